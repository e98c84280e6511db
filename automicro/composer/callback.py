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

`automicro.Trainer` runs each batch through `train_batch()`: every attempt is fenced by the
consensus protocol, a failed attempt is wiped (outputs, grads, metrics, FSDP2 state through the
engine's `recover()`) and the same batch is rerun at the next size the search policy picks. Sync
hooks are on while searching and come off after `stable_batches` clean batches.

Owns: dispatching Composer's events to the rooms that own the behaviour (`settings`: the checked
keys; `runtime`: consensus, ledger, fence, hooks, memory source; `training_search`: the training
batch, its policy and history; `layout_trials`; `eval_search`: the eval fence and searches; the
batch kind), and composing their checkpoint parts. May not touch: FSDP2 internals (the engine's
`recover()` does), torch or Composer privates outside the two `_internals` modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger

from automicro.core import failure_note
from automicro.core.attempt import is_oom  # noqa: F401 - exported
from automicro.core.ledger import FatalRecoveryError
from automicro.core.memory import MemorySource
from automicro.core.metrics import AttemptRecord, batch_metrics, event_traces
from automicro.core.policy import HookReason
from automicro.core.sites import AttemptContext, SiteDispatcher
from automicro.engine.sharding import ShardedModel
from automicro.composer import _composer_internals as composer_internals
from automicro.composer import head_metrics, loss_counting
from automicro.composer.composer_host import ComposerHost
from automicro.composer.eval_search import EvalFence, EvalSearch
from automicro.batch.head_choice import attach_head
from automicro.batch.layout_trials import LayoutTrials
from automicro.composer.pipeline_batch import PipelineBatch
from automicro.batch.runtime import Runtime
from automicro.batch.settings import Settings, search_config
from automicro.composer.stock_trainer import StockTrainerError, refuse_stock_trainer, stock_trainer_message
from automicro.batch.training_search import MicrobatchSizeError, TrainingSearch


