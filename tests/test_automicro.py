"""`automicro.Trainer` with `device_train_microbatch_size="auto"` on FSDP2, end to end on gloo ranks.

The cases run in tests/automicro_cases.py, many per process group (three `run_multiprocess` calls
in all); every call has a hang watchdog that fails the test with every rank's stack. The fault
injector (`automicro.testing.FaultInjector`) decides exactly where, on which ranks and at which
microbatch sizes an "out of memory" happens, so every expected size below is computed from the
injector's conditions.
"""

from __future__ import annotations

import pytest

from automicro.core.policy import chunk_split, even_split
from automicro.testing.multiprocess import run_multiprocess
from tests import automicro_cases as cases
from tests import matrix

TOLERANCE = 1e-5

# Sampled (tests/matrix.py): every site in every run, who and where drawn; `--full` runs all 48.
WORLD2_CASES = matrix.sample("automicro 2 ranks", [
    (site, who, where) for site in cases.MATRIX_SITES for who in ("one", "every") for where in cases.MICROBATCH
])
WORLD2_ONE_RANK = 1
WORLD4_SITES = ("forward_pre", "backward_pre", "unshard_alloc", "reduce_scatter_alloc")
# The first and the last microbatch (the middle one is the 2-rank matrix's, at every site): 16 cases, not 24.
WORLD4_CASES = matrix.sample(
    "automicro 4 ranks", [(site, who, where) for site in WORLD4_SITES for who in ("one", "every") for where in ("first", "last")]
)
WORLD4_ONE_RANK = 3
# Consensus transports (automicro.core.transport): the two-rank matrix and the collectives-only
# subset run on the default ("auto": shared memory, every rank is on this host), the four-rank
# matrix on the gloo process group (what ranks on several hosts use). Each case checks which one ran.
WORLD2_TRANSPORT = "shm"
WORLD4_TRANSPORT = "process_group"


@pytest.fixture(scope="module")
def matrix_two_ranks():
    return run_multiprocess(
        cases.run_fault_matrix, world_size=2, args=(WORLD2_CASES, WORLD2_ONE_RANK), timeout_s=300
    )


COLLECTIVES_ONLY_SITES = ["forward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc", "loss"]
COLLECTIVES_ONLY_CASES = matrix.sample(
    "automicro collectives only", [(site, "one", where) for site in COLLECTIVES_ONLY_SITES for where in ("first", "last")]
)


@pytest.fixture(scope="module")
def matrix_collectives_only():
    return run_multiprocess(
        cases.run_fault_matrix,
        world_size=2,
        args=(COLLECTIVES_ONLY_CASES, WORLD2_ONE_RANK, "collectives"),
        timeout_s=300,
    )


@pytest.fixture(scope="module")
def matrix_four_ranks():
    return run_multiprocess(
        cases.run_fault_matrix,
        world_size=4,
        args=(WORLD4_CASES, WORLD4_ONE_RANK, "all", WORLD4_TRANSPORT),
        timeout_s=300,
    )


@pytest.fixture(scope="module")
def misc(tmp_path_factory):
    folder = tmp_path_factory.mktemp("automicro_checkpoints")
    return run_multiprocess(cases.run_misc_cases, world_size=2, args=(str(folder),), timeout_s=300)


# ---- what the injector lets through -----------------------------------------------------------


def injector_fires(site: str, index: int, split: tuple[int, ...], above: int = cases.ABOVE) -> bool:
    """Whether `FaultInjector(site, above=above, microbatch_index=index)` fires in an attempt with
    this split: the attempt's size (its largest microbatch) must be above `above`, and the site must
    occur at the targeted microbatch. Every site occurs in every microbatch except
    `optimizer_step`, which fires once per attempt, with the index of the last microbatch."""
    if max(split) <= above:
        return False
    target = len(split) - 1 if index == -1 else index
    if site == "optimizer_step":
        return target == len(split) - 1
    return target < len(split)


def expected_found_size(site: str, index: int, batch: int = cases.B) -> int:
    """The largest size the injector allows. While searching, size m runs as Composer's chunk
    split (m, m, ..., rest), so e.g. "middle" (index 1) never fires at size 8 (one microbatch) and
    size 8 is accepted at once; `optimizer_step` at "first" (index 0) fires only where microbatch 0
    is the last one (size 8), so 7 is the answer there.

    The search starts at `batch` and bisects below a failure, so it reaches the largest allowed size
    when the allowed sizes are either everything up to some k or include `batch` itself; checked
    here, so a case outside that shape cannot pass by accident."""
    allowed = [m for m in range(1, batch + 1) if not injector_fires(site, index, chunk_split(batch, m))]
    best = max(allowed)
    assert best == batch or allowed == list(range(1, best + 1)), (site, index, allowed)
    return best


