"""`AutoMicrobatching`: the OOM-safe microbatch-size search for FSDP2, as a Composer callback.

Turn it on in YAML::

    device_train_microbatch_size: auto
    parallelism_config:
      fsdp2: {}
    callbacks:
      auto_microbatching:
        stable_batches: 3
        thrash_batches: 2
        search: bisect          # or `halve`, Composer's own policy, as a baseline

or in Python::

    from automicro import Trainer, AutoMicrobatching
    trainer = Trainer(model=model, train_dataloader=dl, max_duration="20ba",
                      parallelism_config={"fsdp2": {}}, device_train_microbatch_size="auto",
                      callbacks=[AutoMicrobatching()])

`automicro.Trainer` runs each batch through `train_batch()` below: every attempt is fenced by
the consensus protocol, a failed attempt is wiped (outputs, grads, metrics, FSDP2 state through
the engine's `recover()`) and the same batch is rerun at the next size the search policy picks.
Sync hooks are on while searching and come off after `stable_batches` clean batches.

Owns: the Composer side only (events, the batch loop's calls into Composer, the checkpoint
state of the search). The protocol lives in `automicro.core` (attempt fence, consensus, policy,
ledger), the dashboards' metrics and events in `automicro.core.metrics` (the key table is there),
the failure note in `automicro.core.failure_note`. May not touch: FSDP2 internals (the engine's
`recover()` does), torch or Composer privates outside the two `_internals` modules.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger

from automicro.core import failure_note
from automicro.core import policy as search
from automicro.core.alarm import JobLostAlarm
from automicro.core.attempt import AttemptFence, is_oom
from automicro.core.consensus import (
    KIND_ERROR,
    Consensus,
    FailedOnOtherRank,
    LocalFigures,
    OOMOnOtherRank,
    Verdict,
)
from automicro.engine.hooks import SYNC_POINTS, SyncHooks
from automicro.core.layout import LayoutConfig
from automicro.core.ledger import Board, CollectiveLedger, FatalRecoveryError
from automicro.core.optimizer_memory import pending_state_bytes
from automicro.core.memory import CudaMemory, MemorySource, NoMemory, capacity_and_outside, release_after_failure
from automicro.core.metrics import (
    AttemptRecord,
    BatchFigures,
    batch_metrics,
    event_traces,
    history_from_state,
    history_to_state,
)
from automicro.core.policy import HookReason
from automicro.core.sites import AttemptContext, SiteDispatcher
from automicro.core.store_board import StoreBoard
from automicro.core.thrash import ThrashDetector
from automicro.core.transport import TRANSPORTS
from automicro.engine import _torch_internals as torch_internals
from automicro.engine.sharding import ShardedModel
from automicro.integration import _composer_internals as composer_internals
from automicro.integration.batch_kinds import BatchKind, batch_kind
from automicro.integration.batch_step import BatchStep
from automicro.integration.eval_search import EvalFence, EvalSearch
from automicro.integration.layout_trials import LayoutTrials
from automicro.integration.memory_truth import MemoryTruth, reached_bytes
from automicro.integration.pipeline_batch import PipelineBatch
from automicro.integration.stock_trainer import StockTrainerError, refuse_stock_trainer, stock_trainer_message
from automicro.integration.token_budget import TokenBudget

log = logging.getLogger(__name__)

BUDGETS = ("samples", "tokens")
EVAL_OOM = ("split", "stop")


class MicrobatchSizeError(RuntimeError):
    """Even a microbatch of one sample does not fit: raised on every rank."""


class AutoMicrobatching(Callback):
    """Finds the largest microbatch that fits on every rank under FSDP2, without deadlocks."""

    # Works only inside `automicro.Trainer`; another Trainer is refused (`stock_trainer`).
    needs_automicro_trainer = True

    def __init__(
        self,
        stable_batches: int = 3,
        thrash_batches: int = 2,
        search: str = "bisect",
        use_prediction: bool = True,
        start_size: Union[int, str, None] = None,
        cpu_sync_group: bool = True,
        memory_fraction: Optional[Union[float, dict[int, float]]] = None,
        log_attempts: bool = True,
        unguarded_timeout_s: float = 120.0,
        sync_points: str = "all",
        consensus_transport: str = "auto",
        steady_recovery: bool = True,
        budget: str = "samples",
        fixed_tokens: Optional[int] = None,
        eval_oom: str = "split",
        layout: Union[str, list[str], None] = None,
        layout_trial_batches: int = 3,
        layout_min_gain: float = 0.01,
    ) -> None:
        # None: the probe on a GPU, the whole batch on CPU (resolved at attach, as the layout).
        self.start = _start(start_size, search, use_prediction, budget)
        self.policy_config = search_config(
            search, stable_batches, use_prediction, start_size if isinstance(start_size, int) else None,
            probe=self.start == "probe",
        )
        if budget not in BUDGETS:
            raise ValueError(
                f"budget={budget!r}: must be 'samples' (the search counts samples per microbatch) or 'tokens' (it "
                "finds tokens per microbatch and packs variable-length batches under them)"
            )
        # budget="tokens": the search's sizes are tokens per microbatch (`token_budget`).
        if fixed_tokens is not None and budget != "tokens":
            raise ValueError(f"fixed_tokens={fixed_tokens!r} needs budget='tokens'")
        # What a batch is counted in (`batch_kinds`): the callback asks it, never `if tokens`.
        self.kind: BatchKind = batch_kind(budget, fixed_tokens)
        self.tokens: Optional[TokenBudget] = self.kind.tokens
        self.policy_config = self.kind.policy_config(self.policy_config)
        self.thrash = ThrashDetector(thrash_batches)
        # What the engine may trade for speed once the size settles (`automicro.core.layout`).
        self.layout_config = LayoutConfig.parse(layout, layout_trial_batches, layout_min_gain)
        self.layout: Optional[LayoutTrials] = None
        self._last_peak = self._last_capacity = self._last_outside = 0
        self._memory_truth = MemoryTruth(lambda: self._memory, lambda: self._rank, log_attempts)
        if eval_oom not in EVAL_OOM:
            raise ValueError(
                f"eval_oom={eval_oom!r}: must be 'split' (an evaluator with a pinned device_eval_microbatch_size that "
                "runs out of memory is split further on every rank) or 'stop' (the run ends, as without automicro)"
            )
        self.eval_oom = eval_oom
        if not isinstance(cpu_sync_group, bool):
            raise ValueError(f"cpu_sync_group={cpu_sync_group!r}: must be true or false")
        fractions = memory_fraction.values() if isinstance(memory_fraction, dict) else [memory_fraction]
        for fraction in fractions:
            if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0):
                raise ValueError(
                    f"memory_fraction={memory_fraction!r}: must be a number in (0, 1] or a {{rank: fraction}} map"
                )
        if sync_points not in SYNC_POINTS:
            raise ValueError(
                f"sync_points={sync_points!r}: must be 'all' (module boundaries and collectives) or "
                "'collectives' (only in front of FSDP2's collectives: fewer consensus rounds while searching)"
            )
        self.sync_points = sync_points
        if consensus_transport not in TRANSPORTS:
            raise ValueError(
                f"consensus_transport={consensus_transport!r}: must be 'auto' (shared memory on one node, "
                "hierarchical on several), 'shm', 'hierarchical' or 'process_group'"
            )
        self.consensus_transport = consensus_transport
        if not isinstance(steady_recovery, bool):
            raise ValueError(f"steady_recovery={steady_recovery!r}: must be true or false")
        # False: no collective ledger; a failure with the hooks off then stops the job after
        # unguarded_timeout_s (the behaviour before in-process recovery; for measuring its cost).
        # A pipeline then keeps its per-step barriers for the whole run (the cost of not draining).
        self.steady_recovery = steady_recovery
        self.cpu_sync_group = cpu_sync_group
        self.memory_fraction = memory_fraction
        self.log_attempts = log_attempts
        if not isinstance(unguarded_timeout_s, (int, float)) or unguarded_timeout_s <= 0:
            raise ValueError(f"unguarded_timeout_s={unguarded_timeout_s!r}: must be a positive number of seconds")
        self.unguarded_timeout_s = float(unguarded_timeout_s)
        self.history: list[AttemptRecord] = []
        self.policy: Optional[search.SearchPolicy] = None
        self.ooms_total = 0
        self.search_time_s = 0.0
        self._pending_state: Optional[dict[str, Any]] = None
        self._optimizer_pending = 0  # bytes the first optimizer step will allocate on this rank
        self._optimizer_state_known = False
        self._layout_state: Optional[dict[str, Any]] = None  # from a checkpoint, applied at the first batch
        self._sharded: Optional[ShardedModel] = None
        self._consensus: Optional[Consensus] = None
        self._ledger: Optional[CollectiveLedger] = None
        self._ledger_handle: Any = None
        self._fence: Optional[AttemptFence] = None
        self._hooks: Optional[SyncHooks] = None
        self._memory: MemorySource = NoMemory()
        self._dispatcher = SiteDispatcher()  # replaced by the trainer's at attach()
        self._pipeline: Optional[PipelineBatch] = None
        self._step: Optional[BatchStep] = None  # the batch in progress (or the last one)
        self._batch_attempts = 0
        self._batch_retries = False
        self._used_split: tuple[int, ...] = ()
        # Eval forwards fenced like training attempts; one bisect search per evaluator label.
        self._eval = EvalFence(
            self._info, self._count_oom,
            lambda: search_config(self.policy_config.search, self.policy_config.stable_batches, False, None),
        )
        self._rank = 0
        self._last_event: Optional[Event] = None
        self._in_automicro_trainer = False
        self._alarm: Any = None
        self._agreed_error: Optional[BaseException] = None
        # Before Composer's own checks in any composer.Trainer built with this callback.
        composer_internals.check_before_composer_trainer(refuse_stock_trainer)

    def check_trainer(self, trainer: Any) -> None:
        """Called by `automicro.Trainer` once Composer's Trainer is built: settings that cannot go together."""
        self.kind.check_trainer(trainer)

    def bind_trainer(self) -> None:
        """Called by `automicro.Trainer` for each of its AutoMicrobatching callbacks."""
        self._in_automicro_trainer = True

    # ---- wiring ------------------------------------------------------------------------------

    def searches_layout(self, device_type: str) -> bool:
        """Whether the layout is searched on this device (``layout: auto``, the default on a GPU)."""
        return self.layout_config.resolve(device_type).mode == "auto" and self.steady_recovery

    def attach(
        self,
        sharded: ShardedModel,
        memory: Optional[MemorySource] = None,
        sites: Optional[SiteDispatcher] = None,
        pipeline: Optional[PipelineBatch] = None,
    ) -> None:
        """Called by `automicro.Trainer` on every rank once the model is sharded (collective).
        `sites`: the trainer's site dispatcher, shared with its fault injectors (a new one if None).
        `pipeline`: this rank's pipeline stage, when the model is pipelined."""
        import torch.distributed as dist

        if sites is not None:
            self._dispatcher = sites
        self._sharded = sharded
        self._pipeline = pipeline
        self._consensus = Consensus.create(use_cpu_group=self.cpu_sync_group, transport=self.consensus_transport)
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._info(f"consensus transport {self._consensus.describe()}")
        one_rank = dist.is_initialized() and dist.get_world_size() == 1 and sharded.fsdp_modules and pipeline is None
        if one_rank and self.layout_config.resolve(sharded.device.type).mode != "auto" and not self.layout_config.pinned:
            self._info(
                "one rank: FSDP2 with the fixed layout gathers parameters and reduces gradients every microbatch; "
                "layout: auto (the default on a GPU) trades that away once the size is found (README 'One GPU')"
            )
        if pipeline is not None:
            self.kind.check_pipeline()
        if self.start == "auto" and sharded.device.type == "cuda":
            self.policy_config = dataclasses.replace(self.policy_config, probe=True)
        if pipeline is not None and self.start == "probe":
            raise ValueError(
                "AutoMicrobatching(start_size='probe') cannot run pipeline stages (a pipeline runs equal microbatches, "
                "the probe two sizes); leave start_size out or set it to 'batch' or a size"
            )
        if pipeline is not None:
            # Only equal microbatches, enough for the schedule. The steady phase needs no ledger: with
            # one data-parallel rank per stage a stage that fails drains its sends and receives
            # (`automicro.engine.pipeline`); with several, the sync hooks and the executor's barrier
            # before every exchange stay on for the whole run (see `_apply_hooks`).
            self.policy_config = dataclasses.replace(self.policy_config, sizes_for=pipeline.microbatch_sizes)
            self._ledger = None
            self._alarm = None
            self._info(
                f"pipeline stage {pipeline.stage_index} of {pipeline.pipeline.layout.num_stages} "
                f"({pipeline.pipeline.config.schedule}, {pipeline.dp_size} data-parallel rank(s) per stage)"
            )
        else:
            self._ledger = _build_ledger(sharded, self._consensus, self._rank) if self.steady_recovery else None
            # Without the ledger, the job-lost alarm still names the failed rank on every rank.
            self._alarm = None if self.steady_recovery else _build_alarm(self._consensus)
        self._fence = AttemptFence(
            self._consensus, self._dispatcher.context, self._figures, self._ledger, self.unguarded_timeout_s,
            alarm=self._alarm,
        )
        self._hooks = SyncHooks(sharded, self._consensus, self._dispatcher, sync_points=self.sync_points)
        self.layout = LayoutTrials(
            self.layout_config, sharded, self._consensus, self._info,
            recoverable=self._ledger is not None, pipeline=pipeline is not None,
        )
        self._eval.attach(
            self._fence, self._dispatcher, self._recover_model, lambda: self.hooks_active, self._release_memory,
            memory=lambda: self._memory,
            after_failure=lambda left_behind, what: self._memory_truth.after_failure(left_behind, what, "eval"),
        )
        if memory is not None:
            self._memory = memory
        elif torch.cuda.is_available() and sharded.device.type == "cuda":
            fraction = self.memory_fraction
            if isinstance(fraction, dict):
                fraction = fraction.get(self._rank)
            if fraction is not None:
                # A further cap (tests and benchmarks make ranks differ with it): never above a
                # per-process fraction the user's script already set.
                current = torch.cuda.get_per_process_memory_fraction()
                torch.cuda.set_per_process_memory_fraction(min(float(fraction), float(current)))
            self._memory = CudaMemory(fraction)

    def set_memory_source(self, memory: MemorySource) -> None:
        self._memory = memory

    @property
    def hooks_active(self) -> bool:
        return self._hooks is not None and self._hooks.active

    @property
    def found_size(self) -> Optional[int]:
        return None if self.policy is None else self.policy.found_size

    def summary_line(self, per_rank_batch: Optional[int] = None) -> Optional[str]:
        """What the search found, for the console at the end of a fit (None before any batch)."""
        if self.policy is None:
            return None
        tail = f"attempts {len(self.history)}, OOMs {self.ooms_total}; sync hooks {'on' if self.hooks_active else 'off'}"
        layout = "" if self.layout is None or self.layout.engine is None else f"; layout: {self.layout.describe()}"
        return self.kind.summary(self.policy, per_rank_batch, layout, self.used_split, tail)

    # Read-only figures for dashboards, benchmarks and tests.

    @property
    def sites(self) -> SiteDispatcher:
        """The site dispatcher this callback fires (the trainer's, once attached)."""
        return self._dispatcher

    @property
    def attempt_context(self) -> AttemptContext:
        """Where the current attempt is: batch, attempt, microbatch, last site (read it, do not write it)."""
        return self._dispatcher.context

    @property
    def left_behind_bytes(self) -> int:
        """The most a failed attempt left allocated after its wipe on this rank (0: nothing beyond
        the tolerance, `automicro.integration.memory_truth`)."""
        return self._memory_truth.left_behind_bytes

    @property
    def left_behind_checked(self) -> dict[str, int]:
        """How many failed attempts' wipes `left_behind_bytes` covers, by kind ("train", "eval")."""
        return dict(self._memory_truth.checked)

    @property
    def left_behind_exact(self) -> int:
        """The most a failed attempt left allocated after its wipe, below the tolerance too (bytes;
        exact under `automicro.testing.MemoryCap`, which counts live tensor bytes)."""
        return self._memory_truth.left_behind_exact

    @property
    def used_split(self) -> tuple[int, ...]:
        """The microbatch split of the last batch that succeeded (empty before the first)."""
        return self._used_split

    @property
    def batch_attempts(self) -> int:
        """Attempts of the current (or last) batch: 1 when it did not retry."""
        return self._batch_attempts

    @property
    def transport_name(self) -> Optional[str]:
        """The consensus transport in use ("shm", "hierarchical", "process_group"); None before attach."""
        return None if self._consensus is None else self._consensus.transport_name

    @property
    def consensus_rounds(self) -> int:
        """Consensus rounds this rank took part in so far (sync points and end-of-attempt rounds)."""
        return 0 if self._consensus is None else self._consensus.sync_count

    @property
    def consensus_finish_s(self) -> float:
        """Seconds this rank spent in end-of-attempt agreements so far."""
        return 0.0 if self._consensus is None else self._consensus.finish_seconds

    def _info(self, message: str) -> None:
        if self._rank == 0 and self.log_attempts:
            print(f"[automicro] {message}", flush=True)
        log.info("automicro: %s", message)

    # ---- Composer events ---------------------------------------------------------------------

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self._last_event = event  # where an error outside any attempt happened (`fit_raised`)
        super().run_event(event, state, logger)

    def init(self, state: State, logger: Logger) -> None:
        # Where the check before Composer's could not be installed (another Composer version).
        if not self._in_automicro_trainer:
            size = "auto" if state.auto_microbatching else state.device_train_microbatch_size
            raise StockTrainerError(stock_trainer_message(type(self).__name__, "this Trainer", size))

    def fit_start(self, state: State, logger: Logger) -> None:
        # Another fit() of the same trainer: the hooks come back if the policy still wants them.
        if self.policy is not None:
            self._apply_hooks(self.policy.hooks, HookReason.FIT_START)
        self.observe_collectives(True)

    def fit_end(self, state: State, logger: Logger) -> None:
        # The hooks and the collective patch are process-wide: none may outlive this fit.
        self._apply_hooks(False, HookReason.FIT_END)
        self.observe_collectives(False)

    def close(self, state: State, logger: Logger) -> None:
        # `trainer.close()`, also after a fit that raised (fit_end did not run).
        self._apply_hooks(False, HookReason.CLOSED)
        self.observe_collectives(False)
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        if self._alarm is not None:
            self._alarm.close()
            self._alarm = None
        if self._consensus is not None:
            self._consensus.close()

    def observe_collectives(self, on: bool) -> None:
        """Put the collective ledger on FSDP2's collectives (True, what `fit` does) or take it off.

        Public for one purpose: measuring what the ledger costs, batch by batch in one run
        (`benchmarks/steady_oom.py --suite overhead`). While it is off, an OOM after the sync
        hooks are off cannot be recovered in-process; the next `fit` puts it back on."""
        if on and self._ledger_handle is None and self._ledger is not None:
            self._ledger_handle = torch_internals.add_collective_observer(self._ledger)
        elif not on and self._ledger_handle is not None:
            self._ledger_handle.remove()
            self._ledger_handle = None

    @property
    def collectives_replayed(self) -> int:
        """Collectives this rank replayed to get back in step after failures with the hooks off."""
        return 0 if self._ledger is None else self._ledger.replayed_total

    def after_loss(self, state: State, logger: Logger) -> None:
        # The `loss` site, once per microbatch, only when a listener (a fault injector) acts on it:
        # an OOM later in the backward is then not blamed on the loss for nothing.
        if self._dispatcher.listens("loss"):
            self._dispatcher.fire("loss", "")

    def eval_start(self, state: State, logger: Logger) -> None:
        self._eval.running = True
        if self.layout is not None:
            self.layout.suspend()
        if self._eval.guarded:
            # An eval forward all-gathers like a training forward: with the eval search on, every
            # all-gather needs its consensus point too.
            self._apply_hooks(True, HookReason.EVAL)

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        if self._eval.guarded:
            self._eval.batch_start(state)

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        self._eval.batch_end()

    @property
    def eval_searches(self) -> dict[str, EvalSearch]:
        """The eval search of each evaluator label that searched."""
        return self._eval.searches

    @property
    def eval_found_sizes(self) -> dict[str, Optional[int]]:
        """The eval microbatch size found per evaluator label (None while still searching)."""
        return self._eval.found_sizes

    def eval_end(self, state: State, logger: Logger) -> None:
        self._eval.running = False
        if self.layout is not None:
            self.layout.resume()
        # Evaluation can leave memory fragmented and a spike behind: guard the next batches.
        if self.policy is None:
            self._apply_hooks(self._eval.guarded, HookReason.AFTER_EVAL)
        self._rearm("eval")

    def _release_memory(self) -> None:
        release_after_failure(self._memory)

    def guard_eval_metric(self, model: Any) -> Callable[..., Any]:
        """Called by `automicro.Trainer`: `model.update_metric`, where an eval metric update that runs
        out of memory is rerun in pieces on that rank (`EvalFence.guard_metric`)."""
        return self._eval.guard_metric(model)

    def pin_eval(self, label: str, size: int) -> None:
        """Called by `automicro.Trainer` (eval_oom='split'): evaluator `label`, pinned at `size`, is split
        further on every rank when an eval batch runs out of memory (`EvalFence.pin`)."""
        self._eval.pin(label, size)

    def guard_eval_forward(self, eval_forward: Callable[..., Any]) -> Callable[..., Any]:
        """Called by `automicro.Trainer`: eval forwards fenced like training attempts
        (`automicro.integration.eval_search.EvalFence`)."""
        return self._eval.guard(eval_forward)

    def _count_oom(self) -> None:
        self.ooms_total += 1

    def _recover_model(self) -> None:
        assert self._sharded is not None
        self._sharded.recover()
        release_after_failure(self._memory)

    def _rearm(self, reason: str) -> None:
        if self.policy is None:
            return
        decision = self.policy.observe(search.Rearm(reason))
        self._apply_hooks(decision.hooks, decision.reason, reason)

    def _apply_hooks(self, want: bool, reason: HookReason, detail: str = "") -> None:
        if self._hooks is None:
            return
        lifecycle_end = reason in (HookReason.FIT_END, HookReason.CLOSED)
        if self._pipeline is not None and self._pipeline.dp_size > 1 and not lifecycle_end:
            # A stage's FSDP2 collectives cross its data-parallel ranks; without a ledger that follows
            # the stages apart, their consensus points are what keeps an OOM there recoverable.
            want = True
        if self._hooks.set_active(want):
            self._info(self._hooks_message(want, reason, detail))

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.policy is None or not self._used_split:
            return
        budget_tokens, padding_waste = self.kind.metric_figures()
        figures = BatchFigures(
            split=self._used_split,
            attempts=self._batch_attempts,
            ooms_total=self.ooms_total,
            searching=self.policy.phase == search.Phase.SEARCHING,
            hooks_active=self.hooks_active,
            thrash_events=self.thrash.events,
            search_time_s=self.search_time_s,
            alloc_retries=self._batch_retries,
            found_size=self.found_size or 0,
            budget_tokens=budget_tokens,
            padding_waste=padding_waste,
            capacity_bytes=self._last_capacity,
        )
        logger.log_metrics({**batch_metrics(figures, self.history), **(self.layout.metrics() if self.layout else {})})
        # Composer moves the timestamp to the next batch before BATCH_END.
        for trace in event_traces(self.history, int(state.timestamp.batch) - 1):
            logger.log_traces(trace)

    # ---- console -------------------------------------------------------------------------------

    def _hooks_message(self, want: bool, reason: HookReason, detail: str) -> str:
        if not want and self.policy is not None and reason is HookReason.STABLE:
            return f"sync hooks off after {self.policy_config.stable_batches} clean batches at {self.kind.stable_at(self.policy)}"
        return f"sync hooks {'on' if want else 'off'} ({reason.value}{': ' + detail if detail else ''})"

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": None if self.policy is None else self.policy.state.to_dict(),
            "ooms_total": self.ooms_total,
            "thrash_events": self.thrash.events,
            "search_time_s": self.search_time_s,
            "history": history_to_state(self.history),
            "tokens": self.kind.state_dict(),
            "eval": self._eval.state_dict(),
            "layout": None if self.layout is None else self.layout.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending_state = state
        self.ooms_total = int(state.get("ooms_total", 0))
        self.thrash.events = int(state.get("thrash_events", 0))
        self.search_time_s = float(state.get("search_time_s", 0.0))
        self.history = history_from_state(state.get("history", []))
        self.kind.load_state_dict(state.get("tokens"))
        self._eval.load_state_dict(state.get("eval", {}))
        self._layout_state = state.get("layout")

    def _ensure_policy(self, batch_size: int, state: Optional[State] = None) -> None:
        batch_size = self.kind.domain(batch_size)
        if self.policy is None:
            self.policy = search.SearchPolicy(self.policy_config, batch_size)
            if self._pending_state is not None and self._pending_state.get("policy") is not None:
                self.policy.state = search.SearchState.from_dict(self._pending_state["policy"])
                self._pending_state = None
                self.policy.observe(search.Rearm("checkpoint loaded"))
                self.kind.resumed(self.policy, batch_size)
                self._step_below_unrecovered_failure(state)
                self._info(f"resumed with microbatch split {self.policy.current_split()} (hooks on until stable)")
            self._apply_hooks(True, HookReason.SEARCHING)
        else:
            changed = self.kind.changed(self.policy, batch_size)
            if changed is not None:
                decision, detail = changed
                self._apply_hooks(decision.hooks, decision.reason, detail)

    # ---- a run that could not recover in-process -------------------------------------------------

    FAILURE_NOTE = failure_note.FILE_NAME

    def fit_raised(self, state: State, error: BaseException) -> Optional[FatalRecoveryError]:
        """`fit()` raised `error` on this rank. An out-of-memory error from outside any attempt
        (the attempts handle their own) leaves the other ranks in the next batch, waiting for this
        one: declare the job lost where they can hear it (the ledger's board on one node, the
        job-lost alarm across nodes), leave the failure note, and return the error to raise."""
        if isinstance(error, FatalRecoveryError) or error is self._agreed_error or self._ledger is None:
            return None
        where = f"at {self._last_event}" if self._last_event is not None else "between batches"
        batch = int(state.timestamp.batch)
        if not is_oom(error):
            # Any other error of this rank alone (a callback, a checkpoint save): the other ranks
            # are in the next batch's collectives; name this rank on theirs too. No failure note:
            # the size is not the cause.
            if not isinstance(error, Exception):
                return None
            return self._ledger.lost_outside_attempt(where, batch, f"it raised {type(error).__name__}: {error}")
        if not self._used_split:
            return None
        failure_note.write(composer_internals.checkpoint_folder(state), self._rank, batch, self._used_split)
        return self._ledger.lost_outside_attempt(where, batch)

    def _step_below_unrecovered_failure(self, state: Optional[State]) -> None:
        """A failure note beside the checkpoint this run resumed from: start below its size."""
        assert self.policy is not None
        note = failure_note.read(None if state is None else composer_internals.checkpoint_folder(state))
        resumed_at = int(state.timestamp.batch) if state is not None else 0
        if note is None or not note.applies(resumed_at, max(self.policy.current_split())):
            return
        try:
            decision = self.policy.observe(search.OOM(note.size, may_rerun=False))
        except search.CannotFitError as error:
            raise MicrobatchSizeError(
                f"automicro: the run stopped at microbatch size {note.size} in batch {note.batch}, and no smaller "
                "size is left to try"
            ) from error
        self._info(
            f"the previous launch could not recover from an OOM at size {note.size} in batch {note.batch} "
            f"({note.path}); resuming at size {decision.next_size} with the sync hooks on"
        )

    # ---- the guarded batch step --------------------------------------------------------------

    def _figures(self) -> LocalFigures:
        retries = self._memory.alloc_retries()
        new = max(0, retries - (self._step.retries_before if self._step is not None else retries))
        peak = self._memory.peak_bytes() if self._step is None else self._step.peak_bytes()
        capacity, outside = capacity_and_outside(self._memory)  # read on every attempt: other processes share cards
        return LocalFigures(
            new_alloc_retries=new,
            # Before the first optimizer step: the peak the next batches will see, with the state
            # that step creates (`automicro.core.optimizer_memory`).
            peak_bytes=peak + self._optimizer_pending if peak else 0,
            projected_bytes=self._optimizer_pending if peak else 0,
            capacity_bytes=capacity,
            allocated_bytes=self._memory.allocated_bytes(),
            microbatch_tokens=self.kind.microbatch_tokens(),
            outside_bytes=outside,
        )

    def train_batch(self, trainer: Any) -> dict[str, torch.Tensor]:
        """Run one batch with OOM-safe retries; returns Composer's total loss dict.

        Dispatches: `BatchStep` splits, runs (through the attempt fence, with the sync hooks on or
        off) and wipes each attempt; here the agreed verdict becomes the policy's next decision."""
        assert self._fence is not None and self._sharded is not None and self._consensus is not None, "attach() was not called"
        step = BatchStep(
            trainer, self._fence, self._dispatcher, self._memory, self._consensus, self._sharded, self._rank,
            pipeline=self._pipeline, tokens=self.tokens, all_reduce=self._all_reduce_sum,
            layout=None if self.layout is None else self.layout.engine,
        )
        self._step = step
        self._optimizer_pending = self._pending_optimizer_bytes(trainer.state)
        self._ensure_policy(step.begin(), trainer.state)
        assert self.policy is not None and self.layout is not None
        if self._layout_state is not None:
            self.layout.load_state_dict(self._layout_state)
            self._layout_state = None
        self.layout.before_batch(
            self.policy.phase == search.Phase.STEADY, self._last_peak, self.policy.usable_bytes(self._last_capacity),
            *self.kind.layout_figures(self.policy, self._peak_at, self.policy_config.probes),
            capacity_read=self._last_capacity or 0, outside_bytes=self._last_outside,
        )
        undone = self.layout.take_undone()
        if undone is not None:
            decision = self.policy.observe(search.Adopt(undone, reopen=True, capacity_bytes=self._last_capacity))
            self._apply_hooks(decision.hooks, decision.reason, "a layout trade undone")
            self._info(decision.event)
        batch_index = step.batch_index
        while True:
            # A pipeline's per-step barriers come off with the sync hooks (a failed stage drains the
            # schedule instead, `automicro.engine.pipeline`); steady_recovery=False keeps them on.
            hooks_on = self.hooks_active or (self._pipeline is not None and not self.steady_recovery)
            split, budget, track = self.kind.next_attempt(self.policy, self.layout, self.policy_config.probes)
            attempt = step.attempt(split, budget, hooks_on, track_peaks=track)
            self._batch_attempts = step.attempts
            result, sizes = attempt.result, attempt.sizes
            verdict, seconds = result.verdict, result.seconds
            self._memory_truth.after_attempt(verdict)
            self._memory_truth.after_rerun(verdict.failed, max(sizes))
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
                step.step_optimizers()
                if self._optimizer_pending:
                    # The first step just made the optimizer state among the blocks batch 0's
                    # attempts left cached: batch 1 starts from an emptied cache, as a rerun does,
                    # so the size chosen with that state projected meets the memory it was chosen for
                    # (not on a card another process shares: `CudaMemory.empty_cache`).
                    self._memory.empty_cache()
                self._used_split = sizes
                self._last_peak, self._last_capacity = verdict.peak_bytes, verdict.capacity_bytes
                self._last_outside = verdict.outside_bytes
                peaks = self._agreed_peaks(step)
                trial_batch = self.layout.trial_batch
                self.layout.after_success(step.attempts, peaks)
                adopted = self.layout.take_adopted()
                if adopted is not None:
                    decision = self.policy.observe(search.Adopt(adopted))
                    self._info(decision.event)
                # A layout trial's "with" batch does not feed the memory model (its trade's bytes are in it).
                self._after_success(verdict, batch_index, sizes, seconds, () if trial_batch else peaks, trial_batch)
                self._optimizer_pending = 0  # the step created the state: evals and later batches hold it
                return attempt.total_loss_dict

            self.ooms_total += 1
            self.search_time_s += seconds
            self._memory_truth.after_failure(step.left_behind, f"batch {batch_index}")
            if result.own_error is not None or verdict.error_ranks:
                self._record(batch_index, sizes, "error", verdict, sizes[0], seconds, hooks=hooks_on)
                # Every rank agreed on this failure: `fit_raised` has nobody left to tell.
                self._agreed_error = result.own_error or FailedOnOtherRank(
                    f"automicro: rank(s) {verdict.error_ranks} failed with a non-OOM error at "
                    f"{[r.site for r in verdict.reports if r.kind == KIND_ERROR]} during batch {batch_index}; "
                    "see that rank's traceback for the cause"
                )
                raise self._agreed_error
            undone = self._relieved_by_layout(f"out of memory at size {max(sizes)}", max(sizes))
            if undone is not None:
                self._memory_truth.layout_undone(undone, max(sizes), batch_index)
                self._record(
                    batch_index, sizes, "oom", verdict, max(sizes), seconds,
                    f"layout undone first; rerun at the same size, now {self.layout.describe()}", hooks=hooks_on,
                )
                continue
            try:
                failed = search.OOM(
                    self._outcome_size(sizes, verdict, failed=True), tuple(verdict.failed_ranks),
                    reached_bytes=reached_bytes(verdict), capacity_bytes=verdict.capacity_bytes or None,
                )
                decision = self.policy.observe(failed)
            except search.CannotFitError as error:
                self._record(batch_index, sizes, "oom", verdict, 0, seconds, hooks=hooks_on)
                self._agreed_error = MicrobatchSizeError(self._cannot_fit_message(verdict))
                raise self._agreed_error from error
            note = decision.event
            if result.replayed:
                note += f"; {result.replayed} collectives replayed to get the ranks back in step"
            self._record(batch_index, sizes, "oom", verdict, decision.next_size, seconds, note, hooks=hooks_on)
            self._apply_hooks(decision.hooks, decision.reason)

    def _relieved_by_layout(self, why: str, size: int) -> Optional[str]:
        """Memory pressure at the settled size goes to the layout first: when it undoes a trade (the
        one returned; None: nothing undone), the size stays and the sync hooks come back on until the
        size is stable again."""
        assert self.policy is not None
        if self.layout is None or self.policy.phase != search.Phase.STEADY:
            return None
        undone = self.layout.relieve(why, size)
        if undone is not None:
            decision = self.policy.observe(search.Rearm("layout undone"))
            self._apply_hooks(decision.hooks, decision.reason, "layout undone")
        return undone

    def _peak_at(self, found: int) -> Optional[tuple[int, int]]:
        """(The largest microbatch, the memory model's peak at it) were the size found `found`;
        None below the smallest size allowed or where the model cannot tell."""
        assert self.policy is not None
        if found < self.policy_config.min_size:
            return None
        largest = max(self.policy.split_for(found))
        peak = self.policy.projected_peak(largest)
        return None if peak is None else (largest, peak)

    def _pending_optimizer_bytes(self, state: State) -> int:
        """The bytes this rank's optimizer state will add at the first step (0 once it exists, or
        for an optimizer `optimizer_memory` does not know; then nothing is projected)."""
        if self._optimizer_state_known or not self.policy_config.use_prediction:
            return 0
        pending = pending_state_bytes(state.optimizers or [])
        if not pending:
            self._optimizer_state_known = True
            return 0
        return pending

    def _outcome_size(self, sizes: tuple[int, ...], verdict: Verdict, failed: bool = False) -> int:
        """What the policy is told the attempt ran at: samples, or tokens (`batch_kinds`)."""
        assert self.policy is not None
        return self.kind.outcome_size(self.policy, sizes, verdict, failed)

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self._ledger is not None:
            self._ledger.all_reduce(tensor)
        else:
            composer_internals.all_reduce_sum(tensor)

    def _cannot_fit_message(self, verdict: Verdict) -> str:
        rows = []
        for r in verdict.reports:
            if r.failed:
                rows.append(
                    f"rank {r.rank} at {r.site}: peak {r.peak_bytes / 2**20:.1f} MiB, "
                    f"allocated {r.allocated_bytes / 2**20:.1f} MiB, capacity {r.capacity_bytes / 2**20:.1f} MiB"
                )
        return (
            f"automicro: {self.kind.cannot_fit()}; "
            + "; ".join(rows)
            + ". Reduce the model or sequence length, shard more (more ranks, reshard_after_forward, "
            "activation_checkpointing, cpu_offload) or raise the memory limit."
        )

    def _agreed_peaks(self, step: BatchStep) -> tuple[tuple[int, int], ...]:
        """The attempt's per-size microbatch peaks, the max over ranks (one round, every rank: the
        attempt was tracked on all or none), with the optimizer state the first step adds."""
        if step.peaks is None:
            return ()
        assert self._consensus is not None
        local = step.peaks.by_size()
        agreed = self._consensus.agree_max([peak for _, peak in local])
        return tuple((size, peak + self._optimizer_pending) for (size, _), peak in zip(local, agreed) if peak)

    def _after_success(
        self, verdict: Verdict, batch_index: int, sizes: tuple[int, ...], seconds: float,
        peaks_by_size: tuple[tuple[int, int], ...] = (), trial_batch: bool = False,
    ) -> None:
        assert self.policy is not None
        self._batch_retries = verdict.any_new_alloc_retries
        # As in Composer's rule, a batch that already ran out of memory is not counted for thrashing.
        retried_clean_batch = verdict.any_new_alloc_retries and self._batch_attempts == 1
        self.kind.trained()
        if self.thrash.observe(retried_clean_batch):
            if self._relieved_by_layout(f"thrashing at size {max(sizes)}", max(sizes)) is not None:
                assert self.layout is not None
                self._record(batch_index, sizes, "thrash", verdict, max(sizes), seconds, f"layout now {self.layout.describe()}")
                return
            decision = self.policy.observe(search.Thrash(self._outcome_size(sizes, verdict)))
            self._record(batch_index, sizes, "thrash", verdict, decision.next_size, seconds, decision.event)
            self._apply_hooks(decision.hooks, decision.reason)
            return
        phase_before = self.policy.phase
        found = self.policy.found_size
        if trial_batch and found is not None and max(sizes) > found:
            # An upsize trial's "with" batch: that size ran with a layout the policy does not model.
            return
        decision = self.policy.observe(
            search.Success(
                self._outcome_size(sizes, verdict),
                peak_bytes=None if trial_batch else verdict.peak_bytes or None,
                capacity_bytes=verdict.capacity_bytes or None,
                projected=self._optimizer_pending > 0,
                peaks_by_size=peaks_by_size,
            )
        )
        if phase_before != search.Phase.STEADY or self._batch_attempts > 1 or decision.phase != search.Phase.STEADY:
            self._record(batch_index, sizes, "ok", verdict, decision.next_size, seconds, decision.event)
        found_line = self.kind.found_line(self.policy, phase_before, sizes)
        if found_line is not None:
            self._info(found_line)
        self._apply_hooks(decision.hooks, decision.reason)

    def _record(
        self,
        batch_index: int,
        sizes: tuple[int, ...],
        outcome: str,
        verdict: Verdict,
        next_size: int,
        seconds: float,
        note: str = "",
        hooks: Optional[bool] = None,
    ) -> None:
        record = AttemptRecord(
            batch=batch_index,
            attempt=self._batch_attempts,
            size=self.kind.record_size(sizes),
            split=sizes,
            outcome=outcome,
            failed_ranks=verdict.failed_ranks,
            sites=verdict.sites,
            next_size=self.kind.record_next(self.policy, next_size),
            hooks=self.hooks_active if hooks is None else hooks,
            seconds=round(seconds, 4),
            note=note,
        )
        self.history.append(record)
        self._info(record.console_line())


