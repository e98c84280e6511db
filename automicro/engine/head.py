"""The vocabulary head: the output projection and the loss over the vocabulary, plain or fused.

A causal language model's head turns the last hidden states into logits (microbatch x sequence x
vocabulary) and a cross-entropy over them. On the vocabularies models train with today (Llama 3: 128k,
Qwen 2.5/3: 152k, Gemma 2/3: 256-262k) those logits, their fp32 upcast and their gradient are the
largest tensors of the batch: they set the microbatch and a large share of its time (the head's eager
work was 23% of a batch on a 256k model; `docs/guides/what-auto-measures.md`).

The *fused* head never holds the whole logits: the loss is computed from the hidden states and the output
weight in chunks of rows, and each chunk's gradients (of the hidden states and of the weight) are computed
in the same pass, so the backward only scales them (`fused_linear_cross_entropy`). Two backends:

- ``liger``: `liger-kernel`'s fused linear cross-entropy (Triton kernels: the softmax and its gradient in
  place in each chunk's logits), on a CUDA device in bf16, fp16 or fp32, where the package is installed
  (``pip install "automicro[kernels]"``). Chosen over `cut-cross-entropy` because it takes soft-capping and
  label smoothing, is kept by a team that ships it in the Hugging Face Trainer (``use_liger_kernel``), and
  runs on torch 2.7 to 2.15 without a compiler of its own.
- ``torch``: the same chunked computation in torch operators (`_ChunkedLinearCrossEntropy`): a chunk's logits
  as one matrix product, the soft-capping, the log-sum-exp and the gradient in fp32, two matrix products for
  the gradients; where liger cannot run (a CPU, another dtype, the package missing). No kernel of our own.

Both compute what the plain head computes: the mean cross-entropy over the labels that are not
``ignore_index`` (or their sum over ``num_items``, transformers' ``num_items_in_batch``), with the logits
soft-capped (``softcap * tanh(logits / softcap)``: Gemma 2/3) or scaled (``logits * scale``: Granite divides by
``logits_scaling``), optionally label-smoothed. In fp32 the loss and both gradients equal the plain head's to
float rounding (tests/test_head.py).

`HeadSwitch` is the run's switch (plain or fused, the backend, and the meter the profiled batch reads:
`HeadMeter`); the models it applies to, and how, are `automicro.engine.head_models`'.

Owns: the fused loss, its backends and the switch. May not touch: a model's modules (head_models'), the
trials (which decide the switch), Composer, transformers.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

HEAD_MODES = ("auto", "fused", "plain")
# What the profiled batch's host ranges of the head are called (`automicro.batch.batch_profile`).
HEAD_RANGE = "automicro::head"
# The dtypes liger's kernels take.
_LIGER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class HeadConfigError(ValueError):
    """A ``head`` value that cannot be used; the message says what to set instead."""


def liger_available() -> tuple[bool, str]:
    """Whether liger-kernel's fused linear cross-entropy imports here, and why not."""
    try:
        importlib.import_module("liger_kernel.transformers.functional")
    except Exception as error:  # noqa: BLE001 - any import failure (triton missing, a CPU-only build) means no liger
        return False, f"liger-kernel is not importable ({type(error).__name__}: {str(error)[:120]})"
    return True, ""


