"""The control-plane simulator (`automicro.core.control_sim`): its rounds are the real code's,
its cost model matches the measured 16-128-rank runs, and its projection to 16,384 ranks runs in seconds.

The measured runs are those of many ranks on one machine (`docs/results/2026-11-29-many-ranks/call5/mr/w*.json`: `benchmarks/many_ranks.py`
on nvidia-h200's 16 CPU cores, torch 2.11). A live cross-check runs the benchmark itself on 4 CPU ranks as
2 simulated hosts (under a hang timeout) and compares its attempts and rounds with the simulation's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from automicro.core import control_sim
from automicro.core.control_sim import ONE_MACHINE, Links, Simulation, leader_exchanges, project, store_ops
from tests.launch import REPO, run

MEASURED = REPO / "docs" / "results" / "2026-11-29-many-ranks" / "call5" / "mr"
WORLDS = (16, 32, 64, 128)


def _measured(world: int) -> dict:
    return json.loads((MEASURED / f"w{world}.json").read_text())["hierarchical"]


def _simulated(world: int, per_node: int = 8, reruns: int = 5) -> tuple:
    sim = Simulation(world, per_node)
    found = sim.search_until_steady(ONE_MACHINE)
    again = [sim.steady_rerun(ONE_MACHINE, n) for n in range(reruns)]
    return found, again


@pytest.mark.parametrize("world", WORLDS)
def test_the_simulation_takes_the_measured_runs_decisions_and_rounds(world):
    """Same seeds, the same policy and protocol: the same attempts, OOMs, size and rounds as the measured
    run on `world` ranks (the rounds come from the witness threads, not from a formula)."""
    measured = _measured(world)
    found, again = _simulated(world)
    assert (found.attempts, found.ooms, found.found, found.rounds) == (
        measured["search"]["attempts"], measured["search"]["ooms"], measured["search"]["found"], measured["search"]["rounds"]
    )
    assert statistics.median(r.rounds for r in again) == measured["steady_rerun"]["rounds"]


@pytest.mark.parametrize("world", WORLDS)
def test_the_cost_model_is_within_20_percent_of_each_measured_point(world):
    """A round's median and a whole search's seconds at every measured world; the steady-state rerun at
    32-128 ranks. At 16 ranks the measured rerun took 20 ms over 76 rounds (270 us a round, against
    372 us a round in the search of the same run): the model, one cost per round, puts it 41% above;
    it is checked to stay within 45% there."""
    measured = _measured(world)
    found, again = _simulated(world)
    round_s = ONE_MACHINE.round_s(world)  # the whole vector: the measured runs predate the leaders' sparse header
    assert round_s == pytest.approx(measured["round_median_us"] * 1e-6, rel=0.20)
    assert found.seconds == pytest.approx(measured["search"]["seconds"], rel=0.20)
    rerun_s = statistics.median(r.seconds for r in again)
    assert rerun_s == pytest.approx(measured["steady_rerun"]["median_s"], rel=0.20 if world > 16 else 0.45)


def test_the_simulation_matches_a_live_run_of_the_benchmark(tmp_path):
    """`benchmarks/many_ranks.py` on 4 CPU ranks as 2 hosts of 2 (real gloo, shared memory, the real
    fence) and the simulation of the same world: the same attempts, OOMs, size, rounds."""
    done = run([sys.executable, "benchmarks/many_ranks.py", "--out", str(tmp_path), "--worlds", "4", "--per-node", "2",
                "--transports", "hierarchical", "--searched", "1", "--rounds", "20", "--reruns", "3", "--timeout", "150"],
               timeout_s=200)
    assert done.returncode == 0, done.stdout[-3000:]
    live = json.loads((tmp_path / "w4.json").read_text())["hierarchical"]
    found, again = _simulated(4, per_node=2, reruns=3)
    assert (found.attempts, found.ooms, found.found, found.rounds) == (
        live["search"]["attempts"], live["search"]["ooms"], live["search"]["found"], live["search"]["rounds"]
    )
    assert statistics.median(r.rounds for r in again) == live["steady_rerun"]["rounds"]


def test_a_hang_in_the_witness_protocol_is_an_error_not_a_hang(monkeypatch):
    """The witnesses run under a deadline: a rank that never reaches the consensus is an error."""
    sim = Simulation(8)
    monkeypatch.setattr(control_sim, "run_attempt", lambda *a, **k: __import__("time").sleep(3600))
    monkeypatch.setattr(control_sim.threading.Thread, "join", lambda self, timeout=None: None)
    with pytest.raises(RuntimeError, match="hung"):
        sim.search_until_steady(ONE_MACHINE)


def test_leader_exchanges_follow_recursive_doubling():
    assert [leader_exchanges(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 512, 2048)] == [0, 1, 3, 2, 4, 3, 5, 4, 9, 11]


def test_the_projection_to_16384_ranks_meets_the_goals_at_4096_and_names_what_grows():
    """Hosts of 8, the pessimistic public hop: a round at 4,096 ranks within 10 ms (a sync round and a
    finish round alike), a search within 1% of a 1,000-batch run (1 s a batch). What grows: a finish
    round carries every rank's figures (8 words a rank), so at 16,384 ranks it costs more than three
    times one at 4,096; a sync round sends the leaders' header alone and stays under 10 ms there; a CPU
    group over every rank costs the store world x world requests; the groups each rank now makes only
    for itself cost nodes x 64 + nodes^2, far below the old every-node groups."""
    rows = {r["world"]: r for r in project()}
    assert set(rows) == {512, 4096, 16384}
    assert rows[4096]["round_ms"] <= 10.0 and rows[4096]["finish_round_ms"] <= 10.0
    assert rows[4096]["search_share_of_1000_batches"] <= 0.01
    assert rows[16384]["finish_round_ms"] > 3 * rows[4096]["finish_round_ms"]
    assert rows[16384]["round_ms"] <= 10.0
    assert 0 < rows[16384]["search_dense_rounds"] < rows[16384]["search_rounds"] / 10
    ops = store_ops(16384)
    assert ops["world_group"] == 16384**2
    assert ops["own_groups"] < ops["every_node_group"] / 10
    optimistic = {r["world"]: r for r in project(hop="optimistic")}
    assert optimistic[4096]["round_ms"] < rows[4096]["round_ms"]


def test_a_round_grows_with_hops_and_bytes():
    links = Links(node_s=0.0, hop_s=1e-4, link_bytes_per_s=1e12, memory_bytes_per_s=1e15)
    assert links.round_s(16) == pytest.approx(1 * 1e-4, rel=1e-3)  # 2 hosts: one exchange
    assert links.round_s(64) == pytest.approx(3 * 1e-4, rel=1e-3)  # 8 hosts: three
    heavy = Links(node_s=0.0, hop_s=0.0, link_bytes_per_s=1e6, memory_bytes_per_s=1e15)
    assert heavy.round_s(64) == pytest.approx(3 * control_sim.vector_bytes(64) / 1e6, rel=1e-3)
    # A sync round's leaders send the header where the vector is longer (`hierarchical`'s sparse exchange).
    from automicro.core.hierarchical import _RecursiveDoubling

    assert control_sim.HEADER_BYTES == 8 * (1 + 2 * _RecursiveDoubling.SPARSE_PAIRS)
    assert heavy.round_s(64, dense=False) == pytest.approx(3 * control_sim.HEADER_BYTES / 1e6, rel=1e-3)
    assert heavy.round_s(8, dense=False) == heavy.round_s(8)  # a short vector goes whole
