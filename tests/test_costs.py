"""The suite's costs as data: what each run measures per test file and launch (`tests/costs.py`), the
prediction that sizes a run on a slower machine and the report `.ci/run` prints (`.ci/costs.py`), the
launch share drawn per file (`tests/matrix.share_of`). No launches."""

from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import pytest

from tests import costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ci_costs():
    spec = importlib.util.spec_from_file_location("ci_costs", os.path.join(ROOT, ".ci", "costs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_phase_of_a_test_is_charged_to_its_file_and_its_launch_and_the_costliest_come_first(monkeypatch, tmp_path):
    monkeypatch.setattr(costs, "_seconds", costs.defaultdict(float))
    monkeypatch.setattr(costs, "_launches", costs.defaultdict(lambda: costs.defaultdict(float)))
    monkeypatch.setattr(costs, "LAUNCH_OF", {"tests/b.py::C::t2[x]": "fixture two_ranks", "tests/a.py::t4": "test t4"})
    for nodeid, duration in [("tests/a.py::t1", 2.0), ("tests/a.py::t1", 0.5), ("tests/b.py::C::t2[x]", 4.0),
                             ("tests/c.py::t3", 0.25), ("tests/a.py::t4", 1.0)]:
        costs.record(SimpleNamespace(nodeid=nodeid, duration=duration))
    assert costs.costliest(costs._seconds, 2) == [("tests/b.py", 4.0), ("tests/a.py", 3.5)]
    out = tmp_path / "legs" / "leg1.json"
    monkeypatch.setenv("AUTOMICRO_COSTS_OUT", str(out))
    lines = costs.summary_lines()
    assert lines[0].startswith("test costs: 8 s over 3 files (written to ") and "3.5 s  tests/a.py" in lines[2], lines
    assert json.loads(out.read_text()) == {
        "files": {"tests/a.py": 3.5, "tests/b.py": 4.0, "tests/c.py": 0.2},
        "launches": {"tests/a.py": {"": 2.5, "test t4": 1.0}, "tests/b.py": {"fixture two_ranks": 4.0}, "tests/c.py": {"": 0.2}},
    }


def test_the_report_gives_the_total_against_the_budget_each_legs_change_and_the_costliest_files(tmp_path):
    ci = _ci_costs()
    (tmp_path / "leg1.json").write_text(json.dumps({"tests/a.py": 100.0, "tests/b.py": 300.0}))
    (tmp_path / "leg2.json").write_text(json.dumps({"tests/a.py": 50.0}))
    before = {"legs": {"leg1": {"tests/a.py": 90.0, "tests/b.py": 250.0}}}
    lines = ci.report(ci.read_legs(str(tmp_path)), 2500, 2400, before)
    assert lines[0] == "costs: .ci/run 2500 s against a budget of 2400 s: OVER by 100 s", lines
    assert lines[1] == "costs: leg1: 400 s of tests over 2 files (recorded 340 s: +60 s)", lines
    assert lines[2] == "costs: leg2: 50 s of tests over 1 files", lines
    assert [line.split()[-2:] for line in lines[4:]] == [["leg1", "tests/b.py"], ["leg1", "tests/a.py"], ["leg2", "tests/a.py"]]
    assert ci.report({"leg1": {"x": 1.0}}, 2300, 2400, {})[0].endswith(": within")


def test_update_records_the_legs_their_launches_and_the_steps_in_the_repo_file(tmp_path, monkeypatch):
    ci = _ci_costs()
    monkeypatch.setattr(ci, "RECORDED", str(tmp_path / "costs.json"))
    assert ci.main(["update", str(tmp_path / "nothing")]) == 1  # no leg files: nothing written
    assert not (tmp_path / "costs.json").exists()
    (tmp_path / "legs").mkdir()
    (tmp_path / "legs" / "leg3.json").write_text(json.dumps({"files": {"tests/a.py": 12.5}, "launches": {"tests/a.py": {"test t": 12.5}}}))
    (tmp_path / "legs" / "steps.json").write_text(json.dumps({"docs": 60, "leg3": 20.0, "calibration": 3.0}))
    (tmp_path / "legs" / "speed.json").write_text(json.dumps({"calibration_s": 2.5, "share": 0.5}))
    assert ci.main(["update", str(tmp_path / "legs")]) == 1  # half the launches: the rest would drop out
    assert not (tmp_path / "costs.json").exists()
    (tmp_path / "legs" / "speed.json").write_text(json.dumps({"calibration_s": 2.5, "share": 1.0}))
    assert ci.main(["update", str(tmp_path / "legs")]) == 0
    doc = json.loads((tmp_path / "costs.json").read_text())
    assert doc["legs"] == {"leg3": {"tests/a.py": 12.5}} and doc["launches"] == {"leg3": {"tests/a.py": {"test t": 12.5}}}
    assert doc["steps"] == {"docs": 60.0, "leg3": 20.0, "calibration": 3.0} and doc["calibration_s"] == 2.5
    assert ci.speed_factor(doc, 5.0) == 2.0
    # The whole: the docs, the calibration, leg 3's start-up (20 - 12.5 s) and its tests.
    assert ci.predicted_s(doc) == pytest.approx(60 + 3 + 7.5 + 12.5)


def _recorded_gate() -> dict:
    """A recorded run: 1,000 s of fixed steps; a leg whose two files launch 4 and 1 times (100 s each) beside 50 s of
    tests that launch nothing."""
    return {
        "steps": {"docs": 100.0, "venv": 800.0, "calibration": 5.0, "venvs_wait": 95.0, "leg1": 1550.0}, "calibration_s": 5.0,
        "legs": {"leg1": {"tests/test_a.py": 450.0, "tests/test_b.py": 100.0}},
        "launches": {"leg1": {"tests/test_a.py": {"": 50.0, "fixture x": 100.0, "test p[1]": 100.0, "test p[2]": 100.0,
                                                  "test q": 100.0},
                              "tests/test_b.py": {"test r": 100.0}}},
    }


def test_a_machine_as_fast_as_the_recorded_one_draws_every_launch():
    ci = _ci_costs()
    doc = _recorded_gate()
    assert ci.speed_factor(doc, 5.0) == 1.0
    assert ci.predicted_s(doc) == pytest.approx(1000 + 1000 + 550)  # steps, leg 1's start-up, its tests
    assert ci.choose_share(doc, 0.9, recorded_s=2600) == (1.0, pytest.approx(0.9 * 2550))
    # The recorded cost must fit 30 minutes (`RECORDED_BUDGET_S`) whatever today's machine: this one cannot.
    assert ci.choose_share(doc, 0.5, recorded_s=2400)[0] < 1.0


def test_the_share_is_the_commits_the_largest_step_that_fits_30_minutes_at_the_recorded_speed():
    ci = _ci_costs()
    doc = _recorded_gate()  # 2,550 s at every launch; 2,350 s at half of test_a.py's; 2,250 s at one launch a file
    assert ci.RECORDED_BUDGET_S == 1800 and ci.BUDGET_S == 2400 and ci.SLOW_LIMIT_S == 3600
    assert ci.commit_share(doc, recorded_s=2400) == 0.5
    assert ci.choose_share(doc, 1.0, recorded_s=2400) == (0.5, pytest.approx(2350))
    assert ci.commit_share(doc, recorded_s=2000) == ci.SHARES[-1]  # none fits: the smallest
    # Faster or slower machines draw the commit's share; only one whose prediction at it is over an hour steps down.
    assert ci.choose_share(doc, 1.1, recorded_s=2400) == (0.5, pytest.approx(1.1 * 2350))
    assert ci.choose_share(doc, 1.6, recorded_s=2400) == (0.25, pytest.approx(1.6 * 2250))


def test_a_newer_torch_leg_draws_its_share_of_a_file_leg_1_runs_maybe_none_and_keeps_one_of_a_file_only_it_runs():
    ci = _ci_costs()
    doc = _recorded_gate()
    doc["legs"]["leg2"] = {"tests/test_a.py": 250.0, "tests/test_only_leg2.py": 100.0}
    doc["launches"]["leg2"] = {"tests/test_a.py": {"": 50.0, "fixture x": 100.0, "test q": 100.0},
                               "tests/test_only_leg2.py": {"test t": 100.0}}
    doc["launches"]["leg1"]["tests/test_only_leg2.py"] = {"test t": 0.0}  # collected on leg 1, skipped there
    doc["steps"]["leg2"] = 400.0  # 50 s of start-up
    leg1 = 1000 + 1000 + 50
    # At share 0.25 leg 2 draws on average a quarter of test_a.py's two launches (leg 1 runs them too: maybe none),
    # and one of test_only_leg2.py's (no other leg runs it).
    assert ci.predicted_s(doc, 0.25) == pytest.approx(leg1 + 100 + 100 + 50 + 50 + 0.25 * 2 * 100 + 100)
    assert ci.predicted_s(doc) == pytest.approx(leg1 + 500 + 400)


def test_a_slower_machine_draws_a_smaller_share_of_each_files_launches_never_below_one_a_file():
    """Twice as slow: 5,100 s predicted at every launch, over the limit. Each share keeps at least one launch a file,
    and the tests that launch nothing always count; where even one launch a file does not fit, the smallest share is
    drawn."""
    ci = _ci_costs()
    doc = _recorded_gate()
    factor = ci.speed_factor(doc, 10.0)
    assert factor == 2.0
    share, prediction = ci.choose_share(doc, factor, limit_s=4700, recorded_s=2600)
    assert share < 1.0 and prediction <= 4700
    # At share 0.5, test_a.py draws 2 of its 4 launches, test_b.py its one: 300 s of launches instead of 500.
    assert ci.predicted_s(doc, 0.5) == pytest.approx(2000 + 50 + 200 + 100)
    # Never below one launch a file: the least any share predicts.
    floor = 2000 + 50 + 100 + 100
    assert all(ci.predicted_s(doc, s) >= floor for s in ci.SHARES)
    assert ci.choose_share(doc, factor, limit_s=100) == (ci.SHARES[-1], pytest.approx(2 * floor))


def test_the_launch_share_is_drawn_per_file_at_least_one_each_and_over_seeds_every_launch_runs(monkeypatch):
    from tests import matrix

    monkeypatch.setattr(matrix, "DRAWN", {})  # this run's own draws stay as they were (its summary line)
    monkeypatch.delenv(matrix.FULL_ENV, raising=False)  # a draw, also where this run takes every cell (--full, --every)
    launches = {"test_a.py": [f"launch {i}" for i in range(8)], "test_b.py": ["only"]}
    seen = set()
    for seed in range(40):
        monkeypatch.setenv(matrix.SEED_ENV, str(seed))
        taken = matrix.share_of("launch share", launches, 0.25)
        assert sum(1 for file, _ in taken if file == "test_a.py") == 2 and ("test_b.py", "only") in taken
        seen |= taken
    assert seen == {(file, launch) for file, row in launches.items() for launch in row}
    assert len(matrix.share_of("launch share", launches, 1.0)) == 9


def test_on_a_newer_torch_leg_a_file_leg_1_runs_may_draw_none_each_launch_with_the_share_as_its_chance(monkeypatch):
    from tests import matrix

    monkeypatch.setattr(matrix, "DRAWN", {})
    monkeypatch.delenv(matrix.FULL_ENV, raising=False)
    launches = {"test_a.py": [f"launch {i}" for i in range(3)], "test_b.py": ["only"], "test_titan.py": ["t"]}
    counts, seen = {"test_a.py": 0, "test_b.py": 0}, set()
    for seed in range(400):
        monkeypatch.setenv(matrix.SEED_ENV, str(seed))
        taken = matrix.share_of("launch share", launches, 0.25, elsewhere={"test_a.py", "test_b.py"})
        assert ("test_titan.py", "t") in taken  # not elsewhere: at least one
        drawn_a = sum(1 for file, _ in taken if file == "test_a.py")
        assert drawn_a in (0, 1)  # 0.75 launches on average, rounded down or up
        counts["test_a.py"] += drawn_a
        counts["test_b.py"] += ("test_b.py", "only") in taken
        seen |= taken
    assert seen == {(file, launch) for file, row in launches.items() for launch in row}
    assert 0.6 * 400 < counts["test_a.py"] < 0.9 * 400  # 0.75 a run
    assert 0.15 * 400 < counts["test_b.py"] < 0.35 * 400  # 0.25 a run
    with pytest.raises(ValueError, match="expected a number in \\(0, 1\\]"):
        matrix.parse_fraction("0")


def test_every_test_file_has_its_recorded_cost_and_no_recorded_file_is_gone():
    """`tests/costs.json` is the cost a change adds to: a new test file records its cost with it
    (`python3 .ci/costs.py update .ci-costs` after a `.ci/run`), a deleted one leaves."""
    legs = _ci_costs().recorded()["legs"]  # leg 1 runs every file but torchtitan's (leg 3 only: a skipped module)
    recorded = {file: seconds for leg in legs.values() for file, seconds in leg.items()}
    files = {f"tests/{name}" for name in os.listdir(os.path.join(ROOT, "tests")) if name.startswith("test_") and name.endswith(".py")}
    assert sorted(files - set(recorded)) == [], "test files with no recorded cost: run .ci/run, then .ci/costs.py update .ci-costs"
    assert sorted(set(recorded) - files) == [], "recorded costs of test files that are gone: update tests/costs.json"
    assert all(seconds >= 0 for seconds in recorded.values())


def test_the_full_suite_deals_the_files_costliest_first_into_parts_of_about_equal_cost(tmp_path, monkeypatch, capsys):
    """scripts/full_suite.sh's order and parts (`.ci/costs.py files [K/N]`): every file in exactly one
    part, each part costliest first (pytest-xdist starts the longest first), the parts within one
    file's cost of each other; a file's cost from the last full run, else the gate's leg 1, else
    UNKNOWN_S; a bad K/N says what to write."""
    ci = _ci_costs()
    costs = ci.file_costs(["a", "b", "c", "d", "e"], {"files": {"a": 300.0, "b": 10.0}}, {"legs": {"leg1": {"b": 99.0, "c": 50.0}}})
    assert costs == {"a": 300.0, "b": 10.0, "c": 50.0, "d": ci.UNKNOWN_S, "e": ci.UNKNOWN_S}
    many = {f"t{i}": float(s) for i, s in enumerate([400, 250, 200, 120, 90, 60, 30, 30, 10, 5, 1])}
    parts = [ci.deal(many, k, 3) for k in (1, 2, 3)]
    assert sorted(name for part in parts for name in part) == sorted(many)
    for part in parts:
        assert [many[name] for name in part] == sorted((many[name] for name in part), reverse=True)
    loads = [sum(many[name] for name in part) for part in parts]
    assert max(loads) - min(loads) <= max(many.values()), loads
    assert ci.deal(many, 1, 1)[0] == "t0" and len(ci.deal(many, 1, 1)) == len(many)
    assert ci.main(["files", "3/2"]) == 2 and "K must be between 1 and N" in capsys.readouterr().err
    assert ci.main(["files", "half"]) == 2 and "write K/N" in capsys.readouterr().err
    assert ci.main(["files"]) == 0
    listed = capsys.readouterr().out.split()
    assert sorted(listed) == ci.test_files() and "tests/test_costs.py" in listed
    monkeypatch.setattr(ci, "RECORDED_FULL", str(tmp_path / "costs_full.json"))
    (tmp_path / "run.json").write_text(json.dumps({"tests/a.py": 12.5}))
    assert ci.main(["update-full", str(tmp_path / "run.json")]) == 0
    assert json.loads((tmp_path / "costs_full.json").read_text())["files"] == {"tests/a.py": 12.5}


# ---- the run CI makes is the run anyone can make first; a failure says itself last -----------------------------


def test_a_commit_gives_one_seed_on_every_machine_and_another_commit_another():
    ci = _ci_costs()
    commit = "61b4c25a9d0e0c7f1f3d3a2b4c5d6e7f8a9b0c1d"
    assert ci.seed_of(commit) == ci.seed_of(commit + "\n") == int("61b4c25a", 16) % 2**31
    assert ci.seed_of(commit) != ci.seed_of("0c4068d" + commit[7:])
    assert 0 <= ci.seed_of("f" * 40) < 2**31
    with pytest.raises(ValueError, match="is not a commit"):
        ci.seed_of("HEAD")


def test_the_share_moves_in_three_fixed_steps_and_not_with_a_calibrations_noise():
    """The recorded gate drawn at a step (0.5 here): machines from 2.5 times faster to 1.5 times slower than the
    recorded one (calibrations seen on CI and development machines differ by 1.7x) draw the same step, so a run of a
    commit here draws what CI draws for it; only a machine whose prediction at it is over an hour moves it down."""
    ci = _ci_costs()
    assert ci.SHARES == (1.0, 0.5, 0.25)
    doc = _recorded_gate()
    drawn = {ci.choose_share(doc, factor, recorded_s=2400)[0] for factor in (0.4, 0.8, 1.0, 1.2, 1.5)}
    assert drawn == {0.5} == {ci.commit_share(doc, recorded_s=2400)}
    assert ci.choose_share(doc, 1.6, recorded_s=2400)[0] == 0.25


def test_the_draw_of_one_seed_and_share_is_the_same_every_time(monkeypatch):
    from tests import matrix

    monkeypatch.setattr(matrix, "DRAWN", {})
    monkeypatch.delenv(matrix.FULL_ENV, raising=False)
    launches = {"test_a.py": [f"launch {i}" for i in range(9)], "test_b.py": ["x", "y", "z"]}
    monkeypatch.setenv(matrix.SEED_ENV, "1639236187")
    first = matrix.share_of("launch share", launches, 0.25)
    cells = matrix.sample("a matrix", [(site, who) for site in "abc" for who in (0, 1)])
    for _ in range(3):
        assert matrix.share_of("launch share", launches, 0.25) == first
        assert matrix.sample("a matrix", [(site, who) for site in "abc" for who in (0, 1)]) == cells


def test_a_failing_test_is_said_last_with_its_line_its_error_and_the_command_that_repeats_it(tmp_path, monkeypatch):
    """`tests/failures.py` keeps each failed phase with the place in the test's own file it failed; `.ci/failures.py`
    prints every leg's, the repeat command and the seed as `.ci/run`'s last lines."""
    import subprocess
    import sys

    from tests import failures

    monkeypatch.setattr(failures, "_failed", [])
    out = tmp_path / "failures-leg1.jsonl"
    monkeypatch.setenv("AUTOMICRO_FAILURES_OUT", str(out))
    monkeypatch.setenv("AUTOMICRO_TEST_SEED", "12345")
    entry = SimpleNamespace(reprfileloc=SimpleNamespace(path="tests/test_x.py", lineno=42, message="AssertionError"))
    deeper = SimpleNamespace(reprfileloc=SimpleNamespace(path="automicro/core/x.py", lineno=7, message="AssertionError"))
    longrepr = SimpleNamespace(reprcrash=SimpleNamespace(message="AssertionError: (['a consensus round'], 'the line')\nmore",
                                                         path="automicro/core/x.py", lineno=7),
                               reprtraceback=SimpleNamespace(reprentries=[entry, deeper]))
    failures.record(SimpleNamespace(failed=True, nodeid="tests/test_x.py::test_y[compile]", when="call", longrepr=longrepr))
    failures.record(SimpleNamespace(failed=False, nodeid="tests/test_x.py::test_z", when="call", longrepr=None))
    config = SimpleNamespace(getoption=lambda name: name == "--every")
    lines = failures.summary_lines(config)
    assert lines[0] == ("FAILED tests/test_x.py::test_y[compile] (call) at tests/test_x.py:42: "
                        "AssertionError: (['a consensus round'], 'the line')"), lines
    assert lines[1] == "failed: 1 test(s); seed 12345", lines
    assert lines[2].startswith("repeat: AUTOMICRO_TEST_SEED=12345 ") and lines[2].endswith(
        " -m pytest --every 'tests/test_x.py::test_y[compile]'"), lines
    printed = subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "failures.py"), str(tmp_path), "12345", "leg1"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert printed[0] == ("=== FAILED [leg1] tests/test_x.py::test_y[compile] (call) at tests/test_x.py:42: "
                          "AssertionError: (['a consensus round'], 'the line')"), printed
    assert printed[1].startswith("=== repeat leg1's failures: AUTOMICRO_TEST_SEED=12345 "), printed
    assert printed[-2:] == ["=== .ci/run failed in step leg1: 1 failing test(s) above",
                            "=== AUTOMICRO_TEST_SEED=12345 (AUTOMICRO_TEST_SEED=12345 .ci/run repeats this run's draws)"]
    quiet = subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "failures.py"), str(tmp_path / "none"), "7", ""],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert quiet == ["=== AUTOMICRO_TEST_SEED=7 (AUTOMICRO_TEST_SEED=7 .ci/run repeats this run's draws)"]


