"""`shard()`: apply torch's `fully_shard` to a model the way `FSDP2Config` says.

One function applies one parallelism (torchtitan's layout): wrap policy, tied-weight
legalization, activation checkpointing, mixed precision, HSDP mesh, CPU offload, explicit
prefetch chains and async unshard. The returned `ShardedModel` knows the FSDP2 modules in forward
order and can `recover()` them after a failed attempt.

Owns: the FSDP2 layout and `ShardedModel` (recover, figures). May not touch: the consensus,
Composer, private torch outside `_torch_internals`.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from automicro.engine import _torch_internals as internals
from automicro.engine.compile import CompileConfig, CompiledBlocks, compile_blocks
from automicro.engine.config import FSDP2Config, FSDP2ConfigError
from automicro.engine.recompute import BlockDial

log = logging.getLogger(__name__)

AVOID_RECORD_STREAMS_ENV = "TORCH_NCCL_AVOID_RECORD_STREAMS"


@functools.cache
def _warn_record_stream_once() -> None:
    log.warning(
        "automicro: the process group was created without %s=1, so torch %s's c10d calls "
        "record_stream on async collectives (extra memory held until the next sync). "
        "Export %s=1 before launching, or create the Trainer before any process group.",
        AVOID_RECORD_STREAMS_ENV,
        torch.__version__,
        AVOID_RECORD_STREAMS_ENV,
    )


def ensure_record_stream_free() -> bool:
    """Make c10d avoid `record_stream` on async collectives; call before any process group.

    torch >= 2.8 does this by default. On torch 2.7 the variable must be set before the NCCL
    process group exists (it is read when the group is created). Returns True when the setting
    is (or will be) in effect; warns once with the fix when a group already exists without it.
    """
    if not internals.NEEDS_AVOID_RECORD_STREAMS_ENV:
        return True
    if os.environ.get(AVOID_RECORD_STREAMS_ENV) == "1":
        return True
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() != "nccl":
            return True  # record_stream is an NCCL (CUDA caching allocator) matter only
        _warn_record_stream_once()
        return False
    os.environ[AVOID_RECORD_STREAMS_ENV] = "1"
    return True


ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def set_unshard_async(module: FSDPModule, async_op: bool = True) -> None:
    """Make `module`'s all-gathers async ops (FSDP2's `_set_unshard_async_op`, private on
    torch 2.7 and 2.11): the copy-in runs on the compute stream and the all-gather output is
    allocated from its pool. For plain `fully_shard` models; `shard()` sets it from
    `FSDP2Config.unshard_async_op` itself."""
    internals.set_unshard_async_op(module, async_op)


def apply_expandable_segments(choice: Optional[bool], device: torch.device) -> bool:
    """Carry out `FSDP2Config.expandable_segments`; True when the engine turned them on."""
    if device.type != "cuda" or choice is False:
        return False
    user = ",".join(os.environ.get(k, "") for k in ALLOC_CONF_ENVS).replace(" ", "").lower()
    if choice is None and "expandable_segments" in user:
        return False  # the user's explicit allocator setting wins
    if "expandable_segments:false" in user:
        log.warning(
            "automicro: parallelism_config.fsdp2.expandable_segments=true overrides "
            "expandable_segments:False in the allocator environment variable"
        )
    internals.set_expandable_segments()
    log.info(
        "automicro: turned on the CUDA allocator's expandable segments (process-wide; "
        "parallelism_config.fsdp2.expandable_segments: false leaves the allocator alone)"
    )
    return True


def _mixed_precision_policy(name: str) -> MixedPrecisionPolicy:
    if name == "FULL":
        return MixedPrecisionPolicy()
    if name == "DEFAULT":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if name == "PURE":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    raise FSDP2ConfigError(f"parallelism_config.fsdp2.mixed_precision={name!r}: unknown")


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_mesh(config: FSDP2Config, device: torch.device) -> DeviceMesh:
    world = dist.get_world_size()
    if world % config.replicate != 0:
        raise FSDP2ConfigError(
            f"parallelism_config.fsdp2.replicate={config.replicate}: must divide the world size {world}"
        )
    if config.replicate == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device.type, (config.replicate, world // config.replicate), mesh_dim_names=("replicate", "shard")
    )


def _wants_wrap(name: str, module: nn.Module, root: nn.Module, class_names: Optional[set[str]]) -> bool:
    if module is root:
        return False
    if class_names is not None:
        return type(module).__name__ in class_names
    if getattr(module, "_fsdp_wrap", False):
        return True
    for owner in (root, getattr(root, "model", None)):
        wrap_fn = getattr(owner, "fsdp_wrap_fn", None)
        if callable(wrap_fn):
            decision = wrap_fn(module)
            if decision:
                return True
    return False


def no_split_classes(root: nn.Module) -> set[str]:
    """The block classes Hugging Face models name in `_no_split_modules` (the convention that
    accelerate's device maps and torch FSDP's transformer auto-wrap policy use), gathered from
    every submodule that declares them (a Composer `HuggingFaceModel` holds the model as `.model`)."""
    names: set[str] = set()
    for module in root.modules():
        declared = getattr(module, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set, frozenset)):
            names.update(n for n in declared if isinstance(n, str))
    return names


def _repeated_classes(root: nn.Module) -> list[str]:
    """Classes of composite modules with parameters that occur more than once below the root,
    outermost first: the likely blocks (their leaf layers, `Linear` and so on, are not named)."""
    counts: dict[str, int] = {}
    depth: dict[str, int] = {}
    for name, module in root.named_modules():
        if module is root or not list(module.children()) or not any(True for _ in module.parameters()):
            continue
        cls = type(module).__name__
        counts[cls] = counts.get(cls, 0) + 1
        depth[cls] = min(depth.get(cls, 1 << 30), name.count("."))
    repeated = sorted((c for c, n in counts.items() if n > 1), key=lambda c: (depth[c], -counts[c]))
    return [f"{c} (x{counts[c]})" for c in repeated[:3]]


def _param_owners(root: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> names of every module that holds it directly (ties show as >1)."""
    owners: dict[int, list[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), [])
            if name not in owners[id(param)]:
                owners[id(param)].append(name)
    return owners


