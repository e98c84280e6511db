"""Where memory figures come from: the CUDA caching allocator, or the CPU `MemoryCap` emulation.

Owns: the `MemorySource` protocol and its CUDA and no-memory sources. May not touch: the
policy, Composer; the CPU emulation lives in `automicro.testing.memory_cap`.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch


class MemorySource(Protocol):
    def reset_peak(self) -> None: ...
    def peak_bytes(self) -> int: ...
    def allocated_bytes(self) -> int: ...
    def capacity_bytes(self) -> int: ...
    def alloc_retries(self) -> int: ...
    def empty_cache(self) -> None: ...


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

    def alloc_retries(self) -> int:
        return 0

    def empty_cache(self) -> None:
        pass


class CudaMemory:
    """The current CUDA device's caching allocator."""

    def __init__(self, memory_fraction: Optional[float] = None) -> None:
        self.memory_fraction = memory_fraction

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated())

    def capacity_bytes(self) -> int:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return int(total * (self.memory_fraction or 1.0))

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class MicrobatchPeaks:
    """The peaks of one attempt's microbatches, by size, over a `MemorySource` whose peak is reset
    as each microbatch starts (the probe of the search, `automicro.core.policy`).

    Only microbatches after the first count toward a size: the first one's backward creates the
    gradients, every later one's peak holds them. `peak_bytes()` is the attempt's peak so far, as
    the source's own would be without the resets."""

    def __init__(self, memory: MemorySource, sizes: tuple[int, ...]) -> None:
        self.memory, self.sizes = memory, sizes
        self._index = -1
        self._attempt_peak = 0
        self._by_size: dict[int, int] = {}

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
            self._by_size[size] = max(self._by_size.get(size, 0), peak)
        self._index = -1

    def peak_bytes(self) -> int:
        return max(self._attempt_peak, self.memory.peak_bytes())

    def by_size(self) -> tuple[tuple[int, int], ...]:
        """(size, peak) of the smallest and the largest size measured (one pair if only one)."""
        known = sorted(self._by_size.items())
        return tuple(known if len(known) < 2 else (known[0], known[-1]))
