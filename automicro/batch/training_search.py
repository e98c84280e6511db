"""The training batch under `auto`: each attempt's agreed verdict becomes the size policy's next
decision, until the batch trains (`TrainingSearch.train_batch`, called by `automicro.Trainer` through
the callback).

`BatchStep` splits, runs (through the attempt fence, with the sync hooks on or off) and wipes each
attempt; the batch kind (`batch_kinds`) says what sizes are counted in; the layout trials
(`layout_trials`) get the memory pressure at the settled size first. Here: the loop, the attempt
history, the OOM and search-time counters, thrash detection, the optimizer state the first step
will add, the failure note of a run that could not recover, and this room's part of the checkpoint.

Owns: the policy and its checkpointed state, the history. May not touch: Composer or the loop that
owns the batch (asked through its `BatchHost`: Composer's events reach here through the callback,
a plain loop's through `automicro.AutoStep`), FSDP2 internals (the engine's `recover()` does).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
import traceback
from typing import Any, Optional, TypeVar

import torch

from automicro.core import exit_watch, failure_note, headroom
from automicro.core import policy as search
from automicro.core.attempt import is_oom
from automicro.core.consensus import KIND_ERROR, FailedOnOtherRank, LocalFigures, OOMOnOtherRank, Verdict
from automicro.core.ledger import FatalRecoveryError
from automicro.core.memory import capacity_and_outside
from automicro.core.metrics import AttemptRecord, BatchFigures, history_from_state, history_to_state
from automicro.core.optimizer_memory import pending_state_bytes
from automicro.core.policy import HookReason
from automicro.core.thrash import ThrashDetector
from automicro.engine.compile import compile_seconds, compiled_graphs, graph_breaks
from automicro.batch.batch_host import BatchHost
from automicro.batch.batch_step import BatchStep
from automicro.batch.compile_scope import ScopeChoice
from automicro.batch.compile_shapes import StaticShapes
from automicro.batch.floor_ladder import FloorLadder
from automicro.batch.host_offload import HostOffload
from automicro.batch.state_fit import StateFit, measure
from automicro.batch.packing_choice import PackingChoice
from automicro.batch.compile_watch import CompileWatch
from automicro.batch.forward_state import ForwardState
from automicro.batch.routing import RoutingWatch
from automicro.batch.sharding_choice import ShardingChoice
from automicro.batch.thrash_timing import ThrashTiming
from automicro.batch.trial_plan import TrialPlan
from automicro.batch.layout_trials import LayoutTrials
from automicro.batch.memory_truth import MemoryTruth, reached_bytes
from automicro.batch.runtime import Runtime
from automicro.batch.settings import Settings

E = TypeVar("E", bound=BaseException)

log = logging.getLogger(__name__)


def _in_words(error: BaseException) -> str:
    """An error's type and the first line of its message, for a console line."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}{': ' + first if first else ''}"


class MicrobatchSizeError(RuntimeError):
    """Even a microbatch of one sample does not fit: raised on every rank."""


