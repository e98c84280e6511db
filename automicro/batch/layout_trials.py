"""The layout search in a running job: `AutoMicrobatching` asks `LayoutTrials` which layout the
next batch runs at, reports the batch's outcome, and hands it memory pressure first.

Wires `automicro.core.layout.LayoutSearch` (which trade, when, kept or not) to the FSDP2 switches
(`automicro.engine.layout.LayoutEngine`), the batch clock (a device sync around each batch of a
trial only) and the consensus (one round per trial: every rank's times, max over ranks).

Owns: when a layout is applied, the trial clock, the console lines and metrics of the layout.
May not touch: the size policy, the attempt fence, Composer; torch privates (the engine's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from automicro.core.consensus import Consensus
from automicro.core.layout import (
    FUSED_HEAD, GRAD_SYNC_ONCE, GROWS, MEASURED, SIZE_FRACTIONS, TRADES, LayoutConfig, LayoutSearch, Priced, describe,
)
from automicro.core.policy import SAFETY_MARGIN, near_split, predict_max_size
from automicro.engine.layout import LayoutEngine
from automicro.engine.sharding import ShardedModel
from automicro.batch.trial_timing import CONCLUSIVE, BatchClock, agreed_times, enough


class LayoutTrials:
    """One run's layout. `engine` is None where nothing can be traded (no FSDP2 blocks, a pipeline). A trial of
    the plan (`automicro.batch.trial_plan`, "layout": the trades and the size trials, one at a time)."""

    name = "layout"
    profiled = True

    def __init__(
        self,
        config: LayoutConfig,
        sharded: ShardedModel,
        consensus: Consensus,
        info: Callable[[str], None],
        recoverable: bool,
        pipeline: bool,
    ) -> None:
        config = config.resolve(sharded.device.type)
        self.config = config
        self._consensus, self._info = consensus, info
        self.engine: Optional[LayoutEngine] = None
        candidates: list[str] = []
        if not pipeline and sharded.fsdp_modules:
            self.engine = LayoutEngine(sharded)
            candidates = self.engine.candidates()
        missing = [t for t in config.pinned if t not in candidates]
        if missing:
            where = "a pipeline stage" if pipeline else (
                "a model without FSDP2" if not sharded.fsdp_modules else "this model's FSDP2 settings"
            )
            raise ValueError(
                f"layout={list(config.pinned)!r}: {missing} cannot be used with {where} (no_reshard needs "
                "parallelism_config.fsdp2.reshard_after_forward: true, no_recompute needs "
                "parallelism_config.fsdp2.activation_checkpointing: true; all need FSDP2 without a pipeline); "
                "set layout: fixed or drop those trades"
            )
        if config.mode == "auto" and candidates and not recoverable:
            # An OOM in a trial runs with the sync hooks off: without the ledger it would end the job.
            info("layout search off: steady_recovery=false cannot recover an OOM in a trial (layout stays fixed)")
            candidates = []
        self.search = LayoutSearch(config, candidates)
        self._clock = BatchClock(sharded.device)
        self._timing = False  # the clock runs for the batch in progress (a trial's)
        self.layout: tuple[str, ...] = ()
        self._applied = False  # the engine's switches were set once (then only on a change)
        self.adopted: Optional[int] = None  # a kept downsize trial's size, for the size policy (once)
        self.last_run: tuple[str, ...] = ()  # the layout the last batch started at
        self.trial_batch = False
        self._peak_at: Optional[Callable[[int], Optional[tuple[int, int]]]] = None
        self._capacity = 0  # the agreed capacity the next batch was chosen under
        self._capacity_read = 0  # the capacity read (agreed), no ceiling applied: kept trades compare it
        self.undone: Optional[int] = None  # the size found without a kept upsize trade just undone (once)
        self.dropped = False  # the batch just run ended a timed trial whose trade was not kept (once: `take_dropped`)
        self._batch_size = 0  # the probe split's samples (this rank's batch)
        # Turns each measured batch time into the one judged (the identity). Tests replace it to
        # make a trade look faster or slower without depending on the machine's timing.
        self.timing: Callable[[tuple[str, ...], float], float] = lambda layout, seconds: seconds
        # A trial's price, asked before it starts (`automicro.batch.trial_plan.TrialPlan.admit`: None where it runs);
        # the training search sets it.
        self.priced: Priced = lambda label, kind, facts: None
        self.order: Callable[[list[str]], list[str]] = list  # the untried trades in the order they are tried
        self._outcome = ""  # what the last trial decided (its cost line's and the dashboards' words)
        self._one_microbatch = False
        self._quiet: Optional[tuple[Any, ...]] = None  # where given the batch and nothing was left to try
        self._key: tuple[Any, ...] = ()
        self.started_now = False  # a trial started with the batch in progress
        self.held_off = False  # the model runs unsharded for good (`sharding_choice`): FSDP2's trades change nothing
        # The bytes per sample the plain head holds from its forward to its backward, as the profiled batch measured
        # them (agreed; 0: not measured): the fused head's price predicts the size it fits from them. Set by the
        # training search.
        self.head_bytes: Callable[[], int] = lambda: 0
        self._count_at: Optional[Callable[[int], int]] = None
        self._largest_at: Optional[Callable[[int], int]] = None
        self._found: Optional[int] = None
        self._microbatches = 0
        self._probe_microbatches = 0
        if self.engine is not None:
            self._apply(self.search.settled)

    # ---- the plan's questions ---------------------------------------------------------------------

    @property
    def min_gain(self) -> float:
        return self.config.min_gain

    @property
    def pending(self) -> bool:
        """Something may be left to try: searching, and not found idle at this size and layout (with the model
        unsharded for good, only the fused head)."""
        return (self.engine is not None and self.search.searching and self.search.trial is None
                and (not self.held_off or self._head_pending())
                and (self._quiet != self._key or self.search.reprices()))

    @property
    def goes_first(self) -> bool:
        """The fused head is still to be decided (`trial_plan`: it changes what fits, so it goes before every other
        trial, the static recompile included)."""
        return self.engine is not None and self.search.searching and self._head_pending()

    def _head_pending(self) -> bool:
        return self.search.head_open(self._found)

    def head_facts(self) -> dict[str, float]:
        """What the fused head's price needs (`automicro.batch.trial_price`, kind ``fused_head``): the microbatches at
        the size found and at the size the plain head's measured bytes say the fused head fits (the memory model
        less those bytes per sample, under the policy's margin), the probe's microbatches (its measuring batch)."""
        found, count_at, peak_at = self._found, self._count_at, self._peak_at
        head = self.head_bytes()
        # Its measuring batch: near the size found's largest microbatch, else at the probe's split.
        near = (near_split(self._batch_size, self._largest_at(found), self.reduces_once)
                if found and self._largest_at and self._batch_size else None)
        facts = {"found_microbatches": float(self._microbatches), "measure": 1.0 if self._probe_microbatches else 0.0,
                 "measure_microbatches": float(len(near) if near else self._probe_microbatches), "near": float(near is not None),
                 "microbatches": float(self._microbatches)}
        if found is None or count_at is None or peak_at is None or not head or not self._capacity or not self._batch_size:
            return facts
        fits = under = found
        for n in range(found + 1, self._batch_size + 1):
            projected = peak_at(n)
            if projected is None:
                break
            largest, peak = projected
            if peak - largest * head > self._capacity:
                break
            under = n
            if peak - largest * head <= self._capacity * SAFETY_MARGIN:
                fits = n
        past = self._past_margin(fits, under)  # as its trial will choose (`_measured_upsize`)
        if past is not None:
            facts["past_margin"] = 1.0  # a size over the margin: one batch an OOM there may rerun
        fits = past or fits
        facts["microbatches"] = float(count_at(fits))
        facts["fits"] = float(fits)
        return facts

    def _past_margin(self, margin: int, capacity: Optional[int]) -> Optional[int]:
        """A size past the policy's margin worth its risk: where the largest size a measured line puts under the
        capacity itself (`capacity`) runs fewer microbatches than the largest under the margin (`margin`), the
        smallest size that runs as few; None where there is none (or no split to count). The margin is there for a
        line extrapolated past the sizes it was measured at; a microbatch more for it is a batch's fixed work again
        (Mixtral's 2 blocks on one H100: the fused head's line put 6 under the margin, 3 microbatches, and 8 under the
        capacity, 2; 8 ran at 98% of the card by hand, 4% faster). The trial at that size is the check: where it runs
        out, its trade is tried at `margin` (`automicro.core.layout.LayoutSearch.relieve`)."""
        count_at = self._count_at
        if count_at is None or capacity is None or capacity <= margin:
            return None
        fewest = count_at(capacity)
        if fewest >= count_at(margin):
            return None
        return next(n for n in range(margin + 1, capacity + 1) if count_at(n) == fewest)

    @property
    def running(self) -> bool:
        return self.trial_running

    @property
    def label(self) -> Optional[str]:
        """The running trial's label (`automicro.core.layout.Trial.label`), None when none runs."""
        trial = None if self.engine is None else self.search.trial
        return None if trial is None else trial.label

    def candidates(self) -> list[tuple[str, str, dict[str, float]]]:
        """The trades still to try at this size and layout (the downsize, upsize and size trials are priced as they
        come: their sizes are chosen then)."""
        if self.engine is None:
            return []
        head = [(FUSED_HEAD, FUSED_HEAD, self.head_facts())] if self._head_pending() and FUSED_HEAD not in self.search.fits_up_to else []
        if self.held_off:
            return head
        return head + [(t, t, {}) for t in self.search._untried() if not (t == GRAD_SYNC_ONCE and self._one_microbatch)]

    def outcome(self) -> str:
        return self._outcome

    @property
    def won_s(self) -> float:
        """What the trades and sizes it kept (and still keeps) won a batch, as timed."""
        return 0.0 if self.engine is None else self.search.won_s()

    def rule_out(self, why: str) -> None:
        self._quiet = self._key
        self._info(f"layout: no trade nor smaller microbatch tried: {why}")

    def projection(self) -> str:
        return f"{2 * self.config.trial_batches} batches a trial, for each trade and smaller microbatch left to try"

    # ---- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.search.state_dict()

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if state:
            self.search.load_state_dict(state)
            if self.engine is not None:
                self._apply(self.search.settled)
                if self.layout:
                    self._info(f"resumed with layout: {describe(self.layout)}")

    # ---- one batch -------------------------------------------------------------------------------

    def before_batch(
        self, steady: bool, peak_bytes: int, capacity_bytes: int, size: Optional[int] = None,
        found: Optional[int] = None, peak_at: Optional[Callable[[int], Optional[tuple[int, int]]]] = None,
        measure_split: Optional[tuple[int, ...]] = None, largest_at: Optional[Callable[[int], int]] = None,
        capacity_read: int = 0, outside_bytes: int = 0, size_fractions: tuple[float, ...] = SIZE_FRACTIONS,
        size_unit: str = "samples", microbatches: int = 0, count_at: Optional[Callable[[int], int]] = None,
    ) -> None:
        """Choose and apply the next batch's layout; start the clock during a trial. `size`: the
        next batch's largest microbatch (a trade that did not fit at a larger one may be tried
        again); `found`: the size found; `peak_at(n)`: (the largest microbatch, the size policy's
        projected peak) were the size found `n` (None: no projection, or below the smallest size
        allowed). A downsize trial runs only at a split whose largest microbatch is below `size`.
        `measure_split`: the probe's split, where a measured trade's bytes can be measured (None:
        they cannot; `measure_split_next` says when the next batch runs it). `largest_at(n)`: the largest
        microbatch of the split were the size found `n`. `capacity_read`: the capacity as read (the
        least over ranks, no ceiling applied), against which a kept upsize trade is reconsidered
        (`take_undone` then gives the size policy the size found without it). `outside_bytes`: the most
        another process holds on any rank's device (agreed; 0: no card shared): no upsize trial then.
        `microbatches`: how many the settled split runs (0: unknown): with one, gradients are reduced once per
        batch already and ``grad_sync_once`` is not tried (again once the microbatch is smaller). `count_at(n)`: the
        microbatches of the split a size found of `n` runs (a size trial's price)."""
        if self.engine is None:
            return
        engine = self.engine
        self._capacity_read = capacity_read
        held = engine.recompute_held
        self.search.held = {t: held for t in self.search.upsize} if held is not None else {}
        undone, lines = self.search.reconsider(capacity_read) if size is not None else (None, [])
        if undone is not None:
            self.undone, steady = undone, False  # the size is searched again first: no trial now
            for line in lines:
                self._info(line)

        def fits(trade: str) -> Optional[str]:
            extras = [engine.extra_bytes(t) for t in trade.split("+")]  # "a+b": trades tried together
            if any(e is None for e in extras):
                return None  # not projected: the trial's first batch measures it (OOM-safe)
            extra = sum(e for e in extras if e is not None)
            if not capacity_bytes or not peak_bytes or peak_bytes + extra <= capacity_bytes:
                return None
            return (
                f"needs {extra / 2**20:.1f} MiB more than the peak {peak_bytes / 2**20:.1f} MiB, "
                f"capacity {capacity_bytes / 2**20:.1f} MiB"
            )

        search = self.search

        def projected(trades: tuple[str, ...], n: int) -> Optional[tuple[int, float]]:
            """(The largest microbatch, the peak with `trades` on top of the settled layout) were the size found `n`.
            A measured trade's own memory model (`MeasuredLine`, measured on top of the layout settled now) gives the
            peak, else the size policy's; the other trades add their bytes (`LayoutEngine.extra_bytes`). None: not
            projected."""
            measured = [t for t in trades if t in MEASURED]
            if len(measured) > 1 or (measured and not search.measured_on_settled(measured[0])):
                return None  # two measured trades (two rungs of one dial), or one not measured on this layout
            if measured:
                line = search.lines[measured[0]]
                if largest_at is None or line is None:
                    return None
                largest = largest_at(n)
                peak = line.peak(largest)
            else:
                at = None if peak_at is None else peak_at(n)
                if at is None:
                    return None
                largest, peak = at
            extras = [engine.extra_bytes(t) for t in trades if t not in MEASURED]
            if any(e is None for e in extras):
                return None
            return largest, peak + sum(e for e in extras if e is not None)

        def smaller(trades: tuple[str, ...]) -> Optional[int]:
            if found is None or not capacity_bytes:
                return None
            # A measured slope (at the smallest sizes) is extrapolated: under the policy's margin.
            room = capacity_bytes * (SAFETY_MARGIN if any(t in MEASURED for t in trades) else 1.0)
            for n in range(found - 1, 0, -1):
                at = projected(trades, n)
                if at is None:
                    return None
                largest, peak = at
                if (size is None or largest < size) and peak <= room:
                    return n
            return None

        self._key = (found, self.search.settled, size)
        self._one_microbatch = microbatches == 1
        measure_at = None
        if measure_split and found is not None and capacity_bytes:
            measure_at = min(measure_split)
            self._batch_size = sum(measure_split)
        self._peak_at, self._capacity = peak_at, capacity_bytes
        self._found, self._count_at, self._largest_at, self._microbatches = found, count_at, largest_at, microbatches
        self._probe_microbatches = len(measure_split) if measure_split and measure_at is not None else 0
        started = self.search.trial
        layout, lines = self.search.layout_for_batch(
            steady, fits, size, found, smaller, measure_at, largest_at, capacity_bytes,
            sum(measure_split) if measure_split else None, outside_bytes, size_fractions, size_unit, self.priced,
            one_microbatch=microbatches == 1, count_at=count_at, microbatches=microbatches, order=self.order,
            head_facts=self.head_facts() if self._head_pending() else None, head_only=self.held_off,
        )
        trial = self.search.trial
        self.started_now = trial is not None and trial is not started
        if steady and trial is None:
            self._quiet = self._key
        if trial is not None and trial is not started and trial.size is not None and not trial.measure:
            at = projected(trial.trades, trial.size)
            if at is not None:
                lines.append(
                    f"layout trial {trial.trade} at microbatch {trial.size}: projected peak "
                    f"{at[1] / 2**20:.1f} MiB, capacity {capacity_bytes / 2**20:.1f} MiB"
                )
        for line in lines:
            self._info(line)
        self._apply(layout)
        self.last_run = layout
        # A trial's "with" batch: its peak is the trade's, not the layout's the size policy models.
        self.trial_batch = self.search.trial is not None and self.search.trial.next_on
        self._timing = False
        if self.search.trial is not None:
            self._clock.start()
            self._timing = True

    @property
    def measure_near(self) -> Optional[int]:
        """The largest microbatch the next measuring batch runs near (`automicro.core.policy.near_split`: the fused
        head's), None where it runs the probe's split."""
        trial = None if self.engine is None else self.search.trial
        return trial.size if trial is not None and trial.measure and trial.trades == (FUSED_HEAD,) else None

    @property
    def reduces_once(self) -> bool:
        """The layout in effect reduces the gradients once per batch (``grad_sync_once``): in the last microbatch's
        backward, whose peak then holds the reduction's buffers (`automicro.core.memory.MicrobatchPeaks`)."""
        return GRAD_SYNC_ONCE in self.layout

    @property
    def measure_split_next(self) -> bool:
        """The next batch measures a trade's bytes: it runs at the probe's split, its microbatch
        peaks tracked (`after_success` takes them)."""
        trial = None if self.engine is None else self.search.trial
        return trial is not None and trial.measure and not trial.on

    def after_success(self, attempts: int, peaks_by_size: tuple[tuple[int, int], ...] = (), weight: float = 1.0,
                      peak: int = 0) -> None:
        """The batch succeeded (and the optimizer stepped); `peaks_by_size`: its agreed microbatch
        peaks by size, where they were tracked; `weight`: its work against an average batch's (a
        variable-length batch: its real tokens over the average's), its time judged per average
        batch; `peak`: its peak bytes, the max over ranks (each arm's highest is the trade's memory as measured). A
        batch that retried is not timed."""
        if self.engine is None:
            return
        self.engine.reset()
        if not self._timing or self.search.trial is None:
            return
        seconds = self._clock.stop()
        self._timing = False
        if attempts == 1:
            self.search.observe(self.layout, self.timing(self.layout, seconds / (weight or 1.0)), peak)
        trial = self.search.measuring
        if trial is not None:
            self._outcome = "measured"
        if trial is not None and trial.trades[0] in self.search.upsize + GROWS:
            self._info(self._measured_upsize(sorted(peaks_by_size)))
            self._apply(self.search.settled)
            return
        if trial is not None:
            # The layout with the trade, its own memory model through its smallest and largest microbatch's peaks (the
            # size policy's may mix layouts: a trade kept or the head fused since its samples were taken).
            line, how = None, ""
            by_size = sorted(peaks_by_size)
            if len(by_size) >= 2:
                (s1, p1), (s2, p2) = by_size[0], by_size[-1]
                per_sample = (p2 - p1) / (s2 - s1)
                line = (p1 - s1 * per_sample, per_sample)
                how = f"peaks {p1 / 2**20:.1f} MiB at microbatch {s1}, {p2 / 2**20:.1f} MiB at {s2}"
            self._info(self.search.measured(line, how))
            self._apply(self.search.settled)
            return
        trial = self.search.trial
        if trial is not None and not trial.measure and enough(
            self._consensus, [trial.on, trial.off], self.config.trial_batches, self.config.min_gain, extend=True,
        ):
            sides = min(len(trial.on), len(trial.off))
            result = self.search.decide(agreed_times(self._consensus, self.search.local_times()), self._capacity_read)
            self._outcome = "kept" if result.kept else "not kept"
            self.dropped = not result.kept
            extended = (f" (over {sides} batches a side: at {self.config.trial_batches} its gain was under "
                        f"{CONCLUSIVE:g}x its spread)" if sides > self.config.trial_batches else "")
            self._info(result.line() + extended)
            saved = self.search.saves.get(result.trade.split("+")[0]) if result.kept else None
            if saved is not None:
                self._info(f"layout trade {result.trade}: its batches peaked at {saved[0] / 2**30:.2f} GiB at most, those "
                           f"without it at {saved[1] / 2**30:.2f} GiB at least: it saves memory here, so memory pressure "
                           "does not undo it")
            if result.kept and result.size is not None:
                self.adopted = result.size
            self._info(f"layout now: {describe(self.search.settled)}")
            self._apply(self.search.settled)

    def _measured_upsize(self, by_size: list[tuple[int, int]]) -> str:
        """A trade in UPSIZE or GROWS was on in this batch at the probe's split (the fused head: near the size found,
        `automicro.core.policy.near_split`): its own memory model
        (fixed bytes and bytes per sample through the smallest and largest microbatch's peaks) gives
        the largest microbatch under the policy's margin, at most the batch."""
        fits_up_to, how, fallback = None, "", None
        if len(by_size) >= 2 and self._capacity and self._batch_size:
            (s1, p1), (s2, p2) = by_size[0], by_size[-1]
            samples = ((s1, p1, self._capacity), (s2, p2, self._capacity))
            largest = predict_max_size(samples, SAFETY_MARGIN)
            if largest is not None and largest >= 1:
                fits_up_to = min(largest, self._batch_size)
                how = (
                    f"{(p2 - p1) / (s2 - s1) / 2**20:.2f} MiB per sample with it at microbatches {s1} and {s2}, "
                    f"peak {p2 / 2**20:.1f} MiB at {s2}, capacity {self._capacity / 2**20:.1f} MiB"
                )
                under = predict_max_size(samples, 1.0)
                past = self._past_margin(fits_up_to, None if under is None else min(under, self._batch_size))
                if past is not None and self._count_at is not None:
                    fallback, fits_up_to = fits_up_to, past
                    how += (
                        f"; {fallback} under the {100 * SAFETY_MARGIN:g}% margin runs {self._count_at(fallback)} "
                        f"microbatches, {past} under the capacity {self._count_at(past)}: tried at {past}, at "
                        f"{fallback} if it runs out"
                    )
        return self.search.measured(None, how, fits_up_to=fits_up_to, capacity=self._capacity, fallback=fallback)

    @property
    def trial_size(self) -> Optional[int]:
        """The size found the next batch runs at instead of the policy's (a downsize or upsize trial's batch)."""
        return None if self.engine is None else self.search.trial_size

    def take_adopted(self) -> Optional[int]:
        size, self.adopted = self.adopted, None
        return size

    def take_undone(self) -> Optional[int]:
        size, self.undone = self.undone, None
        return size

    def take_dropped(self) -> bool:
        """True once after the batch that ended a timed trial whose trade was not kept: the batches before were the
        trial's, and the allocator's pool still holds the dropped trade's shapes."""
        dropped, self.dropped = self.dropped, False
        return dropped

    @property
    def trial_running(self) -> bool:
        """A layout trial is under way (its batches alternate a layout or a size)."""
        return self.engine is not None and self.search.trial is not None

    def relieve(self, why: str, size: Optional[int] = None) -> Optional[str]:
        """Memory pressure at the settled size (largest microbatch `size`): undo a trade (the console
        says which) and return it, or None when the layout has nothing left to give."""
        if self.engine is None:
            return None
        running = self.search.trial is not None
        failed_layout = self.layout
        undone = self.search.relieve(failed_layout, why, size, self._capacity)
        self._timing = False
        if running:
            self._outcome = f"ended: {why}"
        if undone is not None:
            self._apply(self.search.settled)
            self._info(f"layout: undid {undone} ({why}); layout now: {describe(self.layout)}")
        if self.search.fell_back is not None:
            trade, past, below = self.search.fell_back
            what = "head: fused" if trade == FUSED_HEAD else f"layout trade {trade}"
            arm = "" if trade in failed_layout else f" in the batch without it, after its own at {past}"
            self._info(f"{what} at microbatch {past}, past the margin: {why}{arm}; tried at {below}, the size under the "
                       f"{100 * SAFETY_MARGIN:g}% margin, next")
        return undone

    def head_failed(self, what: str) -> bool:
        """A batch with the fused head the trials put on failed with an error that is not an OOM (`what`): the plain
        head for the rest of the run, the trial ended or the kept head undone, one line. False where the fused head
        was not on (the error is the model's own: it ends the run as any error does)."""
        head = None if self.engine is None else self.engine.head
        if head is None or not head.switchable or FUSED_HEAD not in self.layout:
            return False
        search = self.search
        if search.trial is not None and FUSED_HEAD in search.trial.trades:
            search.trial = None
            self._timing = False
        if FUSED_HEAD in search.kept:
            search.kept.remove(FUSED_HEAD)
        if FUSED_HEAD in search.candidates:
            search.candidates.remove(FUSED_HEAD)
        self._outcome = f"ended: {what}"
        self._apply(search.settled)
        self._info(f"head: plain for the rest of the run: a batch with the fused head failed ({what}); the batch is rerun "
                   "with the plain head (where training reads the logits, head: plain says so from the start)")
        return True

    def recompute_floor(self) -> Optional[str]:
        """The ladder below size 1 (`automicro.batch.floor_ladder`): every block's checkpointing on, applied now
        (between attempts); the trade changed, None where none could be (`LayoutSearch.recompute_floor`)."""
        if self.engine is None:
            return None
        changed = self.search.recompute_floor(self.engine.can_recompute, selective=getattr(self.engine, "can_select", False))
        if changed is not None:
            self.trial_batch, self._timing = False, False
            self._clock.stop()
            self._apply(self.search.current)
        return changed

    # ---- evaluation --------------------------------------------------------------------------------

    def suspend(self) -> None:
        if self.engine is not None:
            self.engine.suspend()

    def resume(self) -> None:
        if self.engine is not None:
            self.engine.resume()

    # ---- figures -----------------------------------------------------------------------------------

    def describe(self) -> str:
        return describe(self.search.settled)

    def metrics(self) -> dict[str, int]:
        if self.engine is None:
            return {}
        row = {f"automicro/layout_{t}": int(t in self.layout) for t in TRADES if t != FUSED_HEAD}
        row["automicro/head_fused"] = int(self.engine.head is not None and self.engine.head.fused)
        row["automicro/layout_trial"] = int(self.search.trial is not None)
        # The ladder below size 1 stepped (`floor_ladder`): the blocks checkpoint because size 1 did not fit without.
        row["automicro/floor_ladder"] = len(self.search.floor)
        return row

    def _apply(self, layout: tuple[str, ...]) -> None:
        assert self.engine is not None
        if layout != self.engine.layout or not self._applied:
            self.engine.apply(layout)
            self._applied = True
        self.layout = layout


__all__ = ["LayoutTrials"]
