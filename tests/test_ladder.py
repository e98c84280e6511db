"""The ladder below size 1 on the main job (`automicro.batch.floor_ladder`): where one sample does not fit without
activation checkpointing, `auto` switches it on and trains, with no key added, as the hand-set run does.

Cases in tests/ladder_cases.py, one 2-rank launch under `run_multiprocess`'s hang watchdog. The repeat at size 1 under
injected faults (the ladder on a settled run, hooks off, one rank and every rank; nothing left: the message) is in
tests/test_floor_rule.py.
"""

from __future__ import annotations

import pytest

from automicro.testing.multiprocess import run_multiprocess
from tests import ladder_cases as cases

pytestmark = pytest.mark.multiproc  # on every torch: tests/conftest.py's TORCH_VERSION_FILES


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_multiprocess(cases.suite, world_size=2, args=(str(tmp_path_factory.mktemp("ladder")),), timeout_s=600)


def _ok(result: dict) -> dict:
    assert "crash" not in result, result["crash"]
    assert "exception" not in result, result["exception"]
    return result


def _gap(run: dict, reference: dict) -> float:
    common = sorted(set(run["losses"]) & set(reference["losses"]))
    assert common, (run["losses"], reference["losses"])
    return max(abs(run["losses"][b] - reference["losses"][b]) / abs(reference["losses"][b]) for b in common)


def test_where_size_1_runs_out_without_checkpointing_auto_switches_it_on_and_trains_as_the_hand_set_run(two_ranks):
    """The issue's command (tiny-cpu at 1,024 tokens a sample): rank 0 runs out at 1, the ladder steps in batch 0 on
    both ranks alike (selective recompute first: size 1 still runs out with it under rank 0's cap; then full), and
    every batch's loss is the hand-set run's (fp32, 1e-5); its lines, the dashboards' keys and the summary say so. A
    one-off OOM on rank 1 in a later batch, checkpointing on, costs one rerun of that batch."""
    for rank, per_rank in enumerate(two_ranks):
        auto, handset = _ok(per_rank["auto"]), _ok(per_rank["handset"])
        assert auto["batches"] == handset["batches"] == cases.BATCHES
        assert auto["found"] == 1 and auto["layout"] == "activation checkpointing on", auto
        assert _gap(auto, handset) < 1e-5, (auto["losses"], handset["losses"])
        rungs = [h[5].split(": ", 1)[1].split(", the size")[0] for h in auto["history"] if "the size searched again" in h[5]]
        assert rungs == ["selective recompute on", "activation checkpointing on"], auto["history"]
        step = [h for h in auto["history"] if "activation checkpointing on, the size searched again" in h[5]]
        assert len(step) == 1 and step[0][:4] == (0, step[0][1], 1, "oom") and step[0][4] == [0], auto["history"]
        assert auto["metrics"]["automicro/floor_ladder"] == 2 and auto["metrics"]["automicro/layout_recompute"] == 1
        assert auto["metrics"]["automicro/layout_recompute_op"] == 0
        assert ("ladder: selective recompute on, then activation checkpointing on (size 1 did not fit without it)"
                in auto["summary"]), auto["summary"]
        later = [h[1:5] for h in auto["history"] if h[0] == cases.LATER]
        assert later[0][2:] == ("oom", [1]) and later[-1][2] == "ok" and len(later) == 2 and later[0][1] == later[1][1] == 1, later
        if rank == 0:
            assert any(line.startswith("recompute on: size 1 did not fit without it (rank 0 at ") for line in auto["lines"]), auto["lines"]
    assert two_ranks[0]["auto"]["history"] == two_ranks[1]["auto"]["history"]


def test_where_size_1_ran_but_will_not_fit_with_the_optimizer_state_the_ladder_steps_before_the_next_batch(two_ranks):
    """Rank 0's cap (14 MB) where size 1 runs in batch 0 with selective recompute, but its peak with the AdamW state the
    first step adds does not fit: the ladder's next rung (full recompute) between batches 0 and 1, on both ranks alike,
    no OOM at size 1 after it (before, batch 1 ran out at size 1, was rerun and ran out again: the GPU's pattern at
    196,608 tokens); the losses are the hand-set run's."""
    for rank, per_rank in enumerate(two_ranks):
        run, handset = _ok(per_rank["projected"]), _ok(per_rank["handset"])
        assert run["batches"] == cases.PROJECTED_BATCHES and run["layout"] == "activation checkpointing on", run
        assert _gap(run, handset) < 1e-5, (run["losses"], handset["losses"])
        history = run["history"]
        stepped = [h for h in history if h[3] == "ok" and "does not fit with the optimizer state" in h[5]]
        assert len(stepped) == 1 and stepped[0][0] == 0 and stepped[0][2] == 1, history
        assert stepped[0][5].startswith("size 1 does not fit with the optimizer state: activation checkpointing on"), history
        assert not [h for h in history if h[0] >= 1 and h[3] == "oom" and h[2] == 1], history
        assert run["metrics"]["automicro/layout_recompute"] == 1 and run["metrics"]["automicro/floor_ladder"] == 2, run["metrics"]
        if rank == 0:
            line = next(line for line in run["lines"] if "optimizer state the first step added" in line)
            assert line.startswith("recompute on: size 1 ran without it, but its peak with the optimizer state the first "
                                   "step added does not fit (rank 0: peak "), line
            assert line.endswith("every block's activation checkpointing switched on, the size searched again from batch "
                                 "1 (the same numbers, a forward per block again in backward)"), line
    assert two_ranks[0]["projected"]["history"] == two_ranks[1]["projected"]["history"]


