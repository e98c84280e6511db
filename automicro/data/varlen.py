"""Variable-length token data, as fine-tuning data looks: long-tailed lengths, padded batches.

* :class:`VariableLengthTokens`: random token sequences whose lengths follow a log-normal law
  (median `median_len`, clipped to `min_len`..`max_len`), reproducible per (seed, index). A
  sample is ``{"input_ids": LongTensor[n], "labels": LongTensor[n]}`` with labels shifted.
* :func:`pad_collate`: what a Hugging Face padding collator does for causal LM training: pad to
  the batch's longest sample (right side), ``attention_mask`` 1 on real tokens, labels -100 on
  padding.
* :func:`count_tokens`: a Composer `get_num_tokens_in_batch` that counts real tokens ("total")
  and loss-generating ones (labels != -100); Composer's own counts padded positions, which is
  wrong for padded batches, and wrong per microbatch once a batch is re-padded.
  :class:`TokenCounter` (``label_shift=1``) counts them for models that shift the labels
  themselves (transformers' causal LMs): ``labels[:, 1:] != -100``.

Owns: these four. May not touch: the trainer, the callback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from automicro.data.datasets import DataError, _check_index, _positive_int

IGNORE_INDEX = -100


class VariableLengthTokens(Dataset):
    """`num_samples` random sequences with log-normal lengths (see the module docstring)."""

    def __init__(
        self,
        num_samples: int,
        vocab_size: int,
        median_len: int = 64,
        sigma: float = 0.8,
        min_len: int = 8,
        max_len: int = 512,
        seed: int = 0,
    ) -> None:
        self.num_samples = _positive_int("num_samples", num_samples)
        self.vocab_size = _positive_int("vocab_size", vocab_size)
        self.median_len = _positive_int("median_len", median_len)
        self.min_len = _positive_int("min_len", min_len)
        self.max_len = _positive_int("max_len", max_len)
        if self.min_len > self.max_len:
            raise DataError(f"min_len={min_len} > max_len={max_len}")
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or sigma < 0:
            raise DataError(f"sigma must be a number >= 0, got {sigma!r}")
        self.sigma = float(sigma)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def length(self, index: int) -> int:
        rng = np.random.default_rng([self.seed, _check_index(index, self.num_samples), 1])
        drawn = int(round(self.median_len * float(np.exp(self.sigma * rng.standard_normal()))))
        return min(self.max_len, max(self.min_len, drawn))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = self.length(index)
        rng = np.random.default_rng([self.seed, _check_index(index, self.num_samples)])
        tokens = torch.from_numpy(rng.integers(0, self.vocab_size, size=n + 1, dtype=np.int64))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


def pad_collate(samples: Sequence[Mapping[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad to the longest sample (right side); attention mask; labels -100 on padding."""
    if not samples:
        raise DataError("pad_collate: no samples")
    longest = max(int(s["input_ids"].shape[0]) for s in samples)
    ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = int(sample["input_ids"].shape[0])
        ids[row, :n] = sample["input_ids"]
        labels[row, :n] = sample["labels"]
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _count(batch: Any, label_shift: int) -> dict[str, int]:
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise DataError("count_tokens: expected a batch mapping with 'input_ids'")
    mask = batch.get("attention_mask")
    total = int(mask.sum()) if isinstance(mask, torch.Tensor) else int(batch["input_ids"].numel())
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor):
        loss = int((labels[..., label_shift:] != IGNORE_INDEX).sum())
    else:
        loss = max(0, total - label_shift * int(batch["input_ids"].shape[0]))
    return {"total": total, "loss_generating": loss}


def count_tokens(batch: Any) -> dict[str, int]:
    """Composer's `get_num_tokens_in_batch` for padded batches whose labels are already shifted (this
    package's data and models): real tokens, and loss-generating ones (labels != -100)."""
    return _count(batch, 0)


class TokenCounter:
    """A `get_num_tokens_in_batch` that knows where the model shifts its labels: with
    ``label_shift=1`` (the transformers convention: the model predicts ``labels[:, t + 1]`` from
    position ``t``), the first label of each row never makes a loss, so the loss tokens are
    ``labels[:, 1:] != -100``; with 0 (labels already shifted), ``labels != -100``."""

    def __init__(self, label_shift: int) -> None:
        if label_shift not in (0, 1):
            raise DataError(f"label_shift={label_shift!r}: must be 0 (labels already shifted) or 1 (the model shifts them)")
        self.label_shift = label_shift

    def __call__(self, batch: Any) -> dict[str, int]:
        return _count(batch, self.label_shift)

    def __repr__(self) -> str:
        return f"TokenCounter(label_shift={self.label_shift})"


__all__ = ["IGNORE_INDEX", "TokenCounter", "VariableLengthTokens", "count_tokens", "pad_collate"]
