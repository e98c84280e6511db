"""The hierarchical consensus transport: shared memory within a node, one gloo round among nodes.

Owns: one consensus round (an element-wise MAX of an int64 vector over every rank) when the ranks
belong to several nodes, and the names of the ranks that broke a round. May not touch: the
consensus protocol (automicro.core.consensus decides what the vector means), FSDP2, Composer.

Why. Over many hosts, a flat gloo all-reduce over every rank costs a ring of world-size hops per
round, and a search with the sync hooks on runs thousands of rounds per batch (benchmarks/
RESULTS.md: +54% to +106% step time on the flat gloo path vs +0.2% to +3.7% with shared memory on
one host). Here a round costs shared memory within each node and one all-reduce among the node
leaders (local rank 0 of each node), a group world-size / ranks-per-node times smaller:

1. every rank writes its vector into its slot of its node's segment, then its round number;
2. the leader waits for its node's round numbers, reduces the slots, and runs the leaders'
   MAX (recursive doubling over gloo point-to-point: log2(nodes) exchanges, where gloo's own
   all-reduce is a ring of 2(nodes - 1) steps) with one extra word: the status of its node (fine,
   a rank gone, a rank late);
3. the leader writes the result and the round number of the result; the others read it.

Buffers alternate by round parity (as in `ShmTransport`): a leader that saw round r + 2 from every
local rank knows each of them finished reading the result of round r; a rank that read the
result of round r + 1 knows its leader finished reading the slots of round r.

Failures are named on every rank. A non-leader that dies or is late is seen by its leader (pids,
round numbers), which carries the name to every node in the status word of the leaders' round,
and to its own node in the segment's error word. A leader that dies is seen by its node's ranks
(its pid), which leave its name in the launcher's store (a client opened only then); the other leaders, whose gloo round broke,
read it there. The leaders' round waits `LEADER_GRACE_S` longer than the local one, so a leader
that reports a late rank at the deadline is still heard.

The local leg is shared memory on x86-64 (the same store-order argument as `ShmTransport`); on
other machines (aarch64 nodes) and where /dev/shm is missing it is a gloo group of the node's
ranks (reduce to the leader, broadcast back): still one round among leaders across the network,
with loopback TCP inside the node.
"""

from __future__ import annotations

import datetime
import os
import platform
import uuid
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from automicro.core.transport import (
    DEFAULT_TIMEOUT_S,
    TransportTimeout,
    node_layout,
    open_shared_segment,
    launcher_store_client,
    process_exists,
    wait_until,
)

LOCAL_LEGS = ("auto", "shm", "process_group")
LEADER_GRACE_S = 10.0  # the leaders' round outlasts the local one by this much
STORE_WAIT_S = 5.0  # how long a leader whose round broke looks in the store for a name
# Status kinds: a rank exited, a rank was late, a leader's round broke, some rank of a node was late.
_GONE, _LATE, _LEADER, _NODE_LATE = 1, 2, 3, 4
_SHIFT = 1 << 32  # status word = kind * _SHIFT + rank + 1


def _leader_bound(timeout_s: float) -> float:
    """How long a leader may take to end a round: its node, then the leaders' round, then the store."""
    return 2 * timeout_s + LEADER_GRACE_S + STORE_WAIT_S + 5.0


def _status(kind: int, rank: int) -> int:
    return kind * _SHIFT + rank + 1


def _describe(status: int, nodes: list[list[int]]) -> str:
    kind, rank = divmod(int(status), _SHIFT)
    rank -= 1
    node = next((i for i, ranks in enumerate(nodes) if rank in ranks), -1)
    where = f"rank {rank} (node {node}{', its leader' if node >= 0 and nodes[node][0] == rank else ''})"
    if kind == _GONE:
        return f"{where} exited"
    if kind == _LATE:
        return f"{where} did not reach the round in time (stuck elsewhere)"
    if kind == _NODE_LATE:
        return f"a rank of node {node} (ranks {nodes[node] if node >= 0 else '?'}) did not reach the round in time"
    return f"the leaders' round broke on {where}"


