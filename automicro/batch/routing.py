"""Routing, watched: where a routed (mixture-of-experts) model sends its tokens, so that a settled size that runs
out can say whether routing moved the memory.

A routed block sends each token to `top_k` of its experts. The bytes of its expert layers then depend on where the
router sends the tokens: the busiest expert's products are as large as the tokens it got, so a batch whose router
favours one expert holds larger temporaries (and, on a GPU, blocks of sizes the caching allocator has not seen) than
a batch of the same shape routed evenly. A size that settled can so run out in a later batch. `auto`'s rule for that
is the rule for any memory that moves (`automicro.core.policy`: an OOM at a size that ran clean reruns the batch at
that size; only a repeat shrinks it); what this module adds is the reason in the line.

How: each router of the model (a module with an ``experts`` child and a ``gate`` or ``router`` child, as Mixtral,
OLMoE, Qwen2/3-MoE and their kin in transformers 4.51-5.x) gets a forward hook that counts, per call (one layer, one
microbatch), the tokens each expert got and keeps the largest share one expert took (the busiest expert's share, 1/E
when the router spreads evenly over E experts, up to 1). The hook works on the router's output as transformers gives
it: the router logits (4.x: top-k taken as the block takes it) or the (logits, scores, indices) of a top-k router
(5.x). Its work is static in shape (a top-k, an index_add over E counts, a max) and stays on the device: the host
reads nothing on a clean batch; each attempt starts the per-layer maxima from zero, a clean attempt folds them into
the run's maximum (on the device), and only an OOM reads both, in one consensus round that every rank reaches there
(`Consensus.agree_max`, after the failure's verdict). The counts live in a non-persistent buffer of each router:
nothing enters the checkpoint, and a compiled block traces the hook and its buffer as it traces a norm's statistics.

The line, where the busiest share of the attempt that ran out passed the run's clean maximum by `MOVED` or more:
``routing moved the memory: the busiest expert took 94% of a layer's tokens (model.layers.1.mlp.gate), at most 31% in
the batches that ran``; otherwise nothing is said (the memory moved for another reason).

Owns: finding the routers, the hook, the shares and the line. May not touch: the policy (it only explains), Composer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

MOVED = 1.25  # the busiest share that ran out over the clean maximum that counts as routing having moved
_BUFFER = "_automicro_busiest"
_SCALE = 1000  # shares travel as per-mille ints (Consensus.agree_max)
_LAYERS = 1 << 16  # ... with the layer index below them


@dataclass(frozen=True)
class Router:
    """One routed block's router: its name, module, expert count and experts per token, and the block's experts
    (the module and its name)."""

    name: str
    module: nn.Module
    num_experts: int
    top_k: int
    experts: Optional[nn.Module] = None
    experts_name: str = ""


def _int_attr(*owners: Any, names: Sequence[str]) -> Optional[int]:
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def find_routers(model: nn.Module) -> list[Router]:
    """The routers of `model`'s routed blocks (a module with an ``experts`` child and a ``gate`` or ``router`` child
    whose expert count and top-k can be read off the block, its router or the model's config); [] for a dense one."""
    config = getattr(model, "config", None)
    found: list[Router] = []
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        router_name = next((n for n in ("gate", "router") if isinstance(getattr(block, n, None), nn.Module)), None)
        if not isinstance(experts, nn.Module) or router_name is None:
            continue
        router = getattr(block, router_name)
        num = _int_attr(block, router, experts, config, names=("num_experts", "num_local_experts"))
        if num is None and isinstance(experts, (nn.ModuleList, nn.Sequential)):
            num = len(experts)
        top_k = _int_attr(block, router, config, names=("top_k", "num_experts_per_tok"))
        if num is None or top_k is None or top_k > num:
            continue
        found.append(Router(f"{name}.{router_name}" if name else router_name, router, num, top_k, experts,
                            f"{name}.experts" if name else "experts"))
    return found


def grouped_experts(model: nn.Module) -> list[str]:
    """The names of `model`'s routed blocks' expert modules that hold their experts as weights of 3 or more
    dimensions (transformers 5's grouped experts: one ``[experts, in, out]`` tensor a projection, multiplied by
    ``grouped_mm``); [] for a dense model and for experts kept as a list of linear layers (transformers 4.x). Autocast
    casts no such weight (``grouped_mm`` is not one of its operators): under autocast these experts compute in the
    weights' own dtype, where FSDP2's mixed precision computes them on bf16 copies (`automicro.batch.one_rank`)."""
    return [r.experts_name for r in find_routers(model)
            if r.experts is not None and any(p.dim() >= 3 for p in r.experts.parameters())]


