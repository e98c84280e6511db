#!/usr/bin/env python3
"""The suite's costs against the budget (issue 59). Standard library only.

    python3 .ci/costs.py report DIR TOTAL_S BUDGET_S   # after .ci/run's legs: the total against the budget,
                                                      # each leg's test seconds against tests/costs.json,
                                                      # the ten costliest files
    python3 .ci/costs.py update DIR                    # tests/costs.json from a run's leg files
    python3 .ci/costs.py files [K/N]                   # the test files, costliest first (part K of N:
                                                      # dealt about equally by cost), for scripts/full_suite.sh
    python3 .ci/costs.py update-full FILE...           # tests/costs_full.json from scripts/full_suite.sh's
                                                      # costs.json (one per part)

DIR holds one ``LEG.json`` per leg (``{test file: seconds}``, written by `tests/costs.py` where
``AUTOMICRO_COSTS_OUT`` names it; `.ci/run` writes ``.ci-costs/leg1.json`` .. ``leg3.json``).
`tests/costs.json` keeps ``{"legs": {LEG: {file: seconds}}, "measured": ...}``: the costs of the last
run someone recorded, so that a change can see what it adds (`report` prints each leg's change).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDED = os.path.join(ROOT, "tests", "costs.json")
RECORDED_FULL = os.path.join(ROOT, "tests", "costs_full.json")
UNKNOWN_S = 120.0  # a file no run recorded yet: dealt early, as one of the costlier ones


def read_legs(folder: str) -> dict[str, dict[str, float]]:
    legs = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                legs[name[: -len(".json")]] = {k: float(v) for k, v in json.load(handle).items()}
    return legs


def _read(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def recorded() -> dict[str, Any]:
    return _read(RECORDED) or {"legs": {}}


def report(legs: dict[str, dict[str, float]], total_s: float, budget_s: float, before: dict[str, Any]) -> list[str]:
    verdict = "within" if total_s <= budget_s else f"OVER by {total_s - budget_s:.0f} s"
    lines = [f"costs: .ci/run {total_s:.0f} s against a budget of {budget_s:.0f} s: {verdict}"]
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
    if argv[:1] == ["update-full"] and len(argv) >= 2:
        files: dict[str, float] = {}
        for path in argv[1:]:
            files.update({k: float(v) for k, v in _read(path).items()})
        if not files:
            print(f"costs: no costs in {' '.join(argv[1:])}: nothing recorded", file=sys.stderr)
            return 1
        _record(RECORDED_FULL, {"files": files}, "scripts/full_suite.sh")
        print(f"costs: {RECORDED_FULL} now holds {len(files)} files, {sum(files.values()):.0f} s")
        return 0
    if len(argv) == 4 and argv[0] == "report":
        legs = read_legs(argv[1])
        if not legs:
            print(f"costs: no leg files in {argv[1]}")
            return 0
        print("\n".join(report(legs, float(argv[2]), float(argv[3]), recorded())))
        return 0
    if len(argv) == 2 and argv[0] == "update":
        legs = read_legs(argv[1])
        if not legs:
            print(f"costs: no leg files in {argv[1]}: nothing recorded", file=sys.stderr)
            return 1
        _record(RECORDED, {"legs": legs}, "a .ci/run on a 2-core development machine")
        print(f"costs: {RECORDED} now holds {', '.join(f'{leg} {sum(f.values()):.0f} s' for leg, f in legs.items())}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
