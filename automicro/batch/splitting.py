"""Split a batch into microbatches of given sizes (the even split of the chosen size).

Owns: splitting a batch by sizes. May not touch: Composer's split (the adapter falls back to it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class UnsplittableBatch(TypeError):
    pass


def _split_tensor(t: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(t, list(sizes), dim=0))


def _split_list(items: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    out, start = [], 0
    for size in sizes:
        out.append(list(items[start : start + size]))
        start += size
    return out


def _split_item(item: Any, sizes: Sequence[int]) -> list[Any]:
    if isinstance(item, torch.Tensor):
        return _split_tensor(item, sizes)
    if isinstance(item, (list, tuple)):
        return _split_list(item, sizes)
    raise UnsplittableBatch(f"cannot split a batch element of type {type(item).__name__}")


def split_by_sizes(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Microbatches of exactly `sizes` samples, for the batch layouts Composer's default split
    understands (a tensor, a mapping of tensors/lists, or a tuple/list with the batch on the
    second level). Raises `UnsplittableBatch` for anything else."""
    if isinstance(batch, torch.Tensor):
        return _split_tensor(batch, sizes)
    if isinstance(batch, Mapping):
        parts = {k: _split_item(v, sizes) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(len(sizes))]
    if isinstance(batch, (tuple, list)):
        columns = [_split_item(item, sizes) for item in batch]
        return [type(batch)(col[i] for col in columns) for i in range(len(sizes))]
    raise UnsplittableBatch(f"cannot split a batch of type {type(batch).__name__}")
