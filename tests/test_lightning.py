"""`automicro.lightning.AutoMicrobatch`: Lightning's Trainer with `ModelParallelStrategy` (FSDP2) and
manual optimization on `AutoStep`, a tiny Llama built from a config, 2 and 4 gloo ranks under the hang
watchdog (tests/lightning_cases.py). Every reference is a plain loop with no automicro and no
Lightning, over the batches each rank trained on."""

from __future__ import annotations

import re

import pytest

from automicro.testing.multiprocess import run_multiprocess
from tests import lightning_cases as cases
from tests.adapter_checks import check_steady_oom
from tests.launch import run_example
from tests.toy_models import max_error

pytestmark = pytest.mark.lightning

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[(2, 1), pytest.param((4, 2), marks=pytest.mark.many_ranks)], ids=["2-ranks", "4-ranks"])
def ranks(request, tmp_path_factory):
    world, one_rank = request.param
    folder = str(tmp_path_factory.mktemp("lightning"))
    return world, one_rank, run_multiprocess(cases.run_cases, world_size=world, args=(one_rank, folder), timeout_s=400)


@pytest.mark.multiproc
def test_lightning_searches_where_one_rank_runs_out_and_trains_like_a_plain_loop(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["search"]
        ooms = [h for h in run["history"] if h["outcome"] == "oom"]
        assert ooms and all(h["failed_ranks"] == [one_rank] for h in ooms), run["history"]
        assert [r["split"] for r in run["results"]] == [r["split"] for r in per_rank[0]["search"]["results"]]
        assert all(max(r["split"]) <= 5 and sum(r["split"]) == cases.BATCH for r in run["results"]), run["results"]
        assert run["results"][0]["attempts"] > 1 and run["results"][-1]["hooks"] is False
        # Lightning counted every optimizer step (max_steps, schedules and checkpoints see them).
        assert run["global_step"] == cases.STEPS and len(run["results"]) == cases.STEPS
        assert max_error(run["params"], run["reference"]) <= TOLERANCE, rank
        assert "automicro/found_size" in run["logged"] and "automicro/ooms_total" in run["logged"]


@pytest.mark.multiproc
def test_an_oom_after_the_hooks_are_off_costs_lightning_one_rerun_of_that_batch(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["steady"]
        check_steady_oom(run, one_rank, rank)
        assert run["global_step"] == 7
        # The second fit of the process built a second mesh over the same ranks: its FSDP2 groups are tracked.
        assert run["groups_tracked"] is True


@pytest.mark.multiproc
def test_lightning_resumes_from_its_own_checkpoint_at_the_saved_split(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["resume"]
        first, second = run["first"], run["second"]
        assert first["global_step"] == 3 and second["global_step"] == 6 and len(second["results"]) == 3
        assert second["state"]["batches"] == 6
        assert second["results"][0]["split"] == first["results"][-1]["split"]
        assert all(r["attempts"] == 1 for r in second["results"]), second["results"]
        assert not [h for h in second["history"] if h["outcome"] == "oom" and h["batch"] >= 3], second["history"]
        assert max_error(second["params"], run["reference"]) <= TOLERANCE, rank


@pytest.mark.multiproc
def test_automatic_optimization_is_refused_with_the_recipe(ranks):
    for out in ranks[2]:
        assert out["automatic"]["type"] == "ValueError", out["automatic"]
        assert "self.automatic_optimization = False" in out["automatic"]["message"]


def test_unknown_settings_are_refused_by_name():
    from automicro.lightning import AutoMicrobatch

    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['eval_oom'\]"):
        AutoMicrobatch(eval_oom=True)


@pytest.mark.multiproc
def test_the_lightning_example_runs_on_two_cpu_ranks_under_a_memory_cap():
    """examples/lightning.py as a user runs it (torchrun, 2 gloo ranks), under a watchdog."""
    output = run_example("lightning.py", "--steps", "5")
    steps = [line for line in output.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == [f"step {i}" for i in range(5)], output[-4000:]
    # The emulated limit made the search run out of memory, and training went on to the last step.
    assert int(re.search(r"OOMs so far (\d+)", steps[-1]).group(1)) >= 1, output[-4000:]
    assert "trained 5 steps" in output
