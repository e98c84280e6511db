"""One GPU under `auto`: train unsharded where FSDP2 would shard nothing (issue 26, "sharding at all").

On one rank FSDP2 shards nothing and still costs time every microbatch: each block's parameters
are copied into an all-gather buffer before its forward and backward, and each microbatch's
gradients go through a reduce-scatter of one rank. Measured on one H100 (RESULTS.md, session 15:
Llama 1B, seq 2048, memory fraction 0.40, size 2): FSDP2 24.7k tokens/s, FSDP2 with the layout
search's trades 32.0k, unsharded 36.0k, Composer's own `auto` 35.1k.

So where the layout is searched (`layout` left at its default on a CUDA device, or `layout: auto`)
and the job has one rank, `automicro.Trainer` runs the model as `parallelism_config: null` does
(Composer's own placement and autocast, `automicro.engine.unsharded`), with the same search. It
keeps FSDP2, and says why, wherever dropping it would change what the user asked for or could lose
the run: compile (per sharded block), CPU offload, FSDP2's activation checkpointing, sharded
checkpoints or a `load_path` (which may hold a sharded run's checkpoint), `device_eval_microbatch_size:
auto` (its search runs on the FSDP2 engine), parameters on the meta device (materialized at
sharding time), and a model whose parameters, gradients, optimizer state and autocast copies would
take more than `STATIC_SHARE` of the GPU's memory (FSDP2 keeps only one block's low-precision copy).
`layout: fixed` (or a pinned list of trades) keeps FSDP2 as configured.

Owns: that decision and its console line. May not touch: the search, Composer's internals, FSDP2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from automicro.core.layout import LayoutConfig
from automicro.core.optimizer_memory import pending_state_bytes
from automicro.engine.config import FSDP2Config

# At most this share of the GPU's memory for what an unsharded model holds between batches (fp32
# parameters and gradients, optimizer state) plus autocast's low-precision copies of the weights;
# the rest is for activations. Above it, FSDP2's per-block copies may be what lets size 1 fit.
STATIC_SHARE = 0.8
# Bytes of optimizer state per parameter byte where the optimizer's kind is unknown (Adam's two
# fp32 moments).
UNKNOWN_OPTIMIZER_FACTOR = 2


def static_bytes(model: torch.nn.Module, optimizers: Iterable[Any], autocast: bool) -> int:
    """Parameters + gradients + optimizer state (projected where it does not exist yet) + autocast's
    bf16/fp16 copies, for an unsharded model."""
    params = [p for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    pending = pending_state_bytes(list(optimizers))
    optimizer_bytes = UNKNOWN_OPTIMIZER_FACTOR * grad_bytes if pending is None else pending
    copies = 2 * sum(p.numel() for p in params) if autocast else 0
    return param_bytes + grad_bytes + optimizer_bytes + copies


def keep_fsdp2(
    *,
    layout: LayoutConfig,
    device_type: str,
    world_size: int,
    fsdp2: FSDP2Config,
    compile_config: Any,
    checkpoint_format: str,
    load_path: Optional[str],
    auto_eval: bool,
    model: torch.nn.Module,
    optimizers: Iterable[Any],
    autocast: bool,
    capacity_bytes: Optional[int],
) -> Optional[str]:
    """Why this job keeps FSDP2 on one rank, or None to train unsharded. Called for a job with
    `auto`, FSDP2 and no pipeline; `capacity_bytes`: what the GPU gives this process."""
    if world_size != 1:
        return f"{world_size} ranks"
    resolved = layout.resolve(device_type)
    if resolved.mode != "auto":
        if resolved.pinned:
            return "the pinned layout's trades are FSDP2's"
        return "layout: fixed" if not layout.gpu_only else "the layout search is for CUDA devices (layout: fixed on CPU)"
    if device_type != "cuda":
        return "not on a GPU (on CPU the layout search keeps the configured sharding)"
    if compile_config is not None:
        return "compile runs per sharded block"
    if fsdp2.cpu_offload:
        return "cpu_offload keeps parameters on the host"
    if fsdp2.activation_checkpointing:
        return "activation_checkpointing is set on the FSDP2 blocks"
    if checkpoint_format == "sharded":
        return "checkpoint_format: sharded saves FSDP2 shards"
    if load_path:
        return "load_path may hold a sharded run's checkpoint"
    if auto_eval:
        return "device_eval_microbatch_size: auto runs on the FSDP2 engine"
    if any(p.device.type == "meta" for p in model.parameters()):
        return "init_device: meta materializes the parameters at sharding time"
    if capacity_bytes:
        need = static_bytes(model, optimizers, autocast)
        if need > STATIC_SHARE * capacity_bytes:
            return (
                f"unsharded, its parameters, gradients, optimizer state and autocast copies would take "
                f"{need / 2**30:.1f} GiB of the {capacity_bytes / 2**30:.1f} GiB this process has"
            )
    return None


def cuda_capacity(device: torch.device, memory_fraction: Any, rank: int = 0) -> Optional[int]:
    """The bytes this process may allocate on `device` (its memory fraction applied), or None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    fraction = memory_fraction.get(rank) if isinstance(memory_fraction, dict) else memory_fraction
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * (float(fraction) if fraction is not None else 1.0))


UNSHARDED_LINE = (
    "one rank: training unsharded (FSDP2 shards nothing on one rank and costs time every microbatch); "
    "layout: fixed keeps parallelism_config.fsdp2"
)


__all__ = ["STATIC_SHARE", "UNSHARDED_LINE", "cuda_capacity", "keep_fsdp2", "static_bytes"]
