"""Pipeline parallelism composed with FSDP2: a model's marked blocks split into stages on a 2-D
``(pp, dp)`` mesh, each stage sharded with FSDP2 over its ``dp`` ranks, torch's pipeline schedules
run by a lockstep executor.

```python
from automicro.engine.pipeline import PipelineConfig, build_pipeline
pipe = build_pipeline(composer_model, PipelineConfig(stages=2, schedule="ZeroBubble"), FSDP2Config())
pipe.sharded          # this rank's stage, sharded (a ShardedModel: recover(), hooks, prefetch)
pipe.runner.run(...)  # one batch through the schedule (see `PipelineRunner.run`)
```

The model marks its blocks by implementing three methods (`automicro.models.ComposerLlama` does):
- ``pipeline_blocks() -> int``: how many blocks there are to split (`split_blocks` gives each
  stage a contiguous run);
- ``pipeline_stage(blocks, first, last) -> nn.Module``: keep only one stage -- the blocks in the
  range ``blocks``, the embedding if ``first``, the head if ``last`` (parameter names unchanged) --
  and return that module. It maps the stage's input (the
  first stage: what ``pipeline_inputs`` returns; the others: the previous stage's output) to its
  output (the last stage: what the model's ``loss(outputs, batch)`` takes), and has
  ``pipeline_io(microbatch_size, seq_len, dtype) -> (inputs, outputs)``: meta tensors of its
  boundary for one microbatch, floating point ones in ``dtype`` (the compute dtype);
- ``pipeline_inputs(batch) -> tuple[Tensor, ...]``: the first stage's positional inputs.

Why an executor of our own (DESIGN.md, the deadlock-freedom invariant): torch's schedules issue
point-to-point sends and receives whenever a rank is ready, so a stage that runs out of memory
leaves its neighbours blocked in a receive, where no consensus point can reach them. Here every
rank runs the schedule's compute order in the same time steps (`lockstep_table`): in each step a
rank computes its action (or idles), then every rank meets at one barrier (`PipelineHooks.
barrier`), then the sends and receives of that step, matched within the step, run. A rank that
fails in a step's compute is seen by every other rank at that step's barrier, before anyone enters
a send or receive. Within a step, FSDP2's collectives over the stage's ``dp`` ranks keep their own
sync points (`automicro.engine.hooks`).

Once the size has settled, a barrier per time step costs throughput (each rank's host waits for
the slowest stage's host at every step, where the asynchronous sends and receives would let it run
ahead). With one data-parallel rank per stage the barriers then come off (``every_step=False``):
only the batch's set-up keeps one before and one after it. A rank that fails in a step drains:
it issues every remaining send and receive of its schedule with placeholder tensors
(`_drain`), so its neighbours finish the batch on placeholders, no operation is left unmatched
on any rank, and every rank learns of the failure at the attempt's agreement.

Memory (the zero-bubble fix of `shared/seeds/pipelining-zero-bubble-memory.txt`): torch detaches
the stage output (or loss) in place after the input gradient (dI), so only what the weight
gradient (dW) needs stays alive. The executor adds what torch's `schedule.step()` does not: it
keeps no output chunks (the last stage's logits are dropped once the loss is computed, instead of
being kept for the whole batch), holds each loss only until its backward, and `release()` drops
every cached output, input, weight-gradient state and receive buffer after a batch or a failed
attempt. ``PipelineConfig.keep_graph_after_input_grad`` (a measurement aid) holds each stage
output's autograd node until the end of the batch: the memory behaviour before torch's fix.

Owns: the stage split and mesh, the lockstep timing and the executor. May not touch: the
consensus (the caller's hooks run it), Composer, the search policy; private torch only through
`_torch_internals`.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from automicro.engine import _torch_internals as internals
from automicro.engine.config import FSDP2Config, PipelineConfig
from automicro.engine.sharding import ShardedModel, shard

log = logging.getLogger(__name__)

# YAML name -> torch schedule class. One stage per rank: torch's interleaved classes with one
# local stage are 1F1B and ZB1P (zero bubble: the weight gradients fill the bubbles).
SCHEDULE_CLASSES = {"1F1B": "ScheduleInterleaved1F1B", "ZeroBubble": "ScheduleInterleavedZeroBubble"}


class PipelineModelError(ValueError):
    """The model cannot be split into pipeline stages; the message says what to add."""


@dataclass(frozen=True)
class Action:
    """One compute action of the schedule: F forward, B full backward, I input gradient (dI),
    W weight gradient (dW), of `microbatch` on `stage`."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def lockstep_table(orders: dict[int, Sequence[Action]], num_stages: int) -> dict[int, list[Optional[Action]]]:
    """Time each rank's actions (in the schedule's order) so that every rank can run step t at the
    same time: an action runs at the first step after everything it needs was computed in an
    earlier step (its input arrives in the exchange of that step). One stage per rank, stage s on
    pipeline rank s. Raises if the orders cannot run at all."""
    done: dict[tuple[str, int, int], int] = {}
    position = {rank: 0 for rank in orders}
    table: dict[int, list[Optional[Action]]] = {rank: [] for rank in orders}
    last = num_stages - 1

    def before(step: int, kind: str, stage: int, microbatch: int) -> bool:
        return done.get((kind, stage, microbatch), step) < step

    def ready(step: int, a: Action) -> bool:
        if a.kind == "F":
            return a.stage == 0 or before(step, "F", a.stage - 1, a.microbatch)
        if a.kind in ("B", "I"):
            if not before(step, "F", a.stage, a.microbatch):
                return False
            return a.stage == last or any(before(step, k, a.stage + 1, a.microbatch) for k in ("B", "I"))
        return before(step, "I", a.stage, a.microbatch)  # W

    step = 0
    while any(position[r] < len(orders[r]) for r in orders):
        chosen = {}
        for rank, actions in orders.items():
            if position[rank] < len(actions) and ready(step, actions[position[rank]]):
                chosen[rank] = actions[position[rank]]
        if not chosen:
            stuck = {r: str(orders[r][position[r]]) for r in orders if position[r] < len(orders[r])}
            raise RuntimeError(f"pipeline schedule cannot proceed: next actions {stuck} wait on each other")
        for rank in orders:
            action = chosen.get(rank)
            table[rank].append(action)
            if action is not None:
                position[rank] += 1
                done[(action.kind, action.stage, action.microbatch)] = step
        step += 1
    return table


