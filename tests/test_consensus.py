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
    return {"shm": shm_results, "pg": pg_results, "leftovers": leftovers, "name": shm.name}


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
    # The segment is unlinked once every rank has mapped it: nothing is left in /dev/shm.
    assert not [p for p in per_rank[0]["leftovers"] if p.startswith("/dev/shm/automicro-consensus-")], per_rank[0]


def _consensus_protocol(rank: int, world: int, transport: str) -> dict:
    """Rank 1 fails at its third sync point; every other rank syncs until it hears of it."""
    consensus = Consensus.create(transport=transport)
    consensus.begin_attempt()
    figures = LocalFigures(peak_bytes=1000 + rank, capacity_bytes=5000 - rank)
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
        assert result["peak"] == 1001 and result["capacity"] == 4999, result
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


def test_shared_memory_refuses_several_hosts_and_other_architectures():
    here = ("node-a", "boot-1", "x86_64", "pid:[1]")
    assert shm_unavailable_reason([here, here]) is None or not os.path.isdir("/dev/shm")
    assert "2 hosts" in shm_unavailable_reason([here, ("node-b", "boot-2", "x86_64", "pid:[1]")])
    assert "aarch64" in shm_unavailable_reason([("n", "b", "aarch64", "p")] * 2)


def test_bad_transport_names_are_refused_with_the_choices():
    from automicro import AutoMicrobatching

    with pytest.raises(ValueError, match="consensus transport 'tcp'.*auto.*shm.*process_group"):
        Consensus.create(transport="tcp")
    with pytest.raises(ValueError, match="consensus_transport='tcp'.*'auto'.*'shm'.*'process_group'"):
        AutoMicrobatching(consensus_transport="tcp")
