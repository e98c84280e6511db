"""The collective ledger: keeps every rank's collective sequence in step after a failure.

Owns: the record of the collectives this rank issued in the current attempt (FSDP2's all-gathers,
reduce-scatters and all-reduces, and the batch-size all-reduce of the batch step), the
shared-memory board where every rank publishes that record, and the replay that brings a rank
which stopped early back in step with the others. May not touch: FSDP2 state, Composer, the
search policy (the attempt fence in `automicro.core.attempt` decides when to call it).

Why it exists (DESIGN.md, "After the hooks are off"). With the sync hooks off, a rank that runs
out of memory stops issuing collectives while the others go on: on gloo their host threads block
inside the next collective; on NCCL their hosts run ahead and queue collectives on their streams
that the failed rank never issued, so the next attempt's first collective would pair with a
stale one (a hang, or wrong data where the sizes happen to match). Every rank issues FSDP2's
collectives in the same order, and a rank that fails has issued a prefix of that order. So:

1. Before issuing collective i of an attempt, a rank writes its descriptor (kind, group, dtype,
   element count, reduce op, and the group's c10d sequence number) into its row of the board,
   then raises the count of collectives it committed to. A rank that fails (or unwinds) marks itself done and, when it failed itself,
   raises a flag every rank checks before its next collective: the others stop within one
   collective (milliseconds) instead of running the rest of the batch.
2. A rank that stopped early replays, with zero-filled buffers, every collective some other rank
   committed to and it did not issue, reading the descriptors from the board, until every rank
   is done. Before each replay it compares its own sequence number on that group with the
   entry's: a difference means the other rank issued collectives the ledger did not see (the
   model's own), and a replay would pair with one of those, so the job stops instead. On gloo that unblocks the ranks waiting inside a collective; on NCCL it completes the
   queued ones. The replayed results are garbage on purpose and nobody keeps them: the attempt
   is wiped on every rank before the retry.
3. Then the usual consensus runs; every rank's collective sequence is in step again.

The shared-memory board needs every rank on one x86-64 node. On several nodes the board is the
launcher's TCP store (`automicro.core.store_board.StoreBoard`, the same interface), written only
after a failure by a listener thread per rank, so the replay runs before the consensus there too,
while the other ranks' main threads are blocked. Without a reachable store, each rank keeps its
record in memory, the consensus carries how many collectives each rank issued, and after it the
ranks behind replay the record of the rank ahead, handed over on a CPU group of the ledger's own
(`align`; every replay is checked first and the ranks agree, so a rank that cannot replay stops
every rank naming itself). That works only where every rank reaches the consensus, which a GPU run
showed NCCL does not guarantee (a host blocks once its stream is stuck; `benchmarks/RESULTS.md` 2026-11-23, the slow link and two nodes). Where a rank is gone, or something outside the ledger (a
collective of the user's model) leaves a rank stuck, recovery is impossible in-process: the rank
that waited longest declares the job lost on the board, and every rank exits with one message
naming the rank, site and batch that failed first (`FatalRecoveryError`; the board's watcher
thread ends a rank stuck inside C++ with the same message).

Cost when nothing fails: per collective, one check of the failure flag, a read of c10d's sequence number and six integer stores
(a few microseconds against FSDP2's own Python work per collective); no extra synchronization.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from automicro.core.consensus import OOMOnOtherRank
from automicro.core.sites import ALL_SITES, site_index
from automicro.core.transport import open_shared_segment, process_exists

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = 1, 2, 3
KINDS = {"all_gather": ALL_GATHER, "reduce_scatter": REDUCE_SCATTER, "all_reduce": ALL_REDUCE}
KIND_NAMES = {ALL_GATHER: "all_gather_into_tensor", REDUCE_SCATTER: "reduce_scatter_tensor", ALL_REDUCE: "all_reduce"}
DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool,
)
_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
_OP_CODES = {getattr(dist.ReduceOp, name): code for code, name in enumerate(_OPS)}
FIELDS = 6  # kind, group, dtype, numel, op, the group's sequence number before the collective
CAPACITY = 8192  # entries per rank; a rank never gets this far ahead of one that stopped
_FATAL = 6  # [flag, declared by, reason, batch, epoch, the latest epoch in which a rank failed]
_HEADER = 6  # per rank: epoch, committed, done, failed (epoch), pid, site index of its failure
REASON_TIMEOUT, REASON_GONE, REASON_UNTRACKED, REASON_OUTSIDE = 1, 2, 3, 4


class FatalRecoveryError(RuntimeError):
    """A failure with the sync hooks off that cannot be recovered in-process; the job must stop."""


@dataclass(frozen=True)
class FatalRecord:
    declared_by: int
    reason: int
    batch: int
    failed: list[tuple[int, str]]  # (rank, site) of every rank that failed itself

    def message(self, rank: int) -> str:
        why = {
            REASON_TIMEOUT: "a rank did not stop in time",
            REASON_GONE: "a rank exited",
            REASON_UNTRACKED: "it needs a collective the ledger cannot replay",
            REASON_OUTSIDE: "it happened outside any attempt, so there is nothing to retry",
        }.get(self.reason, "unknown reason")
        first = ", ".join(f"rank {r} at {site}" for r, site in self.failed) or "unknown"
        during = "" if self.reason == REASON_OUTSIDE else " with the sync hooks off"
        return (
            f"automicro: rank {rank} stops: failure on {first} in batch {self.batch}{during} "
            f"cannot be recovered in-process ({why}; declared by rank {self.declared_by}). Restart from the "
            "last checkpoint (docs/guides/checkpoints.md: 'When a run cannot recover in-process')."
        )


@dataclass(frozen=True)
class Entry:
    kind: int
    group: int
    dtype: int
    numel: int
    op: int
    sequence: int = -1  # the group's collective count before this one (-1: not known)

    def describe(self) -> str:
        return f"{KIND_NAMES.get(self.kind, self.kind)} of {self.numel} x {DTYPES[self.dtype]} on group {self.group}"


def _op_code(op: Any) -> int:
    if op is None:
        return 0
    try:
        return _OP_CODES.get(op, 0)
    except TypeError:  # a premultiplied-sum op object (unhashable): on the wire it is a SUM
        return 0


class Board:
    """The shared-memory rows every rank publishes its ledger into (one host, x86 store order).

    Layout (int64): the fatal record [flag, declared by, reason, batch, epoch] and the latest
    attempt (epoch) in which some rank failed (one word: the check before every collective reads
    only it); then per rank a
    header [epoch, committed, done, failed epoch, pid, site index]; then per rank a ring of
    `CAPACITY` descriptors.
    A row is valid for attempt `epoch` only while its header says that epoch.
    """

    def __init__(self, segment: np.ndarray, rank: int, world: int, check_pids: bool) -> None:
        self.rank, self.world, self.check_pids = rank, world, check_pids
        # Plain ndarray views of the mapping: np.memmap's subclass costs microseconds per access.
        segment = np.asarray(segment)
        self._map = segment
        self.fatal = segment[:_FATAL]
        self.headers = segment[_FATAL : _FATAL + world * _HEADER].reshape(world, _HEADER)
        self.entries = segment[_FATAL + world * _HEADER :].reshape(world, CAPACITY, FIELDS)
        self.headers[rank, 4] = os.getpid()
        self._own_header = self.headers[rank]
        self._own_entries = self.entries[rank]
        self._failed_epoch = segment[5:6]

    @staticmethod
    def words(world: int) -> int:
        return _FATAL + world * _HEADER + world * CAPACITY * FIELDS

    @classmethod
    def create(cls, group: Optional[dist.ProcessGroup]) -> Optional["Board"]:
        """Collective over a CPU-capable group; None where the ranks cannot share memory."""
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            segment, check_pids = open_shared_segment(group, cls.words(world), "ledger")
        except RuntimeError:
            return None
        return cls(segment, rank, world, check_pids)

    # ---- this rank's row --------------------------------------------------------------------

    def begin(self, epoch: int) -> None:
        row = self.headers[self.rank]
        row[1] = 0
        row[2] = 0
        row[3] = 0
        row[0] = epoch  # last: a reader that sees the new epoch sees the cleared fields

    def publish(self, index: int, entry: tuple[int, int, int, int, int, int]) -> None:
        row = self._own_entries[index % CAPACITY]
        row[0], row[1], row[2], row[3], row[4], row[5] = entry
        self._own_header[1] = index + 1  # after the entry: x86 keeps stores in order

    def mark_done(self) -> None:
        self.headers[self.rank, 2] = 1

    def mark_failed(self, epoch: int, site: str) -> None:
        self.headers[self.rank, 5] = site_index(site)
        self.headers[self.rank, 3] = epoch
        self._failed_epoch[0] = epoch  # every failing rank writes the same value

    # ---- every rank ---------------------------------------------------------------------------

    def failed_in(self, epoch: int) -> bool:
        return self._failed_epoch[0] == epoch

    def snapshot(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(committed, done) per rank for `epoch`; a rank still in an earlier attempt counts as
        running with nothing committed."""
        rows = self.headers.copy()
        current = rows[:, 0] == epoch
        committed = np.where(current, rows[:, 1], 0)
        done = current & (rows[:, 2] == 1)
        return committed, done

    def entry(self, source: int, index: int) -> Entry:
        kind, group, dtype, numel, op, sequence = (int(x) for x in self.entries[source, index % CAPACITY])
        return Entry(kind, group, dtype, numel, op, sequence)

    def gone(self) -> list[int]:
        if not self.check_pids:
            return []
        return [r for r in range(self.world) if r != self.rank and not process_exists(int(self.headers[r, 4]))]

    def declare_fatal(self, reason: int, batch: int, epoch: int) -> None:
        if self.fatal[0]:
            return
        self.fatal[1:5] = (self.rank, reason, batch, epoch)
        self.fatal[0] = 1

    def fatal_record(self) -> Optional["FatalRecord"]:
        """What every rank says when the job is declared lost (None until then)."""
        if not self.fatal[0]:
            return None
        declared_by, reason, batch, epoch = (int(x) for x in self.fatal[1:5])
        failed = [(r, ALL_SITES[int(self.headers[r, 5])]) for r in range(self.world) if self.headers[r, 3] == epoch]
        return FatalRecord(declared_by, reason, batch, failed)

    def close(self) -> None:
        self._map = self.fatal = self.headers = self.entries = None  # type: ignore[assignment]
        self._own_header = self._own_entries = self._failed_epoch = None  # type: ignore[assignment]


