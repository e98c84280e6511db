"""The fault kit's Composer callbacks that are not the injector itself: `MemoryCapCallback`
(an emulated per-rank memory limit for a whole fit) and `CapMemory` (the `MemorySource` that
feeds AutoMicrobatching's memory figures from it).

YAML: ``callbacks: {memory_cap: {limit_bytes: {0: 6000000, 1: 9000000}}}`` -- the builder imports
this module only when a config names ``memory_cap``.

Owns: wiring `MemoryCap` into a Composer fit. May not touch: the product's internals; it finds
the auto-microbatching callback by its public `set_memory_source` (no import of
`automicro.composer`, which must never need this kit).
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

    A card that is not all ours: ``capacity_reads`` is what the capacity reading says instead of the
    limit (bytes, or a {rank: bytes} map: a shared card read as if it were all this process's), and
    ``limit_at_batch`` ({batch index: bytes or {rank: bytes}}) changes the limit as that batch
    starts (another process takes memory, or gives it back); the reading follows the limit unless
    ``capacity_reads`` pins it. ``held_outside`` (bytes, or a {rank: bytes} map) is what the reading
    says another process holds on the rank's device (`automicro.core.memory.held_outside_bytes`).

    Args:
        limit_bytes: The emulated limit: bytes, or ``{rank: bytes}`` (a different limit on each rank).
        retry_band: Allocations within this share of the limit count as allocator retries (0.10: 10%).
        capacity_reads: What the capacity reading says instead of the limit (bytes or ``{rank: bytes}``;
            null: the limit).
        limit_at_batch: ``{batch index: bytes or {rank: bytes}}``: the limit changes as that batch starts.
        held_outside: What the reading says another process holds (bytes or ``{rank: bytes}``).
    """

    def __init__(
        self, limit_bytes: Any, retry_band: float = 0.10, capacity_reads: Any = None,
        limit_at_batch: Optional[dict[int, Any]] = None, held_outside: Any = None,
    ) -> None:
        _check_bytes("memory_cap.limit_bytes", limit_bytes)
        if held_outside is not None:
            _check_bytes("memory_cap.held_outside", held_outside)
        if capacity_reads is not None:
            _check_bytes("memory_cap.capacity_reads", capacity_reads)
        schedule = dict(limit_at_batch or {})
        for batch, limit in schedule.items():
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
                raise ValueError(f"memory_cap.limit_at_batch: key {batch!r} must be a batch index (an int >= 0)")
            _check_bytes(f"memory_cap.limit_at_batch.{batch}", limit)
        self.cap = MemoryCap(limit_bytes, retry_band=retry_band)
        self.capacity_reads = capacity_reads
        self.held_outside = held_outside
        self.limit_at_batch = schedule
        self._entered = False

    # A checkpoint's state dict lives in host memory on a GPU (Composer's saver offloads it to the
    # CPU), and `torch.save` leaves its storages in a reference cycle until the collector runs: on
    # CPU ranks those would count as device memory, a little more each checkpoint. Composer's saver
    # comes after every user callback, so the cap pauses before it saves and resumes at whichever
    # event comes next.
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self.cap.pause()

    epoch_checkpoint = iteration_checkpoint = batch_checkpoint

    def before_dataloader(self, state: State, logger: Logger) -> None:
        self.cap.resume()

    epoch_start = epoch_end = eval_start = iteration_start = before_dataloader

    def batch_start(self, state: State, logger: Logger) -> None:
        self.cap.resume()
        limit = self.limit_at_batch.get(int(state.timestamp.batch))
        if limit is not None:
            self.cap.set_limit(limit)

    def fit_start(self, state: State, logger: Logger) -> None:
        if not self._entered:
            self.cap.__enter__()
            self._entered = True
            self.cap.track_existing(state.model, check=False)
            for callback in state.callbacks:
                set_memory_source = getattr(callback, "set_memory_source", None)  # AutoMicrobatching
                if callable(set_memory_source):
                    set_memory_source(CapMemory(self.cap, self._reads(), self._per_rank(self.held_outside, "held_outside") or 0))

    def fit_end(self, state: State, logger: Logger) -> None:
        self.close()

    def close(self, state: Optional[State] = None, logger: Optional[Logger] = None) -> None:
        self.cap.resume()
        if self._entered:
            self._entered = False
            self.cap.__exit__(None, None, None)


    def _reads(self) -> Optional[int]:
        return self._per_rank(self.capacity_reads, "capacity_reads", required=True)

    def _per_rank(self, value: Any, key: str, required: bool = False) -> Optional[int]:
        """This rank's entry of `value` (bytes, or a {rank: bytes} map; a rank left out of a map
        reads None where not `required`)."""
        if isinstance(value, dict):
            rank = self.cap.rank
            if rank not in value:
                if not required:
                    return None
                raise KeyError(f"memory_cap.{key}: no reading given for rank {rank} (readings for ranks {sorted(value)})")
            return int(value[rank])
        return None if value is None else int(value)


def _check_bytes(key: str, value: Any) -> None:
    if isinstance(value, dict):
        bad = {k: v for k, v in value.items() if not isinstance(k, int) or isinstance(v, bool) or not isinstance(v, int) or v <= 0}
        if bad:
            raise ValueError(f"{key}: entries {bad} must map a rank (int) to a positive int of bytes")
    elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key}={value!r}: must be a positive int of bytes or a {{rank: bytes}} map")


class CapMemory:
    """`MemorySource` over a `MemoryCap`; `reads`: what its capacity reading says instead of the
    limit (None: the limit as it is now); `outside`: what it says another process holds."""

    def __init__(self, cap: MemoryCap, reads: Optional[int] = None, outside: int = 0) -> None:
        self.cap = cap
        self.reads = reads
        self.outside = outside
        self.emptied = 0  # the times the allocator's cache was asked to give its free blocks back (`empty_cache`)

    def reset_peak(self) -> None:
        # A new peak window (an attempt, a microbatch the probe measures): frees still pending in
        # gloo's threads land first, or a size-1 microbatch's peak can hold the last one's
        # collective buffer and halve the probe's bytes per sample (seen in CI: 9 predicted, 5 fit).
        self.cap.settle()
        self.cap.reset_peak()

    def peak_bytes(self) -> int:
        return int(self.cap.peak_bytes)

    def allocated_bytes(self) -> int:
        return int(self.cap.live_bytes)

    def mark(self) -> Any:
        return self.cap.mark()

    def held_since(self, mark: Any) -> int:
        return self.cap.held_since(mark)

    def capacity_bytes(self) -> int:
        return self.reads if self.reads is not None else int(self.cap.limit_bytes or 0)

    def held_outside_bytes(self) -> int:
        return self.outside

    def alloc_retries(self) -> int:
        return int(self.cap.memory_stats()["num_alloc_retries"])

    def empty_cache(self) -> None:
        self.emptied += 1  # a cap holds no cache: counted, for the tests that ask when it was emptied


__all__ = ["CapMemory", "MemoryCapCallback"]
