"""Sync hooks: consensus points in front of every FSDP2 collective while searching.

Installed on every FSDP2 module of a `ShardedModel`:
- forward-pre hook, prepended so it runs before FSDP2's own pre-forward (the all-gather);
- full-backward-pre hook, prepended, before FSDP2's pre-backward unshard;
- full-backward hook (post-backward of the module), before the next block's work;
- on the root, whose output may be a `ModelOutput` or a dict (which torch's full-backward hooks
  skip), both backward sites come from a gradient hook on its output tensors instead;
- a pre-collective hook inside FSDP2's collectives module, between buffer allocation and the
  all-gather / reduce-scatter / all-reduce call, so an OOM while allocating those buffers on
  one rank can never leave another rank inside the collective (the FSDP1 "pre-realloc" fix,
  generalised to FSDP2's prefetched and async collectives).
`remove()` takes every handle off and restores torch's own collective code paths.

Every site first calls the dispatcher (fault injectors listen there), then the consensus.

Owns: installing and removing the site hooks and the sync listener. May not touch: the
consensus protocol (it only calls `sync()`), FSDP2 internals outside `_torch_internals`, Composer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.nn as nn

from automicro.core.consensus import Consensus
from automicro.core.sites import PRIORITY_SYNC, SiteDispatcher
from automicro.engine import _torch_internals as internals
from automicro.engine.sharding import ShardedModel

SYNC_POINTS = ("all", "collectives")
SYNC_SITES = frozenset({"forward_pre", "backward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc", "all_reduce_alloc"})


class SiteHooks:
    """Module and collective hooks that call `fire(site, module_name)` at every site of a model.

    Used twice: by `SyncHooks` (firing the dispatcher, whose sync listener runs the consensus)
    and by the fault injector (which must fire even while the sync hooks are off).
    """

    def __init__(self, sharded: ShardedModel, fire: Callable[[str, str], None], module_sites: bool = True) -> None:
        self.sharded = sharded
        self.fire = fire
        self.module_sites = module_sites
        self._handles: list[Any] = []

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        if self._handles:
            return
        fire = self.fire
        for name, module in self.sharded.named_fsdp_modules if self.module_sites else []:
            self._handles.append(module.register_forward_pre_hook(_fire_hook(fire, "forward_pre", name), prepend=True))
            if module is self.sharded.module:
                # The root's output need not be a tensor (a Hugging Face `ModelOutput`, a dict),
                # and torch's full-backward hooks never fire for such outputs: its backward sites
                # come from its output tensors instead.
                # Prepended: its gradient hook is then registered before FSDP2's pre-backward one
                # on the same tensors, and runs first, as the full-backward-pre hooks do.
                self._handles.append(module.register_forward_hook(self._root_forward_hook(name), prepend=True))
                continue
            self._handles.append(module.register_forward_hook(_fire_hook(fire, "forward", name)))
            self._handles.append(
                module.register_full_backward_pre_hook(_fire_hook(fire, "backward_pre", name), prepend=True)
            )
            self._handles.append(module.register_full_backward_hook(_fire_hook(fire, "backward", name)))
        fqn_to_module = self.sharded.param_fqn_to_module()

        def owner(fsdp_params: list[Any]) -> str:
            # FSDP2 names its parameters at its lazy init (the first forward): hooks installed
            # before that hold an empty map. A name not in it refreshes the map once; a name the
            # refresh does not know either is remembered as unowned, so no collective pays twice.
            fqns = [getattr(p, "_param_fqn", "") for p in fsdp_params]
            if any(f and f not in fqn_to_module for f in fqns):
                fqn_to_module.update(self.sharded.param_fqn_to_module())
                fqn_to_module.update({f: "" for f in fqns if f and f not in fqn_to_module})
            return next((fqn_to_module[f] for f in fqns if fqn_to_module.get(f)), "")

        self._handles.append(internals.add_pre_collective_hook(lambda site, params: fire(site, owner(params))))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _root_forward_hook(self, name: str) -> Callable[..., None]:
        """Fire `forward`, then arm `backward_pre` and `backward` on the output's tensors.

        Both backward sites fire when the first gradient reaches the root's output: what torch's
        own full-backward hooks do for a root whose inputs need no gradient (token ids), and the
        only point a root whose output is a `ModelOutput` or a dict has at all.
        """
        fire = self.fire

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            fire("forward", name)
            tensors = [t for t in output_tensors(output) if t.requires_grad]
            if not tensors:
                return  # eval / no_grad: no backward follows

            def on_grad(_: Any) -> None:
                if self._handles:  # still installed when backward reaches the root
                    fire("backward_pre", name)
                    fire("backward", name)

            torch.autograd.graph.register_multi_grad_hook(tensors, on_grad, mode="any")

        hook.__name__ = "automicro_root_forward_hook"
        return hook


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a module's output: tensors, tuples/lists, mappings (a Hugging Face
    `ModelOutput` is an ordered dict) and dataclasses, in order, each once."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen:
                seen.add(id(item))
                found.append(item)
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(reversed([getattr(item, f.name) for f in dataclasses.fields(item)]))
    return found


def _fire_hook(fire: Callable[[str, str], None], site: str, name: str) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        fire(site, name)

    hook.__name__ = f"automicro_{site}_hook"
    return hook


class SyncHooks:
    """The consensus points of the deadlock-freedom invariant, switchable on and off."""

    def __init__(
        self,
        sharded: ShardedModel,
        consensus: Consensus,
        dispatcher: SiteDispatcher,
        sync_points: str = "all",
    ) -> None:
        if sync_points not in SYNC_POINTS:
            raise ValueError(f"sync_points={sync_points!r}: must be one of {list(SYNC_POINTS)}")
        self.consensus = consensus
        self.dispatcher = dispatcher
        # "collectives" keeps only the consensus points in front of FSDP2's collectives: enough
        # for deadlock freedom (the invariant), fewer rounds while searching; a rank then notices
        # another's failure at the next collective instead of the next module boundary.
        self._site_hooks = SiteHooks(sharded, dispatcher.fire, module_sites=sync_points == "all")
        self._remove_listener: Optional[Callable[[], None]] = None

    @property
    def active(self) -> bool:
        return self._remove_listener is not None

    def _listener(self, site: str, module: str, context: Any) -> None:
        if site in SYNC_SITES and context.in_attempt:
            self.consensus.sync()

    def set_active(self, active: bool) -> bool:
        """Turn the hooks on or off; returns True if that changed anything."""
        if active == self.active:
            return False
        if active:
            self._site_hooks.install()
            self._remove_listener = self.dispatcher.add(self._listener, PRIORITY_SYNC, sites=SYNC_SITES)
        else:
            self._site_hooks.remove()
            assert self._remove_listener is not None
            self._remove_listener()
            self._remove_listener = None
        return True


def count_module_hooks(model: nn.Module, marker: str = "automicro_") -> int:
    """How many automicro hooks are registered on the model's modules (for tests and logs)."""
    total = 0
    for module in model.modules():
        for hooks in (
            module._forward_pre_hooks,
            module._forward_hooks,
            module._backward_pre_hooks,
            module._backward_hooks,
        ):
            total += sum(1 for h in hooks.values() if getattr(h, "__name__", "").startswith(marker))
    return total
