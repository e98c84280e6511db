"""Runs that stop making progress (tests/test_watchdog.py): a stall injected on one rank in a forward, before a
collective, inside a consensus round, inside a compile, inside a checkpoint save or an evaluation; the watchdog
(`automicro.core.watchdog`) reports it on every rank and ends every rank. Each rank writes its stderr (the report,
the stacks, the end line) to `folder/rankN.err` and its pid to `folder/rankN.pid`; a rank the watchdog ends never
returns, so the test reads those files.

No outcome here depends on how long anything took. Every rank's watchdog reads a `VirtualClock`: a second for
each batch trained, nothing else, plus what the test adds by writing `folder/rankN.jump` (`jump`). Every rank
passes the point where the stalled one stops (`Stall`): the stalled rank sleeps there; every other rank goes on to
the next collective or consensus round, which can never complete. Once a rank is there (its main thread in the
places the test expects: `Arrival`, which reads the stack, not a clock) it writes `folder/rankN.arrived`; the test
then moves each rank's clock past its limits in the order it chooses (`tests/test_watchdog.py`)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Optional

import torch
from composer.core import Callback

import automicro
from automicro.composer.callback import AutoMicrobatching
from automicro.core import watchdog
from tests.automicro_cases import SEED, make_loader
from tests.toy_models import ComposerStack

HOUR = 3600.0
STALL_BATCH = 5  # after the search settled (the whole batch fits at once) and the sync hooks came off
BATCHES = 12
ARRIVAL_POLL_S = 0.02


def jump(folder: str, rank: int, seconds: float) -> None:
    """Moves `rank`'s virtual clock to `seconds` past the batches it counted (written whole, then renamed: a rank
    never reads half a number)."""
    path = os.path.join(folder, f"rank{rank}.jump")
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        out.write(repr(float(seconds)))
    os.replace(path + ".tmp", path)


class VirtualClock(Callback):
    """The seconds this rank's watchdog measures: one per training batch trained (so every settled batch takes
    exactly 1.0 s) plus the test's jump (`jump`). Set on the watchdog at fit start."""

    def __init__(self, auto: AutoMicrobatching, folder: str, rank: int) -> None:
        self.auto, self.path, self.batches = auto, os.path.join(folder, f"rank{rank}.jump"), 0

    def __call__(self) -> float:
        try:
            with open(self.path, encoding="utf-8") as handle:
                jumped = float(handle.read())
        except FileNotFoundError:
            jumped = 0.0
        return self.batches + jumped

    def fit_start(self, state: Any, logger: Any) -> None:
        dog = self.auto.runtime.watchdog
        dog.clock = self
        dog.beat()

    def after_train_batch(self, state: Any, logger: Any) -> None:  # inside the batch the watchdog times
        self.batches += 1


class Arrival:
    """Writes `folder/rankN.arrived` (what `watchdog.where_waiting` read) once `reached()` was called and this
    process's main thread is in every one of `places` (a thread reading the main thread's stack every
    `ARRIVAL_POLL_S`). Past the stall point a rank's next collective or consensus round never completes, so once
    there it stays: what the file says holds until the test ends the rank."""

    def __init__(self, folder: str, rank: int, places: list[str]) -> None:
        self.path, self.places = os.path.join(folder, f"rank{rank}.arrived"), places
        self._reached = threading.Event()
        threading.Thread(target=self._watch, name="test-arrival", daemon=True).start()

    def reached(self) -> None:
        self._reached.set()

    def _watch(self) -> None:
        self._reached.wait()
        while True:
            where = watchdog.where_waiting(watchdog.main_thread_frames())
            if all(place in where for place in self.places):
                with open(self.path + ".tmp", "w", encoding="utf-8") as out:
                    out.write(where)
                os.replace(self.path + ".tmp", self.path)
                return
            time.sleep(ARRIVAL_POLL_S)


class Stall:
    """The stall point: the stalled rank sleeps `seconds` there (its arrival reached first); every other rank
    marks its arrival reached and goes on (into what never completes)."""

    def __init__(self, stalled_rank: int, seconds: float, arrival: Optional[Arrival]) -> None:
        self.stalled_rank, self.seconds, self.arrival = stalled_rank, seconds, arrival

    def __call__(self) -> None:
        if self.arrival is not None:
            self.arrival.reached()
        if torch.distributed.get_rank() == self.stalled_rank:
            time.sleep(self.seconds)