def test_expected_sizes_follow_the_injector_conditions():
    assert expected_found_size("backward_pre", 0) == 5
    assert expected_found_size("backward_pre", -1) == 5
    assert expected_found_size("backward_pre", 1) == 8  # 6 -> (6, 2) fails, but 8 -> (8,) has no microbatch 1
    assert expected_found_size("optimizer_step", 0) == 7  # fires only at (8,)
    assert expected_found_size("optimizer_step", -1) == 5
    assert expected_found_size("optimizer_step", 1) == 8


def _ok(result):
    assert "crash" not in result, result["crash"]["traceback"]
    return result


def _check_fault_case(
    results, key: str, site: str, index: int, failing: list[int], batches: int, transport: str
) -> None:
    expected = expected_found_size(site, index)
    for rank, per_rank in enumerate(results):
        result = _ok(per_rank[key])
        where = f"{key} on rank {rank}"
        assert "exception" not in result, f"{where}: {result['exception']['traceback']}"
        assert result["transport"] == transport, where
        assert result["found_size"] == expected, f"{where}: found {result['found_size']}, expected {expected}"
        assert result["split"] == list(even_split(cases.B, expected)), where
        # The injector fired exactly where its conditions hold, on exactly the targeted ranks,
        # and every rank agreed on who failed where.
        ooms = 0
        for record in result["history"]:
            fires = injector_fires(site, index, tuple(record["split"]))
            assert record["outcome"] == ("oom" if fires else "ok"), f"{where}: {record}"
            if fires:
                ooms += 1
                assert record["failed_ranks"] == failing, f"{where}: {record}"
                assert record["sites"] == [site] * len(failing), f"{where}: {record}"
        assert result["fired"] == (ooms if rank in failing else 0), where
        if expected < cases.B:
            assert ooms > 0, f"{where}: the injector never fired"
        # Every batch was applied exactly once, failed attempts left nothing behind: the same
        # parameters as a run at a fixed microbatch size of 4 (sample-weighted loss: the split
        # does not change the gradient).
        assert result["batches"] == batches, where
        assert result["adam_steps"] == [batches], f"{where}: optimizer steps {result['adam_steps']}"
        assert result["error"] < TOLERANCE, f"{where}: parameters differ from the fixed-size run by {result['error']}"
        # Every FSDP2 state is IDLE and sharded after fit; after a full backward FSDP2 reshards the
        # root too (it only skips the reshard after forward), so nothing stays unsharded.
        assert result["clean"], f"{where}: {result['states']}"
        assert result["unsharded_bytes"] == 0, where
        # The injector's hooks come off at fit end, the sync hooks too (fit ended while settling).
        assert not result["injector_hooks_after_fit"], where
        assert not result["sync_hooks_after_fit"], where
        assert result["listeners_after_close"] == 0, where
        assert result["collective_patch_after_close"] is False, where
        assert result["module_hooks_after_close"] == 0, where


