"""Several nodes: ranks as separate launchers would set them up (NODE_RANK per node, no shared
memory across nodes), so the consensus runs hierarchically and the collective ledger has no board.

A simulation on one machine: what crosses "nodes" here goes over loopback TCP (gloo), exactly the
code path of real hosts, but not their latency. The fault matrix and the exact-size search on
2 nodes x 2 ranks and 4 nodes x 1 rank; steady-state OOMs recovered across nodes and the exit path
where nothing can be replayed; the harness
script (scripts/multinode.py) with both launchers."""

from __future__ import annotations

import pytest

from automicro.core.hierarchical import LEADER_GRACE_S
from automicro.testing.multiprocess import MultiprocessFailure, run_multiprocess
from tests import matrix
from tests import automicro_cases as cases
from tests import steady_cases
from tests.launch import run as _run
from tests.test_automicro import _check_fault_case
from tests.test_steady_state import _check_recovered

# (site, who, where): who "rankN" = only rank N fails, "every" = every rank.
# Sampled (tests/matrix.py): every site with every "who" in each run, the microbatch drawn.
TWO_BY_TWO = matrix.sample("nodes 2x2", [
    (site, who, where)
    for site in ("forward_pre", "reduce_scatter_alloc")
    for who in ("rank3", "rank2", "every")  # a non-leader, a node leader, everyone
    for where in ("first", "last")
], key=lambda cell: cell[:2])
FOUR_BY_ONE = matrix.sample("nodes 4x1", [
    (site, who, where) for site in ("backward_pre", "unshard_alloc") for who in ("rank1", "every") for where in ("first", "last")
], key=lambda cell: cell[:2])


@pytest.fixture(scope="module")
def two_nodes_two_ranks():
    return run_multiprocess(cases.run_fault_matrix, world_size=4, nodes=2, args=(TWO_BY_TWO, -1), timeout_s=400)


@pytest.fixture(scope="module")
def four_nodes_one_rank():
    return run_multiprocess(cases.run_fault_matrix, world_size=4, nodes=4, args=(FOUR_BY_ONE, -1), timeout_s=400)


def _failing(who: str) -> list[int]:
    return [0, 1, 2, 3] if who == "every" else [int(who[4:])]


