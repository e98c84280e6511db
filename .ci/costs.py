#!/usr/bin/env python3
"""The gate's costs as data, and the prediction that sizes a run. Standard library only.

    python3 .ci/costs.py seed [COMMIT]                 # the run's seed, from the commit under test (HEAD)
    python3 .ci/costs.py predict SECONDS [LIMIT_S]     # SECONDS: this machine's calibration (.ci/calibrate.py);
                                                      # prints the speed factor against the recorded one, the
                                                      # commit's share of each file's launches (the largest step
                                                      # that fits 30 minutes at the recorded speed) and the whole
                                                      # .ci/run's prediction here; a step lower only where that
                                                      # prediction is over LIMIT_S (3600)
    python3 .ci/costs.py report DIR TOTAL_S BUDGET_S   # after .ci/run: the total against the budget, each step
                                                      # and leg against tests/costs.json, the costliest files
    python3 .ci/costs.py update DIR                    # tests/costs.json from a run's DIR (.ci-costs)
    python3 .ci/costs.py files [K/N]                   # the test files, costliest first (part K of N:
                                                      # dealt about equally by cost), for scripts/full_suite.sh
    python3 .ci/costs.py update-full FILE...           # tests/costs_full.json from scripts/full_suite.sh's
                                                      # costs.json (one per part)

DIR holds one ``LEG.json`` per leg (``{"files": {file: seconds}, "launches": {file: {launch: seconds}}}``,
written by `tests/costs.py` where ``AUTOMICRO_COSTS_OUT`` names it), ``steps.json`` (``{step: seconds}``: the docs,
the venvs, the calibration, each leg's wall time) and ``speed.json`` (``{"calibration_s": the calibration's own
seconds}``), both written by `.ci/run`. `tests/costs.json` keeps the last recorded run: ``{"legs": {LEG: {file: s}},
"launches": {LEG: {file: {launch: s}}}, "steps": {...}, "calibration_s": s, "measured": ...}``; `tests/test_gate.py`
holds the recorded gate to its budget.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDED = os.path.join(ROOT, "tests", "costs.json")
RECORDED_FULL = os.path.join(ROOT, "tests", "costs_full.json")
UNKNOWN_S = 120.0  # a file no run recorded yet: dealt early, as one of the costlier ones
BUDGET_S = 2400.0  # 40 minutes, CI's budget
# What the gate may cost at the recorded machine's speed: 30 minutes, so that a machine 1.33x slower still fits 40.
RECORDED_BUDGET_S = 1800.0
# A machine whose prediction at the commit's share is over this (twice the recorded budget, two thirds of CI's 90-minute
# hard limit) draws a step lower: far from the speeds CI and development machines show (1.5-2.6 s calibrations against
# a record of 1.54 s predict at most 1.7x), so the share does not move with an ordinary calibration's noise.
SLOW_LIMIT_S = 3600.0
MIN_SHARE = 0.25  # at the recorded machine's speed the gate draws at least this share within it: tests added are paid for
EVERY_TEST_LEG = "leg1"  # the leg that runs every test of the gate (torch 2.7); the others, the newer torch's share
# The launch shares: a few fixed steps. The commit's is a function of its recorded costs alone (`commit_share`), so a
# run of a commit draws, with the commit's seed, the launches CI draws for it.
SHARES = (1.0, 0.5, 0.25)
STEPS = "steps.json"
SPEED = "speed.json"
# Steps whose time is not tests: the docs build, the leg-1 venvs, the calibration, the wait for the newer
# legs' venvs; each leg's wall time less its tests is its own start-up (collection, imports).
FIXED_STEPS = ("docs", "venv", "calibration", "venvs_wait")


def _leg_doc(doc: dict[str, Any]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(files, launches) of a leg file; an older one holds ``{file: seconds}`` only (one launch-less group each)."""
    if "files" not in doc:
        files = {k: float(v) for k, v in doc.items()}
        return files, {k: {"": v} for k, v in files.items()}
    return ({k: float(v) for k, v in doc["files"].items()},
            {f: {g: float(v) for g, v in groups.items()} for f, groups in doc.get("launches", {}).items()})