class _ShmLeg:
    """One node's ranks over a shared-memory segment (x86-64 store order).

    Layout (int64): pids[n], round numbers[n], result round, error status, slots[2][n][length],
    results[2][length]."""

    name = "shared memory"

    def __init__(self, segment: np.ndarray, local_rank: int, ranks: list[int], length: int, check_pids: bool) -> None:
        n = len(ranks)
        self.local_rank, self.ranks, self.length, self.check_pids = local_rank, ranks, length, check_pids
        self._map = segment
        self._pids = segment[:n]
        self._seq = segment[n : 2 * n]
        self._result_seq = segment[2 * n : 2 * n + 1]
        self._error = segment[2 * n + 1 : 2 * n + 2]
        slots_end = 2 * n + 2 + 2 * n * length
        self._slots = segment[2 * n + 2 : slots_end].reshape(2, n, length)
        self._results = segment[slots_end : slots_end + 2 * length].reshape(2, length)
        self._pids[local_rank] = os.getpid()

    @staticmethod
    def words(n: int, length: int) -> int:
        return 2 * n + 2 + 2 * n * length + 2 * length

    def gather(self, vec: np.ndarray, r: int, timeout_s: float) -> Optional[np.ndarray]:
        """Post this rank's vector; on the leader, wait for the node's and return their MAX."""
        self._slots[r % 2, self.local_rank, :] = vec
        self._seq[self.local_rank] = r  # after the slot: x86 keeps stores in order
        if self.local_rank != 0:
            return None
        seq = self._seq

        def check(waited: float) -> None:
            gone = self._gone(lambda j: seq[j] < r)
            if gone is not None:
                raise _LegFailure(_status(_GONE, self.ranks[gone]))
            if waited > timeout_s:
                late = next(j for j in range(len(self.ranks)) if seq[j] < r)
                raise _LegFailure(_status(_LATE, self.ranks[late]))

        wait_until(lambda: bool((seq >= r).all()), check)
        return self._slots[r % 2].max(axis=0)

    def publish(self, result: np.ndarray, r: int) -> None:
        self._results[r % 2, :] = result
        self._result_seq[0] = r  # after the result

    def post_error(self, status: int) -> None:
        self._error[0] = status

    def receive(self, r: int, timeout_s: float) -> np.ndarray:
        """A non-leader: the leader's result of round r."""
        done, error = self._result_seq, self._error

        def check(waited: float) -> None:
            if error[0]:
                raise _LegFailure(int(error[0]))
            if self._gone(lambda j: j == 0) is not None:
                raise _LegFailure(_status(_GONE, self.ranks[0]), leader_gone=True)
            if waited > _leader_bound(timeout_s):
                raise _LegFailure(_status(_LATE, self.ranks[0]))

        wait_until(lambda: done[0] >= r or bool(error[0]), check)
        if error[0]:
            raise _LegFailure(int(error[0]))
        return self._results[r % 2].copy()

    def _gone(self, which) -> Optional[int]:
        if not self.check_pids:
            return None
        for j in range(len(self.ranks)):
            if which(j) and not process_exists(int(self._pids[j])):
                return j
        return None

    def close(self) -> None:
        self._map = self._pids = self._seq = self._slots = self._results = None  # type: ignore[assignment]


