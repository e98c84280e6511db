"""The job-lost alarm across nodes: one key in the job's TCP store, watched by a thread per rank.

Owns: telling every rank of every node, within seconds, that the job cannot recover in-process,
with the message of the rank that found out, and ending a rank whose main thread cannot hear it
(blocked inside a collective or a device sync). May not touch: the consensus, the ledger's replay,
FSDP2, Composer.

Why. On one node the ledger's shared-memory board carries the "job lost" record and its watcher
ends stuck ranks. Ranks on several nodes share no memory, and a rank blocked in a gloo collective
(or an NCCL rank whose host waits on its stream) never reaches the consensus again: without this,
it waits until the process group's timeout and dies with a message that does not name the rank
that failed. The launcher's rendezvous store (MASTER_ADDR:MASTER_PORT, which torchrun and the
composer launcher both set) is reachable from every node. Each rank opens two clients of its own
(never the default group's, whose lock a blocked wait would hold): one to raise the alarm, one for
a daemon thread that waits on this rank's key, which costs nothing while nothing fails (a wait
held by the store's server, no polling). Ringing sets every rank's key (one store write per rank,
only when the job is lost); closing sets this rank's own key empty, which ends its thread at once.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

from automicro.core.transport import launcher_store_clients

GRACE_S = 5.0  # how long a rank's own main thread gets to stop by itself once the alarm rang
_WAIT_S = 300.0  # one store wait; the watcher waits again after each


class JobLostAlarm:
    """Raise (`ring`) or hear the alarm; `create` on every rank at once."""

    def __init__(
        self, ring_store: Any, watch_store: Any, key: str, rank: int, world: int, grace_s: float = GRACE_S
    ) -> None:
        self._ring_store = ring_store
        self._watch_store = watch_store
        self.key = key
        self.rank = rank
        self.world = world
        self.grace_s = grace_s
        self._rang_here = False
        # The message another rank rang with, once heard: the main thread names that rank when its
        # own error (a collective the lost rank left) reaches it within the grace period.
        self.heard: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="automicro-job-lost-alarm", daemon=True)
        self._thread.start()
        # The thread must be out of its store wait before the interpreter shuts down.
        atexit.register(self.close)

    def _key(self, rank: int) -> str:
        return f"{self.key}/rank{rank}"

    @classmethod
    def create(cls, group: Any = None) -> Optional["JobLostAlarm"]:
        """Collective over `group` (all ranks). None where there is no launcher store to reach
        (MASTER_ADDR / MASTER_PORT unset, or it refuses a client); every rank decides alike."""
        found = launcher_store_clients(group, "job-lost")
        if found is None:
            return None
        key, stores = found
        return cls(stores[0], stores[1], key, dist.get_rank(), dist.get_world_size())

    def ring(self, message: str) -> None:
        """This rank found the job lost: every other rank stops within `grace_s` + seconds."""
        self._rang_here = True
        try:
            for rank in range(self.world):
                if rank != self.rank:
                    self._ring_store.set(self._key(rank), message)
        except RuntimeError:
            pass  # the store's host is gone: the launcher is ending the job anyway

    def _watch(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._watch_store.wait([self._key(self.rank)], datetime.timedelta(seconds=_WAIT_S))
                message = self._watch_store.get(self._key(self.rank)).decode(errors="replace")
            except RuntimeError:
                if time.monotonic() - started < _WAIT_S / 2:
                    return  # not a timeout: the store is gone (the job is ending)
                continue
            if not message or self._rang_here:
                return
            self.heard = message
            if self._stop.wait(self.grace_s):
                return
            print(f"[automicro] rank {self.rank} stops: {message}", file=sys.stderr, flush=True)
            os._exit(3)

    def close(self) -> None:
        """Stop listening: wakes this rank's thread (an empty message) and waits for it."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._ring_store.set(self._key(self.rank), "")
        except RuntimeError:
            pass  # the store is gone: so is the thread's wait
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


__all__ = ["JobLostAlarm"]
