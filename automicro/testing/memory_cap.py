"""CPU emulation of a per-rank GPU memory limit.

`MemoryCap` counts the bytes of *live tensor storages* created while it is active and raises
`torch.OutOfMemoryError` (message starts like the CUDA allocator's, "CUDA out of memory. Tried to
allocate ...", so Composer-style string checks match) as soon as an op's new output would push
the live total over the limit::

    cap = MemoryCap(64 * 2**20)                   # or {0: 10_000_000, 1: 20_000_000} keyed by rank
    cap.track_existing(model)                     # optional: count parameters created before
    with cap:                                     # active on this thread (backward included)
        loss = model(x).sum(); loss.backward()
    cap.stats()         # live_bytes, peak_bytes, limit_bytes, num_alloc_retries, num_ooms, ...
    cap.memory_stats()  # the same numbers under torch.cuda.memory_stats() names
    cap.reset_peak()

How it counts:

- A `TorchDispatchMode` looks at every op's outputs after the op ran. An output whose storage
  was not seen before and is not the storage of one of the op's inputs (views, in-place and
  `out=` ops alias their inputs) is a new allocation: its `untyped_storage().nbytes()` is added.
  A storage is counted once however many views it has.
- Each counted storage gets a weak reference whose callback subtracts its bytes when the storage
  is freed (torch keeps one Python object per storage for the storage's whole life), so the work
  per op is proportional to its outputs, never a sweep of all storages.
- `UntypedStorage.resize_` (FSDP2 frees and re-allocates unsharded parameters that way, outside
  the dispatcher) is observed while a cap is active (`_torch_internals.add_storage_resize_observer`): growth of a counted storage is checked
  against the limit like an allocation, shrinking is subtracted.
- Tensor subclasses (DTensor, the sharded parameters of `fully_shard`) take no storage of their
  own: their inner plain tensors are counted. An op on a subclass is one op for the cap (its
  inner local ops run below the mode): the inner tensors of its outputs are counted, transient
  buffers inside it (e.g. a DTensor redistribution) are not. FSDP2's own buffers and all module
  compute are on plain tensors and are counted. Wrapper subclasses without `__tensor_flatten__`
  are not counted at all.
- Storages that existed before the cap became active (model parameters) are counted only
  through `track_existing`.
- Counting is per thread that entered the cap (the dispatch mode is thread-local; CPU backward
  runs on the calling thread and is counted); frees are seen from any thread.
- Allocator retries are emulated: an allocation after which the live bytes lie within
  `retry_band` (default 10 %) below the limit counts one `num_alloc_retries`, as the CUDA caching
  allocator frees its cache and retries when it is close to full. An allocation over the limit
  first releases the GIL a few times (1 ms each) so that frees pending in other threads land:
  gloo's worker threads drop the buffers of finished collectives asynchronously, so without it
  the same program would OOM on one run and not on the next. If it then fits, it counts one
  retry; if not, it raises and counts one retry and one `num_ooms` (CUDA also retries before it
  gives up).
- A collective's buffers are freed where the program lets go of them, never when gloo's worker
  thread happens to: a c10d collective's `Work` keeps its tensors until it is destroyed, and the
  worker thread drops its reference to the work just after the collective completes. Where that
  reference is the last one, the tensors died on the worker thread when it next took the GIL, an op
  or two later or earlier from run to run, and the peaks and retries of one program moved by a
  whole buffer (the routed-model tests' sizes 3, 4 or 5 under one cap). So the cap runs each
  collective on aliases of its tensors (`detach()`: the same storages, objects of their own, which
  only the work and what gloo's worker makes of them hold) and keeps the program's tensors itself
  until every alias died: then nothing but the program holds the storages. Once the work completed
  and the program let go of its handle, the cap drops its own and waits for the worker (at most
  `collective_wait_s`), so that the tensors are let go of at that check, not at one a worker's
  timing picks; a collective in flight whose tensors and work the program dropped stays counted
  until its work is gone. The checks run before every counted allocation or resize and in
  `stats()`, so what a peak or a retry sees is a function of the program's order alone.
  (`torch.distributed._functional_collectives`' ops are not held; nor are gloo's reduce-scatters,
  whose work never says it completed (`_torch_internals.work_reports_completion`: held, a
  reduce-scatter's input stayed counted long after FSDP2 was done with it, and the torch 2.11 runs
  ran out of memory early).) A use count cannot tell when the work is gone: gloo's worker drops
  temporaries of its own after the work said it completed, so a count falls while the work lives.

An op that would cross the limit still ran (the check happens on its outputs), but its outputs
are never returned and never counted: they are freed as the exception unwinds.

Only `torch` (and the resize observer in `automicro.engine._torch_internals`, where every private
torch hook lives) is needed; the Composer callback around it is `automicro.testing.callbacks`.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

from automicro.engine._torch_internals import (
    add_storage_resize_observer,
    collective_work,
    compiles_under,
    storage_key,
    work_reports_completion,
)

__all__ = ["MemoryCap", "current_rank"]

LimitSpec = Union[int, float, None, Mapping[int, Union[int, float, None]]]

_EMULATION_TAG = "emulated by automicro.testing.MemoryCap"


def current_rank() -> int:
    """Global rank: from torch.distributed if initialized, else env RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - broken distributed install
        pass
    return int(os.environ.get("RANK", "0"))


