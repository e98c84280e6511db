"""The optimizer step on each parameter's local shard, where that gives the same numbers.

FSDP2's parameters, gradients and optimizer state are DTensors, and every op an optimizer runs on
them goes through DTensor's dispatch on the host. An optimizer that loops over parameters
(Composer's `DecoupledAdamW`: about eight ops and a ``.item()`` per parameter; llm-foundry's
`DecoupledLionW`) then keeps the GPU waiting on the host for the whole step: measured on one H200
with the 1B Llama, 65 ms a batch, the gap between FSDP2 and the same model unsharded
(`benchmarks/RESULTS.md`, 2026-11-28, the optimizer step on DTensors).

The same step on the local tensors gives the same numbers where:
- every DTensor lives on a mesh of one rank (a one-GPU job with FSDP2 in its config): the local
  tensor *is* the whole parameter, for any optimizer;
- or the optimizer is element-wise (each element's update reads only that element of the
  parameter, its gradient and its state), listed by exact class in `ELEMENTWISE`: torch's SGD,
  Adam and AdamW, Composer's `DecoupledSGDW` and `DecoupledAdamW`, llm-foundry's
  `DecoupledLionW`. A subclass, or any other optimizer (LAMB, Adafactor, Shampoo, Muon: norms or
  factors over the whole parameter) on several ranks, keeps the DTensor step.

`install` replaces the optimizer's ``step`` (a bound method, so torch's LR schedulers can still
wrap it) by one that, for the step only, puts each DTensor parameter's local tensor in its place in
``param_groups``, with the gradient's local tensor as its ``.grad`` and the state's local tensors
as its state; then it puts everything back. Updates are in place on the same storage; state the
step creates (the first step) or replaces comes back as DTensors with the parameter's mesh and
placements, so checkpoints (DCP, Composer's sharded and full state dicts) see what they see
without this. A closure runs first, outside the swap, as torch's optimizers run it first.

Parameters: ``parallelism_config.fsdp2.local_optimizer_step`` (`FSDP2Config`): null (default)
where the numbers are the same, false never, true required (an error says why it cannot be).

Owns: choosing and installing the local step. May not touch: the model, the gradients' values.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from automicro.engine import _torch_internals as internals
from automicro.engine.config import FSDP2ConfigError

# Optimizers whose update is element-wise, by exact class (module and qualified name, so none is
# imported here); their step on a shard is their step on the whole parameter, restricted to it.
ELEMENTWISE = frozenset({
    "torch.optim.sgd.SGD",
    "torch.optim.adam.Adam",
    "torch.optim.adamw.AdamW",
    "composer.optim.decoupled_weight_decay.DecoupledSGDW",
    "composer.optim.decoupled_weight_decay.DecoupledAdamW",
    "llmfoundry.optim.lion.DecoupledLionW",
})
_BEFORE = "_automicro_dtensor_step"


class LocalStepError(FSDP2ConfigError):
    """``local_optimizer_step: true`` where the local step would not give the same numbers."""


def class_name(optimizer: Any) -> str:
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def why_not(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """None where the local step gives the same numbers as the DTensor step; else why not."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return "no parameter is a DTensor (nothing is sharded)"
    if all(p.device_mesh.size() == 1 for p in sharded):
        return None
    if class_name(optimizer) in ELEMENTWISE:
        return None
    return (
        f"{class_name(optimizer)} on a mesh of {max(p.device_mesh.size() for p in sharded)} ranks is not one of the "
        f"element-wise optimizers whose step on a shard equals its step on the parameter ({', '.join(sorted(ELEMENTWISE))})"
    )


def installed(optimizer: Any) -> bool:
    return hasattr(optimizer, _BEFORE)


def install(optimizer: torch.optim.Optimizer, setting: Optional[bool] = None) -> Optional[str]:
    """Give `optimizer` the local step where `setting` (``local_optimizer_step``) allows and the
    numbers are the same; returns None when installed (or already), else why not. `setting` True
    where it cannot be: `LocalStepError`."""
    if installed(optimizer):
        return None
    if setting is False:
        return "parallelism_config.fsdp2.local_optimizer_step: false"
    reason = why_not(optimizer)
    if reason is not None:
        if setting:
            raise LocalStepError(
                f"parallelism_config.fsdp2.local_optimizer_step=true: {reason}; "
                "set it to null (where it gives the same numbers) or false"
            )
        return reason
    setattr(optimizer, _BEFORE, optimizer.step)
    optimizer.step = types.MethodType(_local_step, optimizer)  # type: ignore[method-assign]
    return None


def _local_step(self: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
    """`kwargs`: what a caller passes on (torch's GradScaler hands a fused optimizer its scale)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    swapped: list[_Swap] = []
    try:
        _swap_in(self, swapped)
        getattr(self, _BEFORE)(**kwargs)
    finally:
        _swap_out(self, swapped)
    return loss


class _Swap:
    __slots__ = ("param", "local", "requires_grad", "state_before", "locals_before")

    def __init__(self, param: DTensor, local: torch.Tensor, state_before: Optional[dict]) -> None:
        self.param, self.local, self.state_before = param, local, state_before
        self.requires_grad = local.requires_grad
        # The state's DTensors' local tensors, as the step sees them (to tell in place from replaced).
        self.locals_before = {k: v.to_local() for k, v in (state_before or {}).items() if isinstance(v, DTensor)}


def _swap_in(optimizer: torch.optim.Optimizer, swapped: list[_Swap]) -> None:
    with torch.no_grad():
        for group in optimizer.param_groups:
            params = list(group["params"])
            for index, param in enumerate(params):
                if not isinstance(param, DTensor):
                    continue
                local = param.to_local()
                swap = _Swap(param, local, optimizer.state.get(param))
                swapped.append(swap)
                # Optimizers skip a parameter that does not require grad (Composer's do): the local
                # tensor says what its parameter says, for the step only.
                local.requires_grad_(param.requires_grad)
                grad = param.grad
                local.grad = grad.to_local() if isinstance(grad, DTensor) else grad
                if swap.state_before is not None:
                    optimizer.state[local] = {k: swap.locals_before.get(k, v) for k, v in swap.state_before.items()}
                params[index] = local
            group["params"] = params


def _swap_out(optimizer: torch.optim.Optimizer, swapped: list[_Swap]) -> None:
    by_local = {id(s.local): s for s in swapped}
    for group in optimizer.param_groups:
        group["params"] = [by_local[id(p)].param if id(p) in by_local else p for p in group["params"]]
    for s in swapped:
        s.local.grad = None
        s.local.requires_grad_(s.requires_grad)
        after = optimizer.state.pop(s.local, None)
        if after is None:
            continue
        restored = {}
        for key, value in after.items():
            before = (s.state_before or {}).get(key)
            if isinstance(before, DTensor) and value is s.locals_before.get(key):
                restored[key] = before  # updated in place: the DTensor holds the new numbers
            elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == s.local.shape and value.dim() > 0:
                if value.device.type != s.param.device_mesh.device_type:
                    # On the host (FSDP2's CPU offload): kept there, as the parameter is.
                    restored[key] = internals.dtensor_like(value, s.param)
                else:
                    restored[key] = DTensor.from_local(
                        value, s.param.device_mesh, s.param.placements, run_check=False, shape=s.param.shape,
                        stride=s.param.stride(),
                    )
            else:
                restored[key] = value  # a step count, a scalar: as the DTensor step keeps it
        optimizer.state[s.param] = restored


__all__ = ["ELEMENTWISE", "LocalStepError", "install", "installed", "why_not"]
