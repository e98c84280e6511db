"""What `AutoMicrobatching.attach` builds on every rank once the model is sharded, and takes down at
`close`: the consensus, the collective ledger (or the job-lost alarm without it), the attempt fence,
the sync hooks, the memory source; plus the console line and the hooks' switch.

Owns: building and closing these, which hook rule a pipeline needs. May not touch: the search's
state (`training_search`), Composer's events (`callback`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

from automicro.core.alarm import JobLostAlarm
from automicro.core.attempt import AttemptFence
from automicro.core.consensus import Consensus, LocalFigures
from automicro.core.ledger import Board, CollectiveLedger
from automicro.core.memory import CudaMemory, MemorySource, NoMemory, release_after_failure
from automicro.core.policy import HookReason
from automicro.core.sites import SiteDispatcher
from automicro.core.store_board import StoreBoard
from automicro.core.watchdog import SignalExit, Watchdog
from automicro.engine import _torch_internals as torch_internals
from automicro.engine.hooks import SyncHooks
from automicro.engine.sharding import ShardedModel
from automicro.batch.pipeline_hooks import StagedBatch
from automicro.batch.settings import Settings

log = logging.getLogger(__name__)


class Runtime:
    """One rank's machinery, empty until `attach` (collective)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.rank = 0
        self.sharded: Optional[ShardedModel] = None
        self.pipeline: Optional[StagedBatch] = None
        self.consensus: Optional[Consensus] = None
        self.ledger: Optional[CollectiveLedger] = None
        self.alarm: Any = None
        self.fence: Optional[AttemptFence] = None
        self.hooks: Optional[SyncHooks] = None
        self.memory: MemorySource = NoMemory()
        self.dispatcher = SiteDispatcher()  # replaced by the trainer's at attach()
        self._ledger_handle: Any = None
        # A run that stops making progress says where and ends (`core.watchdog`); made at attach, armed by the loop.
        self.watchdog: Optional[Watchdog] = None
        self.signal_exit: Optional[SignalExit] = None

    def info(self, message: str) -> None:
        if self.rank == 0 and self.settings.log_attempts:
            print(f"[automicro] {message}", flush=True)
        log.info("automicro: %s", message)

    def attach(
        self,
        sharded: ShardedModel,
        figures: Callable[[], LocalFigures],
        memory: Optional[MemorySource],
        sites: Optional[SiteDispatcher],
        pipeline: Optional[StagedBatch],
    ) -> None:
        import torch.distributed as dist

        s = self.settings
        if sites is not None:
            self.dispatcher = sites
        self.sharded, self.pipeline = sharded, pipeline
        self.consensus = Consensus.create(use_cpu_group=s.cpu_sync_group, transport=s.consensus_transport)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.info(f"consensus transport {self.consensus.describe()}")
        if pipeline is not None:
            # The steady phase needs no ledger: with one data-parallel rank per stage a stage that fails
            # drains its sends and receives (`automicro.engine.pipeline`); with several, the sync hooks and
            # the executor's barrier before every exchange stay on for the whole run (`set_hooks`).
            self.ledger, self.alarm = None, None
        else:
            self.ledger = _build_ledger(sharded, self.consensus, self.rank) if s.steady_recovery else None
            # Without the ledger, the job-lost alarm still names the failed rank on every rank.
            self.alarm = None if s.steady_recovery else _build_alarm(self.consensus)
        self.fence = AttemptFence(
            self.consensus, self.dispatcher.context, figures, self.ledger, s.unguarded_timeout_s, alarm=self.alarm
        )
        self.hooks = SyncHooks(sharded, self.consensus, self.dispatcher, sync_points=s.sync_points)
        self.watchdog = Watchdog(self.rank, s.stall_report_s, s.stall_end_s, context=self.progress)
        self.signal_exit, why = SignalExit.install(s.signal_exit_s, self.rank)
        if why:
            log.info("automicro: SIGTERM and SIGINT within signal_exit_s: %s", why)
        if memory is not None:
            self.memory = memory
        elif torch.cuda.is_available() and sharded.device.type == "cuda":
            fraction = s.memory_fraction
            if isinstance(fraction, dict):
                fraction = fraction.get(self.rank)
            if fraction is not None:
                # A further cap (tests and benchmarks make ranks differ with it): never above a
                # per-process fraction the user's script already set.
                current = torch.cuda.get_per_process_memory_fraction()
                torch.cuda.set_per_process_memory_fraction(min(float(fraction), float(current)))
            self.memory = CudaMemory(fraction)

    @property
    def hooks_active(self) -> bool:
        return self.hooks is not None and self.hooks.active

    def set_hooks(self, want: bool, reason: HookReason) -> Optional[bool]:
        """Turn the sync hooks on or off; what they are now where that changed, else None."""
        if self.hooks is None:
            return None
        lifecycle_end = reason in (HookReason.FIT_END, HookReason.CLOSED)
        if self.pipeline is not None and self.pipeline.dp_size > 1 and not lifecycle_end:
            # A stage's FSDP2 collectives cross its data-parallel ranks; without a ledger that follows
            # the stages apart, their consensus points are what keeps an OOM there recoverable.
            want = True
        return want if self.hooks.set_active(want) else None

    def observe_collectives(self, on: bool) -> None:
        if on and self._ledger_handle is None and self.ledger is not None:
            self._ledger_handle = torch_internals.add_collective_observer(self.ledger)
        elif not on and self._ledger_handle is not None:
            self._ledger_handle.remove()
            self._ledger_handle = None

    def progress(self) -> str:
        """What the batch in progress is at, for the watchdog's report (`core.watchdog`)."""
        ctx = self.dispatcher.context
        if not ctx.in_attempt:
            return f"between attempts (batch {ctx.batch_index}, sync hooks {'on' if self.hooks_active else 'off'})"
        microbatch = f"microbatch {ctx.microbatch_index + 1} of {ctx.num_microbatches}" if ctx.microbatch_index >= 0 else "before its first microbatch"
        module = f" ({ctx.last_module})" if ctx.last_module else ""
        return (f"batch {ctx.batch_index}, attempt {ctx.attempt} at microbatch size {ctx.microbatch_size}, {microbatch}, last "
                f"site {ctx.last_site}{module}, sync hooks {'on' if self.hooks_active else 'off'}")

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.observe_collectives(False)
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        if self.alarm is not None:
            self.alarm.close()
            self.alarm = None
        if self.consensus is not None:
            self.consensus.close()

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        if self.ledger is not None:
            self.ledger.all_reduce(tensor)
        else:
            all_reduce_sum(tensor)

    def release_memory(self) -> None:
        release_after_failure(self.memory)

    def recover_model(self) -> None:
        assert self.sharded is not None
        self.sharded.recover()
        release_after_failure(self.memory)


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """Sums `tensor` over every rank of the default group in place; one process without a group:
    nothing to sum (as Composer's `dist.all_reduce`, without importing Composer)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            f"automicro: WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() before the first step"
        )


def _build_ledger(sharded: ShardedModel, consensus: Consensus, rank: int) -> CollectiveLedger:
    """Collective: the ledger over the default group and the FSDP2 mesh's groups, with a
    shared-memory board when every rank is on one host."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return CollectiveLedger(
            None, [None], sharded.device, rank, poll_s=0, sequence_number=torch_internals.collective_sequence_number
        )
    groups: list[Any] = [dist.group.WORLD]
    # The mesh's groups, then the ones the FSDP2 modules captured (the same objects, unless another mesh
    # over the same ranks was built in this process: `fsdp_process_groups`).
    mesh_groups = [sharded.mesh.get_group(dim) for dim in range(sharded.mesh.ndim)]
    for group in mesh_groups + torch_internals.fsdp_process_groups(sharded.fsdp_modules):
        if not any(group is g for g in groups):
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
