"""The cross-rank agreement run at every sync point (DESIGN.md, "consensus").

One fused all-reduce (MAX) of an int64 vector per sync point, on a CPU (gloo) side group, so
the control plane needs no device sync and never stalls the GPU stream:

    [still_running] + world_size x [code, new_alloc_retries, peak_bytes, capacity_bytes, allocated_bytes,
                                    collectives issued in the attempt, microbatch tokens,
                                    bytes another process holds on the device]

Each rank writes only its own slots, so after MAX every rank knows every rank's report.
- a rank at a sync point sends still_running=1, code=0; if any code is set it raises
  `OOMOnOtherRank` (or `FailedOnOtherRank`) and unwinds;
- a rank that failed (or unwound) sends still_running=0 and its code, again and again, until a
  round comes back with still_running == 0: then every rank agrees the attempt failed;
- at the end of an attempt every rank sends still_running=0, code=0; if a round still shows a
  running rank and no failure it sends again (a barrier), so no rank steps the optimizer unless
  every rank finished forward and backward.
All ranks see the same result in each round, so they leave the loop in the same round and the
number of all-reduces matches on every rank.

Owns: the round's vector layout, the three calls (`sync`, `finish`, `fail`) and the verdict.
May not touch: how a round travels (the transports), Composer, FSDP2, the search policy.
"""

from __future__ import annotations

import time

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from automicro.core.sites import ALL_SITES, site_index
from automicro.core.hierarchical import HierarchicalTransport
from automicro.core.transport import TRANSPORTS, ProcessGroupTransport, ShmTransport, gather_identities, node_layout

SLOTS = 8
KIND_OOM = 1
KIND_ERROR = 2
_SITE_BASE = 64  # code = kind * _SITE_BASE + site index


class OOMOnOtherRank(RuntimeError):
    """Raised at a sync point when another rank ran out of memory in this attempt."""


class FailedOnOtherRank(RuntimeError):
    """Raised on every other rank when one rank failed with a non-OOM error."""


@dataclass(frozen=True)
class RankReport:
    rank: int
    kind: int  # 0 = fine, KIND_OOM, KIND_ERROR
    site: str
    new_alloc_retries: int
    peak_bytes: int
    capacity_bytes: int
    allocated_bytes: int
    collectives: int = 0
    microbatch_tokens: int = 0
    outside_bytes: int = 0

    @property
    def failed(self) -> bool:
        return self.kind != 0


@dataclass(frozen=True)
class Verdict:
    """What every rank agreed about one attempt."""

    reports: tuple[RankReport, ...]
    rounds: int

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.reports)

    @property
    def failed_ranks(self) -> list[int]:
        return [r.rank for r in self.reports if r.failed]

    @property
    def error_ranks(self) -> list[int]:
        return [r.rank for r in self.reports if r.kind == KIND_ERROR]

    @property
    def sites(self) -> list[str]:
        return [r.site for r in self.reports if r.failed]

    @property
    def any_new_alloc_retries(self) -> bool:
        return any(r.new_alloc_retries > 0 for r in self.reports)

    @property
    def peak_bytes(self) -> int:
        return max((r.peak_bytes for r in self.reports), default=0)

    @property
    def capacity_bytes(self) -> int:
        known = [r.capacity_bytes for r in self.reports if r.capacity_bytes > 0]
        return min(known) if known else 0

    @property
    def outside_bytes(self) -> int:
        """The most any rank's device has held outside its process's allocator, where that is more
        than a context's worth (`automicro.core.memory.CapacityReading.outside`; 0: no card shared)."""
        return max((r.outside_bytes for r in self.reports), default=0)

    @property
    def microbatch_tokens(self) -> int:
        """The largest microbatch of the attempt over all ranks, in padded tokens (token budget)."""
        return max((r.microbatch_tokens for r in self.reports), default=0)

    @property
    def failed_microbatch_tokens(self) -> int:
        """The largest microbatch of the ranks that failed, in padded tokens (token budget)."""
        return max((r.microbatch_tokens for r in self.reports if r.failed), default=0)


@dataclass
class LocalFigures:
    """This rank's memory figures for the report (bytes; 0 = unknown)."""

    new_alloc_retries: int = 0
    peak_bytes: int = 0
    capacity_bytes: int = 0
    allocated_bytes: int = 0
    collectives: int = 0  # collectives this rank issued in the attempt (automicro.core.ledger)
    microbatch_tokens: int = 0  # this rank's largest microbatch in padded tokens (budget="tokens")
    outside_bytes: int = 0  # what another process holds on this rank's device (`held_outside_bytes`)
    # Of peak_bytes, what is projected rather than reached (the state the first optimizer step will
    # create): not sent; a failed attempt reports only the bytes it reached (`AttemptFence`).
    projected_bytes: int = 0

    def reached(self) -> "LocalFigures":
        """These figures as a failed attempt reports them: its peak without what is projected."""
        if not self.projected_bytes:
            return self
        return replace(self, peak_bytes=max(0, self.peak_bytes - self.projected_bytes), projected_bytes=0)


