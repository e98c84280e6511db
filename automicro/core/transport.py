"""How a consensus round travels: an element-wise MAX of one small int64 vector over all ranks.

Three transports, same result (the third, for many nodes, is `automicro.core.hierarchical`):
- `ProcessGroupTransport`: `dist.all_reduce(MAX)` on a process group (the gloo side group, or the
  default group when `cpu_sync_group=False`). Works across hosts. One round costs a gloo
  round trip (~0.1 ms on one host).
- `ShmTransport`: when every rank runs on one host, a shared-memory segment in /dev/shm. Each rank
  writes its vector into its own slot and then a round number; a rank reads once every rank's
  round number has reached its own. A few microseconds per round, so a search with sync hooks
  on thousands of rounds per batch costs little host time. x86-64 only: the protocol relies on
  x86's store order (the slot is visible before the round number); elsewhere `auto` picks the
  process group.
- `HierarchicalTransport` (automicro.core.hierarchical): shared memory within each node, one
  gloo round among the node leaders; `auto` picks it when the ranks belong to several nodes.

A node is what the launcher says it is (`launcher_node`): two launchers on one machine, each with
its own node rank, are two nodes and share no memory, exactly as two hosts would not.

Both are collective to create and must be used in the same order on every rank (the consensus
protocol guarantees each rank runs the same number of rounds).

Owns: the transports' MAX round, the launcher's idea of a node, the shared-memory segment and
the launcher store client. May not touch: what the vector means (the consensus does), Composer.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import time
import uuid

from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

TRANSPORTS = ("auto", "shm", "hierarchical", "process_group")
DEFAULT_TIMEOUT_S = 1800.0  # when a round has no timeout of its own: as long as a c10d default


class TransportTimeout(RuntimeError):
    """A consensus round did not complete in time (a rank is gone or stuck elsewhere)."""


class ProcessGroupTransport:
    name = "process_group"

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int) -> None:
        self.group = group
        self.world_size = world_size

    def describe(self) -> str:
        return f"process_group: a gloo all-reduce over {self.world_size} rank(s)"

    def max_reduce(self, vec: np.ndarray, timeout_s: Optional[float] = None) -> np.ndarray:
        if self.world_size == 1:
            return vec
        tensor = torch.from_numpy(vec)  # shares memory: the result lands in `vec`
        if timeout_s is None:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        else:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            if not work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
                raise TransportTimeout(f"automicro consensus timed out after {timeout_s} s")
        return vec

    def close(self) -> None:
        pass


def launcher_store_client(timeout_s: float = 30.0) -> Optional[dist.TCPStore]:
    """A client of its own to the launcher's rendezvous store (MASTER_ADDR:MASTER_PORT, set by
    torchrun and the composer launcher), reachable from every node; None where there is none. Its
    own connection: a blocking wait on it never holds the lock of the default group's store."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return None
    try:
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except (RuntimeError, ValueError):
        return None


def launcher_store_clients(group: Any, name: str, count: int = 2) -> Optional[tuple[str, list[dist.TCPStore]]]:
    """Collective over `group` (all ranks): a key prefix drawn once for the job
    (``automicro/<name>/<uuid>``) and `count` clients of this rank's own to the launcher's store;
    None on every rank when any rank cannot reach the store."""
    box = [f"automicro/{name}/{uuid.uuid4().hex}"]
    dist.broadcast_object_list(box, src=0, group=group)
    stores = [launcher_store_client() for _ in range(count)]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, all(store is not None for store in stores), group=group)
    if not all(everyone):
        return None
    return box[0], stores  # type: ignore[return-value]


def launcher_node() -> str:
    """The node this rank belongs to as its launcher says (torchrun's GROUP_RANK, the composer
    launcher's NODE_RANK); "" when no launcher said. Two launchers on one machine are two nodes."""
    for variable in ("GROUP_RANK", "NODE_RANK"):
        value = os.environ.get(variable, "").strip()
        if value:
            return value
    return ""