def plan_wrapping(root: nn.Module, config: FSDP2Config) -> tuple[list[str], list[str]]:
    """Names of the modules to wrap (children before parents), and notes on tied weights.

    A candidate whose parameters are also used outside its subtree cannot be its own FSDP unit
    (the tied parameter would be sharded twice); it is left to the nearest wrapped ancestor,
    which is the common parent of the tie. If the user named both sides of a tie explicitly in
    `wrap`, that request cannot be honoured and is refused.
    """
    class_names = set(config.wrap) if config.wrap is not None else None
    named = dict(root.named_modules())
    every_name = dict(root.named_modules(remove_duplicate=False))
    candidates = [n for n, m in named.items() if _wants_wrap(n, m, root, class_names)]
    if not candidates and class_names is None:
        # No Composer marks: a Hugging Face model names its blocks in `_no_split_modules`.
        hf_blocks = no_split_classes(root)
        candidates = [n for n, m in named.items() if m is not root and type(m).__name__ in hf_blocks]
    if class_names:
        present = {type(m).__name__ for m in named.values() if m is not root}
        missing = sorted(class_names - present)
        if missing and len(missing) == len(class_names):
            repeated = _repeated_classes(root)
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2.wrap={sorted(class_names)}: no module of the model is of "
                f"these classes, so only the root would be sharded. Name the block class"
                + (f" (repeated classes here: {', '.join(repeated)})" if repeated else "")
                + ", or use wrap: [] for the root alone"
            )
        if missing:
            log.warning("automicro: parallelism_config.fsdp2.wrap: no module is of class %s", missing)
    owners = _param_owners(root)
    notes: list[str] = []
    chosen: list[str] = []
    for name in candidates:
        outside: set[str] = set()
        for param in named[name].parameters():
            outside.update(o for o in owners[id(param)] if not (o == name or o.startswith(name + ".")))
        if not outside:
            chosen.append(name)
            continue
        if class_names is not None and any(
            o in every_name and type(every_name[o]).__name__ in class_names for o in outside
        ):
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2.wrap: module '{name}' shares parameters with "
                f"{sorted(outside)}, and both are listed for wrapping; a tied parameter must live in "
                "one FSDP unit. Remove one of the classes from `wrap` so the tie is wrapped at their "
                "common parent."
            )
        notes.append(
            f"'{name}' shares parameters with {sorted(outside)}: wrapped with their common parent instead"
        )
    # fully_shard must see children before parents.
    chosen.sort(key=lambda n: -n.count("."))
    return chosen, notes


