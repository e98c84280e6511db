"""The benchmark harness (benchmarks/harness.py): interleaving order, statistics, the verdict rule,
the GPU-busy arithmetic, and one real CPU run of a suite through it (benchmarks/vs_plain.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import harness  # noqa: E402
from tests.launch import python_path  # noqa: E402


def test_schedule_is_a_b_a_b():
    assert harness.schedule(["A", "B"], 3) == [(0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B")]
    assert harness.schedule(["A", "B", "C"], 2) == [(0, "A"), (0, "B"), (0, "C"), (1, "A"), (1, "B"), (1, "C")]
    with pytest.raises(ValueError):
        harness.schedule(["A", "A"], 3)
    with pytest.raises(ValueError):
        harness.schedule(["A", "B"], 0)


def test_interleave_runs_measures_in_schedule_order_and_keeps_rounds():
    calls = []

    def measure(name):
        def one(round_index):
            calls.append(f"{name}{round_index}")
            return {"step_s": {"A": 1.0, "B": 2.0}[name] + round_index}

        return one

    samples = harness.interleave({"A": measure("A"), "B": measure("B")}, 3)
    assert calls == ["A0", "B0", "A1", "B1", "A2", "B2"]
    assert [s["step_s"] for s in samples["A"]] == [1.0, 2.0, 3.0]
    assert [s["round"] for s in samples["B"]] == [0, 1, 2]


def test_interleave_launches_alternates_launches():
    launched = []

    def fake_launcher(argv, timeout):
        launched.append(" ".join(argv))
        return subprocess.CompletedProcess(argv, 0)

    samples = harness.interleave_launches(
        {"A": lambda r: ["run", "A", str(r)], "B": lambda r: ["run", "B", str(r)]}, 3,
        read=lambda name, r: {"step_s": 1.0}, launcher=fake_launcher)
    assert launched == ["run A 0", "run B 0", "run A 1", "run B 1", "run A 2", "run B 2"]
    assert [s["returncode"] for s in samples["A"]] == [0, 0, 0]


def test_spread_median_quartiles_and_range():
    s = harness.spread([3.0, 1.0, 2.0, 4.0])
    assert s["n"] == 4 and s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0
    assert s["q1"] == pytest.approx(1.75) and s["q3"] == pytest.approx(3.25)
    assert s["range_rel"] == pytest.approx(3.0 / 2.5)
    assert harness.spread([None, float("nan"), 2.0])["n"] == 1
    assert harness.spread([])["median"] is None


def test_ratio_is_paired_per_round():
    c = harness.compare([1.0, 2.0, 4.0], [1.1, 2.2, 4.4])  # drifting host, constant 10% effect
    assert c["ratios"] == pytest.approx([1.1, 1.1, 1.1])
    assert c["median"] == pytest.approx(1.1) and c["range"] == pytest.approx(0.0)
    assert c["verdict"] == "claimed"
    # a missing round is skipped, not paired with the next one
    assert harness.paired_ratios([1.0, None, 2.0], [1.5, 9.0, 3.0]) == pytest.approx([1.5, 1.5])


@pytest.mark.parametrize("ratios, expected", [
    ([1.10, 1.12, 1.11], "claimed"),        # range 0.02 < effect 0.11
    ([0.95, 0.96, 0.94], "claimed"),        # a speed-up counts the same way
    ([0.90, 1.12, 1.05], "within noise"),   # rounds on both sides of 1
    ([1.01, 1.20, 1.02], "within noise"),   # all above 1, but range 0.19 > effect 0.02
    ([1.05, 1.25, 1.15], "within noise"),   # range 0.20 > effect 0.15
    ([1.00, 1.00, 1.00], "within noise"),   # no effect at all
    ([1.30], "within noise"),               # one round has no spread
    ([], "within noise"),
])
def test_claimed_only_when_spread_is_smaller_than_effect(ratios, expected):
    assert harness.verdict(ratios) == expected


def test_median_interval_is_the_binomial_order_statistics():
    # n = 6 at 95%: only the extremes (2 * 1/64 < 0.05 <= 2 * 7/64); n = 5 is too few.
    assert harness.median_interval([3, 1, 2, 6, 5, 4]) == (1, 6)
    assert harness.median_interval(range(5)) is None
    # n = 40: the 14th and 27th smallest (the textbook table), whatever order they come in.
    assert harness.median_interval(reversed(range(40))) == (13, 26)
    # More confidence widens it; None and NaN samples are dropped.
    assert harness.median_interval(range(40), confidence=0.99) == (11, 28)
    assert harness.median_interval([None, float("nan"), *range(6)]) == (0, 5)


def test_report_per_variant_and_vs_base():
    samples = {
        "plain": [{"step_s": 1.00, "cpu_per_wall": 0.5}, {"step_s": 1.02, "cpu_per_wall": 0.7}, {"step_s": 0.98}],
        "auto": [{"step_s": 1.01}, {"step_s": 1.03}, {"step_s": 0.97}],
    }
    rep = harness.report(samples, base="plain")
    assert rep["variants"]["plain"]["median"] == pytest.approx(1.00)
    assert rep["variants"]["plain"]["rounds"] == [1.00, 1.02, 0.98]
    assert rep["variants"]["plain"]["cpu_per_wall"] == pytest.approx(0.6)
    assert "plain" not in rep["vs_base"]
    auto = rep["vs_base"]["auto"]
    assert auto["ratios"] == pytest.approx([1.01, 1.03 / 1.02, 0.97 / 0.98])
    assert auto["verdict"] == "within noise"
    rows = harness.comparison_rows(rep, "size-4")
    assert rows[0][1] == "plain" and rows[0][5] == "base"
    assert rows[1][6] == "within noise"


def test_gpu_busy_is_the_union_of_device_intervals():
    assert harness.union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert harness.union_seconds([]) == 0.0
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 1000},        # µs
        {"ph": "X", "cat": "kernel", "ts": 500, "dur": 1000},      # overlaps (another stream)
        {"ph": "X", "cat": "gpu_memcpy", "ts": 3000, "dur": 500},
        {"ph": "X", "cat": "cuda_runtime", "ts": 0, "dur": 9000},  # host side: not GPU time
        {"ph": "i", "cat": "kernel", "ts": 0},
    ]}
    got = harness.gpu_busy_from_trace(trace)
    assert got["gpu_events"] == 3
    assert got["gpu_busy_s"] == pytest.approx(0.002)
    assert got["gpu_span_s"] == pytest.approx(0.0035)
    assert harness.host_bound(0.85) is True
    assert harness.host_bound(0.95) is False
    assert harness.host_bound(None) is None


def test_table_lines_align():
    lines = harness.table_lines(["a", "bb"], [["xxx", None], [1, 22]])
    assert lines[0] == "a   bb"
    assert lines[1] == "--- --"
    assert lines[2] == "xxx -"


def test_vs_plain_suite_runs_interleaved_on_cpu(tmp_path):
    """One real run: tiny Llama, one gloo rank, plain Composer vs automicro hooks-off at size 2,
    3 rounds of 2-batch windows in each build order; the JSON must show the A B A B order, the
    reversed order, and the report over the pooled rounds."""
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vs_plain.py"), "--out", str(out), "--device", "cpu",
           "--tiny", "--sizes", "2", "--per-rank-batch", "4", "--window", "2", "--rounds", "3", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = python_path(ROOT)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "vs_plain.json").read_text())
    assert doc["done"] is True and doc["world_size"] == 1
    rep = doc["comparisons"]["size-2"]
    timed = [(w["order"], w["variant"]) for w in rep["windows"] if w["kind"] == "timed"]
    # A B A B A B, then counterbalanced: B built first, B A B A B A
    assert timed == [(0, "plain-2"), (0, "automicro-2")] * 3 + [(1, "automicro-2"), (1, "plain-2")] * 3
    assert [w["variant"] for w in rep["windows"] if w["kind"] == "warmup"] == ["plain-2", "automicro-2", "automicro-2", "plain-2"]
    assert rep["orders"] == [["plain-2", "automicro-2"], ["automicro-2", "plain-2"]]
    assert all(w["kind"] != "profiled" for w in rep["windows"])  # CPU: no GPU profile
    plain, auto = rep["variants"]["plain-2"], rep["variants"]["automicro-2"]
    assert len(plain["rounds"]) == 6 and all(s > 0 for s in plain["rounds"])
    assert plain["min"] <= plain["median"] <= plain["max"]
    cmp = rep["vs_base"]["automicro-2"]
    assert cmp["ratios"] == pytest.approx([a / p for p, a in zip(plain["rounds"], auto["rounds"])])
    assert cmp["verdict"] == harness.verdict(cmp["ratios"])
    assert [len(o["automicro-2"]["ratios"]) for o in rep["per_order"]] == [3, 3]
    assert auto["hooks_on_in_timed_windows"] == [False]  # the hooks came off in the warm-up window
    assert auto["rounds_per_batch"] == 1  # one end-of-batch consensus round left
    assert rep["models_freed"] is True
    assert "within noise" in (out / "vs_plain_table.txt").read_text() or "claimed" in (out / "vs_plain_table.txt").read_text()


# ---- the one runner (benchmarks/run.py) -------------------------------------------------------------


def _runner_args(**overrides):
    import argparse

    base = dict(out="/tmp/automicro-run-test", nproc=0, timeout=0.0, cpu=False, python=sys.executable, rest=[])
    return argparse.Namespace(**{**base, **overrides})


def test_every_suite_launches_files_that_exist_with_its_out_folder():
    import run as runner

    for name, suite in runner.SUITES.items():
        for cpu in (False, True) if suite.cpu else (False,):
            launches = suite.launches(_runner_args(cpu=cpu))
            assert launches, name
            for launch in launches:
                files = [a for a in launch.argv if a.endswith(".py")]
                assert files and all(os.path.exists(os.path.join(ROOT, f)) for f in files), (name, launch.argv)
                assert launch.timeout > 0, (name, launch.name)
                assert any("/tmp/automicro-run-test" in a for a in launch.argv), (name, launch.argv)
                if cpu and "--tiny" not in launch.argv:  # the CPU check never asks for a GPU
                    assert "--dry-run" in launch.argv or "--cpu-dry" in launch.argv or "--gpu" not in launch.argv, (name, launch.argv)


def test_runner_refuses_unknown_suites_and_cpu_checks_a_suite_lacks(tmp_path):
    import run as runner

    with pytest.raises(SystemExit, match="unknown suite"):
        runner.run(["nosuch", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no CPU check"):
        runner.run(["smoke", "--cpu", "--out", str(tmp_path)])


def test_runner_passes_args_after_the_separator_and_keeps_only_summary_lines():
    import run as runner

    (launch,) = runner.SUITES["one_gpu"].launches(_runner_args(rest=["--variants", "eager-auto"]))
    assert launch.argv[-2:] == ["--variants", "eager-auto"]
    text = "[one_gpu] | a table\n[one_gpu:detail] noise\n[automicro] a trainer line\n[rank0]: traceback\nplain\n[steady_oom] ok"
    assert runner._summary_lines(text) == ["[one_gpu] | a table", "[steady_oom] ok"]


def test_one_gpu_fixed_sizes_come_from_the_same_kinds_auto_run_and_a_torch_cap_is_told_to_nobody():
    import argparse

    import one_gpu

    auto = {"variant": "eager-auto_x", "steady_sizes": [16, 16, 8, 16, 4, 16]}  # size trials ran 8 and 4
    assert one_gpu.resolve_fixed("eager-fixed-found", [auto], "_x") == "eager-fixed-16"
    assert one_gpu.resolve_fixed("eager-fixed-half", [auto], "_x") == "eager-fixed-8"
    assert one_gpu.resolve_fixed("eager-fixed-half", [{"variant": "eager-auto_x", "steady_sizes": [1]}], "_x") == "eager-fixed-1"
    assert one_gpu.resolve_fixed("eager-fixed-12", [], "_x") == "eager-fixed-12"
    assert one_gpu.resolve_fixed("unshardpin-fixed-found@eager", [auto], "_x") == "unshardpin-fixed-16"
    assert one_gpu.resolve_fixed("fused-fixed-found+2@eager", [auto], "_x") == "fused-fixed-18"
    assert one_gpu.resolve_fixed("eager-fixed-found", [{"variant": "eager-auto_x", "error": "rc 1"}], "_x") is None
    with pytest.raises(SystemExit, match="blocks-auto earlier"):
        one_gpu.resolve_fixed("blocks-fixed-found", [auto], "_x")
    args = argparse.Namespace(batches=24, skip=14, fixed_batches=10, fixed_skip=4)
    assert one_gpu.batches_and_skip("eager-auto", args) == (24, 14)
    assert one_gpu.batches_and_skip("eager-fixed-8", args) == (10, 4)
    assert one_gpu.batches_and_skip("composercompile-auto", args) == (10, 4)
    with pytest.raises(SystemExit, match="resolve_fixed"):
        one_gpu.overrides("eager-fixed-found", argparse.Namespace(**vars(args), preset="1b", seq=8, batch=2, nproc=1,
                                                                  dry_run=True, memory_fraction=0, extra=""), "/tmp/x")
    # A card not all ours (--torch-fraction): nobody is told a fraction, so Composer's stock run cannot
    # raise the user's cap to --memory-fraction (the first capped Composer row of 2026-11-29 trained uncapped).
    gpu = dict(vars(args), preset="1b", seq=8, batch=2, nproc=1, dry_run=False, extra="")
    told = "callbacks.auto_microbatching.memory_fraction=0.95"
    assert told in one_gpu.overrides("composer-auto", argparse.Namespace(**gpu, memory_fraction=0.95, torch_fraction=0.0), "/tmp/x")
    for variant in ("composer-auto", "composercompile-auto", "blocks-auto"):
        capped = one_gpu.overrides(variant, argparse.Namespace(**gpu, memory_fraction=0.95, torch_fraction=0.3), "/tmp/x")
        assert not any("memory_fraction" in o for o in capped), capped