def _host_identity() -> tuple[str, str, str, str, str]:
    """(hostname, boot id, machine, pid namespace, launcher node): the first two and the last are
    equal on ranks of one node, which may share /dev/shm and probe each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return socket.gethostname(), boot, platform.machine(), pid_ns, launcher_node()


def _node_key(identity: tuple) -> tuple:
    hostname, boot, _, _, node = identity
    return hostname, boot, node


def node_layout(identities: list[tuple]) -> list[list[int]]:
    """The ranks of each node (one identity per rank), nodes ordered by their lowest rank."""
    nodes: dict[tuple, list[int]] = {}
    for rank, identity in enumerate(identities):
        nodes.setdefault(_node_key(identity), []).append(rank)
    return sorted(nodes.values(), key=lambda ranks: ranks[0])


def shm_unavailable_reason(identities: list[tuple]) -> Optional[str]:
    """Why one shared-memory segment cannot serve these ranks (None: it can)."""
    hosts = {(h, b) for h, b, *_ in identities}
    if len(hosts) > 1:
        return f"the ranks run on {len(hosts)} hosts"
    nodes = {_node_key(identity) for identity in identities}
    if len(nodes) > 1:
        return f"the ranks belong to {len(nodes)} nodes (launchers with their own node rank)"
    machine = identities[0][2]
    if machine not in ("x86_64", "AMD64"):
        return f"the host is {machine}, not x86-64 (the shared-memory protocol relies on x86 store order)"
    if not os.path.isdir("/dev/shm"):
        return "/dev/shm does not exist"
    return None


def process_exists(pid: int) -> bool:
    """False only when `pid` (> 0) is known to be gone; unknown pids count as alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def gather_identities(group: Optional[dist.ProcessGroup]) -> list[tuple]:
    """Collective over `group`: every rank's `_host_identity()`, by group rank."""
    identities: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(identities, _host_identity(), group=group)
    return identities