def router_buffer(router: Router, name: str, device: Optional[torch.device] = None) -> torch.Tensor:
    """`router`'s one-element non-persistent buffer `name` (made at zero where it has none: nothing enters the
    checkpoint), on `device`, the device the model computes on (None: the router's parameters'; they may be the host's
    under the host offload while the GPU computes)."""
    if name not in dict(router.module.named_buffers(recurse=False)):
        where = device or next((p.device for p in router.module.parameters()), torch.device("cpu"))
        router.module.register_buffer(name, torch.zeros(1, device=where), persistent=False)
    return getattr(router.module, name)


def _indices(output: Any, top_k: int, num_experts: int) -> Optional[torch.Tensor]:
    """The experts each token was sent to, from a router's output: an integer tensor of the output tuple, or the top-k
    of its logits (the last dimension the expert count)."""
    parts = output if isinstance(output, (tuple, list)) else (output,)
    for part in parts:
        if isinstance(part, torch.Tensor) and not part.is_floating_point() and part.dim() >= 1 and part.size(-1) == top_k:
            return part
    for part in parts:
        if isinstance(part, torch.Tensor) and part.is_floating_point() and part.dim() >= 1 and part.size(-1) == num_experts:
            return torch.topk(part.detach(), top_k, dim=-1).indices
    return None


def _hook(router: Router) -> Callable[..., None]:
    def count(module: nn.Module, args: Any, output: Any) -> None:
        with torch.no_grad():
            indices = _indices(output, router.top_k, router.num_experts)
            if indices is None:
                return
            flat = indices.reshape(-1)
            counts = torch.zeros(router.num_experts, dtype=torch.float32, device=flat.device)
            counts.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))
            # Each token is counted top_k times: its share of a layer's tokens is count / (routed / top_k).
            share = counts.max() * router.top_k / counts.sum().clamp(min=1.0)
            busiest = getattr(module, _BUFFER)
            busiest.copy_(torch.maximum(busiest, share.reshape(1)))

    return count


class RoutingWatch:
    """The routers' busiest shares, per attempt and over the clean ones (see the module's docstring)."""

    def __init__(self, routers: list[Router], device: Optional[torch.device] = None) -> None:
        """`device`: where the counts live, the device the model computes on (the router's parameters may be the
        host's: the host offload, switched on before a launch's first batch where the training state does not fit;
        measured on one H100, OLMoE's blocks); None: the router's parameters' device."""
        self.routers = routers
        self._handles: list[Any] = []
        self._clean: Optional[torch.Tensor] = None
        for router in routers:
            router_buffer(router, _BUFFER, device)
            self._handles.append(router.module.register_forward_hook(_hook(router)))

    @classmethod
    def of(cls, model: nn.Module, device: Optional[torch.device] = None) -> Optional["RoutingWatch"]:
        """A watch on `model`'s routers (its counts on `device`), or None where it has none (a dense model: nothing
        installed)."""
        routers = find_routers(model)
        return cls(routers, device) if routers else None

    def _shares(self) -> torch.Tensor:
        return torch.cat([getattr(r.module, _BUFFER).reshape(1) for r in self.routers])

    def begin_attempt(self) -> None:
        """Each layer's maximum starts from zero (device work only)."""
        for router in self.routers:
            getattr(router.module, _BUFFER).zero_()

    def after_clean(self) -> None:
        """A clean attempt's shares fold into the run's clean maximum (device work only)."""
        shares = self._shares()
        self._clean = shares.clone() if self._clean is None else torch.maximum(self._clean, shares)

    def moved(self, agree_max: Callable[[Sequence[int]], tuple[int, ...]]) -> Optional[str]:
        """After an OOM, on every rank (one `agree_max` round): the line where routing moved the memory, else None."""
        shares = self._shares().float().cpu()
        clean = self._clean.float().cpu() if self._clean is not None else torch.zeros_like(shares)
        layer = int(shares.argmax())
        # The busiest share and its layer in one int (the layer the rank with the largest share names).
        local = (int(round(float(shares.max()) * _SCALE)) * _LAYERS + layer, int(round(float(clean.max()) * _SCALE)))
        both, before = agree_max(local)
        now, layer = divmod(both, _LAYERS)
        if before <= 0 or now < MOVED * before:
            return None
        return (f"routing moved the memory: the busiest expert took {now / 10:.0f}% of a layer's tokens "
                f"({self.routers[layer].name}), at most {before / 10:.0f}% in the batches that ran")

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


__all__ = ["MOVED", "Router", "RoutingWatch", "find_routers", "grouped_experts", "router_buffer"]
