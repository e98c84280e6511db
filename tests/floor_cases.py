"""Multi-rank cases for the floor rule: OOMs at microbatch size 1 (and a pipeline's smallest size).

The search driver (`FaultInjector("forward", above=1)`) makes every case settle on size 1 in
batch 0 (8 -> 4 -> 2 -> 1 fail, fail, fail, fit); the hooks come off after 3 clean batches. Then
faults strike at size 1: a one-off (once per rank it is armed on) must cost one batch retry at
size 1; a repeat (twice) steps the ladder below size 1 (the blocks' activation checkpointing on, the size searched
again in that batch: `automicro.batch.floor_ladder`) and the run trains on with the numbers of the run without it; a
repeat with checkpointing on too (always) ends the run on every rank with the size-1 message naming it, no hang.
Every case returns plain data for tests/test_floor_rule.py; a case that breaks is {"crash": ...}.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer.core import Evaluator

from automicro.composer.callback import AutoMicrobatching
from automicro.testing.faults import FaultInjector
from tests import pipeline_cases
from tests.case_runs import run_case
from tests import steady_cases as steady
from tests.automicro_cases import adam_steps, build_trainer, history, make_loader, max_error

FLOOR = 1
SETTLING_BATCH = 2  # the hooks are still on: clean batch 2 of 3 at size 1
STEADY_BATCH = steady.FAULT_BATCH  # the hooks are off



def run_plain(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 data parallel: one-off and repeated OOMs at size 1, on one rank and on every rank,
    with the hooks off and while still settling; and an eval at size 1."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    reference = steady._reference(world, above=FLOOR)
    last = world - 1

    def one(site: str, ranks: Optional[list[int]], batch: int, times: int, extra: tuple = ()) -> dict[str, Any]:
        fault = FaultInjector(site, ranks=ranks, microbatch_index=-1 if site == "backward" else 0, batch=batch, times=times)
        result = steady._run(world, fault, above=FLOOR, extra=extra)
        params = result.pop("params")
        result["error"] = None if params is None else max_error(params, reference)
        return result

    for site in ("forward", "backward"):
        for who, ranks in (("one", [last]), ("every", None)):
            run_case(out, f"steady/{site}/{who}/once", lambda s=site, r=ranks: one(s, r, STEADY_BATCH, 1))
    run_case(out, "settling/forward/one/once", lambda: one("forward", [last], SETTLING_BATCH, 1))
    run_case(out, "steady/forward/one/twice", lambda: one("forward", [last], STEADY_BATCH, 2))
    run_case(out, "steady/backward/every/twice", lambda: one("backward", None, STEADY_BATCH, 2))
    run_case(out, "steady/forward/one/always", lambda: one("forward", [last], STEADY_BATCH, 99))
    # the ladder's first rung taken at STEADY_BATCH, then a one-off on it in the batch after (on the other rank)
    run_case(out, "steady/forward/one/twice/then-once", lambda: one(
        "forward", [last], STEADY_BATCH, 2, extra=(FaultInjector("forward", ranks=[0], batch=STEADY_BATCH + 1, times=1),)))
    run_case(out, "eval/one/once", lambda: _eval_at_floor(world, times=1))
    run_case(out, "eval/one/twice", lambda: _eval_at_floor(world, times=2))
    return out


EVAL_INTERVAL = 3  # evaluations after batches 3, 6 and 9 (the training context's batch 2, 5, 8)


def _eval_at_floor(world: int, times: int) -> dict[str, Any]:
    """The eval search settles on 1 at the first evaluation (rank 1's eval forward fits only
    size 1); at the second, a one-off (or repeated) OOM at size 1 on the last rank."""
    evaluator = Evaluator(label="eval", dataloader=make_loader(world, 1, seed=3), device_eval_microbatch_size="auto")
    eval_limit = FaultInjector("eval_forward", ranks=[world - 1], above=FLOOR)
    one_off = FaultInjector("eval_forward", ranks=[world - 1], batch=2 * EVAL_INTERVAL - 1, times=times)
    auto = AutoMicrobatching(log_attempts=False)
    trainer = build_trainer(
        world, steady.BATCHES, callbacks=(auto, FaultInjector("forward", above=FLOOR), eval_limit, one_off),
        eval_dataloader=evaluator, eval_interval=f"{EVAL_INTERVAL}ba",
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - returned to the test
        result["exception"] = {"type": type(error).__name__, "message": str(error)}
    result.update(
        batches=int(trainer.state.timestamp.batch),
        adam_steps=adam_steps(trainer),
        fired=one_off.fired,
        eval_found=auto.eval_found_sizes.get("eval"),
        eval_attempts=[(r.size, r.outcome, r.note) for r in auto.eval_searches["eval"].history],
        clean=trainer.sharded_model.is_clean(),
    )
    trainer.close()
    return result


def run_pipeline(rank: int, world: int, schedule: str) -> dict[str, Any]:
    """2 stages: stage 0 fits only size 1 (the pipeline's floor: 8 samples as 8 microbatches);
    after the hooks are off (2 clean batches), a one-off or repeated OOM on either stage at batch 4."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    fixed = pipeline_cases.fit(schedule, FLOOR, batches=6)

    def one(site: str, failing: int, times: int) -> dict[str, Any]:
        injector = FaultInjector(site, ranks=[failing], batch=4, times=times)
        callbacks = [AutoMicrobatching(stable_batches=2, log_attempts=False), FaultInjector("forward", ranks=[0], above=FLOOR), injector]
        try:
            auto = pipeline_cases.fit(schedule, "auto", callbacks=callbacks, batches=6)
        except Exception as error:  # noqa: BLE001 - returned to the test
            return {"exception": {"type": type(error).__name__, "message": str(error)}, "fired": injector.fired}
        return {"history": auto["history"], "found": auto["found"], "fired": injector.fired, "clean": auto["clean"],
                "diff": pipeline_cases.max_difference(auto["params"], fixed["params"])}

    run_case(out, "forward/stage0/once", lambda: one("forward", 0, 1))
    run_case(out, "backward_input/stage1/once", lambda: one("backward_input", 1, 1))
    run_case(out, "forward/stage0/twice", lambda: one("forward", 0, 2))
    return out