class _GroupLeg:
    """One node's ranks over a gloo group: reduce to the leader, broadcast back."""

    name = "gloo"

    def __init__(self, group: Any, local_rank: int, ranks: list[int]) -> None:
        self.group, self.local_rank, self.ranks = group, local_rank, ranks
        self._tensor: Optional[torch.Tensor] = None

    def _wait(self, work: Any, timeout_s: float, status: int) -> None:
        try:
            finished = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            finished = False
        if not finished:
            raise _LegFailure(status)

    def gather(self, vec: np.ndarray, r: int, timeout_s: float) -> Optional[np.ndarray]:
        tensor = torch.from_numpy(vec.copy())
        work = dist.reduce(tensor, dst=self.ranks[0], op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait(work, timeout_s, _status(_NODE_LATE if self.local_rank == 0 else _LATE, self.ranks[0]))
        self._tensor = tensor
        return tensor.numpy() if self.local_rank == 0 else None

    def publish(self, result: np.ndarray, r: int) -> None:
        tensor = torch.from_numpy(np.ascontiguousarray(result))
        self._wait(dist.broadcast(tensor, src=self.ranks[0], group=self.group, async_op=True), LEADER_GRACE_S, _status(_LEADER, self.ranks[0]))

    def post_error(self, status: int) -> None:
        pass  # the node's ranks learn it from the broken broadcast

    def receive(self, r: int, timeout_s: float) -> np.ndarray:
        assert self._tensor is not None
        tensor = self._tensor
        self._wait(
            dist.broadcast(tensor, src=self.ranks[0], group=self.group, async_op=True),
            _leader_bound(timeout_s),
            _status(_LEADER, self.ranks[0]),
        )
        return tensor.numpy().copy()

    def close(self) -> None:
        self._tensor = None


class _AloneLeg:
    """A node of one rank: it is its own leader."""

    name = "none"

    def gather(self, vec: np.ndarray, r: int, timeout_s: float) -> np.ndarray:
        return vec

    def publish(self, result: np.ndarray, r: int) -> None:
        pass

    def post_error(self, status: int) -> None:
        pass

    def close(self) -> None:
        pass


class _RecursiveDoubling:
    """MAX over the node leaders in log2(leaders) exchanges (gloo point-to-point), not a ring.

    gloo's all-reduce is a ring: 2(n - 1) sequential steps, ~50 µs each (benchmarks/RESULTS.md,
    2026-11-23, the hierarchical consensus), which at 64 nodes makes a round ~126 steps long. Here: with p the largest power of
    two <= n, leader i >= p first hands its vector to leader i - p; the first p exchange with the
    partner i XOR 2^k for k = 0, 1, ... and keep the MAX; then leader i < n - p hands the result
    to i + p. log2(p) + 2 steps at most, the same result as the all-reduce."""

    def __init__(self, group: Any, leaders: list[int], index: int) -> None:
        self.group, self.leaders, self.index = group, leaders, index
        self.n = len(leaders)
        self.p = 1 << (self.n.bit_length() - 1)

    # A round's vector holds 8 words a rank, but a sync round (thousands a searching batch) carries little
    # but "still running": where the vector is longer than the header, a leader sends the header (the count
    # of non-zero words, their indices and values: every word is >= 0, so MAX over the non-zero ones is the
    # MAX), and the whole vector after it only where more than `SPARSE_PAIRS` words are non-zero (a finish
    # round's figures). A vector no longer than the header goes whole, alone. Both ends know which from the
    # vector's length, the same on every rank. The bytes a sync round moves between hosts stay the same at any size.
    SPARSE_PAIRS = 64
    _HEADER_TAG, _WHOLE_TAG = 1, 2

    def max_reduce(self, vec: np.ndarray, timeout_s: Optional[float] = None) -> np.ndarray:
        """MAX of `vec` over the leaders, in place (`vec` is the result)."""
        if self.n == 1:
            return vec
        timeout = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        i, p = self.index, self.p
        if i >= p:
            self._wait_all(self._post(vec, self.leaders[i - p]), timeout)
            self._receive_max(vec, self.leaders[i - p], timeout)
            return vec
        if i < self.n - p:
            self._receive_max(vec, self.leaders[i + p], timeout)
        mask = 1
        while mask < p:
            partner = self.leaders[i ^ mask]
            sends = self._post(vec, partner)
            self._receive_max(vec, partner, timeout)
            self._wait_all(sends, timeout)
            mask <<= 1
        if i < self.n - p:
            self._wait_all(self._post(vec, self.leaders[i + p]), timeout)
        return vec

    def _headed(self, vec: np.ndarray) -> bool:
        return len(vec) > 1 + 2 * self.SPARSE_PAIRS

    def _post(self, vec: np.ndarray, peer: int) -> list[Any]:
        """Send `vec` to `peer` (a copy: `vec` may change before the send completes); the pending sends."""
        whole = torch.from_numpy(vec.copy())
        if not self._headed(vec):
            return [dist.isend(whole, peer, group=self.group, tag=self._WHOLE_TAG)]
        k = self.SPARSE_PAIRS
        header = np.zeros(1 + 2 * k, dtype=np.int64)
        nonzero = np.flatnonzero(vec)
        if len(nonzero) > k:
            header[0] = -1  # the whole vector follows
        else:
            header[0] = len(nonzero)
            header[1 : 1 + len(nonzero)] = nonzero
            header[1 + k : 1 + k + len(nonzero)] = vec[nonzero]
        sends = [dist.isend(torch.from_numpy(header), peer, group=self.group, tag=self._HEADER_TAG)]
        if header[0] < 0:
            sends.append(dist.isend(whole, peer, group=self.group, tag=self._WHOLE_TAG))
        return sends

    def _receive_max(self, vec: np.ndarray, peer: int, timeout: datetime.timedelta) -> None:
        """`vec` = MAX(`vec`, what `peer` sends)."""
        if self._headed(vec):
            k = self.SPARSE_PAIRS
            header = torch.empty(1 + 2 * k, dtype=torch.int64)
            self._wait(dist.irecv(header, peer, group=self.group, tag=self._HEADER_TAG), timeout)
            words = header.numpy()
            count = int(words[0])
            if count >= 0:
                index = words[1 : 1 + count]
                vec[index] = np.maximum(vec[index], words[1 + k : 1 + k + count])
                return
        theirs = torch.empty(len(vec), dtype=torch.int64)
        self._wait(dist.irecv(theirs, peer, group=self.group, tag=self._WHOLE_TAG), timeout)
        np.maximum(vec, theirs.numpy(), out=vec)

    def _wait_all(self, works: list[Any], timeout: datetime.timedelta) -> None:
        for work in works:
            self._wait(work, timeout)

    @staticmethod
    def _wait(work: Any, timeout: datetime.timedelta) -> None:
        if not work.wait(timeout=timeout):
            raise TransportTimeout(f"automicro consensus: the leaders' exchange timed out after {timeout.total_seconds():g} s")


class _LegFailure(Exception):
    def __init__(self, status: int, leader_gone: bool = False) -> None:
        super().__init__(status)
        self.status = status
        self.leader_gone = leader_gone


# (the default group, the group) per ranks: a group made once per process and default group, reused by
# every consensus made later (torch names a locally synchronized group by its ranks: one name, one group).
_OWN_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}


