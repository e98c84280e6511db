"""Datasets for language-model training without downloads, and a rank-aware dataloader builder.

Every dataset yields ``{"input_ids": LongTensor[S], "labels": LongTensor[S]}`` where
``labels[t]`` is the token that follows ``input_ids[t]`` (already shifted), the batch format of
:class:`automicro.models.ComposerLlama`.

* :class:`SyntheticTokens`: uniformly random token ids, reproducible per (seed, index).
* :class:`ByteTextCorpus`: byte-level (vocab 256) tokens from local text files; by default the
  Python standard library's own sources (:func:`default_text_paths`), which every machine with
  Python has.

Owns: the datasets and the dataloader builder. May not touch: the trainer, the callback.
"""

from __future__ import annotations

import logging
import operator
import os
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger(__name__)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DEFAULT_MAX_BYTES",
    "DOCUMENT_SEPARATOR",
    "TEXT_SUFFIXES",
    "ByteTextCorpus",
    "DataError",
    "SyntheticTokens",
    "build_dataloader",
    "default_text_paths",
]

BYTE_VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 8_000_000
# Byte placed between concatenated files (NUL: it does not occur in text files).
DOCUMENT_SEPARATOR = 0
# File types picked up when a directory is given to ByteTextCorpus.
TEXT_SUFFIXES = (".py", ".txt", ".md")
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}

PathLike = Union[str, "os.PathLike[str]"]


class DataError(ValueError):
    """A dataset or dataloader cannot be built from the given settings."""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise DataError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_index(index: object, length: int) -> int:
    i = operator.index(index)  # type: ignore[arg-type]
    if i < 0:
        i += length
    if not 0 <= i < length:
        raise IndexError(f"sample index {index} out of range for a dataset of {length} samples")
    return i


class SyntheticTokens(Dataset):
    """`num_samples` sequences of uniformly random token ids in ``[0, vocab_size)``.

    Sample ``i`` is drawn from a generator seeded with ``(seed, i)``, so it is the same whatever
    rank, worker or order asks for it; different seeds give different data.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        self.num_samples = _positive_int("num_samples", num_samples)
        self.seq_len = _positive_int("seq_len", seq_len)
        self.vocab_size = _positive_int("vocab_size", vocab_size)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = _check_index(index, self.num_samples)
        rng = np.random.default_rng([self.seed, i])
        tokens = torch.from_numpy(rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


def _walk_sorted(root: Path, suffixes: Sequence[str], skip_dirs: Iterable[str] = ()) -> list[Path]:
    """Files under `root` with one of `suffixes`, in sorted (deterministic) order."""
    skip = set(skip_dirs)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for filename in sorted(filenames):
            if filename.endswith(tuple(suffixes)):
                found.append(Path(dirpath) / filename)
    return found


def default_text_paths(max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The Python standard library's own ``.py`` files, up to `max_bytes` in total.

    Found under ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages`` and ``test``/``tests``
    directories; sorted by path, so the list (and a corpus built from it) is the same on every call
    and every rank of one installation. Files are taken in order while they fit in `max_bytes`.
    """
    max_bytes = _positive_int("max_bytes", max_bytes)
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the Python standard library directory {root} does not exist; set `data.paths`")
    paths: list[str] = []
    total = 0
    for path in _walk_sorted(root, (".py",), _SKIPPED_STDLIB_DIRS):
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size == 0:
            continue
        if total + size > max_bytes:
            if paths:
                break
            continue  # a single file bigger than the cap: look for a smaller one
        paths.append(str(path))
        total += size
    if not paths:
        raise DataError(f"found no standard-library .py files under {root} within max_bytes={max_bytes}")
    return paths