def choose_backend(device: torch.device, dtype: torch.dtype, wanted: Optional[str] = None) -> tuple[str, str]:
    """The backend for a head on `device` computing in `dtype`: ("liger", "") where it can run, else ("torch", why).
    `wanted`: "torch" forces the torch-native path; "liger" where it cannot run raises `HeadConfigError`."""
    if wanted == "torch":
        return "torch", "asked for"
    why = ""
    if device.type != "cuda":
        why = f"liger-kernel runs on CUDA devices, this is {device.type}"
    elif dtype not in _LIGER_DTYPES:
        why = f"liger-kernel takes bf16, fp16 or fp32, the head computes in {dtype}"
    else:
        ok, why = liger_available()
        if ok:
            return "liger", ""
    if wanted == "liger":
        raise HeadConfigError(f"the fused head's liger backend cannot run here: {why}")
    return "torch", why


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matrix products run in: autocast's where it is on for the device, else the inputs'."""
    device = hidden.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


# The least logits a chunk of the torch-native path holds (elements): below it a chunk's launches cost more than its
# work (a small model's hidden states are small).
MIN_CHUNK = 1 << 20


def chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Rows a chunk of the torch-native path holds: its logits about the size of the hidden states of all rows
    (liger's rule), at least `MIN_CHUNK` elements, at least one row."""
    per = max(1, math.ceil(vocab / max(1, hidden)))
    return max(1, math.ceil(rows / per), MIN_CHUNK // max(1, vocab))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The torch-native fused head: loss and gradients chunk by chunk in forward; backward scales them."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, ignore_index: int, softcap: Optional[float], label_smoothing: float,
                divisor: Optional[torch.Tensor], dtype: torch.dtype, rows: int) -> torch.Tensor:
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, vocab = hidden.shape[0], weight.shape[0]
        valid = labels != ignore_index
        if divisor is None:
            divisor = valid.sum().clamp(min=1).to(torch.float32)
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight) if needs_weight else None
        grad_bias = torch.zeros_like(bias) if needs_bias and bias is not None else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, rows):
            end = min(n, start + rows)
            h = hidden[start:end].to(dtype)
            y = labels[start:end]
            keep = valid[start:end]
            logits = (h @ w.t() if b is None else torch.addmm(b, h, w.t())).float()
            if softcap:
                capped = torch.tanh(logits / softcap)
                z = capped * softcap
            else:
                capped, z = None, logits
            lse = torch.logsumexp(z, dim=-1)
            target = torch.where(keep, y, torch.zeros_like(y))
            loss_rows = lse - z.gather(1, target[:, None]).squeeze(1)
            if label_smoothing:
                loss_rows = (1.0 - label_smoothing) * loss_rows + label_smoothing * (lse - z.mean(dim=-1))
            total = total + torch.where(keep, loss_rows, torch.zeros_like(loss_rows)).sum()
            if not (needs_hidden or needs_weight or needs_bias):
                continue
            # d loss / d z: softmax less the (smoothed) one-hot, over the divisor, on the labels that count.
            grad = torch.exp(z - lse[:, None])
            grad.scatter_add_(1, target[:, None], torch.full_like(lse[:, None], -(1.0 - label_smoothing)))
            if label_smoothing:
                grad -= label_smoothing / vocab
            grad *= (keep.to(grad.dtype) / divisor)[:, None]
            if capped is not None:
                grad *= 1.0 - capped * capped
            del logits, z, capped
            grad = grad.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad @ w).to(grad_hidden.dtype)
            if grad_weight is not None:  # accumulated in the weight's dtype, in the product itself (liger's rule)
                grad_weight.addmm_(grad.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
            if grad_bias is not None:
                grad_bias += grad.sum(0).to(grad_bias.dtype)
            del grad  # before the next chunk's logits: one chunk's buffers at a time
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight, grad_bias) if t is not None))
        ctx.present = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        # The gradients were computed in forward for a loss of gradient one: scaled by the one that came.
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) * grad_output if present else None for present in ctx.present]
        return grads[0], grads[1], grads[2], None, None, None, None, None, None, None


def _torch_fused(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                 ignore_index: int, softcap: Optional[float], label_smoothing: float,
                 divisor: Optional[torch.Tensor]) -> torch.Tensor:
    dtype = _compute_dtype(hidden, weight)
    rows = chunk_rows(hidden.shape[0], weight.shape[0], hidden.shape[1])
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, ignore_index, softcap, label_smoothing,
                                                divisor, dtype, rows)


def _liger_fused(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                 ignore_index: int, softcap: Optional[float], label_smoothing: float,
                 divisor: Optional[torch.Tensor]) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = _compute_dtype(hidden, weight)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if divisor is None:
        return liger_fused_linear_cross_entropy(hidden, weight, labels, bias, ignore_index=ignore_index,
                                                label_smoothing=label_smoothing, reduction="mean", softcap=softcap)
    total = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, ignore_index=ignore_index,
                                             label_smoothing=label_smoothing, reduction="sum", softcap=softcap)
    return total / divisor