def test_where_size_1_runs_out_with_checkpointing_on_too_the_run_ends_on_every_rank_naming_what_was_tried(two_ranks):
    for per_rank in two_ranks:
        tight = per_rank["tight"]
        assert "crash" not in tight, tight["crash"]
        assert tight["exception"]["type"] == "MicrobatchSizeError", tight["exception"]
        message = tight["exception"]["message"]
        assert ("out of memory even with device_train_microbatch_size=1 with selective recompute on, then activation checkpointing "
                "on (switched on by auto at batch 0") in message, message
        assert tight["batches"] == 0


def test_a_run_resumed_after_the_step_starts_with_checkpointing_on_and_trains_as_the_run_without_the_restart(two_ranks):
    for per_rank in two_ranks:
        saved, resumed, auto = _ok(per_rank["saved"]), _ok(per_rank["resumed"]), _ok(per_rank["auto"])
        assert saved["layout"] == "activation checkpointing on" and resumed["layout"] == "activation checkpointing on"
        assert resumed["batches"] == cases.BATCHES and sorted(resumed["losses"]) == list(range(cases.SAVE_AT + 1, cases.BATCHES + 1))
        assert not [h for h in resumed["history"] if h[0] >= cases.SAVE_AT and h[3] == "oom"], resumed["history"]
        assert _gap(resumed, auto) < 1e-5, (resumed["losses"], auto["losses"])
    assert any(line == "resumed with layout: activation checkpointing on" for line in two_ranks[0]["resumed"]["lines"])


def test_compiled_blocks_take_the_step_without_compiling_again_and_train_as_the_eager_run(two_ranks):
    """Each block compiled (aot_eager) with its recompute switched on by the ladder: the same losses as eager, the
    whole-model scope trial ruled out (the blocks checkpoint). Compiled, size 1 fits at the first rung already (the
    selective recompute compiled inside each block's graph: one graph more, for every block; eager it takes full)."""
    if "compiled" not in two_ranks[0]:
        pytest.skip(f"torch {two_ranks[0]['torch']} does not compile under the memory cap (the newer torch legs run it)")
    for per_rank in two_ranks:
        compiled, auto = _ok(per_rank["compiled"]), _ok(per_rank["auto"])
        assert compiled["graphs"] > 0 and compiled["layout"] == "selective recompute on (matrix products and attention kept)", compiled
        assert _gap(compiled, auto) < 1e-5, (compiled["losses"], auto["losses"])


def test_on_one_rank_and_in_a_plain_loop_sharded_with_the_switch():
    """FSDP2 over one rank (the whole model on it) under a cap where size 1 does not fit without checkpointing and fits
    with the ladder's first rung (selective recompute): the Trainer, and `AutoStep` on a model sharded by
    `automicro.engine.shard(..., checkpoint_switch=True)`, each as its hand-set run (full checkpointing: the same
    numbers)."""
    result = run_multiprocess(cases.one_rank, world_size=1, timeout_s=300)[0]
    auto, handset = _ok(result["auto"]), _ok(result["handset"])
    assert auto["found"] == 1 and auto["layout"] == "selective recompute on (matrix products and attention kept)", auto
    assert any("selective recompute on, the size searched again" in h[5] for h in auto["history"]), auto["history"]
    assert not any("activation checkpointing on, the size searched again" in h[5] for h in auto["history"]), auto["history"]
    assert auto["batches"] == handset["batches"] == 3 and _gap(auto, handset) < 1e-5, (auto["losses"], handset["losses"])
    loop, loop_handset = _ok(result["plain_loop"]), _ok(result["plain_loop_handset"])
    assert loop["splits"] == loop_handset["splits"] == [[1, 1]] * 3, (loop["splits"], loop_handset["splits"])
    assert "ladder: selective recompute on (" in loop["summary"] and "ladder" not in loop_handset["summary"], loop["summary"]
    assert _gap(loop, loop_handset) < 1e-5, (loop["losses"], loop_handset["losses"])
