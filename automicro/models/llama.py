"""A Llama-style decoder-only transformer in one file, plus its Composer wrapper.

The model is plain PyTorch: a dataclass config, a handful of small modules, no framework code.
``ComposerLlama`` adapts it to Composer's ``ComposerModel`` interface.

Architecture (pre-norm): token embedding -> ``n_layers`` x Block -> RMSNorm -> lm head, where each
Block is ``x + Attention(RMSNorm(x))`` followed by ``x + SwiGLU(RMSNorm(x))``. Attention uses
rotary position embeddings (RoPE), grouped-query attention (``n_kv_heads <= n_heads``) and
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.

Packed rows: ``forward(input_ids, position_ids)`` with ``position_ids`` that restart at each sample
(a new sample wherever a position is not the one before plus one, as transformers reads them)
rotates each token by its position within its sample and keeps attention to the sample's own
earlier tokens: on CUDA in bf16/fp16 with ``torch.nn.attention.varlen`` (torch >= 2.10) by flash
attention over the samples' boundaries (``cu_seqlens``: no token attends or computes across
samples), else by a block-diagonal causal mask for SDPA (correct anywhere; attention then costs a
row's tokens squared). ``ComposerLlama.packed_input`` says so to the token budget's ``packing: true``.

Initialization and the meta device
----------------------------------
The constructor always builds the modules on the meta device first (no memory, no RNG use) and
then, unless the target device *is* meta, materializes them with ``to_empty`` +
:meth:`Llama.init_weights`. The target device is whatever ``torch.empty`` would allocate on at
construction time, so ``with torch.device("cuda"): Llama(cfg)`` builds on the GPU.

Consequently a model built on CPU and a model built on meta, then ``to_empty(device=...)`` and
``init_weights()``, hold identical weights when the global RNG is seeded identically before each:
the initial values depend only on the RNG state at the time ``init_weights`` runs.

Owns: the model, its presets and the FSDP2 wrap marks (`_fsdp_wrap`). May not touch:
automicro's trainer, engine or callback: the model is plain PyTorch plus a Composer wrapper.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from composer.metrics import LanguageCrossEntropy, LanguagePerplexity
from composer.models import ComposerModel

log = logging.getLogger(__name__)

__all__ = [
    "PRESETS",
    "Attention",
    "Block",
    "ComposerLlama",
    "Llama",
    "LlamaConfig",
    "LlamaStage",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "apply_rotary",
    "build_model",
]


# Named model shapes. Every preset uses the default SwiGLU width rule (see LlamaConfig), which
# reproduces the published hidden sizes of the models each one imitates.
PRESETS: dict[str, dict[str, Any]] = {
    # Byte-level toy: trains in seconds on a CPU. ~0.1M parameters.
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=128, multiple_of=64),
    # GPT-3 "small" width/depth with Llama blocks: ~134M parameters (untied), ~85M non-embedding.
    "125m": dict(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, max_seq_len=2048),
    # TinyLlama-1.1B shape: ~1.10B parameters.
    "1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, max_seq_len=2048),
    # Llama-3.2-3B shape with a 32k vocabulary: ~3.02B parameters.
    "3b": dict(vocab_size=32000, d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, max_seq_len=2048),
    # Llama-2-7B shape: ~6.74B parameters.
    "7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, max_seq_len=2048),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class LlamaConfig:
    """Shape and hyperparameters of a :class:`Llama`.

    Args:
        vocab_size: number of token ids.
        d_model: residual stream width.
        n_layers: number of transformer blocks.
        n_heads: number of query heads; ``d_model`` must be divisible by it and the head
            dimension ``d_model // n_heads`` must be even (RoPE rotates pairs).
        n_kv_heads: number of key/value heads (grouped-query attention); ``None`` means
            ``n_heads`` (plain multi-head attention). ``n_heads`` must be divisible by it.
        ffn_hidden: SwiGLU hidden width; ``None`` means ``int(8 * d_model / 3)`` rounded up to a
            multiple of ``multiple_of`` (the Llama rule).
        multiple_of: rounding granularity for the default ``ffn_hidden``.
        max_seq_len: longest sequence the RoPE tables cover.
        rope_theta: RoPE base frequency.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the token embedding matrix with the lm head.
        init_std: standard deviation of the normal init of every Linear and Embedding weight.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    multiple_of: int = 256
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.ffn_hidden is None:
            hidden = int(8 * self.d_model / 3)
            self.ffn_hidden = self.multiple_of * math.ceil(hidden / self.multiple_of)
        if not _is_int(self.ffn_hidden) or self.ffn_hidden <= 0:
            raise ValueError(f"LlamaConfig.ffn_hidden must be a positive integer or None, got {self.ffn_hidden!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(
                f"LlamaConfig.d_model // n_heads (head dim {self.d_model // self.n_heads}) must be even for "
                "rotary embeddings; change d_model or n_heads"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "LlamaConfig":
        """The config of preset `name` (see ``PRESETS``) with `overrides` applied."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown LlamaConfig override(s) {unknown} for preset {name!r}; valid fields: {sorted(fields)}"
            )
        return cls(**{**PRESETS[name], **overrides})


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables ``cos``/``sin`` of shape [max_seq_len, head_dim // 2].

    Both are non-persistent buffers (not in the state dict): :meth:`reset_buffers` recomputes them,
    which is needed after ``to_empty`` leaves them uninitialized.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        device = self.cos.device
        if device.type == "meta":
            return
        exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]

    def at(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at `position_ids` [B, S], shaped [B, 1, S, head_dim // 2] (broadcast over heads)."""
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)


