"""Consensus transports (automicro.core.transport): shared memory and the process group give the
same MAX in every round, on 2 and 4 ranks, with ranks arriving at different times; a shared-memory
round that waits for a rank that is gone or late ends with an error that names the rank."""

from __future__ import annotations

import glob
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from automicro.core.consensus import SLOTS, Consensus, LocalFigures
from automicro.core.transport import (
    ProcessGroupTransport,
    ShmTransport,
    TransportTimeout,
    node_layout,
    shm_unavailable_reason,
)
from automicro.testing.multiprocess import run_multiprocess

ROUNDS = 300


def _vector(seed: int, rank: int, round_: int, length: int) -> np.ndarray:
    rng = random.Random(seed * 1_000_003 + round_ * 101 + rank)
    return np.array([rng.randrange(0, 2**62) if rng.random() < 0.7 else 0 for _ in range(length)], dtype=np.int64)


def _both_transports(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    length = 1 + SLOTS * world
    shm = ShmTransport.create(None, length)
    leftovers = sorted(glob.glob("/dev/shm/automicro-consensus-*"))
    pg = ProcessGroupTransport(None, world)
    delays = random.Random(seed + rank)
    shm_results, pg_results = [], []
    for r in range(ROUNDS):
        # Arrive late now and then, sometimes past the busy-wait and the yield phase (> 2 ms).
        if delays.random() < 0.1:
            time.sleep(delays.choice([1e-4, 1e-3, 5e-3]))
        shm_results.append(shm.max_reduce(_vector(seed, rank, r, length)).tolist())
        pg_results.append(pg.max_reduce(_vector(seed, rank, r, length)).tolist())
    dist.barrier()
    shm.close()
    return {"shm": shm_results, "pg": pg_results, "leftovers": leftovers, "name": shm.name, "pid": os.getpid()}


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_and_process_group_agree_on_every_round(world):
    seed = 7 + world
    per_rank = run_multiprocess(_both_transports, world_size=world, args=(seed,), timeout_s=120)
    length = 1 + SLOTS * world
    expected = [
        np.max([_vector(seed, rank, r, length) for rank in range(world)], axis=0).tolist() for r in range(ROUNDS)
    ]
    for rank, result in enumerate(per_rank):
        assert result["name"] == "shm"
        assert result["pg"] == expected, f"rank {rank}: gloo all-reduce differs from the element-wise max"
        assert result["shm"] == expected, f"rank {rank}: shared-memory round differs from the element-wise max"
    # The segment is unlinked once every rank has mapped it: nothing of this launch's is left in
    # /dev/shm (rank 0 names it by its pid; other launches, pytest-xdist's, may hold theirs).
    ours = f"/dev/shm/automicro-consensus-{per_rank[0]['pid']}-"
    assert not [p for p in per_rank[0]["leftovers"] if p.startswith(ours)], per_rank[0]


def _consensus_protocol(rank: int, world: int, transport: str) -> dict:
    """Rank 1 fails at its third sync point; every other rank syncs until it hears of it."""
    consensus = Consensus.create(transport=transport)
    consensus.begin_attempt()
    # Another process holds memory on rank 1's card only (the last slot of a rank's report).
    figures = LocalFigures(peak_bytes=1000 + rank, capacity_bytes=5000 - rank, outside_bytes=700 * rank)
    raised = None
    if rank == 1:
        consensus.sync()
        consensus.sync()
        verdict = consensus.fail(1, "backward", figures)
    else:
        try:
            for _ in range(10):
                consensus.sync()
        except RuntimeError as error:
            raised = type(error).__name__
        verdict = consensus.fail(1, "backward", figures, own_code_zero=True)
    consensus.begin_attempt()
    clean = consensus.finish(figures)
    return {
        "transport": consensus.transport_name,
        "raised": raised,
        "failed_ranks": verdict.failed_ranks,
        "sites": verdict.sites,
        "peak": verdict.peak_bytes,
        "capacity": verdict.capacity_bytes,
        "outside": (verdict.outside_bytes, clean.outside_bytes),
        "clean_failed": clean.failed,
        "syncs": consensus.sync_count,
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("transport", ["shm", "process_group"])
def test_consensus_protocol_same_verdict_and_round_count_on_each_transport(transport):
    per_rank = run_multiprocess(_consensus_protocol, world_size=2, args=(transport,), timeout_s=60)
    for rank, result in enumerate(per_rank):
        assert result["transport"] == transport
        assert result["failed_ranks"] == [1] and result["sites"] == ["backward"], result
        assert result["peak"] == 1001 and result["capacity"] == 4999 and result["outside"] == (700, 700), result
        assert result["clean_failed"] is False
    assert per_rank[0]["raised"] == "OOMOnOtherRank"
    assert per_rank[0]["syncs"] == per_rank[1]["syncs"], "ranks ran different numbers of rounds"


def _single_rank_view(other_pid: int) -> ShmTransport:
    segment = np.zeros(2 * (2 + 2 * 3), dtype=np.int64)  # what open_shared_segment maps, in plain memory
    transport = ShmTransport(segment, rank=0, world_size=2, length=3, check_pids=True)
    transport._pids[1] = other_pid
    return transport


def test_shared_memory_round_names_a_rank_that_exited():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    transport = _single_rank_view(gone.pid)
    started = time.monotonic()
    with pytest.raises(TransportTimeout, match=rf"rank 1 \(pid {gone.pid}\) exited"):
        transport.max_reduce(np.zeros(3, dtype=np.int64), timeout_s=60)
    assert time.monotonic() - started < 10, "a dead rank must be noticed at once, not at the timeout"


def test_shared_memory_round_times_out_naming_the_late_rank():
    transport = _single_rank_view(os.getpid())  # "rank 1" is alive but never arrives
    with pytest.raises(TransportTimeout, match=r"timed out after 1.5 s: rank\(s\) \[1\] did not reach round 1"):
        transport.max_reduce(np.zeros(3, dtype=np.int64), timeout_s=1.5)


def test_shared_memory_refuses_several_hosts_nodes_and_other_architectures():
    here = ("node-a", "boot-1", "x86_64", "pid:[1]", "0")
    assert shm_unavailable_reason([here, here]) is None or not os.path.isdir("/dev/shm")
    assert "2 hosts" in shm_unavailable_reason([here, ("node-b", "boot-2", "x86_64", "pid:[1]", "1")])
    # Two launchers on one machine, each with its own node rank: two nodes, no shared segment.
    assert "2 nodes" in shm_unavailable_reason([here, ("node-a", "boot-1", "x86_64", "pid:[1]", "1")])
    assert "aarch64" in shm_unavailable_reason([("n", "b", "aarch64", "p", "")] * 2)
    assert node_layout([here, ("node-a", "boot-1", "x86_64", "pid:[1]", "1"), here]) == [[0, 2], [1]]


def test_bad_transport_names_are_refused_with_the_choices():
    from automicro import AutoMicrobatching

    with pytest.raises(ValueError, match="consensus transport 'tcp'.*auto.*shm.*process_group"):
        Consensus.create(transport="tcp")
    with pytest.raises(ValueError, match="consensus_transport='tcp'.*'auto'.*'shm'.*'hierarchical'.*'process_group'"):
        AutoMicrobatching(consensus_transport="tcp")


# ---- many nodes: the hierarchical transport ------------------------------------------------------


def _sparse_vector(seed: int, rank: int, round_: int, length: int) -> np.ndarray:
    """Every other round on average a sync round's shape (a few non-zero words, fewer than the header's
    pairs), else `_vector`'s (dense: the whole vector follows the header)."""
    vec = _vector(seed, rank, round_, length)
    rng = random.Random(seed * 7 + round_ * 13 + rank)
    if rng.random() < 0.5:
        keep = np.zeros_like(vec)
        for index in rng.sample(range(length), 2):
            keep[index] = vec[index]
        return keep
    return vec


def _hierarchical_and_gloo(rank: int, world: int, seed: int, local_leg: str, sparse_pairs: int = 0) -> dict:
    from automicro.core.hierarchical import _RecursiveDoubling

    if sparse_pairs:  # the leaders' sparse exchange at a vector this short (it applies past 1 + 2 x pairs words)
        _RecursiveDoubling.SPARSE_PAIRS = sparse_pairs
    make = _sparse_vector if sparse_pairs else _vector
    consensus = Consensus.create(transport="auto", local_leg=local_leg)
    pg = ProcessGroupTransport(consensus.group, world)
    length = 1 + SLOTS * world
    delays = random.Random(seed + rank)
    hier_results, pg_results = [], []
    for r in range(ROUNDS):
        if delays.random() < 0.1:
            time.sleep(delays.choice([1e-4, 1e-3, 5e-3]))
        hier_results.append(consensus.transport.max_reduce(make(seed, rank, r, length)).tolist())
        pg_results.append(pg.max_reduce(make(seed, rank, r, length)).tolist())
    described = consensus.describe()
    consensus.close()
    return {"hier": hier_results, "pg": pg_results, "name": consensus.transport_name, "described": described}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "world,nodes,local_leg,within,sparse_pairs",
    [
        (4, 2, "auto", "shared memory", 0),
        (4, 4, "auto", "one rank per node", 0),
        (3, 3, "auto", "one rank per node", 0),  # leaders not a power of two: one folds into another
        (4, 2, "process_group", "gloo", 0),
        # The leaders' sparse exchange (a header of 3 pairs, the whole vector where more words are set),
        # with a fold (5 leaders) and without (4).
        (5, 5, "auto", "one rank per node", 3),
        (8, 4, "auto", "shared memory", 3),
    ],
)
def test_hierarchical_and_gloo_agree_on_every_round_with_late_arrivals(world, nodes, local_leg, within, sparse_pairs):
    seed = 31 + nodes
    per_rank = run_multiprocess(
        _hierarchical_and_gloo, world_size=world, nodes=nodes, args=(seed, local_leg, sparse_pairs), timeout_s=180
    )
    length = 1 + SLOTS * world
    make = _sparse_vector if sparse_pairs else _vector
    expected = [
        np.max([make(seed, rank, r, length) for rank in range(world)], axis=0).tolist() for r in range(ROUNDS)
    ]
    for rank, result in enumerate(per_rank):
        assert result["name"] == "hierarchical", result["described"]
        assert f"{nodes} nodes of {world // nodes} rank(s), {within}" in result["described"], result["described"]
        assert result["pg"] == expected, f"rank {rank}: gloo all-reduce differs from the element-wise max"
        assert result["hier"] == expected, f"rank {rank}: hierarchical round differs from the element-wise max"


def _groups_after_hierarchical(rank: int, world: int) -> list[float]:
    import torch
    import torch.distributed as dist

    sums = []
    for _ in range(2):  # the second consensus reuses the groups the first made
        consensus = Consensus.create(transport="auto")
        assert consensus.transport_name == "hierarchical"
        everyone = dist.new_group(backend="gloo")  # as the ledger's exchange group is made after it
        value = torch.ones(1)
        dist.all_reduce(value, group=everyone)
        sums.append(float(value.item()))
        consensus.close()
    return sums


@pytest.mark.multiproc
@pytest.mark.torch_versions
def test_a_group_over_every_rank_made_after_the_hierarchical_consensus_works_on_every_torch():
    """Each rank makes only its own groups (locally synchronized); torch 2.15 counts those in the names of
    the groups made after, so leaders and the others must make as many (a world group hung there before)."""
    per_rank = run_multiprocess(_groups_after_hierarchical, world_size=4, nodes=2, timeout_s=90)
    assert per_rank == [[4.0, 4.0]] * 4


@pytest.mark.multiproc
@pytest.mark.parametrize("nodes", [2, 4])
def test_consensus_protocol_same_verdict_on_several_nodes(nodes):
    per_rank = run_multiprocess(_consensus_protocol, world_size=4, nodes=nodes, args=("auto",), timeout_s=60)
    for rank, result in enumerate(per_rank):
        assert result["transport"] == "hierarchical", result
        assert result["failed_ranks"] == [1] and result["sites"] == ["backward"], result
        assert result["peak"] == 1003 and result["capacity"] == 4997, result
        assert result["clean_failed"] is False
    assert {r["syncs"] for r in per_rank} == {per_rank[0]["syncs"]}, "ranks ran different numbers of rounds"


def _one_rank_exits(rank: int, world: int, victim: int, timeout_s: float) -> str:
    from automicro.core.transport import TransportTimeout

    consensus = Consensus.create(transport="auto")
    vec = np.zeros(1 + SLOTS * world, dtype=np.int64)
    for _ in range(5):
        consensus.transport.max_reduce(vec.copy())
    if rank == victim:
        os._exit(7)
    started = time.monotonic()
    try:
        consensus.transport.max_reduce(vec.copy(), timeout_s=timeout_s)
    except TransportTimeout as error:
        return f"{time.monotonic() - started:.1f}|{error}"
    return "no error"


@pytest.mark.multiproc
@pytest.mark.parametrize("victim,role", [(3, "non-leader"), (2, "leader")])
def test_hierarchical_round_names_a_rank_that_exited_on_every_other_rank(victim, role):
    from automicro.testing.multiprocess import MultiprocessFailure

    with pytest.raises(MultiprocessFailure) as failure:
        run_multiprocess(
            _one_rank_exits, world_size=4, nodes=2, args=(victim, 60.0), timeout_s=60, failure_grace_s=30
        )
    results = failure.value.results
    assert sorted(results) == sorted(set(range(4)) - {victim}), failure.value
    leader = ", its leader" if role == "leader" else ""
    for rank, text in results.items():
        seconds, message = text.split("|", 1)
        assert f"rank {victim} (node 1{leader}) exited" in message, (rank, message)
        assert float(seconds) < 20, f"rank {rank} took {seconds} s to name the rank that exited"


def _one_rank_late(rank: int, world: int, late: int) -> str:
    from automicro.core.transport import TransportTimeout

    consensus = Consensus.create(transport="auto")
    vec = np.zeros(1 + SLOTS * world, dtype=np.int64)
    consensus.transport.max_reduce(vec.copy())
    if rank == late:
        time.sleep(8)  # stuck elsewhere; arrives long after the others gave up
    try:
        consensus.transport.max_reduce(vec.copy(), timeout_s=2.0)
    except TransportTimeout as error:
        return str(error)
    return "no error"


@pytest.mark.multiproc
def test_hierarchical_round_times_out_naming_the_late_rank_everywhere():
    per_rank = run_multiprocess(_one_rank_late, world_size=4, nodes=2, args=(1,), timeout_s=90)
    for rank, message in enumerate(per_rank):
        assert "rank 1 (node 0) did not reach the round in time" in message, (rank, message)


def test_finish_time_and_rounds_are_counted_for_dashboards():
    consensus = Consensus()  # one rank: every round is local
    assert consensus.finish_seconds == 0.0 and consensus.sync_count == 0
    consensus.begin_attempt()
    consensus.sync()
    verdict = consensus.finish(LocalFigures())
    assert not verdict.failed
    assert consensus.sync_count == 2
    assert consensus.finish_seconds > 0.0