def split_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Contiguous runs of blocks, one per stage, sizes differing by at most one (earlier stages
    get the extra blocks: the last stage also runs the head)."""
    if num_blocks < num_stages:
        raise PipelineModelError(
            f"parallelism_config.pipeline.stages={num_stages}: the model has only {num_blocks} blocks; "
            "use at most one stage per block"
        )
    base, extra = divmod(num_blocks, num_stages)
    runs, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        runs.append(range(start, start + size))
        start += size
    return runs


class PipelineHooks(Protocol):
    """What the executor calls around its actions (the integration's consensus and sites).

    ``every_step``: True, `barrier()` runs before every time step's exchange, so a rank that
    fails in a step is seen by every other rank there, before any of them sends or receives.
    False: it runs only before and after a batch's set-up (the receive buffers); a rank that
    fails in a step then drains the schedule instead (``drains``, `PipelineRunner.run`), so the
    other stages finish the batch and meet the failure at the attempt's agreement. Needs a stage
    whose compute issues no collective of its own (one data-parallel rank per stage)."""

    every_step: bool
    drains: bool

    def before_action(self, action: Action) -> None: ...

    def after_loss(self, microbatch: int) -> None: ...

    def barrier(self) -> None: ...


class NoHooks:
    every_step = False
    drains = False

    def before_action(self, action: Action) -> None:
        pass

    def after_loss(self, microbatch: int) -> None:
        pass

    def barrier(self) -> None:
        pass


class PipelineDrainError(RuntimeError):
    """A stage failed where the rest of its sends and receives could not be issued (inside an
    exchange, or while draining): the stages are out of step for good."""


@dataclass
class PipelineLayout:
    """Where this rank sits: its stage, and its place among the data-parallel copies of it."""

    mesh: DeviceMesh  # ("pp", "dp")
    num_stages: int
    stage_index: int
    dp_size: int
    dp_rank: int

    @property
    def pp_group(self) -> Any:
        return self.mesh.get_group("pp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def build_layout(config: PipelineConfig, device: torch.device) -> PipelineLayout:
    """Collective. Ranks ``r`` with the same ``r // dp`` form one stage's data-parallel group
    (neighbours, so FSDP2's traffic stays within a host); ranks with the same ``r % dp`` form one
    pipeline."""
    world = dist.get_world_size()
    if world % config.stages != 0:
        raise PipelineModelError(
            f"parallelism_config.pipeline.stages={config.stages}: must divide the world size {world} "
            "(each stage runs on world/stages data-parallel ranks)"
        )
    dp = world // config.stages
    mesh = init_device_mesh(device.type, (config.stages, dp), mesh_dim_names=("pp", "dp"))
    rank = dist.get_rank()
    return PipelineLayout(mesh=mesh, num_stages=config.stages, stage_index=rank // dp, dp_size=dp, dp_rank=rank % dp)


def check_pipeline_model(model: Any) -> None:
    missing = [n for n in ("pipeline_blocks", "pipeline_stage", "pipeline_inputs") if not callable(getattr(model, n, None))]
    if missing:
        raise PipelineModelError(
            f"parallelism_config.pipeline: {type(model).__name__} does not mark its pipeline blocks (no "
            f"{' / '.join(missing)}); implement pipeline_blocks(), pipeline_stage(blocks, first, last) and pipeline_inputs(batch) "
            "as automicro.models.ComposerLlama does, or leave parallelism_config.pipeline out"
        )


@dataclass
class Pipeline:
    """This rank's part of a pipelined model."""

    layout: PipelineLayout
    config: PipelineConfig
    sharded: ShardedModel
    runner: "PipelineRunner"


def build_pipeline(
    model: Any, config: PipelineConfig, fsdp2: Optional[FSDP2Config] = None, device: Optional[torch.device] = None
) -> Pipeline:
    """Collective. Split `model` (see the module docstring for what it must implement) into
    `config.stages` stages, keep this rank's, shard it with FSDP2 over its data-parallel ranks."""
    check_pipeline_model(model)
    fsdp2 = fsdp2 or FSDP2Config()
    if fsdp2.replicate != 1:
        raise PipelineModelError(
            f"parallelism_config.fsdp2.replicate={fsdp2.replicate} with a pipeline: HSDP inside pipeline stages "
            "is not supported; use replicate: 1 (each stage is sharded over its world/stages ranks)"
        )
    if config.schedule == "ZeroBubble" and fsdp2.activation_checkpointing:
        # torch's composable checkpoint recomputes through a single-use context manager; a zero-bubble
        # stage recomputes twice (dI, then dW) and the second fails (AttributeError in
        # contextlib, seen on torch 2.7 and 2.11).
        raise PipelineModelError(
            "parallelism_config.pipeline.schedule=ZeroBubble with parallelism_config.fsdp2.activation_checkpointing=true "
            "is not supported (the weight-gradient step recomputes a checkpointed block a second time); use "
            "schedule: 1F1B with activation checkpointing, or activation_checkpointing: false"
        )
    if config.schedule == "ZeroBubble" and fsdp2.reshard_after_forward is not False:
        # torch computes a zero-bubble stage's weight gradients (dW) from the parameters the stage
        # holds at its input-gradient step; FSDP2 blocks resharded after forward hold their
        # sharded parameters there, which are not in the autograd graph: their gradients would
        # be lost. So the blocks stay unsharded from the first forward to the end of the batch
        # (one all-gather per batch instead of two per microbatch; torchtitan does the same).
        log.warning(
            "automicro: parallelism_config.pipeline.schedule=ZeroBubble: reshard_after_forward=%r -> false (the weight "
            "gradients need the unsharded parameters until the end of the batch)",
            fsdp2.reshard_after_forward,
        )
        fsdp2 = dataclasses.replace(fsdp2, reshard_after_forward=False)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    layout = build_layout(config, device)
    runs = split_blocks(model.pipeline_blocks(), layout.num_stages)
    try:
        stage_module = model.pipeline_stage(runs[layout.stage_index], first=layout.is_first, last=layout.is_last)
    except PipelineModelError:
        raise
    except ValueError as error:
        raise PipelineModelError(f"parallelism_config.pipeline: {error}") from error
    if not isinstance(stage_module, nn.Module) or not callable(getattr(stage_module, "pipeline_io", None)):
        raise PipelineModelError(
            f"{type(model).__name__}.pipeline_stage must return an nn.Module with pipeline_io(microbatch_size, "
            "seq_len, dtype)"
        )
    internals.install_input_grad_failure_cleanup()
    internals.check_pipeline_exchange_group()
    sharded = shard(stage_module, fsdp2, mesh=layout.dp_mesh, device=device)
    object.__setattr__(model, "_automicro_sharded", sharded)
    runner = PipelineRunner(sharded, layout, config, compute_dtype=_compute_dtype(fsdp2, stage_module))
    log.info(
        "automicro: pipeline stage %d of %d (blocks %s) on %d data-parallel rank(s), schedule %s",
        layout.stage_index, layout.num_stages, getattr(stage_module, "block_names", "?"), layout.dp_size, config.schedule,
    )
    return Pipeline(layout=layout, config=config, sharded=sharded, runner=runner)


def _compute_dtype(fsdp2: FSDP2Config, module: nn.Module) -> torch.dtype:
    if fsdp2.mixed_precision in ("DEFAULT", "PURE"):
        return torch.bfloat16
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


@dataclass
class PipelineStats:
    """Figures of the last batch this rank ran (for benchmarks and tests)."""

    time_steps: int = 0
    exchanges: int = 0
    actions: list[str] = field(default_factory=list)


class PipelineRunner:
    """Runs batches through torch's pipeline stage of this rank, in lockstep with the other stages."""

    def __init__(self, sharded: ShardedModel, layout: PipelineLayout, config: PipelineConfig, compute_dtype: torch.dtype) -> None:
        self.sharded = sharded
        self.layout = layout
        self.config = config
        self.compute_dtype = compute_dtype
        self.schedule_class = internals.pipeline_schedule_class(SCHEDULE_CLASSES[config.schedule])
        self.stats = PipelineStats()
        # Failed attempts this rank drained, and the time steps it exchanged placeholders in (`_drain`).
        self.drains = 0
        self.drained_steps = 0
        self._stage: Any = None
        self._kept_nodes: list[Any] = []
        # Per runner, not `functools.lru_cache` (a class-wide cache would keep every runner, and its
        # model, alive after `Trainer.release()`).
        self._count_ok: dict[int, bool] = {}
        self._tables: dict[int, dict[int, list[Optional[Action]]]] = {}

    @property
    def module(self) -> nn.Module:
        return self.sharded.module

    # ---- what the search may choose --------------------------------------------------------

    def microbatch_sizes(self, batch_size: int) -> tuple[int, ...]:
        """The microbatch sizes this schedule can run a batch of `batch_size` samples with, in
        ascending order: equal microbatches (torch's stages receive into fixed-shape buffers), at
        least one per stage (fewer leaves a stage idle for the whole batch), and a count the
        schedule accepts (its rounds must divide it)."""
        sizes = [m for m in range(1, batch_size + 1) if batch_size % m == 0 and self.count_ok(batch_size // m)]
        return tuple(sizes)

    def count_ok(self, num_microbatches: int) -> bool:
        if num_microbatches not in self._count_ok:
            ok = num_microbatches >= self.layout.num_stages
            if ok:
                try:
                    self._schedule(self._probe_stage(), num_microbatches)
                except ValueError:
                    ok = False
            self._count_ok[num_microbatches] = ok
        return self._count_ok[num_microbatches]

    # ---- one batch -------------------------------------------------------------------------

    def run(
        self,
        microbatches: Sequence[Any],
        stage_inputs: Callable[[Any], tuple[torch.Tensor, ...]],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        hooks: Optional[PipelineHooks] = None,
    ) -> Optional[torch.Tensor]:
        """Forward and backward of every microbatch on this rank's stage, in the schedule's
        order; FSDP2's gradient reduce-scatter once at the end. `stage_inputs(microbatch)`: the
        first stage's inputs; `loss_fn(outputs, microbatch)`: the loss of one microbatch on the
        last stage, already scaled to its share of the batch. Returns the sum of the losses
        (detached) on the last stage, None on the others. Call `release()` after a failure."""
        hooks = hooks or NoHooks()
        n = len(microbatches)
        if n < 1 or not self.count_ok(n):
            raise ValueError(f"pipeline schedule {self.config.schedule} cannot run {n} microbatches on {self.layout.num_stages} stages")
        first_inputs = tuple(t.to(self.sharded.device) for t in stage_inputs(microbatches[0]))
        seq_len = int(first_inputs[0].shape[1]) if first_inputs[0].dim() > 1 else 1
        inputs_meta, outputs_meta = self.module.pipeline_io(int(first_inputs[0].shape[0]), seq_len, self.compute_dtype)
        # Activations and their gradients flow between stages (torch 2.15 derives the gradient
        # buffers from this flag).
        inputs_meta, outputs_meta = (tuple(_with_grad(t) for t in group) for group in (inputs_meta, outputs_meta))
        stage = self._new_stage(inputs_meta, outputs_meta)
        schedule = self._schedule(stage, n)
        table = self._table(n)
        me = self.layout.stage_index
        previous = table.get(me - 1)
        following = table.get(me + 1)
        self._stage = stage
        self.stats = PipelineStats(time_steps=len(table[me]))
        losses: dict[int, torch.Tensor] = {}
        total: Optional[torch.Tensor] = None
        # Every stage reaches this point before any of them allocates receive buffers or (2.11+)
        # exchanges the set-up message with its neighbours.
        hooks.barrier()
        internals.initialize_pipeline_stages(schedule, first_inputs)
        if not hooks.every_step:
            hooks.barrier()  # a failed set-up is seen here, before any step's exchange
        # The first time step whose sends and receives this rank has not issued yet.
        unexchanged, exchanging = 0, False
        try:
            for step, action in enumerate(table[me]):
                ops: list[Any] = []
                if action is not None:
                    hooks.before_action(action)
                    self.stats.actions.append(str(action))
                    if action.kind == "F":
                        args = tuple(t.to(self.sharded.device) for t in stage_inputs(microbatches[action.microbatch])) if self.layout.is_first else ()
                        output = stage.forward_one_chunk(action.microbatch, args, {})
                        if self.config.keep_graph_after_input_grad:
                            self._kept_nodes.extend(t.grad_fn for t in _tensors(output) if t.grad_fn is not None)
                        if self.layout.is_last:
                            loss = loss_fn(output, microbatches[action.microbatch])
                            losses[action.microbatch] = loss
                            total = loss.detach() if total is None else total + loss.detach()
                            # torch keeps every output chunk for a merge the training step never uses.
                            stage.output_chunks.clear()
                            hooks.after_loss(action.microbatch)
                        else:
                            ops.extend(stage.get_fwd_send_ops(action.microbatch))
                        del output
                    elif action.kind in ("B", "I"):
                        loss = losses.pop(action.microbatch, None)
                        stage.backward_one_chunk(action.microbatch, loss=loss, full_backward=action.kind == "B", last_backward=False)
                        del loss
                        if not self.layout.is_first:
                            ops.extend(stage.get_bwd_send_ops(action.microbatch))
                    else:
                        stage.backward_weight_one_chunk(action.microbatch, last_backward=False)
                before = previous[step] if previous is not None and step < len(previous) else None
                if before is not None and before.kind == "F":
                    ops.extend(stage.get_fwd_recv_ops(before.microbatch))
                after = following[step] if following is not None and step < len(following) else None
                if after is not None and after.kind in ("B", "I"):
                    ops.extend(stage.get_bwd_recv_ops(after.microbatch))
                if hooks.every_step:
                    hooks.barrier()
                if ops:
                    self.stats.exchanges += 1
                    exchanging = True
                    _exchange(ops)
                    exchanging = False
                    del ops
                unexchanged = step + 1
                if action is not None and action.kind in ("B", "I"):
                    internals.drop_finished_microbatch(stage, action.microbatch)
        except Exception as error:  # not an interrupt: every rank gets that one, nobody waits on a drain
            if hooks.drains:
                losses.clear()
                total = None
                self._drain_after(error, table, unexchanged, exchanging, inputs_meta, outputs_meta)
            raise
        internals.finish_stage_backward(stage)
        self.sharded.end_of_backward()
        self.release()
        return total

    def _drain_after(
        self,
        error: BaseException,
        table: dict[int, list[Optional[Action]]],
        step: int,
        exchanging: bool,
        inputs_meta: tuple[torch.Tensor, ...],
        outputs_meta: tuple[torch.Tensor, ...],
    ) -> None:
        """This rank failed with the per-step barriers off before issuing the sends and receives
        of time step `step`: issue every send and receive its schedule has from that step on, with
        placeholder tensors of the boundary's shapes, so the neighbouring stages (which do not know
        yet) finish the batch instead of waiting on a receive for ever, and no operation is left
        unmatched on any rank's stream for the next attempt to pair with. Their results are thrown
        away: the attempt's agreement fails it on every rank."""
        if exchanging:
            raise PipelineDrainError(
                f"automicro: pipeline stage {self.layout.stage_index} failed inside the exchange of time step {step} "
                f"({type(error).__name__}: {error}); its neighbours' sends and receives cannot be matched any more"
            ) from error
        # The failed attempt's activations: nothing of them is needed any more, and the
        # placeholders need the room (the error's frames hold the failed action's tensors).
        self.release()
        for each in _chain(error):
            if each.__traceback__ is not None:
                traceback.clear_frames(each.__traceback__)
        try:
            self.drained_steps += _drain(table, step, self.layout, self.sharded.device, inputs_meta, outputs_meta)
            self.drains += 1
        except BaseException as drain_error:
            raise PipelineDrainError(
                f"automicro: pipeline stage {self.layout.stage_index} failed at time step {step} ({type(error).__name__}) "
                f"and then could not issue the rest of its sends and receives ({type(drain_error).__name__}: {drain_error})"
            ) from drain_error

    def release(self) -> None:
        """Drop everything the last (or failed) batch left on the stage; safe to call twice."""
        if self._stage is not None:
            internals.release_stage(self._stage)
            self._stage = None
        self._kept_nodes.clear()

    # ---- helpers -----------------------------------------------------------------------------

    def _new_stage(self, inputs_meta: tuple[torch.Tensor, ...], outputs_meta: tuple[torch.Tensor, ...]) -> Any:
        from torch.distributed.pipelining import PipelineStage

        stage = PipelineStage(
            self.module,
            self.layout.stage_index,
            self.layout.num_stages,
            self.sharded.device,
            input_args=inputs_meta,
            output_args=outputs_meta,
            group=self.layout.pp_group,
        )
        stage.has_backward = True
        return stage

    def _probe_stage(self) -> Any:
        meta = (torch.empty(1, device="meta"),)
        return self._new_stage(meta, meta)

    def _schedule(self, stage: Any, num_microbatches: int) -> Any:
        return self.schedule_class([stage], num_microbatches, loss_fn=_loss_outside_schedule)

    def _table(self, num_microbatches: int) -> dict[int, list[Optional[Action]]]:
        if num_microbatches not in self._tables:
            order = internals.pipeline_compute_order(self._schedule(self._probe_stage(), num_microbatches))
            actions = {rank: [Action(*row) for row in rows] for rank, rows in order.items()}
            self._tables[num_microbatches] = lockstep_table(actions, self.layout.num_stages)
        return self._tables[num_microbatches]


def _drain(
    table: dict[int, list[Optional[Action]]],
    start: int,
    layout: PipelineLayout,
    device: torch.device,
    inputs_meta: tuple[torch.Tensor, ...],
    outputs_meta: tuple[torch.Tensor, ...],
) -> int:
    """The sends and receives of this rank's time steps `start`.. in the order `run` issues them
    (its action's sends, then the receive of the previous stage's forward, then that of the next
    stage's input gradient), one tensor per boundary tensor as torch's stage sends them: zeros to
    send, scratch to receive into. Returns the steps that exchanged anything."""
    me, group = layout.stage_index, layout.pp_group
    previous, following, mine = table.get(me - 1), table.get(me + 1), table[me]
    prev_peer = dist.get_global_rank(group, me - 1) if not layout.is_first else -1
    next_peer = dist.get_global_rank(group, me + 1) if not layout.is_last else -1

    send_out, send_grads, recv_in, recv_grads = internals.stage_placeholders(
        inputs_meta, outputs_meta, layout.is_first, layout.is_last, device
    )
    exchanged = 0
    for step in range(start, len(mine)):
        ops: list[Any] = []
        action = mine[step]
        if action is not None and action.kind == "F":
            ops.extend(dist.P2POp(dist.isend, t, next_peer, group) for t in send_out)
        elif action is not None and action.kind in ("B", "I"):
            ops.extend(dist.P2POp(dist.isend, t, prev_peer, group) for t in send_grads)
        before = previous[step] if previous is not None and step < len(previous) else None
        if before is not None and before.kind == "F":
            ops.extend(dist.P2POp(dist.irecv, t, prev_peer, group) for t in recv_in)
        after = following[step] if following is not None and step < len(following) else None
        if after is not None and after.kind in ("B", "I"):
            ops.extend(dist.P2POp(dist.irecv, t, next_peer, group) for t in recv_grads)
        if ops:
            exchanged += 1
            _exchange(ops)
    return exchanged


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    each: Optional[BaseException] = error
    while each is not None and all(each is not s for s in seen):
        seen.append(each)
        each = each.__cause__ or each.__context__
    return seen


def _exchange(ops: list[Any]) -> None:
    """Run one step's sends and receives to completion. In a function of its own: a finished work
    object still references its tensor, and must not outlive the step as a loop variable."""
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _loss_outside_schedule(output: Any, target: Any) -> torch.Tensor:
    raise RuntimeError("automicro's pipeline executor computes the loss itself; the schedule's loss_fn is never called")


def _with_grad(meta: torch.Tensor) -> torch.Tensor:
    return meta.detach().requires_grad_(meta.is_floating_point())


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


__all__ = [
    "Action",
    "Pipeline",
    "PipelineConfig",
    "PipelineDrainError",
    "PipelineHooks",
    "PipelineLayout",
    "PipelineModelError",
    "PipelineRunner",
    "SCHEDULE_CLASSES",
    "build_layout",
    "build_pipeline",
    "lockstep_table",
    "split_blocks",
]