@torch.compiler.disable
def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
    ignore_index: int = -100, softcap: Optional[float] = None, scale: Optional[float] = None,
    label_smoothing: float = 0.0, num_items: Union[int, torch.Tensor, None] = None, backend: str = "torch",
) -> torch.Tensor:
    """The cross-entropy of ``(hidden @ weight.T + bias) * scale``, soft-capped where `softcap` is given, against
    `labels`, without the whole logits: the mean over the labels that are not `ignore_index`, or their sum over
    `num_items` where given (transformers' ``num_items_in_batch``). `hidden`: ``[..., H]``, `labels` the same
    leading shape (already shifted), `weight`: ``[V, H]``. `backend`: "liger" or "torch" (`choose_backend`).
    Always run eagerly (a compiled model leaves it out of its graph: liger reads a count on the host)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"fused head: hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} differ before the last dim")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    if scale is not None and scale != 1.0:
        hidden = hidden * scale
        bias = None if bias is None else bias * scale
    divisor = None
    if num_items is not None:
        divisor = torch.as_tensor(num_items, dtype=torch.float32, device=hidden.device)
    run = _liger_fused if backend == "liger" else _torch_fused
    return run(hidden, weight, bias, labels, ignore_index, softcap or None, float(label_smoothing), divisor)


def plain_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
    ignore_index: int = -100, softcap: Optional[float] = None, scale: Optional[float] = None,
    label_smoothing: float = 0.0, num_items: Union[int, torch.Tensor, None] = None,
) -> torch.Tensor:
    """What `fused_linear_cross_entropy` computes, through the whole logits (the reference the tests compare to)."""
    logits = F.linear(hidden, weight, bias)
    if scale is not None:
        logits = logits * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float().reshape(-1, logits.shape[-1])
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    return loss if num_items is None else loss / num_items


@dataclass
class HeadMeter:
    """What the profiled batch reads of the head (`automicro.batch.batch_profile`): the host ranges around its
    forward and backward (`HEAD_RANGE`: the device work they launch is the head's time) and the bytes its forward
    leaves held until its backward, per sample (the memory source's allocated bytes, before and after)."""

    allocated: Callable[[], int] = lambda: 0
    on: bool = False
    held_bytes: list[tuple[int, int]] = field(default_factory=list)  # (bytes held, samples) per microbatch

    def reset(self) -> None:
        self.held_bytes = []

    def per_sample(self) -> int:
        """The largest bytes per sample a microbatch's head held from its forward to its backward (0: none seen)."""
        return max((b // max(1, n) for b, n in self.held_bytes), default=0)


class _Range:
    """A profiler host range entered and left from two places (hooks): `torch.profiler.record_function`'s own."""

    def __init__(self, name: str) -> None:
        self._record = torch.profiler.record_function(name)
        self._open = False

    def enter(self) -> None:
        if not self._open:
            self._record.__enter__()
            self._open = True

    def leave(self) -> None:
        if self._open:
            self._open = False
            self._record.__exit__(None, None, None)


@dataclass
class _Open:
    forward: _Range
    backward: _Range
    before: int
    hidden: torch.Tensor
    samples: int


class FusedHeadLogitsError(RuntimeError):
    """A batch read the logits of a fused head, which never holds them."""


@dataclass
class HeadSwitch:
    """One run's head: plain or fused (`fused`), the fused path's backend, the meter. Shared by a model and its
    unsharded twin (`automicro.engine.twin`). `mode` is the key's value as resolved ("fused" pinned, "auto": the
    trials switch it, "plain": never fused); `family`: the model's, for the lines."""

    mode: str = "plain"
    fused: bool = False
    backend: str = "torch"
    backend_why: str = ""
    family: str = ""
    vocab: int = 0
    meter: HeadMeter = field(default_factory=HeadMeter)
    # The last fused microbatch's summed loss and loss tokens (detached): what a loss metric takes instead of logits.
    last: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    _open: Optional[_Open] = None

    @property
    def switchable(self) -> bool:
        return self.mode == "auto"

    def set_fused(self, on: bool) -> None:
        """The trials' switch (`automicro.engine.layout`): only a head under ``head: auto`` moves."""
        if self.mode == "auto":
            self.fused = bool(on)

    def describe(self) -> str:
        return f"fused ({self.backend})" if self.fused else "plain"

    def loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor],
             softcap: Optional[float], scale: Optional[float], num_items: Union[int, torch.Tensor, None] = None) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, labels, bias, softcap=softcap, scale=scale, num_items=num_items,
                                          backend=self.backend)

    # ---- the meter ---------------------------------------------------------------------------------

    def started(self, hidden: torch.Tensor) -> None:
        """The head's first operation is next (its input: the last hidden states, ``[B, S, H]``). Metered only: a
        host range opens and the allocated bytes are read."""
        if not self.meter.on or not torch.is_grad_enabled() or self._open is not None:
            return
        opened = _Open(_Range(HEAD_RANGE), _Range(HEAD_RANGE + "_backward"), self.meter.allocated(), hidden,
                       int(hidden.shape[0]) if hidden.dim() > 2 else 1)
        opened.forward.enter()
        self._open = opened

    def finished(self, loss: Any) -> None:
        """The head's loss is computed: its forward range closes, the bytes it holds are read; its backward range
        opens when the loss's gradient arrives and closes when the hidden states' does (the head's backward is the
        first work of the backward)."""
        opened, self._open = self._open, None
        if opened is None:
            return
        opened.forward.leave()
        self.meter.held_bytes.append((max(0, self.meter.allocated() - opened.before), opened.samples))
        hidden = opened.hidden
        if isinstance(loss, torch.Tensor) and loss.requires_grad and hidden.requires_grad:
            backward = opened.backward
            loss.register_hook(lambda grad: (backward.enter(), grad)[1])
            hidden.register_hook(lambda grad: (backward.leave(), grad)[1])


__all__ = [
    "FusedHeadLogitsError", "HEAD_MODES", "HEAD_RANGE", "HeadConfigError", "HeadMeter", "HeadSwitch", "choose_backend",
    "chunk_rows", "fused_linear_cross_entropy", "liger_available", "plain_linear_cross_entropy",
]