def _own_stderr(folder: str, rank: int) -> None:
    """This rank's stderr (file descriptor 2, which the watchdog and faulthandler write) to a file of its own."""
    handle = os.open(os.path.join(folder, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(handle, 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stderr until it ends
    with open(os.path.join(folder, f"rank{rank}.pid"), "w", encoding="utf-8") as out:
        out.write(str(os.getpid()))


class StallAt(Callback):
    """The stall point at Composer's `event` ("before_forward", "eval_before_forward", ...) in batch `batch` (or
    the first eval batch after it), once."""

    def __init__(self, event: str, batch: int, stall: Stall) -> None:
        self.event, self.batch, self.stall, self.done = event, batch, stall, False

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        if event.value == self.event and int(state.timestamp.batch) >= self.batch and not self.done:
            self.done = True
            self.stall()


class StallIn(Callback):
    """The stall point before the callable `owner.name` runs (a consensus round, a checkpoint save, FSDP2's
    collective) for the first time from batch `batch` on: set at fit start, when the owner exists."""

    def __init__(self, owner: Any, name: str, batch: int, stall: Stall) -> None:
        self.owner, self.name, self.batch, self.stall = owner, name, batch, stall
        self.now, self.done = -1, False

    def batch_start(self, state: Any, logger: Any) -> None:
        self.now = int(state.timestamp.batch)

    def fit_start(self, state: Any, logger: Any) -> None:
        owner = self.owner() if callable(self.owner) and not hasattr(self.owner, self.name) else self.owner
        original = getattr(owner, self.name)

        def stalling(*args: Any, **kwargs: Any) -> Any:
            if self.now >= self.batch and not self.done:
                self.done = True
                self.stall()
            return original(*args, **kwargs)

        setattr(owner, self.name, stalling)


def _slow_backend(rank: int, seconds: float, stall: Stall) -> str:
    """A compile backend that takes `seconds` on `rank` (a compile that never ends, or a long legitimate one) and
    then runs the graph as traced; on every rank its first call is the stall point."""
    from torch._dynamo import register_backend

    name = f"automicro_test_slow_{rank}_{int(seconds)}"

    @register_backend(name=name)
    def slow(graph: Any, example_inputs: Any) -> Any:
        stall()
        return graph.forward

    return name


def run(rank: int, world: int, where: str, folder: str, report_s: Optional[float] = 2.0, end_s: Optional[float] = 6.0,
        stalled_rank: int = 1, seconds: float = HOUR, signal_exit_s: float = 30.0,
        floors: Optional[tuple[float, float, float, float]] = None, places: Optional[dict[int, list[str]]] = None,
        virtual: bool = True) -> dict[str, Any]:
    """A fit of the toy stack (2 CPU ranks, gloo) with `where` stalling `stalled_rank` for `seconds`. `floors`: the
    settled batches' limits (report floor and multiple, end floor and multiple), lowered for a test. `places`: per
    rank, where its main thread must be before it writes `rankN.arrived` (none: no file). `virtual`: the watchdog
    reads the `VirtualClock` (the limits are in its seconds), else the real one."""
    _own_stderr(folder, rank)
    if floors is not None:
        watchdog.SETTLED_REPORT_MIN_S, watchdog.SETTLED_REPORT_X, watchdog.SETTLED_END_MIN_S, watchdog.SETTLED_END_X = floors
    torch.manual_seed(0)
    auto = AutoMicrobatching(log_attempts=False, stall_report_s=report_s, stall_end_s=end_s, signal_exit_s=signal_exit_s,
                             exit_timeout_s=2.0)
    arrival = Arrival(folder, rank, places[rank]) if places is not None else None
    stall = Stall(stalled_rank, seconds if rank == stalled_rank else 0.0, arrival)
    callbacks: list[Any] = [auto] + ([VirtualClock(auto, folder, rank)] if virtual else [])
    more: dict[str, Any] = {}
    if where == "forward":
        callbacks.append(StallAt("before_forward", STALL_BATCH, stall))
    elif where == "evaluation":
        callbacks.append(StallAt("eval_before_forward", STALL_BATCH, stall))
        more = dict(eval_dataloader=make_loader(world, 2), eval_interval=f"{STALL_BATCH + 1}ba")
    elif where == "collective":  # before FSDP2's all-gather: the other rank goes into it alone
        callbacks.append(StallIn(torch.distributed, "all_gather_into_tensor", STALL_BATCH, stall))
    elif where == "consensus":  # inside the end-of-attempt consensus round: the other rank waits in it
        callbacks.append(StallIn(lambda: auto.runtime.consensus, "finish", STALL_BATCH, stall))
    elif where == "checkpoint":
        from composer.utils import checkpoint

        callbacks.append(StallIn(checkpoint, "save_checkpoint", STALL_BATCH, stall))
        more = dict(save_folder=os.path.join(folder, "checkpoints"), save_interval=f"{STALL_BATCH + 1}ba", save_overwrite=True)
    elif where == "compile":
        more = dict(compile={"backend": _slow_backend(stalled_rank, seconds, stall), "scope": "blocks", "dynamic": True})
    model = ComposerStack()
    trainer = automicro.Trainer(
        model=model, train_dataloader=make_loader(world, BATCHES), max_duration=f"{BATCHES}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", parallelism_config={"fsdp2": {}},
        device_train_microbatch_size="auto", callbacks=callbacks, loggers=[], progress_bar=False, log_to_console=False,
        seed=SEED, **more,
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    return {"finished": int(trainer.state.timestamp.batch)}
