"""Runs that stop making progress (tests/test_watchdog.py): a stall injected on one rank in a forward, before a
collective, inside a consensus round, inside a compile, inside a checkpoint save or an evaluation; the watchdog
(`automicro.core.watchdog`) reports it on every rank and ends every rank. Each rank writes its stderr (the report,
the stacks, the end line) to `folder/rankN.err` and its pid to `folder/rankN.pid`; a rank the watchdog ends never
returns, so the test reads those files."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

import torch
from composer.core import Callback

import automicro
from automicro.composer.callback import AutoMicrobatching
from tests.automicro_cases import SEED, make_loader
from tests.toy_models import ComposerStack

HOUR = 3600.0
STALL_BATCH = 5  # after the search settled (the whole batch fits at once) and the sync hooks came off
BATCHES = 12


def _own_stderr(folder: str, rank: int) -> None:
    """This rank's stderr (file descriptor 2, which the watchdog and faulthandler write) to a file of its own."""
    handle = os.open(os.path.join(folder, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(handle, 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stderr until it ends
    with open(os.path.join(folder, f"rank{rank}.pid"), "w", encoding="utf-8") as out:
        out.write(str(os.getpid()))


class SleepAt(Callback):
    """Sleeps `seconds` on `rank` at Composer's `event` ("before_forward", "eval_before_forward", ...) in batch
    `batch` (or the first eval batch after it)."""

    def __init__(self, event: str, rank: int, batch: int, seconds: float, marker: str = "") -> None:
        self.event, self.rank, self.batch, self.seconds, self.marker = event, rank, batch, seconds, marker

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        if event.value == self.event and torch.distributed.get_rank() == self.rank and int(state.timestamp.batch) >= self.batch:
            if self.marker:  # the test sends its signal once this rank sleeps
                open(self.marker, "w").close()
            time.sleep(self.seconds)


class SleepIn(Callback):
    """From batch `batch` on `rank`, the callable `owner.name` sleeps `seconds` before it runs (a consensus round,
    a checkpoint save, FSDP2's pre-collective site): set at fit start, when the owner exists."""

    def __init__(self, owner: Any, name: str, rank: int, batch: int, seconds: float, marker: str = "") -> None:
        self.owner, self.name, self.rank, self.batch, self.seconds, self.marker = owner, name, rank, batch, seconds, marker
        self.now = -1

    def batch_start(self, state: Any, logger: Any) -> None:
        self.now = int(state.timestamp.batch)

    def fit_start(self, state: Any, logger: Any) -> None:
        owner = self.owner() if callable(self.owner) and not hasattr(self.owner, self.name) else self.owner
        original = getattr(owner, self.name)

        def slow(*args: Any, **kwargs: Any) -> Any:
            if torch.distributed.get_rank() == self.rank and self.now >= self.batch:
                if self.marker:  # the test sends its signal once this rank sleeps
                    open(self.marker, "w").close()
                time.sleep(self.seconds)
            return original(*args, **kwargs)

        setattr(owner, self.name, slow)


def _slow_backend(rank: int, seconds: float) -> str:
    """A compile backend that takes `seconds` on `rank` (a compile that never ends, or a long legitimate one) and
    then runs the graph as traced."""
    from torch._dynamo import register_backend

    name = f"automicro_test_slow_{rank}_{int(seconds)}"

    @register_backend(name=name)
    def slow(graph: Any, example_inputs: Any) -> Any:
        if torch.distributed.get_rank() == rank:
            time.sleep(seconds)
        return graph.forward

    return name


def run(rank: int, world: int, where: str, folder: str, report_s: Optional[float] = 2.0, end_s: Optional[float] = 6.0,
        stalled_rank: int = 1, seconds: float = HOUR, signal_exit_s: float = 30.0,
        floors: Optional[tuple[float, float, float, float]] = None) -> dict[str, Any]:
    """A fit of the toy stack (2 CPU ranks, gloo) with `where` stalling `stalled_rank` for `seconds`. `floors`: the
    settled batches' limits (report floor and multiple, end floor and multiple), lowered for a test."""
    _own_stderr(folder, rank)
    if floors is not None:
        from automicro.core import watchdog

        watchdog.SETTLED_REPORT_MIN_S, watchdog.SETTLED_REPORT_X, watchdog.SETTLED_END_MIN_S, watchdog.SETTLED_END_X = floors
    torch.manual_seed(0)
    # A rank whose collective fails once the stalled one ended (gloo notices a closed peer on torch >= 2.8) exits
    # within 2 s of its error.
    auto = AutoMicrobatching(log_attempts=False, stall_report_s=report_s, stall_end_s=end_s, signal_exit_s=signal_exit_s,
                             exit_timeout_s=2.0)
    callbacks: list[Any] = [auto]
    more: dict[str, Any] = {}
    if where == "forward":
        callbacks.append(SleepAt("before_forward", stalled_rank, STALL_BATCH, seconds,
                                 marker=os.path.join(folder, f"rank{stalled_rank}.sleeping")))
    elif where == "evaluation":
        callbacks.append(SleepAt("eval_before_forward", stalled_rank, STALL_BATCH, seconds))
        more = dict(eval_dataloader=make_loader(world, 2), eval_interval=f"{STALL_BATCH + 1}ba")
    elif where == "collective":  # before FSDP2's all-gather: the other rank goes into it alone
        callbacks.append(SleepIn(torch.distributed, "all_gather_into_tensor", stalled_rank, STALL_BATCH, seconds,
                                 marker=os.path.join(folder, f"rank{stalled_rank}.sleeping")))
    elif where == "consensus":  # inside the end-of-attempt consensus round: the other rank waits in it
        callbacks.append(SleepIn(lambda: auto.runtime.consensus, "finish", stalled_rank, STALL_BATCH, seconds))
    elif where == "checkpoint":
        from composer.utils import checkpoint

        callbacks.append(SleepIn(checkpoint, "save_checkpoint", stalled_rank, STALL_BATCH, seconds))
        more = dict(save_folder=os.path.join(folder, "checkpoints"), save_interval=f"{STALL_BATCH + 1}ba", save_overwrite=True)
    elif where == "compile":
        more = dict(compile={"backend": _slow_backend(stalled_rank, seconds), "scope": "blocks", "dynamic": True})
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
