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
