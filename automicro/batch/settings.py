"""What a user can set on `AutoMicrobatching` (the YAML's ``callbacks.auto_microbatching`` keys),
checked once: every bad value is refused here, with what to set instead.

Owns: the checks and the values they resolve to (the search's config, how it starts, the batch
kind, the layout config). May not touch: Composer's state, torch, the ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from automicro.core import policy as search
from automicro.core.headroom import DEFAULT_RERUN_TARGET
from automicro.core.layout import LayoutConfig
from automicro.core.transport import TRANSPORTS
from automicro.engine.head import HEAD_MODES
from automicro.engine.hooks import SYNC_POINTS
from automicro.batch.batch_kinds import BatchKind, batch_kind
from automicro.batch.host_offload import check_mode
from automicro.batch.loss_normalization import LossNormalization

BUDGETS = ("samples", "tokens")
EVAL_OOM = ("split", "stop")
START_SIZES = ("probe", "batch")


@dataclasses.dataclass
class Settings:
    """The checked settings. `policy_config` is the search's config before the device is known
    (`TrainingSearch.configure` resolves the start and a pipeline's sizes at attach)."""

    start: str
    policy_config: search.PolicyConfig
    kind: BatchKind
    thrash_batches: int
    layout_config: LayoutConfig
    eval_oom: str
    cpu_sync_group: bool
    memory_fraction: Optional[Union[float, dict[int, float]]]
    log_attempts: bool
    unguarded_timeout_s: float
    sync_points: str
    consensus_transport: str
    steady_recovery: bool
    loss_normalization: LossNormalization
    # After the run ended with an error: how long the process may take to exit (`core.exit_watch`).
    exit_timeout_s: float = 30.0
    # The job-level share of batches a steady-state OOM may rerun; the settled size keeps the headroom it
    # takes at the run's world size (`core.headroom`). 0: the size found stays.
    rerun_target: float = DEFAULT_RERUN_TARGET
    # Every trial is priced before it runs and runs only where it pays (`batch.trial_plan`); false: every trial
    # runs, unpriced (tests, measurements).
    bound_trials: bool = True
    # False: no trial at all (the size search and nothing else: a short fine-tune).
    trials: bool = True
    # A run that stops making progress (`core.watchdog`): the report and the end (None: what a batch should cost),
    # and how long a SIGTERM or SIGINT gives the process.
    stall_report_s: Optional[float] = None
    stall_end_s: Optional[float] = None
    signal_exit_s: float = 30.0
    # The vocabulary head (`automicro.batch.head_choice`): None (auto on a GPU where the layout is searched, plain
    # elsewhere), "auto", "fused" or "plain".
    head: Optional[str] = None
    # The ladder's last rung below size 1 (`automicro.batch.host_offload`): None (off) or "auto".
    offload: Optional[str] = None
    # A routed model's routers watched (`automicro.batch.routing`): an OOM at a settled size says whether routing moved it.
    watch_routing: bool = True

    def searches_layout(self, device_type: str) -> bool:
        """The layout trials run on this device (``layout: auto``, the default on a GPU; an OOM in a trial must be
        recoverable: ``steady_recovery``)."""
        return self.layout_config.resolve(device_type).mode == "auto" and self.steady_recovery

    @classmethod
    def parse(
        cls,
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
        rerun_target: float = DEFAULT_RERUN_TARGET,
        bound_trials: bool = True,
        stall_report_s: Optional[float] = None,
        stall_end_s: Optional[float] = None,
        signal_exit_s: float = 30.0,
        trials: bool = True,
        head: Optional[str] = None,
        offload: Union[str, bool, None] = None,
        watch_routing: bool = True,
    ) -> "Settings":
        # None: the probe on a GPU, the whole batch on CPU (resolved at attach, as the layout).
        start = _start(start_size, search, use_prediction, budget)
        config = search_config(
            search, stable_batches, use_prediction, start_size if isinstance(start_size, int) else None,
            probe=start == "probe",
        )
        if budget not in BUDGETS:
            raise ValueError(
                f"budget={budget!r}: must be 'samples' (the search counts samples per microbatch) or 'tokens' (it "
                "finds tokens per microbatch and packs variable-length batches under them)"
            )
        # budget="tokens": the search's sizes are tokens per microbatch (`token_budget`).
        if fixed_tokens is not None and budget != "tokens":
            raise ValueError(f"fixed_tokens={fixed_tokens!r} needs budget='tokens'")
        if packing is not None and not isinstance(packing, bool) and packing != "auto":
            raise ValueError(
                f"packing={packing!r}: must be null (with budget: tokens, packed rows measured against padded batches on "
                "a GPU where the model's attention skips the other samples), 'auto' (measured on any device), true or false"
            )
        if packing is True and budget != "tokens":
            raise ValueError(
                f"packing=true needs budget='tokens' (got budget={budget!r}): packed rows are cut by their tokens"
            )
        if packing is True and loss_normalization == "samples":
            raise ValueError(
                "packing=true with loss_normalization='samples': a packed microbatch is one row whatever its samples, so "
                "a per-sample weight means nothing; drop loss_normalization (per loss token, the default) or packing"
            )
        # What a batch is counted in (`batch_kinds`): the callback asks it, never `if tokens`.
        kind = batch_kind(budget, fixed_tokens, packing)
        if eval_oom not in EVAL_OOM:
            raise ValueError(
                f"eval_oom={eval_oom!r}: must be 'split' (an evaluator with a pinned device_eval_microbatch_size that "
                "runs out of memory is split further on every rank) or 'stop' (the run ends, as without automicro)"
            )
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
        if consensus_transport not in TRANSPORTS:
            raise ValueError(
                f"consensus_transport={consensus_transport!r}: must be 'auto' (shared memory on one node, "
                "hierarchical on several), 'shm', 'hierarchical' or 'process_group'"
            )
        # False: no collective ledger; a failure with the hooks off then stops the job after
        # unguarded_timeout_s (the behaviour before in-process recovery; for measuring its cost).
        # A pipeline then keeps its per-step barriers for the whole run (the cost of not draining).
        if not isinstance(steady_recovery, bool):
            raise ValueError(f"steady_recovery={steady_recovery!r}: must be true or false")
        if not isinstance(unguarded_timeout_s, (int, float)) or unguarded_timeout_s <= 0:
            raise ValueError(f"unguarded_timeout_s={unguarded_timeout_s!r}: must be a positive number of seconds")
        if isinstance(exit_timeout_s, bool) or not isinstance(exit_timeout_s, (int, float)) or exit_timeout_s <= 0:
            raise ValueError(
                f"exit_timeout_s={exit_timeout_s!r}: must be a positive number of seconds (how long the process may take "
                "to exit after the run ended with an error, before automicro prints what holds it and ends it)"
            )
        if isinstance(rerun_target, bool) or not isinstance(rerun_target, (int, float)) or not 0.0 <= rerun_target < 1.0:
            raise ValueError(
                f"rerun_target={rerun_target!r}: must be a number in [0, 1): the share of the batches a steady-state OOM "
                "may rerun over the whole job (0.01: 1%), which sets the headroom below the size found; 0 keeps the size found"
            )
        if not isinstance(bound_trials, bool):
            raise ValueError(
                f"bound_trials={bound_trials!r}: must be true (each trial is priced before it runs and runs only where "
                "it pays) or false (every trial runs, unpriced)"
            )
        if not isinstance(watch_routing, bool):
            raise ValueError(
                f"watch_routing={watch_routing!r}: must be true (a routed model's routers are watched, so that an OOM "
                "at a settled size says whether routing moved the memory) or false (not watched: nothing installed)"
            )
        if not isinstance(trials, bool):
            raise ValueError(
                f"trials={trials!r}: must be true (once the size settles, trials that pay for themselves may change how "
                "the batch runs) or false (the size search and nothing else)"
            )
        if head is not None and head not in HEAD_MODES:
            raise ValueError(
                f"head={head!r}: must be left out (auto on a GPU, plain elsewhere), 'auto' (the fused head timed against "
                "the plain one once the size settles, priced like every trial, and kept where faster), 'fused' (the loss "
                "computed from the hidden states in chunks, never the whole logits: the size is searched with it) or "
                "'plain' (the model's own head)"
            )
        if head == "auto" and (not trials or layout == "fixed" or isinstance(layout, (list, tuple))):
            why = "trials=false turns every trial off" if not trials else f"layout={layout!r} keeps the layout trials off"
            raise ValueError(
                f"head='auto' times the fused head against the plain one in the layout trials, and {why}: set head: fused "
                "or head: plain, or drop " + ("trials=false" if not trials else "the layout key (or set layout: auto)")
            )
        if not trials:
            if layout == "auto":
                raise ValueError(
                    "layout='auto' runs the layout trials and trials=false turns every trial off: drop layout (the "
                    "engine's own layout then stays), pin a list of trades, or drop trials=false"
                )
            if packing == "auto":
                raise ValueError(
                    "packing='auto' times packed rows against padded batches and trials=false turns every trial off: "
                    "pin packing (true or false) or drop trials=false"
                )
            if layout is None:
                layout = "fixed"
            if packing is None and budget == "tokens":
                packing = False
        for key, value in (("stall_report_s", stall_report_s), ("stall_end_s", stall_end_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(
                    f"{key}={value!r}: must be null (the default: from what a batch should cost, generous for a batch that "
                    "searches, compiles or runs a trial) or a positive number of seconds without progress"
                )
        if stall_report_s is not None and stall_end_s is not None and stall_end_s < stall_report_s:
            raise ValueError(
                f"stall_end_s={stall_end_s!r} is below stall_report_s={stall_report_s!r}: the run is ended after it is "
                "reported; set stall_end_s at least stall_report_s"
            )
        if isinstance(signal_exit_s, bool) or not isinstance(signal_exit_s, (int, float)) or signal_exit_s <= 0:
            raise ValueError(
                f"signal_exit_s={signal_exit_s!r}: must be a positive number of seconds (after SIGTERM or SIGINT the process "
                "ends within it, its stacks written, even where its main thread is blocked)"
            )
        return cls(
            start=start,
            policy_config=kind.policy_config(config),
            kind=kind,
            thrash_batches=thrash_batches,
            # What the engine may trade for speed once the size settles (`automicro.core.layout`).
            layout_config=LayoutConfig.parse(layout, layout_trial_batches, layout_min_gain, layout_size_trials),
            eval_oom=eval_oom,
            cpu_sync_group=cpu_sync_group,
            memory_fraction=memory_fraction,
            log_attempts=log_attempts,
            unguarded_timeout_s=float(unguarded_timeout_s),
            sync_points=sync_points,
            consensus_transport=consensus_transport,
            steady_recovery=steady_recovery,
            # Per loss token over the whole batch by default with budget: tokens (`loss_normalization`).
            loss_normalization=LossNormalization.parse(loss_normalization, label_shift, budget),
            exit_timeout_s=float(exit_timeout_s),
            rerun_target=float(rerun_target),
            bound_trials=bound_trials,
            trials=trials,
            stall_report_s=None if stall_report_s is None else float(stall_report_s),
            stall_end_s=None if stall_end_s is None else float(stall_end_s),
            signal_exit_s=float(signal_exit_s),
            head=head,
            offload=check_mode(offload),
            watch_routing=watch_routing,
        )


def search_config(
    search_mode: str, stable_batches: int, use_prediction: bool, start_size: Optional[int], probe: bool = False
) -> search.PolicyConfig:
    return search.PolicyConfig(
        search=search_mode,
        stable_batches=stable_batches,
        use_prediction=use_prediction,
        start_size=start_size,
        probe=probe,
    )


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