@dataclass
class ShardedModel:
    """A model after `shard()`: the same module object, plus what the engine knows about it."""

    module: nn.Module
    config: FSDP2Config
    mesh: DeviceMesh
    device: torch.device
    wrapped_names: list[str]
    tie_notes: list[str] = field(default_factory=list)
    _forward_order: list[str] = field(default_factory=list)
    _order_hooks: list[Any] = field(default_factory=list)
    _prefetch_plan: list[str] = field(default_factory=list)
    # internals.ComputeStreamAllGather / ComputeStreamReduceScatter when compute_stream_buffers
    _all_gather_comm: Any = None
    _reduce_scatter_comm: Any = None
    _comm_hook: Any = None
    expandable_segments_set_by_engine: bool = False
    # The blocks compiled in place (`compile: {scope: blocks}`), None without: `automicro.
    # batch.compile_shapes` compiles them again with static shapes once the size settles.
    compiled: Optional[CompiledBlocks] = None
    # On a mesh of one: the model unsharded over the same storage (`automicro.engine.twin`), where the
    # trainer built one for `automicro.batch.sharding_choice` to time; None otherwise.
    twin: Optional[Any] = None
    # The vocabulary head's switch (`automicro.engine.head.HeadSwitch`), where the model's head can be fused and the
    # run asked for it (`automicro.batch.head_choice`); None: the model's own head, untouched.
    head: Optional[Any] = None
    # The blocks' recompute dial (`automicro.engine.recompute.BlockDial`), where they carry checkpointing (the
    # config's rung, or ``checkpoint_switch``); None otherwise.
    recompute: Optional[Any] = None

    @property
    def compute_stream_buffers(self) -> bool:
        """Whether FSDP2's all-gather and reduce-scatter buffers come from the compute stream's pool."""
        return self._reduce_scatter_comm is not None

    @property
    def named_fsdp_modules(self) -> list[tuple[str, FSDPModule]]:
        """(name, module) of every FSDP2 module, in forward order once recorded (root first)."""
        named = dict(self.module.named_modules())
        order = self._forward_order or self.wrapped_names_in_registration_order()
        rows = [("", self.module)] + [(n, named[n]) for n in order]
        return [(n, m) for n, m in rows if isinstance(m, FSDPModule)]

    @property
    def fsdp_modules(self) -> list[FSDPModule]:
        return [m for _, m in self.named_fsdp_modules]

    def wrapped_names_in_registration_order(self) -> list[str]:
        order = [n for n, _ in self.module.named_modules() if n in set(self.wrapped_names)]
        return order

    # ---- explicit prefetch -------------------------------------------------------------------

    def _record_forward_order(self) -> None:
        named = dict(self.module.named_modules())
        recorded: list[str] = []

        def make_pre_hook(name: str):
            def hook(module: nn.Module, args: Any) -> None:
                if name not in recorded:
                    recorded.append(name)

            return hook

        for name in self.wrapped_names:
            self._order_hooks.append(named[name].register_forward_pre_hook(make_pre_hook(name)))

        def finish(module: nn.Module, args: Any, output: Any) -> None:
            for handle in self._order_hooks:
                handle.remove()
            self._order_hooks.clear()
            if recorded:
                self._forward_order = list(recorded)
                self._apply_prefetch()

        self._order_hooks.append(self.module.register_forward_hook(finish))

    def _apply_prefetch(self) -> None:
        named = dict(self.module.named_modules())
        order = self._forward_order or self.wrapped_names_in_registration_order()
        blocks = [named[n] for n in order]
        plan = []
        fwd, bwd = self.config.forward_prefetch, self.config.backward_prefetch
        for i, (name, block) in enumerate(zip(order, blocks)):
            # Explicit lists replace FSDP2's implicit choice: forward prefetch overlaps the next
            # blocks' all-gathers with this block's compute, and with async unshard the copy-in
            # stays on the default stream, so no buffer is shared between streams.
            if fwd > 0:
                targets = blocks[i + 1 : i + 1 + fwd]
                block.set_modules_to_forward_prefetch(targets)
            if bwd > 0:
                targets_b = list(reversed(blocks[max(0, i - bwd) : i]))
                block.set_modules_to_backward_prefetch(targets_b)
            fwd_names = order[i + 1 : i + 1 + fwd] if fwd > 0 else ["(implicit)"]
            bwd_names = list(reversed(order[max(0, i - bwd) : i])) if bwd > 0 else ["(implicit)"]
            plan.append(f"{name or '<root>'}: forward -> {fwd_names}, backward -> {bwd_names}")
        self._prefetch_plan = plan

    def prefetch_plan(self) -> str:
        """The prefetch chains as text, one FSDP module per line."""
        if not self._prefetch_plan:
            self._apply_prefetch()
        return "\n".join(self._prefetch_plan)

    # ---- recovery ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Return every FSDP2 state to IDLE and sharded after a failed forward/backward.

        Frees unsharded parameters and gradients, waits for (then drops) any all-gather or
        reduce-scatter already issued, forgets queued post-backward callbacks and sets every
        sharded gradient to None: the next forward/backward runs as if the failed one had
        never started. Safe to call when nothing failed, and at any failure point.
        """
        internals.reset_fsdp_states(self.fsdp_modules)
        if self._reduce_scatter_comm is not None:
            # After the waits above: no reduce-scatter work is pending on what it holds.
            self._reduce_scatter_comm.reset()
        for param in self.module.parameters():
            param.grad = None

    def end_of_backward(self) -> None:
        """A backward run outside autograd's own end (a pipeline stage's, `engine.pipeline`): let go of
        the reduce-scatter outputs the compute-stream comm holds until then."""
        if self._reduce_scatter_comm is not None:
            self._reduce_scatter_comm.release_all()

    def reshard_root(self) -> None:
        """Free the root's unsharded parameters (FSDP2 keeps them after a forward without backward)."""
        self.module.reshard()

    def is_clean(self) -> bool:
        return internals.is_clean(self.fsdp_modules)

    def states(self) -> list[dict[str, str]]:
        return internals.describe_states(self.named_fsdp_modules)

    def unsharded_bytes(self) -> int:
        return internals.unsharded_bytes(self.fsdp_modules)

    def param_fqn_to_module(self) -> dict[str, str]:
        mapping = {}
        for name, module in self.named_fsdp_modules:
            for fqn in internals.group_param_fqns(module):
                mapping[fqn] = name
        return mapping