def own_group(ranks: list[int]) -> Any:
    """A gloo group over `ranks`, created by those ranks only (`use_local_synchronization`: the others
    neither call nor wait), so a job's start costs each rank its own groups, not one per node. Every
    member must call it, in the same order as the other groups it belongs to."""
    key = tuple(ranks)
    cached = _OWN_GROUPS.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    group = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
    _OWN_GROUPS[key] = (dist.group.WORLD, group)
    return group


class HierarchicalTransport:
    """MAX-reduce over several nodes: a local leg per node, one gloo all-reduce among leaders."""

    name = "hierarchical"

    def __init__(
        self,
        rank: int,
        nodes: list[list[int]],
        leg: Any,
        leaders: Optional[_RecursiveDoubling],
        key: str,
    ) -> None:
        self.rank = rank
        self.nodes = nodes
        self.node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
        self.leader = nodes[self.node][0] == rank
        self._leg = leg
        self._leaders = leaders
        self._key = key
        self._round = 0

    @classmethod
    def create(
        cls, group: Optional[dist.ProcessGroup], identities: list[tuple], length: int, local_leg: str = "auto"
    ) -> "HierarchicalTransport":
        """Collective over every rank (`group`: a CPU-capable group over all of them;
        `identities`: every rank's `transport._host_identity()`)."""
        if local_leg not in LOCAL_LEGS:
            raise ValueError(f"local leg {local_leg!r}: must be one of {list(LOCAL_LEGS)}")
        rank = dist.get_rank()
        nodes = node_layout(identities)
        box = [f"automicro/consensus/{uuid.uuid4().hex}"]
        dist.broadcast_object_list(box, src=0, group=group)
        mine = next(ranks for ranks in nodes if rank in ranks)
        # Each rank creates only the groups it belongs to: its node's, and the leaders' where it leads
        # (`own_group`). Creating every node's group on every rank cost nodes x world at start (128 CPU
        # ranks in 16 hosts: 0.82 s, `benchmarks/RESULTS.md` 2026-11-29, many ranks), hours at 16,384 ranks.
        leader_ranks = [ranks[0] for ranks in nodes]
        local_group = own_group(mine)
        if mine[0] == rank:
            leaders_group = own_group(leader_ranks)
        else:
            leaders_group = None
            # As many groups of its own as a leader makes: torch 2.15 counts a locally synchronized group in the
            # names of the groups made after it (`_world.group_count`, members only), and those names must agree
            # on every rank (a later `new_group` over every rank hung on torch 2.15 without this one).
            own_group([rank])
        local_rank = mine.index(rank)
        leg: Any
        if len(mine) == 1:
            leg = _AloneLeg()
        else:
            leg = None
            x86 = platform.machine() in ("x86_64", "AMD64")
            if local_leg == "shm" or (local_leg == "auto" and x86):
                try:
                    segment, check_pids = open_shared_segment(
                        local_group, _ShmLeg.words(len(mine), length), "consensus-node"
                    )
                    leg = _ShmLeg(segment, local_rank, mine, length, check_pids)
                except RuntimeError as error:
                    if local_leg == "shm":
                        raise ValueError(f"hierarchical consensus, local leg 'shm': {error}") from None
            if leg is None:
                leg = _GroupLeg(local_group, local_rank, mine)
        leaders = _RecursiveDoubling(leaders_group, leader_ranks, leader_ranks.index(rank)) if mine[0] == rank else None
        return cls(rank, nodes, leg, leaders, box[0])

    def describe(self) -> str:
        sizes = "/".join(str(n) for n in sorted({len(ranks) for ranks in self.nodes}))
        within = "one rank per node" if self._leg.name == "none" else f"{self._leg.name} within a node"
        return f"hierarchical: {len(self.nodes)} nodes of {sizes} rank(s), {within}, gloo recursive doubling among the node leaders"

    # ---- one round ----------------------------------------------------------------------------

    def max_reduce(self, vec: np.ndarray, timeout_s: Optional[float] = None) -> np.ndarray:
        timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        r = self._round + 1
        try:
            if self.leader:
                result = self._lead(vec, r, timeout)
            else:
                self._leg.gather(vec, r, timeout)
                result = self._leg.receive(r, timeout)
        except _LegFailure as failure:
            if failure.leader_gone:
                self._leave_name(failure.status)
            raise TransportTimeout(f"automicro consensus (round {r}): {_describe(failure.status, self.nodes)}") from None
        self._round = r
        return result

    def _lead(self, vec: np.ndarray, r: int, timeout: float) -> np.ndarray:
        status = 0
        try:
            local = self._leg.gather(vec, r, timeout)
        except _LegFailure as failure:
            status, local = failure.status, vec  # still join the leaders' round: it carries the name
        extended = np.empty(len(vec) + 1, dtype=np.int64)
        extended[:-1] = local
        extended[-1] = status
        assert self._leaders is not None
        try:
            self._leaders.max_reduce(extended, timeout + LEADER_GRACE_S)
        except (TransportTimeout, RuntimeError) as error:
            # Broken (not timed out): a leader died; its node's ranks leave its name in the store.
            found = 0 if isinstance(error, TransportTimeout) else self._name_from_store()
            status = found if found else _status(_LEADER, self.rank)
            self._leg.post_error(status)
            if found:
                raise _LegFailure(status) from None
            raise TransportTimeout(
                f"automicro consensus (round {r}): the leaders' round failed ({error}); a rank on another node "
                "exited or is stuck"
            ) from None
        if extended[-1]:
            self._leg.post_error(int(extended[-1]))
            raise _LegFailure(int(extended[-1]))
        result = extended[:-1]
        self._leg.publish(result, r)
        return result

    def _leave_name(self, status: int) -> None:
        store = launcher_store_client(STORE_WAIT_S)
        if store is None:
            return
        try:
            store.set(self._key, str(status))
        except RuntimeError:
            pass

    def _name_from_store(self) -> int:
        store = launcher_store_client(STORE_WAIT_S)
        if store is None:
            return 0
        try:
            store.wait([self._key], datetime.timedelta(seconds=STORE_WAIT_S))
            return int(store.get(self._key))
        except (RuntimeError, ValueError):
            return 0

    def close(self) -> None:
        self._leg.close()


__all__ = ["HierarchicalTransport", "LOCAL_LEGS", "LEADER_GRACE_S"]