def _fmt_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def _plain_storages(obj: Any, out: list) -> None:
    """Append the UntypedStorage of every plain tensor in `obj` (subclasses are flattened into
    their inner tensors; tensors without a real storage are skipped)."""
    if isinstance(obj, torch.Tensor):
        _tensor_storages(obj, out)
    elif isinstance(obj, (tuple, list)):  # op args and outputs: flat, or lists of tensors
        for item in obj:
            if isinstance(item, torch.Tensor):
                _tensor_storages(item, out)
            elif isinstance(item, (tuple, list, dict)):
                _plain_storages(item, out)
    elif isinstance(obj, dict):
        _plain_storages(list(obj.values()), out)
    elif obj is not None and not isinstance(obj, (int, float, bool, str, torch.dtype, torch.device)):
        leaves, _ = tree_flatten(obj)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                _tensor_storages(leaf, out)


def _tensor_storages(t: torch.Tensor, out: list) -> None:
    tp = type(t)
    plain = tp is torch.Tensor or tp is torch.nn.Parameter
    if not plain and is_traceable_wrapper_subclass(t):  # DTensor & co: count the inner tensors
        attrs, _ = t.__tensor_flatten__()
        for name in attrs:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                _tensor_storages(inner, out)
        return
    if t.layout != torch.strided:  # sparse, nested, ...
        return
    try:
        st = t.untyped_storage()
        if not plain:
            st.data_ptr()  # a wrapper subclass has a storage without data: this raises
    except (RuntimeError, NotImplementedError, TypeError):
        return
    if st.device.type == "meta":  # meta / fake tensors allocate nothing
        return
    out.append(st)


class _Collective:
    """A c10d collective the cap holds (`MemoryCap._release_collectives`): `tensors`, the program's tensors the op
    got, which the cap keeps (so that their storages cannot die on gloo's worker thread); `aliases`, a weak reference
    to each alias the op got in their place (`Tensor.detach()`: the same storage, a `TensorImpl` of its own), the
    set emptied by their callbacks as they die. The work keeps its aliases, and whatever gloo's worker makes of them
    (views, temporaries), until every one of them is gone, so an empty set says the work is destroyed and nothing
    but the program and the cap holds the storages; a use count can say no such thing (the worker lets go of
    temporaries after the work said it completed, and a count falls while the work lives). `work`: the cap's
    reference, dropped once the work completed and the program let go of its handle. Only works that say when they
    completed are held (`_torch_internals.work_reports_completion`)."""

    __slots__ = ("work", "tensors", "aliases", "issued")

    def __init__(self, work: Any, tensors: list, aliases: set, issued: int):
        self.work = work
        self.tensors = tensors
        self.aliases = aliases
        self.issued = issued  # the cap's count of collectives when this one was issued