def warn_root_only(model: nn.Module, config: FSDP2Config) -> None:
    """Say, with the fix, that only the root will be sharded: the whole model is then gathered
    as one unit in every forward and backward, and most of FSDP's memory saving is lost."""
    if config.wrap is not None and not config.wrap:
        return  # `wrap: []` asks for the root alone
    how = (
        f"no module is of a class in parallelism_config.fsdp2.wrap={list(config.wrap)}"
        if config.wrap is not None
        else "no module has `_fsdp_wrap = True`, the model has no `fsdp_wrap_fn`, and it names no `_no_split_modules`"
    )
    repeated = _repeated_classes(model)
    hint = f" (repeated classes here: {', '.join(repeated)})" if repeated else ""
    warnings.warn(
        f"automicro: only the root module is sharded: {how}. The whole model is gathered as one FSDP "
        f"unit in every forward and backward, so most of FSDP's memory saving is lost. Name the block "
        f"class in parallelism_config.fsdp2.wrap{hint}, or mark the blocks with `_fsdp_wrap = True`; "
        "`wrap: []` silences this.",
        stacklevel=3,
    )


def _materialize_meta(model: nn.Module, device: torch.device) -> None:
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device)
    for owner in (model, getattr(model, "model", None)):
        init = getattr(owner, "init_weights", None)
        if callable(init):
            with torch.no_grad():
                init()
            return
    raise FSDP2ConfigError(
        "the model was built on the meta device but has no `init_weights()` method to materialize "
        "its shards; build it on cpu/cuda or give it `init_weights()`"
    )


