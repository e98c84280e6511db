"""How a batch's loss is normalised over its microbatches: per loss token over the whole batch, so
that training does not depend on the split (the default under `budget: tokens`), or per sample.

Composer scales each microbatch's loss by its share of the batch: its samples by default, its
loss-generating tokens with ``accumulate_train_batch_on_tokens=True``. A causal LM's loss is a
mean over its microbatch's loss tokens, so per-sample weights make the gradient depend on how the
batch was cut; per-token weights make it the mean over every loss token of the batch on every
rank, the same whatever the split. Under `budget: tokens` the split follows the memory, so a
per-sample result would depend on the GPU: this room turns per-token accumulation on by default,
with a token counter that knows where the model shifts its labels:

- ``label_shift: auto`` (default): 0 for models that say their labels come shifted (a
  ``label_shift`` attribute on the model: `automicro.models`' own say 0), 1 for every other model
  (transformers' causal LMs and llm-foundry's shift inside the model: the first label of a row
  never makes a loss, so the count is ``labels[:, 1:] != -100``);
- ``label_shift: 0`` or ``1`` pins it.

A data spec with its own ``get_num_tokens_in_batch`` keeps it (the user's counter knows the data);
Composer's default counter (padded ``input_ids``: wrong once a microbatch is re-padded) and
automicro's own `count_tokens` are replaced by `automicro.data.TokenCounter` with the shift.

Owns: the choice of normalisation, the train data spec's token counter, the line that says both.
May not touch: the search, FSDP2, the loss itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from automicro.integration import _composer_internals as composer_internals

NORMALIZATIONS = ("tokens", "samples")
LABEL_SHIFTS = ("auto", 0, 1)


@dataclass
class LossNormalization:
    """`per`: "tokens", "samples", or None (Composer's own choice is left alone: budget samples
    with nothing set). `label_shift`: "auto", 0 or 1. What `apply` resolved: `resolved`, `shift`."""

    per: Optional[str]
    label_shift: Union[str, int]
    explicit: bool  # the user set loss_normalization (a Trainer argument that disagrees is refused)
    resolved: Optional[str] = None
    shift: int = 1
    _checked: Any = None  # the counter `ensure_counter` last saw in place: nothing to do while it is
    _said: bool = False

    @classmethod
    def parse(cls, loss_normalization: Optional[str], label_shift: Union[str, int], budget: str) -> "LossNormalization":
        if loss_normalization is not None and loss_normalization not in NORMALIZATIONS:
            raise ValueError(
                f"loss_normalization={loss_normalization!r}: must be 'tokens' (the loss per loss token over the whole "
                "batch: training does not depend on the split; the default with budget: tokens) or 'samples' "
                "(Composer's default: each microbatch's mean loss weighted by its samples)"
            )
        if isinstance(label_shift, bool) or label_shift not in LABEL_SHIFTS:
            raise ValueError(
                f"label_shift={label_shift!r}: must be 'auto' (0 for models whose labels come shifted, 1 otherwise), "
                "1 (the model shifts the labels itself, as transformers' causal LMs do) or 0 (labels already shifted)"
            )
        per = loss_normalization if loss_normalization is not None else ("tokens" if budget == "tokens" else None)
        return cls(per=per, label_shift=label_shift, explicit=loss_normalization is not None)

    def apply(self, trainer: Any, info: Callable[[str], None], accumulate_on_tokens: Optional[bool] = None) -> int:
        """On every rank once Composer's Trainer is built. `accumulate_on_tokens`: the Trainer's
        ``accumulate_train_batch_on_tokens`` where the user passed it (None: not passed). Returns
        the label shift resolved for the model."""
        per = self.per
        self.shift = self.resolve_shift(trainer.state.model)
        if accumulate_on_tokens is not None:
            asked = "tokens" if accumulate_on_tokens else "samples"
            if self.explicit and asked != per:
                raise ValueError(
                    f"AutoMicrobatching(loss_normalization={per!r}) and accumulate_train_batch_on_tokens="
                    f"{accumulate_on_tokens} disagree: drop one of them (loss_normalization decides when the Trainer "
                    "argument is left out)"
                )
            per = asked
        self.resolved = per
        if per == "samples":
            trainer.accumulate_train_batch_on_tokens = False
            info(
                "loss per sample (loss_normalization: samples): each microbatch's mean loss is weighted by its samples, "
                "so the result depends on the split, which follows the memory; loss_normalization: tokens does not"
            )
        elif per == "tokens":
            trainer.accumulate_train_batch_on_tokens = True
            self.ensure_counter(trainer, info)
        return self.shift

    def ensure_counter(self, trainer: Any, info: Callable[[str], None]) -> None:
        """Per loss token: the train data spec counts loss tokens with the shift (Composer's or
        automicro's own counter replaced, the user's kept), said once. Called at `apply` and before
        every training batch (a train dataloader passed to `fit()` comes after `apply`); once in
        place, a check of one attribute."""
        if self.resolved != "tokens":
            return
        counter = composer_internals.current_token_counter(trainer)
        if counter is None or counter is self._checked:
            return
        if composer_internals.token_counter(trainer) == "own":
            how = "your data spec's get_num_tokens_in_batch counts the loss tokens"
        else:
            from automicro.data import TokenCounter

            counter = TokenCounter(self.shift)
            composer_internals.set_token_counter(trainer, counter)
            how = ("labels[:, 1:] != -100: the model shifts its labels" if self.shift else
                   "labels != -100: the labels come shifted") + f", label_shift: {self.label_shift}"
        self._checked = counter
        if not self._said:
            self._said = True
            info(f"loss per loss token over the whole batch (loss_normalization: tokens; {how}): training does not depend on the split")

    def resolve_shift(self, model: Any) -> int:
        if self.label_shift != "auto":
            return int(self.label_shift)
        declared = getattr(model, "label_shift", None)
        return declared if declared in (0, 1) and not isinstance(declared, bool) else 1


__all__ = ["LABEL_SHIFTS", "NORMALIZATIONS", "LossNormalization"]
