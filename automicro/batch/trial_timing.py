"""The timing the trials share: a batch's wall time with the device synchronized at both ends, and
the slowest rank's time of each batch (one consensus round on every rank at the same batch).

Owns: the clock and the agreement of batch times. May not touch: what a trial decides.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from automicro.core.consensus import SLOTS
from automicro.core.layout import TrialResult, judge


class BatchClock:
    """`start()` before a batch, `stop()` after it: its seconds, the device's queued work included
    (0.0 where the batch was not started on the clock)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._started: Optional[float] = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._started = time.perf_counter()

    def stop(self) -> float:
        if self._started is None:
            return 0.0
        self._sync()
        seconds, self._started = time.perf_counter() - self._started, None
        return seconds


def timed_arm(state: str) -> Optional[str]:
    """The arm a trial's state ``timing_ARM`` times, or None."""
    return state[len("timing_"):] if state.startswith("timing_") else None


def agreed_times(consensus: Any, times: Sequence[float]) -> list[float]:
    """The slowest rank's time of each batch: every rank calls it at the same batch with as many times."""
    local = [int(round(s * 1e6)) for s in times]
    agreed: list[int] = []
    for start in range(0, len(local), SLOTS):  # a round carries at most SLOTS ints per rank
        agreed.extend(consensus.agree_max(local[start : start + SLOTS]))
    return [us / 1e6 for us in agreed]


EARLY_BATCHES = 2  # batches a side that decide a trial where its spread is tiny
TINY = 0.25  # tiny: an arm's spread under this share of the gain a trial must show (its ``min_gain``)
# A two-arm trial that would keep its trade on a gain under CONCLUSIVE x its spread (the larger median absolute
# deviation of its arms) runs on, up to EXTEND x its batches a side, before it is judged: on one H200 two processes of
# one configuration differ by 1-5% a batch, and of the trades kept on 3 batches a side, half won under 3x their spread
# (+1.1-2.9%, one +8.5%), the kept configuration then no faster than `trials: false` in another process.
CONCLUSIVE = 3.0
EXTEND = 2


def enough(consensus: Any, arms: Sequence[Sequence[float]], batches: int, min_gain: float, extend: bool = False) -> bool:
    """Whether the arms' times can be judged: `batches` each, or `EARLY_BATCHES` each where every arm's spread
    (half the gap of its two agreed times) is under `TINY` x `min_gain` of its median: a third batch a side could
    not move a median across the rule. With `extend` (two arms: the trade's, then the one without), a trade the
    rule would keep on a gain under `CONCLUSIVE` x its spread runs on in pairs, up to `EXTEND` x `batches` a side.
    Every rank calls it at the same batch with as many times (one consensus round per arm where it judges early or
    looks at an extension)."""
    counts = [len(arm) for arm in arms]
    if min(counts) >= batches:
        if not extend or len(arms) != 2 or min(counts) >= EXTEND * batches:
            return True
        if counts[0] != counts[1]:
            return False  # an extension's pair half run
        on, off = agreed_times(consensus, arms[0]), agreed_times(consensus, arms[1])
        result = judge("trial", on, off, min_gain)
        return not (result.kept and result.median_off - result.median_on < CONCLUSIVE * result.spread)
    if batches <= EARLY_BATCHES or any(count != EARLY_BATCHES for count in counts):
        return False
    for arm in arms:
        agreed = agreed_times(consensus, arm)
        if abs(agreed[0] - agreed[1]) / 2 > TINY * min_gain * statistics.median(agreed):
            return False
    return True


def judged(consensus: Any, trade: str, on: Sequence[float], off: Sequence[float], min_gain: float,
           on_label: str, off_label: str) -> tuple[TrialResult, str, tuple[list[float], list[float]]]:
    """A two-arm trial's verdict: each arm's batch times agreed (the slowest rank's), `trade` (the "on"
    arm) judged against the other (`automicro.core.layout.judge`), the words that say both medians, and the
    agreed times of each arm."""
    on, off = agreed_times(consensus, on), agreed_times(consensus, off)
    result = judge(trade, on, off, min_gain)
    median_on, median_off = statistics.median(on), statistics.median(off)
    return result, (
        f"median batch {median_on:.4f} s {on_label}, {median_off:.4f} s {off_label} "
        f"({100.0 * (1.0 - median_on / median_off):+.1f}%; spread {result.spread:.4f} s)"
    ), (on, off)


__all__ = ["BatchClock", "CONCLUSIVE", "EARLY_BATCHES", "EXTEND", "TINY", "agreed_times", "enough", "judged", "timed_arm"]