def shard(
    model: nn.Module,
    config: Optional[FSDP2Config] = None,
    mesh: Optional[DeviceMesh] = None,
    device: Optional[torch.device] = None,
    compile: Optional[CompileConfig] = None,
    checkpoint_switch: bool = False,
) -> ShardedModel:
    """Shard `model` in place with `fully_shard` and return its `ShardedModel` handle.

    Args:
        model: a `ComposerModel` or plain `nn.Module`; blocks are chosen by `config.wrap`.
        config: the `FSDP2Config` (defaults when None).
        mesh: a 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) mesh; None builds one over all
            ranks from `config.replicate`.
        device: where shards live; defaults to the current CUDA device under NCCL, else CPU.
        compile: with ``scope: blocks``, each sharded block's forward is compiled in place before
            sharding (the root's, when only the root is sharded); other scopes are not the engine's.
        checkpoint_switch: where ``config.activation_checkpointing`` is false, checkpoint every
            wrapped block all the same, switched off (the hooks return at once): the layout search's
            ``recompute`` trade switches it on (`automicro.engine.layout`).
    """
    internals.check_supported_torch()
    if not dist.is_initialized():
        raise RuntimeError("automicro.engine.shard needs torch.distributed to be initialized first")
    config = config or FSDP2Config()
    if isinstance(model, FSDPModule):
        raise FSDP2ConfigError("the model is already sharded with fully_shard; shard it only once")
    device = device or _default_device()
    ensure_record_stream_free()
    expandable_set = apply_expandable_segments(config.expandable_segments, device)
    if device.type == "cpu" or dist.get_backend() == "gloo":
        internals.install_gloo_gradient_average_fix()
    if config.replicate > 1 and device.type == "cpu" and internals.TORCH_VERSION < (2, 8):
        raise FSDP2ConfigError(
            f"parallelism_config.fsdp2.replicate={config.replicate}: HSDP on CPU needs torch >= 2.8 "
            f"(torch {torch.__version__}'s FSDP2 needs a stream event for the replicate all-reduce, "
            "which CPU streams do not record); use replicate: 1 on CPU, or a GPU"
        )
    mesh = mesh or build_mesh(config, device)
    if config.cpu_offload and device.type == "cpu":
        raise FSDP2ConfigError("parallelism_config.fsdp2.cpu_offload=true needs device: gpu")
    if not any(p.is_meta for p in model.parameters()):
        model.to(device)

    wrapped, notes = plan_wrapping(model, config)
    for note in notes:
        log.warning("automicro: %s", note)
    if not wrapped:
        warn_root_only(model, config)
    named = dict(model.named_modules())
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": _mixed_precision_policy(config.mixed_precision),
    }
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    compiled = None
    if compile is not None and compile.compiles_blocks:
        compiled = compile_blocks([named[name] for name in wrapped] or [model], compile, root=model)
    rung = config.rung
    dial = None
    if wrapped and (rung.on or checkpoint_switch):
        dial = BlockDial.install([named[name] for name in wrapped], compiled)
    for name in wrapped:
        fully_shard(named[name], reshard_after_forward=config.reshard_after_forward, **kwargs)
    # The root keeps its parameters unsharded between forward and backward (FSDP2 does the same
    # for the root by default), so no reshard_after_forward here.
    fully_shard(model, **kwargs)
    _materialize_meta(model, device)

    sharded = ShardedModel(
        module=model, config=config, mesh=mesh, device=device, wrapped_names=wrapped, tie_notes=notes
    )
    sharded.expandable_segments_set_by_engine = expandable_set
    sharded.compiled = compiled
    sharded.recompute = dial
    if dial is not None:
        dial.set(rung)
    if config.unshard_async_op:
        for module in sharded.fsdp_modules:
            internals.set_unshard_async_op(module, True)
    if config.use_compute_stream_buffers(internals.TORCH_VERSION, internals.HAS_CUSTOM_COMMS):
        comms = internals.install_compute_stream_comms(model, sharded.fsdp_modules, device)
        sharded._all_gather_comm, sharded._reduce_scatter_comm, sharded._comm_hook = comms
    if config.forward_prefetch > 0 or config.backward_prefetch > 0:
        sharded._apply_prefetch()
        sharded._record_forward_order()
    object.__setattr__(model, "_automicro_sharded", sharded)
    log.info(
        "automicro: applied FSDP2 to %d blocks + root (mesh %s, mixed precision %s, reshard_after_forward=%s, "
        "prefetch fwd=%d bwd=%d, async unshard=%s, buffers on compute stream=%s, activation checkpointing=%s)",
        len(wrapped),
        tuple(mesh.shape),
        config.mixed_precision,
        config.reshard_after_forward,
        config.forward_prefetch,
        config.backward_prefetch,
        config.unshard_async_op,
        sharded.compute_stream_buffers,
        rung.describe(len(wrapped)),
    )
    return sharded


