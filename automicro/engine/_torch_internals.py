"""Every use of a private torch API in automicro lives in this module.

Each function names the torch versions it was checked on. The suite runs on torch 2.7.x (Composer
0.32.1's pin), 2.11.x (the GPU machines) and 2.15.x (the newest release); versions between 2.7 and
2.15 are accepted untested, any other is refused by `check_supported_torch()` when the engine
shards a model, with a message, instead of failing deep inside FSDP2 later.

What is private here and why:
- FSDP2 runtime state (`FSDPState`, `FSDPParamGroup`, `FSDPCommContext`): `recover()` must put
  it back to IDLE/sharded after an exception, which torch has no public API for.
- The module globals of `_fsdp_collectives` / `_fsdp_param_group`: the pre-collective sync
  point must run *after* FSDP2 allocates its all-gather / reduce-scatter buffers and *before*
  the collective is issued; nothing public runs there.
- `_get_gradient_divide_factors` on torch < 2.8: gloo's reduce-scatter ignores `ReduceOp.AVG`
  there (it sums), so gradients would be world-size times too large on CPU.
- `_set_unshard_async_op` (private on every checked version).
- The composable activation checkpoint (`torch.distributed._composable.checkpoint`), which keeps
  parameter names unchanged (the wrapper class would insert `_checkpoint_wrapped_module`).
- The `AllGather` / `ReduceScatter` comm interfaces (`_fsdp_api`, torch >= 2.9) behind the
  public `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`:
  `ComputeStreamAllGather` and `ComputeStreamReduceScatter` allocate FSDP2's side-stream buffers
  from the compute stream's memory.
- the profiler's kineto results (`profile.profiler.kineto_results`): a batch's kernels and host events
  without building torch's Python event tree (`profiler_events`), for what a trial can win.
- dynamo's compile counters (`torch._dynamo.utils.counters`): how many graphs the search made
  `torch.compile` compile (`compiled_graph_count`); `torch._dynamo.maybe_mark_dynamic`: the
  compiled blocks dynamic in the batch dimension only (`mark_batch_dynamic`).

Owns: every private torch access, each behind a version gate. May not touch: Composer,
automicro's protocol (callers pass what they need as arguments).
"""

from __future__ import annotations

import itertools

import threading
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
from torch.utils._python_dispatch import TorchDispatchMode


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _torch_version()
CHECKED_VERSIONS = ((2, 7), (2, 11), (2, 15))
# torch >= 2.8 avoids record_stream in c10d by default; 2.7 needs the env variable.
NEEDS_AVOID_RECORD_STREAMS_ENV = TORCH_VERSION < (2, 8)
# torch 2.7's gloo reduce-scatter sums where FSDP2 asks for AVG (measured on CPU, 2 ranks).
GLOO_REDUCE_SCATTER_IGNORES_AVG = TORCH_VERSION < (2, 8)
# `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` and the comm interfaces exist
# from torch 2.9.
HAS_CUSTOM_COMMS = (
    TORCH_VERSION >= (2, 9)
    and hasattr(FSDPModule, "set_custom_reduce_scatter")
    and hasattr(FSDPModule, "set_custom_all_gather")
)


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_supported_torch() -> None:
    """The check and its message both come from CHECKED_VERSIONS (the oldest to the newest): the
    range between them is accepted, the listed versions are the ones the test suite runs on."""
    low, high = CHECKED_VERSIONS[0], CHECKED_VERSIONS[-1]
    if not low <= TORCH_VERSION <= high:
        checked = [_dotted(v) for v in CHECKED_VERSIONS]
        installs = [f"{v}.0" for v in checked]
        raise RuntimeError(
            f"automicro's FSDP2 engine supports torch {_dotted(low)} to {_dotted(high)} (checked on "
            f"{', '.join(checked)}); found torch {torch.__version__}, which is "
            f"{'older' if TORCH_VERSION < low else 'newer'} than that. Install torch {installs[0]} "
            f"(Composer 0.32.1's pin), {', '.join(installs[1:-1])} or {installs[-1]} (with Composer "
            "installed --no-deps; see docs/supported-versions.md)."
        )


# --------------------------------------------------------------------------------------------
# FSDP2 state access (checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------


def fsdp_state(module: FSDPModule) -> Any:
    """The `FSDPState` behind one `fully_shard`ed module (private `_get_fsdp_state`)."""
    return module._get_fsdp_state()


def param_group(module: FSDPModule) -> Any:
    """The module's `FSDPParamGroup`, or None for a module that owns no parameters."""
    return fsdp_state(module)._fsdp_param_group


def fsdp_process_groups(modules: list[FSDPModule]) -> list[Any]:
    """The process groups the modules' collectives run on (shard, then replicate for HSDP), in module
    order, each once. Read from the param groups' mesh info, the groups `fully_shard` captured (on
    2.7, 2.11 and 2.15 `FSDPMeshInfo.shard_process_group` / `replicate_process_group`): a mesh's
    `get_group` can answer another group over the same ranks once a second mesh was built in the
    process (torch 2.7: two Lightning fits, the second fit's FSDP collectives on a group the ledger
    did not know)."""
    groups: list[Any] = []
    for module in modules:
        group = param_group(module)
        if group is None:
            continue
        info = group.mesh_info
        for pg in (getattr(info, "shard_process_group", None), getattr(info, "replicate_process_group", None)):
            if pg is not None and not any(pg is g for g in groups):
                groups.append(pg)
    return groups


def set_unshard_async_op(module: FSDPModule, async_op: bool) -> None:
    # Private on 2.7, 2.11 and 2.15 (`FSDPModule._set_unshard_async_op`).
    module._set_unshard_async_op(async_op)


def group_param_fqns(module: FSDPModule) -> list[str]:
    group = param_group(module)
    if group is None:
        return []
    return [getattr(p, "_param_fqn", "") for p in group.fsdp_params]


def describe_states(modules: list[tuple[str, FSDPModule]]) -> list[dict[str, str]]:
    """One row per FSDP2 module: state, param-group state and sharded state, as strings."""
    rows = []
    for name, module in modules:
        state = fsdp_state(module)
        group = state._fsdp_param_group
        rows.append(
            {
                "module": name,
                "state": state._training_state.name,
                "group_state": group._training_state.name if group else "NONE",
                "sharded": group._sharded_state.name if group else "NONE",
                "pending_all_gather": str(group is not None and group._all_gather_result is not None),
            }
        )
    return rows


def unsharded_bytes(modules: list[FSDPModule]) -> int:
    """Bytes still held by unsharded parameter storage or unsharded gradients."""
    # The unsharded parameter is a view of the all-gather output: each storage counts once.
    storages: dict[int, int] = {}

    def add(tensor: Any) -> None:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for module in modules:
        group = param_group(module)
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            for tensor in getattr(fsdp_param, "all_gather_outputs", []) or []:
                add(tensor)
            if hasattr(fsdp_param, "_unsharded_param"):
                add(fsdp_param._unsharded_param)
                if fsdp_param._unsharded_param.grad is not None:
                    add(fsdp_param._unsharded_param.grad)
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                add(fsdp_param.unsharded_accumulated_grad)
    return sum(nbytes for ptr, nbytes in storages.items() if ptr != 0)


# --------------------------------------------------------------------------------------------
# Recovery (checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------


