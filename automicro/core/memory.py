"""Where memory figures come from: the CUDA caching allocator, or the CPU `MemoryCap` emulation.

The capacity is what this process can still get (DESIGN.md, "Memory truth"): the smaller of
torch's per-process limit and this process's reserved bytes plus the device's free bytes, with
`AutoMicrobatching(memory_fraction)` as a further cap; read on every attempt.

Owns: the `MemorySource` protocol and its CUDA and no-memory sources, the capacity reading. May not touch: the
policy, Composer; the CPU emulation lives in `automicro.testing.memory_cap`.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

# A capacity that moves by more than this fraction is a change: worth a line here, and, growing, it
# reopens the sizes that ran out under less memory (`automicro.core.policy`).
from automicro.core.policy import CAPACITY_CHANGE, capacity_moved


class MemorySource(Protocol):
    def reset_peak(self) -> None: ...
    def peak_bytes(self) -> int: ...
    def allocated_bytes(self) -> int: ...
    def capacity_bytes(self) -> int: ...
    def alloc_retries(self) -> int: ...
    def empty_cache(self) -> None: ...


@dataclass(frozen=True)
class CapacityReading:
    """What this process can still get on its device, and why (bytes; 0: no such limit).

    total: the device's memory (a MIG slice reports its own); free: what the driver says is free
    (`cudaMemGetInfo`), beside `reserved`, what this process's caching allocator already holds;
    torch_limit: torch's per-process fraction times the total (`set_per_process_memory_fraction`);
    own_limit: `AutoMicrobatching(memory_fraction)` times the total."""

    total: int
    free: int
    reserved: int
    torch_limit: int = 0
    own_limit: int = 0

    @property
    def usable(self) -> int:
        limits = [self.reserved + self.free] + [b for b in (self.torch_limit, self.own_limit) if b > 0]
        return max(0, min(limits))

    @property
    def shared(self) -> bool:
        """Whether more than `CAPACITY_CHANGE` of the device is held outside this process's allocator
        (another process, most of the time; this process's CUDA context alone is far less)."""
        return self.total - self.free - self.reserved > CAPACITY_CHANGE * self.total

    @property
    def outside(self) -> int:
        """The bytes held outside this process's allocator where the card is `shared` (else 0)."""
        return self.total - self.free - self.reserved if self.shared else 0

    def why(self) -> str:
        """What makes the capacity smaller than the device total ("" where nothing does)."""
        gib = 2**30
        reasons = []
        if self.reserved + self.free == self.usable and self.shared:
            reasons.append(
                f"{(self.total - self.free - self.reserved) / gib:.1f} GiB of the device is held outside this process's allocator "
                "(another process, this process's CUDA context and communication buffers)"
            )
        own_set = self.own_limit and self.own_limit == self.torch_limit  # AutoMicrobatching set torch's too
        if self.torch_limit and self.torch_limit == self.usable and self.torch_limit < self.total and not own_set:
            reasons.append(f"torch per-process fraction {self.torch_limit / self.total:.2f}")
        if self.own_limit and self.own_limit == self.usable and self.own_limit < self.total:
            reasons.append(f"AutoMicrobatching memory_fraction {self.own_limit / self.total:.2f}")
        return "; ".join(reasons)


class NoMemory:
    """No figures (CPU without a cap): the policy falls back to bisection."""

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int:
        return 0

    def allocated_bytes(self) -> int:
        return 0

    def capacity_bytes(self) -> int:
        return 0

    def held_outside_bytes(self) -> int:
        return 0

    def alloc_retries(self) -> int:
        return 0

    def empty_cache(self) -> None:
        pass


def held_outside_bytes(memory: Any) -> int:
    """What another process holds on this process's device, by `memory`'s reading (0: the card is
    all this process's, or the source cannot tell). A source may leave `held_outside_bytes` out."""
    read = getattr(memory, "held_outside_bytes", None)
    return max(0, int(read())) if callable(read) else 0


def capacity_and_outside(memory: MemorySource) -> tuple[int, int]:
    """(`capacity_bytes`, `held_outside_bytes`) of `memory` from one device reading where the source
    offers one (`capacity_reading`: a CUDA device is queried once per attempt, not twice)."""
    reading = getattr(memory, "capacity_reading", None)
    if callable(reading):
        now = reading()
        return now.usable, now.outside
    return memory.capacity_bytes(), held_outside_bytes(memory)


@dataclass(frozen=True)
class AttemptMark:
    """This rank's memory as an attempt starts (`mark_attempt`); `left_after_wipe` reads it again."""

    allocated: int
    token: Any = None  # the source's own mark, where it can count what was allocated since (`held_since`)


def mark_attempt(memory: MemorySource) -> AttemptMark:
    """Before an attempt: allocated bytes, and the source's own mark where it offers `mark`."""
    mark = getattr(memory, "mark", None)
    return AttemptMark(memory.allocated_bytes(), mark() if callable(mark) else None)


def left_after_wipe(memory: MemorySource, mark: AttemptMark) -> tuple[int, int]:
    """(allocated before the attempt, allocated after its wipe). Where the source can count the
    bytes allocated (or grown) since its mark that are still live (`held_since`), "after" is the
    mark plus those: memory freed during the wipe that was allocated before the attempt (garbage
    the wipe's collection found) then cannot hide what the attempt left. Otherwise (a CUDA device)
    the allocator's total, which such frees can lower."""
    held_since = getattr(memory, "held_since", None)
    if mark.token is not None and callable(held_since):
        return mark.allocated, mark.allocated + int(held_since(mark.token))
    return mark.allocated, memory.allocated_bytes()


def drain_autograd_queue() -> None:
    """Drop what a backward that raised left in this thread's autograd ready queue.

    When a backward raises (an OOM in a kernel or in a hook: FSDP2's pre-backward all-gather, a sync point), the
    autograd engine returns at once and leaves the node tasks that were ready beside the failed one in the calling
    thread's ready queue. Each holds its node, and so the activations the branch below it saved: a routed block's
    experts are such branches, one per expert hit, and a failed backward of two routed blocks left 42.6 MiB of a
    74.4 MiB cap held (transformers' Qwen3-MoE and OLMoE on 2 CPU ranks; torch 2.7, 2.11, 2.15). They are dropped
    only when the next backward on this thread pops them, and a rerun that runs out in its forward never gets there:
    the search took each rerun's OOM for the size's and stepped down to the ladder. A backward of one scalar pops them
    (`tests/test_capacity.py` shows the engine's behaviour and the drain). A GPU's device threads keep popping their
    own queues; what runs on this thread is drained here the same way."""
    with torch.enable_grad():
        torch.zeros((), requires_grad=True).backward()


def release_after_failure(memory: MemorySource) -> None:
    """After a failed attempt, before its rerun: drop the node tasks a failed backward left queued
    (`drain_autograd_queue`), free what only Python reference cycles still hold, then hand the
    allocator's unused blocks back (`empty_cache`, where the source allows it).

    Tensors in reference cycles outlive their last use until the cyclic collector runs, and the
    caching allocator cannot free them: `torch.save` (every checkpoint) leaves its storages in one,
    and llm-foundry's `scheduled_gc` turns the automatic collector off for thousands of batches. A
    size that ran clean then runs out for memory no batch uses; collecting first lets the rerun at
    that size find it (a full collection: tens to hundreds of milliseconds, on failures only)."""
    drain_autograd_queue()
    gc.collect()
    memory.empty_cache()


def read_cuda_capacity(own_fraction: Optional[float] = None) -> CapacityReading:
    """The current CUDA device as it is now: read on every attempt, since other processes take and
    give back memory while this one runs."""
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    fraction = float(torch.cuda.get_per_process_memory_fraction(device))
    return CapacityReading(
        total=int(total),
        free=int(free),
        reserved=int(torch.cuda.memory_reserved(device)),
        torch_limit=int(total * fraction) if fraction < 1.0 else 0,
        own_limit=int(total * own_fraction) if own_fraction else 0,
    )


class CudaMemory:
    """The current CUDA device's caching allocator. Capacity: what this process can still get
    (`read_cuda_capacity`), never the device total alone."""

    def __init__(
        self, memory_fraction: Optional[float] = None, read: Optional[Callable[[], CapacityReading]] = None,
    ) -> None:
        self.memory_fraction = memory_fraction
        self._read = read if read is not None else (lambda: read_cuda_capacity(memory_fraction))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated())

    def capacity_reading(self) -> CapacityReading:
        return self._read()

    def capacity_bytes(self) -> int:
        return self._read().usable

    def held_outside_bytes(self) -> int:
        return self._read().outside

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))

    def empty_cache(self) -> None:
        """Give the allocator's unused blocks back to the device, unless another process holds memory
        on it: that process would take them (an H200, `benchmarks/RESULTS.md` 2026-11-26, a shared card: 20 GiB went, and size 1 no longer
        fit). Where it is kept, the allocator still frees its unused blocks and retries by itself
        before it raises an OOM."""
        if not self._read().shared:
            torch.cuda.empty_cache()