def _build_ledger(sharded: ShardedModel, consensus: Consensus, rank: int) -> CollectiveLedger:
    """Collective: the ledger over the default group and the FSDP2 mesh's groups, with a
    shared-memory board when every rank is on one host."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return CollectiveLedger(
            None, [None], sharded.device, rank, poll_s=0, sequence_number=torch_internals.collective_sequence_number
        )
    groups: list[Any] = [dist.group.WORLD]
    for dim in range(sharded.mesh.ndim):
        group = sharded.mesh.get_group(dim)
        if group not in groups:
            groups.append(group)
    board = Board.create(consensus.group)
    if board is not None:
        return CollectiveLedger(board, groups, sharded.device, rank, sequence_number=torch_internals.collective_sequence_number)
    # Several nodes: the board is the launcher's store, written only after a failure, and the job-lost
    # alarm carries what the shared board's fatal record would. Without a store, the ranks hand their
    # records over after the consensus on a CPU group of their own (`CollectiveLedger.align`).
    exchange = dist.new_group(backend="gloo")
    alarm = JobLostAlarm.create(exchange)
    store_board = StoreBoard.create(exchange)
    return CollectiveLedger(
        store_board, groups, sharded.device, rank, poll_s=0, exchange_group=exchange, alarm=alarm,
        sequence_number=torch_internals.collective_sequence_number,
    )


def _build_alarm(consensus: Consensus) -> Any:
    """Collective: the job-lost alarm over the launcher's store (None on one rank or without a store)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return JobLostAlarm.create(consensus.group)


