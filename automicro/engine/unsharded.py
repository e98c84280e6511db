"""`UnshardedModel`: the engine's handle on a model that is not sharded (one rank, no FSDP).

On one rank FSDP2 shards nothing and only costs: each block's parameters are still copied into
an all-gather buffer before its forward and backward, and each microbatch's gradients pass through
a reduce-scatter. With ``parallelism_config: null`` and ``device_train_microbatch_size: auto`` on
one rank, the model runs as Composer runs it without FSDP (its own autocast, fp32 parameters), and
the search, its attempt fence and the steady-phase rerun use this handle where they use a
`ShardedModel`: nothing to put back after a failed attempt but the gradients, no FSDP2 states, no
collectives to guard.

Owns: the handle's answers for an unsharded model. May not touch: Composer, the search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass
class UnshardedModel:
    """Duck-types the parts of `ShardedModel` the search uses, for a model on one rank."""

    module: nn.Module
    device: torch.device
    config: Any = None
    mesh: Any = None

    @property
    def named_fsdp_modules(self) -> list[tuple[str, Any]]:
        return []

    @property
    def fsdp_modules(self) -> list[Any]:
        return []

    @property
    def wrapped_names(self) -> list[str]:
        return []

    def recover(self) -> None:
        """After a failed attempt: drop every gradient (the attempt's partial sums)."""
        for param in self.module.parameters():
            param.grad = None

    def is_clean(self) -> bool:
        return True

    def states(self) -> list[dict[str, str]]:
        return []

    def unsharded_bytes(self) -> int:
        return 0

    def param_fqn_to_module(self) -> dict[str, str]:
        return {}

    def reshard_root(self) -> None:
        return None


def unsharded(model: nn.Module, device: torch.device) -> UnshardedModel:
    """The handle for `model` trained unsharded on `device` (Composer moves it there)."""
    return UnshardedModel(module=model, device=device)


__all__ = ["UnshardedModel", "unsharded"]