_STALE = 16  # a collective whose work is not gone is let go of once this many came after it (a peer never joined it)


class _Entry:
    __slots__ = ("nbytes", "ref", "what")

    def __init__(self, nbytes: int, ref: "weakref.ref", what: Any = None):
        self.nbytes = nbytes
        self.ref = ref
        self.what = what  # the op that made it: named where another thread frees it (`stats()["foreign_ops"]`)


@compiles_under  # `torch.compile` compiles under the cap, which counts the compiled code's ops
class _CapMode(TorchDispatchMode):
    """The dispatch mode of one activation of a MemoryCap (on one thread)."""

    def __init__(self, cap: "MemoryCap"):
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The mode is popped while we run: neither the op nor our bookkeeping re-enters it.
        if getattr(func, "namespace", None) == "c10d":
            return self.cap._collective_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if not self.cap.paused:
            self.cap._after_op(func, args, kwargs, out)
        return out


class _ResizeWatch:
    """The cap's view of `UntypedStorage.resize_` (`_torch_internals.add_storage_resize_observer`)."""

    def __init__(self, cap: "MemoryCap") -> None:
        self.cap = cap

    def before_resize(self, storage, new_nbytes: int) -> None:
        key = storage_key(storage)
        if self.cap._tracks(key):
            self.cap._before_resize(key, new_nbytes - storage.nbytes())

    def after_resize(self, storage) -> None:
        key = storage_key(storage)
        if self.cap._tracks(key):
            self.cap._resync_one(key, storage)