@pytest.mark.multiproc
@pytest.mark.parametrize("site,who,where", TWO_BY_TWO)
def test_two_nodes_of_two_ranks_find_the_largest_size_with_exact_params(two_nodes_two_ranks, site, who, where):
    _check_fault_case(
        two_nodes_two_ranks, f"{site}/{who}/{where}", site, cases.MICROBATCH[where], _failing(who),
        cases.MATRIX_BATCHES, "hierarchical",
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("site,who,where", FOUR_BY_ONE)
def test_four_nodes_of_one_rank_find_the_largest_size_with_exact_params(four_nodes_one_rank, site, who, where):
    _check_fault_case(
        four_nodes_one_rank, f"{site}/{who}/{where}", site, cases.MICROBATCH[where], _failing(who),
        cases.MATRIX_BATCHES, "hierarchical",
    )


TIMEOUT_S = 6.0
# Steady-phase OOMs (hooks off) across nodes: the ledger's board is the launcher's store
# (automicro.core.store_board). The first case is the one a GPU run showed unrecovered before it:
# rank 0 blocked (here in gloo) waiting for a collective rank 1 never issues.
NODES_CASES = [
    ("slow_forward", "one", "first"),
    ("forward_pre", "one", "first"),
    ("backward", "one", "last"),
    ("reduce_scatter_alloc", "every", "first"),
    ("grad_hook", "one", "last"),
]
NODES_2X2_CASES = [("forward_pre", "one", "last"), ("backward", "every", "first")]


@pytest.mark.multiproc
def test_oom_after_hooks_off_on_two_nodes_costs_one_batch_retry_with_params_equal_to_no_oom():
    per_rank = run_multiprocess(steady_cases.run_steady_matrix, world_size=2, nodes=2, args=(NODES_CASES, 1), timeout_s=300)
    for site, who, where in NODES_CASES:
        _check_recovered(per_rank, f"{site}/{who}/{where}", 1, 2)
    # Rank 0 waited in a collective rank 1 never issued: rank 1 replayed it from rank 0's record.
    assert per_rank[1]["slow_forward/one/first"]["replayed"] >= 1, per_rank[1]["slow_forward/one/first"]


@pytest.mark.multiproc
def test_oom_after_hooks_off_on_two_nodes_of_two_ranks_costs_one_batch_retry():
    per_rank = run_multiprocess(
        steady_cases.run_steady_matrix, world_size=4, nodes=2, args=(NODES_2X2_CASES, 3), timeout_s=300
    )
    for site, who, where in NODES_2X2_CASES:
        _check_recovered(per_rank, f"{site}/{who}/{where}", 3, 4)


@pytest.mark.multiproc
def test_unrecoverable_oom_on_gloo_nodes_stops_every_rank_within_the_bound_naming_rank_site_batch(capfd):
    """Rank 0 sits in an all-reduce of the model's own code that rank 1 never reaches: nothing can
    replay it. Rank 1 gives up after the bound and rings the job-lost alarm, which ends rank 0."""
    with pytest.raises(MultiprocessFailure) as failure:
        run_multiprocess(
            steady_cases.run_unrecoverable, world_size=2, nodes=2, args=(TIMEOUT_S,), timeout_s=300,
            failure_grace_s=40, start_method="spawn",  # spawn: the workers' stderr reaches capfd
        )
    info = failure.value
    failing = info.results.get(1)
    assert failing is not None, info.errors
    assert failing["transport"] == "hierarchical"
    assert failing["fatal"], failing
    message = failing["exception"]["message"]
    assert "rank 1" in message and "loss" in message and f"batch {steady_cases.FAULT_BATCH}" in message, message
    assert "did not stop within" in message, message
    # The bound: unguarded_timeout_s for the catch-up, plus the leaders' grace of the hierarchical round, and what the
    # stop costs beyond them (a second or two on CI's loaded 2 cores: 60 s holds at ten times that), not the hang bound.
    spent = failing["total_seconds"] - sum(r["seconds"] for r in failing["history"] if r["outcome"] == "ok")
    assert spent < TIMEOUT_S + LEADER_GRACE_S + 60, failing
    assert info.exitcodes.get(0) == 3, (info.exitcodes, info.errors)
    err = capfd.readouterr().err
    assert "rank 0 stops: automicro: rank 1 cannot recover in-process from the failure at loss" in err, err[-3000:]


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher,nproc", [("composer", 1), ("torchrun", 2)])
def test_harness_runs_the_main_job_as_two_nodes_with_the_hierarchical_consensus(tmp_path, launcher, nproc):
    world = 2 * nproc
    caps = {0: 13000000, 1: 18000000, 2: 18000000, 3: 18000000}
    limits = "{" + ", ".join(f"{r}: {caps[r]}" for r in range(world)) + "}"
    result = _run(
        [
            __import__("sys").executable, "scripts/multinode.py", "--nodes", "2", "--nproc-per-node", str(nproc),
            "--launcher", launcher, "--timeout", "400", "--",
            "scripts/train.py", "configs/tiny-cpu.yaml", "max_duration=6ba", f"run_dir={tmp_path}",
            f"global_train_batch_size={8 * world}", f"callbacks.memory_cap.limit_bytes={limits}",
        ],
        timeout_s=450,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert f"consensus transport hierarchical: 2 nodes of {nproc} rank(s)" in out, out[-4000:]
    assert "microbatch size found: 5 (per-rank batch 8); split in use [4, 4]" in out, out[-4000:]
    assert "[multinode] exit codes per node: [0, 0]" in out


@pytest.mark.multiproc
@pytest.mark.parametrize("nodes", [1, 2])
def test_oom_between_batches_stops_every_rank_naming_the_rank_and_event_and_leaves_the_note(capfd, tmp_path, nodes):
    """One node: the ledger's board carries the news; two nodes: the job-lost alarm."""
    import json
    import os

    folder = str(tmp_path / "checkpoints")
    with pytest.raises(MultiprocessFailure) as failure:
        run_multiprocess(
            steady_cases.run_oom_between_batches, world_size=2, nodes=nodes, args=(folder,), timeout_s=150,
            failure_grace_s=40, start_method="spawn",  # spawn: the workers' stderr reaches capfd
        )
    info = failure.value
    failing = info.results.get(1)
    assert failing is not None, info.errors
    assert failing["transport"] == ("hierarchical" if nodes > 1 else "shm")
    assert failing["fatal"], failing
    message = failing["exception"]["message"]
    assert "rank 1" in message and "between_batches" in message and "Event.BATCH_END" in message, message
    assert f"batch {steady_cases.FAULT_BATCH}" in message, message
    assert info.exitcodes.get(0) == 3, (info.exitcodes, info.errors)
    err = capfd.readouterr().err
    stopped = [line for line in err.splitlines() if "rank 0 stops" in line]
    assert stopped and "rank 1" in stopped[0] and "between_batches" in stopped[0], err[-3000:]
    with open(os.path.join(folder, "automicro_failure.json")) as f:
        note = json.load(f)
    assert note["batch"] == steady_cases.FAULT_BATCH and note["size"] == max(steady_cases.SPLIT), note