def seed_of(commit: str) -> int:
    """The seed of a run of `commit` (40 or fewer hex digits): its first 8 digits as an int below 2**31, so two runs
    of one commit draw the same fault-matrix cells and launches (`tests/matrix.py`) on any machine."""
    digits = commit.strip()[:8]
    try:
        return int(digits, 16) % 2**31
    except ValueError:
        raise ValueError(f"{commit!r} is not a commit (hex digits, as `git rev-parse HEAD` prints)") from None


def head_commit() -> str:
    import subprocess

    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def read_run(folder: str) -> dict[str, Any]:
    """A run's DIR: {"legs": {leg: {file: s}}, "launches": {leg: {file: {launch: s}}}, "steps": {step: s}}."""
    out: dict[str, Any] = {"legs": {}, "launches": {}, "steps": {}}
    speed = _read(os.path.join(folder, SPEED))
    if speed.get("calibration_s"):
        out["calibration_s"] = float(speed["calibration_s"])
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        doc = _read(os.path.join(folder, name))
        if name == STEPS:
            out["steps"] = {k: float(v) for k, v in doc.items()}
            continue
        if name == SPEED:
            continue
        leg = name[: -len(".json")]
        out["legs"][leg], out["launches"][leg] = _leg_doc(doc)
    return out


def read_legs(folder: str) -> dict[str, dict[str, float]]:
    return read_run(folder)["legs"]


def predicted_s(doc: dict[str, Any], share: float = 1.0) -> float:
    """The whole run's seconds as recorded in `doc` (tests/costs.json's form), each file drawing `share` of its
    launches: the fixed steps, each leg's start-up, each file's tests without a launch, and of its launches the
    share's expected cost (the launches' mean cost times the count drawn: at least one, except on a newer torch leg
    for a file whose launches `EVERY_TEST_LEG` runs too, which draws `share` of them on average, maybe none)."""
    steps = doc.get("steps", {})
    total = sum(float(steps.get(step, 0.0)) for step in FIXED_STEPS)
    every = doc.get("launches", {}).get(EVERY_TEST_LEG, {})
    for leg, files in doc.get("legs", {}).items():
        launches = doc.get("launches", {}).get(leg, {})
        tests = 0.0
        for file, seconds in files.items():
            groups = launches.get(file) or {"": seconds}
            runs = {g: v for g, v in groups.items() if g}
            tests += groups.get("", 0.0)
            if not runs:
                continue
            if share >= 1.0:
                drawn: float = len(runs)
            elif leg != EVERY_TEST_LEG and any(g for g, v in every.get(file, {}).items() if g and v > 0):
                drawn = share * len(runs)
            else:
                drawn = max(1, math.ceil(share * len(runs)))
            tests += sum(runs.values()) / len(runs) * drawn
        total += tests + max(0.0, float(steps.get(leg, 0.0)) - sum(files.values()))
    return total


def commit_share(doc: dict[str, Any], recorded_s: float = RECORDED_BUDGET_S) -> float:
    """The commit's launch share: the largest of `SHARES` whose prediction at the recorded machine's speed fits
    `recorded_s` (the smallest where none does). It reads the recorded costs only, never this machine."""
    return next((share for share in SHARES if predicted_s(doc, share) <= recorded_s), SHARES[-1])


def choose_share(doc: dict[str, Any], factor: float, limit_s: float = SLOW_LIMIT_S,
                 recorded_s: float = RECORDED_BUDGET_S) -> tuple[float, float]:
    """The share this machine draws and its prediction here (recorded x `factor`): the commit's (`commit_share`), or a
    step lower for each step whose prediction here is over `limit_s` (a machine far slower than any CI showed; never
    below the smallest: a slow machine draws less, never nothing)."""
    steps = SHARES[SHARES.index(commit_share(doc, recorded_s)):]
    for share in steps:
        if factor * predicted_s(doc, share) <= limit_s:
            return share, factor * predicted_s(doc, share)
    return steps[-1], factor * predicted_s(doc, steps[-1])