def test_the_flake_hunt_counts_each_tests_passes_and_failures_over_its_rounds(tmp_path):
    """scripts/test_repeat.py reads each round's JUnit file: a failure or an error in any phase fails the test in that
    round; the table lists the tests that failed in some round."""
    spec = importlib.util.spec_from_file_location("test_repeat", os.path.join(ROOT, "scripts", "test_repeat.py"))
    repeat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repeat)
    rounds = []
    for index, bad in enumerate(("failure", None, "error")):
        xml = tmp_path / f"round-{index}.xml"
        fault = f"<{bad} message='x'/>" if bad else ""
        xml.write_text("<testsuites><testsuite>"
                       f"<testcase classname='tests.test_w' name='test_stall[compile]'>{fault}</testcase>"
                       "<testcase classname='tests.test_w.TestC' name='test_ok'/>"
                       "<testcase classname='tests.test_w' name='test_skipped'><skipped/></testcase>"
                       "</testsuite></testsuites>")
        rounds.append(repeat.outcomes(str(xml)))
    counts = repeat.tally(rounds)
    assert counts["tests/test_w.py::test_stall[compile]"] == {"passed": 1, "failed": 2, "skipped": 0, "missing": 0}
    assert counts["tests/test_w.py::TestC::test_ok"] == {"passed": 3, "failed": 0, "skipped": 0, "missing": 0}
    table = repeat.table(counts, 3, 2, [10.0, 11.0, 12.0])
    assert table[1].split() == ["1", "2", "tests/test_w.py::test_stall[compile]"], table
    assert table[-1].startswith("repeat: 2 tests that launch processes, 3 round(s) each beside 2 busy process(es)") and \
        table[-1].endswith(": 1 failed in some round; 1 skipped in every round"), table
