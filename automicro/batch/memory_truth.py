"""What the allocator says against what `auto` planned (docs/guides/one-gpu.md, Memory, DESIGN.md "Memory truth"):
the capacity line on the console, the bytes an OOM reached, what a failed attempt left behind.

`AutoMicrobatching` hands each attempt's agreed verdict here; the policy gets the reached bytes as
part of its `OOM` outcome. Owns: the console lines about capacity and memory left behind, and the
`left_behind_bytes` figure. May not touch: the policy's state, Composer, torch internals.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from automicro.core.consensus import KIND_OOM, Verdict
from automicro.core.memory import CapacityWatch, MemorySource

log = logging.getLogger(__name__)

#: A failed attempt may leave this share of what was allocated before it (and 1 MiB) without a line:
#: a collective's buffer freed a moment later, a library's first workspace.
LEFT_BEHIND_TOLERANCE = 0.01


def reached_bytes(verdict: Verdict) -> Optional[int]:
    """The least peak a rank that ran out of memory had reached (its report leaves out what is
    projected, `LocalFigures.reached`); None where no failed rank measured one."""
    reached = [r.peak_bytes for r in verdict.reports if r.kind == KIND_OOM and r.peak_bytes > 0]
    return min(reached) if reached else None


class MemoryTruth:
    """One rank's view: `after_attempt` for every attempt's verdict, `after_failure` once a failed
    attempt's wipe is done, `layout_undone` and `after_rerun` around the rerun of a batch whose
    layout trade was undone for memory."""

    def __init__(self, memory: Callable[[], MemorySource], rank: Callable[[], int], say: bool) -> None:
        self._memory, self._rank, self._say = memory, rank, say
        self._watch = CapacityWatch()
        self.left_behind_bytes = 0  # the most a failed attempt left allocated after its wipe
        # Failed attempts whose wipe was checked, by kind ("train", "eval"): what the figure covers.
        self.checked: dict[str, int] = {}
        # The most any checked wipe left, below the tolerance too (exact where the source counts
        # live tensor bytes, as `automicro.testing.MemoryCap` does): what tests assert on.
        self.left_behind_exact = 0
        self._undone: Optional[tuple[str, int, int, int]] = None  # (trade, size, batch, allocated then)

    def layout_undone(self, trade: str, size: int, batch_index: int) -> None:
        """A layout trade (on trial, or kept) was undone for memory in a batch at the size found
        `size`; the batch reruns there without it (`after_rerun` says how that went)."""
        self._undone = (trade, size, batch_index, self._memory().allocated_bytes())

    def after_rerun(self, failed: bool, size: int) -> None:
        """The attempt after `layout_undone`. Running out again at the size found, which ran clean
        before the trade, is an error-level line: the trade was not what held the memory (memory a
        trial left behind, another process, fragmentation), and the size policy acts next."""
        if self._undone is None:
            return
        trade, at, batch, allocated = self._undone
        self._undone = None
        if not failed or size != at:
            return
        now = self._memory().allocated_bytes()
        self._line(
            f"microbatch size {at} runs out again in batch {batch} with layout trade {trade} undone: the trade was not "
            f"what held the memory ({now / 2**20:.1f} MiB allocated on rank {self._rank()} after the wipe, "
            f"{allocated / 2**20:.1f} MiB when it was undone); the size policy decides next",
            self._rank() == 0, logging.ERROR,
        )

    def after_attempt(self, verdict: Verdict) -> None:
        """One line for the first capacity agreed, one whenever it moves (`CapacityWatch`): on the
        rank whose reading is the least, which knows why."""
        least = min((r for r in verdict.reports if r.capacity_bytes > 0), key=lambda r: r.capacity_bytes, default=None)
        if least is None:
            return
        ours = least.rank == self._rank()
        reading: Any = getattr(self._memory(), "capacity_reading", None)
        line = self._watch.observe(verdict.capacity_bytes, reading if ours and callable(reading) else None)
        if line is None:
            return
        if len(verdict.reports) > 1:
            line += f" (the least over ranks: rank {least.rank}'s)"
        self._line(line, ours, logging.INFO)

    def after_failure(self, left_behind: Optional[tuple[int, int]], what: str, kind: str = "train") -> None:
        """`left_behind`: (allocated before the attempt, after its wipe), `BatchStep.left_behind` or
        the eval fence's; `what` names the attempt in the line ("batch 7", "eval 'lm' batch 2").
        Nothing may be left (DESIGN.md); more than the tolerance is said on the rank it happened on."""
        if left_behind is None:
            return
        self.checked[kind] = self.checked.get(kind, 0) + 1
        before, after = left_behind
        extra = after - before
        self.left_behind_exact = max(self.left_behind_exact, extra)
        if extra <= max(2**20, LEFT_BEHIND_TOLERANCE * before):
            return
        self.left_behind_bytes = max(self.left_behind_bytes, extra)
        self._line(
            f"rank {self._rank()}: the failed attempt of {what} left {extra / 2**20:.1f} MiB allocated "
            f"after its wipe ({before / 2**20:.1f} MiB before it, {after / 2**20:.1f} MiB after): memory no batch uses",
            True, logging.WARNING,
        )

    def _line(self, line: str, print_here: bool, level: int) -> None:
        log.log(level, "automicro: %s", line)
        if print_here and self._say:
            print(f"[automicro] {line}", flush=True)


__all__ = ["LEFT_BEHIND_TOLERANCE", "MemoryTruth", "reached_bytes"]
