"""Activation recompute on a sharded model's blocks as a dial, not a switch: the rungs between none and all.

Set by hand with ``parallelism_config.fsdp2.activation_checkpointing`` (a plain loop: `FSDP2Config`):

- ``false``: no block recomputes anything (``off``);
- ``op``: every block checkpointed with a *selective* policy (torch's
  `torch.utils.checkpoint.create_selective_checkpoint_contexts`): the outputs of the matrix products (``aten.mm``,
  ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``) and of attention (the scaled-dot-product kernels: flash, efficient,
  cuDNN, CPU flash, math) are saved for backward; everything else a block computes (norms, activations,
  element-wise products, casts, RoPE) is recomputed. The costly work runs once; the many cheap intermediates are not
  kept (`SAVED_OPS`);
- an int ``k`` (``1 <= k``): full checkpointing on the first ``k`` of the ``N`` blocks (``blocks``). The first blocks'
  activations are the ones live longest (from their forward to the end of the backward): at the turn from forward
  to backward, the peak, any ``k`` blocks save the same bytes, but the last block is the first the backward runs, so
  checkpointing it gives its bytes back at the peak (its recompute); the first ``k`` never do
  (`tests/test_recompute.py` measures the saved bytes live at the peak for first, spread and last);
  ``k >= N`` is ``full``;
- ``true`` (or ``full``): every block fully checkpointed, its forward run again in backward.

Every rung computes the same numbers as ``off`` (the same operators on the same inputs; fp32, 1e-5 on CPU: tests).

`BlockDial` is the switch: one per sharded model, its rung changed between batches (never between a forward and its
backward), with no recompile. Eager blocks carry torch's composable checkpoint (hooks) whose context is read at each
forward: off (the hooks return at once), full (no context) or op (the selective contexts). A compiled block cannot
take the selective contexts from outside its graph (dynamo runs a compiled function eager under a dispatch mode:
the block would lose its compile without a word), so under ``op`` a compiled block's forward is the compiled form of
``checkpoint(forward, context_fn=selective)``, compiled once per shape beside its plain graph
(`automicro.engine.compile.CompiledBlocks.set_selective`): switching back and forth compiles nothing again.

Owns: the rungs, what ``op`` saves, which blocks ``k`` takes, the per-block switch. May not touch: the layout
search (which rung a run keeps), Composer; torch privates outside `_torch_internals`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

OFF, OP, BLOCKS, FULL = "off", "op", "blocks", "full"
KINDS = (OFF, OP, BLOCKS, FULL)


class RecomputeConfigError(ValueError):
    """An ``activation_checkpointing`` value that is not a rung; the message says what to set."""


@dataclass(frozen=True)
class Rung:
    """One rung of the dial: `kind` of `KINDS`; `blocks`: how many blocks ``blocks`` checkpoints (the first ones)."""

    kind: str = OFF
    blocks: int = 0

    @property
    def on(self) -> bool:
        return self.kind != OFF

    def modes(self, count: int) -> list[str]:
        """Each of `count` blocks' mode (off, op or full), in the model's order."""
        if self.kind == BLOCKS:
            return [FULL if i < self.blocks else OFF for i in range(count)]
        return [self.kind] * count

    def describe(self, count: Optional[int] = None) -> str:
        if self.kind == BLOCKS:
            return f"full on {self.blocks}" + (f" of {count}" if count else "") + " blocks"
        return {OFF: "off", OP: "op (matrix products and attention saved)", FULL: "full"}[self.kind]

    def value(self) -> Union[bool, str, int]:
        """The config value that sets it."""
        return {OFF: False, FULL: True, OP: OP}.get(self.kind, self.blocks)


def parse(value: Any, key: str = "parallelism_config.fsdp2.activation_checkpointing") -> Rung:
    """``false`` / ``true`` / ``"full"`` / ``"op"`` / an int ``k >= 1`` (full on the first k blocks) / a `Rung`."""
    if isinstance(value, Rung):
        return value
    if isinstance(value, bool):
        return Rung(FULL if value else OFF)
    if isinstance(value, int):
        if value < 1:
            raise RecomputeConfigError(f"{key}={value!r}: the blocks to checkpoint must be at least 1 (false: none)")
        return Rung(BLOCKS, value)
    if isinstance(value, str) and value.lower() in (OP, FULL, OFF, "true", "false"):
        text = value.lower()
        return Rung(FULL if text in (FULL, "true") else OFF if text in (OFF, "false") else OP)
    raise RecomputeConfigError(
        f"{key}={value!r}: must be true (every block recomputed), false, op (each block's matrix products and "
        "attention saved, the rest recomputed) or an int k (the first k blocks recomputed)")


# ---- what ``op`` saves ----------------------------------------------------------------------------------

def _ops(*names: str) -> frozenset:
    """The aten overloads of `names` this torch has (attention kernels come and go between versions)."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            found.append(getattr(packet, overload))
    return frozenset(found)