class CollectiveLedger:
    """This rank's collective sequence in the current attempt, published on the board.

    `groups`: the process groups the ledger may see, in the same order on every rank (the default
    group first); a collective on any other group is recorded as untracked, and a failure that
    would need it replayed is fatal.
    """

    def __init__(
        self,
        board: Optional[Board],
        groups: list[Any],
        device: torch.device,
        rank: int = 0,
        poll_s: float = 0.2,
        exchange_group: Any = None,
        alarm: Any = None,
        sequence_number: Optional[Callable[[Any], int]] = None,
    ) -> None:
        self.board = board
        # Without a board: the job-lost alarm over the launcher's store (automicro.core.alarm).
        self.alarm = alarm
        # Where the ranks share no board, `align` hands the record over on this group: a CPU group
        # of its own, never one the model's collectives may still be queued on.
        self.exchange_group = exchange_group
        self.groups = list(groups)
        self._group_index = {g: i for i, g in enumerate(self.groups)}
        self.device = device
        self.rank = rank
        self.epoch = 0
        self.committed = 0
        self.issued = 0
        self.replayed_total = 0
        self._stop_early = False
        # The groups' c10d sequence numbers (`sequence_number(group)`: the engine's
        # `collective_sequence_number`, a torch private) let a replay notice a collective outside the
        # ledger (the model's own) that would pair with a replayed one; only with a process group.
        self._sequence_number = sequence_number if dist.is_initialized() else None
        # Without a board (ranks on several nodes) this rank keeps its own record of the attempt;
        # after the consensus, the rank that issued most hands its record to the others (`align`).
        self._entries: list[tuple[int, int, int, int, int, int]] = []
        self._watcher: Optional[threading.Thread] = None
        self._stop_watcher = threading.Event()
        if board is not None and poll_s > 0:
            self._watcher = threading.Thread(
                target=self._watch, args=(poll_s,), name="automicro-ledger-watcher", daemon=True
            )
            self._watcher.start()

    @property
    def live(self) -> bool:
        """Whether a rank that stopped early can be brought back in step in-process."""
        return self.board is not None

    # ---- the attempt --------------------------------------------------------------------------

    def begin_attempt(self, stop_early: bool = True) -> None:
        """`stop_early`: stop at the next collective once another rank failed. Only with the sync
        hooks off: with them on, two ranks that passed a consensus point must both issue the
        collective behind it (the other may already have), so only the hooks may stop a rank."""
        self._stop_early = stop_early and self.board is not None
        self.epoch += 1
        self.committed = self.issued = 0
        self._entries.clear()
        if self.board is not None:
            self.board.begin(self.epoch)

    def before(self, kind: str, tensor: torch.Tensor, group: Any, op: Any = None) -> None:
        """Called right before this rank issues a collective of the current attempt
        (`kind`: "all_gather", "reduce_scatter" or "all_reduce"; the engine's observer API)."""
        board = self.board
        if self._stop_early and board.failed_in(self.epoch):  # type: ignore[union-attr]
            raise OOMOnOtherRank("automicro: another rank failed in this attempt (collective ledger)")
        index = self._group_index.get(group if group is not None else self.groups[0], -1)
        sequence = self._sequence_number(group) if self._sequence_number is not None else -1
        entry = (KINDS[kind], index, _DTYPE_CODES.get(tensor.dtype, -1), tensor.numel(), _op_code(op), sequence)
        if board is not None:
            board.publish(self.committed, entry)
        else:
            self._entries.append(entry)
        self.committed += 1

    def after(self) -> None:
        """The collective committed last was issued (its call returned)."""
        self.issued = self.committed

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
        """A recorded `dist.all_reduce` for collectives the batch step issues itself."""
        if not dist.is_initialized():
            return
        self.before("all_reduce", tensor, group, op)
        dist.all_reduce(tensor, op=op, group=group)
        self.after()

    def stop(self, failed_here: bool, site: str) -> None:
        """This rank issues nothing more in this attempt; `failed_here`: it failed itself (at `site`)."""
        if self.board is not None:
            if failed_here:
                self.board.mark_failed(self.epoch, site)
            self.board.mark_done()

    # ---- bringing this rank back in step -------------------------------------------------------

    def catch_up(self, timeout_s: float, site: str, batch: int) -> int:
        """Replay what other ranks committed to and this rank did not issue, until every rank is
        done with the attempt. Returns how many collectives were replayed. Raises
        `FatalRecoveryError` (after declaring it on the board) when that cannot finish."""
        board = self.board
        if board is None:
            raise self._fatal(site, batch, REASON_UNTRACKED, "the ranks do not share a host, so no rank can see what the others issued")
        start = time.monotonic()
        replayed = 0
        delay = 0.0
        next_probe = start + 1.0
        while True:
            self._raise_if_declared()
            committed, done = board.snapshot(self.epoch)
            target = int(committed.max(initial=0))
            if self.issued < target:
                replayed += self._replay_to(target, committed, site, batch)
                delay = 0.0
                continue
            if done.all():
                self.replayed_total += replayed
                return replayed
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + 1.0
                gone = board.gone()
                if gone:
                    raise self._fatal(site, batch, REASON_GONE, f"rank(s) {gone} exited")
            if now - start > timeout_s:
                late = [r for r in range(board.world) if not done[r]]
                raise self._fatal(
                    site, batch, REASON_TIMEOUT,
                    f"rank(s) {late} did not stop within {timeout_s:g} s (stuck in something outside the "
                    "collective ledger, e.g. a collective of the model's own code, or a host sync on one)",
                )
            delay = min(max(delay * 2, 2e-5), 1e-3)
            time.sleep(delay)

    def _replay_to(self, target: int, committed: np.ndarray, site: str, batch: int) -> int:
        assert self.board is not None
        count = 0
        while self.issued < target:
            index = self.issued
            sources = [r for r in range(self.board.world) if committed[r] > index]
            if not sources:
                break
            source = sources[0]
            if int(committed[source]) - index > CAPACITY:
                raise self._fatal(site, batch, REASON_UNTRACKED, f"rank {source} got more than {CAPACITY} collectives ahead")
            entry = self.board.entry(source, index)
            self._check_replayable(entry, index, source, site, batch)
            self._replay(entry)
            self.issued += 1
            count += 1
        return count

    def _check_replayable(self, entry: Entry, index: int, source: int, site: str, batch: int) -> None:
        problem = self._replay_problem(entry, index, source)
        if problem:
            raise self._fatal(site, batch, REASON_UNTRACKED, problem)

    def _replay_problem(self, entry: Entry, index: int, source: int, replays_before: int = 0) -> str:
        """Why replaying `entry` (collective `index` of rank `source`) would be wrong, or "".
        `replays_before`: replays this rank will have issued on the entry's group before it."""
        if entry.group < 0 or entry.dtype < 0:
            return f"collective {index} ({entry.describe()}) is on a group or dtype the ledger does not track"
        if entry.sequence < 0 or self._sequence_number is None:
            return ""
        mine = self._sequence_number(self.groups[entry.group]) + replays_before
        if mine != entry.sequence:
            # Rank `source` issued other collectives on this group before this one (the model's
            # own, unseen by the ledger): a replay would pair with one of those.
            return (
                f"rank {source} issued {entry.sequence - mine} collective(s) outside the ledger on group "
                f"{entry.group} before collective {index} ({entry.describe()}); replaying it would pair it with one of those"
            )
        return ""

    def _replay(self, entry: Entry) -> None:
        group = self.groups[entry.group]
        size = dist.get_world_size(group)
        dtype = DTYPES[entry.dtype]
        op = getattr(dist.ReduceOp, _OPS[entry.op])
        if entry.kind == ALL_GATHER:
            dist.all_gather_into_tensor(
                torch.empty(entry.numel * size, dtype=dtype, device=self.device),
                torch.zeros(entry.numel, dtype=dtype, device=self.device),
                group=group,
            )
        elif entry.kind == REDUCE_SCATTER:
            if dist.get_backend(group) == "gloo" and op == dist.ReduceOp.AVG:
                op = dist.ReduceOp.SUM  # what FSDP2 asks of gloo; AVG is not a gloo op
            dist.reduce_scatter_tensor(
                torch.empty(entry.numel, dtype=dtype, device=self.device),
                torch.zeros(entry.numel * size, dtype=dtype, device=self.device),
                op=op,
                group=group,
            )
        elif entry.kind == ALL_REDUCE:
            dist.all_reduce(torch.zeros(entry.numel, dtype=dtype, device=self.device), op=op, group=group)
        else:
            raise ValueError(f"unknown collective kind {entry.kind}")

    def align(self, counts: list[int], site: str, batch: int) -> int:
        """After a consensus without a board (ranks on several nodes): bring every rank up to the
        rank that issued most in the attempt (`counts`: what each rank issued, from the verdict,
        the same on every rank). Collective over the exchange group when the counts differ;
        returns how many collectives this rank replayed.

        Only NCCL can get here with different counts: its hosts run ahead and queue collectives on
        their streams, while a gloo rank would still be blocked in the collective it waits for
        (and the consensus would have timed out)."""
        target = max(counts, default=0)
        if min(counts, default=0) == target:
            return 0
        source = counts.index(target)
        group = self.exchange_group
        box: list[Any] = [self._entries[:target] if self.rank == source else None]
        dist.broadcast_object_list(box, src=source if group is None else dist.get_global_rank(group, source), group=group)
        entries = [Entry(*fields) for fields in box[0][self.issued : target]]
        # Check every replay before issuing any, and agree: a rank that cannot replay stops the job
        # on every rank with its reason, instead of leaving the others to wait for it.
        planned: dict[int, int] = {}
        problem = ""
        for offset, entry in enumerate(entries):
            problem = self._replay_problem(entry, self.issued + offset, source, planned.get(entry.group, 0))
            if problem:
                break
            planned[entry.group] = planned.get(entry.group, 0) + 1
        problems: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
        found = [(rank, text) for rank, text in enumerate(problems) if text]
        if found:
            raise FatalRecoveryError(
                f"automicro: rank {self.rank} stops: the failure at {site} in batch {batch} happened with the sync "
                f"hooks off and cannot be recovered in-process: rank {found[0][0]} cannot replay: {found[0][1]}. "
                "Restart from the last checkpoint (docs/guides/checkpoints.md: 'When a run cannot recover in-process')."
            )
        for entry in entries:
            self._replay(entry)
            self.issued += 1
        self.replayed_total += len(entries)
        return len(entries)

    # ---- the job is lost ----------------------------------------------------------------------

    def lost_outside_attempt(self, where: str, batch: int, what: str = "it ran out of memory") -> FatalRecoveryError:
        """This rank failed outside any attempt (`where`: e.g. a callback at Event.BATCH_END, a
        checkpoint save): nothing to retry, and the other ranks are already in the next batch.
        Tell every rank that can hear it (board or alarm); the error to raise. `what`: the failure."""
        site = "between_batches"
        if self.board is not None:
            self.board.mark_failed(self.epoch, site)
        return self._fatal(
            site, batch, REASON_OUTSIDE,
            f"{what} outside any attempt ({where}), where nothing can be retried", during="",
        )

    def lost(self, site: str, batch: int, why: str) -> FatalRecoveryError:
        """The job cannot recover (`why`): tell every rank that can hear it; the error to raise."""
        return self._fatal(site, batch, REASON_TIMEOUT, why)

    def _fatal(
        self, site: str, batch: int, reason: int, why: str, during: str = " while the sync hooks were off"
    ) -> FatalRecoveryError:
        first = ""
        if self.board is not None:
            self.board.declare_fatal(reason, batch, self.epoch)
            record = self.board.fatal_record()
            if record is not None and record.failed:
                first = " (" + ", ".join(f"rank {r} failed at {s}" for r, s in record.failed) + ")"
        error = FatalRecoveryError(
            f"automicro: rank {self.rank} cannot recover in-process from the failure at {site} in batch {batch}"
            f"{first}{during}: {why}. Stopping the job; restart it from the last checkpoint "
            "(docs/guides/checkpoints.md: 'When a run cannot recover in-process')."
        )
        if self.alarm is not None:
            self.alarm.ring(str(error))
        return error

    def _raise_if_declared(self) -> None:
        record = self.board.fatal_record() if self.board is not None else None
        if record is not None:
            raise FatalRecoveryError(record.message(self.rank))

    def _watch(self, poll_s: float) -> None:
        """Ends this rank when another declared the job lost and this one does not follow within
        a grace period (its main thread is stuck inside a collective or a device sync)."""
        while not self._stop_watcher.wait(poll_s):
            board = self.board
            if board is None:
                return
            record = board.fatal_record()
            if record is None or record.declared_by == self.rank:
                continue
            if self._stop_watcher.wait(5.0):
                return
            print(f"[automicro] {record.message(self.rank)}", file=sys.stderr, flush=True)
            os._exit(3)

    def close(self) -> None:
        if self.alarm is not None:
            self.alarm.close()
        self._stop_watcher.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2.0)
        if self.board is not None:
            self.board.close()
            self.board = None


__all__ = ["Board", "CollectiveLedger", "Entry", "FatalRecord", "FatalRecoveryError"]
