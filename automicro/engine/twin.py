"""`UnshardedTwin`: the model unsharded beside its FSDP2 form on a mesh of one, sharing every byte.

On one rank FSDP2 shards nothing: each parameter's local tensor is the whole parameter. The twin is
a copy of the model's modules made before `fully_shard` (its parameters and buffers left out of the
copy: placeholders), whose parameters are then plain `nn.Parameter`s over the FSDP2 parameters' local
tensors and whose buffers are the model's own. A forward and backward through the twin trains the
same storage without FSDP2's hooks, casts and copies; `move_grads` hands its gradients to the FSDP2
parameters (a DTensor over the same tensor, no copy), so the optimizer, its state, the checkpoints
and evaluation stay on the FSDP2 model and never see the twin. Switching between the two is a
pointer swap for the batch (`automicro.batch.sharding_choice` measures which is faster).

Where the two give the same numbers: in fp32 (``mixed_precision: FULL``), the same to the summation
order of the gradients; with ``mixed_precision: DEFAULT`` and Composer's ``amp_bf16`` the twin computes
under autocast as the unsharded model does (`automicro.batch.one_rank`'s pin), not on bf16 copies of
the parameters: the same bf16 compute, not the same rounding.

Compiled, the twin compiles each of FSDP2's blocks, as FSDP2's own are (`compile`), and can compile its
whole forward instead for the compile scope trial (`compile_model`, `back_to_blocks`).

Owns: the copy, the binding of its parameters to the FSDP2 storage, the gradient hand-over and the
twin's compile. May not touch: the FSDP2 modules' state, the optimizer, Composer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


class TwinError(ValueError):
    """The model cannot have an unsharded twin (the message says why)."""


def _named_slots(module: nn.Module, kind: str) -> list[tuple[str, nn.Module, str, Any]]:
    """(fqn, owner, name, tensor) for every parameter (`kind` "_parameters") or buffer ("_buffers")
    of `module`, tied ones under each of their names."""
    out = []
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, tensor in getattr(owner, kind).items():
            if tensor is not None:
                out.append((f"{prefix}.{name}" if prefix else name, owner, name, tensor))
    return out


@dataclass
class UnshardedTwin:
    """The twin of one model. `module` is what a batch calls in the model's place."""

    module: nn.Module
    compile_kwargs: Optional[dict[str, Any]] = None
    # (name, FSDP2 parameter, twin parameter), one per distinct parameter once bound.
    pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    compiled: bool = False
    # The names of the modules FSDP2 shards into blocks (set at bind): where `compile` compiles each of them.
    blocks: tuple[str, ...] = ()
    scope: str = "blocks"  # how the twin is compiled: "blocks" (each) or "model" (the whole forward)
    _eager: list[tuple[nn.Module, Any]] = field(default_factory=list)  # each block and its eager forward
    _block_forwards: list[Any] = field(default_factory=list)  # each block's compiled forward, made once
    # Made at `bind` so that `rebind`, before every batch through the twin, walks no module tree: each
    # pair's (model module, parameter name), and (model module, twin module) of each name.
    _slots: list[tuple[nn.Module, str]] = field(default_factory=list)
    _modes: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)

    @classmethod
    def before_sharding(cls, model: nn.Module, compile_kwargs: Optional[dict[str, Any]] = None,
                        scope: str = "blocks") -> "UnshardedTwin":
        """Copy `model`'s modules before `fully_shard` changes them, its parameters and buffers left
        out (each a placeholder on the meta device until `bind`). `scope`: "model" where the user compiles
        the whole model (Composer's ``compile_config``), else each block is compiled."""
        memo: dict[int, Any] = {}
        for _, _, _, param in _named_slots(model, "_parameters"):
            memo.setdefault(id(param), nn.Parameter(torch.empty(0, device="meta"), requires_grad=param.requires_grad))
        for _, _, _, buffer in _named_slots(model, "_buffers"):
            memo.setdefault(id(buffer), torch.empty(0, device="meta"))
        try:
            module = copy.deepcopy(model, memo)
        except Exception as error:  # a model that holds what cannot be copied (a process group, a file)
            raise TwinError(f"the model's modules cannot be copied ({type(error).__name__}: {error})") from error
        return cls(module, dict(compile_kwargs) if compile_kwargs is not None else None, scope=scope)

    def bind(self, model: nn.Module) -> None:
        """Point the twin's parameters at `model`'s FSDP2 parameters' local tensors and share its
        buffers (after `fully_shard` and placement, and again whenever FSDP2 replaced a local tensor:
        `rebind`). `model` must be resharded (its parameters DTensors)."""
        sharded = {fqn: tensor for fqn, _, _, tensor in _named_slots(model, "_parameters")}
        buffers = {fqn: tensor for fqn, _, _, tensor in _named_slots(model, "_buffers")}
        owners = {fqn: (owner, name) for fqn, owner, name, _ in _named_slots(model, "_parameters")}
        made: dict[int, nn.Parameter] = {}
        pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        for fqn, owner, name, _ in _named_slots(self.module, "_parameters"):
            param = sharded.get(fqn)
            if param is None:
                raise TwinError(f"the sharded model has no parameter {fqn!r}")
            if id(param) not in made:
                local = _whole_local(fqn, param)
                twin = nn.Parameter(local, requires_grad=param.requires_grad)
                made[id(param)] = twin
                pairs.append((fqn, param, twin))
            owner._parameters[name] = made[id(param)]
        for fqn, owner, name, _ in _named_slots(self.module, "_buffers"):
            if fqn not in buffers:
                raise TwinError(f"the sharded model has no buffer {fqn!r}")
            owner._buffers[name] = buffers[fqn]
        self.pairs = pairs
        self._slots = [owners[fqn] for fqn, _, _ in pairs]
        mirrors = dict(self.module.named_modules())
        self._modes = [(source, mirrors[name]) for name, source in model.named_modules() if name in mirrors]

    def rebind(self, model: nn.Module) -> None:
        """Before a batch through the twin: each of its modules in the mode (train or eval) of the
        model's module of that name (a model built in eval mode, as `from_pretrained` returns one, is put
        in train mode by the trainer after the copy); bound again where the model's parameter or its
        local tensor is no longer the one bound (a checkpoint load with ``assign``, a move that replaced
        FSDP2's storage)."""
        for source, mirror in self._modes:
            if mirror.training != source.training:
                mirror.training = source.training
        with torch.no_grad():
            for (owner, name), (_, param, twin) in zip(self._slots, self.pairs):
                now = owner._parameters.get(name)
                if isinstance(now, DTensor) and now is not param:  # (an unsharded FSDP2 module shows plain tensors)
                    break
                local = param.to_local() if isinstance(param, DTensor) else param
                if local.data_ptr() != twin.data_ptr() or local.shape != twin.shape:
                    break
            else:
                return
        self.bind(model)

    def compile(self) -> bool:
        """Compile the twin (once; True where it was compiled now): each of its `blocks` (the modules FSDP2
        shards into blocks, by name: what FSDP2's own compiled blocks are; a whole-model compile of the same 1B
        model took 60-70 s where each block took a few) where there are blocks and the user did not ask for the
        whole model (`scope` "model"), else the whole forward."""
        if self.compile_kwargs is None or self.compiled:
            return False
        if self.blocks and self.scope != "model":
            self._compile_blocks()
        else:
            self.module.compile(**self.compile_kwargs)
            self.scope = "model"
        self.compiled = True
        return True

    def _compile_blocks(self) -> None:
        assert self.compile_kwargs is not None
        named = dict(self.module.named_modules())
        if not self._block_forwards:
            self._eager = [(named[name], named[name].forward) for name in self.blocks]
            self._block_forwards = [torch.compile(forward, **self.compile_kwargs) for _, forward in self._eager]
        for (block, _), compiled in zip(self._eager, self._block_forwards):
            block.forward = compiled
        self.scope = "blocks"

    def compile_model(self) -> None:
        """The compile scope trial on the twin: its whole forward compiled, every block eager again (their graphs
        kept for `back_to_blocks`, which then compiles nothing). Unsharded, nothing breaks the graph between the
        blocks: dynamo traces the whole model into one graph (60-70 s for a 1B model on one H200 where a block
        took a few; `automicro.batch.compile_scope` weighs that before it runs). A call the outer compile does not
        trace (`torch.compiler.disable`) runs its nested compiled blocks eager on torch 2.7-2.15 (checked): no way
        to keep the blocks' graphs inside."""
        assert self.compile_kwargs is not None and self.blocks
        for block, eager in self._eager:
            block.forward = eager
        self.module.compile(**self.compile_kwargs)
        self.scope = "model"

    def back_to_blocks(self) -> None:
        """Each block compiled again as before `compile_model` (the same compiled functions and their graphs)."""
        self.module._compiled_call_impl = None
        self._compile_blocks()

    def move_grads(self) -> None:
        """After the twin's last backward of a batch: its gradients become the FSDP2 parameters'
        (a DTensor over the same tensor), added to any they hold."""
        for _, param, twin in self.pairs:
            grad, twin.grad = twin.grad, None
            if grad is None:
                continue
            if isinstance(param, DTensor):
                grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                          shape=param.shape, stride=param.stride())
            param.grad = grad if param.grad is None else param.grad + grad

    def drop_grads(self) -> None:
        """After a failed attempt: nothing the twin accumulated reaches the model."""
        for _, _, twin in self.pairs:
            twin.grad = None


def _whole_local(fqn: str, param: Any) -> torch.Tensor:
    """`param`'s local tensor, which must be the whole parameter (a mesh of one)."""
    if not isinstance(param, DTensor):
        raise TwinError(f"parameter {fqn!r} is not sharded by FSDP2 (the model must be resharded when bound)")
    if param.device_mesh.size() != 1:
        raise TwinError(f"parameter {fqn!r} lives on a mesh of {param.device_mesh.size()} ranks; the twin needs one")
    with torch.no_grad():
        local = param.to_local()
    if local.shape != param.shape:
        raise TwinError(f"parameter {fqn!r}'s local tensor {tuple(local.shape)} is not the whole {tuple(param.shape)}")
    return local


__all__ = ["TwinError", "UnshardedTwin"]
