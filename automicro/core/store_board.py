"""The collective ledger's board across nodes: the launcher's TCP store, written only after a failure.

Owns: telling every rank of every node that a rank failed in the current attempt, and handing each
rank's record of the attempt to the ranks that must replay it, through the job's rendezvous store
(MASTER_ADDR:MASTER_PORT, which torchrun and the composer launcher both set). May not touch: the
consensus, FSDP2, Composer; the replay itself is the ledger's (`CollectiveLedger.catch_up`).

Why (`benchmarks/RESULTS.md`, 2026-11-23, the slow link and two nodes). Ranks on several nodes share no memory, so before this a
rank kept its record to itself until the consensus, and the ranks behind replayed it afterwards
(`CollectiveLedger.align`). That needs every rank's host to reach the consensus, and on GPUs it
does not: with a real model, the rank that did not fail has its stream stuck behind an all-gather
the failed rank never issued, and its host blocks inside the backward (in C++) once CUDA's launch
queue or NCCL's work queue is full. On gloo its host blocks in the collective itself. Either way
the rank's main thread cannot answer. A thread of its own can: both block in C++ with the GIL
released. So this board has the shape of the shared-memory one (`automicro.core.ledger.Board`),
and `catch_up` runs on it unchanged:

- While nothing fails, `publish` appends to a list in memory; nothing goes to the store. A
  listener thread per rank waits for its next notice key in the store (a wait held by the store's
  server: no polling, nothing sent while nothing fails).
- A rank that fails writes its own record and gives every other rank a notice naming the attempt
  (a counter and a key per rank, only on failure). Each listener then copies its rank's record into
  the store as it grows, and its "done" once the main thread stops, so a rank that stopped early
  replays what the others issued while their main threads are still blocked.
- The check before every collective (`failed_in`) reads one attribute the listener sets.

Keys live under a prefix drawn per run (`automicro/ledger/<uuid>/`): per rank `notice/<rank>/count`
and `notice/<rank>/<n>` (the n-th notice: an attempt number); per attempt `<epoch>/<rank>/committed`
and `<epoch>/<rank>/done` (store counters) and `<epoch>/<rank>/e/<index>` (one descriptor). A
rank that is gone, or a job declared lost, is the job-lost alarm's to announce
(`automicro.core.alarm`); this board reports neither.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from automicro.core.ledger import Entry, FatalRecord
from automicro.core.transport import launcher_store_clients

NOTICE_WAIT_S = 300.0  # one wait of the listener for its next notice; it waits again after each
_PUBLISH_POLL_S = 0.001  # how often a notified listener copies new entries of its rank into the store


class StoreBoard:
    """`Board`'s interface over the launcher's store, for ranks on several nodes; `create` on every rank."""

    def __init__(self, main_store: Any, listen_store: Any, prefix: str, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._store = main_store  # the main thread: notices, its own record, the catching-up reads
        self._listen_store = listen_store  # the listener thread: waits, and its rank's record meanwhile
        self._prefix = prefix
        self._epoch = 0
        self._entries: list[tuple[int, ...]] = []
        self._done = False
        self._failed_epoch = -1  # the latest attempt in which some rank failed, as far as this rank knows
        self._published = 0  # entries of the current attempt already in the store
        self._done_published = False
        self._lock = threading.Lock()  # one writer of this rank's record at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="automicro-ledger-listener", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def create(cls, group: Any = None) -> Optional["StoreBoard"]:
        """Collective over `group` (all ranks). None where the launcher's store cannot be reached
        from every rank (MASTER_ADDR / MASTER_PORT unset, or a refused client)."""
        found = launcher_store_clients(group, "ledger")
        if found is None:
            return None
        prefix, stores = found
        return cls(stores[0], stores[1], prefix, dist.get_rank(), dist.get_world_size())

    def _key(self, *parts: Any) -> str:
        return "/".join((self._prefix,) + tuple(str(p) for p in parts))

    # ---- this rank's record (the ledger's main thread) ----------------------------------------

    def begin(self, epoch: int) -> None:
        with self._lock:
            self._entries = []
            self._done = False
            self._published = 0
            self._done_published = False
            self._epoch = epoch  # last: the listener re-arms for it

    def publish(self, index: int, entry: tuple[int, ...]) -> None:
        self._entries.append(entry)  # index == len - 1; the store hears of it only after a failure

    def mark_done(self) -> None:
        self._done = True
        if self._failed_epoch == self._epoch:
            self._flush(self._store)

    def mark_failed(self, epoch: int, site: str) -> None:
        self._failed_epoch = epoch
        self._flush(self._store)
        for rank in range(self.world):
            if rank != self.rank:
                self._notify(rank, str(epoch))

    def _flush(self, store: Any) -> None:
        """Copy what the store lacks of this rank's record (and its "done") into it."""
        with self._lock:
            epoch, entries = self._epoch, self._entries
            count = len(entries)
            for index in range(self._published, count):
                store.set(self._key(epoch, self.rank, "e", index), ",".join(str(x) for x in entries[index]))
            if count > self._published:
                # After the entries: a reader that sees the count finds every entry below it.
                store.add(self._key(epoch, self.rank, "committed"), count - self._published)
                self._published = count
            if self._done and not self._done_published:
                store.add(self._key(epoch, self.rank, "done"), 1)
                self._done_published = True

    # ---- every rank ---------------------------------------------------------------------------

    def failed_in(self, epoch: int) -> bool:
        return self._failed_epoch == epoch

    def snapshot(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(committed, done) per rank for `epoch`: this rank's from memory, the others' from what
        they copied into the store (nothing yet: running, with nothing committed)."""
        committed = np.zeros(self.world, dtype=np.int64)
        done = np.zeros(self.world, dtype=bool)
        for rank in range(self.world):
            if rank == self.rank:
                if epoch == self._epoch:
                    committed[rank], done[rank] = len(self._entries), self._done
                continue
            committed[rank] = self._store.add(self._key(epoch, rank, "committed"), 0)
            done[rank] = self._store.add(self._key(epoch, rank, "done"), 0) > 0
        return committed, done

    def entry(self, source: int, index: int) -> Entry:
        if source == self.rank:
            fields = self._entries[index]
        else:
            raw = self._store.get(self._key(self._epoch, source, "e", index)).decode()
            fields = tuple(int(x) for x in raw.split(","))
        return Entry(*fields)

    def gone(self) -> list[int]:
        return []  # no pids across hosts: the catch-up's timeout and the job-lost alarm cover it

    def declare_fatal(self, reason: int, batch: int, epoch: int) -> None:
        pass  # across nodes the job-lost alarm carries it (the ledger rings it)

    def fatal_record(self) -> Optional[FatalRecord]:
        return None

    # ---- the listener -------------------------------------------------------------------------

    def _listen(self) -> None:
        heard = 0  # notices of this rank read so far: the next one is `<rank>/notice/<heard + 1>`
        while not self._stop.is_set():
            key = self._key("notice", self.rank, heard + 1)
            started = time.monotonic()
            try:
                self._listen_store.wait([key], datetime.timedelta(seconds=NOTICE_WAIT_S))
                epoch_text = self._listen_store.get(key).decode()
            except RuntimeError:
                if time.monotonic() - started < NOTICE_WAIT_S / 2:
                    return  # not a timeout: the store is gone (the job is ending)
                continue
            heard += 1
            if self._stop.is_set() or not epoch_text.isdigit():
                return
            epoch = int(epoch_text)
            if epoch != self._epoch or (self._failed_epoch == epoch and self._done_published):
                continue  # an attempt this rank is not in, or one already answered (a second failing rank)
            self._failed_epoch = epoch
            # Copy this rank's record as it grows until its main thread is done with the attempt.
            while not self._stop.is_set() and self._epoch == epoch:
                try:
                    self._flush(self._listen_store)
                except RuntimeError:
                    return  # the store is gone
                if self._done_published:
                    break
                time.sleep(_PUBLISH_POLL_S)

    def _notify(self, rank: int, text: str) -> None:
        count = self._store.add(self._key("notice", rank, "count"), 1)
        self._store.set(self._key("notice", rank, count), text)

    def close(self) -> None:
        """Stop listening: wakes the listener (a notice of its own) and waits for it."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._notify(self.rank, "closing")
        except RuntimeError:
            pass  # the store is gone: so is the listener's wait
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


__all__ = ["StoreBoard", "NOTICE_WAIT_S"]
