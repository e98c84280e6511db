"""Cutting a padded token batch into microbatches by sample indices, each re-padded to its own
longest sample (the torch side of `automicro.core.token_packing`).

A batch is a mapping (Hugging Face style: ``input_ids``, ``attention_mask``, ``labels``, ...) of
tensors whose first dimension is the sample and, for the per-token keys, whose second dimension
is the padded sequence. A sample's length is its attention mask's sum (all of ``input_ids``'
width when there is no mask). Padding may be on the right (training collators) or the left
(``tokenizer.padding_side = "left"``): a microbatch keeps the last `L` positions or the first,
where `L` is its longest sample. Keys whose second dimension is not the sequence's are cut by
sample only; lists are cut by sample.

`select_packed` packs the samples instead (``packing: true``): one row of their real tokens end to
end, ``position_ids`` restarting at each sample (a sample that comes with ``position_ids`` keeps
its own: a row that already packs several documents stays as it is), no ``attention_mask`` (the
model keeps attention within each sample from the position ids), and, for a model that shifts its
labels, each sample's first label -100 (it would be predicted from the sample before). Every
per-token key is packed alike; `unpackable_key` names a key that cannot be (per-sample values).

Owns: lengths, index selection and re-padding or packing of a batch. May not touch: the policy, the
consensus, Composer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from automicro.data.varlen import IGNORE_INDEX

SEQUENCE_KEY = "input_ids"
MASK_KEY = "attention_mask"
LABELS_KEY = "labels"
POSITIONS_KEY = "position_ids"


class TokenBatchError(TypeError):
    """A batch the token budget cannot cut (says what shape it needs)."""


def _check(batch: Any) -> tuple[torch.Tensor, int]:
    if not isinstance(batch, Mapping) or not isinstance(batch.get(SEQUENCE_KEY), torch.Tensor):
        raise TokenBatchError(
            "automicro: budget='tokens' needs batches as a mapping with an 'input_ids' tensor [samples, sequence] "
            "(Hugging Face style, optionally 'attention_mask' and 'labels'); got "
            f"{type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''}. "
            "Use budget='samples' for other batches"
        )
    ids = batch[SEQUENCE_KEY]
    if ids.dim() != 2:
        raise TokenBatchError(f"automicro: budget='tokens': 'input_ids' must be [samples, sequence], got shape {tuple(ids.shape)}")
    return ids, int(ids.shape[1])


def sample_lengths(batch: Any) -> list[int]:
    """Real tokens per sample: the attention mask's sum, else the padded width."""
    ids, width = _check(batch)
    mask = batch.get(MASK_KEY)
    if isinstance(mask, torch.Tensor):
        if tuple(mask.shape) != tuple(ids.shape):
            raise TokenBatchError(
                f"automicro: budget='tokens': 'attention_mask' {tuple(mask.shape)} must have the shape of 'input_ids' "
                f"{tuple(ids.shape)}"
            )
        return [int(n) for n in mask.sum(dim=1).tolist()]
    return [width] * int(ids.shape[0])


def _left_padded(batch: Mapping[str, Any]) -> bool:
    mask = batch.get(MASK_KEY)
    if not isinstance(mask, torch.Tensor) or mask.shape[1] == 0:
        return False
    # Right padding leaves the first column all ones; left padding the last.
    return bool(mask[:, -1].all()) and not bool(mask[:, 0].all())


def _take(value: Any, index: torch.Tensor, keep: slice, width: int, indices: Sequence[int]) -> Any:
    if isinstance(value, torch.Tensor):
        picked = value.index_select(0, index.to(value.device))
        if picked.dim() >= 2 and picked.shape[1] == width:
            picked = picked[:, keep]
        return picked.contiguous()
    if isinstance(value, (list, tuple)):
        return type(value)(value[i] for i in indices)
    return value