class AutoMicrobatching(Callback):
    """Finds the largest microbatch that fits on every rank under FSDP2, without deadlocks.

    The keyword arguments are the YAML keys of ``callbacks.auto_microbatching`` (the configuration
    reference is generated from this list); `automicro.AutoStep` and the HF and Lightning adapters take
    the same, less the eval ones.

    Args:
        stable_batches: Clean batches at one split before the sync hooks come off.
        thrash_batches: Batches with allocator retries in a row that count as an OOM (a layout trial's batches
            are not counted: their retries are timed in its arms). On a GPU the size below is then timed against
            those batches, and the retrying size kept where it was faster (its retries accepted).
        search: ``bisect`` (the largest size that fits, between the bounds the attempts found) or
            ``halve`` (Composer's own policy, as a baseline).
        use_prediction: Predict the next size from the measured memory of the sizes tried.
        start_size: Left out: the probe on a GPU, the whole batch on CPU; ``probe`` (two small sizes,
            then the size the measured memory predicts); ``batch`` (the whole batch first, halving down,
            as Composer); or a microbatch size to try first.
        cpu_sync_group: Consensus rounds over a gloo group of their own (false: over the default group).
        memory_fraction: A number in (0, 1] or ``{rank: fraction}``: caps each rank's device memory at
            that share, to make memory tight (and uneven) on purpose.
        log_attempts: Print one line per attempt of the search.
        unguarded_timeout_s: Where a failure cannot be recovered in-process, every rank stops within
            this many seconds.
        sync_points: ``all`` (consensus at module boundaries and before collectives while searching) or
            ``collectives`` (only before FSDP2's collectives: fewer rounds).
        consensus_transport: How a consensus round travels: ``auto`` (shared memory on one host,
            hierarchical on several), ``shm``, ``hierarchical`` or ``process_group``.
        steady_recovery: An OOM after the hooks are off reruns the batch (the collective ledger); false:
            the job stops after such an OOM.
        budget: ``samples`` (the size is samples per microbatch) or ``tokens`` (tokens per microbatch:
            variable-length batches packed under the budget).
        fixed_tokens: With ``budget: tokens``: a token budget set by hand (null: searched).
        eval_oom: ``split`` (an evaluator with a pinned eval microbatch size that runs out of memory is
            split further on every rank) or ``stop`` (the run ends, as without automicro).
        layout: ``auto`` (the default on a GPU: trades of memory for speed tried once the size is found,
            the faster kept), ``fixed`` (the engine's own layout; the default on CPU) or a list of trades
            to pin (``grad_sync_once``, ``no_reshard``, ``no_recompute``).
        layout_trial_batches: Batches each trade is timed over.
        layout_min_gain: A trade is kept only when faster by more than this share (0.01: 1%).
        layout_size_trials: Under ``layout: auto``, also time microbatches smaller than the size found
            and keep the faster.
        loss_normalization: ``tokens`` (the loss per loss token over the whole batch: training does not
            depend on the split; the default with ``budget: tokens``) or ``samples`` (each microbatch's
            mean loss weighted by its samples, Composer's default).
        label_shift: ``auto`` (0 for models whose labels come shifted, 1 otherwise), 1 (the model shifts
            its labels, as transformers' causal LMs do) or 0.
        packing: With ``budget: tokens``: null (packed rows measured against padded batches on a GPU where
            the model's attention keeps samples apart), ``auto`` (measured on any device), true or false.
        exit_timeout_s: After the run ended with an error, the process gets this many seconds to exit
            before automicro prints what holds it and ends it.
        rerun_target: The share of the batches a steady-state OOM may rerun over the whole job (0.01:
            1%); the size settled on keeps the headroom below the size found that this takes at the
            run's world size, from the spread of the settling batches' peaks; 0 keeps the size found.
        trials: Once the size settles, time other ways of running the same batch and keep the faster (the
            blocks compiled again, packed rows, the model unsharded on one GPU, the layout trades, smaller
            microbatches), each priced before it runs from what the run measured and run only where it pays, all
            within 1% of the run's planned seconds; false: the size search and nothing else (a short fine-tune).
        bound_trials: Price each trial before it runs (false: every trial runs, unpriced: for measuring a trial).
        stall_report_s: Seconds without progress after which every thread's stack and what automicro was
            doing are written (null: from what a settled batch takes, generous for a batch that searches,
            compiles or runs a trial, an evaluation or a checkpoint save).
        stall_end_s: Seconds without progress after which the run ends with an error naming the stall
            (null: as stall_report_s, longer).
        signal_exit_s: After SIGTERM or SIGINT the process ends within this many seconds, its stacks written,
            even where its main thread is blocked in a collective or a compile.
        head: The vocabulary head (the output projection and the loss over the vocabulary): ``auto`` (the default
            on a GPU where the layout is searched: once the size settles, the fused head is priced like every trial,
            measured, timed against the plain one at the size it fits and kept where faster), ``fused`` (the loss
            computed from the hidden states in chunks, never the whole logits: the size is searched with it) or
            ``plain`` (the model's own head; the default elsewhere). automicro's Llama and transformers' Llama,
            Mistral, Qwen2/3, Gemma 1/2/3, OLMo-2, Phi-3, GPT-2, StableLM and Granite causal LMs, and their routed
            kin (Qwen3-MoE, OLMoE, Mixtral). With ``device_train_microbatch_size`` set to a number the callback
            searches nothing, but ``fused`` is still put on the model (FSDP2 needed) and ``auto`` is refused.
        offload: ``auto``: where microbatch size 1 still runs out with every block recomputing, FSDP2's CPU offload of
            the sharded parameters, their gradients and the optimizer state is switched on as the ladder's last rung
            (the same numbers as ``parallelism_config.fsdp2.cpu_offload: true``, slower: the optimizer steps on the
            host) and the size searched again; also before the first batch where the parameters, gradients and the
            first step's optimizer state alone pass the device's capacity. A GPU job with FSDP2 only. Left out or
            ``off`` (the default): the run ends there, its message saying so.
        watch_routing: A routed (mixture-of-experts) model's routers watched: each router's busiest expert share
            counted on the device, read only after an OOM, so that an OOM at a settled size says whether routing
            moved the memory (`automicro.batch.routing`); false: nothing installed.

    The rooms that own the behaviour: `settings` (the checked keys), `runtime` (what attach builds:
    consensus, ledger, fence, sync hooks, memory source), `search` (the training batch under `auto`
    and its checkpoint part), `layout` (the layout trials), `_eval` (the eval fence and searches)."""

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
        layout_size_trials: bool = True,
        loss_normalization: Optional[str] = None,
        label_shift: Union[str, int] = "auto",
        packing: Union[bool, str, None] = None,
        exit_timeout_s: float = 30.0,
        rerun_target: float = 0.01,
        bound_trials: bool = True,
        stall_report_s: Optional[float] = None,
        stall_end_s: Optional[float] = None,
        signal_exit_s: float = 30.0,
        trials: bool = True,
        head: Optional[str] = None,
        offload: Union[str, bool, None] = None,
        watch_routing: bool = True,
    ) -> None:
        self.settings = Settings.parse(
            stable_batches, thrash_batches, search, use_prediction, start_size, cpu_sync_group, memory_fraction,
            log_attempts, unguarded_timeout_s, sync_points, consensus_transport, steady_recovery, budget,
            fixed_tokens, eval_oom, layout, layout_trial_batches, layout_min_gain, layout_size_trials,
            loss_normalization, label_shift, packing, exit_timeout_s, rerun_target, bound_trials, stall_report_s,
            stall_end_s, signal_exit_s, trials, head, offload, watch_routing,
        )
        self.runtime = Runtime(self.settings)
        self.search = TrainingSearch(self.settings, self.runtime)
        self.layout: Optional[LayoutTrials] = None
        # Eval forwards fenced like training attempts; one bisect search per evaluator label.
        self._eval = EvalFence(
            self._info, self._count_oom,
            lambda: search_config(self.policy_config.search, self.policy_config.stable_batches, False, None),
        )
        self._last_event: Optional[Event] = None
        self._in_automicro_trainer = False
        # Before Composer's own checks in any composer.Trainer built with this callback.
        composer_internals.check_before_composer_trainer(refuse_stock_trainer)

    # The settings, as the YAML keys set them.
    start = property(lambda self: self.settings.start)
    eval_oom = property(lambda self: self.settings.eval_oom)
    layout_config = property(lambda self: self.settings.layout_config)
    memory_fraction = property(lambda self: self.settings.memory_fraction)
    sync_points = property(lambda self: self.settings.sync_points)
    log_attempts = property(lambda self: self.settings.log_attempts)
    kind = property(lambda self: self.settings.kind)
    tokens = property(lambda self: self.settings.kind.tokens)
    # The training search's state (`TrainingSearch`), read-only here.
    policy_config = property(lambda self: self.search.config, doc="The size search's config (resolved at attach).")
    policy = property(lambda self: self.search.policy)
    history = property(lambda self: self.search.history)
    ooms_total = property(lambda self: self.search.ooms_total)
    search_time_s = property(lambda self: self.search.search_time_s)
    thrash = property(lambda self: self.search.thrash)
    used_split = property(lambda self: self.search.used_split, doc="The split of the last batch that trained (empty before).")
    batch_attempts = property(lambda self: self.search.batch_attempts, doc="Attempts of the current (or last) batch.")

    def check_trainer(self, trainer: Any, accumulate_on_tokens: Optional[bool] = None) -> None:
        """Called by `automicro.Trainer` once Composer's Trainer is built: settings that cannot go together,
        and the loss normalisation (`accumulate_on_tokens`: the Trainer's argument, None where not passed)."""
        self.kind.check_trainer(trainer)
        self.kind.label_shift(loss_counting.apply(self.settings.loss_normalization, trainer, self._info, accumulate_on_tokens), self._info)
        self.kind.check_packing(
            trainer.state.model, self._info, self.settings.loss_normalization.resolved,
            "cuda" if getattr(trainer.state.device, "name", "cpu") == "gpu" else "cpu",
        )

    def bind_trainer(self) -> None:
        """Called by `automicro.Trainer` for each of its AutoMicrobatching callbacks."""
        self._in_automicro_trainer = True

    # ---- wiring ------------------------------------------------------------------------------

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

        rt = self.runtime
        rt.attach(sharded, self.search.figures, memory, sites, pipeline)
        one_rank = dist.is_initialized() and dist.get_world_size() == 1 and sharded.fsdp_modules and pipeline is None
        if one_rank and self.layout_config.resolve(sharded.device.type).mode != "auto" and not self.layout_config.pinned:
            self._info(
                "one rank: FSDP2 with the fixed layout gathers parameters and reduces gradients every microbatch; "
                "layout: auto (the default on a GPU) trades that away once the size is found (docs/guides/one-gpu.md)"
            )
        self.search.configure(sharded.device.type, pipeline)
        # The head before the layout trials: its switch is one of their trades under head: auto.
        model = sharded.module
        switch = attach_head(
            self.settings, sharded, self._info, allocated=lambda: rt.memory.allocated_bytes(),
            logits_needed=head_metrics.logits_needed(model), pipeline=pipeline is not None, also=head_metrics.from_loss(model),
        )
        if switch is not None:
            twin = getattr(sharded, "twin", None)
            for composer_model in [model] + ([twin.module] if twin is not None else []):
                head_metrics.install(composer_model, switch)
        self.layout = self.search.layout = LayoutTrials(
            self.layout_config, sharded, rt.consensus, self._info, recoverable=rt.ledger is not None, pipeline=pipeline is not None,
        )
        self._eval.attach(
            rt.fence, rt.dispatcher, rt.recover_model, lambda: self.hooks_active, rt.release_memory,
            memory=lambda: rt.memory,
            after_failure=lambda left_behind, what: self.search.memory_truth.after_failure(left_behind, what, "eval"),
        )

    def set_memory_source(self, memory: MemorySource) -> None:
        self.runtime.memory = memory

    @property
    def hooks_active(self) -> bool:
        return self.runtime.hooks_active

    @property
    def found_size(self) -> Optional[int]:
        return None if self.policy is None else self.policy.found_size

    def summary_line(self, per_rank_batch: Optional[int] = None) -> Optional[str]:
        """What the search found, for the console at the end of a fit (None before any batch)."""
        return self.search.summary_line(per_rank_batch)

    # Read-only figures for dashboards, benchmarks and tests.

    @property
    def sites(self) -> SiteDispatcher:
        """The site dispatcher this callback fires (the trainer's, once attached)."""
        return self.runtime.dispatcher

    @property
    def attempt_context(self) -> AttemptContext:
        """Where the current attempt is: batch, attempt, microbatch, last site (read it, do not write it)."""
        return self.runtime.dispatcher.context

    @property
    def left_behind_bytes(self) -> int:
        """The most a failed attempt left allocated after its wipe on this rank (0: nothing beyond
        the tolerance, `automicro.batch.memory_truth`)."""
        return self.search.memory_truth.left_behind_bytes

    @property
    def left_behind_checked(self) -> dict[str, int]:
        """How many failed attempts' wipes `left_behind_bytes` covers, by kind ("train", "eval")."""
        return dict(self.search.memory_truth.checked)

    @property
    def left_behind_exact(self) -> int:
        """The most a failed attempt left allocated after its wipe, below the tolerance too (bytes;
        exact under `automicro.testing.MemoryCap`, which counts live tensor bytes)."""
        return self.search.memory_truth.left_behind_exact

    @property
    def transport_name(self) -> Optional[str]:
        """The consensus transport in use ("shm", "hierarchical", "process_group"); None before attach."""
        return None if self.runtime.consensus is None else self.runtime.consensus.transport_name

    @property
    def consensus_rounds(self) -> int:
        """Consensus rounds this rank took part in so far (sync points and end-of-attempt rounds)."""
        return 0 if self.runtime.consensus is None else self.runtime.consensus.sync_count

    @property
    def consensus_finish_s(self) -> float:
        """Seconds this rank spent in end-of-attempt agreements so far."""
        return 0.0 if self.runtime.consensus is None else self.runtime.consensus.finish_seconds

    @property
    def collectives_replayed(self) -> int:
        """Collectives this rank replayed to get back in step after failures with the hooks off."""
        return 0 if self.runtime.ledger is None else self.runtime.ledger.replayed_total

    def _info(self, message: str) -> None:
        self.runtime.info(message)

    # ---- Composer events ---------------------------------------------------------------------

    # Events after which the loop runs callbacks, logging and checkpoint saves until the next batch (a generous bound).
    _BETWEEN_BATCHES = (Event.BATCH_END, Event.BATCH_CHECKPOINT, Event.EPOCH_END, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT)

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self._last_event = event  # where an error outside any attempt happened (`fit_raised`)
        watchdog = self.runtime.watchdog
        if watchdog is not None:  # every event is progress (`core.watchdog`)
            if event in self._BETWEEN_BATCHES:
                watchdog.enter(f"between batches ({event.value}: callbacks, logging, checkpoint saves)")
            elif event == Event.EVAL_START:
                watchdog.enter("an evaluation")
            else:
                watchdog.beat()
        super().run_event(event, state, logger)

    def init(self, state: State, logger: Logger) -> None:
        # Where the check before Composer's could not be installed (another Composer version).
        if not self._in_automicro_trainer:
            size = "auto" if state.auto_microbatching else state.device_train_microbatch_size
            raise StockTrainerError(stock_trainer_message(type(self).__name__, "this Trainer", size))

    def fit_start(self, state: State, logger: Logger) -> None:
        # Another fit() of the same trainer: the hooks come back if the policy still wants them.
        if self.policy is not None:
            self.search.apply_hooks(self.policy.hooks, HookReason.FIT_START)
        self.observe_collectives(True)
        if self.runtime.watchdog is not None:
            self.runtime.watchdog.arm()

    def fit_end(self, state: State, logger: Logger) -> None:
        # The hooks and the collective patch are process-wide: none may outlive this fit.
        self.search.apply_hooks(False, HookReason.FIT_END)
        self.observe_collectives(False)
        if self.runtime.watchdog is not None:
            self.runtime.watchdog.disarm()

    def close(self, state: State, logger: Logger) -> None:
        # `trainer.close()`, also after a fit that raised (fit_end did not run).
        self.search.apply_hooks(False, HookReason.CLOSED)
        self.runtime.close()

    def observe_collectives(self, on: bool) -> None:
        """Put the collective ledger on FSDP2's collectives (True, what `fit` does) or take it off.

        Public for one purpose: measuring what the ledger costs, batch by batch in one run
        (`benchmarks/steady_oom.py --suite overhead`). While it is off, an OOM after the sync
        hooks are off cannot be recovered in-process; the next `fit` puts it back on."""
        self.runtime.observe_collectives(on)

    def after_loss(self, state: State, logger: Logger) -> None:
        # The `loss` site, once per microbatch, only when a listener (a fault injector) acts on it:
        # an OOM later in the backward is then not blamed on the loss for nothing.
        if self.runtime.dispatcher.listens("loss"):
            self.runtime.dispatcher.fire("loss", "")

    def eval_start(self, state: State, logger: Logger) -> None:
        self._eval.running = True
        if self.layout is not None:
            self.layout.suspend()
        if self._eval.guarded:
            # An eval forward all-gathers like a training forward: with the eval search on, every
            # all-gather needs its consensus point too.
            self.search.apply_hooks(True, HookReason.EVAL)

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
            self.search.apply_hooks(self._eval.guarded, HookReason.AFTER_EVAL)
        self.search.rearm("eval")

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
        (`automicro.composer.eval_search.EvalFence`)."""
        return self._eval.guard(eval_forward)

    def _count_oom(self) -> None:
        self.search.ooms_total += 1

    def batch_end(self, state: State, logger: Logger) -> None:
        figures = self.search.batch_figures()
        if figures is None:
            return
        logger.log_metrics({**batch_metrics(figures, self.history), **(self.layout.metrics() if self.layout else {}),
                            **self.search.trial_metrics()})
        # Composer moves the timestamp to the next batch before BATCH_END.
        for trace in event_traces(self.history, int(state.timestamp.batch) - 1) + self.search.trial_traces():
            logger.log_traces(trace)

    # ---- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {**self.search.state_dict(), "eval": self._eval.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.search.load_state_dict(state)
        self._eval.load_state_dict(state.get("eval", {}))

    # ---- the batch and a run that could not recover in-process ---------------------------------

    FAILURE_NOTE = failure_note.FILE_NAME

    def train_batch(self, trainer: Any) -> dict[str, torch.Tensor]:
        """Called by `automicro.Trainer` for each batch: one batch with OOM-safe retries
        (`TrainingSearch.train_batch`); returns Composer's total loss dict."""
        loss_counting.ensure_counter(self.settings.loss_normalization, trainer, self._info)
        return self.search.train_batch(ComposerHost(trainer))

    def fit_raised(self, state: State, error: BaseException) -> Optional[FatalRecoveryError]:
        """`fit()` raised `error` on this rank: what to raise instead (`TrainingSearch.lost`), or None."""
        where = f"at {self._last_event}" if self._last_event is not None else "between batches"
        return self.search.lost(error, where, int(state.timestamp.batch), composer_internals.checkpoint_folder(state))


__all__ = ["AutoMicrobatching", "AttemptRecord", "MicrobatchSizeError", "is_oom"]