def adopt(model: nn.Module) -> ShardedModel:
    """The `ShardedModel` of a model the user sharded with torch's `fully_shard` (torchtitan's way:
    each block, then the root), so that the sync hooks, the ledger and `recover()` guard it as they
    guard `shard()`'s. Nothing about the model changes: its prefetch, async unshard, resharding,
    mixed precision and checkpointing stay as the user set them. What the layout search may trade
    is read from the model: ``no_reshard`` only where every block reshards to its whole mesh after
    forward, ``no_recompute`` only on blocks with torch's composable ``checkpoint``.

    Refused, with what to change: a root that is not sharded (call ``fully_shard(model)`` last),
    a model with no sharded parameter, parameters on more than one mesh."""
    internals.check_supported_torch()
    if not dist.is_initialized():
        raise RuntimeError("automicro: adopting a fully_shard model needs torch.distributed to be initialized first")
    existing = sharded_of(model)
    if existing is not None:
        return existing
    if not isinstance(model, FSDPModule):
        inner = [name for name, m in model.named_modules() if m is not model and isinstance(m, FSDPModule)]
        raise FSDP2ConfigError(
            f"automicro: the model passed ({type(model).__name__}) is not itself sharded"
            + (f" (its sharded modules: {inner[:3]}{' ...' if len(inner) > 3 else ''})" if inner else "")
            + ": call fully_shard(model) on the root after its blocks, as torchtitan does, and pass that root"
        )
    # `fully_shard` without a mesh builds one per call: equal meshes over the same ranks are one mesh.
    meshes = {
        (p.device_mesh.device_type, tuple(p.device_mesh.mesh.shape), tuple(p.device_mesh.mesh.flatten().tolist())): p.device_mesh
        for p in model.parameters() if hasattr(p, "device_mesh")
    }
    if not meshes:
        raise FSDP2ConfigError("automicro: the model has no sharded parameter (a fully_shard root with no parameters?)")
    if len(meshes) > 1:
        raise FSDP2ConfigError(
            f"automicro: the model's parameters are sharded over {len(meshes)} different device meshes; "
            "automicro guards a model sharded over one data-parallel mesh (1-D, or 2-D replicate x shard)"
        )
    mesh = next(iter(meshes.values()))
    device = next(p for p in model.parameters() if hasattr(p, "device_mesh")).to_local().device
    if device.type == "cpu" or dist.get_backend() == "gloo":
        internals.install_gloo_gradient_average_fix()
    ensure_record_stream_free()
    wrapped = [name for name, m in model.named_modules() if m is not model and isinstance(m, FSDPModule)]
    wrapped.sort(key=lambda n: -n.count("."))
    named = dict(model.named_modules())
    blocks = [named[n] for n in wrapped if internals.param_group(named[n]) is not None]
    full_reshard = bool(blocks) and all(internals.reshards_to_whole_mesh(b) for b in blocks)
    checkpointed = any(internals.has_activation_checkpointing(named[n]) for n in wrapped)
    # What the engine reads of the config: the layout's trades. Nothing here is applied to the model.
    config = FSDP2Config(
        reshard_after_forward=full_reshard, activation_checkpointing=checkpointed,
        replicate=mesh.shape[0] if mesh.ndim == 2 else 1, forward_prefetch=0, backward_prefetch=0,
        unshard_async_op=False, compute_stream_buffers=False, expandable_segments=False,
    )
    sharded = ShardedModel(module=model, config=config, mesh=mesh, device=device, wrapped_names=wrapped)
    object.__setattr__(model, "_automicro_sharded", sharded)
    log.info("automicro: adopted a fully_shard model: %d blocks + root (mesh %s)", len(wrapped), tuple(mesh.shape))
    return sharded


def sharded_of(model: nn.Module) -> Optional[ShardedModel]:
    """The `ShardedModel` that `shard()` made for `model`, if any."""
    return getattr(model, "_automicro_sharded", None)
