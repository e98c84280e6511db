"""The one place that decides which trial holds the next batch, which trials run at all, and what they cost.

Once the size has settled, `auto` may time other ways of running the same batch (`automicro.batch`'s
trials: the blocks compiled again at the settled size, packed rows against padded batches, the model
unsharded on one rank, the whole model compiled, the layout trades and smaller microbatches). Each trial
module owns how it times its arms and what it keeps; this plan owns *when*:

- one trial at a time holds the batches (their times would mix), until it decides;
- the trials that change the device work itself come first, in this order, unbounded: the static
  recompile (the graphs every later trial is timed on) and packing;
- then one batch is profiled (`automicro.batch.batch_profile`: a clocked batch, then a profiled one) and
  every other trial is bounded by it: one whose bound does not clear its own rule for keeping is decided
  without running, one line naming the bound; the rest run in order of what they can win, the model
  unsharded before the compile scope (the scope trial then decides for whichever ran faster and reuses that
  trial's times as its own "each block" arm where nothing changed in between), the layout trades and size
  trials last; a kept trial changes the configuration, so the next bound comes from a new profile;
- by batch `TARGET_BATCH` the configuration should be final: where a trial is still pending or running
  then, one line says which, with its projected cost;
- once nothing is left, one line says the price: the seconds the trials cost against the settled
  configuration (every batch from the second to the last trial's, against the median of the
  `SETTLED_BATCHES` batches after it) and the share of this run's planned batches (``max_duration``;
  1,000 where the loop does not say). The summary line at the end of the run repeats it.

Where no batch can be profiled (another profiler is on; `bound_trials=False`), every trial runs as before,
said once. The profile is taken only where a bounded trial is pending.

Owns: the turn, the profile's timing, the bounds' verdicts, the cost. May not touch: how a trial times
or what it keeps (its module's), the search policy, Composer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch

from automicro.batch.batch_profile import BatchProfile, BatchProfiler
from automicro.batch.trial_timing import BatchClock

TARGET_BATCH = 25  # the batch by which the configuration kept for the run should be final
SETTLED_BATCHES = 5  # batches after the last trial whose median is the settled configuration's batch
DEFAULT_PLANNED = 1000  # the run's batches where the loop does not say (`max_duration` in epochs of unknown length)
PROFILE = "profile"


class PlannedTrial(Protocol):
    """What the plan asks of a trial module."""

    name: str
    min_gain: float

    @property
    def pending(self) -> bool:
        """It would start if given the batch (not decided, not off)."""

    @property
    def running(self) -> bool:
        """It holds the batches (its arms are being timed or compiled)."""

    def bound_kind(self) -> Optional[str]:
        """What a batch profile bounds for it (`batch_profile.UNSHARDED`, `SCOPE`, ...), or None: not bounded."""

    def rule_out(self, why: str) -> None:
        """Decided without running: it cannot win beyond its rule for keeping (`why` names the bound)."""

    def projection(self) -> str:
        """What it still costs, in words (batches and compiles), for the line after `TARGET_BATCH`."""


def busy_before(trial: Any, trials: Sequence[Any]) -> bool:
    """A trial it waits for is still to decide."""
    waits = set(getattr(trial, "waits_for", ()))
    return any(t.name in waits and (t.pending or t.running) for t in trials)


class TrialPlan:
    """Asked once per batch, before the trials' own `before_batch` (`turn`), and after it (`after_batch`)."""

    def __init__(
        self, trials: Sequence[PlannedTrial], consensus: Any, info: Callable[[str], None], device: torch.device,
        bound: bool = True,
    ) -> None:
        self.trials = list(trials)
        self.consensus, self.info, self.device = consensus, info, device
        self.bound = bound
        self.profile: Optional[BatchProfile] = None
        self.profiled_for: Any = None  # the configuration the profile was taken at
        self.profiler = BatchProfiler(device)
        self.clock = BatchClock(device)
        self._profiling = ""  # "" | "clock" (a clocked batch) | "profile" (the profiled batch)
        self._wall = 0.0
        self.no_profile = "" if bound else "bound_trials is off"
        self._said_no_profile = False
        self.turn: Optional[str] = None
        self.final_at: Optional[int] = None  # the first batch the final configuration ran without a trial
        # The loop's wall clock per batch, start to start, no device sync: {batch: seconds}.
        self.seconds: dict[int, float] = {}
        self._started: Optional[tuple[int, float]] = None
        self.first: Optional[int] = None  # this run's first batch
        self.first_steady: Optional[int] = None  # the first batch with the size settled: the trials' window opens
        self._batch = 0
        self._said_target = False
        self.price: Optional[str] = None  # the price line once said (the summary repeats it)
        self.planned_batches: Optional[int] = None
        self.ruled_out: list[str] = []
        self._tried = False  # a trial (or the profile) held a batch, or one was ruled out: there is a price to say
        # What a compile of the blocks costs, as measured so far (0: not measured); the training search sets it.
        self.block_compile_s: Callable[[], float] = lambda: 0.0
        # Tests replace it to give every rank the same profile without depending on the machine.
        self.measured: Callable[[Optional[BatchProfile]], Optional[BatchProfile]] = lambda profile: profile

    # ---- the turn --------------------------------------------------------------------------------

    def before_batch(self, batch: int, steady: bool, configuration: Any) -> Optional[str]:
        """The trial (by name), or `PROFILE`, that holds batch `batch`; None: no trial. `steady`: the size has
        settled (sync hooks off); `configuration`: what the trials have kept so far (a profile of another
        configuration bounds nothing)."""
        now = time.perf_counter()
        if self._started is not None and self._started[0] == batch - 1:
            self.seconds[batch - 1] = now - self._started[1]
        self._started, self._batch = (batch, now), batch
        self.first = batch if self.first is None else self.first
        if steady and self.first_steady is None:
            self.first_steady = batch
        if self.final_at is not None and self.price is None:
            self._price()
        self.turn = self._choose(steady, configuration)
        self._tried = self._tried or self.turn is not None or bool(self.ruled_out)
        if self.turn == PROFILE:
            if self._profiling == "clock":
                self.clock.start()
            elif not self.profiler.start():
                self._profiling, self.no_profile, self.turn = "", self.profiler.why, None
        if self.final_at is not None and (self.turn is not None or self.running_or_pending()):
            self.final_at = self.price = None  # a trial again (the size moved, memory came back): priced anew
        self._target_line(batch)
        return self.turn

    def _choose(self, steady: bool, configuration: Any) -> Optional[str]:
        if not steady:
            self._profiling = ""
            return None
        running = next((t for t in self.trials if t.running), None)
        if running is not None:
            return running.name
        if self._profiling:
            return PROFILE
        for trial in self.trials:  # the unbounded ones first, in their order
            if trial.pending and trial.bound_kind() is None and trial.name != "layout":
                return trial.name
        bounded = [t for t in self.trials if t.pending and t.bound_kind() is not None]
        if bounded and self.profile_needed(configuration):
            self._profiling, self.profiled_for = "clock", configuration
            return PROFILE
        for trial in bounded:
            if busy_before(trial, self.trials):
                continue  # bounded once the trials it waits for have decided (the configuration may change)
            why = self._rules_out(trial)
            if why is not None:
                trial.rule_out(why)
                self.ruled_out.append(trial.name)
        busy = {t.name for t in self.trials if t.pending or t.running}
        ready = [t for t in self.trials if t.pending and not busy & set(getattr(t, "waits_for", ()))]
        if not ready:
            return None
        if self.profile is None:
            return ready[0].name
        # By what they can win (unbounded first), the listed order breaking ties.
        ranked = sorted(enumerate(ready), key=lambda it: (-(self.profile.can_win(it[1].bound_kind()) if it[1].bound_kind() else float("inf")), it[0]))
        return ranked[0][1].name

    def profile_needed(self, configuration: Any) -> bool:
        if self.no_profile:
            if not self._said_no_profile:
                self._said_no_profile = True
                self.info(f"trials: no batch profile ({self.no_profile}); every trial runs, none is bounded")
            return False
        return self.profile is None or self.profiled_for != configuration

    def _rules_out(self, trial: PlannedTrial) -> Optional[str]:
        """Why `trial` cannot pay: its bound under its own rule for keeping, or all it can win over the batches left
        below what it costs before it can keep anything (a compile, projected from a compile of the blocks)."""
        kind = trial.bound_kind()
        if self.profile is None or kind is None:
            return None
        why = self.profile.rules_out(kind, trial.min_gain)
        if why is not None or not hasattr(trial, "projected_cost_s"):
            return why
        cost, what = trial.projected_cost_s(self.block_compile_s())
        planned = self.planned_batches or DEFAULT_PLANNED
        left = max(0, planned - self._batch)
        most = self.profile.can_win(kind) * left
        if cost <= 0 or most >= cost:
            return None
        whose = "this run's" if self.planned_batches else "a run of"
        return (f"it can win at most {most:.1f} s over the {left:,} batches left of {whose} {planned:,} "
                f"({self.profile.share(self.profile.can_win(kind))} of a {self.profile.wall_s:.4f} s batch: "
                f"{self.profile.parts(kind)}), less than {what} costs (projected {cost:.1f} s)")

    def running_or_pending(self) -> bool:
        return any(t.running or t.pending for t in self.trials)

    # ---- after the batch ---------------------------------------------------------------------------

    def after_batch(self, attempts: int, layout_started: bool = False) -> None:
        """The batch trained after `attempts` attempts; `layout_started`: a layout trial started with it."""
        if self.turn == PROFILE:
            if attempts != 1:  # an OOM or a retry in the profile's batches: measure again
                self._profiling = ""
                self.clock.stop()
                if self.profiler._profile is not None:
                    self.profiler.stop(0.0)
                self.profiled_for = None
            elif self._profiling == "clock":
                self._wall, self._profiling = self.clock.stop(), "profile"
            else:
                self._profiling = ""
                self._agree(self.profiler.stop(self._wall))
            return
        nothing_left = self.turn is None and not layout_started and not self.running_or_pending()
        if nothing_left and self.final_at is None and self.first_steady is not None:
            self.final_at = self._batch

    def _agree(self, profile: Optional[BatchProfile]) -> None:
        """Every rank's profile, the max of each figure over ranks (one round): every rank bounds alike."""
        local = self.measured(profile)
        values = local.to_micros() if local is not None else [0] * 6
        agreed = self.consensus.agree_max(values + [0 if local is not None else 1])
        if agreed[-1]:
            self.no_profile, self.profile = self.profiler.why or "a rank could not profile its batch", None
            return
        self.profile = BatchProfile.from_micros(agreed[:-1], self.device.type, local.unattributed_names if local else ())
        self.info(self.profile.line())

    # ---- the price ---------------------------------------------------------------------------------

    def _price(self) -> None:
        """Once `SETTLED_BATCHES` batches ran after the last trial: the trials' window (from the first batch with
        the size settled to the last before `final_at`) against their median, agreed (the max over ranks)."""
        assert self.final_at is not None and self.first_steady is not None
        if not self._tried:
            return  # nothing was tried: nothing to price
        settled = [self.seconds[b] for b in range(self.final_at, self.final_at + SETTLED_BATCHES) if b in self.seconds]
        if len(settled) < SETTLED_BATCHES:
            return
        median = statistics.median(settled)
        window = [self.seconds[b] for b in range(self.first_steady, self.final_at) if b in self.seconds]
        local = max(0.0, sum(window) - median * len(window))
        cost_us, median_us = self.consensus.agree_max([int(local * 1e6), int(median * 1e6)])
        cost, median = cost_us / 1e6, median_us / 1e6
        planned = self.planned_batches or DEFAULT_PLANNED
        share = cost / (planned * median) if median > 0 else 0.0
        whose = "this run's" if self.planned_batches else "a run of"
        self.price = (f"trials: the configuration was final at batch {self.final_at}; the trials cost {cost:.1f} s against the "
                      f"settled configuration ({median:.4f} s a batch, the median of the {SETTLED_BATCHES} batches after), "
                      f"{100.0 * share:.1f}% of {whose} {planned:,} batches")
        self.info(self.price)

    def _target_line(self, batch: int) -> None:
        if self.first is None or batch - self.first != TARGET_BATCH or self._said_target or self.final_at is not None:
            return
        left = [t for t in self.trials if t.running or t.pending]
        if not left and self.turn is None:
            return
        self._said_target = True
        what = "; ".join(f"{t.name}: {t.projection()}" for t in left) or "a batch profile"
        self.info(f"trials: still running at batch {TARGET_BATCH}, projected: {what}")

    def summary(self) -> str:
        """The summary line's part (empty before the price is known)."""
        if self.price is None:
            return ""
        return self.price.split("; ", 1)[1].replace("the trials cost", "trials cost", 1)


__all__ = ["DEFAULT_PLANNED", "PROFILE", "PlannedTrial", "SETTLED_BATCHES", "TARGET_BATCH", "TrialPlan"]