class MemoryCap:
    """Emulated per-rank device memory limit on live tensor bytes (see module docstring).

    Args:
        limit_bytes: the limit for this process; or a mapping global rank -> limit (the rank is
            read when the cap is entered: torch.distributed if initialized, else env RANK, else
            0; a rank missing from the mapping raises KeyError). None means no limit (counting
            only).
        retry_band: fraction of the limit below it where an allocation counts as an emulated
            allocator retry.
        rank: override the rank used for the mapping and the messages.
        settle_attempts, settle_s: before raising an OOM, release the GIL `settle_attempts`
            times for `settle_s` each, so that frees pending in other threads land first (gloo
            worker threads release finished collectives' buffers asynchronously). Costs nothing
            unless an allocation is over the limit; 0 disables it.
        collective_wait_s: how long a check waits for gloo's worker to let go of a completed
            collective's work once the program dropped its handle (microseconds as a rule; past
            it the tensors stay counted until a later check finds the work gone:
            `stats()["slow_releases"]`). While the program holds the work, the cap keeps the
            work and its tensors counted and waits for nothing.
    """

    def __init__(
        self,
        limit_bytes: LimitSpec,
        *,
        retry_band: float = 0.10,
        rank: Optional[int] = None,
        settle_attempts: int = 3,
        settle_s: float = 0.001,
        collective_wait_s: float = 0.1,
    ):
        if not 0 <= retry_band < 1:
            raise ValueError(f"retry_band must be in [0, 1), got {retry_band}")
        self._settle_attempts = max(0, int(settle_attempts))
        self._settle_s = settle_s
        self._limit_spec = limit_bytes
        self.retry_band = retry_band
        self._rank_override = rank
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        self._live_bytes = 0
        self._peak_bytes = 0
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._num_allocs = 0
        self._foreign_frees = 0
        self._foreign_ops: list[str] = []  # what the first 8 foreign frees were (the op that made it, its bytes, the thread)
        self._threads: set[int] = set()  # the threads that entered the cap
        self._limit: Optional[float] = None
        self._limit_resolved = False
        self._tls = threading.local()
        self._collective_wait_s = collective_wait_s
        self._collectives: list[_Collective] = []
        self._releasing = threading.Lock()
        self._issued = 0
        self._slow_releases = 0

    # ---- configuration -------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank_override if self._rank_override is not None else current_rank()

    def _resolve_limit(self) -> Optional[float]:
        spec = self._limit_spec
        if isinstance(spec, Mapping):
            rank = self.rank
            if rank not in spec:
                raise KeyError(f"MemoryCap: no limit given for rank {rank} (limits for ranks {sorted(spec)})")
            spec = spec[rank]
        if spec is not None and spec < 0:
            raise ValueError(f"MemoryCap: negative limit {spec}")
        self._limit = spec
        self._limit_resolved = True
        return spec

    @property
    def limit_bytes(self) -> Optional[float]:
        if not self._limit_resolved:
            return self._resolve_limit()
        return self._limit

    def set_limit(self, limit_bytes: LimitSpec) -> None:
        """A new limit from now on (another process took or gave back memory); bytes already live
        stay counted, the next allocation is checked against it."""
        with self._lock:
            self._limit_spec = limit_bytes
            self._resolve_limit()

    # ---- activation ----------------------------------------------------------------------------

    def __enter__(self) -> "MemoryCap":
        depth = getattr(self._tls, "depth", 0)
        if depth == 0:
            self._threads.add(threading.get_ident())
            self._resolve_limit()
            self.resync()
            mode = _CapMode(self)
            resize = add_storage_resize_observer(_ResizeWatch(self))
            try:
                mode.__enter__()
            except BaseException:
                resize.remove()
                raise
            self._tls.mode, self._tls.resize = mode, resize
        self._tls.depth = depth + 1
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        depth = self._tls.depth - 1
        self._tls.depth = depth
        if depth == 0:
            mode, self._tls.mode = self._tls.mode, None
            try:
                mode.__exit__(exc_type, exc, tb)
            finally:
                self._tls.resize.remove()
                self._tls.resize = None

    @property
    def paused(self) -> bool:
        """Whether new storages go uncounted on the calling thread (`pause`)."""
        return getattr(self._tls, "paused", False)

    def pause(self) -> None:
        """Count no new storage on the calling thread until `resume()`: what a GPU would hold in host
        memory, such as a checkpoint's state dict (Composer offloads it to the CPU). Frees and
        resizes of storages already counted still are."""
        self._tls.paused = True

    def resume(self) -> None:
        self._tls.paused = False

    @property
    def active(self) -> bool:
        """Whether the cap is active on the calling thread."""
        return getattr(self._tls, "depth", 0) > 0

    # ---- public bookkeeping API ----------------------------------------------------------------

    def track_existing(self, tensors: Union[torch.Tensor, torch.nn.Module, Iterable[torch.Tensor]], *, check: bool = True) -> int:
        """Count already-existing tensors (e.g. the model's parameters and buffers) against the
        limit. Storages already counted are skipped. Returns the bytes newly counted. With
        `check`, raises torch.OutOfMemoryError (counting nothing) if they do not fit."""
        if isinstance(tensors, torch.nn.Module):
            tensors = list(tensors.parameters()) + list(tensors.buffers())
        elif isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        storages: list = []
        for t in tensors:
            if t is not None:
                _tensor_storages(t, storages)
        limit = self.limit_bytes if check else None
        return self._allocate(storages, "track_existing", limit, count_retries=False)

    def stats(self) -> dict:
        """live_bytes, peak_bytes, limit_bytes, num_alloc_retries, num_ooms (+ num_allocs,
        num_tracked_storages, rank, and foreign_frees: counted storages freed on a thread where the
        cap was never entered, such as gloo's worker; 0 where the counts follow the program alone; foreign_ops: the
        first 8 of those, each the op that made it, its bytes and the thread; and slow_releases: waits for gloo's worker
        past `collective_wait_s`, each collective's tensors let go of at a later check)."""
        self._release_collectives()
        self.resync()
        with self._lock:
            return dict(
                live_bytes=self._live_bytes,
                peak_bytes=self._peak_bytes,
                limit_bytes=self.limit_bytes,
                num_alloc_retries=self._num_alloc_retries,
                num_ooms=self._num_ooms,
                num_allocs=self._num_allocs,
                num_tracked_storages=len(self._entries),
                foreign_frees=self._foreign_frees,
                foreign_ops=list(self._foreign_ops),
                slow_releases=self._slow_releases,
                rank=self.rank,
            )

    def memory_stats(self) -> dict:
        """The counters under torch.cuda.memory_stats() key names."""
        s = self.stats()
        return {
            "num_alloc_retries": s["num_alloc_retries"],
            "num_ooms": s["num_ooms"],
            "allocated_bytes.all.current": s["live_bytes"],
            "allocated_bytes.all.peak": s["peak_bytes"],
            "active_bytes.all.current": s["live_bytes"],
            "active_bytes.all.peak": s["peak_bytes"],
            "reserved_bytes.all.current": s["live_bytes"],
            "reserved_bytes.all.peak": s["peak_bytes"],
            "allocation.all.current": s["num_tracked_storages"],
        }

    @property
    def live_bytes(self) -> int:
        self._release_collectives()
        return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak_bytes

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_bytes = self._live_bytes

    def settle(self) -> None:
        """Let frees pending in other threads land (`settle_attempts` GIL releases of `settle_s`):
        before a peak window starts, a buffer gloo's worker has not dropped yet would otherwise
        count in the next window's peak, where on a GPU it is gone."""
        self._release_collectives()
        for _ in range(self._settle_attempts):
            self._settle()

    def mark(self) -> dict[int, tuple["_Entry", int]]:
        """A mark to count what is allocated from now on (`held_since`): each counted storage and
        its size now. O(number of counted storages)."""
        self._release_collectives()
        with self._lock:
            return {key: (entry, entry.nbytes) for key, entry in self._entries.items()}

    def held_since(self, mark: dict[int, tuple["_Entry", int]]) -> int:
        """Live bytes allocated since `mark`: storages counted after it, and what storages counted
        then have grown by (an FSDP2 unsharded parameter's storage is resized up, not allocated)."""
        self._release_collectives()
        with self._lock:
            held = 0
            for key, entry in self._entries.items():
                then = mark.get(key)
                if then is None or then[0] is not entry:
                    held += entry.nbytes
                else:
                    held += max(0, entry.nbytes - then[1])
            return held

    def count_retries(self, retries: int = 1) -> None:
        """Count `retries` allocator retries now, whatever the bytes (a pool another layout left
        fragmented, as a card near its limit shows: the test says when)."""
        with self._lock:
            self._num_alloc_retries += int(retries)

    def reset_counters(self) -> None:
        """Zero num_alloc_retries / num_ooms / num_allocs (live bytes are kept)."""
        with self._lock:
            self._num_alloc_retries = self._num_ooms = self._num_allocs = 0

    def resync(self) -> None:
        """Re-read the size of every counted storage (catches resizes that happened while no cap
        was active). O(number of counted storages); run on enter and by stats()."""
        with self._lock:
            for key, entry in list(self._entries.items()):
                st = entry.ref()
                if st is not None:
                    self._resync_one(key, st)

    # ---- internals -----------------------------------------------------------------------------

    def _tracks(self, key: int) -> bool:
        return key in self._entries

    def _oom(self, requested: int, what: Any, limit: float) -> torch.OutOfMemoryError:
        self._num_ooms += 1
        self._num_alloc_retries += 1
        live = self._live_bytes
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_fmt_bytes(requested)} ({_EMULATION_TAG}): "
            f"rank {self.rank}, op {what}, requested_bytes={requested}, live_bytes={live}, "
            f"limit_bytes={int(limit)}; {_fmt_bytes(live)} live of {_fmt_bytes(limit)} limit, "
            f"{_fmt_bytes(max(limit - live, 0))} free."
        )

    def _settle(self) -> None:
        """Let other threads run (GIL released) so that buffers they are about to free get freed:
        gloo's worker threads release the tensors of finished collectives asynchronously (and
        need the GIL to do so). The emulated counterpart of the CUDA allocator freeing its cache
        before it retries a failed allocation."""
        time.sleep(self._settle_s)

    def _allocate(self, storages: list, what: Any, limit: Optional[float], *, count_retries: bool = True) -> int:
        """Count the new storages among `storages`, all or none: raise OOM (counting nothing)
        if one of them crosses `limit` even after letting pending frees land."""
        for attempt in range(self._settle_attempts + 1):
            with self._lock:
                new = []
                seen = set()
                running = self._live_bytes
                band_floor = None if limit is None else limit * (1.0 - self.retry_band)
                retries = 0
                crossing = None
                for st in storages:
                    key = storage_key(st)
                    if key in seen or key in self._entries:
                        continue
                    seen.add(key)
                    nbytes = st.nbytes()
                    running += nbytes
                    if limit is not None:
                        if running > limit:
                            crossing = nbytes
                            break
                        if count_retries and nbytes and running > band_floor:
                            retries += 1
                    new.append((key, st, nbytes))
                if crossing is not None:
                    if attempt == self._settle_attempts:
                        raise self._oom(crossing, what, limit)
                else:
                    for key, st, nbytes in new:
                        ref = weakref.ref(st, functools.partial(self._on_free, key))
                        self._entries[key] = _Entry(nbytes, ref, what)
                    added = running - self._live_bytes
                    self._live_bytes = running
                    self._num_allocs += len(new)
                    # a retry that succeeded after settling counts once, like CUDA's
                    self._num_alloc_retries += 1 if attempt else retries
                    if running > self._peak_bytes:
                        self._peak_bytes = running
                    return added
            self._settle()  # outside the lock: the frees we wait for take it
        raise AssertionError("unreachable")  # pragma: no cover

    def _on_free(self, key: int, ref: "weakref.ref") -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.ref is ref:
                if threading.get_ident() not in self._threads:  # gloo's worker, an offload thread
                    self._foreign_frees += 1
                    if len(self._foreign_ops) < 8:
                        self._foreign_ops.append(f"{entry.what} ({entry.nbytes} B, {threading.current_thread().name})")
                del self._entries[key]
                self._live_bytes -= entry.nbytes

    def _resync_one(self, key: int, st) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            nbytes = st.nbytes()
            if nbytes != entry.nbytes:
                self._live_bytes += nbytes - entry.nbytes
                entry.nbytes = nbytes
                if self._live_bytes > self._peak_bytes:
                    self._peak_bytes = self._live_bytes

    def _before_resize(self, key: int, delta: int, what: Any = "UntypedStorage.resize_") -> None:
        """Limit check for a counted storage growing by `delta` bytes (resize_)."""
        if delta <= 0 or not self.active:
            return
        self._release_collectives()
        for attempt in range(self._settle_attempts + 1):
            with self._lock:
                limit = self._limit
                if limit is None:
                    return
                after = self._live_bytes + delta
                if after <= limit:
                    if attempt or after > limit * (1.0 - self.retry_band):
                        self._num_alloc_retries += 1
                    return
                if attempt == self._settle_attempts:
                    raise self._oom(delta, what, limit)
            self._settle()

    def _after_op(self, func, args, kwargs, out) -> None:
        outs: list = []
        _plain_storages(out, outs)
        if not outs:
            if getattr(func, "namespace", None) == "inductor":  # inductor.resize_storage_bytes_
                ins: list = []
                _plain_storages((args, kwargs), ins)
                for st in ins:
                    self._resync_one(storage_key(st), st)
            return
        entries = self._entries
        unknown = []
        for st in outs:
            key = storage_key(st)
            entry = entries.get(key)
            if entry is None:
                unknown.append(st)
            elif st.nbytes() != entry.nbytes:  # e.g. aten.resize_ grew or shrank it in place
                self._before_resize(key, st.nbytes() - entry.nbytes, func)
                self._resync_one(key, st)
        if not unknown:
            return
        ins: list = []
        _plain_storages(args, ins)
        if kwargs:
            _plain_storages(kwargs, ins)
        in_keys = {storage_key(st) for st in ins}
        new = [st for st in unknown if storage_key(st) not in in_keys]
        if new:
            self._release_collectives()
            self._allocate(new, func, self._limit)  # func: named only in an OOM message

    # ---- collectives: their buffers freed in the program's order, not the gloo worker's ----------

    def _collective_op(self, func, args, kwargs) -> Any:
        """Run a c10d collective op on aliases of its tensors; count its outputs as any op's and hold its tensors and
        work (`_Collective`) until `_release_collectives` lets go of them on this thread."""
        originals: dict[int, torch.Tensor] = {}  # alias id -> the program's tensor
        aliases: set = set()

        def alias(leaf: Any) -> Any:
            if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
                return leaf
            a = leaf.detach()  # not a view of it: what the worker makes of `a` keeps `a` itself alive
            originals[id(a)] = leaf
            aliases.add(weakref.ref(a, aliases.discard))  # set.discard: one step under the GIL, on any thread
            return a

        args, kwargs = tree_map(alias, (args, kwargs))
        out = func(*args, **kwargs)
        if not self.paused:
            self._after_op(func, args, kwargs, out)
        work = collective_work(func, out)
        out = tree_map(lambda leaf: originals.get(id(leaf), leaf) if isinstance(leaf, torch.Tensor) else leaf, out)
        del args, kwargs  # the aliases: from here on only the work (and what the worker made of them) holds them
        self._issued += 1
        if work is not None and originals and work_reports_completion(func):
            tensors = list({id(t): t for t in originals.values()}.values())
            self._collectives.append(_Collective(work, tensors, aliases, self._issued))
        return out

    def _release_collectives(self) -> None:
        """Let go of the collectives' tensors whose work is gone (see the module docstring): once the work completed
        and the program let go of its handle, the cap drops its own and waits here (at most `collective_wait_s`) for
        gloo's worker to drop the last, so that whether the tensors are let go of now or at a later check does not
        depend on when the worker thread last ran. A collective whose work is not gone after `_STALE` more (one a
        peer never joined) is let go of as it is. Never under the lock: the worker's frees of other storages take it."""
        if not self._collectives or not self._releasing.acquire(blocking=False):
            return  # nothing held, or another thread is at it
        try:
            self._release_held_collectives()
        finally:
            self._releasing.release()

    def _release_held_collectives(self) -> None:
        kept: list[_Collective] = []
        pending, self._collectives = self._collectives, []  # what is held from now on is added there
        for c in pending:
            # `sys.getrefcount(c.work) > 2`: the program still holds the work (besides the cap's reference and the call's)
            if c.aliases and c.work is not None and c.work.is_completed() and sys.getrefcount(c.work) <= 2:
                c.work = None  # where gloo's worker let go of it already, the aliases die here, on this thread
                self._wait_for_work(c)
            if c.aliases and self._issued - c.issued <= _STALE:
                kept.append(c)
        del pending  # the tensors of what was let go of: freed here where the program dropped them too
        self._collectives = kept + self._collectives

    def _wait_for_work(self, c: "_Collective") -> None:
        """Wait (at most `collective_wait_s`, the GIL released) for gloo's worker to drop a completed collective's work
        (a timeout counts in `slow_releases`: the tensors are then let go of at a later check, once the work is gone)."""
        deadline = time.monotonic() + self._collective_wait_s
        while c.aliases and time.monotonic() < deadline:
            time.sleep(0.0001)  # the GIL released: the worker drops the work
        if c.aliases:
            self._slow_releases += 1

    def __repr__(self) -> str:
        return (
            f"MemoryCap(limit_bytes={self._limit_spec!r}, live_bytes={self._live_bytes}, "
            f"peak_bytes={self._peak_bytes})"
        )
