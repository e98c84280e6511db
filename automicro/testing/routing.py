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
(a microbatch is one; a block's recompute under activation checkpointing follows its forward pass) and the others
route as the model would: with 1 the skew stands for memory that moved once (the batch's rerun routes as the model does), None skews
every forward pass (a rerun meets it again). Routers are found as `automicro.batch.routing.find_routers` finds
them.

Compiled blocks: the routers' hooks read one switch per router (a buffer on the device the model computes on, 1.0 while
a forward pass is skewed) and always compute the skew's arithmetic with it, so a compiled block traces them once and
compiles nothing again when a batch is skewed; the batch, the rank and the forward passes are counted in Python
outside the blocks (Composer's ``before_forward``, or a pre-hook on the model installed by hand).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger

from automicro.batch.routing import Router, find_routers, router_buffer

BIAS = 1e4  # added to the skewed expert's logit: its softmax weight is 1 to within float precision
_SWITCH = "_automicro_skew"  # each router's switch: 1.0 while a forward pass is skewed (a non-persistent buffer)


class RoutingSkew(Callback):
    """Route `share` of each microbatch's tokens to `expert` in `batches` (Composer's ``timestamp.batch``) on `ranks`.
    As a Composer callback it prints one line at the end of each batch it skewed on a rank (``[automicro] routing skew:
    batch N, ...``).

    Args:
        batches: The batches skewed (Composer's batch count when each starts: 0 is the first).
        expert: The expert that gets the tokens (an index below every routed layer's expert count).
        share: The share of each microbatch's tokens sent to it, in (0, 1].
        ranks: Only on these ranks (null: every rank).
        forwards: Only the first N forward passes of a skewed batch on a rank (a microbatch is one; null: all of them,
            so a rerun of the batch meets the skew again; 1: memory that moved once).
    """

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
        self._forwards: dict[int, int] = {}  # batch -> its forward passes counted so far (on the ranks skewed)
        self.skewed_calls = 0  # router calls skewed (each router once a skewed forward pass)
        self._on = False

    # ---- by hand -------------------------------------------------------------------------------

    def install(self, model: torch.nn.Module, device: Optional[torch.device] = None, by_hand: bool = True) -> None:
        """Hook `model`'s routers; a model without one is an error naming what a router is. `device`: where the switch
        lives, the device the model computes on (None: the routers' parameters'). `by_hand`: each call of `model`
        counts as a forward pass (a Composer callback counts them at ``before_forward`` instead)."""
        if self._handles:
            return
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError("RoutingSkew: the model has no routed block (a module with an 'experts' child and a 'gate' "
                             "or 'router' child, its expert count and top-k readable from it or the model's config)")
        for router in self.routers:
            if self.expert >= router.num_experts:
                raise ValueError(f"RoutingSkew expert={self.expert}: {router.name} has {router.num_experts} experts")
        for router in self.routers:
            router_buffer(router, _SWITCH, device)
            self._handles.append(router.module.register_forward_hook(self._hook(router)))
        if by_hand:
            self._handles.append(model.register_forward_pre_hook(lambda module, args: self.next_forward()))
        self._on = False

    def set_batch(self, batch: Optional[int]) -> None:
        self._batch = batch

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._switch(False)

    def next_forward(self) -> None:
        """A forward pass starts (a microbatch's; a block's recompute in backward is not one): the routers skew it or not.
        Python's bookkeeping is here, outside the routers' hooks, so that a compiled block reads one tensor, the switch,
        and not the batch (a guard on it would compile the block again every batch)."""
        self._switch(self._active())

    # ---- Composer ------------------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        self.install(state.model, getattr(getattr(state, "device", None), "_device", None), by_hand=False)

    def batch_start(self, state: State, logger: Logger) -> None:
        self.set_batch(int(state.timestamp.batch))

    def before_forward(self, state: State, logger: Logger) -> None:
        self.next_forward()

    def batch_end(self, state: State, logger: Logger) -> None:
        self._switch(False)  # an evaluation after the batch routes as the model does
        skewed = self._skewed_forwards()
        if skewed:
            print(f"[automicro] routing skew: batch {self._batch}, {skewed} forward pass(es) sent {self.share:.0%} of "
                  f"their tokens to expert {self.expert}", flush=True)

    def _skewed_forwards(self) -> int:
        """The forward passes of the current batch the skew reached on this rank (0 where it skewed none)."""
        if self._batch not in self._forwards:
            return 0
        counted = self._forwards[self._batch]
        return counted if self.forwards is None else min(counted, self.forwards)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.remove()

    # ---- the hook ------------------------------------------------------------------------------

    def _active(self) -> bool:
        if self._batch not in self.batches:
            return False
        if self.ranks is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if rank not in self.ranks:
                return False
        self._forwards[self._batch] = self._forwards.get(self._batch, 0) + 1
        if self.forwards is not None and self._forwards[self._batch] > self.forwards:
            return False
        self.skewed_calls += len(self.routers)
        return True

    def _switch(self, on: bool) -> None:
        if on == self._on:
            return
        self._on = on
        with torch.no_grad():
            for router in self.routers:
                getattr(router.module, _SWITCH).fill_(1.0 if on else 0.0)

    def _hook(self, router: Router) -> Any:
        def skew(module: torch.nn.Module, args: Any, output: Any) -> Any:
            on = getattr(module, _SWITCH)
            if isinstance(output, torch.Tensor):
                return self._logits(output, on)
            parts = list(output)
            for i, part in enumerate(parts):
                if isinstance(part, torch.Tensor) and not part.is_floating_point() and part.size(-1) == router.top_k:
                    parts[i] = self._choices(part, on)
                    return type(output)(parts) if isinstance(output, tuple) else parts
            raise ValueError(f"RoutingSkew: {router.name} returned neither logits nor top-k choices ({type(output).__name__})")

        return skew

    def _rows(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.arange(rows, device=device) < math.ceil(self.share * rows)

    def _logits(self, logits: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.size(-1))
        bias = torch.zeros_like(flat)
        bias[self._rows(flat.size(0), flat.device), self.expert] = BIAS
        return (flat + bias * on.to(flat.dtype)).reshape(logits.shape)

    def _choices(self, indices: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
        flat = indices.reshape(-1, indices.size(-1)).clone()
        take = self._rows(flat.size(0), flat.device) & ~(flat == self.expert).any(dim=-1) & (on > 0)
        flat[:, 0] = torch.where(take, torch.full_like(flat[:, 0], self.expert), flat[:, 0])
        return flat.reshape(indices.shape)


__all__ = ["RoutingSkew"]