@dataclass
class Consensus:
    """The sync-point protocol for one process group. Create it on every rank at once."""

    group: Optional[dist.ProcessGroup] = None
    world_size: int = 1
    rank: int = 0
    sync_count: int = 0
    finish_seconds: float = 0.0  # wall time spent in `finish()` (the end-of-attempt agreement)
    transport: Any = None  # ProcessGroupTransport, ShmTransport or HierarchicalTransport
    _failed_seen: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.transport is None:
            self.transport = ProcessGroupTransport(self.group, self.world_size)
        self._vec = np.zeros(1 + SLOTS * self.world_size, dtype=np.int64)

    @property
    def transport_name(self) -> str:
        return self.transport.name

    @classmethod
    def create(cls, use_cpu_group: bool = True, transport: str = "auto", local_leg: str = "auto") -> "Consensus":
        """Collective: every rank must call it.

        `transport`: "shm" (shared memory, every rank on one x86-64 node), "hierarchical" (shared
        memory within each node, gloo among the node leaders), "process_group" (a gloo side
        group, or the default group when `use_cpu_group` is False) or "auto" (shm on one node,
        hierarchical on several, the process group where neither can be set up). `local_leg`:
        the hierarchical transport's leg within a node ("auto", "shm", "process_group")."""
        if transport not in TRANSPORTS:
            raise ValueError(f"consensus transport {transport!r}: must be one of {list(TRANSPORTS)}")
        if not dist.is_initialized():
            return cls(group=None, world_size=1, rank=0)
        group = None
        if use_cpu_group and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1 or transport == "process_group":
            return cls(group=group, world_size=world, rank=rank)
        if group is None and dist.get_backend() != "gloo":
            if transport != "auto":
                raise ValueError(
                    f"consensus transport {transport!r} needs a CPU group to set itself up: keep cpu_sync_group true"
                )
            return cls(group=group, world_size=world, rank=rank)
        identities = gather_identities(group)
        several_nodes = len(node_layout(identities)) > 1
        length = 1 + SLOTS * world
        chosen: Any = None
        if transport == "hierarchical" or (transport == "auto" and several_nodes):
            chosen = HierarchicalTransport.create(group, identities, length, local_leg)
        else:
            try:
                chosen = ShmTransport.create(group, length)
            except RuntimeError as error:
                if transport == "shm":
                    raise ValueError(
                        f"consensus transport 'shm': {error}; use 'auto', 'hierarchical' or 'process_group'"
                    ) from None
        return cls(group=group, world_size=world, rank=rank, transport=chosen)

    def describe(self) -> str:
        """One line for the console: the transport in use and its shape."""
        return self.transport.describe()

    def close(self) -> None:
        self.transport.close()

    # ---- one round ------------------------------------------------------------------------

    def _round(
        self, still_running: int, code: int, figures: LocalFigures, timeout_s: Optional[float] = None
    ) -> np.ndarray:
        vec = self._vec
        vec.fill(0)
        vec[0] = still_running
        base = 1 + SLOTS * self.rank
        vec[base : base + SLOTS] = (
            code,
            figures.new_alloc_retries,
            figures.peak_bytes,
            figures.capacity_bytes,
            figures.allocated_bytes,
            figures.collectives,
            figures.microbatch_tokens,
            figures.outside_bytes,
        )
        if self.world_size > 1:
            vec = self.transport.max_reduce(vec, timeout_s)
        self.sync_count += 1
        return vec

    def _verdict(self, vec: np.ndarray, rounds: int) -> Verdict:
        reports = []
        for rank in range(self.world_size):
            base = 1 + SLOTS * rank
            code, retries, peak, capacity, allocated, collectives, tokens, outside = (int(x) for x in vec[base : base + SLOTS])
            kind = code // _SITE_BASE
            site = ALL_SITES[code % _SITE_BASE] if kind else ""
            reports.append(RankReport(rank, kind, site, retries, peak, capacity, allocated, collectives, tokens, outside))
        return Verdict(tuple(reports), rounds)

    @staticmethod
    def _any_failed(vec: np.ndarray) -> bool:
        return bool(vec[1::SLOTS].any())

    # ---- the three calls ------------------------------------------------------------------

    def begin_attempt(self) -> None:
        self._failed_seen = False

    def sync(self) -> None:
        """A sync point: raise if another rank already failed in this attempt."""
        if self._failed_seen:
            # Already unwinding: no more rounds as a running rank.
            raise OOMOnOtherRank("automicro: another rank failed in this attempt")
        vec = self._round(1, 0, LocalFigures())
        if self._any_failed(vec):
            self._failed_seen = True
            verdict = self._verdict(vec, 1)
            if verdict.error_ranks:
                raise FailedOnOtherRank(
                    f"automicro: rank(s) {verdict.error_ranks} failed with an error at "
                    f"{[r.site for r in verdict.reports if r.kind == KIND_ERROR]}; stopping this rank too"
                )
            raise OOMOnOtherRank(
                f"CUDA out of memory encountered on rank(s) {verdict.failed_ranks} "
                f"at {verdict.sites} (automicro consensus)"
            )

    def agree_max(self, values: Sequence[int]) -> tuple[int, ...]:
        """One round outside any attempt, on every rank at the same point: the element-wise
        maximum of `values` (at most SLOTS non-negative ints) over all ranks."""
        if len(values) > SLOTS or any(int(v) < 0 for v in values):
            raise ValueError(f"agree_max: at most {SLOTS} ints >= 0, got {list(values)}")
        vec = self._vec
        vec.fill(0)
        base = 1 + SLOTS * self.rank
        vec[base : base + len(values)] = [int(v) for v in values]
        if self.world_size > 1:
            vec = self.transport.max_reduce(vec, None)
        self.sync_count += 1
        rows = vec[1:].reshape(self.world_size, SLOTS)[:, : len(values)]
        return tuple(int(x) for x in rows.max(axis=0))

    def barrier(self) -> None:
        """Wait until every rank is at a barrier or has failed; raise if one failed (with the
        verdict as the error's `agreed` attribute when that round already was the agreement).

        A pipeline's time step (`automicro.engine.pipeline`): ranks run different work between
        two barriers, so their numbers of sync points differ. A rank at the barrier reports
        still_running=0 and keeps joining rounds until no rank is running: every rank leaves in
        the same round, and the next round of each rank is again the same round on all."""
        if self._failed_seen:
            raise OOMOnOtherRank("automicro: another rank failed in this attempt")
        while True:
            vec = self._round(0, 0, LocalFigures())
            if self._any_failed(vec):
                self._failed_seen = True
                verdict = self._verdict(vec, 1)
                if verdict.error_ranks:
                    error: RuntimeError = FailedOnOtherRank(
                        f"automicro: rank(s) {verdict.error_ranks} failed with an error at "
                        f"{[r.site for r in verdict.reports if r.kind == KIND_ERROR]}; stopping this rank too"
                    )
                else:
                    error = OOMOnOtherRank(
                        f"CUDA out of memory encountered on rank(s) {verdict.failed_ranks} "
                        f"at {verdict.sites} (automicro consensus)"
                    )
                if int(vec[0]) == 0:
                    # Nobody was running in this round: it already was the agreement (the failed
                    # ranks left their drain with it); no further round may follow.
                    error.agreed = verdict  # type: ignore[attr-defined]
                raise error
            if int(vec[0]) == 0:
                return

    def finish(self, figures: LocalFigures) -> Verdict:
        """End of an attempt on a rank that did not fail: agree whether every rank finished."""
        started = time.perf_counter()
        try:
            return self._finish(figures)
        finally:
            self.finish_seconds += time.perf_counter() - started

    def _finish(self, figures: LocalFigures) -> Verdict:
        rounds = 0
        while True:
            vec = self._round(0, 0, figures)
            rounds += 1
            if self._any_failed(vec):
                self._failed_seen = True
                if int(vec[0]) == 0:
                    return self._verdict(vec, rounds)
                return self.fail(KIND_OOM, None, figures, already_rounds=rounds, own_code_zero=True)
            if int(vec[0]) == 0:
                return self._verdict(vec, rounds)

    def fail(
        self,
        kind: int,
        site: Optional[str],
        figures: LocalFigures,
        already_rounds: int = 0,
        own_code_zero: bool = False,
        timeout_s: Optional[float] = None,
    ) -> Verdict:
        """This rank failed (or unwound because another did): drain until nobody is running."""
        self._failed_seen = True
        code = 0 if own_code_zero else kind * _SITE_BASE + site_index(site or "other")
        rounds = already_rounds
        while True:
            vec = self._round(0, code, figures, timeout_s)
            rounds += 1
            if int(vec[0]) == 0:
                return self._verdict(vec, rounds)