def search_config(
    search_mode: str, stable_batches: int, use_prediction: bool, start_size: Optional[int], probe: bool = False
):
    return search.PolicyConfig(
        search=search_mode,
        stable_batches=stable_batches,
        use_prediction=use_prediction,
        start_size=start_size,
        probe=probe,
    )


START_SIZES = ("probe", "batch")


def _start(start_size: Union[int, str, None], search_mode: str, use_prediction: bool, budget: str) -> str:
    """How the search starts: "auto" (the probe on a GPU, else the batch), "probe", "batch" or
    "size" (an int, checked by the policy's config)."""
    if start_size is None:
        return "auto"
    if isinstance(start_size, int) and not isinstance(start_size, bool):
        return "size"
    if start_size not in START_SIZES:
        raise ValueError(
            f"start_size={start_size!r}: must be left out (the probe on a GPU, the whole batch on CPU), 'probe' "
            "(two small sizes first, then the size the measured memory predicts), 'batch' (the whole batch first, "
            "halving down, as Composer) or a microbatch size >= 1"
        )
    if start_size == "probe" and (search_mode != "bisect" or not use_prediction or budget != "samples"):
        raise ValueError(
            f"start_size='probe' needs search='bisect', use_prediction=true and budget='samples' (got "
            f"search={search_mode!r}, use_prediction={use_prediction!r}, budget={budget!r}); the probe feeds the "
            "bisection's memory prediction"
        )
    return start_size


__all__ = ["AutoMicrobatching", "AttemptRecord", "MicrobatchSizeError", "is_oom"]
