"""`automicro.AutoStep`: `auto` microbatching in a plain PyTorch loop, on a model the user sharded with
`fully_shard` (no Composer Trainer), 2 and 4 gloo ranks under the hang watchdog.

The cases run in tests/autostep_cases.py; every reference is a plain loop with no automicro.
"""

from __future__ import annotations

import re

import pytest

from automicro.testing.multiprocess import run_multiprocess
from tests import autostep_cases as cases
from tests.adapter_checks import check_steady_oom
from tests.launch import run_example
from tests.toy_models import max_error

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[(2, 1), pytest.param((4, 2), marks=pytest.mark.many_ranks)], ids=["2-ranks", "4-ranks"])
def ranks(request):
    world, one_rank = request.param
    return world, one_rank, run_multiprocess(cases.run_cases, world_size=world, args=(one_rank,), timeout_s=400)


@pytest.mark.multiproc
def test_a_search_where_one_rank_runs_out_trains_every_batch_like_a_plain_loop(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["search"]
        # Only `one_rank` ran out of memory (above 5 samples), and every rank took the same decisions.
        ooms = [h for h in run["history"] if h["outcome"] == "oom"]
        assert ooms and all(h["failed_ranks"] == [one_rank] for h in ooms), run["history"]
        assert [r["split"] for r in run["results"]] == [r["split"] for r in per_rank[0]["search"]["results"]]
        assert all(max(r["split"]) <= 5 for r in run["results"]), run["results"]
        assert run["results"][0]["attempts"] > 1 and run["results"][-1]["attempts"] == 1
        # Settled, the sync hooks come off; one optimizer step per batch, failed attempts left none.
        assert run["results"][-1]["hooks"] is False
        assert run["steps"] == [6]
        # The parameters of a plain loop at the same splits, and of the whole batch at once.
        assert max_error(run["params"], run["reference"]) <= TOLERANCE, rank
        assert max_error(run["params"], run["whole"]) <= TOLERANCE, rank
        assert run["metrics"]["automicro/found_size"] == 5 and run["metrics"]["automicro/ooms_total"] == len(ooms)
        assert run["metrics"]["automicro/last_oom_rank"] == one_rank
        assert run["patched_after_close"] is False


@pytest.mark.multiproc
def test_an_oom_after_the_hooks_are_off_costs_one_rerun_of_that_batch_and_clipping_holds(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["steady"]
        # The same split again (the size holds), every batch trained once.
        check_steady_oom(run, one_rank, rank)
        assert run["steps"] == [7]
        # Clipped as torch's own clip_grad_norm_ clips (every norm above the bound: it acted).
        assert all(r["grad_norm"] > cases.CLIP for r in run["results"]), run["results"]
        assert max_error(run["params"], run["unclipped"]) > 100 * TOLERANCE


@pytest.mark.multiproc
def test_a_resumed_autostep_starts_at_the_split_it_saved_and_ends_like_an_unbroken_run(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["resume"]
        first, second = run["first"], run["second"]
        assert second["state"]["batches"] == 6 and first["state"]["batches"] == 3
        # No search again: the first batch after the resume runs the saved split (hooks on until stable).
        assert second["results"][0]["split"] == first["results"][-1]["split"]
        assert all(r["attempts"] == 1 for r in second["results"]), second["results"]
        assert second["results"][0]["hooks"] is True and second["results"][-1]["hooks"] is False
        assert not [h for h in second["history"] if h["batch"] >= 3 and h["outcome"] == "oom"]
        assert max_error(second["params"], run["reference"]) <= TOLERANCE, rank


@pytest.mark.multiproc
def test_under_a_memory_cap_lower_on_one_rank_the_search_fits_that_rank(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["cap"]
        # Every OOM was the low rank's own allocator limit (MemoryCap), never another rank's.
        assert out["cap"]["cap_ooms"] == (0 if rank != one_rank else len([h for h in run["history"] if h["outcome"] == "oom"]))
        assert any(h["outcome"] == "oom" for h in run["history"])
        assert all(h["failed_ranks"] == [one_rank] for h in run["history"] if h["outcome"] == "oom")
        assert run["steps"] == [4] and max(run["results"][-1]["split"]) < 64


@pytest.mark.multiproc
def test_padded_rows_under_the_token_budget_train_like_whole_batches_per_loss_token(ranks):
    world, one_rank, per_rank = ranks
    for rank, out in enumerate(per_rank):
        run = out["tokens"]
        ooms = [h for h in run["history"] if h["outcome"] == "oom"]
        assert ooms and all(h["failed_ranks"] == [one_rank] for h in ooms), run["history"]
        assert all(len(r["split"]) > 1 for r in run["results"]), run["results"]  # the batches were cut
        assert run["moved"] > 100 * TOLERANCE  # the parameters moved: the comparison can tell
        assert max_error(run["params"], run["reference"]) <= TOLERANCE, rank


@pytest.fixture(scope="module")
def errors():
    return run_multiprocess(cases.run_errors, world_size=2, timeout_s=200)


@pytest.mark.multiproc
def test_what_a_plain_loop_gets_wrong_is_refused_with_what_to_change(errors):
    for out in errors:
        assert "fully_shard(model) on the root" in out["root_not_sharded"]["message"]
        assert "eval_oom" in out["unknown_setting"]["message"] and "evaluation is the loop's own" in out["unknown_setting"]["message"]
        assert "torch.optim.Optimizer" in out["bad_optimizer"]["message"]
        assert "budget='bytes'" in out["bad_budget"]["message"]
        assert "max_grad_norm=0: must be a number > 0" in out["bad_clip"]["message"]
        assert "pass loss_fn=" in out["default_loss_on_tuple"]["message"]
        assert "one-element tensor" in out["loss_not_scalar"]["message"]
        # An error inside a step leaves nothing installed in the process.
        assert out["patched_after_errors"] is False


@pytest.mark.multiproc
def test_the_plain_loop_example_runs_on_two_cpu_ranks_under_a_memory_cap():
    """examples/torch_loop.py as a user runs it (torchrun, 2 gloo ranks), under a watchdog."""
    output = run_example("torch_loop.py", "--batches", "6")
    lines = [line for line in output.splitlines() if line.startswith("batch ")]
    assert [line.split(":")[0] for line in lines] == [f"batch {i}" for i in range(6)], output[-4000:]
    # The emulated limit made the search run out of memory, and the run went on to the last batch.
    assert int(re.search(r"OOMs so far (\d+)", lines[-1]).group(1)) >= 1, output[-4000:]
    assert "real (non-padding) tokens/s" in output


@pytest.mark.multiproc
def test_allocator_retries_in_a_layout_trials_batches_are_timed_not_a_thrash():
    """Two H200s at a 0.3 memory fraction (`benchmarks/RESULTS.md` 2026-11-28, AutoStep): a trade's batch left the pool
    retrying in the next batch too, thrash was blamed on the size, and the size went 7 -> 6 -> 5 over two trials. And
    Mixtral's blocks on one H100 (2026-12-07, the thrash in a trial): the fused head at 8 retried in its trial's
    batches, the trial ended for it, and the size that was fastest set by hand was never timed. The retries of a
    trial's batches are its arms' to time: no thrash, each trade timed to its end (slower here: not kept), the size
    stays; the batch after each trial retries once (the pool the trade left), and one is no thrash either."""
    for out in run_multiprocess(cases.run_trial_retries, world_size=2, timeout_s=300):
        assert out["retries"] >= 4  # the trials' batches did retry
        assert [h for h in out["history"] if h["outcome"] == "thrash"] == [], out["history"]
        assert [r["size"] for r in out["results"][1:]] == [5] * 15, out["results"]
        assert sorted(out["tried"]) == [["grad_sync_once", False], ["no_reshard", False]], out["tried"]
        assert out["rejected"] == {}, out["rejected"]


@pytest.mark.multiproc
def test_one_rank_and_a_batch_of_one_sample():
    (out,) = run_multiprocess(cases.run_one_rank, world_size=1, timeout_s=200)
    assert [r["split"] for r in out["results"]][-1] == (1,)
    assert all(max(r["split"]) <= 3 for r in out["results"]), out["results"]
    assert out["steps"] == [5]
    assert max_error(out["params"], out["reference"]) <= TOLERANCE