def open_shared_segment(group: Optional[dist.ProcessGroup], words: int, purpose: str) -> tuple[np.ndarray, bool]:
    """Collective over `group` (a CPU-capable group, or a subgroup of one node's ranks): map one
    zeroed int64 segment of `words` in /dev/shm on every rank of it.

    Returns (segment, check_pids): check_pids is True when every rank is in one pid namespace, so
    a rank may probe another's pid to tell "gone" from "slow". Raises RuntimeError with the reason
    (on every rank together) when the ranks cannot share memory. The file is unlinked as soon as
    every rank has mapped it: nothing is left behind in /dev/shm, even after a crash.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    identities = gather_identities(group)
    reason = shm_unavailable_reason(identities)
    if reason is not None:
        raise RuntimeError(f"shared-memory {purpose} is not possible: {reason}")
    check_pids = len({ident[3] for ident in identities}) == 1 and identities[0][3] != ""
    path_box = [None]
    error = ""
    if rank == 0:
        path = f"/dev/shm/automicro-{purpose}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * (8 * words))
            os.chmod(path, 0o600)
            path_box[0] = path
        except OSError as e:
            error = f"rank 0 could not create {path}: {e}"
    dist.broadcast_object_list(path_box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    segment: Optional[np.ndarray] = None
    if path_box[0] is not None:
        try:
            segment = np.memmap(path_box[0], dtype=np.int64, mode="r+", shape=(words,))
        except (OSError, ValueError) as e:
            error = f"rank {rank} could not map {path_box[0]}: {e}"
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=group)
    if rank == 0 and path_box[0] is not None:
        try:
            os.unlink(path_box[0])
        except OSError:
            pass
    problems = [e for e in errors if e]
    if problems:
        raise RuntimeError(f"shared-memory {purpose} is not possible: " + "; ".join(problems))
    assert segment is not None
    return segment, check_pids


_SPIN = 200  # busy checks before yielding the CPU
_YIELD_S = 0.002  # then sched_yield until this long, then short sleeps up to 1 ms


def wait_until(ready: Callable[[], bool], check: Callable[[float], None], check_every_s: float = 1.0) -> None:
    """Wait for `ready()` on shared memory written by another process: spin, then yield, then
    sleep in short steps; every `check_every_s`, `check(seconds waited)` may raise (a rank gone,
    a timeout)."""
    for _ in range(_SPIN):
        if ready():
            return
    start = time.monotonic()
    next_check = start + check_every_s
    delay = 0.0
    while not ready():
        now = time.monotonic()
        if now - start < _YIELD_S:
            os.sched_yield()
            continue
        delay = min(max(delay * 2, 2e-5), 1e-3)
        time.sleep(delay)
        if now >= next_check:
            next_check = now + check_every_s
            check(now - start)


class ShmTransport:
    """MAX-reduce through a shared-memory segment; every rank on one x86-64 host.

    Layout (int64): a header of `world` pids, then `world` round numbers, then two buffers of
    `world` x `length` slots (round r uses buffer r % 2). A rank that has seen every round number
    reach r knows every other rank finished reading round r - 1, so writing round r + 1 into
    buffer (r + 1) % 2 can never overwrite a slot someone still reads.
    """

    name = "shm"

    def __init__(self, segment: np.ndarray, rank: int, world_size: int, length: int, check_pids: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        self.length = length
        self.check_pids = check_pids
        self._map = segment
        self._pids = self._map[:world_size]
        self._seq = self._map[world_size : 2 * world_size]
        self._bufs = self._map[2 * world_size :].reshape(2, world_size, length)
        self._round = 0
        self._pids[rank] = os.getpid()

    @classmethod
    def create(cls, group: Optional[dist.ProcessGroup], length: int) -> "ShmTransport":
        """Collective over `group` (a CPU-capable group). Raises RuntimeError with the reason if
        the ranks cannot share memory; every rank raises together."""
        rank, world = dist.get_rank(), dist.get_world_size()
        segment, check_pids = open_shared_segment(group, world * (2 + 2 * length), "consensus")
        return cls(segment, rank, world, length, check_pids)

    def describe(self) -> str:
        return f"shm: shared memory among {self.world_size} ranks on one node"

    def max_reduce(self, vec: np.ndarray, timeout_s: Optional[float] = None) -> np.ndarray:
        if vec.shape != (self.length,):
            raise ValueError(f"consensus vector of shape {vec.shape}, transport built for ({self.length},)")
        r = self._round + 1
        buf = self._bufs[r % 2]
        buf[self.rank, :] = vec
        self._seq[self.rank] = r  # after the slot: x86 keeps stores in order
        self._wait(r, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        self._round = r
        return buf.max(axis=0)

    def _wait(self, r: int, timeout_s: float) -> None:
        seq = self._seq

        def check(waited: float) -> None:
            self._check_alive(r)
            if waited > timeout_s:
                late = [j for j in range(self.world_size) if seq[j] < r]
                raise TransportTimeout(
                    f"automicro consensus timed out after {timeout_s} s: rank(s) {late} did not reach "
                    f"round {r} (stuck elsewhere, or gone)"
                )

        wait_until(lambda: bool((seq >= r).all()), check)

    def _check_alive(self, r: int) -> None:
        if not self.check_pids:
            return
        for j in range(self.world_size):
            if self._seq[j] >= r:
                continue
            pid = int(self._pids[j])
            if not process_exists(pid):
                raise TransportTimeout(
                    f"automicro consensus: rank {j} (pid {pid}) exited while the others waited in a consensus round"
                )

    def close(self) -> None:
        """Drop this rank's mapping (results handed out are copies, so nothing else holds it)."""
        self._map = self._pids = self._seq = self._bufs = None  # type: ignore[assignment]