class TrainingSearch:
    """One rank's training search (the same decisions on every rank: each verdict is agreed)."""

    def __init__(self, settings: Settings, runtime: Runtime) -> None:
        self.config = settings.policy_config
        self.kind = settings.kind
        self.start = settings.start
        self.runtime = runtime
        self.thrash = ThrashDetector(settings.thrash_batches)
        # A thrash's retrying batches timed against the size below it (`thrash_timing`): on at configure, on a GPU.
        self.thrash_timing = ThrashTiming(settings.thrash_batches, settings.layout_config.min_gain,
                                          lambda: runtime.consensus, lambda line: runtime.info(line))
        self.layout: Optional[LayoutTrials] = None  # set at attach
        self.policy: Optional[search.SearchPolicy] = None
        self.history: list[AttemptRecord] = []
        self.ooms_total = 0
        self.search_time_s = 0.0
        self.used_split: tuple[int, ...] = ()  # the split of the last batch that trained
        self.batch_attempts = 0
        self.batch_retries = False
        self.last_capacity = 0
        self.agreed_error: Optional[BaseException] = None  # a failure every rank agreed on
        self.memory_truth = MemoryTruth(lambda: runtime.memory, lambda: runtime.rank, settings.log_attempts)
        self._last_peak = self._last_outside = 0
        # Every rank's peak in each settling batch, and the sizes found whose headroom was decided (`_headroom`).
        self._settling_peaks: list[list[int]] = []
        self._headroom_checked: set[int] = set()
        self._pending_policy: Optional[dict[str, Any]] = None  # from a checkpoint, applied at the first batch
        self._layout_state: Optional[dict[str, Any]] = None
        self._one_rank_state: Optional[dict[str, Any]] = None  # `sharding_choice`'s, from a checkpoint
        self._optimizer_pending = 0  # bytes the first optimizer step will allocate on this rank
        self._optimizer_state_known = False
        self._step: Optional[BatchStep] = None  # the batch in progress (or the last one)
        self.static_shapes: Optional[StaticShapes] = None  # made at the first batch (`_static_shapes`)
        self.compile_scope: Optional[ScopeChoice] = None  # the same (`_compile_scope`)
        self.packing_choice: Optional[PackingChoice] = None  # packed or padded, measured (`packing_choice`)
        self.sharding_choice: Optional[ShardingChoice] = None  # one rank: FSDP2 or unsharded (`sharding_choice`)
        self.plan: Optional[TrialPlan] = None  # which trial holds the next batch (`trial_plan`)
        self.ladder: Optional[FloorLadder] = None  # below size 1 (`floor_ladder`), made at the first batch
        # The ladder's last rung (``offload: auto``, `host_offload`): checked at attach.
        self.offload = HostOffload(settings.offload, runtime.info)
        # Parameters, gradients and the first step's optimizer state against the capacity, once a launch (`state_fit`).
        self.state_fit = StateFit(runtime.info)
        # The launch's first batch's seconds where it trained in one attempt (its compile: the trials' price), else 0.
        self._first_batch_s: Optional[float] = None
        # A routed model's routers, watched (`routing`): made at the first batch; False for a model without one.
        self.routing: Any = None
        # Graph breaks and graphs compiled after the configuration is final (`compile_watch`): made with the plan.
        self.compile_watch: Optional[CompileWatch] = None
        # The model's buffers a failed attempt wrote, undone in its wipe (`forward_state`): made at the first batch.
        self.forward_state: Optional[ForwardState] = None
        self._plan_steady = False  # the batch in progress was given to the trials with the size settled
        # The one-rank trial's times of the configuration that won: (split, agreed times, configuration).
        self._reuse: Optional[tuple[tuple[int, ...], list[float], tuple[Any, ...]]] = None

    def configure(self, device_type: str, pipeline: Any) -> None:
        """At attach: how the search starts on this device, and a pipeline's sizes."""
        if pipeline is not None:
            self.kind.check_pipeline()
        self.offload.check(device_type, pipeline is not None, self.runtime.sharded)
        if self.start == "auto" and device_type == "cuda":
            self.config = dataclasses.replace(self.config, probe=True)
        timing = self.thrash_timing
        timing.enabled = (timing.enabled or device_type == "cuda") and self.config.search == "bisect"
        if pipeline is not None and self.start == "probe":
            raise ValueError(
                "AutoMicrobatching(start_size='probe') cannot run pipeline stages (a pipeline runs equal microbatches, "
                "the probe two sizes); leave start_size out or set it to 'batch' or a size"
            )
        if pipeline is not None:
            # Only equal microbatches, enough for the schedule.
            self.config = dataclasses.replace(self.config, sizes_for=pipeline.microbatch_sizes)
            self.runtime.info(
                f"pipeline stage {pipeline.stage_index} of {pipeline.pipeline.layout.num_stages} "
                f"({pipeline.pipeline.config.schedule}, {pipeline.dp_size} data-parallel rank(s) per stage)"
            )

    # ---- the sync hooks --------------------------------------------------------------------------

    def apply_hooks(self, want: bool, reason: HookReason, detail: str = "") -> None:
        now = self.runtime.set_hooks(want, reason)
        if now is None:
            return
        if not now and self.policy is not None and reason is HookReason.STABLE:
            self.runtime.info(f"sync hooks off after {self.config.stable_batches} clean batches at {self.kind.stable_at(self.policy)}")
        else:
            self.runtime.info(f"sync hooks {'on' if now else 'off'} ({reason.value}{': ' + detail if detail else ''})")

    def rearm(self, reason: str) -> None:
        if self.policy is None:
            return
        decision = self.policy.observe(search.Rearm(reason))
        self.apply_hooks(decision.hooks, decision.reason, reason)

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": None if self.policy is None else self.policy.state.to_dict(),
            "ooms_total": self.ooms_total,
            "thrash_events": self.thrash.events,
            "search_time_s": self.search_time_s,
            "history": history_to_state(self.history),
            "tokens": self.kind.state_dict(),
            "layout": None if self.layout is None else self.layout.state_dict(),
            "one_rank": None if self.sharding_choice is None else self.sharding_choice.state_dict(),
            "offload": self.offload.state_dict(),
            "thrash_timing": self.thrash_timing.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending_policy = state.get("policy")
        self.ooms_total = int(state.get("ooms_total", 0))
        self.thrash.events = int(state.get("thrash_events", 0))
        self.search_time_s = float(state.get("search_time_s", 0.0))
        self.history = history_from_state(state.get("history", []))
        self.kind.load_state_dict(state.get("tokens"))
        self._layout_state = state.get("layout")
        self._one_rank_state = state.get("one_rank")
        self.offload.load_state_dict(state.get("offload"))
        self.thrash_timing.load_state_dict(state.get("thrash_timing"))

    # ---- the dashboards' figures -----------------------------------------------------------------

    def batch_figures(self) -> Optional[BatchFigures]:
        """The figures of the batch that just trained (None before the first)."""
        if self.policy is None or not self.used_split:
            return None
        budget_tokens, padding_waste = self.kind.metric_figures()
        return BatchFigures(
            split=self.used_split,
            attempts=self.batch_attempts,
            ooms_total=self.ooms_total,
            searching=self.policy.phase == search.Phase.SEARCHING,
            hooks_active=self.runtime.hooks_active,
            thrash_events=self.thrash.events,
            search_time_s=self.search_time_s,
            alloc_retries=self.batch_retries,
            found_size=self.policy.found_size or 0,
            budget_tokens=budget_tokens,
            padding_waste=padding_waste,
            capacity_bytes=self.last_capacity,
            peak_bytes=int(self._last_peak or 0),
        )

    def trial_metrics(self) -> dict[str, float]:
        """`automicro/trial` and `automicro/trials_s` of the batch that just trained (`TrialPlan.metrics`), and
        `automicro/host_offload` (the ladder's last rung: 0 unless it was stepped)."""
        return {**({} if self.plan is None else self.plan.metrics()), **self.offload.metrics()}

    def trial_traces(self) -> list[dict[str, Any]]:
        """One `automicro/trial` trace per trial that ended since the last call: its label, kind, batches, outcome,
        real and predicted cost."""
        return [] if self.plan is None else [{"automicro/trial": record} for record in self.plan.take_records()]

    def summary_line(self, per_rank_batch: Optional[int] = None) -> Optional[str]:
        """What the search found, for the console at the end of a run (None before any batch)."""
        if self.policy is None:
            return None
        tail = f"attempts {len(self.history)}, OOMs {self.ooms_total}; sync hooks {'on' if self.runtime.hooks_active else 'off'}"
        layout = "" if self.layout is None or self.layout.engine is None else f"; layout: {self.layout.describe()}"
        if self.sharding_choice is not None and self.sharding_choice.state in ("unsharded", "sharded"):
            how = "measured" if self.sharding_choice.result is not None else "not timed"
            tail += f"; one rank: {'the model unsharded' if self.sharding_choice.state == 'unsharded' else 'FSDP2'} ({how})"
        head = getattr(self.runtime.sharded, "head", None)
        if head is not None:
            tail += f"; head: {head.describe()}"
        if self.ladder is not None and self.ladder.summary():
            tail += f"; {self.ladder.summary()}"
        if self.plan is not None and self.plan.summary():
            tail += f"; {self.plan.summary()}"
        return self.kind.summary(self.policy, per_rank_batch, layout, self.used_split, tail)

    def figures(self) -> LocalFigures:
        """This rank's figures for each attempt's agreement (the fence asks)."""
        memory = self.runtime.memory
        retries = memory.alloc_retries()
        new = max(0, retries - (self._step.retries_before if self._step is not None else retries))
        peak = memory.peak_bytes() if self._step is None else self._step.peak_bytes()
        capacity, outside = capacity_and_outside(memory)  # read on every attempt: other processes share cards
        return LocalFigures(
            new_alloc_retries=new,
            # Before the first optimizer step: the peak the next batches will see, with the state
            # that step creates (`automicro.core.optimizer_memory`).
            peak_bytes=peak + self._optimizer_pending if peak else 0,
            projected_bytes=self._optimizer_pending if peak else 0,
            capacity_bytes=capacity,
            allocated_bytes=memory.allocated_bytes(),
            microbatch_tokens=self.kind.microbatch_tokens(),
            outside_bytes=outside,
        )

    # ---- the batch -------------------------------------------------------------------------------

    def train_batch(self, host: BatchHost) -> dict[str, torch.Tensor]:
        """Run the host's batch with OOM-safe retries; returns the host's total loss dict (Composer's
        trainer through `ComposerHost`, a plain loop through `automicro.AutoStep`'s host)."""
        rt = self.runtime
        assert rt.fence is not None and rt.sharded is not None and rt.consensus is not None, "attach() was not called"
        if self.forward_state is None:
            self.forward_state = ForwardState(rt.sharded.module, rt.info)
        step = BatchStep(
            host, rt.fence, rt.dispatcher, rt.memory, rt.consensus, rt.sharded, rt.rank,
            pipeline=rt.pipeline, tokens=self.kind.tokens, all_reduce=rt.all_reduce_sum,
            layout=None if self.layout is None else self.layout.engine, forward_state=self.forward_state,
        )
        self._step = step
        packing = self._packing_choice()
        # One place decides which trial holds this batch (`trial_plan`): the size must have settled (last batch's
        # verdict), and each trial runs alone; each trial below is given the batch only where the size is still
        # settled after this batch's own checks (`_steady()` again: a new batch size, a layout trade undone).
        plan = self._trial_plan()
        planned = getattr(host, "planned_batches", None)
        plan.planned_batches = planned() if callable(planned) else None
        watchdog = rt.watchdog
        if watchdog is not None:  # what the batch should cost is known once the plan has given it (below)
            watchdog.batch(step.batch_index, False, f"training batch {step.batch_index}")
        # While a thrash's size below is timed (`thrash_timing`), its batches are no trial's.
        turn = plan.before_batch(step.batch_index, self._steady() and not self.thrash_timing.holding, self._configuration)
        if watchdog is not None:  # a settled batch should take the settled median (`core.watchdog`)
            watchdog.settled = self._steady() and turn is None
            watchdog.phase = (f"training batch {step.batch_index} ("
                              + ("settled" if watchdog.settled else f"{'the ' + turn + ' trial' if turn else 'the size search'}") + ")")
        if packing is not None:  # before the batch's domain is agreed (`step.begin`)
            packing.before_batch(turn == "packing" and self._steady(), self._steady())
        self.offload.before_batch(step.batch_index, host.optimizers())  # taken after the last batch, or a checkpoint's
        self._optimizer_pending = self._pending_optimizer_bytes(host.optimizers())
        self._ensure_policy(step.begin(), host)
        assert self.policy is not None and self.layout is not None
        if not self.state_fit.checked:
            self._check_state_fits(host)
        if self._layout_state is not None:
            self.layout.load_state_dict(self._layout_state)
            self._layout_state = None
        sharding = self._sharding_choice()
        # Where the model runs unsharded for good, FSDP2's layout trades change nothing: none is tried.
        self.layout.held_off = sharding.blocks_layout
        self.layout.before_batch(
            turn == "layout" and self._steady(), self._last_peak, self.policy.usable_bytes(self.last_capacity),
            *self.kind.layout_figures(self.policy, self._peak_at, self.config.probes),
            capacity_read=self.last_capacity or 0, outside_bytes=self._last_outside, size_fractions=self.kind.size_fractions,
            size_unit=self.config.unit, microbatches=len(self.policy.current_split()) if self.config.unit == "samples" else 0,
            count_at=(lambda n: len(self.policy.split_for(n))) if self.config.unit == "samples" else None,
        )
        undone = self.layout.take_undone()
        if undone is not None:
            decision = self.policy.observe(search.Adopt(undone, reopen=True, capacity_bytes=self.last_capacity))
            self.apply_hooks(decision.hooks, decision.reason, "a layout trade undone")
            rt.info(decision.event)
        static, scope = self._static_shapes(), self._compile_scope()
        engine = self.layout.engine
        if scope.pending and engine is not None and engine.recomputes:
            # Checkpointing switched on inside a whole-model graph recomputes other values than its forward saved
            # (torch 2.11 and 2.15): each block stays compiled while the blocks checkpoint.
            scope.rule_out("the blocks checkpoint their activations, which a whole-model graph cannot recompute")
        steady = self._steady()
        settled_split = tuple(self.policy.current_split())
        static.before_batch(turn == "static" and steady, settled_split)
        scope.before_batch(turn == "scope" and steady, settled_split)
        step.twin = sharding.before_batch(turn == "one_rank" and steady, settled_split, self.kind.stable_at(self.policy))
        # What holds this batch, now that the trials have started theirs (a layout trade's or size trial's own label).
        trial = {"layout": self.layout}.get(turn or "") or next((t for t in plan.trials if t.name == turn), None)
        plan.hold(None if trial is None else trial.label, turn)
        self._plan_steady = steady
        batch_index = step.batch_index
        while True:
            # A pipeline's per-step barriers come off with the sync hooks (a failed stage drains the
            # schedule instead, `automicro.engine.pipeline`); steady_recovery=False keeps them on.
            hooks_on = rt.hooks_active or (rt.pipeline is not None and not rt.settings.steady_recovery)
            split, budget, track = self.kind.next_attempt(self.policy, self.layout, self.config.probes)
            if rt.watchdog is not None:
                rt.watchdog.beat()
            routing = self._routing()
            if routing is not None:
                routing.begin_attempt()
            try:
                attempt = step.attempt(split, budget, hooks_on, track_peaks=track, last_apart=track and self.layout.reduces_once)
            except FatalRecoveryError as lost:
                self._ends_run(lost)
                raise
            self.batch_attempts = step.attempts
            result, sizes = attempt.result, attempt.sizes
            verdict, seconds = result.verdict, result.seconds
            self.memory_truth.after_attempt(verdict)
            self.memory_truth.after_rerun(verdict.failed, max(sizes))
            if result.unreported is not None:
                # This rank raised although no rank reported a failure: never count that as a
                # success (the batch would be skipped silently, or the error swallowed).
                if isinstance(result.unreported, (OOMOnOtherRank, FailedOnOtherRank)):
                    raise RuntimeError(
                        "automicro: this rank stopped at a sync point for a failure no rank reported "
                        "(stale sync hooks of an earlier Trainer in this process that was not closed?)"
                    ) from result.unreported
                raise result.unreported
            if not verdict.failed:
                return self._trained(step, attempt, verdict, batch_index, sizes, seconds)
            if step.twin is not None and (result.own_error is not None or verdict.error_ranks) and self._twin_failed(result.own_error):
                # An error through the unsharded twin (its whole-model compile, a shape it cannot take): FSDP2
                # reruns the batch; an error of the model's own meets FSDP2 too and ends the run there.
                step.twin = None
                self.search_time_s += seconds
                self.memory_truth.after_failure(step.left_behind, f"batch {batch_index}")
                self._record(batch_index, sizes, "error", verdict, max(sizes), seconds,
                             "an error through the unsharded model: rerun through FSDP2 at the same size", hooks=hooks_on)
                continue
            if (result.own_error is not None or verdict.error_ranks) and self._head_failed(result.own_error):
                # An error with the fused head the trials put on (a loss or a metric that reads the logits): the plain
                # head reruns the batch; an error of the model's own meets the plain head too and ends the run there.
                self.search_time_s += seconds
                self.memory_truth.after_failure(step.left_behind, f"batch {batch_index}")
                self._record(batch_index, sizes, "error", verdict, max(sizes), seconds,
                             "an error with the fused head: rerun with the plain head at the same size", hooks=hooks_on)
                continue
            self.ooms_total += 1
            self.search_time_s += seconds
            self.memory_truth.after_failure(step.left_behind, f"batch {batch_index}")
            if result.own_error is not None or verdict.error_ranks:
                self._record(batch_index, sizes, "error", verdict, sizes[0], seconds, hooks=hooks_on)
                # Every rank agreed on this failure: `lost` has nobody left to tell.
                self.agreed_error = result.own_error or FailedOnOtherRank(
                    f"automicro: rank(s) {verdict.error_ranks} failed with a non-OOM error at "
                    f"{[r.site for r in verdict.reports if r.kind == KIND_ERROR]} during batch {batch_index}; "
                    "see that rank's traceback for the cause"
                )
                raise self._ends_run(self.agreed_error)
            if step.twin is not None and sharding.relieve():
                step.twin = None
                self._record(batch_index, sizes, "oom", verdict, max(sizes), seconds,
                             "the unsharded model undone first; rerun through FSDP2 at the same size", hooks=hooks_on)
                continue
            if packing is not None and packing.relieve():
                self._record(batch_index, sizes, "oom", verdict, max(sizes), seconds,
                             "packed rows undone first; rerun padded at the same budget", hooks=hooks_on)
                continue
            undone = self._relieved_by_layout(f"out of memory at size {max(sizes)}", max(sizes))
            if undone is not None:
                self.memory_truth.layout_undone(undone, max(sizes), batch_index)
                # A trial's batch at its own size (an upsize or downsize trial's) is rerun at the size found.
                rerun = max(self.policy.current_split()) if self.config.unit == "samples" else max(sizes)
                where = "at the same size" if rerun == max(sizes) else f"at the size found, {rerun}"
                self._record(
                    batch_index, sizes, "oom", verdict, rerun, seconds,
                    f"layout undone first; rerun {where}, now {self.layout.describe()}", hooks=hooks_on,
                )
                continue
            try:
                failed = search.OOM(
                    self.kind.outcome_size(self.policy, sizes, verdict, True), tuple(verdict.failed_ranks),
                    reached_bytes=reached_bytes(verdict), capacity_bytes=verdict.capacity_bytes or None,
                )
                decision = self.policy.observe(failed)
            except search.CannotFitError as error:
                ladder = self._floor_ladder()
                line = ladder.step(batch_index, verdict, self._compile_scope(), sharding, host.optimizers())
                if line is not None:
                    # Below the floor, a rung instead of the end: the size is searched again in this batch.
                    self._search_again(ladder.last)
                    if self.offload.on:  # the first step's optimizer state is the host's now, not the device's
                        self._optimizer_pending = self._pending_optimizer_bytes(host.optimizers())
                    self._record(batch_index, sizes, "oom", verdict, self.policy.state.size, seconds,
                                 f"size 1 did not fit: {ladder.last}, the size searched again", hooks=hooks_on)
                    rt.info(line)
                    continue
                self._record(batch_index, sizes, "oom", verdict, 0, seconds, hooks=hooks_on)
                self.agreed_error = MicrobatchSizeError(self._cannot_fit_message(verdict))
                raise self._ends_run(self.agreed_error) from error
            note = decision.event
            if routing is not None:
                # Every rank is here after the agreed failure: one round says whether routing moved the memory.
                moved = routing.moved(rt.consensus.agree_max)
                if moved is not None:
                    note += f"; {moved}"
            if result.replayed:
                note += f"; {result.replayed} collectives replayed to get the ranks back in step"
            self._record(batch_index, sizes, "oom", verdict, decision.next_size, seconds, note, hooks=hooks_on)
            self.apply_hooks(decision.hooks, decision.reason)

    def _trained(self, step: BatchStep, attempt: Any, verdict: Verdict, batch_index: int, sizes: tuple[int, ...], seconds: float) -> dict[str, torch.Tensor]:
        assert self.policy is not None and self.layout is not None
        if self._first_batch_s is None:
            self._first_batch_s = seconds if step.attempts == 1 else 0.0
        started = time.perf_counter()
        step.step_optimizers()
        self.offload.batch_trained(batch_index, seconds, time.perf_counter() - started)
        if self._optimizer_pending:
            # The first step just made the optimizer state among the blocks batch 0's attempts left
            # cached: batch 1 starts from an emptied cache, as a rerun does, so the size chosen with
            # that state projected meets the memory it was chosen for (not on a card another process
            # shares: `CudaMemory.empty_cache`).
            self.runtime.memory.empty_cache()
        self.used_split = sizes
        if self.routing:
            self.routing.after_clean()
        self._last_peak, self.last_capacity = verdict.peak_bytes, verdict.capacity_bytes
        self._last_outside = verdict.outside_bytes
        peaks = self._agreed_peaks(step)
        trial_batch = self.layout.trial_batch
        # Allocator retries in a layout trial's batches are the trial's to price, not a thrash: its arms are timed with
        # them (a trade whose batches retry is kept only where it is faster still), and an OOM still ends it. A trade's
        # batch leaves the pool fragmented for the arm after it too, and the card's pool settles over more batches
        # than a trial holds: on Mixtral's blocks on one H100 the fused head at 8 (two microbatches, 7 under the
        # margin runs three) retried in 9 of its first 12 batches set by hand, none after, and was the fastest size;
        # counted as a thrash, the trial fell back to 7, and that run's 1,000 batches projected 1.9% longer than the
        # same run timing the retries (`benchmarks/RESULTS.md` 2026-12-07, the thrash in a trial). A trial's batch
        # counts as one without retries (`_after_success`): the streak starts again after the trial.
        in_trial = self.layout.trial_running
        self.layout.after_success(step.attempts, peaks, weight=self.kind.batch_weight(), peak=verdict.peak_bytes)
        adopted = self.layout.take_adopted()
        if adopted is not None:
            self.runtime.info(self.policy.observe(search.Adopt(adopted)).event)
        if self.layout.take_dropped():
            # The trial ended here with its trade not kept: the pool still holds the trade's shapes, and the plain batch
            # after it would retry for them (Mixtral's blocks on one H100: no_reshard's last batch and the plain batch
            # after it retried, and counted as a thrash at the settled size, shrank it 6 -> 4, -7% a batch).
            self.runtime.memory.empty_cache()
        # A layout trial's "with" batch does not feed the memory model (its trade's bytes are in it).
        if trial_batch or not self._ladder_on_projection(verdict, batch_index, sizes, seconds, step.host):
            self._after_success(verdict, batch_index, sizes, seconds, () if trial_batch else peaks, trial_batch, in_trial)
        self._optimizer_pending = 0  # the step created the state: evals and later batches hold it
        self._static_shapes().after_batch(step.attempts, sizes)
        self._compile_scope().after_batch(step.attempts, sizes)
        sharding = self._sharding_choice()
        was = sharding.state
        sharding.after_batch(step.attempts, tuple(self.policy.current_split()), self.kind.batch_weight())
        self.layout.held_off = sharding.blocks_layout  # before the plan asks what is pending next
        if was == "trial" and sharding.state in ("unsharded", "sharded"):
            # Its times of the configuration that won are the compile scope's "each block" arm while nothing changes.
            self._reuse = (tuple(self.policy.current_split()), sharding.decided_times[sharding.state], self._configuration(False))
        packing = self._packing_choice()
        if packing is not None and self.kind.tokens is not None and self.kind.tokens.plan is not None:
            packing.after_batch(step.attempts, self.kind.batch_weight(), self.kind.tokens.plan.most_real)
        plan = self._trial_plan()
        plan.after_batch(step.attempts if self._plan_steady else 0, self.layout.started_now, retried=self.batch_retries,
                         split=sizes)
        if self.compile_watch is not None:
            self.compile_watch.after_batch(batch_index, plan.final_at)
        return attempt.total_loss_dict

    # ---- the trials' plan ------------------------------------------------------------------------

    def _steady(self) -> bool:
        """The size has settled and the sync hooks are off: a trial may hold the batch."""
        return self.policy is not None and self.policy.phase == search.Phase.STEADY and not self.runtime.hooks_active

    def _configuration(self, with_choices: bool = True) -> tuple[Any, ...]:
        """What the trials have kept so far (a batch profile of another configuration bounds nothing; with
        `with_choices` False, the one-rank and scope choices left out and the layout in: what the scope trial's
        reuse of the one-rank trial's times needs)."""
        split = () if self.policy is None else tuple(self.policy.current_split())
        static = None if self.static_shapes is None else self.static_shapes.state
        packing = None if self.packing_choice is None else self.packing_choice.state
        # A kept layout trade only takes FSDP2's work and host time away: the profile before it still bounds what
        # the later trials can win (from above), so it is not profiled again; it does change the scope's arm times.
        layout = self.layout.search.settled if self.layout is not None and not with_choices else ()
        # What runs, not how it was decided: FSDP2 kept (or never timed) is the configuration profiled before.
        choices = (self.sharding_choice is not None and self.sharding_choice.state == "unsharded",
                   self.compile_scope is not None and self.compile_scope.state == "model") if with_choices else ()
        return (split, static, packing, layout) + choices

    def _trial_plan(self) -> TrialPlan:
        if self.plan is None:
            rt = self.runtime
            assert rt.sharded is not None and rt.consensus is not None and self.layout is not None
            trials = [self._static_shapes(), self._packing_choice(), self._sharding_choice(), self._compile_scope(), self.layout]
            self.plan = TrialPlan([t for t in trials if t is not None], rt.consensus, rt.info, rt.sharded.device,
                                  bound=rt.settings.bound_trials, enabled=rt.settings.trials)
            self.compile_watch = CompileWatch(rt.info)  # before the first batch compiles anything
            layout, plan = self.layout, self.plan
            layout.priced = lambda label, kind, facts: plan.admit(label, kind, layout.min_gain, **facts)
            layout.search.repriceable = plan.reprices
            layout.order = plan.by_value
            # The vocabulary head, where the run put its switch on the model: metered in the profiled batch, whose
            # figures price the fused head (`head_choice`).
            plan.profiler.head = getattr(rt.sharded, "head", None)
            layout.head_bytes = lambda: plan.profile.head_bytes if plan.profile is not None else 0
            scope, sharding = self._compile_scope(), self._sharding_choice()

            def target() -> tuple[str, Any]:
                twin = getattr(rt.sharded, "twin", None)
                if sharding.state == "unsharded" and twin is not None and twin.compiled and twin.blocks and twin.scope == "blocks":
                    return "unsharded", twin
                return "FSDP2", scope.compiled

            def reusable(split: tuple[int, ...]) -> Optional[list[float]]:
                if self._reuse is None or self._reuse[0] != split or self._reuse[2] != self._configuration(False):
                    return None
                return self._reuse[1]

            scope.target, scope.reusable = target, reusable
            scope.breaks = lambda: sum(graph_breaks().values())
            compiled = getattr(rt.sharded, "compiled", None)
            plan.split_now = lambda: tuple(self.policy.current_split()) if self.policy is not None else ()
            plan.compile_s = self._graph_compile_s
            plan.first_batch_s = lambda: (self._first_batch_s or 0.0) if compiled is not None else 0.0
            plan.blocks = lambda: 0 if compiled is None else len(compiled.blocks)
            plan.graphs = compiled_graphs if compiled is not None or getattr(rt.sharded, "twin", None) is not None else (lambda: 0)
            plan.padding_share = self.kind.padding_share
        return self.plan

    def _graph_compile_s(self) -> float:
        """One graph's compile, as timed in this run: dynamo's own timings of its compiles (the median), else the static
        recompile's compile batch or the twin's first batch, less a settled batch; 0 where nothing compiled."""
        timed = compile_seconds()
        if timed:
            return statistics.median(timed)
        plan = self.plan
        wall = plan.profile.wall_s if plan is not None and plan.profile is not None else 0.0
        measured = [s - wall for s in (
            self.static_shapes.compile_batch_s if self.static_shapes is not None else 0.0,
            self.sharding_choice.first_s if self.sharding_choice is not None else 0.0,
        ) if s > wall]
        return max(measured, default=0.0)

    def _packing_choice(self) -> Optional[PackingChoice]:
        """Packed rows against padded batches, where the batch kind measures it (`packing_choice`)."""
        if self.packing_choice is None and self.kind.measures_packing and self.kind.tokens is not None:
            rt = self.runtime
            assert rt.sharded is not None and rt.consensus is not None
            self.packing_choice = PackingChoice(self.kind.tokens, rt.consensus, rt.info, rt.sharded.device)
        return self.packing_choice

    def _floor_ladder(self) -> FloorLadder:
        if self.ladder is None:
            self.ladder = FloorLadder(self.layout, self.runtime.info, pipeline=self.runtime.pipeline is not None,
                                      offload=self.offload)
        return self.ladder

    def _check_state_fits(self, host: Any) -> None:
        """Before a launch's first attempt, on every rank: the training state fits, or the host offload is on (its
        line), or the run ends here with what it needs (`state_fit`)."""
        rt = self.runtime
        assert rt.consensus is not None
        optimizers = host.optimizers()
        device_type = None if rt.sharded is None else rt.sharded.device.type
        need = measure(optimizers, rt.memory.allocated_bytes(), rt.memory.capacity_bytes(), device_type)
        message = self.state_fit.before_first_attempt(need, rt.consensus.agree_max, rt.consensus.rank, self.offload, optimizers)
        if message is not None:  # every rank, after the same round
            self.agreed_error = MicrobatchSizeError(message)
            raise self._ends_run(self.agreed_error)
        if self.offload.on:  # the first step's optimizer state is the host's now
            self._optimizer_pending = self._pending_optimizer_bytes(optimizers)

    def _routing(self) -> Optional[RoutingWatch]:
        if self.routing is None:
            assert self.runtime.sharded is not None
            sharded = self.runtime.sharded
            watched = self.runtime.settings.watch_routing and RoutingWatch.of(sharded.module, sharded.device)
            self.routing = watched or False
        return self.routing or None

    def _search_again(self, rung: str) -> None:
        """After the ladder's step: the size policy starts again (a batch's memory is another one now), from the probe
        where the search can take it (two sizes in one attempt: the size the memory line predicts next), else from
        where the run's search starts; the sync hooks on."""
        assert self.policy is not None
        config = self.config
        probe = dataclasses.replace(config, probe=True, start_size=None)
        if probe.probes and search.probe_split(self.policy.state.batch_size, probe.min_size) is not None:
            self.config = config = probe
        self.policy = search.SearchPolicy(config, self.policy.state.batch_size)
        self._settling_peaks, self._headroom_checked = [], set()
        self.apply_hooks(True, HookReason.SEARCHING, f"the size searched again with {rung}")

    def _head_failed(self, error: Optional[BaseException]) -> bool:
        """A non-OOM error in a batch that ran with the fused head `head: auto` put on: the plain head for the rest
        of the run (`LayoutTrials.head_failed`), the error and its traceback in the log once. True where the batch is
        to be rerun with the plain head."""
        what = "an error on another rank" if error is None else _in_words(error)
        if self.layout is None or not self.layout.head_failed(what):
            return False
        if error is not None:
            log.warning("automicro: the error with the fused head (rerun with the plain head):\n%s",
                        "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        return True

    def _twin_failed(self, error: Optional[BaseException]) -> bool:
        """A non-OOM error in a batch through the twin: FSDP2 from now on, the error and its traceback in the
        log once (`sharding_choice.relieve`). True where the batch is to be rerun through FSDP2."""
        assert self.sharding_choice is not None
        what = "an error" if error is None else f"an error ({_in_words(error)})"
        if not self.sharding_choice.relieve(what):
            return False
        if error is not None:
            log.warning("automicro: the error through the model unsharded (rerun through FSDP2):\n%s",
                        "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        return True

    def _sharding_choice(self) -> ShardingChoice:
        """One rank: the model unsharded timed against FSDP2 once the size and its graphs settle (`sharding_choice`)."""
        if self.sharding_choice is None:
            rt = self.runtime
            assert rt.sharded is not None and rt.consensus is not None
            sharded = rt.sharded
            self.sharding_choice = ShardingChoice(
                getattr(sharded, "twin", None), rt.consensus, rt.info, sharded.device,
                why_not=None if rt.settings.trials else "trials: false", release=lambda: setattr(sharded, "twin", None),
            )
        if self._one_rank_state is not None:
            self.sharding_choice.load_state_dict(self._one_rank_state)
            self._one_rank_state = None
        return self.sharding_choice

    def _static_shapes(self) -> StaticShapes:
        """The compiled blocks' static recompile once the size settles (`compile_shapes`)."""
        if self.static_shapes is None:
            rt = self.runtime
            compiled = getattr(rt.sharded, "compiled", None)
            why_not = None
            if not rt.settings.trials:
                why_not = "trials: false"
            elif compiled is not None and compiled.config.dynamic is not None:
                why_not = f"compile.dynamic={str(compiled.config.dynamic).lower()} is set"
            elif compiled is not None and self.kind.tokens is not None:
                why_not = "a token budget gives every microbatch its own shape"
            assert rt.sharded is not None and rt.consensus is not None
            self.static_shapes = StaticShapes(compiled, rt.consensus, rt.info, rt.sharded.device, why_not)
        return self.static_shapes

    def _compile_scope(self) -> ScopeChoice:
        """The whole model timed against the compiled blocks, once they settle (`compile_scope`)."""
        if self.compile_scope is None:
            rt = self.runtime
            why_not = "a token budget gives every microbatch its own shape" if self.kind.tokens is not None else None
            why_not = why_not if rt.settings.trials else "trials: false"
            assert rt.sharded is not None and rt.consensus is not None
            self.compile_scope = ScopeChoice(getattr(rt.sharded, "compiled", None), rt.consensus, rt.info, rt.sharded.device, why_not)
        return self.compile_scope

    def _ensure_policy(self, batch_size: int, host: Optional[BatchHost] = None) -> None:
        batch_size = self.kind.domain(batch_size)
        if self.policy is None:
            self.policy = search.SearchPolicy(self.config, batch_size)
            if self._pending_policy is not None:
                self.policy.state = search.SearchState.from_dict(self._pending_policy)
                self._pending_policy = None
                self.policy.observe(search.Rearm("checkpoint loaded"))
                self.kind.resumed(self.policy, batch_size)
                self._step_below_unrecovered_failure(host)
                self.runtime.info(f"resumed with microbatch split {self.policy.current_split()} (hooks on until stable)")
            self.apply_hooks(True, HookReason.SEARCHING)
        else:
            changed = self.kind.changed(self.policy, batch_size)
            if changed is not None:
                decision, detail = changed
                self.apply_hooks(decision.hooks, decision.reason, detail)

    def _relieved_by_layout(self, why: str, size: int) -> Optional[str]:
        """Memory pressure at the settled size goes to the layout first: when it undoes a trade (the
        one returned; None: nothing undone), the size stays and the sync hooks come back on until the
        size is stable again. In that settling too: each kept trade is undone before the size shrinks
        (on Qwen3-MoE's blocks on one H100 a second thrash there shrank 3 -> 2, -18% a batch, with a trade
        worth +8.7% still kept). Not while the size is searched."""
        assert self.policy is not None
        if self.layout is None or self.policy.phase == search.Phase.SEARCHING or self.policy.found_size is None:
            return None
        undone = self.layout.relieve(why, size)
        if undone is not None:
            decision = self.policy.observe(search.Rearm("layout undone"))
            self.apply_hooks(decision.hooks, decision.reason, "layout undone")
        return undone

    def _ladder_on_projection(self, verdict: Verdict, batch_index: int, sizes: tuple[int, ...], seconds: float,
                              host: BatchHost) -> bool:
        """Size 1 ran, but on some rank its peak with the optimizer state the first step added does not fit: above the
        floor the policy searches below (`policy._projected_to_fail`); at it there is nowhere lower, and the next batch
        would run out at size 1, be rerun once and run out again before the ladder stepped (tests/test_ladder.py's
        14 MB cap, tests/test_head.py's head rung). The ladder's next layout rung now, between batches, every rank
        alike (the agreed verdict), and the size searched again from the next batch; True where it stepped. The host
        offload too, where it is the rung left (``offload: auto``): switched on before the next batch, the step's
        gradients dropped first (`HostOffload.schedule`; one H100, Llama-3.2 3B's shape at 196,608 tokens a sample:
        batch 1 ran out twice before the OOM's path took it, `benchmarks/RESULTS.md` "the host offload")."""
        assert self.policy is not None
        if not self._optimizer_pending or not self.config.use_prediction or self.config.unit != "samples":
            return False
        if max(sizes) > self.policy.floor:
            return False
        # Against the capacity read, not the lower ceiling an OOM showed usable (`SearchPolicy.usable_bytes`): that one
        # came from another split's failed allocation, and a rung taken here is kept for the run (FSDP2 over one rank
        # under a 16 MB cap: peak 14.7 MiB with the state over a ceiling of 14.6, and the next batches fit at 15.3).
        over = [r for r in verdict.reports if r.capacity_bytes and r.peak_bytes > r.capacity_bytes]
        ladder = self._floor_ladder()
        if not over or ladder.why_not() is not None:
            return False
        figures = "; ".join(f"rank {r.rank}: peak {r.peak_bytes / 2**20:.1f} MiB with it, capacity "
                            f"{r.capacity_bytes / 2**20:.1f} MiB" for r in over)
        line = ladder.step(batch_index, verdict, self._compile_scope(), self._sharding_choice(), host.optimizers(),
                           projected=figures)
        if line is None:
            return False
        self.batch_retries = verdict.any_new_alloc_retries  # as `_after_success` keeps it (the dashboards, the plan)
        self.kind.trained()
        self._search_again(ladder.last)
        self._record(batch_index, sizes, "ok", verdict, self.policy.state.size, seconds,
                     f"size 1 does not fit with the optimizer state: {ladder.last}, the size searched again from the next batch")
        self.runtime.info(line)
        return True

    def _peak_at(self, found: int) -> Optional[tuple[int, int]]:
        """(The largest microbatch, the memory model's peak at it) were the size found `found`;
        None below the smallest size allowed or where the model cannot tell."""
        assert self.policy is not None
        if found < self.config.min_size:
            return None
        largest = max(self.policy.split_for(found))
        peak = self.policy.projected_peak(largest)
        return None if peak is None else (largest, peak)

    def _pending_optimizer_bytes(self, optimizers: list[torch.optim.Optimizer]) -> int:
        """The bytes this rank's optimizer state will add at the first step (0 once it exists, or
        for an optimizer `optimizer_memory` does not know; then nothing is projected)."""
        if self._optimizer_state_known or not self.config.use_prediction:
            return 0
        sharded = self.runtime.sharded
        pending = pending_state_bytes(optimizers, None if sharded is None else sharded.device.type)
        if not pending:
            self._optimizer_state_known = True
            return 0
        return pending

    def _cannot_fit_message(self, verdict: Verdict) -> str:
        rows = [
            f"rank {r.rank} at {r.site}: peak {r.peak_bytes / 2**20:.1f} MiB, "
            f"allocated {r.allocated_bytes / 2**20:.1f} MiB, capacity {r.capacity_bytes / 2**20:.1f} MiB"
            for r in verdict.reports if r.failed
        ]
        ladder = self._floor_ladder()
        checkpointing = "" if ladder.stepped else "activation_checkpointing, "
        return (
            f"automicro: {self.kind.cannot_fit()}{ladder.tried()}{ladder.unasked()}; "
            + "; ".join(rows)
            + f". Reduce the model or sequence length, shard more (more ranks, reshard_after_forward, {checkpointing}"
            "cpu_offload) or raise the memory limit."
        )

    def _agreed_peaks(self, step: BatchStep) -> tuple[tuple[int, int], ...]:
        """The attempt's per-size microbatch peaks, the max over ranks (one round, every rank: the
        attempt was tracked on all or none), with the optimizer state the first step adds."""
        if step.peaks is None:
            return ()
        assert self.runtime.consensus is not None
        local = step.peaks.by_size()
        agreed = self.runtime.consensus.agree_max([peak for _, peak in local])
        return tuple((size, peak + self._optimizer_pending) for (size, _), peak in zip(local, agreed) if peak)

    def _after_success(
        self, verdict: Verdict, batch_index: int, sizes: tuple[int, ...], seconds: float,
        peaks_by_size: tuple[tuple[int, int], ...] = (), trial_batch: bool = False, in_layout_trial: bool = False,
    ) -> None:
        assert self.policy is not None
        self.batch_retries = verdict.any_new_alloc_retries
        # As in Composer's rule, a batch that already ran out of memory is not counted for thrashing; nor a layout
        # trial's batch (`_trained`: its retries are timed in its arms).
        # Nor one at a size whose retries were timed faster than the size below (`thrash_timing`).
        retried_clean_batch = (verdict.any_new_alloc_retries and self.batch_attempts == 1 and not in_layout_trial
                               and not self.thrash_timing.accepts(self.policy.found_size))
        self.kind.trained()
        timing = self.thrash_timing
        timing.after_batch(batch_index, self.policy.found_size, sizes, self.runtime.hooks_active,
                           self.batch_attempts == 1 and not in_layout_trial and not trial_batch and self._trial_plan().turn is None)
        if self.thrash.observe(retried_clean_batch):
            twin_ran = self._step is not None and self._step.twin is not None
            relieved = self.sharding_choice is not None and self.sharding_choice.relieve("thrashing", rerun=False)
            if timing.holding and relieved:
                timing.stop("another thrash came first and moved the model to FSDP2")
            if relieved:
                # Through the twin, or in any batch of its trial, as an OOM there: FSDP2 from the next batch, the size stays.
                self.runtime.memory.empty_cache()
                through = "through the unsharded model" if twin_ran else "in the unsharded model's trial"
                self._record(batch_index, sizes, "thrash", verdict, max(sizes), seconds,
                             f"allocator retries {through}: FSDP2 from the next batch, the size stays")
                return
            if self._relieved_by_layout(f"thrashing at size {max(sizes)}", max(sizes)) is not None:
                assert self.layout is not None
                if timing.holding:
                    timing.stop("another thrash came first and undid a trade")
                # The undone trade's shapes stay in the allocator's pool and the batches after it retry on (Qwen3-MoE's
                # blocks on one H100: two more retrying batches after grad_sync_once's undo undid no_reshard too).
                self.runtime.memory.empty_cache()
                self._record(batch_index, sizes, "thrash", verdict, max(sizes), seconds, f"layout now {self.layout.describe()}")
                return
            state = self.policy.state
            # A thrash at the size below one being timed: its retrying batches are that timing's other arm.
            if not (timing.holding and timing.below_thrashed(batch_index, max(sizes))):
                timing.thrash(batch_index, state.found, max(sizes), self.policy.floor, state.first_failure,
                              verdict.capacity_bytes, state.phase == search.Phase.SEARCHING, self.config.unit == "samples")
            decision = self.policy.observe(search.Thrash(self.kind.outcome_size(self.policy, sizes, verdict, False)))
            self._record(batch_index, sizes, "thrash", verdict, decision.next_size, seconds, decision.event)
            self.apply_hooks(decision.hooks, decision.reason)
            return
        phase_before = self.policy.phase
        found = self.policy.found_size
        if trial_batch and found is not None and max(sizes) > found:
            # An upsize trial's "with" batch: that size ran with a layout the policy does not model.
            return
        decision = self.policy.observe(
            search.Success(
                self.kind.outcome_size(self.policy, sizes, verdict, False),
                peak_bytes=None if trial_batch else verdict.peak_bytes or None,
                capacity_bytes=verdict.capacity_bytes or None,
                projected=self._optimizer_pending > 0,
                peaks_by_size=peaks_by_size,
            )
        )
        if phase_before != search.Phase.STEADY or self.batch_attempts > 1 or decision.phase != search.Phase.STEADY:
            self._record(batch_index, sizes, "ok", verdict, decision.next_size, seconds, decision.event)
        found_line = self.kind.found_line(self.policy, phase_before, sizes)
        if found_line is not None:
            self.runtime.info(found_line)
        self.apply_hooks(decision.hooks, decision.reason)
        self._headroom(phase_before, decision, verdict, found, trial_batch)
        if timing.holding:
            plan = self._trial_plan()
            retried = timing.decide(batch_index, self.policy.found_size, verdict.capacity_bytes, plan.seconds, plan.compiled)
            if retried is not None:
                decision = self.policy.observe(retried)
                self.runtime.info(decision.event)
                self.apply_hooks(decision.hooks, decision.reason)

    def _headroom(self, phase_before: search.Phase, decision: Any, verdict: Verdict, found: Optional[int], trial_batch: bool) -> None:
        """Collect every rank's peak over the settling batches; once the size is steady, keep the
        headroom the rerun target takes at this world size (`automicro.core.headroom`), once per size found."""
        assert self.policy is not None
        config = self.policy.config
        target = self.runtime.settings.rerun_target
        if not target or config.unit != "samples" or config.sizes_for is not None:
            return
        if phase_before != search.Phase.SETTLING or found is None or self.policy.found_size != found:
            self._settling_peaks = []
            return
        if self.policy.state.stable_count == 1:
            # The first clean batch of a run of them: a one-off OOM or a rearm while settling restarted the count,
            # and the peaks before it are not the settling batches' (memory held until the wipe read as spread).
            self._settling_peaks = []
        if not trial_batch and self.batch_attempts == 1:
            self._settling_peaks.append([r.peak_bytes for r in verdict.reports])
        if decision.phase != search.Phase.STEADY or found in self._headroom_checked:
            return
        peaks, self._settling_peaks = self._settling_peaks, []
        self._headroom_checked.add(found)
        # The peaks are the largest microbatch's of the split run (an even split of the batch under the size
        # found): that microbatch is the one to step down.
        largest = max(self.policy.current_split())
        above, at = self.policy.projected_peak(largest), self.policy.projected_peak(largest - 1) if largest > 1 else None
        per_sample = above - at if above is not None and at is not None else None
        usable = self.policy.usable_bytes(verdict.capacity_bytes) if verdict.capacity_bytes else 0
        chosen = headroom.decide(largest, peaks, usable, per_sample, len(verdict.reports), target, config.min_size)
        self.runtime.info(chosen.line)
        if chosen.size != largest:
            self._headroom_checked.add(chosen.size)
            self.runtime.info(self.policy.observe(search.Adopt(chosen.size)).event)

    def _record(
        self, batch_index: int, sizes: tuple[int, ...], outcome: str, verdict: Verdict, next_size: int,
        seconds: float, note: str = "", hooks: Optional[bool] = None,
    ) -> None:
        record = AttemptRecord(
            batch=batch_index,
            attempt=self.batch_attempts,
            size=self.kind.record_size(sizes),
            split=sizes,
            outcome=outcome,
            failed_ranks=verdict.failed_ranks,
            sites=verdict.sites,
            next_size=self.kind.record_next(self.policy, next_size),
            hooks=self.runtime.hooks_active if hooks is None else hooks,
            seconds=round(seconds, 4),
            note=note,
        )
        self.history.append(record)
        self.runtime.info(record.console_line())

    # ---- a run that could not recover in-process -------------------------------------------------

    def lost(self, error: BaseException, where: str, batch: int, folder: Optional[str]) -> Optional[FatalRecoveryError]:
        """The loop raised `error` on this rank (`where`: "at <event>" or "between batches", `batch`:
        the batches trained, `folder`: where the failure note goes). An out-of-memory error from
        outside any attempt (the attempts handle their own) leaves the other ranks in the next batch,
        waiting for this one: declare the job lost where they can hear it (the ledger's board on one
        node, the job-lost alarm across nodes), leave the failure note, and return the error to raise."""
        if isinstance(error, Exception):
            # The run is over: its process exits within exit_timeout_s (an error raised from this one
            # below carries the mark through its cause).
            self._ends_run(error)
        ledger = self.runtime.ledger
        if isinstance(error, FatalRecoveryError) or error is self.agreed_error or ledger is None:
            return None
        if not is_oom(error):
            # Any other error of this rank alone (a callback, a checkpoint save): the other ranks
            # are in the next batch's collectives; name this rank on theirs too. No failure note:
            # the size is not the cause.
            if not isinstance(error, Exception):
                return None
            return ledger.lost_outside_attempt(where, batch, f"it raised {type(error).__name__}: {error}")
        if not self.used_split:
            return None
        failure_note.write(folder, self.runtime.rank, batch, self.used_split)
        return ledger.lost_outside_attempt(where, batch)

    def _ends_run(self, error: E) -> E:
        """`error` ends the run: where nothing catches it, the process exits within `exit_timeout_s`
        or says what holds it and ends (`automicro.core.exit_watch`)."""
        return exit_watch.arm(error, self.runtime.settings.exit_timeout_s, self.runtime.rank)

    def _step_below_unrecovered_failure(self, host: Optional[BatchHost]) -> None:
        """A failure note beside the checkpoint this run resumed from: start below its size."""
        assert self.policy is not None
        note = failure_note.read(None if host is None else host.checkpoint_folder())
        resumed_at = host.batch_index if host is not None else 0
        if note is None or not note.applies(resumed_at, max(self.policy.current_split())):
            return
        try:
            decision = self.policy.observe(search.OOM(note.size, may_rerun=False))
        except search.CannotFitError as error:
            raise MicrobatchSizeError(
                f"automicro: the run stopped at microbatch size {note.size} in batch {note.batch}, and no smaller "
                "size is left to try"
            ) from error
        self.runtime.info(
            f"the previous launch could not recover from an OOM at size {note.size} in batch {note.batch} "
            f"({note.path}); resuming at size {decision.next_size} with the sync hooks on"
        )