def _sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: a sample starts here (a row's first token, or a position that is not the
    previous one plus one)."""
    starts = torch.diff(position_ids, dim=-1) != 1
    return torch.cat([torch.ones_like(position_ids[:, :1], dtype=torch.bool), starts], dim=-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query t may attend key s <= t of its own sample."""
    sample = _sample_starts(position_ids).cumsum(-1)
    same = sample.unsqueeze(-1) == sample.unsqueeze(-2)
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


@dataclasses.dataclass(frozen=True)
class Samples:
    """Where the samples of packed rows start, for varlen flash attention over the rows' tokens
    flattened: ``cu_seqlens`` [N + 1] int32 (N samples), the longest sample."""

    cu_seqlens: torch.Tensor
    longest: int


def packed_samples(position_ids: torch.Tensor) -> Samples:
    """The samples of `position_ids` [B, S] (rows flattened; a row always starts a sample). Reads
    the longest sample on the host (one sync per forward, outside the blocks)."""
    starts = _sample_starts(position_ids).flatten().nonzero().flatten()
    total = position_ids.numel()
    cu = torch.cat([starts, starts.new_tensor([total])]).to(torch.int32)
    return Samples(cu, int((cu[1:] - cu[:-1]).max()) if total else 0)


def _uses_varlen(x: torch.Tensor) -> bool:
    """Packed rows of `x` (the embedded tokens) run varlen flash attention: CUDA, a bf16/fp16
    compute dtype (autocast's where it is on), torch >= 2.10."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return x.is_cuda and dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None


@functools.cache
def _varlen_attn() -> Any:
    """torch's varlen flash attention, or None (torch < 2.10); looked up once, not per layer."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, S, D] by position: the two halves of the last dim form the (real, imag) pairs."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos.float(), sin.float()
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query attention."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.d_model, config.n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(config.d_model, config.n_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(config.d_model, config.n_kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(config.n_heads * self.head_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Union[torch.Tensor, Samples, None] = None) -> torch.Tensor:
        """`mask`: None (causal), a [B, 1, S, S] bool mask, or `Samples` (varlen flash attention)."""
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            repeats = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        if isinstance(mask, Samples):
            # [B, H, S, D] -> [B * S, H, D]: the rows' tokens flattened, the samples cut by cu_seqlens.
            flat = [t.transpose(1, 2).reshape(batch * seq, self.n_heads, self.head_dim) for t in (q, k, v)]
            out = _varlen_attn()(*flat, mask.cu_seqlens, mask.cu_seqlens, mask.longest, mask.longest, window_size=(-1, 0))
            return self.o(out.reshape(batch, seq, self.n_heads * self.head_dim))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block; the unit of FSDP wrapping and activation checkpointing."""

    _fsdp_wrap = True  # Composer's convention: shard each block as its own FSDP unit.
    _activation_checkpointing = True  # Composer's convention: checkpoint each block when enabled.

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Union[torch.Tensor, Samples, None] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


def _normal_init_(param: torch.Tensor, std: float) -> None:
    """Fill `param` with N(0, std) in place; for a DTensor, as if it were one unsharded tensor.

    Random ops applied directly to a sharded DTensor do not reproduce the unsharded values (and on
    CPU meshes every shard draws the same numbers). So for a DTensor the full tensor is drawn on
    the parameter's device from the default RNG and distributed with ``distribute_tensor``, whose
    ``src_data_rank=0`` default takes the values from the first rank of each mesh dimension: all
    replicas agree even if the ranks' RNG states differ. Costs one full-size temporary per parameter.
    """
    mesh = getattr(param, "device_mesh", None)
    placements = getattr(param, "placements", None)
    if mesh is None or placements is None:
        nn.init.normal_(param, mean=0.0, std=std)
        return
    from torch.distributed.tensor import distribute_tensor

    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    nn.init.normal_(full, mean=0.0, std=std)
    param.copy_(distribute_tensor(full, mesh, placements))


class Llama(nn.Module):
    """Decoder-only Llama-style language model: ``forward(input_ids [B, S]) -> logits [B, S, V]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # Where the caller wants the model (honours `with torch.device(...)` and the default device).
        target = torch.empty(0).device
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
            self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        if target.type != "meta":
            self.to_empty(device=target)  # `_apply` below keeps the embedding tie
            self.init_weights()

    def _apply(self, fn: Any, recurse: bool = True) -> "Llama":
        # `to_empty`/`to` off the meta device give each module a new Parameter object, which would
        # silently untie lm_head from the embedding; restore the tie afterwards. (DTensor params are
        # swapped in place and stay tied, so this does not fire under FSDP2.)
        result = super()._apply(fn, recurse)
        if self.config.tie_embeddings and self.lm_head.weight is not self.tok_embeddings.weight:
            self.lm_head.weight = self.tok_embeddings.weight
        return result

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter and buffer in place, deterministically from the global RNG.

        Linear and Embedding weights ~ N(0, init_std), in module order (a tied weight once);
        RMSNorm weights = 1; RoPE tables recomputed (:meth:`init_buffers`). Use after
        ``to_empty(device=...)`` to materialize a model built on the meta device.

        Works on FSDP2-sharded (DTensor) parameters too, and gives them the same values as an
        unsharded model: see ``_normal_init_``. Under torch.distributed every rank must call it.
        """
        std = self.config.init_std
        seen: set[int] = set()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if id(module.weight) in seen:
                    continue
                seen.add(id(module.weight))
                _normal_init_(module.weight, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute the non-persistent RoPE tables on the device they live on."""
        self.rope.reset_buffers()

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`position_ids` [B, S]: packed rows (positions restarting at each sample; see the module docstring)."""
        return self.lm_head(self.hidden_states(input_ids, position_ids))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What the head reads: the final norm of the last block's output, ``[B, S, d_model]`` (a fused head
        computes the loss from it and ``lm_head``'s weight without the logits: `automicro.engine.head`)."""
        seq = input_ids.shape[1]
        mask = None
        if position_ids is None:
            if seq > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {seq} exceeds the model's max_seq_len {self.config.max_seq_len}"
                )
            cos, sin = self.rope(seq)
        else:
            if tuple(position_ids.shape) != tuple(input_ids.shape):
                raise ValueError(f"position_ids {tuple(position_ids.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
            if seq and int(position_ids.max()) >= self.config.max_seq_len:
                raise ValueError(
                    f"position {int(position_ids.max())} in position_ids: a sample longer than the model's max_seq_len "
                    f"{self.config.max_seq_len}"
                )
            cos, sin = self.rope.at(position_ids)
        x = self.tok_embeddings(input_ids)
        if position_ids is not None:
            mask = packed_samples(position_ids) if _uses_varlen(x) else document_mask(position_ids)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.norm(x)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied weight counts once).

        With ``exclude_embeddings=True`` the input token-embedding table is left out: it is a lookup,
        not a matmul. The lm head stays in, even when tied to the embedding, since it is a matmul.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.config.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * N + 12 * n_layers * d_model * seq_len``.

        ``N = num_params(exclude_embeddings=True)``. Each weight costs 2 FLOPs per token in the
        forward matmul and 4 in the backward (input and weight gradients): 6N. Attention scores and
        the weighted sum of values add ``2 * 2 * d_model * seq_len`` forward FLOPs per token per
        layer, times 3 for forward + backward: ``12 * n_layers * d_model * seq_len`` (the PaLM
        convention; no discount for the causal mask, no activation recomputation, norms and
        elementwise ops ignored).
        """
        cfg = self.config
        return 6 * self.num_params(exclude_embeddings=True) + 12 * cfg.n_layers * cfg.d_model * seq_len


class LlamaStage(nn.Module):
    """One pipeline stage of a :class:`Llama`: the embedding on the first stage, a contiguous run of
    blocks, the final norm and head on the last. Parameter names are the full model's
    (``blocks.<i>`` keeps the block's index), so a stage's state dict is a slice of the model's.

    ``forward(x)``: token ids ``[B, S]`` on the first stage, hidden states ``[B, S, D]`` on the
    others; returns hidden states, or logits ``[B, S, V]`` on the last stage.
    """

    def __init__(self, llama: "Llama", blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = llama.config
        self.first, self.last = first, last
        self.rope = llama.rope
        self.tok_embeddings = llama.tok_embeddings if first else None
        self.blocks = nn.ModuleDict({str(i): llama.blocks[i] for i in blocks})
        self.norm = llama.norm if last else None
        self.lm_head = llama.lm_head if last else None

    @property
    def block_names(self) -> list[str]:
        return [f"blocks.{i}" for i in self.blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(x.shape[1])
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x

    def pipeline_io(self, microbatch_size: int, seq_len: int, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Meta tensors of this stage's input and output for one microbatch (`dtype`: the compute dtype)."""
        cfg = self.config
        hidden = torch.empty(microbatch_size, seq_len, cfg.d_model, dtype=dtype, device="meta")
        tokens = torch.empty(microbatch_size, seq_len, dtype=torch.long, device="meta")
        logits = torch.empty(microbatch_size, seq_len, cfg.vocab_size, dtype=dtype, device="meta")
        return (tokens if self.first else hidden,), (logits if self.last else hidden,)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The values the full model's :meth:`Llama.init_weights` gives this stage's parameters
        under the same RNG state: every weight of the full model is drawn in order, this stage
        keeps its own (a stage built on the meta device, then sharded, matches a split of a model
        initialized whole)."""
        with torch.device("meta"):
            whole = Llama(self.config)
        own = dict(self.named_modules())
        device = next((p.device for p in self.parameters() if not p.is_meta), None)
        for name, module in whole.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name == "lm_head" and self.config.tie_embeddings:
                    continue
                mine = own.get(name)
                if mine is None:
                    # Another stage's weight: draw it anyway so the RNG advances as in the whole model.
                    torch.empty(module.weight.shape, device=device or "cpu").normal_(0.0, self.config.init_std)
                    continue
                _normal_init_(mine.weight, self.config.init_std)
                if getattr(mine, "bias", None) is not None:
                    mine.bias.zero_()
            elif isinstance(module, RMSNorm) and name in own:
                own[name].reset_parameters()
        self.rope.reset_buffers()


class ComposerLlama(ComposerModel):
    """Composer wrapper around :class:`Llama`.

    Batches are dicts ``{"input_ids": LongTensor[B, S], "labels": LongTensor[B, S]}`` with labels
    already shifted (``labels[:, t]`` is the token after ``input_ids[:, t]``); label -100 is ignored.
    """

    # Where the labels' loss tokens start (`automicro.batch.loss_normalization`): 0, already shifted.
    label_shift = 0
    # Packed rows (position_ids restarting at each sample) keep attention within each sample
    # (`automicro.batch.packed_input`).
    packed_input = True

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Llama(config)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        positions = batch.get("position_ids")
        return self.model(batch["input_ids"]) if positions is None else self.model(batch["input_ids"], positions)

    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """Mean next-token cross entropy over all tokens (computed in float32)."""
        labels = batch["labels"]
        return F.cross_entropy(outputs.float().reshape(-1, outputs.shape[-1]), labels.reshape(-1), ignore_index=-100)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        # Fresh instances each call (Composer deep-copies them); kept off the module tree so that
        # sharding, to_empty and state dicts never see them.
        return {"LanguageCrossEntropy": LanguageCrossEntropy(), "LanguagePerplexity": LanguagePerplexity()}

    def eval_forward(self, batch: dict[str, torch.Tensor], outputs: Optional[Any] = None) -> torch.Tensor:
        return outputs if outputs is not None else self.forward(batch)

    def update_metric(self, batch: dict[str, torch.Tensor], outputs: torch.Tensor, metric: Any) -> None:
        # Composer's metrics `.view` their inputs, so hand them contiguous tensors.
        metric.update(outputs.float().contiguous(), batch["labels"].contiguous())

    def flops_per_batch(self, batch: dict[str, torch.Tensor]) -> int:
        """Training FLOPs for `batch` (read by Composer's SpeedMonitor for MFU). A pipeline stage
        counts its share: its blocks' part of the whole model's FLOPs (the embedding and head
        are counted with the blocks by parameter count, as for the whole model)."""
        input_ids = batch["input_ids"]
        if isinstance(self.model, LlamaStage):
            whole = _whole_model_flops_per_token(self.config, input_ids.shape[1])
            return whole * len(self.model.blocks) // self.config.n_layers * input_ids.numel()
        return self.model.flops_per_token(input_ids.shape[1]) * input_ids.numel()

    # ---- pipeline parallelism (automicro.engine.pipeline) ----------------------------------

    def pipeline_blocks(self) -> int:
        """How many blocks the pipeline may split between its stages."""
        return self.config.n_layers

    def pipeline_stage(self, blocks: range, first: bool, last: bool) -> LlamaStage:
        """Keep only one pipeline stage (`blocks`, with the embedding if `first`, the head if
        `last`) and return it; the model's other modules are dropped."""
        if not isinstance(self.model, Llama):
            raise ValueError("ComposerLlama.pipeline_stage: the model is already a pipeline stage")
        if self.config.tie_embeddings:
            raise ValueError(
                "model.tie_embeddings=true with a pipeline: the embedding (first stage) and the head (last stage) "
                "cannot share a weight across stages; set tie_embeddings: false"
            )
        stage = LlamaStage(self.model, blocks, first=first, last=last)
        self.model = stage  # type: ignore[assignment]
        return stage

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return (batch["input_ids"],)


def _whole_model_flops_per_token(config: LlamaConfig, seq_len: int) -> int:
    with torch.device("meta"):
        return Llama(config).flops_per_token(seq_len)


def build_model(preset: Union[str, LlamaConfig], init_device: str = "cpu", **overrides: Any) -> ComposerLlama:
    """Build a :class:`ComposerLlama` from a preset name (or a ready config) and config overrides.

    ``init_device="meta"`` allocates nothing: the parameters and buffers stay on the meta device
    and the caller materializes them, e.g. the FSDP2 engine shards the model and then runs
    ``model.to_empty(device=...)`` + ``model.model.init_weights()`` on each rank's shards. Any other
    device (``"cpu"``, ``"cuda"``...) gets an initialized model there.
    """
    if isinstance(preset, LlamaConfig):
        if overrides:
            preset = dataclasses.replace(preset, **overrides)
        config = preset
        name = "custom"
    else:
        config = LlamaConfig.from_preset(preset, **overrides)
        name = preset
    try:
        device = torch.device(init_device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"init_device {init_device!r} is not a torch device ({error})") from None
    with torch.device(device):
        model = ComposerLlama(config)
    log.info(
        "automicro: built Llama %s on %s: %.2fM parameters (%.2fM excluding the embedding table)",
        name,
        device,
        model.model.num_params() / 1e6,
        model.model.num_params(exclude_embeddings=True) / 1e6,
    )
    return model
