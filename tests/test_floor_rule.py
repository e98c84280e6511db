"""The floor rule on gloo ranks: a one-off OOM at microbatch size 1 costs one batch retry, never
the run; a repeat at size 1 steps the ladder (activation checkpointing on, the size searched again in that batch, the
numbers as without it); only a repeat at size 1 with nothing left ends it, on every rank, with the size-1 message
naming what was tried, and no hang.

Cases in tests/floor_cases.py, each process group under `run_multiprocess`'s hang watchdog.
Before the fix every "once" case below ended with MicrobatchSizeError.
"""

from __future__ import annotations

import pytest

from automicro.testing.multiprocess import run_multiprocess
from tests import floor_cases as cases
from tests import steady_cases as steady

TOLERANCE = 1e-5
SIZE_1_MESSAGE = "out of memory even with device_train_microbatch_size=1"
SELECTIVE = "selective recompute on (matrix products and attention kept)"  # the ladder's first rung, as the layout says it


@pytest.fixture(scope="module")
def plain():
    return run_multiprocess(cases.run_plain, world_size=2, timeout_s=500)


@pytest.fixture(scope="module")
def pipeline():
    return run_multiprocess(cases.run_pipeline, world_size=2, args=("1F1B",), timeout_s=500)


def _result(per_rank: dict, key: str) -> dict:
    result = per_rank[key]
    assert "crash" not in result, result["crash"]
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "key, batch",
    [(f"steady/{site}/{who}/once", cases.STEADY_BATCH) for site in ("forward", "backward") for who in ("one", "every")]
    + [("settling/forward/one/once", cases.SETTLING_BATCH)],
)
def test_a_one_off_oom_at_size_1_reruns_the_batch_at_size_1_and_trains_like_the_run_without_it(plain, key, batch):
    hooks_off = key.startswith("steady")
    for rank, per_rank in enumerate(plain):
        result = _result(per_rank, key)
        assert "exception" not in result, (rank, key, result["exception"])
        assert result["batches"] == steady.BATCHES and result["adam_steps"] == [steady.BATCHES], (rank, key)
        assert result["error"] <= TOLERANCE, (rank, key, result["error"])
        assert result["found_size"] == 1 and result["clean"], (rank, key)
        attempts = [(r["attempt"], r["size"], r["outcome"], r["hooks"]) for r in result["history"] if r["batch"] == batch]
        assert attempts[0] == (1, 1, "oom", not hooks_off) and attempts[-1][1:] == (1, "ok", True), (rank, key, attempts)
        # Every rank's own one-off gets its rerun: with the hooks off, a rank stopped by another's
        # OOM may meet its own one attempt later (at most one OOM per rank armed).
        ooms = [a for a in attempts if a[2] == "oom"]
        assert all(a[1] == 1 for a in attempts) and len(ooms) <= (len(plain) if "/every/" in key else 1), attempts


@pytest.mark.multiproc
@pytest.mark.parametrize("key", ["steady/forward/one/twice", "steady/backward/every/twice"])
def test_a_repeated_oom_at_size_1_switches_checkpointing_on_and_the_run_trains_on_like_the_run_without_it(plain, key):
    """The ladder below size 1: the repeat switches the blocks' first rung on (selective recompute: size 1 fits with
    it here, so full recompute is not taken), the size is searched again in the same batch (the probe's split: its
    microbatches of 2 run out under the search driver, then 1 fits), every rank alike, and the parameters end as the
    run that never ran out (fp32, 1e-5)."""
    for rank, per_rank in enumerate(plain):
        result = _result(per_rank, key)
        assert "exception" not in result, (rank, key, result["exception"])
        assert result["batches"] == steady.BATCHES and result["adam_steps"] == [steady.BATCHES], (rank, key)
        assert result["error"] <= TOLERANCE, (rank, key, result["error"])
        assert result["found_size"] == 1 and result["clean"] and result["layout"] == SELECTIVE, result
        batch = [(r["attempt"], r["size"], r["outcome"]) for r in result["history"] if r["batch"] == cases.STEADY_BATCH]
        assert batch == [(1, 1, "oom"), (2, 1, "oom"), (3, 2, "oom"), (4, 1, "ok")], (rank, batch)
        step = next(r for r in result["history"] if r["batch"] == cases.STEADY_BATCH and r["attempt"] == 2)
        assert "selective recompute on, the size searched again" in step["note"], step
    # Every rank alike; a rank that replayed collectives to get back in step (hooks off) says so in its own note.
    steps = [[(r["batch"], r["attempt"], r["size"], r["outcome"], r["note"].split("; ")[0]) for r in per_rank[key]["history"]]
             for per_rank in plain]
    assert steps[0] == steps[1], steps


