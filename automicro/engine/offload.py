"""The host offload switched on between two batches: FSDP2's CPU offload on a model sharded without it.

`fully_shard`'s ``offload_policy=CPUOffloadPolicy()`` (``parallelism_config.fsdp2.cpu_offload: true``) keeps every
sharded parameter, its gradient and the optimizer's state on the host: each block's parameters are copied to the
device for its all-gather, each reduced gradient is copied back, and the optimizer steps on the host. The device holds
only what a forward and backward need (a block's unsharded parameters and gradients at a time, and the activations):
the last thing left where one sample with every block recomputing still does not fit. It is set at build time; a run
that only learns at its first batch that it needs it (`automicro.batch.floor_ladder`, ``offload: auto``) cannot build
the model again. `offload_to_host` puts the same state on the model it has, between two batches:

- every `FSDPParam` as `CPUOffloadPolicy(pin_memory)` builds it (`_torch_internals.offload_sharded_params`): the
  padded shard copied to pinned host memory, the sharded parameter's DTensor rebuilt over it and swapped into the
  same Python object, so the module, the optimizer, the LR scheduler and checkpointing keep their parameter;
- the optimizers' state of those parameters copied to the host (a DTensor keeps its mesh and placements), so the
  next step runs where its parameters and gradients are (a state the first step creates is made there);
- the engine's compute-stream reduce-scatter comm (`compute_stream_buffers`) replaced by FSDP2's own, as a model
  built with ``cpu_offload: true`` has it.

The numbers are those of the run built with ``cpu_offload: true`` (the same shards, the same reductions; the same
optimizer math on the host): a 2-rank CPU test compares every parameter after a switch mid-run with both the run built
with FSDP2's policy and the run without it, and a GPU run in ``benchmarks/RESULTS.md`` measures it on CUDA. On a CPU
device there is nothing to move: the switch turns FSDP2's offload path on and moves no byte (`automicro`'s
``offload: auto`` refuses a CPU job; this function does not, so that the CPU test can check the numbers).

Not switched at run time (an error says so): a module mid-step or holding a gradient (between batches only), a
parameter FSDP2 gathers through a tensor subclass's own hooks (float8), a pipeline stage (not a `ShardedModel`).

Owns: the order of the switch and what it tells its caller. May not touch: the size search, the ladder, Composer;
torch privates outside `_torch_internals`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from automicro.engine import _torch_internals as internals
from automicro.engine.sharding import ShardedModel


@dataclasses.dataclass(frozen=True)
class Offloaded:
    """What `offload_to_host` moved: parameter bytes and optimizer-state bytes, this rank's."""

    param_bytes: int
    state_bytes: int

    def describe(self) -> str:
        return f"{self.param_bytes / 2**30:.2f} GiB of parameters and {self.state_bytes / 2**30:.2f} GiB of optimizer state"


def offload_to_host(sharded: ShardedModel, optimizers: Sequence[torch.optim.Optimizer], pin_memory: bool = True) -> Offloaded:
    """Put `sharded`'s parameters, gradients and `optimizers`' state on the host, as ``cpu_offload: true`` builds it
    (see the module's docstring). Between batches: after a step or a failed attempt's recovery, no gradient held.
    `pin_memory`: the host copies pinned (as FSDP2's default; False on a CPU device). A model already offloaded: a
    no-op."""
    modules = sharded.fsdp_modules
    if not internals.is_clean(modules):
        raise RuntimeError("automicro: the host offload is switched on between batches (a module is not idle and sharded)")
    if sharded.device.type == "cpu":
        pin_memory = False
    comm = sharded._reduce_scatter_comm
    if comm is not None:
        comm.release_all()
        for module in modules:
            internals.reset_reduce_scatter_comm(module)
        sharded._reduce_scatter_comm = None
    param_bytes = internals.offload_sharded_params(modules, pin_memory)
    state_bytes = _state_to_host(sharded.module, optimizers)
    sharded.config = dataclasses.replace(sharded.config, cpu_offload=True, compute_stream_buffers=False)
    return Offloaded(param_bytes, state_bytes)


def _state_to_host(module: torch.nn.Module, optimizers: Sequence[Any]) -> int:
    """The optimizers' state of `module`'s host parameters copied to the host; the bytes moved."""
    on_host = {id(p) for p in module.parameters() if _local(p).device.type == "cpu"}
    moved = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param)
                if id(param) not in on_host or not state:
                    continue
                for key, value in list(state.items()):
                    if torch.is_tensor(value) and _local(value).device.type != "cpu":
                        state[key] = internals.tensor_to_host(value)
                        moved += _local(value).numel() * _local(value).element_size()
    return moved


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if callable(to_local) else tensor


def is_offloaded(sharded: ShardedModel) -> bool:
    """Every parameter of `sharded` lives on the host (``cpu_offload: true``, or switched on)."""
    return internals.offloaded(sharded.fsdp_modules)


__all__ = ["Offloaded", "is_offloaded", "offload_to_host"]