def speed_factor(doc: dict[str, Any], calibration_s: float) -> float:
    """This machine against the recorded one: its calibration's seconds over the recorded (1.0 where none was)."""
    recorded_s = float(doc.get("calibration_s", 0.0))
    return calibration_s / recorded_s if recorded_s > 0 and calibration_s > 0 else 1.0


def _read(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def recorded() -> dict[str, Any]:
    return _read(RECORDED) or {"legs": {}}


def report(legs: dict[str, dict[str, float]], total_s: float, budget_s: float, before: dict[str, Any],
           steps: Optional[dict[str, float]] = None) -> list[str]:
    verdict = "within" if total_s <= budget_s else f"OVER by {total_s - budget_s:.0f} s"
    lines = [f"costs: .ci/run {total_s:.0f} s against a budget of {budget_s:.0f} s: {verdict}"]
    was_steps = before.get("steps", {})
    for step, seconds in (steps or {}).items():
        change = f" (recorded {was_steps[step]:.0f} s)" if step in was_steps else ""
        lines.append(f"costs: step {step}: {seconds:.0f} s{change}")
    for leg, files in legs.items():
        was = before.get("legs", {}).get(leg)
        change = "" if was is None else f" (recorded {sum(was.values()):.0f} s: {sum(files.values()) - sum(was.values()):+.0f} s)"
        lines.append(f"costs: {leg}: {sum(files.values()):.0f} s of tests over {len(files)} files{change}")
    pairs = sorted(((seconds, leg, name) for leg, files in legs.items() for name, seconds in files.items()), reverse=True)
    lines.append("costs: the ten costliest files (leg, seconds):")
    lines += [f"costs:   {seconds:7.1f} s  {leg:5}  {name}" for seconds, leg, name in pairs[:10]]
    return lines


def _record(path: str, doc: dict[str, Any], default_note: str) -> None:
    """`doc` with its ``measured`` note (AUTOMICRO_COSTS_NOTE, else `default_note`) into `path`."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"measured": os.environ.get("AUTOMICRO_COSTS_NOTE", default_note), **doc}, handle, indent=1, sort_keys=True)
        handle.write("\n")


def test_files() -> list[str]:
    folder = os.path.join(ROOT, "tests")
    return sorted(f"tests/{name}" for name in os.listdir(folder) if name.startswith("test_") and name.endswith(".py"))


def file_costs(files: list[str], full: dict[str, Any], gate: dict[str, Any]) -> dict[str, float]:
    """Each file's cost in the full suite: the last recorded full run (`tests/costs_full.json`), else
    its leg-1 cost in the gate (`tests/costs.json`), else UNKNOWN_S."""
    measured = full.get("files", {})
    leg1 = gate.get("legs", {}).get("leg1", {})
    return {name: float(measured.get(name, leg1.get(name, UNKNOWN_S))) for name in files}


def deal(costs: dict[str, float], part: int, parts: int) -> list[str]:
    """Part `part` (1-based) of `parts`: the costliest file first to the part with the least so far (the
    greedy longest-first rule), ties by name; the part's files costliest first (pytest-xdist hands
    files out in that order, so the longest start first)."""
    if not 1 <= part <= parts:
        raise ValueError(f"part {part}/{parts}: K must be between 1 and N")
    loads = [0.0] * parts
    dealt: list[list[str]] = [[] for _ in range(parts)]
    for name, seconds in sorted(costs.items(), key=lambda item: (-item[1], item[0])):
        least = min(range(parts), key=lambda i: (loads[i], i))
        loads[least] += seconds
        dealt[least].append(name)
    return dealt[part - 1]


def parse_part(text: str) -> tuple[int, int]:
    try:
        part, parts = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"part {text!r}: write K/N, e.g. 1/2") from None
    if not 1 <= part <= parts:
        raise ValueError(f"part {text!r}: K must be between 1 and N")
    return part, parts


def main(argv: list[str]) -> int:
    if argv[:1] == ["files"] and len(argv) <= 2:
        try:
            part, parts = parse_part(argv[1]) if len(argv) == 2 else (1, 1)
        except ValueError as e:
            print(f"costs: {e}", file=sys.stderr)
            return 2
        print("\n".join(deal(file_costs(test_files(), _read(RECORDED_FULL), recorded()), part, parts)))
        return 0
    if argv[:1] == ["seed"] and len(argv) <= 2:
        commit = argv[1] if len(argv) == 2 else head_commit()
        try:
            print(seed_of(commit))
        except ValueError as e:
            print(f"costs: {e}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["predict"] and len(argv) in (2, 3):
        doc = recorded()
        factor = speed_factor(doc, float(argv[1]))
        limit = float(argv[2]) if len(argv) == 3 else SLOW_LIMIT_S
        full = factor * predicted_s(doc)
        own = commit_share(doc)
        share, prediction = choose_share(doc, factor, limit)
        whose = ("the commit's: the largest step that fits " f"{RECORDED_BUDGET_S:.0f} s at the recorded speed" if share == own
                 else f"a step below the commit's {own:g}: its prediction here is over {limit:.0f} s")
        print(f"predict: calibration {float(argv[1]):.2f} s against the recorded {doc.get('calibration_s', 0):.2f} s: "
              f"speed {factor:.2f}x the recorded machine; every launch {full:.0f} s predicted; "
              f"launch share {share:g} ({whose}): {prediction:.0f} s predicted here (budget {BUDGET_S:.0f} s)")
        print(f"share={share:g}")
        return 0
    if argv[:1] == ["update-full"] and len(argv) >= 2:
        files: dict[str, float] = {}
        for path in argv[1:]:
            files.update(_leg_doc(_read(path))[0])
        if not files:
            print(f"costs: no costs in {' '.join(argv[1:])}: nothing recorded", file=sys.stderr)
            return 1
        _record(RECORDED_FULL, {"files": files}, "scripts/full_suite.sh")
        print(f"costs: {RECORDED_FULL} now holds {len(files)} files, {sum(files.values()):.0f} s")
        return 0
    if len(argv) == 4 and argv[0] == "report":
        run = read_run(argv[1])
        if not run["legs"]:
            print(f"costs: no leg files in {argv[1]}")
            return 0
        print("\n".join(report(run["legs"], float(argv[2]), float(argv[3]), recorded(), run["steps"])))
        return 0
    if len(argv) == 2 and argv[0] == "update":
        run = read_run(argv[1])
        if not run["legs"]:
            print(f"costs: no leg files in {argv[1]}: nothing recorded", file=sys.stderr)
            return 1
        speed = _read(os.path.join(argv[1], SPEED))
        share = float(speed.get("share", 1.0))
        if speed.get("every"):
            print(f"costs: {argv[1]} is a run of every draw (--every: every fault-matrix cell and 4-rank launch), more "
                  "than the gate runs; record a run of every launch (AUTOMICRO_LAUNCH_SHARE=1 .ci/run)", file=sys.stderr)
            return 1
        if share < 1.0:
            print(f"costs: {argv[1]} is a run of launch share {share:g}: the launches it did not draw would drop out "
                  "of the record; record a run of every launch (AUTOMICRO_LAUNCH_SHARE=1 .ci/run)", file=sys.stderr)
            return 1
        _record(RECORDED, run, "a .ci/run on a 2-core development machine")
        print(f"costs: {RECORDED} now holds {', '.join(f'{leg} {sum(f.values()):.0f} s' for leg, f in run['legs'].items())}; "
              f"the whole gate {predicted_s(run):.0f} s")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