def select(
    batch: Mapping[str, Any], indices: Sequence[int], lengths: Sequence[int], mask_first_label: bool = False
) -> dict[str, Any]:
    """The samples `indices` of `batch`, re-padded to their longest (lengths from `sample_lengths`).
    `mask_first_label`: on a left-padded batch, the label of each row's first real token becomes
    -100 (`left_padded_first_labels`)."""
    _, width = _check(batch)
    longest = max((lengths[i] for i in indices), default=0)
    longest = max(longest, 1)
    left = _left_padded(batch)
    keep = slice(width - longest, width) if left else slice(0, longest)
    index = torch.tensor(list(indices), dtype=torch.long)
    part = {key: _take(value, index, keep, width, indices) for key, value in batch.items()}
    labels = part.get(LABELS_KEY)
    if mask_first_label and left and isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape[1] == longest:
        labels = labels.clone()
        for row, i in enumerate(indices):
            if 0 < lengths[i] < longest:
                labels[row, longest - lengths[i]] = IGNORE_INDEX
        part[LABELS_KEY] = labels
    return part


def left_padded_first_labels(batch: Mapping[str, Any], lengths: Sequence[int]) -> bool:
    """Whether `batch` is left-padded with a loss label on a padded row's first real token. A model
    that shifts its labels (transformers' causal LMs) predicts that token from a padding position,
    whose output changes with the padding width, so the loss would change with the split (each
    microbatch is re-padded to its own longest): `select(mask_first_label=True)` masks it."""
    labels = batch.get(LABELS_KEY) if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or not _left_padded(batch):
        return False
    width = int(labels.shape[1])
    return any(0 < n < width and int(labels[row, width - n]) != IGNORE_INDEX for row, n in enumerate(lengths))


def split_by_groups(
    batch: Mapping[str, Any], groups: Sequence[Sequence[int]], lengths: Sequence[int], mask_first_label: bool = False
) -> list[dict[str, Any]]:
    return [select(batch, group, lengths, mask_first_label) for group in groups]


def unpackable_key(batch: Mapping[str, Any]) -> Optional[str]:
    """The first key whose value cannot be packed into one row (not a per-token tensor
    [samples, sequence, ...] of the batch's shape), or None."""
    ids, width = _check(batch)
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != (ids.shape[0], width):
            return key
    return None


def select_packed(
    batch: Mapping[str, Any], indices: Sequence[int], lengths: Sequence[int], mask_first_label: bool
) -> dict[str, Any]:
    """The samples `indices` of `batch` packed into one row (see the module docstring).
    `mask_first_label`: the model shifts its labels (each sample's first label becomes -100)."""
    _, width = _check(batch)
    left = _left_padded(batch)
    spans = [(width - lengths[i], width) if left else (0, lengths[i]) for i in indices]
    part: dict[str, Any] = {}
    for key, value in batch.items():
        if key == MASK_KEY:
            continue
        part[key] = torch.cat([value[i, a:b] for i, (a, b) in zip(indices, spans)], dim=0).unsqueeze(0).contiguous()
    if POSITIONS_KEY not in part:
        ids = batch[SEQUENCE_KEY]
        part[POSITIONS_KEY] = torch.cat([torch.arange(b - a, device=ids.device) for a, b in spans]).unsqueeze(0)
    labels = part.get(LABELS_KEY)
    if mask_first_label and isinstance(labels, torch.Tensor):
        labels = labels.clone()
        at = 0
        for a, b in spans:
            if b > a:
                labels[0, at] = IGNORE_INDEX
            at += b - a
        part[LABELS_KEY] = labels
    return part


def pack_by_groups(
    batch: Mapping[str, Any], groups: Sequence[Sequence[int]], lengths: Sequence[int], mask_first_label: bool
) -> list[dict[str, Any]]:
    return [select_packed(batch, sorted(group), lengths, mask_first_label) for group in groups]


__all__ = [
    "TokenBatchError", "left_padded_first_labels", "pack_by_groups", "sample_lengths", "select", "select_packed",
    "split_by_groups", "unpackable_key",
]
