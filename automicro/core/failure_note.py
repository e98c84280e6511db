"""The failure note: the size a run could not recover from, left beside its checkpoints.

When a rank loses the run (an OOM that in-process recovery could not take back), it writes
`automicro_failure.json` into the checkpoint folder: the batch and the split in use. A relaunch
that resumes from that folder (Composer's autoresume, or `load_path` to it) reads the note and
starts below that size with the sync hooks on, instead of failing the same way again.

Owns: the note's file name, format and atomic write, and the rule of when a note applies. May
not touch: Composer (the adapter finds the folder), the policy (the adapter steps it down).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

FILE_NAME = "automicro_failure.json"


@dataclass(frozen=True)
class FailureNote:
    batch: int
    split: tuple[int, ...]
    path: str = ""

    @property
    def size(self) -> int:
        return max(self.split)

    def applies(self, resumed_at_batch: int, size_in_use: int) -> bool:
        """Only a failure at or after the checkpoint resumed from, at the size the run would use
        again or a smaller one, says anything about the relaunch. (The size can shrink between the
        checkpoint and the failure: the relaunch would then start above a size that failed.)"""
        return self.batch >= resumed_at_batch and self.size <= size_in_use


def write(folder: Optional[str], rank: int, batch: int, split: tuple[int, ...]) -> Optional[str]:
    """Write the note (atomically: every rank may write the same one). Remote folders (`s3://`)
    and runs without a checkpoint folder get none; returns the path written."""
    if folder is None or "://" in folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, FILE_NAME)
    temporary = f"{path}.rank{rank}.tmp"
    with open(temporary, "w") as f:
        json.dump({"batch": batch, "size": max(split), "split": list(split)}, f)
    os.replace(temporary, path)
    return path


def read(folder: Optional[str]) -> Optional[FailureNote]:
    """The note in `folder`, or None when there is none."""
    path = None if folder is None else os.path.join(folder, FILE_NAME)
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        note = json.load(f)
    split = tuple(int(s) for s in note.get("split") or [note.get("size", 0)])
    return FailureNote(batch=int(note.get("batch", -1)), split=split, path=path)


__all__ = ["FILE_NAME", "FailureNote", "read", "write"]
