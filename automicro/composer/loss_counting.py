"""Composer's side of `loss_normalization` (`automicro.batch.loss_normalization`): the Trainer's
``accumulate_train_batch_on_tokens`` and the train data spec's token counter, set once the Trainer
is built, and the line that says which.

Owns: those two Trainer settings. May not touch: the search, FSDP2, the loss itself; Composer
privates outside `_composer_internals`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from automicro.batch.loss_normalization import LossNormalization
from automicro.composer import _composer_internals as composer_internals


def apply(norm: LossNormalization, trainer: Any, info: Callable[[str], None], accumulate_on_tokens: Optional[bool] = None) -> int:
    """On every rank once Composer's Trainer is built. `accumulate_on_tokens`: the Trainer's
    ``accumulate_train_batch_on_tokens`` where the user passed it (None: not passed). Returns
    the label shift resolved for the model."""
    per = norm.per
    norm.shift = norm.resolve_shift(trainer.state.model)
    if accumulate_on_tokens is not None:
        asked = "tokens" if accumulate_on_tokens else "samples"
        if norm.explicit and asked != per:
            raise ValueError(
                f"AutoMicrobatching(loss_normalization={per!r}) and accumulate_train_batch_on_tokens="
                f"{accumulate_on_tokens} disagree: drop one of them (loss_normalization decides when the Trainer "
                "argument is left out)"
            )
        per = asked
    norm.resolved = per
    if per == "samples":
        trainer.accumulate_train_batch_on_tokens = False
        info(
            "loss per sample (loss_normalization: samples): each microbatch's mean loss is weighted by its samples, "
            "so the result depends on the split, which follows the memory; loss_normalization: tokens does not"
        )
    elif per == "tokens":
        trainer.accumulate_train_batch_on_tokens = True
        ensure_counter(norm, trainer, info)
    return norm.shift

def ensure_counter(norm: LossNormalization, trainer: Any, info: Callable[[str], None]) -> None:
    """Per loss token: the train data spec counts loss tokens with the shift (Composer's or
    automicro's own counter replaced, the user's kept), said once. Called at `apply` and before
    every training batch (a train dataloader passed to `fit()` comes after `apply`); once in
    place, a check of one attribute."""
    if norm.resolved != "tokens":
        return
    counter = composer_internals.current_token_counter(trainer)
    if counter is None or counter is norm._checked:
        return
    if composer_internals.token_counter(trainer) == "own":
        how = "your data spec's get_num_tokens_in_batch counts the loss tokens"
    else:
        from automicro.data import TokenCounter

        counter = TokenCounter(norm.shift)
        composer_internals.set_token_counter(trainer, counter)
        how = ("labels[:, 1:] != -100: the model shifts its labels" if norm.shift else
               "labels != -100: the labels come shifted") + f", label_shift: {norm.label_shift}"
    norm._checked = counter
    if not norm._said:
        norm._said = True
        info(f"loss per loss token over the whole batch (loss_normalization: tokens; {how}): training does not depend on the split")


__all__ = ["apply", "ensure_counter"]
