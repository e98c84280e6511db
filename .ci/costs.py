#!/usr/bin/env python3
"""The suite's costs against the budget (issue 59). Standard library only.

    python3 .ci/costs.py report DIR TOTAL_S BUDGET_S   # after .ci/run's legs: the total against the budget,
                                                      # each leg's test seconds against tests/costs.json,
                                                      # the ten costliest files
    python3 .ci/costs.py update DIR                    # tests/costs.json from a run's leg files

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


def read_legs(folder: str) -> dict[str, dict[str, float]]:
    legs = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                legs[name[: -len(".json")]] = {k: float(v) for k, v in json.load(handle).items()}
    return legs


def recorded() -> dict[str, Any]:
    if not os.path.exists(RECORDED):
        return {"legs": {}}
    with open(RECORDED, encoding="utf-8") as handle:
        return json.load(handle)


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


def main(argv: list[str]) -> int:
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
        doc = {"measured": os.environ.get("AUTOMICRO_COSTS_NOTE", "a .ci/run on a 2-core development machine"), "legs": legs}
        with open(RECORDED, "w", encoding="utf-8") as handle:
            json.dump(doc, handle, indent=1, sort_keys=True)
            handle.write("\n")
        print(f"costs: {RECORDED} now holds {', '.join(f'{leg} {sum(f.values()):.0f} s' for leg, f in legs.items())}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