@pytest.mark.multiproc
def test_a_one_off_oom_on_the_rung_the_ladder_took_reruns_the_batch_at_1_and_keeps_the_rung(plain):
    """After the ladder took selective recompute (a repeat at size 1 on the last rank), a one-off at size 1 on rank 0
    in the next batch is a one-off like any other: that batch reruns once at 1 on the same rung (full recompute is not
    taken), and the parameters end as the run that never ran out (fp32, 1e-5)."""
    key = "steady/forward/one/twice/then-once"
    for rank, per_rank in enumerate(plain):
        result = _result(per_rank, key)
        assert "exception" not in result, (rank, result["exception"])
        assert result["batches"] == steady.BATCHES and result["adam_steps"] == [steady.BATCHES], rank
        assert result["error"] <= TOLERANCE, (rank, result["error"])
        assert result["found_size"] == 1 and result["layout"] == SELECTIVE, result
        after = [(r["attempt"], r["size"], r["outcome"]) for r in result["history"] if r["batch"] == cases.STEADY_BATCH + 1]
        assert after == [(1, 1, "oom"), (2, 1, "ok")], (rank, after)
    steps = [[(r["batch"], r["attempt"], r["size"], r["outcome"]) for r in per_rank[key]["history"]] for per_rank in plain]
    assert steps[0] == steps[1], steps


@pytest.mark.multiproc
def test_a_repeated_oom_at_size_1_with_checkpointing_on_ends_the_run_on_every_rank_naming_what_was_tried(plain):
    for rank, per_rank in enumerate(plain):
        result = _result(per_rank, "steady/forward/one/always")
        assert result["exception"]["type"] == "MicrobatchSizeError", (rank, result["exception"])
        message = result["exception"]["message"]
        # Both rungs tried, the cheaper first, before the run ends.
        assert SIZE_1_MESSAGE in message and (f"with selective recompute on, then activation checkpointing on (switched on by auto "
                                              f"at batch {cases.STEADY_BATCH}") in message, message
        assert "shard more (more ranks, reshard_after_forward, cpu_offload)" in message, message
        batch = [(r["attempt"], r["outcome"]) for r in result["history"] if r["batch"] == cases.STEADY_BATCH]
        assert batch == [(n, "oom") for n in range(1, 7)], (rank, batch)
        assert result["batches"] == cases.STEADY_BATCH, "nothing of the failed batch was stepped"


@pytest.mark.multiproc
def test_a_one_off_eval_oom_at_eval_size_1_is_retried_at_1_and_training_goes_on(plain):
    for rank, per_rank in enumerate(plain):
        result = _result(per_rank, "eval/one/once")
        assert "exception" not in result, (rank, result["exception"])
        assert result["batches"] == steady.BATCHES and result["adam_steps"] == [steady.BATCHES]
        assert result["eval_found"] == 1 and result["clean"]
        assert result["fired"] == (1 if rank == len(plain) - 1 else 0)
        reruns = [a for a in result["eval_attempts"] if "rerun at 1" in a[2]]
        assert [a[:2] for a in reruns] == [(1, "oom")], result["eval_attempts"]


@pytest.mark.multiproc
def test_a_repeated_eval_oom_at_eval_size_1_ends_the_run_on_every_rank(plain):
    for rank, per_rank in enumerate(plain):
        result = _result(per_rank, "eval/one/twice")
        assert "exception" in result, (rank, result)
        assert "even microbatch size 1 does not fit" in result["exception"]["message"], result["exception"]


@pytest.mark.multiproc
@pytest.mark.parametrize("key, failing", [("forward/stage0/once", 0), ("backward_input/stage1/once", 1)])
def test_a_one_off_oom_on_a_pipeline_stage_at_its_smallest_size_reruns_the_batch(pipeline, key, failing):
    for rank, per_rank in enumerate(pipeline):
        result = _result(per_rank, key)
        assert "exception" not in result, (rank, key, result["exception"])
        assert result["found"] == 1 and result["clean"]
        assert result["fired"] == (1 if rank == failing else 0)
        batch = [h[1:4] for h in result["history"] if h[0] == 4]
        assert batch == [(1, "oom", [failing]), (1, "ok", [])], (rank, key, result["history"])
        assert result["diff"] < TOLERANCE, (rank, key, result["diff"])


@pytest.mark.multiproc
def test_a_repeated_oom_on_a_pipeline_stage_at_its_smallest_size_ends_the_run_on_both_stages(pipeline):
    for rank, per_rank in enumerate(pipeline):
        result = _result(per_rank, "forward/stage0/twice")
        assert result["exception"]["type"] == "MicrobatchSizeError", (rank, result)
        assert SIZE_1_MESSAGE in result["exception"]["message"]
        assert "activation checkpointing on not tried: a pipeline stage's checkpointing" in result["exception"]["message"]