@pytest.mark.multiproc
@pytest.mark.parametrize("site, who, where", WORLD2_CASES)
def test_two_ranks_oom_at_site_on_rank1_or_every_rank_finds_largest_allowed_size_with_exact_params(
    matrix_two_ranks, site, who, where
):
    failing = [WORLD2_ONE_RANK] if who == "one" else [0, 1]
    _check_fault_case(
        matrix_two_ranks, f"{site}/{who}/{where}", site, cases.MICROBATCH[where], failing, cases.MATRIX_BATCHES,
        WORLD2_TRANSPORT,
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("site, who, where", WORLD4_CASES)
def test_four_ranks_oom_at_collective_site_on_rank3_or_every_rank_finds_largest_allowed_size_with_exact_params(
    matrix_four_ranks, site, who, where
):
    failing = [WORLD4_ONE_RANK] if who == "one" else [0, 1, 2, 3]
    _check_fault_case(
        matrix_four_ranks, f"{site}/{who}/{where}", site, cases.MICROBATCH[where], failing, cases.MATRIX_BATCHES,
        WORLD4_TRANSPORT,
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("site, where", [(site, where) for site, _, where in COLLECTIVES_ONLY_CASES])
def test_consensus_only_before_collectives_still_never_deadlocks_and_finds_the_size(matrix_collectives_only, site, where):
    # sync_points="collectives": no consensus at module boundaries, only between FSDP2's buffer
    # allocation and its collectives; rank 1 fails and rank 0 must notice at its next collective.
    _check_fault_case(
        matrix_collectives_only, f"{site}/one/{where}", site, cases.MICROBATCH[where], [WORLD2_ONE_RANK],
        cases.MATRIX_BATCHES, WORLD2_TRANSPORT,
    )


# ---- hooks lifecycle ---------------------------------------------------------------------------


def _rows(result, batch, attempt=None):
    rows = [r for r in result["rows"] if r["batch"] == batch and (attempt is None or r["attempt"] == attempt)]
    assert rows, f"no after_forward recorded in batch {batch} attempt {attempt}"
    return rows


def _assert_hooks(rows, on: bool, what: str) -> None:
    for row in rows:
        if on:
            assert row["hooks_active"] and row["module_hooks"] > 0 and row["collective_patch"], (what, row)
            assert row["listeners"] == 1, (what, row)
        else:
            assert not row["hooks_active"], (what, row)
            assert row["module_hooks"] == 0 and row["collective_patch"] is False and row["listeners"] == 0, (what, row)


@pytest.mark.multiproc
def test_sync_hooks_on_while_searching_off_after_three_clean_batches_and_back_after_an_oom(misc):
    for rank, per_rank in enumerate(misc):
        result = _ok(per_rank["hooks_after_oom"])
        # Batch 0 searches (size 8 fits), batches 1-3 are the 3 clean batches: hooks off from batch 4.
        for batch in range(0, 4):
            _assert_hooks(_rows(result, batch), True, f"rank {rank} batch {batch}")
        for batch in range(4, cases.OOM_BATCH):
            _assert_hooks(_rows(result, batch), False, f"rank {rank} batch {batch}")
        # Batch 6 runs out of memory on every rank with the hooks off, then reruns with them on.
        _assert_hooks(_rows(result, cases.OOM_BATCH, attempt=1), False, f"rank {rank} batch 6 attempt 1")
        _assert_hooks(_rows(result, cases.OOM_BATCH, attempt=2), True, f"rank {rank} batch 6 attempt 2")
        _assert_hooks(_rows(result, cases.OOM_BATCH + 1), True, f"rank {rank} batch 7")
        oom = [r for r in result["history"] if r["outcome"] == "oom"]
        assert len(oom) == 1 and oom[0]["batch"] == cases.OOM_BATCH and oom[0]["attempt"] == 1, result["history"]
        assert oom[0]["failed_ranks"] == [0, 1] and "steady" in oom[0]["note"], oom[0]
        # Nothing fired while the hooks were off, so the failure is not blamed on a stale site.
        assert oom[0]["sites"] == ["other", "other"], oom[0]
        assert result["fired"] == 1 and result["clean"]
        # One OOM in the steady phase is rerun at the same size (hooks on), which fits: 8 stays.
        assert result["found_size"] == 8
        rerun = [r for r in result["history"] if r["batch"] == cases.OOM_BATCH and r["attempt"] == 2]
        assert rerun and rerun[0]["outcome"] == "ok" and rerun[0]["size"] == 8, result["history"]
        assert result["listeners_after_close"] == 0 and result["collective_patch_after_close"] is False
        assert result["module_hooks_after_close"] == 0


@pytest.mark.multiproc
def test_sync_hooks_rearmed_for_the_batch_after_eval(misc):
    for rank, per_rank in enumerate(misc):
        result = _ok(per_rank["hooks_after_eval"])
        assert [e["batch"] for e in result["eval_ends"]] == [cases.EVAL_INTERVAL, cases.EVAL_BATCHES]
        _assert_hooks(_rows(result, 0), True, f"rank {rank} batch 0")
        _assert_hooks(_rows(result, cases.EVAL_INTERVAL - 1), False, f"rank {rank} batch 4 (steady, before eval)")
        _assert_hooks(_rows(result, cases.EVAL_INTERVAL), True, f"rank {rank} batch 5 (after eval)")
        after_eval = [r for r in result["history"] if r["batch"] == cases.EVAL_INTERVAL]
        assert after_eval and after_eval[0]["note"].startswith("clean batch 1/3"), result["history"]
        # Eval runs the root's forward without a backward: FSDP2 may keep the root unsharded
        # (it does on torch 2.7 and 2.11: the root is never resharded after forward), but every
        # block is sharded again and every state is IDLE.
        for end in result["eval_ends"]:
            assert all(r["module"] == "" and r["state"] == "IDLE" for r in end["not_idle_or_sharded"]), end
        assert result["listeners_after_close"] == 0 and result["collective_patch_after_close"] is False


# ---- thrash --------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_allocator_retries_in_two_batches_at_size8_count_as_thrash_and_step_down(misc):
    for rank, per_rank in enumerate(misc):
        result = _ok(per_rank["thrash"])
        history = result["history"]
        thrash = [r for r in history if r["outcome"] == "thrash"]
        assert len(thrash) == 1, history
        assert thrash[0]["size"] == 8 and thrash[0]["next_size"] < 8, thrash[0]
        assert result["thrash_events"] == 1
        # Retries without any emulated OOM; the smaller sizes never retry, so no second thrash.
        assert result["cap_ooms"] == 0 and result["ooms_total"] == 0
        assert not [r for r in history if r["outcome"] == "oom"], history
        assert result["found_size"] is not None and result["found_size"] < 8
        assert all(r["size"] < 8 for r in history if r["batch"] > thrash[0]["batch"]), history
        assert result["clean"]
        assert result["listeners_after_close"] == 0 and result["collective_patch_after_close"] is False


@pytest.mark.multiproc
def test_a_thrash_timed_keeps_the_size_below_where_it_is_faster(misc):
    for per_rank in misc:
        result = _ok(per_rank["thrash_timed_below"])
        thrash = [r for r in result["history"] if r["outcome"] == "thrash"]
        assert len(thrash) == 1 and thrash[0]["size"] == 8, result["history"]
        # The retrying batches (1, 2) against the size below's settled batches with the hooks on, the first at its
        # split left out (5: after 4's (7, 1)).
        assert result["lines"] == [
            "thrash at 8 timed: median batch 3.0000 s at 8 with the allocator's retries (batches 1, 2), 1.0000 s at 7 "
            "(batches 6, 7) (-200.0%; spread 0.0000 s): 7 kept, as the thrash rule had it"
        ], result["lines"]
        after = result["batches"][thrash[0]["batch"] + 1:]
        assert after and all(max(b["split"]) < 8 and not b["retried"] for b in after), result["batches"]
        assert result["found_size"] == 7 and result["thrash_events"] == 1 and result["ooms_total"] == 0


@pytest.mark.multiproc
def test_a_thrash_at_the_size_below_one_being_timed_gives_the_other_arm_and_the_faster_retrying_size_is_kept(misc):
    """Qwen3-MoE's blocks on one H100: a thrash at 6, then at 4, 3 and 2 as each size's pool settled, and the run
    ended at 2 (3.4 s a batch against 2.2 s at 6). Here the size below (7, split (4, 4)) retries in batches 6 and 7."""
    for per_rank in misc:
        result = _ok(per_rank["thrash_timed_cascade"])
        # 5 is the first at its split after 4's (7, 1): not fit to time; 6 and 7 are the arm, their hooks on.
        assert result["lines"] == [
            "thrash at 8 timed: median batch 1.0000 s at 8 with the allocator's retries (batches 1, 2), 2.0000 s at 4 "
            "with its retries too (batches 6, 7) (+50.0%; spread 0.0000 s): 8 again from batch 10, its retries accepted "
            "(no thrash counted there; an OOM there still shrinks the size)",
            "thrash at 8 timed faster than 3: back to 8, split (8,)",
        ], result["lines"]
        assert [r["batch"] for r in result["history"] if r["outcome"] == "thrash"] == [2, 7], result["history"]
        splits = [b["split"] for b in result["batches"]]
        assert splits[5:10] == [[4, 4], [4, 4], [4, 4], [2, 2, 2, 2], [3, 3, 2]], splits
        # Back at 8 from batch 10: every batch there retries (as 1 and 2 did), and none counts as a thrash.
        assert result["batches"][10:] == [{"split": [8], "retried": True}] * 2, result["batches"]
        assert result["found_size"] == 8 and result["thrash_events"] == 2 and result["ooms_total"] == 0
        assert result["cap_ooms"] == 0 and result["clean"]


# ---- failures that must stop every rank -----------------------------------------------------------


@pytest.mark.multiproc
def test_non_oom_error_on_rank1_stops_rank1_with_it_and_rank0_naming_rank1(misc):
    rank0, rank1 = (_ok(r["non_oom_error"]) for r in misc)
    assert rank1["exception"]["type"] == "InjectedFault"
    assert "injected error at backward_pre on rank 1" in rank1["exception"]["message"]
    assert rank0["exception"]["type"] == "FailedOnOtherRank"
    assert "rank(s) [1]" in rank0["exception"]["message"] and "backward_pre" in rank0["exception"]["message"]
    for rank, result in enumerate((rank0, rank1)):
        assert result["seconds"] < 60, f"rank {rank} took {result['seconds']} s to stop"
        assert result["history"][-1]["outcome"] == "error" and result["history"][-1]["failed_ranks"] == [1]
        assert result["clean"]
        # fit raised, so fit_end did not run: trainer.close() takes every hook off.
        assert result["injector_hooks_before_close"] and not result["injector_hooks_after_close"]
        assert result["listeners_after_close"] == 0 and result["collective_patch_after_close"] is False
        assert result["module_hooks_after_close"] == 0


@pytest.mark.multiproc
def test_oom_even_at_size1_on_rank0_raises_microbatch_size_error_on_every_rank(misc):
    for rank, per_rank in enumerate(misc):
        result = _ok(per_rank["oom_at_size_one"])
        assert result["exception"]["type"] == "MicrobatchSizeError", (rank, result["exception"])
        message = result["exception"]["message"]
        assert "device_train_microbatch_size=1" in message and "rank 0 at forward_pre" in message, message
        # The ladder below size 1: at the first repeat the selective rung, the probe's split (2) and 1 again; at the
        # next repeat full recompute, 2 and 1 again.
        assert "with selective recompute on, then activation checkpointing on (switched on by auto at batch 0" in message, message
        assert [r["size"] for r in result["history"]] == [8, 4, 2, 1, 2, 1, 2, 1]
        assert all(r["outcome"] == "oom" and r["failed_ranks"] == [0] for r in result["history"])
        assert result["seconds"] < 60
        assert result["clean"]
        assert result["listeners_after_close"] == 0 and result["collective_patch_after_close"] is False


# ---- checkpoints ---------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_resume_from_checkpoint_keeps_found_size_and_guards_until_stable(misc):
    for rank, per_rank in enumerate(misc):
        result = _ok(per_rank["checkpoint"])
        assert result["saved_found_size"] == 5
        assert f"ep0-ba{cases.CHECKPOINT_AT}-rank0.pt" in result["files"]
        assert result["first_listeners_after_close"] == 0 and result["first_collective_patch_after_close"] is False
        assert result["sites_shared"] is False and result["first_context_unchanged"] is True
        assert result["resumed_context_batch"] == cases.RESUMED_BATCHES - 1  # the second trainer's own last batch
        resumed = [r for r in result["history"] if r["batch"] >= cases.CHECKPOINT_AT]
        # No new search from 8: the first resumed batch runs the found size's even split at once.
        assert resumed[0]["batch"] == cases.CHECKPOINT_AT and resumed[0]["attempt"] == 1, resumed
        assert tuple(resumed[0]["split"]) == (4, 4) and resumed[0]["outcome"] == "ok", resumed[0]
        assert all(r["outcome"] == "ok" and max(r["split"]) <= cases.ABOVE for r in resumed), resumed
        assert result["fired"] == 0 and result["found_size"] == 5
        # Hooks on after loading until 3 clean batches (4, 5, 6), off in batch 7. The injector's
        # own module hooks (and its collective hook) stay for the whole fit.
        injector = result["injector_module_hooks"]
        for batch in range(cases.CHECKPOINT_AT, cases.RESUMED_BATCHES):
            on = batch < cases.CHECKPOINT_AT + 3
            for row in _rows(result, batch):
                assert row["hooks_active"] is on, (batch, row)
                assert row["module_hooks"] == (2 * injector if on else injector), (batch, row)
                assert row["listeners"] == (1 if on else 0), (batch, row)
        assert result["adam_steps"] == [cases.RESUMED_BATCHES]
        assert result["error_vs_uninterrupted"] < TOLERANCE
        assert result["listeners_after_close"] == 0 and result["collective_patch_after_close"] is False
