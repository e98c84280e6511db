"""Multi-rank cases for failures after the sync hooks are off (the steady phase).

A search driver (`FaultInjector("forward", above=ABOVE)`) makes the search settle on size 5 with
the split (4, 4); after `stable_batches` clean batches the hooks come off. Then one more injector
fails at an exact site, rank set and microbatch in batch `FAULT_BATCH`. Every case returns plain
data for tests/test_steady_state.py; a case that breaks is returned as {"crash": ...}.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from composer.core import Callback, State
from composer.loggers import Logger

from automicro.core.ledger import FatalRecoveryError
from automicro.composer.callback import AutoMicrobatching
from automicro.testing.faults import FaultInjector
from tests.automicro_cases import adam_steps, build_trainer, history, max_error
from tests.toy_models import full_state

ABOVE = 5  # search: 8 fails, 4 fits, 6 fails, 5 fits -> split (4, 4)
SPLIT = (4, 4)
BATCHES = 9
FAULT_BATCH = 7  # the hooks are off from batch 5 (batch 1 converges, batches 2-4 are clean)
MICROBATCH = {"first": 0, "last": -1}
SITES = ("forward_pre", "forward", "backward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc", "loss",
         "optimizer_step", "grad_hook")


class GradHookOOM(Callback):
    """A gradient hook of the user's model (on a block's output) that raises an OOM in backward, on
    `ranks`, in batch `batch`, at microbatch `microbatch_index` (-1: the last), once."""

    def __init__(self, ranks: Optional[list[int]], batch: int, microbatch_index: int) -> None:
        self.ranks, self.batch, self.microbatch_index = ranks, batch, microbatch_index
        self.fired = 0
        self._handle: Any = None
        self._sites: Any = None

    def attach_sites(self, sites: Any) -> None:
        # automicro.Trainer hands every callback with this method its attempt context.
        self._sites = sites

    def fit_start(self, state: State, logger: Logger) -> None:
        assert self._sites is not None, "automicro.Trainer did not hand over its sites"
        self._handle = state.model.model.blocks[1].register_forward_hook(self._on_output)

    def _on_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        context = self._sites.context
        wanted = context.num_microbatches - 1 if self.microbatch_index == -1 else self.microbatch_index
        rank = dist.get_rank()
        armed = (
            output.requires_grad
            and context.in_attempt
            and context.batch_index == self.batch
            and (self.ranks is None or rank in self.ranks)
            and context.microbatch_index == wanted
            and self.fired == 0
        )
        if armed:
            def hook(grad: torch.Tensor) -> None:
                self.fired += 1
                raise torch.OutOfMemoryError(f"CUDA out of memory (test: gradient hook on rank {rank})")

            output.register_hook(hook)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class SlowForwardOOM(GradHookOOM):
    """An OOM in the forward of block 1 that the failing rank raises only once every other rank has gone on and
    committed a collective this rank never issues (gloo: its host blocked in it; NCCL: its stream), so it can only be
    brought back by a replay. Decided by the ranks' collective ledgers, not by a clock: the failing rank writes how
    many collectives it committed in this attempt; each other rank's thread writes back once its own ledger committed
    more (`automicro.core.ledger`), in a folder rank 0 names at fit start."""

    HANG_S = 300.0  # a bound on the wait for the other ranks (each is milliseconds): only a broken case reaches it

    def __init__(self, ranks: Optional[list[int]], batch: int, microbatch_index: int) -> None:
        super().__init__(ranks, batch, microbatch_index)
        self.folder, self.name = "", "fault"
        self.auto: Any = None  # set by `_run`: its ledger

    def fit_start(self, state: State, logger: Logger) -> None:
        super().fit_start(state, logger)
        named = [os.path.join(tempfile.gettempdir(), f"automicro-slow-forward-{uuid.uuid4().hex}") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(named, src=0)  # before any attempt: every rank's collectives stay in step
        self.folder = named[0]
        os.makedirs(self.folder, exist_ok=True)
        if self.ranks is not None and dist.get_rank() not in self.ranks:
            threading.Thread(target=self._say_when_ahead, name="test-ahead", daemon=True).start()

    def _path(self, what: str, rank: Optional[int] = None) -> str:
        return os.path.join(self.folder, f"{self.name}-{what}" + ("" if rank is None else f"-rank{rank}"))

    def _say_when_ahead(self) -> None:
        """A rank that does not fail: once the failing one said how far it got, wait for this rank's ledger to have
        committed more in the same attempt, then say so."""
        failing = self._path("committed")
        while not os.path.exists(failing):
            time.sleep(0.01)
        with open(failing, encoding="utf-8") as handle:
            theirs = int(handle.read())
        ledger = self.auto.runtime.ledger
        while ledger.committed <= theirs:
            time.sleep(0.01)
        open(self._path("ahead", dist.get_rank()), "w").close()

    def _on_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        context = self._sites.context
        wanted = context.num_microbatches - 1 if self.microbatch_index == -1 else self.microbatch_index
        if (
            context.in_attempt
            and context.batch_index == self.batch
            and (self.ranks is None or dist.get_rank() in self.ranks)
            and context.microbatch_index == wanted
            and self.fired == 0
        ):
            self.fired += 1
            with open(self._path("committed") + ".tmp", "w", encoding="utf-8") as out:
                out.write(str(self.auto.runtime.ledger.committed))
            os.replace(self._path("committed") + ".tmp", self._path("committed"))
            others = [r for r in range(dist.get_world_size()) if r not in (self.ranks or [])]
            deadline = time.monotonic() + self.HANG_S
            while not all(os.path.exists(self._path("ahead", r)) for r in others):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"test: ranks {others} never committed a collective past this rank's in {self.HANG_S:g} s")
                time.sleep(0.01)
            raise torch.OutOfMemoryError(f"CUDA out of memory (test: late, in forward on rank {dist.get_rank()})")


def _fault(site: str, ranks: Optional[list[int]], index: int, batch: int = FAULT_BATCH, exception: Any = None) -> Callback:
    if site == "grad_hook":
        return GradHookOOM(ranks, batch, index)
    if site == "slow_forward":
        return SlowForwardOOM(ranks, batch, index)
    return FaultInjector(site, ranks=ranks, microbatch_index=index, batch=batch, times=1, exception=exception)


def _run(world: int, fault: Optional[Callback], transport: str = "auto", timeout_s: float = 60.0,
         batches: int = BATCHES, dropout: bool = False, extra: tuple = (), above: int = ABOVE) -> dict[str, Any]:
    """`above`: the search driver's limit (the size it settles on)."""
    auto = AutoMicrobatching(log_attempts=False, consensus_transport=transport, unguarded_timeout_s=timeout_s)
    if isinstance(fault, SlowForwardOOM):
        fault.auto = auto
    driver = FaultInjector("forward", above=above)
    callbacks = (auto, driver) + ((fault,) if fault is not None else ()) + extra
    trainer = build_trainer(world, batches, callbacks=callbacks, dropout=dropout)
    started = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - returned to the test
        result["exception"] = {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    result.update(
        seconds=round(time.perf_counter() - started, 3),
        history=history(auto),
        fired=getattr(fault, "fired", None),
        split=list(auto.policy.current_split()) if auto.policy else None,
        found_size=auto.found_size,
        hooks_after=auto.hooks_active,
        clean=trainer.sharded_model.is_clean(),
        adam_steps=adam_steps(trainer),
        batches=int(trainer.state.timestamp.batch),
        replayed=auto.collectives_replayed,
        layout=None if auto.layout is None else auto.layout.describe(),
        params=None,
    )
    if "exception" not in result:
        result["params"] = full_state(trainer.state.model)
    trainer.close()
    return result


def _reference(world: int, dropout: bool = False, above: int = ABOVE) -> dict[str, torch.Tensor]:
    """The same run without the steady-phase fault (the search driver only)."""
    result = _run(world, None, dropout=dropout, above=above)
    assert "exception" not in result, result
    return result["params"]


def run_steady_matrix(rank: int, world: int, cases: list[tuple[str, str, str]], one_rank: int,
                      transport: str = "auto") -> dict[str, Any]:
    """cases: (site, who, where); who "one" = [one_rank], "every" = all ranks."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"torch": torch.__version__}
    reference = _reference(world)
    for site, who, where in cases:
        ranks = [one_rank] if who == "one" else None
        key = f"{site}/{who}/{where}"
        try:
            result = _run(world, _fault(site, ranks, MICROBATCH[where]), transport)
            params = result.pop("params")
            result["error"] = None if params is None else max_error(params, reference)
            out[key] = result
        except Exception:  # noqa: BLE001 - report which case broke
            out[key] = {"crash": traceback.format_exc()}
    return out


ERROR_SITES = tuple(site for site in SITES if site != "grad_hook")  # the injector's sites


def error_case(world: int, site: str, hooks: str, who: str) -> dict[str, Any]:
    """A non-OOM error (`FaultInjector(exception="error")`) at `site`, in batch 0 while searching
    (`hooks` "on") or in batch FAULT_BATCH after the hooks came off ("off"), on rank 1 or every rank
    (`who`): what each rank raised, and how long after the fault."""
    ranks = [world - 1] if who == "one" else None
    index = -1 if site == "optimizer_step" else 0
    fault = FaultInjector(site, ranks=ranks, microbatch_index=index, batch=0 if hooks == "on" else FAULT_BATCH, times=1,
                          exception="error")
    result = _run(world, fault)
    result.pop("params", None)
    return result


def run_steady_misc(rank: int, world: int, errors: tuple = ()) -> dict[str, Any]:
    """`errors`: (site, hooks, who) cells of `error_case`, run after the fixed cases."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def case(name: str, fn: Any) -> None:
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001
            out[name] = {"crash": traceback.format_exc()}

    def strip(result: dict[str, Any], reference: Optional[dict[str, torch.Tensor]] = None) -> dict[str, Any]:
        params = result.pop("params")
        if reference is not None and params is not None:
            result["bitwise_equal"] = all(torch.equal(params[k], reference[k]) for k in reference)
            result["error"] = max_error(params, reference)
        return result

    # Dropout on: the retry at the same split must draw the same random numbers.
    dropout_reference = _reference(world, dropout=True)
    case("dropout_one_rank_oom", lambda: strip(_run(world, _fault("backward", [1], 0), dropout=True), dropout_reference))
    # The rerun at the same size runs out of memory again: then the size steps down.
    case("oom_twice", lambda: strip(_run(world, FaultInjector("forward", ranks=[0], batch=FAULT_BATCH, times=2))))
    # A non-OOM error on one rank with the hooks off: every rank stops, naming it.
    case("error_one_rank", lambda: strip(_run(world, _fault("backward", [1], -1, exception="error"))))
    # An OOM in an eval forward after the training hooks came off (eval auto turns them on).
    case("eval_oom_after_hooks_off", lambda: _eval_after_hooks_off(world))
    for site, hooks, who in errors:
        case(f"error/{site}/{hooks}/{who}", lambda: error_case(world, site, hooks, who))
    return out


def _eval_after_hooks_off(world: int) -> dict[str, Any]:
    from composer.core import Evaluator

    from tests.automicro_cases import make_loader

    evaluator = Evaluator(label="eval", dataloader=make_loader(world, 1, seed=3), device_eval_microbatch_size="auto")
    fault = FaultInjector("eval_forward", ranks=[1], above=4)
    auto = AutoMicrobatching(log_attempts=False)
    seen: list[bool] = []

    class HooksAtEval(Callback):
        def eval_before_all(self, state: State, logger: Logger) -> None:
            seen.append(auto.hooks_active)

    trainer = build_trainer(world, BATCHES, callbacks=(auto, FaultInjector("forward", above=ABOVE), fault, HooksAtEval()),
                            eval_dataloader=evaluator, eval_interval=f"{FAULT_BATCH}ba")
    trainer.fit()
    result = {
        "batches": int(trainer.state.timestamp.batch),
        "adam_steps": adam_steps(trainer),
        "fired": fault.fired,
        "eval_microbatch": evaluator.device_eval_microbatch_size,
        "eval_attempts": [(r.size, r.outcome) for r in auto.eval_searches["eval"].history],
        "ooms_total": auto.ooms_total,
        "hooks_when_eval_began": seen,
        "clean": trainer.sharded_model.is_clean(),
    }
    trainer.close()
    return result


class StrayCollective(Callback):
    """At `after_loss` in `batch`, an all-reduce of the model's own code that automicro does not
    see (outside the collective ledger)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def after_loss(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) == self.batch:
            dist.all_reduce(torch.ones(3))


RUN_NAME = "steady"


def _checkpointing(folder: Optional[str]) -> dict[str, Any]:
    if folder is None:
        return {}
    return {"save_folder": folder, "save_interval": "1ba", "run_name": RUN_NAME, "autoresume": True,
            "save_overwrite": False}


def run_unrecoverable(rank: int, world: int, timeout_s: float, folder: Optional[str] = None) -> dict[str, Any]:
    """Rank 1 runs out of memory after its loss while rank 0 goes on into an all-reduce the ledger
    does not know: recovery is impossible, every rank must stop within the bound. Nothing here
    runs a collective after `fit()` raised (the job is lost; the launcher ends it)."""
    torch.set_num_threads(1)
    auto = AutoMicrobatching(log_attempts=False, unguarded_timeout_s=timeout_s)
    # At `after_loss` of the first microbatch: rank 1 raises there, rank 0 goes on into the stray
    # all-reduce at the same event, with no collective of the ledger in between (so rank 0 cannot
    # see rank 1's failure first and stop early: the case is deterministic).
    fault = FaultInjector("loss", ranks=[1], microbatch_index=0, batch=FAULT_BATCH, times=1)
    callbacks = (auto, FaultInjector("forward", above=ABOVE), fault, StrayCollective(FAULT_BATCH))
    trainer = build_trainer(world, BATCHES, callbacks=callbacks, **_checkpointing(folder))
    return _fit_expecting_failure(trainer, auto)


def _fit_expecting_failure(trainer: Any, auto: AutoMicrobatching) -> dict[str, Any]:
    """fit() once; its exception (if any), the history and the seconds it took, for the test.
    Nothing runs a collective after `fit()` raised (the job is lost; the launcher ends it)."""
    started = time.perf_counter()
    result: dict[str, Any] = {"exception": None}
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - returned to the test
        result["exception"] = {"type": type(error).__name__, "message": str(error)}
    result["history"] = history(auto)
    result["total_seconds"] = round(time.perf_counter() - started, 3)
    result["fatal"] = (result["exception"] or {}).get("type") == FatalRecoveryError.__name__
    result["transport"] = auto.transport_name
    return result


def run_resume(rank: int, world: int, folder: str) -> dict[str, Any]:
    """The restart of `run_unrecoverable` (Composer's autoresume from the same folder, the same
    faults armed again except the one that made the job unrecoverable)."""
    torch.set_num_threads(1)
    auto = AutoMicrobatching(log_attempts=False)
    trainer = build_trainer(world, BATCHES, callbacks=(auto, FaultInjector("forward", above=ABOVE)), **_checkpointing(folder))
    resumed_at = int(trainer.state.timestamp.batch)
    trainer.fit()
    result = {"resumed_at": resumed_at, "history": history(auto), "batches": int(trainer.state.timestamp.batch),
              "adam_steps": adam_steps(trainer), "split": list(auto.policy.current_split()) if auto.policy else None}
    trainer.close()
    return result


def run_several_nodes_oom(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """Ranks on several nodes (no board), gloo: the last rank runs out of memory before a forward
    collective after the hooks are off, while the others block in that all-gather waiting for it.
    Nothing can bring them back in step in-process (gloo blocks their host threads, so they never
    reach the consensus): the failing rank stops within the bound naming itself, site and batch,
    and rings the job-lost alarm that ends the blocked ranks with the same story."""
    torch.set_num_threads(1)
    auto = AutoMicrobatching(log_attempts=False, unguarded_timeout_s=timeout_s)
    fault = FaultInjector("forward_pre", ranks=[world - 1], microbatch_index=0, batch=FAULT_BATCH, times=1)
    trainer = build_trainer(world, BATCHES, callbacks=(auto, FaultInjector("forward", above=ABOVE), fault))
    return _fit_expecting_failure(trainer, auto)


class OOMAtBatchEnd(Callback):
    """A callback of the user's that runs out of memory at Event.BATCH_END of `batch` on `rank`
    (outside any attempt: the batch is done; the other ranks go on into the next one)."""

    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch = rank, batch

    def batch_end(self, state: State, logger: Logger) -> None:
        if dist.get_rank() == self.rank and int(state.timestamp.batch) == self.batch:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in a batch_end callback)")


def run_oom_between_batches(rank: int, world: int, folder: Optional[str] = None) -> dict[str, Any]:
    """The last rank runs out of memory in a callback between batches with the hooks off: nothing
    to retry; it stops naming itself and the event, and every other rank (blocked in the next
    batch's first collective) is ended with the same story."""
    torch.set_num_threads(1)
    auto = AutoMicrobatching(log_attempts=False)
    callbacks = (auto, FaultInjector("forward", above=ABOVE), OOMAtBatchEnd(world - 1, FAULT_BATCH))
    # Checkpoints only for the failure note (no autoresume: Composer's autoresume set-up races on
    # its signal files when two simulated nodes share one folder on one machine).
    saving = {} if folder is None else {"save_folder": folder, "save_interval": "1ba", "run_name": RUN_NAME}
    trainer = build_trainer(world, BATCHES, callbacks=callbacks, **saving)
    return _fit_expecting_failure(trainer, auto)
