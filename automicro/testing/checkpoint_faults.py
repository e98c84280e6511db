"""`CheckpointFault`: break one checkpoint save at a chosen point, the way a preemption, a dying node
or a full disk does. A Composer callback, usable from YAML::

    callbacks:
      checkpoint_fault: {at: mid_write, batch: 6, ranks: [0]}

`at`:
- `before_write`: SIGKILL before anything of the save is written;
- `mid_write`: SIGKILL with the file half written (full: the temporary `.partial-*` file cut to half
  its length; sharded: this rank's shard file cut, no `.metadata`);
- `before_rename`: SIGKILL with the file whole under its temporary name (sharded: every shard of this
  rank written, `.metadata` not);
- `before_latest`: SIGKILL after every rank agreed the save committed, before Composer moves `latest`;
- `truncate`: after the commit, cut the checkpoint (full: the `.pt`; sharded: this rank's shard) to
  half its length and train on (what a disk that lost the tail leaves);
- `delete_shard`: after the commit, delete this rank's shard file and train on (sharded only);
- `disk_full`: the write raises `OSError(ENOSPC)` on the chosen ranks (what `save_failure` handles).

`batch`: the save at this batch count (the checkpoint `ep0-ba6` is batch 6; None = the first save);
`ranks`: where it happens (None = every rank). A full checkpoint is written by rank 0 alone, so the
write points (`before_write` to `before_rename`, `truncate`, `disk_full`) fire there only. Once per
process.

Owns: the faults' conditions. May not touch: the commit protocol; it listens at its save points
(`automicro.composer.checkpoint_commit.listen`).
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from automicro.composer import checkpoint_commit
# fault -> (the save point it acts at, what it does there)
FAULTS = {
    "before_write": ("before_write", "kill"),
    "mid_write": ("written", "cut_and_kill"),
    "before_rename": ("written", "kill"),
    "before_latest": ("committed", "kill"),
    "truncate": ("committed", "cut"),
    "delete_shard": ("committed", "delete"),
    "disk_full": ("before_write", "enospc"),
}


class CheckpointFault(Callback):
    """Breaks one checkpoint save (a full checkpoint is written by rank 0 alone: its write faults fire there).

    Args:
        at: ``before_write``, ``mid_write``, ``before_rename`` or ``before_latest`` (a SIGKILL of the rank
            there), ``truncate`` or ``delete_shard`` (the committed checkpoint cut, or a shard deleted;
            training goes on) or ``disk_full`` (``OSError(ENOSPC)`` in the write).
        batch: Only the save at this batch count (null: the first save).
        ranks: Only on these ranks (null: every rank).
    """

    def __init__(self, at: str, batch: Optional[int] = None, ranks: Optional[list[int]] = None) -> None:
        if at not in FAULTS:
            raise ValueError(f"checkpoint_fault: at={at!r}: must be one of {', '.join(FAULTS)}")
        if batch is not None and (not isinstance(batch, int) or batch < 1):
            raise ValueError(f"checkpoint_fault: batch={batch!r}: the batch count of a save (a positive int) or null")
        self.at = at
        self.batch = batch
        self.ranks = None if ranks is None else [int(r) for r in ranks]
        self.fired = False
        self._state: Optional[State] = None
        self._undo = checkpoint_commit.listen(self._on_point)

    def init(self, state: State, logger: Logger) -> None:
        self._state = state

    def _on_point(self, point: str, path: str) -> None:
        where, action = FAULTS[self.at]
        if self.fired or point != where or self._state is None:
            return
        if self.ranks is not None and dist.get_global_rank() not in self.ranks:
            return
        if self.batch is not None and int(self._state.timestamp.batch) != self.batch:
            return
        target = self._file(path)
        if action in ("cut", "delete") and not target:
            return  # a rank that wrote nothing in this save
        self.fired = True
        if action == "enospc":
            raise checkpoint_commit.disk_full(path)
        if action in ("cut", "cut_and_kill"):
            with open(target, "r+b") as handle:
                handle.truncate(os.path.getsize(target) // 2)
        if action == "delete":
            if not target.endswith(".distcp"):
                raise ValueError("checkpoint_fault: at='delete_shard' needs a sharded checkpoint (checkpoint_format: sharded)")
            os.remove(target)
        if action in ("kill", "cut_and_kill"):
            os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _file(path: str) -> str:
        """The file a point's path stands for on this rank: a DCP folder (or a shard name in it:
        Composer names every rank's shard after the rank it had at import) means this rank's shard."""
        if path.endswith(".distcp"):
            path = os.path.dirname(path)
        if path and os.path.isdir(path):
            shard = os.path.join(path, f"__{dist.get_global_rank()}_0.distcp")
            return shard if os.path.exists(shard) else ""
        return path if path and os.path.exists(path) else ""

    def close(self, state: State, logger: Logger) -> None:
        self._undo()


__all__ = ["FAULTS", "CheckpointFault"]
