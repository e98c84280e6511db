"""The one place that decides which trial holds the next batch, which trials run at all, and what they cost.

Once the size has settled, `auto` may time other ways of running the same batch (`automicro.batch`'s
trials: the blocks compiled again at the settled size, packed rows against padded batches, the model
unsharded on one rank, the whole model compiled, the layout trades and smaller microbatches). Each trial
module owns how it times its arms and what it keeps; this plan owns *when*, and *whether at all*:

- one trial at a time holds the batches (their times would mix), until it decides;
- every trial is priced before it runs (`automicro.batch.trial_price`): its expected win per batch from what this
  run has measured, and its predicted cost (compiles, its arms' batches); it runs only where the win over the
  batches left is `MARGIN` times the cost, where it is expected to clear its own rule for keeping, and where its
  cost fits what is left of the trials' budget (1% of the run's planned seconds, raised by half of what the trials
  kept have won as their arms were timed, over the batches left when each was kept: `trial_price.WON_SHARE`); what
  does not run says why; one refused only for the budget is priced again once a kept trial has raised it;
- a trial that changes what fits goes before every other (`goes_first`: the fused vocabulary head under
  ``head: auto``, `automicro.core.layout`'s ``fused_head``): the size it settles on is the one the others are timed
  at; it is priced from the first profile;
- then the trials that change the device work itself, in this order: the static recompile (the graphs every
  later trial is timed on) and packing; they are priced without a profile;
- then one batch is profiled (`automicro.batch.batch_profile`: a clocked batch, then a profiled one) where the
  budget holds it and a trial is left that needs it; the budget goes to the rest best expected value first
  (`trial_price.allocate`); they run in their order (the model unsharded before the compile scope, the layout
  trades and size trials last); a kept trial changes the configuration, so the next prices come from a new
  profile;
- each trial's batches are clocked by the loop (start to start); when it ends one line says its real cost against
  the settled batch and its predicted one (and what it won, where it kept a faster configuration: the budget grows),
  and a record of it goes to the dashboards (`take_records`);
- by batch `TARGET_BATCH` the configuration should be final: where a trial is still pending or running then, one
  line says in seconds what is left and why;
- once nothing is left, one line says the price: the seconds the trials cost against the settled configuration
  (every batch from the first with the size settled to the last trial's, against the median of the
  `SETTLED_BATCHES` batches after it), their predicted sum, and the share of this run's planned batches
  (``max_duration``; 1,000 where the loop does not say). The summary line at the end of the run repeats it.

`trials=False` (the key): no trial runs at all. `bound=False` (`bound_trials: false`): every trial runs, unpriced
(tests that exercise a trial's logic, measurements of what an unpriced trial costs).

Every decision is taken from agreed figures (one consensus round where a price is needed, one where a trial
ends), so every rank takes the same one.

Owns: the turn, the profile's timing, the prices and the budget, the trials' costs. May not touch: how a trial
times or what it keeps (its module's), the search policy, Composer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch

from automicro.batch import trial_price
from automicro.batch.batch_profile import BatchProfile, BatchProfiler
from automicro.batch.trial_price import Budget, Measured, Price, seconds
from automicro.batch.trial_timing import BatchClock

TARGET_BATCH = 25  # the batch by which the configuration kept for the run should be final
SETTLED_BATCHES = 5  # batches after the last trial whose median is the settled configuration's batch
DEFAULT_PLANNED = 1000  # the run's batches where the loop does not say (`max_duration` in epochs of unknown length)
PROFILE = "profile"
KEPT_BATCHES = 64  # the batches' figures kept once the price is said (`_forget`)
# The dashboards' `automicro/trial`: which kind of trial holds the batch (0: none).
TRIAL_CODES = {None: 0, PROFILE: 1, "static": 2, "packing": 3, "one_rank": 4, "scope": 5, "layout": 6, "size": 7}


class PlannedTrial(Protocol):
    """What the plan asks of a trial module."""

    name: str
    min_gain: float
    profiled: bool  # priced from a batch profile (the static recompile and packing are not)

    @property
    def pending(self) -> bool:
        """It would start if given the batch (not decided, not off)."""

    @property
    def running(self) -> bool:
        """It holds the batches (its arms are being timed or compiled)."""

    @property
    def label(self) -> Optional[str]:
        """What its running trial is called (its name; a layout trade's or size trial's own), None when none runs."""

    def candidates(self) -> list[tuple[str, str, dict[str, float]]]:
        """What it would run, priced now: (label, kind of `trial_price.KINDS`, facts)."""

    def rule_out(self, why: str) -> None:
        """Decided without running: it does not pay (`why` names its price)."""

    def projection(self) -> str:
        """What it still costs, in words (batches and compiles), for the line at `TARGET_BATCH`."""

    def outcome(self) -> str:
        """What its last trial decided, in a few words (for its cost line and the dashboards)."""

    # Optional: ``won_s``, what the configurations it kept (and still keeps) won a batch, as its arms were timed
    # (agreed); a trial without it raises no budget.


_OFFSET_US = 10**12  # added to a signed figure for its agreement (a maximum of non-negative ints), then taken off


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


class TrialPlan:
    """Asked once per batch, before the trials' own `before_batch` (`before_batch`), told which trial label held it
    once they have started (`hold`), and after it (`after_batch`)."""

    def __init__(
        self, trials: Sequence[PlannedTrial], consensus: Any, info: Callable[[str], None], device: torch.device,
        bound: bool = True, enabled: bool = True,
    ) -> None:
        self.trials = list(trials)
        self.consensus, self.info, self.device = consensus, info, device
        self.priced = bound
        self.enabled = enabled
        self.profile: Optional[BatchProfile] = None
        self.profiled_for: Any = None  # the configuration the profile was taken at
        self.profiler = BatchProfiler(device)
        self.clock = BatchClock(device)
        self._profiling = ""  # "" | "clock" (a clocked batch) | "profile" (the profiled batch)
        self._wall = 0.0
        self.no_profile = ""
        self.turn: Optional[str] = None
        self.label: Optional[str] = None  # what holds the batch in progress: a trial's label, PROFILE, or None
        self.final_at: Optional[int] = None  # the first batch the final configuration ran without a trial
        # The loop's wall clock per batch, start to start, no device sync: {batch: seconds}.
        self.seconds: dict[int, float] = {}
        self.held: dict[int, Optional[str]] = {}  # {batch: the label that held it}
        self.kinds: dict[str, str] = {}  # {label: its trial module's name} (the dashboards' code)
        self.compiled: dict[int, int] = {}  # {batch: graphs dynamo compiled in it}
        self.points: list[tuple[int, int, float, int]] = []  # (microbatches, samples, seconds, batch) of clean batches
        self.retried: dict[int, bool] = {}  # {steady batch: allocator retries in it}
        self._batch_split: dict[int, tuple[int, ...]] = {}
        self._sizes_seen: set[int] = set()  # the microbatch sizes trained so far
        # Whether the last batch that trained a microbatch size of 2 or more not trained before compiled a graph (None:
        # none has yet): a trial at a new size compiles where it did (`trial_price.Measured.sizes_compile`).
        self._new_size_compiled: Optional[bool] = None
        self._graphs_at = 0
        self._started: Optional[tuple[int, float]] = None
        self.first: Optional[int] = None  # this run's first batch
        self.first_steady: Optional[int] = None  # the first batch with the size settled: the trials' window opens
        self._batch = 0
        self._said_target = False
        self._said_off = False
        self.price: Optional[str] = None  # the price line once said (the summary repeats it)
        self.planned_batches: Optional[int] = None
        self.ruled_out: list[str] = []
        self._tried = False  # a trial (or the profile) held a batch, or one was ruled out: there is a price to say
        self.budget = Budget()
        self.allowed: dict[str, Price] = {}  # labels the budget went to at the last allocation
        self.refused: dict[str, str] = {}  # labels that do not run, and why
        # {label: the budget's total when its price paid but did not fit it}: priced again where asked once it grew
        # (`reprices`; a layout trade or the fused head the layout search ruled out at this size found asks then).
        self.over_budget: dict[str, float] = {}
        self._won_seen: dict[str, float] = {}  # {trial: its `won_s` as last credited to the budget}
        self.admitted: dict[str, Price] = {}  # labels let run and not ended, with their price
        self.predicted_s = 0.0  # the predicted costs of every trial let run
        self.costs: dict[str, float] = {}  # {label: its real cost (agreed) once it ended}
        self._cost_now: dict[str, float] = {}  # {label: local seconds over the reference so far}
        self._batches_of: dict[str, list[int]] = {}
        self.records: list[dict[str, Any]] = []  # ended trials, for the dashboards (`take_records`)
        self._records_out = 0
        self._reference_s = 0.0  # the settled batch as last agreed
        # Figures the training search supplies: the settled split, one graph's compile, the compiled blocks, the
        # padding's share of the tokens.
        self.split_now: Callable[[], tuple[int, ...]] = lambda: ()
        self.compile_s: Callable[[], float] = lambda: 0.0
        # The launch's first batch's seconds where it compiled the blocks in one attempt (0: unknown).
        self.first_batch_s: Callable[[], float] = lambda: 0.0
        self.blocks: Callable[[], int] = lambda: 0
        self.padding_share: Callable[[], float] = lambda: 0.0
        self.graphs: Callable[[], int] = lambda: 0  # graphs dynamo compiled in the process so far
        # Tests replace it to give every rank the same profile without depending on the machine.
        self.measured: Callable[[Optional[BatchProfile]], Optional[BatchProfile]] = lambda profile: profile

    # ---- the turn --------------------------------------------------------------------------------

    def before_batch(self, batch: int, steady: bool, configuration: Any) -> Optional[str]:
        """The trial (by name), or `PROFILE`, that holds batch `batch`; None: no trial. `steady`: the size has
        settled (sync hooks off); `configuration`: what the trials have kept so far, or a callable that says it
        (a profile of another configuration prices nothing)."""
        now = time.perf_counter()
        graphs = self.graphs()
        if self._started is not None and self._started[0] == batch - 1:
            self.seconds[batch - 1] = now - self._started[1]
            self.compiled[batch - 1] = max(0, graphs - self._graphs_at)
            self._sizes_trained(batch - 1)
            self._clocked(batch - 1)
        self._started, self._batch, self._graphs_at = (batch, now), batch, graphs
        self.first = batch if self.first is None else self.first
        if steady and self.first_steady is None:
            self.first_steady = batch
        self._ended(batch)
        if self.final_at is not None and self.price is None:
            self._price()
        if self.price is not None and batch % KEPT_BATCHES == 0:
            self._forget(batch - KEPT_BATCHES)
        self.turn = self._choose(steady, configuration)
        self.label = self.turn if self.turn in (None, PROFILE) else None
        self._tried = self._tried or self.turn is not None or bool(self.ruled_out)
        if self.turn == PROFILE:
            if self._profiling == "clock":
                self.clock.start()
            elif not self.profiler.start():
                self._profiling, self.no_profile, self.turn, self.label = "", self.profiler.why, None, None
        if self.final_at is not None and (self.turn is not None or self.running_or_pending()):
            self.final_at = self.price = None  # a trial again (the size moved, memory came back): priced anew
        self._target_line(batch)
        return self.turn

    def hold(self, label: Optional[str], kind: Optional[str] = None) -> None:
        """What holds the batch in progress, once the trials have started theirs: a trial's label (its module's
        `name` where it has one label, a layout trade's or size trial's own), or None."""
        if self.turn == PROFILE:
            return
        self.label = label
        if label is not None:
            self.kinds.setdefault(label, kind or self.turn or label)

    def _choose(self, steady: bool, configuration: Any) -> Optional[str]:
        if not steady:
            self._profiling = ""
            return None
        running = next((t for t in self.trials if t.running), None)
        if running is not None:
            return running.name
        if self._profiling:
            return PROFILE
        if not self.enabled:
            if not self._said_off and any(t.pending for t in self.trials):
                self._said_off = True
                self.info("trials: off (trials: false): the size search and nothing else; the configuration stays as "
                          "the search left it")
            return None
        first = [t for t in self.trials if getattr(t, "goes_first", False)]
        for trial in self.trials:  # the ones that change the device work first, in their order
            if trial.pending and not trial.profiled and not first:
                why = self._admit_trial(trial)
                if why is None:
                    return trial.name
                self._rule_out(trial, why)
        profiled = [t for t in self.trials if t.pending and t.profiled]
        if callable(configuration):  # read now: the trials ruled out above may have changed it
            configuration = configuration()
        if profiled and self.priced and self.profile_needed(configuration):
            why = self._profile_unaffordable()
            if why is None:
                self._profiling, self.profiled_for = "clock", configuration
                return PROFILE
            for trial in profiled:
                self._rule_out(trial, why)
            return None
        while True:
            busy = {t.name for t in self.trials if t.pending or t.running}
            ready = [t for t in self.trials if t.pending and not busy & set(getattr(t, "waits_for", ()))]
            ready.sort(key=lambda t: not getattr(t, "goes_first", False))
            if not ready:
                return None
            trial = ready[0]
            if trial.name == "layout" or not self.priced:
                return trial.name  # the layout prices each trade and size trial as it comes (`admit`)
            why = self._admit_trial(trial)
            if why is None:
                return trial.name
            self._rule_out(trial, why)

    def _rule_out(self, trial: PlannedTrial, why: str) -> None:
        trial.rule_out(why)
        self.ruled_out.append(trial.name)

    def profile_needed(self, configuration: Any) -> bool:
        return self.profile is None or self.profiled_for != configuration

    def running_or_pending(self) -> bool:
        return any(t.running or t.pending for t in self.trials)

    # ---- prices ------------------------------------------------------------------------------------

    def _snapshot(self) -> Measured:
        """What this run has measured, agreed (the max of each figure over ranks: one round)."""
        planned = self.planned_batches or DEFAULT_PLANNED
        split = self.split_now()
        fit = trial_price.fit_microbatch_cost((n, s, t) for n, s, t, _ in self.points)
        steady = [b for b in self.retried if self.held.get(b) is None]
        retried = sum(1 for b in steady if self.retried[b]) / len(steady) if steady else 0.0
        local = [self._local_reference(), float(fit is not None), max(0.0, fit or 0.0), retried, self.compile_s(),
                 self.padding_share(), self.first_batch_s(), float(self._new_size_compiled is not False)]
        agreed = [v / 1e6 for v in self.consensus.agree_max([int(round(max(0.0, v) * 1e6)) for v in local])]
        batch_s, has_fit, fit_s, retried_share, compile_s, padding, first_s, sizes_compile = agreed
        fit_s = fit_s if has_fit else None
        profile = self.profile if self.profile is not None and self.profiled_for is not None else None
        self._reference_s = batch_s or 0.0
        if profile is not None:
            batch_s = profile.wall_s
        batch_s = batch_s or 0.0
        self.budget.planned_s = planned * batch_s
        return Measured(
            batch_s=batch_s, left=max(0, planned - self._batch), planned=planned, planned_known=bool(self.planned_batches),
            profile=profile, microbatches=max(1, len(split)), microbatch_fit_s=fit_s, retried_share=retried_share or 0.0,
            graph_compile_s=compile_s or 0.0, blocks=self.blocks(), padding_share=padding or 0.0,
            first_compile_s=max(0.0, first_s - (self._reference_s or batch_s)) if first_s and compile_s else 0.0,
            sizes_compile=bool(sizes_compile),  # where any rank's last new size compiled
        )

    def _local_reference(self) -> float:
        """This rank's settled batch: the median of the last steady batches no trial held and nothing compiled in,
        else of the last batches that compiled nothing (the run's first left out)."""
        clean = [b for b in sorted(self.seconds) if not self.compiled.get(b) and b != self.first]
        settled = [self.seconds[b] for b in clean if self.first_steady is not None and b >= self.first_steady and self.held.get(b) is None]
        if settled:
            return _median(settled[-SETTLED_BATCHES:])
        if clean:
            return _median([self.seconds[b] for b in clean[-3:]])
        return self.seconds[max(self.seconds)] if self.seconds else 0.0

    def _admit_trial(self, trial: PlannedTrial) -> Optional[str]:
        """A top-level trial given the turn: None where it runs (its budget committed), else why not."""
        if not self.priced:
            return None
        why = None
        for label, kind, facts in trial.candidates():
            why = self.admit(label, kind, trial.min_gain, **facts)
            if why is None:
                return None
        return why or "nothing of it is left to run"

    def admit(self, label: str, kind: str, min_gain: float, **facts: float) -> Optional[str]:
        """Trial `label` of `kind` asks to run now: None where it may (its price committed, one line), else why not.
        Asked at the same batch on every rank (a consensus round where it is priced now)."""
        if not self.priced or not self.enabled:
            return None if self.enabled else "trials: false"
        if label in self.admitted:
            return None
        if label in self.refused:
            why = self.refused.pop(label)
            if not self.reprices(label):
                return why
            # refused for the budget alone: priced again against the budget grown since
        measured = self._snapshot()
        price = self.allowed.pop(label, None)
        self.budget.set_aside_s = sum(p.cost_s for p in self.allowed.values())
        if price is None:
            price = trial_price.price(label, kind, measured, **facts)
            if price is None:
                return f"not priced: no batch profile ({self.no_profile or 'none was taken'})"
            why = trial_price.worth(price, measured, min_gain)
            if why is None:
                why = self.budget.fits(price)
                if why is not None:
                    self.over_budget[label] = self.budget.total_s
            else:
                self.over_budget.pop(label, None)  # it does not pay: a larger budget changes nothing
            if why is not None:
                return why
        self.over_budget.pop(label, None)
        self.admitted[label] = price
        self.predicted_s += price.cost_s
        self.kinds.setdefault(label, kind)
        self.budget.commit(price)
        self.info(f"trials: {label} runs: expected {price.share(measured.batch_s)} a batch ({price.basis}), "
                  f"{seconds(price.win_s * measured.left)} over the {measured.left:,} batches left; predicted cost "
                  f"{seconds(price.cost_s)} ({price.costs}); {seconds(max(0.0, self.budget.left_s()))} of the "
                  f"{seconds(self.budget.total_s)} budget left")
        return None

    def reprices(self, label: str) -> bool:
        """`label`'s price paid but did not fit the budget, which has grown since (a kept trial won): ask again."""
        at = self.over_budget.get(label)
        return at is not None and self.budget.total_s > at + 1e-6

    def by_value(self, labels: list[str]) -> list[str]:
        """`labels` with those the budget went to first, the best expected value first (the rest as given)."""
        left = max(1, (self.planned_batches or DEFAULT_PLANNED) - self._batch)
        allowed = sorted((l for l in labels if l in self.allowed), key=lambda l: -self.allowed[l].value(left))
        return allowed + [l for l in labels if l not in self.allowed]

    def _profile_unaffordable(self) -> Optional[str]:
        """Why no batch is profiled (the budget cannot hold it and one trial), or None."""
        if self.no_profile:
            return f"not priced: no batch profile ({self.no_profile})"
        measured = self._snapshot()
        need = (trial_price.PROFILE_BATCHES + trial_price.ARM_BATCHES * trial_price.NOISE) * measured.batch_s
        if self.budget.left_s() >= need:
            return None
        whose = "this run's" if measured.planned_known else "a run of"
        won = f" and {100 * trial_price.WON_SHARE:g}% of the {seconds(self.budget.won_s)} the trials kept won" if self.budget.won_s > 0 else ""
        return (f"the trials' budget, {self.budget.total_s:.2f} s (1% of {whose} {measured.planned:,} batches of "
                f"{measured.batch_s:.4f} s{won}) with {max(0.0, self.budget.left_s()):.2f} s left, cannot hold a profiled batch "
                f"and a trial ({need:.2f} s)")

    def _allocate(self) -> None:
        """The profile is in: the budget goes to the pending trials best expected value first."""
        measured = self._snapshot()
        self.allowed, self.budget.set_aside_s = {}, 0.0
        prices: list[Price] = []
        mins: dict[str, float] = {}
        for trial in self.trials:
            if not trial.pending or not trial.profiled:
                continue
            for label, kind, facts in trial.candidates():
                price = trial_price.price(label, kind, measured, **facts)
                if price is not None and label not in self.admitted and (label not in self.refused or label in self.over_budget):
                    prices.append(price)
                    mins[label] = trial.min_gain
        chosen, refused = [], {}
        by_gain: dict[float, list[Price]] = {}
        for price in prices:
            by_gain.setdefault(mins[price.label], []).append(price)
        for min_gain, group in by_gain.items():
            picked, why = trial_price.allocate(group, measured, self.budget, min_gain)
            chosen += picked
            refused.update(why)
        self.allowed = {p.label: p for p in chosen}
        self.budget.set_aside_s = sum(p.cost_s for p in chosen)
        for price in chosen:
            self.refused.pop(price.label, None)
            self.over_budget.pop(price.label, None)
        self.refused.update(refused)
        for p in prices:
            if p.label in refused:
                if trial_price.worth(p, measured, mins[p.label]) is None:
                    self.over_budget[p.label] = self.budget.total_s
                else:
                    self.over_budget.pop(p.label, None)

    # ---- after the batch ---------------------------------------------------------------------------

    def after_batch(self, attempts: int, layout_started: bool = False, retried: bool = False,
                    split: tuple[int, ...] = ()) -> None:
        """The batch trained after `attempts` attempts (0: not given to the trials); `layout_started`: a layout trial
        started with it; `retried`: the allocator retried in it (any rank); `split`: the split it trained."""
        batch = self._batch
        self.held[batch] = self.label
        self._batch_split[batch] = split
        if self.first_steady is not None and batch >= self.first_steady and self.label is None:
            self.retried[batch] = retried
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
        # A batch given to a trial that started nothing in it (the layout, its last trades priced out at its turn) ran
        # the settled configuration: it is the final one's first batch where nothing is left (not the batch after).
        idle = self.turn is None or (self.turn != PROFILE and self.label is None)
        nothing_left = idle and not layout_started and not self.running_or_pending()
        if nothing_left and self.final_at is None and self.first_steady is not None:
            self.final_at = batch

    def _forget(self, before: int) -> None:
        """Once the price is said, only the last `KEPT_BATCHES` batches' figures are kept (a trial that starts again
        prices itself from the recent ones): a long run holds no record per batch."""
        for table in (self.seconds, self.held, self.compiled, self.retried, self._batch_split):
            for old in [b for b in table if b < before]:
                del table[old]
        self.points = [p for p in self.points if p[3] >= before]

    def _sizes_trained(self, batch: int) -> None:
        """Batch `batch`'s graphs are counted: where it trained a microbatch size not trained before, whether it
        compiled one. Not the run's first batch (its first compile), nor one with a new size 1 (dynamo specializes 1:
        it compiles where the other sizes share one graph)."""
        split = self._batch_split.get(batch, ())
        new = set(split) - self._sizes_seen
        self._sizes_seen.update(split)
        if new and batch != self.first and 1 not in new:
            self._new_size_compiled = bool(self.compiled.get(batch))

    def _clocked(self, batch: int) -> None:
        """Batch `batch`'s seconds are in: a clean batch is a point of the microbatch cost model; a trial's batch adds
        to its cost."""
        split = self._batch_split.get(batch, ())
        label = self.held.get(batch)
        if split and label is None and not self.compiled.get(batch) and batch != self.first:
            self.points.append((len(split), sum(split), self.seconds[batch], batch))
        if label is not None:
            self._cost_now[label] = self._cost_now.get(label, 0.0) + self.seconds[batch] - (self._reference_s or self._local_reference())
            self._batches_of.setdefault(label, []).append(batch)

    def _ended(self, batch: int) -> None:
        """The label that held the last batch and holds none now has ended (its trial decided, or the profile is in):
        its cost, agreed (one round), its line and its record."""
        last = self.held.get(batch - 1)
        if last is None or (last == PROFILE and self._profiling) or last in self._running_labels():
            return
        local = self._cost_now.pop(last, 0.0)
        trial = self._trial_of(last) if last != PROFILE else None
        name = trial.name if trial is not None else last
        won_local = max(0.0, float(getattr(trial, "won_s", 0.0) or 0.0))
        # A kept trade's batches can be faster than the reference: a cost below zero, agreed offset to stay >= 0. What
        # the trial's kept configurations win a batch: the least over ranks (the max of its negation).
        cost_us, won_us = self.consensus.agree_max([int(round(local * 1e6)) + _OFFSET_US, _OFFSET_US - int(round(won_local * 1e6))])
        cost, won = (cost_us - _OFFSET_US) / 1e6, (_OFFSET_US - won_us) / 1e6
        self.costs[last] = self.costs.get(last, 0.0) + cost
        self.budget.settle(last, cost)
        left = max(0, (self.planned_batches or DEFAULT_PLANNED) - batch)
        gained = won - self._won_seen.get(name, 0.0)
        if last != PROFILE and abs(gained) > 1e-6:
            self._won_seen[name] = won
            self.budget.win(name, gained * left)
        batches = self._batches_of.pop(last, [])
        predicted = self.admitted.pop(last, None)
        outcome = "" if last == PROFILE else self._outcome(last)
        if last != PROFILE:
            grew = ""
            if gained > 1e-6:
                grew = (f"; it won {seconds(gained)} a batch as timed, {seconds(gained * left)} over the {left:,} batches left: "
                        f"the budget grows by {100 * trial_price.WON_SHARE:g}% of it")
            elif gained < -1e-6:
                grew = f"; what it had kept won {seconds(-gained)} a batch less now: the budget shrinks by {100 * trial_price.WON_SHARE:g}% of {seconds(-gained * left)}"
            self.info(f"trials: {last} ended ({outcome}): cost {seconds(cost)} over {len(batches)} batch(es) against the "
                      "batch before it" + (f", predicted {seconds(predicted.cost_s)}" if predicted is not None else "") + grew
                      + (f"; {seconds(max(0.0, self.budget.left_s()))} of the {seconds(self.budget.total_s)} budget left"
                         if predicted is not None or grew else ""))
        self.records.append({
            "trial": last, "kind": self.kinds.get(last, last), "first": batches[0] if batches else batch - 1,
            "last": batches[-1] if batches else batch - 1, "outcome": outcome, "cost_s": round(cost, 4),
            "predicted_s": None if predicted is None else round(predicted.cost_s, 4),
        })

    def _running_labels(self) -> set[str]:
        return {t.label for t in self.trials if t.running and t.label is not None}

    def _trial_of(self, label: str) -> Optional[PlannedTrial]:
        kind = self.kinds.get(label, label)
        names = {t.name: t for t in self.trials}
        return names.get(kind) or names.get("layout")

    def _outcome(self, label: str) -> str:
        trial = self._trial_of(label)
        return trial.outcome() if trial is not None else ""

    def _agree(self, profile: Optional[BatchProfile]) -> None:
        """Every rank's profile, the max of each figure over ranks (one round): every rank prices alike."""
        local = self.measured(profile)
        values = local.to_micros() if local is not None else [0] * len(BatchProfile(0.0, 0.0, 0.0, 0.0, 0.0).to_micros())
        # A round holds 8 figures: the batch's 7 and whether a rank has none, then (where the run has a head switch,
        # on every rank alike) the head's 3.
        agreed = list(self.consensus.agree_max(values[:7] + [0 if local is not None else 1]))
        head = self.profiler.head
        agreed = agreed[:-1] + (list(self.consensus.agree_max(values[7:])) if head is not None else [0] * len(values[7:])) + agreed[-1:]
        if agreed[-1]:
            self.no_profile, self.profile = self.profiler.why or "a rank could not profile its batch", None
            return
        self.profile = BatchProfile.from_micros(agreed[:-1], self.device.type, local.unattributed_names if local else ())
        self.info(self.profile.line())
        head_line = self.profile.head_line(head.vocab if head is not None else 0)
        if head_line is not None:
            self.info(head_line)
        self._allocate()

    # ---- the dashboards ----------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """`automicro/trial` (what held the last batch: `TRIAL_CODES`) and `automicro/trials_s` (the trials' cost so
        far, seconds over the settled batch)."""
        label = self.held.get(self._batch)
        kind = self.kinds.get(label, label) if label is not None else None
        code = TRIAL_CODES.get(kind, TRIAL_CODES["layout"] if label is not None else 0)
        if label is not None and label.startswith("size "):
            code = TRIAL_CODES["size"]
        return {"automicro/trial": code, "automicro/trials_s": round(sum(self.costs.values()) + sum(self._cost_now.values()), 4)}

    def take_records(self) -> list[dict[str, Any]]:
        """The trials that ended since the last call (one `automicro/trial` trace each)."""
        out = self.records[self._records_out:]
        self._records_out = len(self.records)
        return out

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
        ran = [label for label in self.costs if label != PROFILE]
        predicted = self.predicted_s + (trial_price.PROFILE_BATCHES * median if PROFILE in self.costs else 0.0)
        what = (f"{len(ran)} ran ({', '.join(ran)}), predicted {seconds(predicted)}" if ran
                else "none ran" + (f" ({', '.join(dict.fromkeys(self.ruled_out))} priced out)" if self.ruled_out else ""))
        grown = ""
        if self.budget.won_s > 0:
            grown = (f"; the budget {seconds(self.budget.total_s)}: {self.budget.basis()}")
        self.price = (f"trials: the configuration was final at batch {self.final_at}; the trials cost {seconds(cost)} against the "
                      f"settled configuration ({median:.4f} s a batch, the median of the {SETTLED_BATCHES} batches after), "
                      f"{100.0 * share:.1f}% of {whose} {planned:,} batches; {what}{grown}")
        self.info(self.price)

    def _target_line(self, batch: int) -> None:
        if not self.enabled or self.first is None or batch - self.first != TARGET_BATCH or self._said_target or self.final_at is not None:
            return
        left = [t for t in self.trials if t.running or t.pending]
        if not left and self.turn is None:
            return
        self._said_target = True
        running = [label for label in self._cost_now]
        left_s = max(0.0, sum(self.budget.running.values()) - sum(self._cost_now.values()))
        why = (f"the size settled at batch {self.first_steady}" if self.first_steady is not None
               else "the size has not settled yet")
        what = "; ".join(f"{t.name}: {t.projection()}" for t in left) or "a batch profile"
        self.info(f"trials: not final at batch {TARGET_BATCH} ({why}): about {seconds(left_s)} of predicted cost left"
                  + (f" ({', '.join(running)} running)" if running else "") + f"; left: {what}")

    def summary(self) -> str:
        """The summary line's part (empty before the price is known)."""
        if self.price is None:
            return ""
        return self.price.split("; ", 1)[1].split("; ")[0].replace("the trials cost", "trials cost", 1)


__all__ = ["DEFAULT_PLANNED", "PROFILE", "PlannedTrial", "SETTLED_BATCHES", "TARGET_BATCH", "TRIAL_CODES", "TrialPlan"]
