"""The fault kit's Composer callbacks that are not the injector itself: `MemoryCapCallback`
(an emulated per-rank memory limit for a whole fit) and `CapMemory` (the `MemorySource` that
feeds AutoMicrobatching's memory figures from it).

YAML: ``callbacks: {memory_cap: {limit_bytes: {0: 6000000, 1: 9000000}}}`` -- the builder imports
this module only when a config names ``memory_cap``.

Owns: wiring `MemoryCap` into a Composer fit. May not touch: the product's internals; it finds
the auto-microbatching callback by its public `set_memory_source` (no import of
`automicro.integration`, which must never need this kit).
"""

from __future__ import annotations

from typing import Any, Optional

from composer.core import Callback, State
from composer.loggers import Logger

from automicro.testing.memory_cap import MemoryCap


class MemoryCapCallback(Callback):
    """`automicro.testing.MemoryCap` as a Composer callback: an emulated per-rank memory limit on
    CPU for the whole fit, which also feeds AutoMicrobatching's memory figures.

    YAML: ``callbacks: {memory_cap: {limit_bytes: {0: 6000000, 1: 9000000}}}``
    """

    def __init__(self, limit_bytes: Any, retry_band: float = 0.10) -> None:
        if isinstance(limit_bytes, dict):
            bad = {k: v for k, v in limit_bytes.items() if not isinstance(k, int) or not isinstance(v, int) or v <= 0}
            if bad:
                raise ValueError(f"memory_cap.limit_bytes: entries {bad} must map a rank (int) to a positive int of bytes")
        elif isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise ValueError(f"memory_cap.limit_bytes={limit_bytes!r}: must be a positive int of bytes or a {{rank: bytes}} map")
        self.cap = MemoryCap(limit_bytes, retry_band=retry_band)
        self._entered = False

    def fit_start(self, state: State, logger: Logger) -> None:
        if not self._entered:
            self.cap.__enter__()
            self._entered = True
            self.cap.track_existing(state.model, check=False)
            for callback in state.callbacks:
                set_memory_source = getattr(callback, "set_memory_source", None)  # AutoMicrobatching
                if callable(set_memory_source):
                    set_memory_source(CapMemory(self.cap))

    def fit_end(self, state: State, logger: Logger) -> None:
        self.close()

    def close(self, state: Optional[State] = None, logger: Optional[Logger] = None) -> None:
        if self._entered:
            self._entered = False
            self.cap.__exit__(None, None, None)


class CapMemory:
    """`MemorySource` over a `MemoryCap`."""

    def __init__(self, cap: MemoryCap) -> None:
        self.cap = cap

    def reset_peak(self) -> None:
        self.cap.reset_peak()

    def peak_bytes(self) -> int:
        return int(self.cap.peak_bytes)

    def allocated_bytes(self) -> int:
        return int(self.cap.live_bytes)

    def capacity_bytes(self) -> int:
        return int(self.cap.limit_bytes or 0)

    def alloc_retries(self) -> int:
        return int(self.cap.memory_stats()["num_alloc_retries"])

    def empty_cache(self) -> None:
        pass


__all__ = ["CapMemory", "MemoryCapCallback"]
