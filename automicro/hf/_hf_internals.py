"""What `automicro.hf` needs from transformers' `Trainer` and accelerate beyond their documented
surface, in one place (as `_composer_internals` is for Composer). Read against transformers 4.51
(leg 1's pin, llm-foundry's) and 5.17-5.24 (the GPU machines' and the newest), accelerate 1.8 and
1.15.

- `keep_sharded_model`: accelerate's `prepare_model` wraps any model of a multi-process run that
  accelerate does not shard itself in `DistributedDataParallel`. A model the user already passed
  through torch's `fully_shard` must stay as it is (its gradients are reduced by FSDP2): it is
  prepared as transformers 5 prepares a model it sharded at load time
  (``prepare_model(model, device_placement=False, evaluation_mode=True)``: autocast and compile
  only, no wrapper). transformers 4.51 has no such path, hence the wrapper around the instance's
  `prepare_model`.
- `inner_optimizer`: accelerate's `AcceleratedOptimizer` skips `zero_grad` while accelerate
  accumulates; automicro zeroes the optimizer it wraps.
- `loss_takes_item_count`: the Trainer's own rule for normalizing a causal LM's loss by the loss
  tokens of the whole step (`model_accepts_loss_kwargs`, or a `compute_loss_func`).

Owns: those three reads. May not touch: the search, the step (`automicro.step`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule


def is_fully_shard_root(model: Any) -> bool:
    return isinstance(model, FSDPModule)


def accelerate_shards(accelerator: Any) -> bool:
    """Whether accelerate shards the model itself (its FSDP plugin, either version)."""
    return getattr(getattr(accelerator, "state", None), "fsdp_plugin", None) is not None


def keep_sharded_model(accelerator: Any) -> None:
    """Make `accelerator.prepare_model` leave a `fully_shard` root unwrapped (idempotent)."""
    if getattr(accelerator, "_automicro_keeps_sharded", False):
        return
    original = accelerator.prepare_model

    def prepare_model(model: torch.nn.Module, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        if is_fully_shard_root(model) and not accelerate_shards(accelerator):
            return original(model, device_placement=False, evaluation_mode=True)
        return original(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    accelerator.prepare_model = prepare_model
    accelerator._automicro_keeps_sharded = True


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (itself if not wrapped)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def loss_takes_item_count(trainer: Any) -> bool:
    return bool(getattr(trainer, "model_accepts_loss_kwargs", False)) or getattr(trainer, "compute_loss_func", None) is not None


__all__ = ["accelerate_shards", "inner_optimizer", "is_fully_shard_root", "keep_sharded_model", "loss_takes_item_count"]
