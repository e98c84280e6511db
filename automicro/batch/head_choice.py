"""The ``head`` key at attach: which head the run trains with, and the one line that says it.

- ``plain``: the model's own head (the default where the layout is not searched: a CPU, ``layout: fixed``,
  ``trials: false``); nothing is installed.
- ``fused``: the switch (`automicro.engine.head.HeadSwitch`) is put on the model fused from the first batch, so the
  size is searched with the head that trains. A model whose head automicro cannot fuse is refused, with why.
- ``auto`` (the default on a GPU where the layout is searched): the switch is put on plain; once the size settles
  the layout trials price the fused head from the profiled batch (the head's share of its time, the bytes its
  logits hold per sample), measure its memory in one batch, and time it against the plain head at the largest size
  it fits (`automicro.core.layout`'s ``fused_head``); kept where faster, the size settles there. A model whose head
  cannot be fused keeps its own, one line says why.

Either way a run whose loop reads the logits of a training batch keeps the plain head (a Composer model's training
metrics other than its loss's: `automicro.composer.head_metrics`), said on the line; evaluation always runs
the plain head (a fused head only runs a training forward with labels). The switch is put on the model's unsharded
twin too, where the run has one (the same head either way).

Owns: resolving the key, the attach-time checks and the line. May not touch: the fused loss and the models
(`automicro.engine.head`, `head_models`), the trial (the layout's), Composer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from automicro.engine.head import HeadConfigError, HeadSwitch, choose_backend
from automicro.engine.head_models import find_head, head_weight, install_head
from automicro.engine.sharding import ShardedModel
from automicro.batch.settings import Settings


def _compute_dtype(sharded: ShardedModel, weight: torch.Tensor) -> torch.dtype:
    precision = getattr(sharded.config, "mixed_precision", "FULL")
    return torch.bfloat16 if precision in ("DEFAULT", "PURE") else weight.dtype


def attach_head(
    settings: Settings, sharded: ShardedModel, info: Callable[[str], None], *,
    allocated: Callable[[], int] = lambda: 0, logits_needed: str = "", pipeline: bool = False, also: str = "",
    searched: bool = True,
) -> Optional[HeadSwitch]:
    """Resolve ``head`` for this run and put the switch on the model where it is fused or timed; returns it (also
    as ``sharded.head``), or None where the model keeps its own head. `allocated`: the memory source's allocated
    bytes (the meter's); `logits_needed`: why the loop reads a training batch's logits ("" where it does not);
    `pipeline`: the model is a pipeline stage; `also`: what else the fused head brings, for the line (the training
    metrics it computes from its loss); `searched`: the size is searched with the head (False: the microbatch size is
    set by hand, ``head: fused`` only)."""
    value = settings.head
    # ``head: auto`` is one of the layout trials: they must run here, on FSDP2's blocks.
    searches_layout = settings.searches_layout(sharded.device.type) and bool(sharded.fsdp_modules) and not pipeline
    mode = value
    if mode is None:
        mode = "auto" if searches_layout and sharded.device.type == "cuda" and not pipeline else "plain"
    if mode == "plain":
        if value == "plain":
            info("head: plain (head: plain): the model's own head")
        return None
    if mode == "auto" and not searches_layout:
        raise HeadConfigError(
            "head='auto' times the fused head against the plain one in the layout trials, which do not run here "
            "(layout: fixed, the default off a GPU; a pipeline; a model without FSDP2; steady_recovery: false): set "
            "head: fused or head: plain, or layout: auto"
        )
    family, why = (None, "a pipeline stage holds the head apart from the blocks") if pipeline else find_head(sharded.module)
    if family is None:
        if value == "fused":
            raise HeadConfigError(f"head='fused': {why}; set head: plain (or leave it out)")
        info(f"head: plain: {why}")
        return None
    if logits_needed:
        info(f"head: plain ({'head: ' + value if value else 'the default on a GPU'} asked for {mode}): {logits_needed}, "
             "which the fused head never holds")
        return None
    weight = head_weight(sharded.module)
    assert weight is not None
    backend, backend_why = choose_backend(sharded.device, _compute_dtype(sharded, weight))
    switch = HeadSwitch(mode=mode, fused=mode == "fused", backend=backend, backend_why=backend_why, family=family,
                        vocab=int(weight.shape[0]))
    switch.meter.allocated = allocated
    install_head(sharded.module, switch)
    twin = getattr(sharded, "twin", None)
    if twin is not None:
        install_head(twin.module, switch)
    sharded.head = switch
    how = "liger-kernel's fused linear cross-entropy" if backend == "liger" else f"torch-native, in chunks ({backend_why})"
    if backend == "torch" and sharded.device.type == "cuda":
        how += "; pip install \"automicro[kernels]\" for liger-kernel's, 1.3-3x faster on an H200"
    also = f"; {also}" if also else ""
    if mode == "fused":
        info(f"head: fused ({how}) on {family}'s head, a vocabulary of {switch.vocab:,}: the loss from the hidden states "
             f"in chunks, never the whole logits; {'the size is searched with it' if searched else 'at the microbatch size set'}{also}")
    else:
        info(f"head: auto: {family}'s head (a vocabulary of {switch.vocab:,}) is priced fused ({how}) once the size "
             f"settles, from the profiled batch, and timed against the plain head at the size it fits{also}")
    return switch


def attach_head_at_set_size(
    settings: Settings, sharded: Optional[ShardedModel], size: object, info: Callable[[str], None], *,
    logits_needed: str = "", pipeline: bool = False, also: str = "",
) -> Optional[HeadSwitch]:
    """``device_train_microbatch_size`` set to `size` (not ``auto``): the search stays idle, but ``head: fused`` changes
    the model, not the search: it is put on as set (a size and head `auto` found, pinned by hand; before, the plain
    head ran and no line said so). ``head: auto`` has no trials to time it in, and a run without FSDP2 (`sharded`
    None) nothing to put it on: both refused with what to set. The rest as `attach_head`."""
    if settings.head is None or settings.head == "plain":
        return None
    if settings.head == "auto":
        raise HeadConfigError(
            f"head='auto' times the fused head against the plain one in the trials of device_train_microbatch_size: "
            f"auto, and this run sets it to {size!r}: set head: fused (the fused head at that size) or head: plain, "
            "or device_train_microbatch_size: auto"
        )
    if sharded is None:
        raise HeadConfigError(
            f"head='fused' with device_train_microbatch_size={size!r} is put on the sharded model, and this run has "
            "none: pass parallelism_config={'fsdp2': {}} (FSDP2, on one rank too), or set head: plain"
        )
    return attach_head(settings, sharded, info, logits_needed=logits_needed, pipeline=pipeline, also=also, searched=False)


__all__ = ["attach_head", "attach_head_at_set_size"]