def _wait_pending_all_gather(group: Any) -> None:
    result = group._all_gather_result
    if result is None:
        return
    # The collective was issued on every rank (the deadlock-freedom invariant puts a consensus
    # point before it), so waiting for it cannot hang; dropping it unwaited could free a buffer
    # NCCL is still writing.
    event = getattr(result, "all_gather_event", None)
    if event is not None:
        group.device_handle.current_stream().wait_event(event)
    work = getattr(result, "all_gather_work", None)
    if isinstance(work, dist.distributed_c10d.Work):
        work.wait()
    group._all_gather_result = None


def _drop_unsharded_grads(group: Any) -> None:
    for fsdp_param in group.fsdp_params:
        if hasattr(fsdp_param, "_unsharded_param"):
            fsdp_param._unsharded_param.grad = None
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            fsdp_param.unsharded_accumulated_grad = None
        event = getattr(fsdp_param, "grad_offload_event", None)
        if event is not None:
            event.synchronize()
            fsdp_param.grad_offload_event = None


def reset_param_group(group: Any) -> None:
    """Return one `FSDPParamGroup` to IDLE and SHARDED, freeing every unsharded buffer."""
    _wait_pending_all_gather(group)
    group._wait_for_post_backward()
    _drop_unsharded_grads(group)
    if group._reshard_after_forward_event is not None:
        group.device_handle.current_stream().wait_event(group._reshard_after_forward_event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = TrainingState.IDLE
    # `_to_sharded` frees the unsharded storage from SHARDED_POST_FORWARD or UNSHARDED alike.
    group._to_sharded()
    _free_partial_unshard(group)


def _free_partial_unshard(group: Any) -> None:
    """An OOM in the middle of a group's unshard (its parameters' all-gather outputs grown one after the other, the
    group still SHARDED) leaves what was grown so far: `_to_sharded` frees nothing from SHARDED (seen on torch 2.7:
    2.5 MiB of a routed block's experts held after the wipe, FSDP2 over one rank). Every all-gather output and
    unsharded inner tensor of the group is freed here (a resize to 0, as FSDP2's own `free_storage`), never the
    sharded data."""
    for fsdp_param in group.fsdp_params:
        local = getattr(fsdp_param, "_sharded_param_data", None)
        keep = None if local is None else local.untyped_storage().data_ptr()
        for tensor in itertools.chain(getattr(fsdp_param, "all_gather_outputs", ()) or (),
                                      getattr(fsdp_param, "_unsharded_inner_tensors", ()) or ()):
            storage = tensor.untyped_storage()
            if storage.size() != 0 and storage.data_ptr() != keep:
                storage.resize_(0)


def reset_fsdp_states(modules: list[FSDPModule]) -> None:
    """Put every FSDP2 state reachable from `modules` back to a clean IDLE/sharded state."""
    seen_ctx = set()
    for module in modules:
        state = fsdp_state(module)
        state._training_state = TrainingState.IDLE
        state._modules_to_run_forward.clear()
        if state._fsdp_param_group is not None:
            reset_param_group(state._fsdp_param_group)
        comm_ctx = state._comm_ctx
        state_ctx = state._state_ctx
        if id(state_ctx) not in seen_ctx:
            seen_ctx.add(id(state_ctx))
            state_ctx.iter_forward_root = None
            # A failed backward drops the autograd graph task with its queued final callback.
            state_ctx.post_backward_final_callback_queued = False
            state_ctx.is_last_backward = True
        if getattr(comm_ctx, "all_gather_state", None) is not None:
            comm_ctx.all_gather_state = None
        rs_state = getattr(comm_ctx, "reduce_scatter_state", None)
        if rs_state is not None:
            # FSDP2 itself waits the same way at the end of backward (a no-op on CPU).
            comm_ctx.device_handle.current_stream().wait_event(rs_state.event)
            comm_ctx.reduce_scatter_state = None
        if hasattr(comm_ctx, "post_forward_order"):
            comm_ctx.post_forward_order.clear()


def is_clean(modules: list[FSDPModule]) -> bool:
    for module in modules:
        state = fsdp_state(module)
        if state._training_state != TrainingState.IDLE:
            return False
        group = state._fsdp_param_group
        if group is None:
            continue
        if group._training_state != TrainingState.IDLE or group._sharded_state != ShardedState.SHARDED:
            return False
        if group._all_gather_result is not None:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Pre-collective hook (checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------
#
# Every version issues every FSDP2 collective through the module global `dist` of
# `_fsdp_collectives` (`dist.all_gather_into_tensor`, `dist.reduce_scatter_tensor`,
# `dist.all_reduce`; torch 2.15's default comms `dist.all_gather_single` and
# `dist.reduce_scatter_single`), after the output/input buffers are allocated. Replacing that global with a
# proxy gives a hook exactly between allocation and collective. `_fsdp_param_group` calls
# `foreach_all_gather` / `foreach_reduce` by module global too; wrapping those tells the hook
# which FSDP module the collective belongs to.

PreCollectiveHook = Callable[[str, list[Any]], None]  # (site, the collective's FSDPParams)


class CollectiveObserver(Protocol):
    """Told about every FSDP2 collective right before it is issued and right after the call
    returns (`automicro.core.ledger.CollectiveLedger`). `kind` is "all_gather", "reduce_scatter"
    or "all_reduce"; `tensor` is the rank's own contribution (input of an all-gather, output of
    a reduce-scatter); `group` as FSDP2 passed it (None: the default group)."""

    def before(self, kind: str, tensor: torch.Tensor, group: Any, op: Any) -> None: ...

    def after(self) -> None: ...


class _Owner(threading.local):
    fsdp_params: list[Any] = []


_owner = _Owner()
_hooks: list[PreCollectiveHook] = []
_observers: list[CollectiveObserver] = []


def _run_hooks(site: str) -> None:
    for hook in list(_hooks):
        hook(site, _owner.fsdp_params)


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _observed(kind: str, call: Callable[..., Any], tensor: torch.Tensor, group: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    if not _observers:
        return call(*args, **kwargs)
    observer = _observers[-1]
    observer.before(kind, tensor, group, op)
    work = call(*args, **kwargs)
    observer.after()
    return work


class _DistProxy(types.ModuleType):
    """Stands in for `torch.distributed` inside `_fsdp_collectives` while hooks or an observer exist.

    Signatures (the same on 2.7, 2.11 and 2.15): all_gather_into_tensor(output_tensor, input_tensor,
    group, async_op); reduce_scatter_tensor(output, input, op, group, async_op);
    all_reduce(tensor, op, group, async_op)."""

    def __init__(self) -> None:
        super().__init__("automicro_fsdp_dist_proxy")

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_gather_into_tensor(self, *args: Any, **kwargs: Any) -> Any:
        _run_hooks("unshard_alloc")
        return _observed(
            "all_gather", dist.all_gather_into_tensor, _arg(args, kwargs, 1, "input_tensor"),
            _arg(args, kwargs, 2, "group"), None, args, kwargs,
        )

    def reduce_scatter_tensor(self, *args: Any, **kwargs: Any) -> Any:
        _run_hooks("reduce_scatter_alloc")
        return _observed(
            "reduce_scatter", dist.reduce_scatter_tensor, _arg(args, kwargs, 0, "output"),
            _arg(args, kwargs, 3, "group"), _arg(args, kwargs, 2, "op", dist.ReduceOp.SUM), args, kwargs,
        )

    # torch 2.15's default FSDP2 comms (`DefaultAllGather`, `DefaultReduceScatter` and their
    # process-group-allocating twins) call these two instead, with the same arguments in the same
    # places as the two above. Missing them left a model sharded by plain `fully_shard` unguarded on
    # 2.15 (no pre-collective sync point, no ledger record: a steady-state OOM could not be recovered).
    def all_gather_single(self, *args: Any, **kwargs: Any) -> Any:
        _run_hooks("unshard_alloc")
        return _observed(
            "all_gather", dist.all_gather_single, _arg(args, kwargs, 1, "input_tensor"),  # type: ignore[attr-defined]
            _arg(args, kwargs, 2, "group"), None, args, kwargs,
        )

    def reduce_scatter_single(self, *args: Any, **kwargs: Any) -> Any:
        _run_hooks("reduce_scatter_alloc")
        return _observed(
            "reduce_scatter", dist.reduce_scatter_single, _arg(args, kwargs, 0, "output"),  # type: ignore[attr-defined]
            _arg(args, kwargs, 3, "group"), _arg(args, kwargs, 2, "op", dist.ReduceOp.SUM), args, kwargs,
        )

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        _run_hooks("all_reduce_alloc")
        return _observed(
            "all_reduce", dist.all_reduce, _arg(args, kwargs, 0, "tensor"),
            _arg(args, kwargs, 2, "group"), _arg(args, kwargs, 1, "op", dist.ReduceOp.SUM), args, kwargs,
        )


_ORIGINAL_FOREACH_ALL_GATHER = _fsdp_param_group.foreach_all_gather
_ORIGINAL_FOREACH_REDUCE = _fsdp_param_group.foreach_reduce


def _owned(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(fsdp_params: list[Any], *args: Any, **kwargs: Any) -> Any:
        previous = _owner.fsdp_params
        _owner.fsdp_params = fsdp_params
        try:
            return fn(fsdp_params, *args, **kwargs)
        finally:
            _owner.fsdp_params = previous

    return wrapper


class _PatchHandle:
    """Takes one hook or observer off its list; the last one off restores torch's code paths."""

    def __init__(self, registry: list[Any], item: Any) -> None:
        self._registry, self._item = registry, item
        if not _hooks and not _observers:
            _patch_collectives()
        registry.append(item)

    def remove(self) -> None:
        if self._item in self._registry:
            self._registry.remove(self._item)
        if not _hooks and not _observers:
            _restore_collectives()


def _patch_collectives() -> None:
    _fsdp_collectives.dist = _DistProxy()
    _fsdp_param_group.foreach_all_gather = _owned(_ORIGINAL_FOREACH_ALL_GATHER)
    _fsdp_param_group.foreach_reduce = _owned(_ORIGINAL_FOREACH_REDUCE)


def _restore_collectives() -> None:
    _fsdp_collectives.dist = dist
    _fsdp_param_group.foreach_all_gather = _ORIGINAL_FOREACH_ALL_GATHER
    _fsdp_param_group.foreach_reduce = _ORIGINAL_FOREACH_REDUCE


def add_pre_collective_hook(hook: PreCollectiveHook) -> _PatchHandle:
    """Call `hook(site, fsdp_params)` after FSDP2 allocates a collective's buffers, before it runs.

    The patch is in place only while at least one hook (or observer) exists; removing the last
    one restores torch's own code paths exactly.
    """
    return _PatchHandle(_hooks, hook)


def add_collective_observer(observer: CollectiveObserver) -> _PatchHandle:
    """Tell `observer` about every FSDP2 collective (the newest observer only) until removed.

    Uses the same module-global patch as the pre-collective hooks; it stays in place while any
    hook or observer exists."""
    return _PatchHandle(_observers, observer)


def collective_sequence_number(group: Any) -> int:
    """How many collectives this rank has issued on `group` (None: the default group) since it was
    created: c10d's per-group sequence number (`ProcessGroup._get_sequence_number_for_group`,
    private; checked on torch 2.7.0, 2.11.0 and 2.15.0 with gloo, and on 2.11.0 with NCCL, where it counts
    collectives only). Equal on every rank that issued the same collectives."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return int(pg._get_sequence_number_for_group())


def pre_collective_hook_installed() -> bool:
    """Whether a pre-collective hook (a sync point) runs in front of FSDP2's collectives."""
    return bool(_hooks) and isinstance(_fsdp_collectives.dist, _DistProxy)


def collectives_patched() -> bool:
    """Whether FSDP2's collectives go through automicro's proxy at all (hooks or an observer)."""
    return isinstance(_fsdp_collectives.dist, _DistProxy)


# --------------------------------------------------------------------------------------------
# Gradient averaging on gloo (torch 2.7 only; checked on 2.7.0, not needed on 2.11.0 or 2.15.0)
# --------------------------------------------------------------------------------------------

_ORIGINAL_DIVIDE_FACTORS = getattr(_fsdp_collectives, "_get_gradient_divide_factors", None)


def _gloo_safe_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type=""):
    backend_is_gloo = dist.get_backend(reduce_scatter_group) == "gloo"
    if not backend_is_gloo:
        return _ORIGINAL_DIVIDE_FACTORS(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type)
    data_parallel_size = reduce_scatter_group.size()
    if all_reduce_group is not None:
        data_parallel_size *= all_reduce_group.size()
    # A pre-divide factor of 1.0 selects ReduceOp.SUM (and divides by nothing); the post-divide
    # then turns the sum into the mean FSDP2 means to compute.
    return 1.0, float(data_parallel_size)


def install_gloo_gradient_average_fix() -> bool:
    """On torch 2.7, make FSDP2 average (not sum) gradients over gloo. Returns True if applied."""
    if not GLOO_REDUCE_SCATTER_IGNORES_AVG:
        return False
    if _fsdp_collectives._get_gradient_divide_factors is not _gloo_safe_divide_factors:
        _fsdp_collectives._get_gradient_divide_factors = _gloo_safe_divide_factors
    return True


# --------------------------------------------------------------------------------------------
# CUDA allocator settings after start-up (checked on torch 2.7.0 and 2.11.0; on 2.15.0 without a GPU)
# --------------------------------------------------------------------------------------------


def set_expandable_segments() -> None:
    """Turn on the caching allocator's expandable segments now (new segments only).

    torch 2.7: `torch._C._cuda_cudaCachingAllocator_set_allocator_settings` (what the private
    `torch.cuda.memory._set_allocator_settings` calls); torch >= 2.9 deprecates that wrapper for
    `torch._C._accelerator_setAllocatorSettings`. Neither initializes CUDA.
    """
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    setter("expandable_segments:True")


def attach_oom_observer(observer: Callable[[int, int, int, int], None]) -> bool:
    """Call `observer(device, asked_bytes, device_allocated, device_free)` at every OOM the CUDA
    caching allocator raises (`torch._C._cuda_attach_out_of_memory_observer`, on torch 2.7.0, 2.11.0
    and 2.15.0; benchmarks read the pool there). False where there is no CUDA device to attach to."""
    if not torch.cuda.is_available():
        return False
    torch._C._cuda_attach_out_of_memory_observer(observer)
    return True


# --------------------------------------------------------------------------------------------
# Activation checkpointing (checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------


def apply_activation_checkpointing(module: nn.Module, context_fn: Any = None) -> None:
    """Composable (hook-based) checkpointing: parameter names stay unchanged. `context_fn`: called at each forward
    for the forward's and the recompute's contexts (`automicro.engine.recompute`'s selective ones), as
    `torch.utils.checkpoint.checkpoint`'s own."""
    from torch.distributed._composable import checkpoint

    if context_fn is None:
        checkpoint(module)
    else:
        checkpoint(module, context_fn=context_fn)


def has_activation_checkpointing(module: nn.Module) -> bool:
    """Whether `apply_activation_checkpointing` was applied to `module` (the composable API's
    registry: `checkpoint.state(module)` is None where it was not)."""
    from torch.distributed._composable import checkpoint

    return checkpoint.state(module) is not None


def checkpoint_enabled(module: nn.Module) -> bool:
    """Whether a checkpointed module's recomputation is on now (`set_activation_checkpointing`)."""
    from torch.distributed._composable import checkpoint

    state = checkpoint.state(module)
    return bool(state is not None and getattr(state, "enable_hook", False))


def set_activation_checkpointing(module: nn.Module, on: bool) -> None:
    """Switch a checkpointed module's recomputation on or off between forwards. The composable
    checkpoint's hooks run only while the module's state has `enable_hook` set (the same flag its
    recomputation clears to run the forward again without checkpointing); off, the forward keeps its
    activations for backward as an unwrapped module does. Never flip it between a forward and its
    backward."""
    from torch.distributed._composable import checkpoint

    state = checkpoint.state(module)
    if state is None or not hasattr(state, "enable_hook"):
        raise RuntimeError(
            f"automicro: this torch ({torch.__version__}) has no activation checkpointing switch on "
            f"{type(module).__name__}; pin a layout without no_recompute"
        )
    state.enable_hook = bool(on)


# --------------------------------------------------------------------------------------------
# FSDP2's side-stream buffers from the compute stream's memory (torch >= 2.9; checked on 2.11.0; on 2.15.0
# with CPU streams only, no GPU)
# --------------------------------------------------------------------------------------------
#
# The caching allocator keeps one pool per stream: a block freed by one stream is never handed to
# another. FSDP2 allocates two big kinds of buffers on its side streams:
#   - the flat all-gather output (sync unshard: on the all-gather copy-in stream), one per
#     unshard, freed right after its copy-out into the unsharded parameters;
#   - the reduce-scatter output (on the reduce-scatter stream). With an fp32 reduce it is kept as
#     the sharded `.grad` (views into it), so every step's gradients come from that pool.
# Both pools stay reserved while the compute stream (the optimizer, activations, the next
# forward) cannot use them: that is most of what is left of the seed's reserved/allocated gap
# once record_stream is gone. The two comms below take these blocks from the compute stream's
# pool instead, keeping FSDP2's streams, overlap and events unchanged.
#
# All-gather output. Its first user is the copy-in stream, so `allocate` first makes the copy-in
# stream wait for the compute stream (everything a reused block was used for by the compute
# stream was queued before it was freed). That costs no overlap: FSDP2 already makes the copy-in
# stream wait for the previous copy-out, queued on the compute stream just before the next
# unshard is issued. When FSDP2 drops the buffer, the compute stream has waited for the
# all-gather and queued the copy-out, so the block is safe for the compute stream at once.
#
# Reduce-scatter output. FSDP2 makes the reduce-scatter stream wait for the compute stream right
# before it allocates the output, so its first use is safe. The danger is its *free*: under
# gradient accumulation FSDP2 adds the output into the existing `.grad` on the reduce-scatter
# stream and drops it at once; a compute-stream block freed like that could be handed to the next
# compute-stream allocation before the reduce-scatter and the `+=` ran. So the comm keeps every
# output alive until the compute stream is ordered after the reduce-scatter-stream work on it:
#   - FSDP2's `post_backward` makes the compute stream wait for the previous reduce-scatter's
#     event before it calls `foreach_reduce` again. That event follows, on the reduce-scatter
#     stream, every op of all earlier reductions (their `+=` included), so when output k is
#     allocated, outputs k-2 and older are safe to drop; output k-1 is kept;
#   - at the end of each backward (an autograd final callback) and in `recover()`, the compute
#     stream waits for the reduce-scatter stream and every held output is dropped.
# At most two outputs are held beyond what FSDP2 itself keeps; without accumulation the output
# *is* the gradient and holding it costs nothing. HSDP (the replicate all-reduce adds a third
# stream) and CPU offload (gradients live on the host) keep FSDP2's own allocation.


def _stream_handle(device: torch.device) -> Any:
    """torch.cuda (or the device type's module, e.g. torch.cpu, whose streams are distinct
    objects too, so the CPU tests run the same code path)."""
    return getattr(torch, device.type, None)


if HAS_CUSTOM_COMMS:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
else:  # torch 2.7: never instantiated (FSDP2Config refuses it there)

    class _AllGatherBase:  # type: ignore[no-redef]
        pass

    class _ReduceScatterBase:  # type: ignore[no-redef]
        pass


class ComputeStreamAllGather(_AllGatherBase):
    """An `AllGather` comm whose flat outputs come from the compute stream's memory pool.

    The compute stream is the current stream when the root module's forward starts
    (`note_compute_stream`, a forward pre-hook the engine puts before FSDP2's own).
    """

    def __init__(self, handle_for: Callable[[torch.device], Any] = _stream_handle) -> None:
        self._handle_for = handle_for
        self.compute_stream: Any = None
        self.outputs_from_compute_stream = 0

    def note_compute_stream(self, device: torch.device) -> None:
        handle = self._handle_for(device)
        if handle is not None and hasattr(handle, "current_stream"):
            self.compute_stream = handle.current_stream(device)

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        handle = self._handle_for(device)
        if handle is None or self.compute_stream is None or not hasattr(handle, "current_stream"):
            return torch.empty(*size, dtype=dtype, device=device)
        current = handle.current_stream(device)
        if current == self.compute_stream:  # async unshard: FSDP2 already uses the compute stream
            return torch.empty(*size, dtype=dtype, device=device)
        current.wait_stream(self.compute_stream)
        with handle.stream(self.compute_stream):
            output = torch.empty(*size, dtype=dtype, device=device)
        self.outputs_from_compute_stream += 1
        return output

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        # Through `_fsdp_collectives.dist`, so the pre-collective hook (its proxy) still fires.
        return _fsdp_collectives.dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class ComputeStreamReduceScatter(_ReduceScatterBase):
    """A `ReduceScatter` comm whose outputs come from the compute stream's memory pool.

    One instance serves every FSDP2 module of one root (they share one reduce-scatter stream
    and FSDP2's "wait for the previous reduce-scatter" rule). `handle_for(device)` returns the
    stream module for a device (tests pass fake streams to check the release rule on CPU).
    """

    def __init__(self, handle_for: Callable[[torch.device], Any] = _stream_handle) -> None:
        self._handle_for = handle_for
        self._compute_stream: Any = None
        self._reduce_stream: Any = None
        self._held: list[torch.Tensor] = []
        self._expect_output = False
        self._release_queued = False
        self.outputs_from_compute_stream = 0  # counters, for tests and benchmarks
        self.max_held = 0

    # -- the ReduceScatter interface ------------------------------------------------------------

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        handle = self._handle_for(device)
        if handle is None or not hasattr(handle, "current_stream"):
            return torch.empty(*size, dtype=dtype, device=device)
        current = handle.current_stream(device)
        if not self._expect_output or current == self._compute_stream:
            # `foreach_reduce` allocates the input first, on the compute stream (the current
            # stream when `post_backward` runs); remember which stream that is. (Equal streams
            # with an output due: the previous reduction failed between its two allocations.)
            self._compute_stream = current
            self._expect_output = True
            return torch.empty(*size, dtype=dtype, device=device)
        # The output, inside FSDP2's `with stream(reduce_scatter_stream)`.
        self._expect_output = False
        self._reduce_stream = current
        # The compute stream has waited for the previous reduce-scatter's event: every output but
        # the newest held one is no longer used by pending reduce-scatter-stream work.
        del self._held[:-1]
        with handle.stream(self._compute_stream):
            output = torch.empty(*size, dtype=dtype, device=device)
        self._held.append(output)
        self.outputs_from_compute_stream += 1
        self.max_held = max(self.max_held, len(self._held))
        self._queue_release_after_backward()
        return output

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        # Through `_fsdp_collectives.dist`, so the pre-collective hook (its proxy) still fires.
        return _fsdp_collectives.dist.reduce_scatter_tensor(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        return len(self._held)

    def _queue_release_after_backward(self) -> None:
        if self._release_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._release_after_backward)
        except RuntimeError:
            return  # not inside a backward: the next output or `release_all()` drops them
        self._release_queued = True

    def _release_after_backward(self) -> None:
        self._release_queued = False
        self.release_all()

    def release_all(self) -> None:
        """Order the compute stream after all reduce-scatter work, then drop every held output."""
        if self._held and self._reduce_stream is not None and self._compute_stream is not None:
            self._compute_stream.wait_stream(self._reduce_stream)
        self._held.clear()

    def reset(self) -> None:
        """After a failed attempt (`recover()`): nothing pending, nothing held."""
        self.release_all()
        self._release_queued = False
        self._expect_output = False


def install_compute_stream_comms(
    root: nn.Module, modules: list[FSDPModule], device: torch.device
) -> tuple[ComputeStreamAllGather, ComputeStreamReduceScatter, Any]:
    """Give every FSDP2 module of one root the same compute-stream all-gather and reduce-scatter
    comms (torch >= 2.9). Returns them and the handle of the root pre-forward hook that tells the
    all-gather comm which stream computes."""
    if not HAS_CUSTOM_COMMS:
        raise RuntimeError(f"custom FSDP2 comms need torch >= 2.9 (found {torch.__version__})")
    all_gather = ComputeStreamAllGather()
    reduce_scatter = ComputeStreamReduceScatter()
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)

    def note(module: nn.Module, args: Any) -> None:
        all_gather.note_compute_stream(device)

    # prepend: before FSDP2's root pre-forward, which issues the root's all-gather.
    handle = root.register_forward_pre_hook(note, prepend=True)
    return all_gather, reduce_scatter, handle


def all_gather_comm(module: FSDPModule) -> Any:
    """The comm object FSDP2 uses for this module's all-gather (None without parameters)."""
    group = param_group(module)
    return None if group is None else getattr(group, "_all_gather_comm", None)


def reduce_scatter_comm(module: FSDPModule) -> Any:
    """The comm object FSDP2 uses for this module's reduce-scatter (None without parameters)."""
    group = param_group(module)
    # torch 2.7 has no comm objects (the attribute appears with the comm API).
    return None if group is None else getattr(group, "_reduce_scatter_comm", None)


# --------------------------------------------------------------------------------------------
# Host offload switched on at run time (checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------
#
# `fully_shard(..., offload_policy=CPUOffloadPolicy())` decides at build time where each sharded parameter lives:
# `FSDPParam._init_sharded_param` copies the padded shard to the host (pinned) and wraps it in the sharded
# parameter's DTensor; from then on the all-gather copies it to the device first (`all_gather_inputs`), the
# reduce-scatter's output goes to the host (`foreach_reduce`, `grad_offload_event`), and the optimizer steps on the
# host. What reads the choice at run time is `FSDPParam.offload_to_cpu` / `pin_memory` and the group's
# `offload_policy` (the lazy init's check only). So switching it on between two batches is: those flags, the padded
# shard copied to the host, and the sharded parameter's DTensor rebuilt over it, swapped into the same Python object
# (`torch.utils.swap_tensors`) so that the module, the optimizer and every other holder keep their parameter.


def offload_sharded_params(modules: list[FSDPModule], pin_memory: bool) -> int:
    """Switch every parameter of `modules` to FSDP2's CPU offload, as `CPUOffloadPolicy(pin_memory)` at build time
    would have placed it. Between batches only: every group idle and sharded, no gradient held. Returns the bytes
    moved to the host (parameters already there are left)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    moved = 0
    for module in modules:
        group = param_group(module)
        if group is None:
            continue
        if group._training_state != TrainingState.IDLE:
            raise RuntimeError("automicro: the host offload is switched on between batches (a module is mid-step)")
        group.offload_policy = CPUOffloadPolicy(pin_memory=pin_memory)
        for fsdp_param in group.fsdp_params:
            if fsdp_param.offload_to_cpu:
                continue
            if fsdp_param.sharded_state != ShardedState.SHARDED:
                raise RuntimeError(f"automicro: {fsdp_param._param_fqn} is not sharded; the host offload needs every module resharded")
            param = fsdp_param.sharded_param
            if param.grad is not None:
                raise RuntimeError(f"automicro: {fsdp_param._param_fqn} holds a gradient; the host offload is switched on with none")
            data = fsdp_param._sharded_param_data
            if type(data) is not torch.Tensor:
                raise RuntimeError(
                    f"automicro: {fsdp_param._param_fqn} is a tensor subclass ({type(data).__name__}) FSDP2 gathers with its own "
                    "hooks; the host offload is not switched on at run time there (set cpu_offload: true by hand)"
                )
            host = data.to("cpu", copy=True)
            if pin_memory:
                host = host.pin_memory()
            dim = fsdp_param.fsdp_placement.dim
            local = param._local_tensor
            length = local.size(dim) if local.numel() > 0 else 0
            shard = host.view(fsdp_param.padded_sharded_param_size).narrow(dim, 0, length)
            fresh = nn.Parameter(fsdp_param.to_sharded_dtensor(shard), requires_grad=param.requires_grad)
            fresh.__dict__.update(param.__dict__)
            torch.utils.swap_tensors(param, fresh)  # `param` (every holder's object) is the host one now
            fsdp_param._sharded_param_data = host.view(-1)
            fsdp_param.offload_to_cpu, fsdp_param.pin_memory = True, pin_memory
            fsdp_param.grad_offload_event = None
            moved += host.numel() * host.element_size()
    return moved


def offloaded(modules: list[FSDPModule]) -> bool:
    """Every parameter of `modules` lives on the host (FSDP2's CPU offload, set at build time or switched on)."""
    groups = [param_group(m) for m in modules]
    params = [p for g in groups if g is not None for p in g.fsdp_params]
    return bool(params) and all(p.offload_to_cpu for p in params)


def tensor_to_host(value: torch.Tensor) -> torch.Tensor:
    """`value` (an optimizer's state: a DTensor over a sharded parameter, or a plain tensor) copied to the host; a
    DTensor keeps its mesh and placements, its local tensor on the host as FSDP2's offloaded parameters have it
    (`dtensor_like`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return dtensor_like(value._local_tensor.to("cpu"), value)
    return value.to("cpu")


def dtensor_like(local: torch.Tensor, like: Any) -> torch.Tensor:
    """A DTensor over `local` with `like`'s mesh, placements, shape and stride, `local` kept where it is: on the host
    under FSDP2's CPU offload, where `DTensor.from_local` would copy it to the mesh's device (an optimizer's state
    made by a step on local shards, `automicro.engine.local_step`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = like._spec
    meta = TensorMeta(like.shape, like.stride(), local.dtype)
    return _from_local_no_grad(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta))


def reset_reduce_scatter_comm(module: FSDPModule) -> None:
    """FSDP2's own reduce-scatter comm back on `module` (torch >= 2.9; the engine's compute-stream one is not used
    with the host offload: `install_compute_stream_comms`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    module.set_custom_reduce_scatter(DefaultReduceScatter())


# --------------------------------------------------------------------------------------------
# Storage resize observers (checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------
#
# FSDP2 frees and re-allocates its unsharded parameters with `UntypedStorage.resize_`, outside
# the dispatcher, so a `TorchDispatchMode` never sees that memory come and go. The CPU memory cap
# of the test kit (`automicro.testing.memory_cap`) needs to. While at least one observer is
# registered, `torch.UntypedStorage.resize_` (inherited from `torch._C.StorageBase`) is wrapped;
# removing the last observer deletes the wrapper, so torch's own method is back exactly.


class StorageResizeObserver(Protocol):
    """Told around every `UntypedStorage.resize_` while registered: `before_resize` may raise
    (the resize then does not happen)."""

    def before_resize(self, storage: Any, new_nbytes: int) -> None: ...

    def after_resize(self, storage: Any) -> None: ...


_resize_lock = threading.Lock()
_resize_observers: list[StorageResizeObserver] = []
_original_resize: Any = None


def storage_key(storage: Any) -> int:
    """A storage's identity for as long as it lives (its C++ object's address, `_cdata`)."""
    return storage._cdata


# The c10d ops whose gloo `Work` never says it completed, waited on or not (`is_completed()` stays False, `get_future()`
# raises "not implemented"): the reduce-scatters (seen on torch 2.7.0, 2.11.0 and 2.15.0; FSDP2 reduces its gradients
# with `_reduce_scatter_base_`). Checked by tests/test_testing_tools.py on every supported torch.
_GLOO_WORK_NEVER_COMPLETES = frozenset({"reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"})


def work_reports_completion(op: Any) -> bool:
    """Whether a c10d op's gloo `Work` says when it completed (`_GLOO_WORK_NEVER_COMPLETES`)."""
    name = getattr(op, "__name__", "")  # `c10d._reduce_scatter_base_.default`: "_reduce_scatter_base_.default"
    return name.split(".")[0] not in _GLOO_WORK_NEVER_COMPLETES


def collective_work(op: Any, out: Any) -> Any:
    """The `Work` of a c10d collective op (`c10d.allreduce_`, `c10d._allgather_base_`, ...: what
    `torch.distributed`'s collectives dispatch, async or not) from the op's outputs, where the
    dispatcher returns it boxed as a `ScriptObject`; None for any other op. Checked on torch 2.7.0,
    2.11.0 and 2.15.0 (`Work.unbox`)."""
    if getattr(op, "namespace", None) != "c10d":
        return None
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.ScriptObject):
            try:
                return torch._C._distributed_c10d.Work.unbox(leaf)
            except (AttributeError, RuntimeError, TypeError):
                return None
    return None


def _observed_resize_(storage: Any, size: int) -> Any:
    observers = list(_resize_observers)
    for observer in observers:
        observer.before_resize(storage, int(size))
    result = _original_resize(storage, size)
    for observer in observers:
        observer.after_resize(storage)
    return result


class _ResizeHandle:
    def __init__(self, observer: StorageResizeObserver) -> None:
        self._observer: Any = observer

    def remove(self) -> None:
        with _resize_lock:
            if self._observer is None:
                return
            _resize_observers.remove(self._observer)
            self._observer = None
            if not _resize_observers and torch.UntypedStorage.__dict__.get("resize_") is _observed_resize_:
                del torch.UntypedStorage.resize_


def add_storage_resize_observer(observer: StorageResizeObserver) -> _ResizeHandle:
    """Register `observer` for every `UntypedStorage.resize_` in this process; `.remove()` the
    handle to stop (the last removal restores torch's method)."""
    global _original_resize
    with _resize_lock:
        if not _resize_observers:
            _original_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _observed_resize_
        _resize_observers.append(observer)
    return _ResizeHandle(observer)


# torch 2.11 and 2.15 ask a dispatch mode whether `torch.compile` may compile under it
# (`ignore_compile_internals`: off while compiling, on while the compiled code runs). torch 2.7 has
# no such question: dynamo skips every frame under a mode that is not one of its own, and marking the
# mode "infra" (`is_infra_mode`) compiles but recompiles on every call (a guard that fails while any
# mode is active; checked on torch 2.7.0), so there it stays eager.
COMPILES_UNDER_DISPATCH_MODES = hasattr(TorchDispatchMode, "ignore_compile_internals")


def compiles_under(mode_cls: type) -> type:
    """Class decorator: let `torch.compile` compile while a `TorchDispatchMode` of `mode_cls` is
    active, the mode seeing the compiled code's ops as they run (not dynamo's tracing). Without it
    dynamo skips every frame under the mode, silently: no graph, the function runs eager (the CPU
    memory cap, `automicro.testing.MemoryCap`, turned every `compile` under it into eager). Where
    torch cannot (`COMPILES_UNDER_DISPATCH_MODES` False: torch 2.7) the class is left as it is."""
    if COMPILES_UNDER_DISPATCH_MODES:
        mode_cls.ignore_compile_internals = classmethod(lambda cls: True)
    return mode_cls


# --------------------------------------------------------------------------------------------
# Pipelining (`torch.distributed.pipelining`; checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------
#
# automicro runs torch's pipeline stages with its own lockstep executor (`engine.pipeline`): the
# schedule's compute order comes from torch's schedule classes (public), each action runs through
# the stage's own methods (`forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk`,
# `get_*_ops`: public names on a private base class). Private here: the action fields of
# `pipeline_order`, the stage set-up (`_initialize_stages`, whose signature and work differ
# between versions) and the end of an FSDP stage's backward (torch 2.7 runs it inside the last
# backward, 2.11+ as `perform_reduce_grad`), and the stage's runtime caches a failed attempt
# leaves behind.

_PIPELINE_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def pipeline_schedule_class(name: str) -> Any:
    """torch's schedule class by its public name (`torch.distributed.pipelining.schedules`)."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, name)


def pipeline_compute_order(schedule: Any) -> dict[int, list[tuple[str, int, int]]]:
    """Each pipeline rank's compute actions, in order, as (kind, stage, microbatch); kind is F
    (forward), B (full backward), I (input gradient) or W (weight gradient). Bubbles (None) and
    communication actions are left out: the executor times the actions itself."""
    order: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in schedule.pipeline_order.items():
        rows = []
        for action in actions:
            if action is None:
                continue
            kind = _PIPELINE_KINDS.get(getattr(action.computation_type, "name", str(action.computation_type)))
            if kind is None:
                continue
            rows.append((kind, int(action.stage_index), int(action.microbatch_index)))
        order[rank] = rows
    return order


def initialize_pipeline_stages(schedule: Any, first_stage_args: tuple[Any, ...]) -> None:
    """Allocate the stages' receive buffers for the schedule's microbatch count (what the
    schedule's first `step()` does). On 2.11+ it also exchanges one warm-up message with the
    neighbouring stages: every stage must call it at the same point."""
    schedule._initialize_stages(first_stage_args, {})


def check_pipeline_exchange_group() -> None:
    """torch 2.15's `torch.distributed.config.pipeline_per_edge_p2p` gives each stage-to-stage edge
    a group of its own; automicro's drain (`stage_placeholders`) exchanges on the stage's group."""
    if TORCH_VERSION < (2, 15):
        return
    from torch.distributed import config as dist_config

    if getattr(dist_config, "pipeline_per_edge_p2p", False):
        raise RuntimeError(
            "automicro: torch.distributed.config.pipeline_per_edge_p2p is on (TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P); "
            "automicro's pipeline executor exchanges on each pipeline's own group: turn it off"
        )


def stage_placeholders(
    inputs_meta: tuple[torch.Tensor, ...],
    outputs_meta: tuple[torch.Tensor, ...],
    is_first: bool,
    is_last: bool,
    device: torch.device,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Tensors standing in for one time step's sends and receives of a `PipelineStage` that can no
    longer compute (a failed attempt's drain): (forward sends, input-gradient sends, forward
    receives, gradient receives). They mirror torch's stage protocol, the same on 2.7, 2.11 and
    2.15: `get_fwd_send_ops` sends each output tensor to the next stage (`act_send_info`: one
    destination per output), `get_bwd_send_ops` sends a gradient for every input received from the
    previous stage (`_create_grad_send_info`: every `_RecvInfo`), and the receive buffers are
    shaped as `_make_tensor_from_meta` makes them from the same meta tensors. torch 2.15 exchanges
    gradients only for boundary tensors that require grad (`_derive_grad_metas`), on the stage's
    group unless `torch.distributed.config.pipeline_per_edge_p2p` (off by default;
    `check_pipeline_exchange_group` refuses it) gives each edge a group of its own."""

    def make(metas: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return [torch.zeros(m.shape, dtype=m.dtype, device=device) for m in metas]

    def grads(metas: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(m for m in metas if m.requires_grad) if TORCH_VERSION >= (2, 15) else metas

    return (
        make(outputs_meta) if not is_last else [],
        make(grads(inputs_meta)) if not is_first else [],
        make(inputs_meta) if not is_first else [],
        make(grads(outputs_meta)) if not is_last else [],
    )


def finish_stage_backward(stage: Any) -> None:
    """After a stage's last backward of the batch: FSDP2's post-backward (the reduce-scatter of
    the accumulated gradients, reshard) and its final callback. No gradient scaling: automicro
    scales each microbatch's loss instead."""
    if hasattr(stage, "perform_reduce_grad"):  # torch >= 2.11
        stage.perform_reduce_grad(1)
        return
    module = stage.submod  # torch 2.7: what its `backward_maybe_with_nosync` does on the last backward
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fsdp_state(module)
    for each in state._state_ctx.all_states:
        if each._fsdp_param_group:
            each._fsdp_param_group.post_backward()
    state._root_post_backward_final_callback()


def drop_finished_microbatch(stage: Any, microbatch: int) -> None:
    """After a microbatch's input gradient was computed and sent: the gradient torch leaves as the
    `.grad` of its receive buffer (2.7, 2.11) and its entry in the output chunks (kept for a merge
    the executor never asks for) are needed by nobody; without this they live to the end of the
    batch, one boundary tensor per finished microbatch."""
    infos = getattr(stage, "args_recv_info", None)
    for info in infos.get(microbatch, ()) if isinstance(infos, dict) else ():
        buffer = getattr(info, "buffer", None)
        if isinstance(buffer, torch.Tensor):
            buffer.grad = None
    chunks = getattr(stage, "output_chunks", None)
    if isinstance(chunks, list) and microbatch < len(chunks):
        chunks[microbatch] = None


# torch 2.7 and 2.11: `stage_backward_input` hangs a pre-hook on each intermediate autograd node,
# whose closure holds the node list (`param_groups`), and removes the hooks only after
# `autograd.grad` returns. An OOM inside it leaves node -> hook -> closure -> node cycles through
# C++ that Python's collector cannot see: the microbatch's graph stays alive for good. torch 2.15
# removes the hooks in a `finally`. On the older versions the wrapper below empties the node lists
# when it raises, which breaks the cycles.
_INPUT_GRAD_LEAKS_ON_FAILURE = TORCH_VERSION < (2, 15)
_input_grad_cleanup_installed = False


def install_input_grad_failure_cleanup() -> None:
    """Idempotent; a no-op on torch >= 2.15 (checked on 2.7.0 and 2.11.0)."""
    global _input_grad_cleanup_installed
    if not _INPUT_GRAD_LEAKS_ON_FAILURE or _input_grad_cleanup_installed:
        return
    from torch.distributed.pipelining import _backward, stage as stage_module

    original = stage_module.stage_backward_input

    def stage_backward_input(*args: Any, **kwargs: Any) -> Any:
        made: list[Any] = []
        find_groups = _backward.get_param_groups

        def recording(*a: Any, **k: Any) -> Any:
            groups = find_groups(*a, **k)
            made.append(groups)
            return groups

        _backward.get_param_groups = recording
        try:
            return original(*args, **kwargs)
        except BaseException:
            for groups in made:
                for group in groups:
                    group.clear()
            raise
        finally:
            _backward.get_param_groups = find_groups

    stage_module.stage_backward_input = stage_backward_input
    _input_grad_cleanup_installed = True


def release_stage(stage: Any) -> None:
    """Drop everything a stage holds between actions of one batch (cached stage outputs and
    inputs with their autograd graphs, zero-bubble weight-gradient state, input gradients, the
    last stage's output chunks) and the receive buffers, after a batch or a failed attempt: none
    of it may keep memory or a graph alive into the next attempt."""
    for name in ("fwd_cache", "bwd_cache", "backward_state", "dw_runner", "output_chunks"):
        cache = getattr(stage, name, None)
        if cache is not None:
            cache.clear()
    for name in ("args_recv_info", "grad_recv_info"):
        infos = getattr(stage, name, None)
        if isinstance(infos, dict):
            infos.clear()
    module = stage.submod
    if isinstance(module, FSDPModule):
        # The stage's backward turned these off for accumulation; a failed attempt never turned them back.
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place write counter (``Tensor._version``: every in-place op on it or a view of it bumps it; read
    on the host, nothing runs on the device). Checked on torch 2.7.0, 2.11.0 and 2.15.0."""
    return int(tensor._version)


def compiled_graph_count() -> int:
    """Graphs dynamo compiled in this process (first compiles and recompiles alike): its
    ``counters["stats"]["unique_graphs"]``, the same on torch 2.7, 2.11 and 2.15."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> dict[str, int]:
    """Why dynamo broke a graph, or gave up on one, in this process so far, and how often: its
    ``counters["graph_break"]`` and ``counters["unimplemented"]`` (where a backend's failure adds the break: torch 2.11
    and 2.15 count it there only), keyed by the reason's first line, with the failing operator where a backend failed
    (its ``Exception:`` line). The keys differ by version (torch 2.7: "Dynamic shape operator"; 2.11 and 2.15: a
    paragraph whose first line is the reason); one break counted in both counters is counted once (the larger count).
    Checked on torch 2.7.0, 2.11.0 and 2.15.0."""
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    for group in ("graph_break", "unimplemented"):
        seen: dict[str, int] = {}
        for key, count in counters[group].items():
            lines = [line.strip() for line in str(key).splitlines() if line.strip()]
            reason = lines[0] if lines else str(key)
            failed = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Exception:")), "")
            reason = f"{reason}: {failed}" if failed else reason
            seen[reason] = seen.get(reason, 0) + int(count)
        for reason, count in seen.items():
            out[reason] = max(out.get(reason, 0), count)
    return out


def compile_seconds() -> list[float]:
    """The seconds of each frame dynamo compiled in this process (its `compile_inner`: tracing and the backend's
    compile, inductor's included), from ``torch._dynamo.utils.compilation_time_metrics``; empty where the
    process compiled nothing or this torch keeps no such timings. Checked on torch 2.7.0, 2.11.0 and 2.15.0."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - a torch without it: the plan falls back to compile batches
        return []
    for key in ("_compile.compile_inner", "compile_inner"):
        times = compilation_time_metrics.get(key)
        if times:
            return [float(t) for t in times]
    return []


def mark_batch_dynamic(args: tuple, kwargs: dict) -> None:
    """Mark dimension 0 of a compiled block's batch-sized tensor inputs dynamic, as dynamo's automatic
    dynamic does once it has seen two batch sizes: the first tensor argument's dimension 0 is the
    batch; every tensor argument (or one inside a tuple or list argument) of that leading size gets
    ``torch._dynamo.maybe_mark_dynamic(t, 0)`` (no error where the code specializes it; sizes 0 and
    1 stay static). The other dimensions stay static. Checked on torch 2.7.0, 2.11.0, 2.15.0."""
    mark = torch._dynamo.maybe_mark_dynamic
    values = [*args, *kwargs.values()]
    flat = [t for v in values for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
    if not flat or flat[0].dim() == 0:
        return
    batch = flat[0].shape[0]
    for tensor in flat:
        if tensor.dim() > 0 and tensor.shape[0] == batch:
            mark(tensor, 0)



class ProfiledEvent(tuple):
    """One event of a profiled batch: (name, on_device, start_ns, end_ns, correlation, linked, thread)."""

    __slots__ = ()
    name = property(lambda self: self[0])
    on_device = property(lambda self: self[1])  # a kernel, copy or set on the accelerator (else a host event)
    start_ns = property(lambda self: self[2])
    end_ns = property(lambda self: self[3])
    correlation = property(lambda self: self[4])  # a kernel's: its launch's (the CUDA runtime call's) id
    linked = property(lambda self: self[5])
    thread = property(lambda self: self[6])


def profiler_events(profile: Any) -> list[ProfiledEvent]:
    """The events of a finished `torch.profiler.profile`, read from its kineto results directly (`prof.events()`
    builds a Python tree of every event: seconds on a compiled batch of tens of thousands of kernels). The
    ``profiler.kineto_results`` attribute and `_KinetoEvent`'s accessors are not documented; checked on torch
    2.7.0, 2.11.0 and 2.15.0 (the accessors used here exist and mean the same on each)."""
    results = getattr(getattr(profile, "profiler", None), "kineto_results", None)
    if results is None:
        return []
    from torch.autograd import DeviceType

    out: list[ProfiledEvent] = []
    for event in results.events():
        start = int(event.start_ns())
        out.append(ProfiledEvent((
            event.name(), event.device_type() != DeviceType.CPU, start, start + int(event.duration_ns()),
            int(event.correlation_id()), int(event.linked_correlation_id()), int(event.start_thread_id()),
        )))
    return out


# --------------------------------------------------------------------------------------------
# Layout trades (`automicro.engine.layout`; checked on torch 2.7.0, 2.11.0 and 2.15.0)
# --------------------------------------------------------------------------------------------
#
# `FSDPModule.set_reshard_after_forward` is public from torch 2.9; torch 2.7 has only the
# param group's `post_forward_mesh_info` (the mesh to reshard to after forward; None: keep the
# parameters unsharded until backward), which the public setter also writes.
HAS_SET_RESHARD_AFTER_FORWARD = hasattr(FSDPModule, "set_reshard_after_forward")


def set_block_reshard_after_forward(module: FSDPModule, reshard: bool) -> None:
    """Reshard (True) or keep (False) one FSDP2 module's parameters after forward, this module only."""
    if HAS_SET_RESHARD_AFTER_FORWARD:
        module.set_reshard_after_forward(reshard, recurse=False)
        return
    group = param_group(module)
    if group is not None:
        group.post_forward_mesh_info = group.mesh_info if reshard else None


def reshards_after_forward(module: FSDPModule) -> bool:
    group = param_group(module)
    return group is not None and group.post_forward_mesh_info is not None


def reshards_to_whole_mesh(module: FSDPModule) -> bool:
    """Whether the module frees its unsharded parameters back to its whole mesh after forward
    (``reshard_after_forward=True``; False for False, or an int that reshards to a smaller mesh)."""
    group = param_group(module)
    return group is not None and group.post_forward_mesh_info is not None and group.post_forward_mesh_info == group.mesh_info


def unsharded_param_bytes(modules: list[FSDPModule]) -> tuple[int, int, int]:
    """(parameter bytes, gradient bytes, sharded gradient bytes) of every module's parameters:
    unsharded, parameters in the dtype forward computes in, gradients in the wider of that and the
    reduce dtype (what an accumulated unsharded gradient is kept in); and this rank's sharded
    gradients, in the sharded parameters' dtype (what a reduce-scatter leaves in `.grad`)."""
    params = grads = sharded = 0
    for module in modules:
        group = param_group(module)
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            numel = 1
            for dim in fsdp_param._orig_size:
                numel *= int(dim)
            orig = fsdp_param.sharded_param.dtype
            # Set at FSDP2's lazy init (the first forward); before it, the policy: the group's on
            # torch 2.7 and 2.11, each parameter's own (resolved per parameter) on 2.15.
            policy = getattr(fsdp_param, "mp_policy", None) or getattr(group, "mp_policy", None)
            compute = getattr(fsdp_param, "param_dtype", getattr(policy, "param_dtype", None)) or orig
            reduce = getattr(fsdp_param, "reduce_dtype", getattr(policy, "reduce_dtype", None)) or compute
            params += numel * compute.itemsize
            grads += numel * max(compute.itemsize, reduce.itemsize)
            local = fsdp_param.sharded_param
            local = local.to_local() if hasattr(local, "to_local") else local  # a DTensor: this rank's shard
            sharded += local.numel() * orig.itemsize
    return params, grads, sharded


# --------------------------------------------------------------------------------------------
# Module-level compile (`nn.Module.compile`; checked on torch 2.15.0, where torchtitan 0.3.0 runs)
# --------------------------------------------------------------------------------------------
# `nn.Module.compile` compiles the module's `_call_impl`, its hooks with it (torchtitan compiles each
# block so, fullgraph). automicro's sync hooks sit on those blocks and run a consensus round (a
# collective and a read of its result): traced, they break a fullgraph compile. Compiling the
# block's `forward` in place instead (what `automicro.engine.compile` does for its own blocks)
# leaves the hooks, FSDP2's and automicro's, eager around the same compiled code.


def compile_forwards_not_hooks(root: torch.nn.Module, **options: Any) -> int:
    """Every module under `root` compiled with `nn.Module.compile` gets its `forward` compiled in
    place with `options` instead (`torch.compile`'s keywords); returns how many."""
    moved = 0
    for module in root.modules():
        if getattr(module, "_compiled_call_impl", None) is None:
            continue
        module._compiled_call_impl = None
        module.forward = torch.compile(module.forward, **options)
        moved += 1
    return moved
