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

Owns: the choice of normalisation and the label shift (Composer's side, the train data spec's
token counter and the line that says both: `automicro.composer.loss_counting`; a plain loop's:
`automicro.batch.torch_host`). May not touch: the search, FSDP2, the loss itself, any training
framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

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

    def resolve_shift(self, model: Any) -> int:
        if self.label_shift != "auto":
            return int(self.label_shift)
        declared = getattr(model, "label_shift", None)
        return declared if declared in (0, 1) and not isinstance(declared, bool) else 1


__all__ = ["LABEL_SHIFTS", "NORMALIZATIONS", "LossNormalization"]