SAVED_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math", "_flash_attention_forward", "_efficient_attention_forward",
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """The forward's and the recompute's contexts of the ``op`` rung (a fresh pair per forward)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def _selective_method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(type(self).forward, self, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)


def selective(forward: Any) -> Any:
    """`forward` checkpointed with the ``op`` policy, as one function (what a compiled block compiles under ``op``).
    A block's own class ``forward`` gives a method of the block (dynamo then compiles one graph for every block of
    the class, as for the plain forward; a closure over each block's method would compile one per block on torch
    2.7, past its recompile limit on a deep model)."""
    import types

    from torch.utils.checkpoint import checkpoint

    owner = getattr(forward, "__self__", None)
    if isinstance(owner, nn.Module) and getattr(forward, "__func__", None) is type(owner).forward:
        return types.MethodType(_selective_method, owner)

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)

    return checkpointed


# ---- the switch --------------------------------------------------------------------------------------------

class BlockDial:
    """The rung of one model's blocks (`blocks`, in the model's order, each carrying the composable checkpoint:
    `install`). `compiled`: the blocks' `CompiledBlocks`, where the engine compiled them (``op`` swaps their
    compiled forward); `rung`: the rung set now."""

    def __init__(self, blocks: Sequence[nn.Module], compiled: Any = None) -> None:
        self.blocks, self.compiled = list(blocks), compiled
        self.rung = Rung(OFF)
        self._modes = [OFF] * len(self.blocks)

    @classmethod
    def install(cls, blocks: Sequence[nn.Module], compiled: Any = None) -> "BlockDial":
        """Put the checkpoint's hooks on every block (switched off): the dial turns them."""
        from automicro.engine import _torch_internals as internals

        dial = cls(blocks, compiled)
        for index, block in enumerate(dial.blocks):
            internals.apply_activation_checkpointing(block, context_fn=functools.partial(dial._context, index))
            internals.set_activation_checkpointing(block, False)
        return dial

    def _context(self, index: int) -> tuple[Any, Any]:
        from contextlib import nullcontext

        if self._modes[index] == OP and not self._compiled_op:
            return selective_contexts()
        return nullcontext(), nullcontext()

    @property
    def _compiled_op(self) -> bool:
        return self.compiled is not None and self.compiled.scope == "blocks"

    def set(self, rung: Rung) -> None:
        """Every block to `rung` (between batches)."""
        from automicro.engine import _torch_internals as internals

        modes = rung.modes(len(self.blocks))
        for index, (block, mode) in enumerate(zip(self.blocks, modes)):
            # Under ``op`` a compiled block checkpoints inside its own graph: its hooks stay off.
            hooked = mode == FULL or (mode == OP and not self._compiled_op)
            internals.set_activation_checkpointing(block, hooked)
        if self.compiled is not None:
            self.compiled.set_selective({i for i, mode in enumerate(modes) if mode == OP})
        self._modes, self.rung = modes, rung

    def modes(self) -> list[str]:
        return list(self._modes)


__all__ = ["BLOCKS", "BlockDial", "FULL", "KINDS", "OFF", "OP", "RecomputeConfigError", "Rung", "SAVED_OPS", "parse",
           "selective", "selective_contexts"]