class CapacityWatch:
    """The console's view of the capacity: one line for the first reading (with why it is below the
    device total), one line whenever it moves by more than `CAPACITY_CHANGE` since the last line."""

    def __init__(self) -> None:
        self.announced: Optional[int] = None

    def observe(self, capacity: int, read: Optional[Callable[[], CapacityReading]] = None) -> Optional[str]:
        """The line for `capacity` (agreed), or None. `read`: this rank's reading, for why; called
        only when there is a line (a device query, not one per batch)."""
        if capacity <= 0:
            return None
        mib = 2**20
        before = self.announced
        moved = None if before is None else capacity_moved(before, capacity)
        if before is not None and moved is None:
            return None
        self.announced = capacity
        reading = None if read is None else read()
        why = "" if reading is None else reading.why()
        if moved is not None:
            return f"memory capacity {moved}: {before / mib:.1f} -> {capacity / mib:.1f} MiB" + (f" ({why})" if why else "")
        if reading is None:
            return f"memory capacity {capacity / mib:.1f} MiB"
        return f"memory capacity {capacity / mib:.1f} MiB of the device's {reading.total / mib:.1f} MiB" + (f": {why}" if why else "")


class MicrobatchPeaks:
    """The peaks of one attempt's microbatches, by size, over a `MemorySource` whose peak is reset
    as each microbatch starts (the probe of the search, `automicro.core.policy`).

    Only microbatches after the first count toward a size: the first one's backward creates the
    gradients, every later one's peak holds them. `peak_bytes()` is the attempt's peak so far, as
    the source's own would be without the resets.

    `last_apart`: the last microbatch is not like the others (gradients reduced once per batch, in its
    backward: the reduction's buffers are in its peak, whatever its size). Its peak then sets no size's: the
    line's slope comes from the microbatches between the first and the last, and the line is raised by what
    the last one's peak holds above it (`by_size`), so that it still bounds every microbatch of a batch. On one
    H100 (Mixtral's blocks, gradients reduced once per batch) a line through microbatches of 1 and 2, the
    last one a 2, said 5,377 MiB a sample and "fits 4 at most" where 8 fitted by hand, and gave the same 61,603.6 MiB
    at 2 with and without recompute (`benchmarks/RESULTS.md` 2026-12-06, the twin and the fixed sweeps)."""

    def __init__(self, memory: MemorySource, sizes: tuple[int, ...], last_apart: bool = False) -> None:
        self.memory, self.sizes = memory, sizes
        self.last_apart = last_apart and len(sizes) >= 3
        self._index = -1
        self._attempt_peak = 0
        self._by_size: dict[int, int] = {}
        self._last: Optional[tuple[int, int]] = None  # (size, peak) of the last microbatch, where apart

    def start(self, index: int) -> None:
        """Microbatch `index` starts: the one before it ended."""
        self.end()
        self._index = index
        self.memory.reset_peak()

    def end(self) -> None:
        """The running microbatch ended (the last one: at the end of the attempt)."""
        if self._index < 0:
            return
        peak = self.memory.peak_bytes()
        self._attempt_peak = max(self._attempt_peak, peak)
        if self._index >= 1:
            size = self.sizes[self._index]
            if self.last_apart and self._index == len(self.sizes) - 1:
                self._last = (size, peak)
            else:
                self._by_size[size] = max(self._by_size.get(size, 0), peak)
        self._index = -1

    def peak_bytes(self) -> int:
        return max(self._attempt_peak, self.memory.peak_bytes())

    def by_size(self) -> tuple[tuple[int, int], ...]:
        """(size, peak) of the smallest and the largest size measured (one pair if only one). With the last
        microbatch apart: the two sizes between the first and the last, both raised by what the last one's peak
        holds above their line (where fewer than two sizes ran between them, the last counts as any other)."""
        known = dict(self._by_size)
        if self._last is not None and len(known) < 2:
            size, peak = self._last
            known[size] = max(known.get(size, 0), peak)
        pairs = sorted(known.items())
        pairs = pairs if len(pairs) < 2 else [pairs[0], pairs[-1]]
        if self._last is None or len(self._by_size) < 2:
            return tuple(pairs)
        (a, pa), (b, pb) = pairs
        (c, pc) = self._last
        above = pc - (pa + (pb - pa) * (c - a) / (b - a))
        lift = max(0, int(math.ceil(above)))
        return ((a, pa + lift), (b, pb + lift))
