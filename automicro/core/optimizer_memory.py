"""What an optimizer's state will take once it exists: the memory a first optimizer step adds.

Adam's moments (and most optimizers' state) are created at the first `step()`. A microbatch
size whose peak fit batch 0 can therefore run out of memory at batch 1, once the state lives
beside the activations (measured: 5-7 OOMs over 3 batches on one GPU, Composer's halving has the
same fault). `pending_state_bytes(optimizers)` tells the bytes not yet allocated: per parameter
without state, how many parameter-sized tensors the optimizer's kind keeps, times the parameter's
bytes on this rank (the local shard of an FSDP2 `DTensor`). The policy adds them to the peak of
an attempt that ran before the first step (`automicro.core.policy.Success.projected`).

Known kinds (torch's and Composer's classes, matched by name so Composer is not imported): the
table `STATE_TENSORS`. Any other optimizer gives None: nothing is projected, the search works as
before (an OOM at batch 1 is then a one-off rerun, then a step down).

Owns: the per-kind state sizes, and the gradients a first backward makes (`pending_grad_bytes`, for the check that
the training state fits at all: `automicro.batch.state_fit`). May not touch: the policy, Composer, collectives.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

# Parameter-sized state tensors per parameter, by optimizer class name (a function of the param
# group for the kinds whose state depends on its options).
STATE_TENSORS: dict[str, Callable[[dict[str, Any]], int]] = {
    "Adam": lambda g: 3 if g.get("amsgrad") else 2,
    "AdamW": lambda g: 3 if g.get("amsgrad") else 2,
    "NAdam": lambda g: 2,
    "RAdam": lambda g: 2,
    "Adamax": lambda g: 2,
    "SGD": lambda g: 1 if g.get("momentum", 0) else 0,
    "RMSprop": lambda g: 1 + (1 if g.get("momentum", 0) else 0) + (1 if g.get("centered") else 0),
    "Adagrad": lambda g: 1,
    "Adadelta": lambda g: 2,
    # Composer's optimizers (composer.optim)
    "DecoupledAdamW": lambda g: 3 if g.get("amsgrad") else 2,
    "DecoupledSGDW": lambda g: 1 if g.get("momentum", 0) else 0,
    # llm-foundry's (llmfoundry.optim): Lion keeps one moment
    "DecoupledLionW": lambda g: 1,
}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # an FSDP2 DTensor: this rank's shard
    return to_local() if callable(to_local) else tensor


def pending_state_bytes(optimizers: Iterable[Any], device_type: Optional[str] = None) -> Optional[int]:
    """Bytes this rank's optimizers will allocate for the state of parameters that have none yet
    (0 once every parameter has state). None when an optimizer's kind is not in `STATE_TENSORS`.
    `device_type`: count only parameters on that device (the host offload's live on the host, and
    so will their state)."""
    total = 0
    for optimizer in optimizers:
        per_param = STATE_TENSORS.get(type(optimizer).__name__)
        if per_param is None:
            return None
        for group in optimizer.param_groups:
            tensors = per_param(group)
            if tensors == 0:
                continue
            for param in group["params"]:
                if not param.requires_grad or optimizer.state.get(param):
                    continue
                local = _local(param)
                if device_type is not None and local.device.type != device_type:
                    continue
                total += tensors * local.numel() * local.element_size()
    return total


def pending_grad_bytes(params: Iterable[torch.nn.Parameter], device_type: Optional[str] = None) -> int:
    """Bytes the gradients of `params` that have none yet will take on this rank (the local shard's, in the
    parameter's dtype, as FSDP2 keeps a sharded gradient); `device_type`: only parameters on that device."""
    total = 0
    for param in params:
        if not param.requires_grad or param.grad is not None:
            continue
        local = _local(param)
        if device_type is not None and local.device.type != device_type:
            continue
        total += local.numel() * local.element_size()
    return total


__all__ = ["STATE_TENSORS", "pending_grad_bytes", "pending_state_bytes"]
