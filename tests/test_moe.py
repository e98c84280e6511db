"""Routed (mixture-of-experts) models under `auto`: transformers' Qwen3-MoE, OLMoE and Mixtral built from tiny
configs (tests/moe_cases.py), `automicro.Trainer` on 2 CPU ranks and on 1, an emulated per-rank cap. The search, the
parity with a fixed run at the size found (OLMoE with its load-balancing loss in the loss), a settled batch whose
routing moved (`automicro.testing.RoutingSkew`), a resume."""

from __future__ import annotations

from typing import Any

import pytest

from automicro.testing import run_multiprocess
from tests import moe_cases

TOLERANCE = 1e-5  # fp32: the same numbers to rounding (a split only reorders the sums)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return run_multiprocess(moe_cases.two_ranks, world_size=2, args=(str(tmp_path_factory.mktemp("moe")),), timeout_s=600)


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "crash" not in result, result.get("crash")
    for run in result.values():
        if isinstance(run, dict):
            assert "exception" not in run, run["exception"]
            # the emulated cap's counts follow the program alone (`MemoryCap`: a collective's buffers freed in the
            # program's order): where gloo's worker freed them, the sizes found moved from run to run (3, 4 or 5)
            assert run.get("foreign_frees", 0) == 0, (run["foreign_frees"], run.get("foreign_ops"), run.get("slow_releases"))
    return result


def _steps(run: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What every rank agrees on: batch, size, split, outcome, failed ranks, the note (a rank's own replay note cut)."""
    return [(b, size, split, outcome, failed, note.split("; ")[0]) for b, _, size, split, outcome, failed, note in run["history"]]


def _left_or_ladder(run: dict[str, Any]) -> list[str]:
    return [line for line in run["lines"] if "allocated after its wipe" in line or line.startswith("recompute on")]


@pytest.mark.multiproc
@pytest.mark.parametrize("family", moe_cases.FAMILIES)
def test_auto_searches_a_routed_model_and_trains_it_as_a_fixed_run_at_the_size_found(two_ranks, family):
    """The search settles below the batch (8 runs out on both ranks), every rank alike, nothing left held after a
    failed attempt (the ladder never steps), and the parameters are a fixed run's at the size found."""
    for per_rank in two_ranks:
        pair = _ok(per_rank[family])
        auto, fixed = pair["auto"], pair["fixed"]
        assert 2 <= auto["found"] < moe_cases.PER_RANK and auto["batches"] == fixed["batches"] == moe_cases.BATCHES, auto["history"]
        assert any(h[4] == "oom" for h in auto["history"]), auto["history"]
        assert not _left_or_ladder(auto), _left_or_ladder(auto)
        assert pair["param_gap"] < TOLERANCE, (family, pair["param_gap"], auto["history"])
    assert _steps(two_ranks[0][family]["auto"]) == _steps(two_ranks[1][family]["auto"])


@pytest.mark.multiproc
def test_a_load_balancing_loss_is_the_fixed_runs_at_the_same_split(two_ranks):
    """OLMoE with its router's load-balancing loss in the loss (the loss of each microbatch's routing, so not the same
    over another split): a batch whose attempt at 8 ran out and trained at (4, 4) is a fixed run's at 4."""
    for per_rank in two_ranks:
        pair = _ok(per_rank["olmoe_aux"])
        auto = pair["auto"]
        assert [(h[2], h[3], h[4]) for h in auto["history"]] == [(8, [8], "oom"), (4, [4, 4], "ok")], auto["history"]
        assert pair["param_gap"] < TOLERANCE and pair["loss_gap"] < TOLERANCE, pair


@pytest.mark.multiproc
def test_a_settled_batch_whose_routing_moved_reruns_once_and_says_so(two_ranks):
    """Qwen3-MoE's batch 3, its first attempt on rank 1 routed 90% to one expert: where the experts' memory follows the
    routing (transformers 4.x) rank 1 runs out at the settled size, the batch reruns once at that size on every rank
    and the line names routing; where it does not (5.x) the batch trains as it came. Either way the parameters are a
    fixed run's routed the same way."""
    for per_rank in two_ranks:
        skew = _ok(per_rank["skew"])
        auto = skew["auto"]
        batch = [(split, outcome, failed) for b, _, _, split, outcome, failed, _ in auto["history"] if b == moe_cases.SKEWED]
        settled = [split for b, _, _, split, outcome, _, _ in auto["history"] if b == moe_cases.SKEWED - 1 and outcome == "ok"][-1]
        if per_rank["moves"]:
            assert batch == [(settled, "oom", [1]), (settled, "ok", [])], auto["history"]
            note = next(h[6] for h in auto["history"] if h[0] == moe_cases.SKEWED)
            assert "rerun at" in note and "routing moved the memory: the busiest expert took 9" in note and \
                ".gate), at most " in note, note
        else:
            assert batch == [(settled, "ok", [])], auto["history"]
        assert skew["param_gap"] < TOLERANCE and not _left_or_ladder(auto), (skew["param_gap"], auto["history"])
    assert _steps(two_ranks[0]["skew"]["auto"]) == _steps(two_ranks[1]["skew"]["auto"])


@pytest.mark.multiproc
def test_a_routed_model_resumed_from_a_checkpoint_trains_on_as_the_run_that_never_stopped(two_ranks):
    for per_rank in two_ranks:
        resume = _ok(per_rank["resume"])
        assert resume["param_gap"] < TOLERANCE and resume["loss_gap"] < TOLERANCE, resume
        assert resume["resumed"]["found"] == resume["saved"]["found"], "the size found comes back with the checkpoint"
        later = [(b, outcome) for b, _, _, _, outcome, _, _ in resume["resumed"]["history"] if b >= 2]
        assert later == [(2, "ok"), (3, "ok")], resume["resumed"]["history"]


@pytest.mark.multiproc
def test_a_routed_model_on_one_rank():
    """auto against a fixed run on one rank; and its routers watched under auto only, not where `watch_routing: false`."""
    out = run_multiprocess(moe_cases.one_rank, world_size=1, timeout_s=300)[0]
    result = _ok(out["qwen3moe"])
    auto = result["auto"]
    assert auto["watched"] == moe_cases.config("qwen3moe").num_hidden_layers and result["fixed"]["watched"] == 0
    unwatched = _ok(out["unwatched"])
    assert unwatched["watched"] == 0 and unwatched["batches"] == 2, unwatched["history"]
    assert 1 <= auto["found"] < moe_cases.PER_RANK and not _left_or_ladder(auto), auto["history"]
    assert result["param_gap"] < TOLERANCE, (result["param_gap"], auto["history"])
