"""Flattened batches: every sample of the batch end to end in one row, as the Hugging Face
`DataCollatorWithFlattening` makes them (``input_ids``, ``labels`` and ``position_ids`` of shape
``[1, T]``, ``position_ids`` restarting at 0 where each sample starts; no padding).

Such a batch has one row, so a split by rows cannot cut it. Its samples are the runs between the
restarts: a microbatch of k samples is the row's columns from the start of one sample to the start
of the sample k later, a flattened row itself (the model keeps attention within each sample from the
``position_ids``, as it does for the whole row). Only tensors of the row's shape are cut; the
flash-attention extras the collator can add (``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``)
describe the whole row and are refused with what to change.

Owns: recognising a flattened batch, counting its samples, cutting it at sample starts.
May not touch: the search, the loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

WHOLE_ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class FlattenedBatchError(ValueError):
    """A flattened batch automicro cannot cut (the message says what to change)."""


def restarts(batch: Any) -> Optional[list[int]]:
    """Where ``position_ids`` restarts at 0, for a mapping whose ``position_ids`` is one row that
    restarts more than once with ``input_ids`` of the same shape; else None. One read of the row
    (a sync on a GPU): callers keep it for the batch (`sample_starts(batch, restarts)`)."""
    if not isinstance(batch, Mapping):
        return None
    positions, ids = batch.get("position_ids"), batch.get("input_ids")
    if not isinstance(positions, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return None
    if positions.dim() != 2 or positions.shape[0] != 1 or tuple(ids.shape) != tuple(positions.shape):
        return None
    found = torch.nonzero(positions[0] == 0).flatten().tolist()
    return found if len(found) > 1 else None


def is_flattened(batch: Any) -> bool:
    return restarts(batch) is not None


def sample_starts(batch: Mapping[str, Any], found: Optional[list[int]] = None) -> list[int]:
    """The column where each sample starts, and the row's length last (`found`: the batch's
    `restarts`, when the caller has them)."""
    starts = restarts(batch) if found is None else found
    if not starts or starts[0] != 0:
        raise FlattenedBatchError("automicro: a flattened batch's position_ids must start at 0 (the first sample's start)")
    return starts + [int(batch["position_ids"].shape[1])]


def count(batch: Mapping[str, Any], found: Optional[list[int]] = None) -> int:
    return len(sample_starts(batch, found)) - 1


def split(batch: Mapping[str, Any], sizes: tuple[int, ...], found: Optional[list[int]] = None) -> list[dict[str, Any]]:
    """`batch` cut into flattened rows of `sizes` samples each, in order (`found`: its `restarts`)."""
    extras = [k for k in WHOLE_ROW_KEYS if k in batch]
    if extras:
        raise FlattenedBatchError(
            f"automicro: the flattened batch carries {extras}, which describe the whole row and cannot be cut; "
            "build DataCollatorWithFlattening without return_flash_attn_kwargs / return_seq_idx (the model finds "
            "the samples from position_ids)"
        )
    starts = sample_starts(batch, found)
    if sum(sizes) != len(starts) - 1:
        raise FlattenedBatchError(f"automicro: a split of {sum(sizes)} samples for a flattened batch of {len(starts) - 1}")
    width = int(batch["position_ids"].shape[1])
    out, first = [], 0
    for size in sizes:
        lo, hi = starts[first], starts[first + size]
        out.append({k: (v[:, lo:hi] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == width else v)
                    for k, v in batch.items()})
        first += size
    return out


__all__ = ["FlattenedBatchError", "count", "is_flattened", "restarts", "split"]
