"""The thrash rule, measured: where allocator retries in consecutive batches shrank the size, the batches that
retried are timed against the size the search settles on below, and the faster is kept.

Composer's rule (`automicro.core.thrash`) counts `thrash_batches` consecutive batches with new allocator retries as an
OOM at their size: the search goes below it. Retries cost time (the caching allocator frees its cache and tries
again), but so does a smaller microbatch, and the rule never asks which costs more: on Qwen3-MoE's blocks on one H100
(32 x 4,096 a rank, selective recompute) a thrash at 2 in the settling shrank the run to 1 for good, 4.1 -> 6.0 s a
batch (`benchmarks/RESULTS.md`, 2026-12-07, routed models as sized).

The thrash still shrinks the size (the batches after it must not run out of memory), and its own batches are the
retrying size's arm (each at the size found, or the batch the search converged in, where it ran that size's split).
Once the search has settled below, the first batches there are the other arm: each trained in one attempt, none a
trial's or the batch profile's, none the first at its split or one that compiled a graph on any rank, the sync hooks
as the retrying batches had them or off (off only makes the size below faster: the comparison errs toward the rule).
The trial plan gives no trial a batch meanwhile (`holding`). Times are the plan's clock (start to start,
`automicro.batch.trial_plan`), the slowest rank's per batch (one consensus round), judged by the layout trials' rule
(`automicro.core.layout.judge`: the median faster by more than `min_gain` and the larger spread). Where the retrying
batches were faster, the size found goes back up (`policy.Retried`) and the retries there are accepted while it stays
the size found (`accepts`): no thrash is counted at it again; an OOM there still goes through the one-off rule, so a
size that does run out still shrinks. Else the size below stays, as the rule had it.

Where the size below retries too, before it gives its arm (a thrash there: the same H100 run, a thrash at 6 with full
recompute, then at 4, 3 and 2 as each new size's allocator pool settled, the run ended at 2, 3.4 s a batch against
2.2 s at 6), the retries came with the run, not with the size: that thrash's retrying batches fit to time (the first at
a split never is) are the other arm, and the faster of the two retrying sizes is judged. They ran with the sync hooks
on where the thrash turned them on (0.2-3.7% of a batch on 2 H200s, `docs/design.md`): the error is toward the larger
size, at most that much. The search meanwhile shrinks as the rule has it; where the larger size loses, the size below
stays (that thrash is not timed apart).

Not timed (the rule's shrink stands; where the timing had started, a line says why it stopped): a thrash while the
size is searched, at the floor (the policy stays there), over tokens (a token budget's batches differ in their work),
Composer's `halve` search; the timing stops where the capacity read moves, the search goes above the size that
retried (memory came back), another thrash comes first with no batch fit to time (that one is timed instead) or undoes
a trade, or `WAIT_BATCHES` batches pass without the batches it needs (the trials it holds off then run).

Owns: the two arms, their judgement and the size whose retries are accepted. May not touch: the policy's state (it
returns the outcome to observe), torch (the times come from the plan, their agreement from the consensus).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from automicro.batch.trial_timing import agreed_times
from automicro.core.layout import judge
from automicro.core.policy import Retried, capacity_moved

KEPT = 64  # batches whose records are kept (the arms are the last few)
# Batches after the thrash within which the size below must have given its arm (a settling's few, its steady ones):
# past them the timing stops, and the trials it holds off get their batches (each batch there compiling a graph, say).
WAIT_BATCHES = 16


@dataclass(frozen=True)
class _Batch:
    found: Optional[int]  # the size found while it trained (None: searching)
    split: tuple[int, ...]
    hooks: bool
    clean: bool  # one attempt, not a trial's or the profile's batch


@dataclass(frozen=True)
class _Pending:
    size: int  # the size found that retried
    bound: Optional[int]  # the policy's failure bound before the thrash
    batches: tuple[int, ...]  # the retrying batches
    hooks: bool  # the sync hooks were on in them
    capacity: int  # the capacity read at the thrash
    at: int  # the thrash's batch
    largest: int  # the retrying batches' largest microbatch
    # Where the size below retried too (a thrash there while this one waits): its retrying batches fit to time, and
    # that size. They are the other arm until the size the search settles on gives its own.
    retried: tuple[int, ...] = ()
    retried_size: int = 0


class ThrashTiming:
    """Told of every batch that trained (`after_batch`), of each thrash before the policy shrinks (`thrash`), and
    asked after each batch whether the timing decides (`decide`)."""

    def __init__(self, thrash_batches: int, min_gain: float, consensus: Callable[[], Any], info: Callable[[str], None],
                 enabled: bool = False) -> None:
        self.thrash_batches, self.min_gain = thrash_batches, min_gain
        # `enabled`: on a CUDA device (`TrainingSearch.configure`); a CPU batch's time says nothing of a GPU's, and on a
        # CPU the allocator never retries (tests turn it on with their own `timing`).
        self.consensus, self.info, self.enabled = consensus, info, enabled
        self._batches: dict[int, _Batch] = {}
        self._compiled: set[int] = set()  # batches agreed to have compiled a graph on some rank
        self.pending: Optional[_Pending] = None
        self.accepted: Optional[int] = None  # the size found whose retries count as no thrash
        # Tests replace the clock's reading (`tests/automicro_cases.py`): (size found, seconds measured) -> seconds.
        self.timing: Callable[[int, float], float] = lambda size, seconds: seconds

    @property
    def holding(self) -> bool:
        """The size below is being timed: no trial may take its batches."""
        return self.pending is not None

    def accepts(self, found: Optional[int]) -> bool:
        """Allocator retries at the size found `found` were timed faster than the size below: no thrash."""
        return found is not None and found == self.accepted

    def after_batch(self, batch: int, found: Optional[int], split: tuple[int, ...], hooks: bool, clean: bool) -> None:
        """Batch `batch` trained at `split` (the size found `found`, the sync hooks `hooks`); `clean`: in one attempt,
        held by no trial. Every rank alike (agreed figures only)."""
        self._batches[batch] = _Batch(found, tuple(split), hooks, clean)
        self._batches.pop(batch - KEPT, None)  # batches come one by one (a resume starts a new record)
        if self.accepted is not None and found is not None and found != self.accepted:
            self.accepted = None  # the size moved: retries at a size found again are timed again

    def thrash(self, batch: int, found: Optional[int], largest: int, floor: int, bound: Optional[int], capacity: int,
               searching: bool, samples: bool) -> None:
        """A thrash at batch `batch` (its largest microbatch `largest`, the size found `found`), before the policy
        shrinks: the last `thrash_batches` batches are the retrying arm, where it can be timed."""
        self.pending = None
        if not self.enabled or not samples or searching or found is None or largest <= floor:
            return
        batches = tuple(range(batch - self.thrash_batches + 1, batch + 1))
        # Each at the size found, or the batch the search converged in at its split (found after it: a new size's pool
        # settles with retries of its own; on one H100 the thrashes at 4 and at 3 retried in their converging batch).
        split = self._batches[batch].split if batch in self._batches else None
        if any(b not in self._batches or self._batches[b].found not in (None, found) or self._batches[b].split != split
               for b in batches):
            return
        self.pending = _Pending(found, bound, batches, self._batches[batch].hooks, capacity, batch, largest)

    def below_thrashed(self, batch: int, largest: int) -> bool:
        """Another thrash, at batch `batch` (its largest microbatch `largest`), while this one waits for the size
        below: where it is below the size timed, its retrying batches fit to time (one attempt, no trial's, not the
        first at their split) become the other arm: the size below retries too, so the retries came with the run, not
        with the size, and the question is which of the two retrying sizes is faster. True: the timing goes on (this
        thrash is not timed apart); False: it stopped, with its line."""
        pending = self.pending
        assert pending is not None
        fit = [b for b in range(batch - self.thrash_batches + 1, batch + 1)
               if self._fit(b) and max(self._batches[b].split) == largest]
        if largest >= pending.largest or not fit:
            self.stop(f"another thrash came first, at {largest}" if largest >= pending.largest
                      else "another thrash came first, at the size below, in no batch fit to time")
            return False
        self.pending = dataclasses.replace(pending, retried=tuple(fit), retried_size=largest)
        return True

    def _fit(self, b: int) -> bool:
        """Batch `b` is fit to time: trained in one attempt, no trial's or the profile's, not the first at its split."""
        record, before = self._batches.get(b), self._batches.get(b - 1)
        return record is not None and before is not None and record.clean and record.split == before.split

    def _arm_below(self, batch: int, found: int, hooks: bool) -> list[int]:
        assert self.pending is not None
        # Seconds are known up to the batch before this one.
        return [b for b in range(self.pending.at + 1, batch)
                if self._fit(b) and self._batches[b].found == found and (hooks or not self._batches[b].hooks)
                and b not in self._compiled]

    def stop(self, why: str) -> None:
        """The timing ends where it is: the size below stays (`why`, in words)."""
        assert self.pending is not None
        self.info(f"thrash at {self.pending.size}: not timed against the size below ({why}); the size below stays")
        self.pending = None

    def decide(self, batch: int, found: Optional[int], capacity: int, seconds: Mapping[int, float],
               compiled: Mapping[int, int]) -> Optional[Retried]:
        """After batch `batch` (the policy told of it; the size found now `found`, the capacity read `capacity`),
        with the plan's seconds and graphs compiled per batch (this rank's): None while there is nothing to decide
        or the size below stays; else the outcome that takes the retrying size back. Every rank at the same batch."""
        pending = self.pending
        if pending is None:
            return None
        if capacity_moved(pending.capacity, capacity) is not None:
            self.stop(f"the memory capacity moved, {pending.capacity / 2**20:.1f} -> {capacity / 2**20:.1f} MiB")
            return None
        if batch - pending.at > WAIT_BATCHES:
            self.stop(f"no {len(pending.batches)} batches fit to time at the size below within {WAIT_BATCHES} batches")
            return None
        if found is None:
            return None  # still searching below
        if found >= pending.size:
            self.stop(f"the search went to {found}")
            return None
        below = self._arm_below(batch, found, pending.hooks)
        need = len(pending.batches)
        size_below, retried = found, False
        if len(below) >= need:
            below = below[:need]
        elif pending.retried and max(pending.retried) < batch:
            below, size_below, retried = list(pending.retried), pending.retried_size, True
        else:
            return None
        batches = list(pending.batches) + below
        local = [seconds.get(b, 0.0) for b in batches] + [float(bool(compiled.get(b))) for b in batches]
        agreed = agreed_times(self.consensus(), local)
        times, graphs = agreed[: len(batches)], agreed[len(batches):]
        newly = {b for b, g in zip(batches, graphs) if g > 0}
        if newly & set(below):
            self._compiled |= newly & set(below)  # those batches compiled on some rank: the next ones instead
            if retried:  # the size below's retrying batches left out: its settled ones are the arm
                self.pending = dataclasses.replace(pending, retried=tuple(b for b in pending.retried if b not in newly))
            return None
        retrying = [self.timing(pending.size, t) for b, t in zip(batches, times) if b in pending.batches and b not in newly]
        at_below = [self.timing(size_below, t) for b, t in zip(batches, times) if b in below]
        if not retrying:
            self.stop("each retrying batch compiled a graph")
            return None
        self.pending = None
        result = judge("retries", retrying, at_below, self.min_gain)
        on, off = statistics.median(retrying), statistics.median(at_below)
        words = (f"thrash at {pending.size} timed: median batch {on:.4f} s at {pending.size} with the allocator's "
                 f"retries (batches {', '.join(str(b) for b in pending.batches if b not in newly)}), {off:.4f} s at "
                 f"{size_below}{' with its retries too' if retried else ''} (batch{'es' if len(below) > 1 else ''} "
                 f"{', '.join(str(b) for b in below)}) ({100.0 * (1.0 - on / off):+.1f}%; spread {result.spread:.4f} s)")
        if not result.kept:
            self.info(f"{words}: {found} kept, as the thrash rule had it")
            return None
        self.accepted = pending.size
        self.info(f"{words}: {pending.size} again from batch {batch + 1}, its retries accepted (no thrash counted "
                  "there; an OOM there still shrinks the size)")
        return Retried(pending.size, pending.bound)

    def state_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        self.accepted = None if not state else state.get("accepted")
