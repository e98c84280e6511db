"""`RoutingSkew`: a routed model's routers biased so that most tokens of chosen batches go to one expert.

A Composer callback, or by hand in a plain loop::

    skew = RoutingSkew(batches=[3], expert=0, share=0.9, ranks=[1])
    trainer = automicro.Trainer(..., callbacks=[auto, skew])     # installs itself at fit_start

    skew.install(model); skew.set_batch(3); loss = model(...)     # a plain loop

In a skewed batch, on `ranks` (None: every rank), the first `share` of each microbatch's tokens (in each routed
layer) go to `expert`: a router that returns its logits (transformers 4.x) gets a large bias on that expert's logit
for those tokens (so the block's top-k, its weights and its load-balancing loss follow); a top-k router that returns
its choices (transformers 5.x: logits, scores, indices) gets `expert` in the first slot of those tokens' choices where
it is not among them already. The skew is deterministic (the same tokens, the same batches), so a fixed run with the
same skew computes the same numbers; `forwards` limits it to the first N forward passes of a skewed batch on a rank
(a microbatch is one; a block's recompute under activation checkpointing another) and the others route as the model
would: with 1 the skew stands for memory that moved once (the batch's rerun routes as the model does), None skews
every forward pass (a rerun meets it again). Routers are found as `automicro.batch.routing.find_routers` finds
them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from automicro.batch.routing import Router, find_routers

BIAS = 1e4  # added to the skewed expert's logit: its softmax weight is 1 to within float precision


class RoutingSkew(Callback):
    """Route `share` of each microbatch's tokens to `expert` in `batches` (Composer's ``timestamp.batch``) on `ranks`."""

    def __init__(self, batches: Iterable[int], expert: int = 0, share: float = 0.9, ranks: Optional[Iterable[int]] = None,
                 forwards: Optional[int] = None) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"RoutingSkew share={share!r}: the share of the tokens sent to one expert, in (0, 1]")
        if expert < 0:
            raise ValueError(f"RoutingSkew expert={expert!r}: an expert's index, 0 or more")
        self.batches = frozenset(int(b) for b in batches)
        self.expert, self.share = int(expert), float(share)
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self.forwards = forwards
        self.routers: list[Router] = []
        self._handles: list[Any] = []
        self._batch: Optional[int] = None
        self._forwards: dict[int, int] = {}  # batch -> forward passes of the first router skewed so far
        self.skewed_calls = 0

    # ---- by hand -------------------------------------------------------------------------------

    def install(self, model: torch.nn.Module) -> None:
        """Hook `model`'s routers; a model without one is an error naming what a router is."""
        if self._handles:
            return
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError("RoutingSkew: the model has no routed block (a module with an 'experts' child and a 'gate' "
                             "or 'router' child, its expert count and top-k readable from it or the model's config)")
        for router in self.routers:
            if self.expert >= router.num_experts:
                raise ValueError(f"RoutingSkew expert={self.expert}: {router.name} has {router.num_experts} experts")
            self._handles.append(router.module.register_forward_hook(self._hook(router, first=router is self.routers[0])))

    def set_batch(self, batch: Optional[int]) -> None:
        self._batch = batch

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- Composer ------------------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        self.install(state.model)

    def batch_start(self, state: State, logger: Logger) -> None:
        self.set_batch(int(state.timestamp.batch))

    def fit_end(self, state: State, logger: Logger) -> None:
        self.remove()

    # ---- the hook ------------------------------------------------------------------------------

    def _active(self, first: bool) -> bool:
        if self._batch not in self.batches:
            return False
        if self.ranks is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank not in self.ranks:
                return False
        if first:
            # A forward pass starts at the first router; `forwards` counts them.
            self._forwards[self._batch] = self._forwards.get(self._batch, 0) + 1
        return True

    def _hook(self, router: Router, first: bool) -> Any:
        def skew(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if not self._active(first):
                return None
            if self.forwards is not None and self._forwards.get(self._batch, 0) > self.forwards:
                return None
            self.skewed_calls += 1
            if isinstance(output, torch.Tensor):
                return self._logits(output)
            parts = list(output)
            for i, part in enumerate(parts):
                if isinstance(part, torch.Tensor) and not part.is_floating_point() and part.size(-1) == router.top_k:
                    parts[i] = self._choices(part)
                    return type(output)(parts) if isinstance(output, tuple) else parts
            raise ValueError(f"RoutingSkew: {router.name} returned neither logits nor top-k choices ({type(output).__name__})")

        return skew

    def _rows(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.arange(rows, device=device) < math.ceil(self.share * rows)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.size(-1))
        bias = torch.zeros_like(flat)
        bias[self._rows(flat.size(0), flat.device), self.expert] = BIAS
        return (flat + bias).reshape(logits.shape)

    def _choices(self, indices: torch.Tensor) -> torch.Tensor:
        flat = indices.reshape(-1, indices.size(-1)).clone()
        take = self._rows(flat.size(0), flat.device) & ~(flat == self.expert).any(dim=-1)
        flat[take, 0] = self.expert
        return flat.reshape(indices.shape)


__all__ = ["RoutingSkew"]
