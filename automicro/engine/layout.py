"""`LayoutEngine`: puts a layout (`automicro.core.layout`) on a sharded model.

- ``no_reshard``: every wrapped block keeps its parameters unsharded from forward to backward
  (the root already does, as FSDP2 sets it), and every module keeps them unsharded after the
  backward of each microbatch but the batch's last (FSDP2's `set_reshard_after_backward`): one
  all-gather per block per batch instead of two per microbatch. The peak is the same (every block
  is unsharded at the turn from forward to backward either way).
- ``grad_sync_once``: before each microbatch, gradient reduction is on for the last microbatch
  of the batch only; the others accumulate unsharded gradients (FSDP2's own accumulation).
- ``no_recompute``: the blocks' activation checkpointing (applied at build time where
  ``activation_checkpointing: true``) is switched off, and back on, between batches.
- ``recompute``: the blocks' checkpointing applied switched off at build time (`shard`'s
  ``checkpoint_switch``, where ``activation_checkpointing: false``) is switched on between batches: by the layout
  search's upsize trial (not where the blocks are compiled), or by the ladder below the floor
  (`automicro.batch.floor_ladder`, compiled blocks included: the switch sits in the block's hooks, outside its
  compiled forward, so switching it compiles nothing again).
- ``fused_head``: the vocabulary head's switch (`automicro.engine.head.HeadSwitch`, put on the model under
  ``head: auto``) is turned to the fused head between batches.

`reset()` puts gradient reduction back on (after a failed attempt and between batches), so an
attempt that never reached its last microbatch leaves no module that skips its reduce-scatter.
Evaluation runs at the engine's own layout (`suspend` / `resume`): a forward with no backward
would otherwise leave the blocks unsharded.

Owns: which FSDP2 switches a layout turns, and the projected bytes of each trade. May not touch:
the layout search, Composer; torch privates outside `_torch_internals`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from automicro.core.layout import FUSED_HEAD, GRAD_SYNC_ONCE, NO_RECOMPUTE, NO_RESHARD, RECOMPUTE, RECOMPUTE_OP
from automicro.engine import _torch_internals as internals
from automicro.engine.recompute import FULL, OFF, OP, Rung
from automicro.engine.sharding import ShardedModel


class LayoutEngine:
    """The switches of one sharded model (not a pipeline stage)."""

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded
        self._blocks = [m for name, m in sharded.named_fsdp_modules if name]
        self.layout: tuple[str, ...] = ()
        self._suspended: Optional[tuple[str, ...]] = None
        self._extra: dict[str, int] = {}
        self._sync_off = False  # a microbatch turned gradient reduction off and nothing turned it back
        self._kept = False  # a microbatch kept the parameters unsharded after backward

    def candidates(self) -> list[str]:
        """The trades this model can take: ``no_reshard`` where blocks reshard after forward
        (``reshard_after_forward: true``, the default), ``grad_sync_once`` wherever it is sharded,
        ``no_recompute`` where the blocks checkpoint their activations, ``recompute`` where they
        carry checkpointing switched off (`shard`'s ``checkpoint_switch``; compiled blocks too, held while the whole
        model is compiled: `recompute_held`); ``recompute_op`` where the blocks carry the engine's dial and the user asked
        for full recompute (the ``op`` rung in its place) or none (``op`` tried up before full); ``fused_head`` where the
        head's switch is the trials' (``head: auto``)."""
        found = []
        if self.head is not None and self.head.switchable:
            found.append(FUSED_HEAD)
        if self.sharded.fsdp_modules:
            found.append(GRAD_SYNC_ONCE)
        if self._blocks and self.sharded.config.reshard_after_forward is True:
            found.append(NO_RESHARD)
        if self._checkpointed and (self._asked or self.sharded.compiled is None or self._dial is not None):
            # Compiled blocks take ``recompute`` where they carry the engine's dial: its hooks sit on each block's call,
            # outside its compiled forward (not while the whole model is compiled: `recompute_held`).
            found.append(NO_RECOMPUTE if self._asked else RECOMPUTE)
        if self._dial is not None and self._asked and self.sharded.config.rung.kind == FULL:
            # Full recompute asked for by hand: tried down to ``op`` as well as off.
            found.append(RECOMPUTE_OP)
        elif self._dial is not None and RECOMPUTE in found:
            # No recompute now: ``op`` tried up (at a larger microbatch) before full, the cheaper recompute.
            found.append(RECOMPUTE_OP)
        return found

    @property
    def can_recompute(self) -> bool:
        """The ladder below the floor can make the blocks recompute more: they carry the engine's dial below full
        (checkpointing switched off at build time, `shard`'s ``checkpoint_switch``, or a rung below full asked for),
        or, sharded by the model's own `fully_shard`, checkpointing it switched off."""
        if self._dial is not None:
            return self.rung_of(self.layout).kind != FULL
        return bool(self._checkpointed) and not self._asked

    @property
    def recompute_held(self) -> Optional[str]:
        """Why the blocks' checkpointing cannot be switched on now (None: it can): the whole model is compiled (the
        compile scope's trial, or kept), and checkpointing switched on inside a whole-model graph recomputes other
        values than its forward saved (torch 2.11 and 2.15)."""
        compiled = self.sharded.compiled
        if compiled is not None and getattr(compiled, "scope", "blocks") != "blocks":
            return "the whole model is compiled (checkpointing inside its graph would recompute other values)"
        return None

    @property
    def can_select(self) -> bool:
        """The ladder's cheapest rung is left: the blocks carry the engine's dial and recompute nothing now."""
        return self._dial is not None and not self.rung_of(self.layout).on

    @property
    def recomputes(self) -> bool:
        """The blocks checkpoint their activations (some of them, or some of their work) in the layout applied."""
        if self._dial is not None:
            return self.rung_of(self.layout).on
        return bool(self._checkpointed) and (NO_RECOMPUTE not in self.layout if self._asked else RECOMPUTE in self.layout)

    def rung_of(self, layout: Sequence[str]) -> Rung:
        """The recompute rung `layout` puts on the blocks: full (``recompute``), off where the user asked for
        checkpointing and ``no_recompute`` switches it off, ``op`` (``recompute_op``: the ladder's rung, or a hand-set
        full recompute tried down), the one asked for (``activation_checkpointing``), else off."""
        if RECOMPUTE in layout:
            return Rung(FULL)
        if self._asked and NO_RECOMPUTE in layout:
            return Rung(OFF)
        if RECOMPUTE_OP in layout:
            return Rung(OP)
        if self._asked:
            return self.sharded.config.rung
        return Rung(OFF)

    @property
    def _dial(self) -> Any:
        return getattr(self.sharded, "recompute", None)

    @property
    def head(self) -> Any:
        return getattr(self.sharded, "head", None)

    @property
    def _asked(self) -> bool:
        """The user asked for checkpointing (``activation_checkpointing: true``)."""
        return bool(self.sharded.config.activation_checkpointing)

    @property
    def _checkpointed(self) -> list:
        return [b for b in self._blocks if internals.has_activation_checkpointing(b)]

    def extra_bytes(self, trade: str) -> Optional[int]:
        """What `trade` adds to this rank's peak, at most: every block's unsharded parameters
        (``no_reshard``) or unsharded gradients less the sharded ones the engine's own layout holds
        (``grad_sync_once``); None for ``no_recompute`` and ``recompute``
        (the activations depend on the layers and the microbatch: not projected)."""
        if trade in (NO_RECOMPUTE, RECOMPUTE, RECOMPUTE_OP, FUSED_HEAD):
            return None
        if not self._extra:
            param_bytes, grad_bytes, sharded_grad_bytes = internals.unsharded_param_bytes(self._blocks)
            # The engine's own layout holds the sharded gradients from the first microbatch's
            # reduce-scatter on; reduced once per batch, the unsharded ones take their place until
            # the last (one rank: the same bytes).
            self._extra = {NO_RESHARD: param_bytes, GRAD_SYNC_ONCE: max(0, grad_bytes - sharded_grad_bytes)}
        return self._extra[trade]

    def apply(self, layout: Sequence[str]) -> None:
        layout = tuple(layout)
        if self.sharded.config.reshard_after_forward is True:
            for block in self._blocks:
                internals.set_block_reshard_after_forward(block, NO_RESHARD not in layout)
        if self._dial is not None:  # the engine's blocks: the rung the layout puts on them
            rung = self.rung_of(layout)
            if rung.on and not self._asked and self.recompute_held is not None:
                # The callers hold the trade and the ladder compiles the blocks again first: a bug if it gets here.
                raise RuntimeError(f"automicro: recompute switched on where {self.recompute_held}; layout {list(layout)}")
            self._dial.set(rung)
        else:  # a model sharded by its own `fully_shard`, its checkpointing its own: on or off
            on = NO_RECOMPUTE not in layout if self._asked else RECOMPUTE in layout
            for block in self._checkpointed:
                internals.set_activation_checkpointing(block, on)
        if self.head is not None:
            self.head.set_fused(FUSED_HEAD in layout)
        self.layout = layout
        self.reset()

    def before_microbatch(self, index: int, count: int) -> None:
        last = index + 1 == count
        if GRAD_SYNC_ONCE in self.layout and count > 1:
            self.sharded.module.set_requires_gradient_sync(last)
            self._sync_off = not last
        if NO_RESHARD in self.layout and count > 1:
            self.sharded.module.set_reshard_after_backward(last)
            self._kept = not last

    def reset(self) -> None:
        """Gradient reduction and resharding after backward back on where a microbatch turned them
        off (a no-op otherwise: this runs after every batch and every failed attempt; a failed
        attempt's unsharded parameters are freed by `ShardedModel.recover`)."""
        if self._sync_off:
            self.sharded.module.set_requires_gradient_sync(True)
            self._sync_off = False
        if self._kept:
            self.sharded.module.set_reshard_after_backward(True)
            self._kept = False

    def suspend(self) -> None:
        """Evaluation: the engine's own layout until `resume`."""
        if self._suspended is None and self.layout:
            self._suspended = self.layout
            self.apply(())

    def resume(self) -> None:
        if self._suspended is not None:
            layout, self._suspended = self._suspended, None
            self.apply(layout)


__all__ = ["LayoutEngine"]