def _expand_paths(paths: Sequence[PathLike]) -> list[Path]:
    files: list[Path] = []
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            files.extend(_walk_sorted(path, TEXT_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"data path {str(entry)!r} does not exist (or is not a file or directory); fix `data.paths`")
    return files


class ByteTextCorpus(Dataset):
    """Byte-level language-modeling samples from local text files (vocab 256: token = byte value).

    The files are read in order (a directory contributes its ``*.py``, ``*.txt`` and ``*.md`` files
    recursively, sorted), joined with the separator byte ``DOCUMENT_SEPARATOR`` and truncated to
    `max_bytes`. Sample ``i`` is the non-overlapping window
    ``data[i * (seq_len + 1) : (i + 1) * (seq_len + 1)]`` split into ``input_ids = window[:-1]`` and
    ``labels = window[1:]``; a trailing partial window is dropped.

    Args:
        paths: files and/or directories; ``None`` uses :func:`default_text_paths`.
        seq_len: tokens per sample.
        max_bytes: cap on the corpus size in bytes.
    """

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(
        self, paths: Optional[Sequence[PathLike]], seq_len: int, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.seq_len = _positive_int("seq_len", seq_len)
        max_bytes = _positive_int("max_bytes", max_bytes)
        if paths is None:
            paths = default_text_paths(max_bytes)
        elif isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.files = [str(p) for p in _expand_paths(paths)]

        buffer = bytearray()
        for index, file in enumerate(self.files):
            if len(buffer) >= max_bytes:
                break
            if index > 0:
                buffer.append(DOCUMENT_SEPARATOR)
            try:
                with open(file, "rb") as handle:
                    buffer += handle.read(max_bytes - len(buffer))
            except OSError as error:
                raise DataError(f"cannot read data file {file!r} ({error}); fix `data.paths`") from None
        del buffer[max_bytes:]

        window = self.seq_len + 1
        if len(buffer) < window:
            raise DataError(
                f"the text corpus has {len(buffer)} bytes from {len(self.files)} file(s), fewer than one sample "
                f"needs (seq_len + 1 = {window}); add text to `data.paths` or lower seq_len"
            )
        # One uint8 tensor for the whole corpus; samples are views into it.
        self.data = torch.frombuffer(buffer, dtype=torch.uint8)
        self.num_samples = len(buffer) // window
        log.debug("ByteTextCorpus: %d bytes from %d files -> %d samples", len(buffer), len(self.files), self.num_samples)

    @property
    def num_bytes(self) -> int:
        return int(self.data.numel())

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = _check_index(index, self.num_samples)
        window = self.seq_len + 1
        tokens = self.data[i * window : (i + 1) * window].long()
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


def build_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int = 0,
    pin_memory: Optional[bool] = None,
    replicas: Optional[tuple[int, int]] = None,
    collate_fn: Optional[Any] = None,
) -> DataLoader:
    """A DataLoader giving this rank its own shard of `dataset`, `batch_size` samples per batch.

    Sharding is a ``DistributedSampler`` over the world size and global rank (as Composer's
    ``dist.get_sampler``: torch.distributed's where it is initialized, else WORLD_SIZE and RANK from
    the environment, else one rank). Composer's trainer
    calls ``set_epoch`` on it each epoch, so shuffling (seeded by `seed`) changes per epoch.
    `drop_last` applies to both the sampler (equal shards on every rank) and the loader (full
    batches only). `pin_memory` defaults to whether CUDA is available. `replicas`: ``(count,
    index)`` of the data-parallel copies to shard over instead of the world (a pipeline: the
    ranks of one pipeline read the same samples). `collate_fn`: e.g. `pad_collate` for variable
    lengths (None: torch's default, which stacks equal lengths).
    """
    batch_size = _positive_int("batch_size", batch_size)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise DataError(f"num_workers must be a non-negative integer, got {num_workers!r}")
    num_replicas, replica = replicas if replicas is not None else (None, None)
    world, rank = _world_and_rank()
    sampler = DistributedSampler(
        dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
        num_replicas=world if num_replicas is None else num_replicas, rank=rank if replica is None else replica,
    )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
    )
    if len(loader) == 0:
        raise DataError(
            f"the dataloader has no batches: {len(dataset)} samples over {world if num_replicas is None else num_replicas} rank(s) "  # type: ignore[arg-type]
            f"with batch_size={batch_size} per rank; use more data or a smaller batch size"
        )
    return loader


def _world_and_rank() -> tuple[int, int]:
    """The world size and global rank: torch.distributed's once initialized, else WORLD_SIZE and RANK
    (a launcher's), else one rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
