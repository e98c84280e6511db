#!/usr/bin/env python3
"""The flake hunt: the gate's multi-rank launches, every one, several times over, on a machine as loaded as CI at its
worst (two busy processes beside the tests on a 2-core machine), and each test's passes and failures.

    make test-repeat                      # 3 rounds on torch 2.7 (.venv), two CPU hogs
    make test-repeat N=5 HOGS=2 REPEAT_ARGS="tests/test_watchdog.py"
    python3 scripts/test_repeat.py --python .venv-211/bin/python --rounds 3 -- -m "torch_versions and not many_ranks"

Each round is one pytest process, as a CI leg runs (one worker): ``--every --launches-only`` (every draw the gate can
make: every fault-matrix cell and 4-rank launch, every launch of every file; only the tests that start processes),
with the pytest arguments after ``--`` (a file or test id there replaces ``tests``). The hogs are plain busy loops
(`HOG`), started before the first round and killed after the last. Writes OUT/round-K.xml (JUnit), OUT/round-K.log
and OUT/repeat.json (each test's outcomes); prints every test that failed in any round with its passes and failures,
then one line for the whole. Exit 1 where a test failed in any round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOG = "while True:\n    pass\n"


def _test_id(case: Any) -> str:
    """pytest's node id of a JUnit testcase (classname "tests.test_x" or "tests.test_x.TestY", name "test_z[id]")."""
    parts = case.get("classname", "").split(".")
    module = [p for p in parts if not p[:1].isupper()]
    classes = [p for p in parts if p[:1].isupper()]
    return "::".join(["/".join(module) + ".py", *classes, case.get("name", "")])


def outcomes(path: str) -> dict[str, str]:
    """{test id: passed | failed | skipped} of one round's JUnit file (an error in setup or teardown is a failure)."""
    if not os.path.exists(path):
        return {}
    out: dict[str, str] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            out[_test_id(case)] = "failed"
        elif "skipped" in tags:
            out.setdefault(_test_id(case), "skipped")
        else:
            out.setdefault(_test_id(case), "passed")
    return out


def tally(rounds: list[dict[str, str]]) -> dict[str, dict[str, int]]:
    """{test id: {"passed": n, "failed": n, "skipped": n, "missing": n}} over the rounds."""
    tests = sorted({test for one in rounds for test in one})
    out: dict[str, dict[str, int]] = {}
    for test in tests:
        counts: dict[str, int] = defaultdict(int)
        for one in rounds:
            counts[one.get(test, "missing")] += 1
        out[test] = {key: counts.get(key, 0) for key in ("passed", "failed", "skipped", "missing")}
    return out


def table(counts: dict[str, dict[str, int]], rounds: int, hogs: int, seconds: list[float]) -> list[str]:
    flaky = {test: c for test, c in counts.items() if c["failed"]}
    lines = [f"{'passed':>6} {'failed':>6}  test" for _ in [0] if flaky]
    lines += [f"{c['passed']:>6} {c['failed']:>6}  {test}" for test, c in sorted(flaky.items())]
    ran = sum(1 for c in counts.values() if c["passed"] + c["failed"])
    skipped = sum(1 for c in counts.values() if not c["passed"] + c["failed"])
    lines.append(f"repeat: {ran} tests that launch processes, {rounds} round(s) each beside {hogs} busy process(es) "
                 f"({', '.join(f'{s:.0f} s' for s in seconds)}): {len(flaky)} failed in some round"
                 + (f"; {skipped} skipped in every round" if skipped else ""))
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the tests (2: CI's 2 cores doubly loaded)")
    parser.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    parser.add_argument("--out", default=os.path.join(ROOT, ".ci-repeat"))
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (a path replaces tests)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.hogs < 0:
        parser.error("--rounds must be at least 1 and --hogs at least 0")
    os.makedirs(args.out, exist_ok=True)
    named = [a for a in args.pytest_args if a.startswith("tests")]
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    results, seconds = [], []
    try:
        for index in range(1, args.rounds + 1):
            xml = os.path.join(args.out, f"round-{index}.xml")
            command = [args.python, "-m", "pytest", *([] if named else ["tests"]), "--every", "--launches-only",
                       "-p", "no:cacheprovider", f"--junitxml={xml}", *args.pytest_args]
            env = dict(os.environ, AUTOMICRO_FAILURES_OUT=os.path.join(args.out, f"round-{index}-failures.jsonl"),
                       WANDB_MODE=os.environ.get("WANDB_MODE", "offline"))
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            print(f"repeat: round {index}/{args.rounds}: {' '.join(command)}", flush=True)
            began = time.monotonic()
            with open(os.path.join(args.out, f"round-{index}.log"), "w", encoding="utf-8") as log:
                code = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            seconds.append(time.monotonic() - began)
            results.append(outcomes(xml))
            failed = sorted(t for t, o in results[-1].items() if o == "failed")
            print(f"repeat: round {index}: exit {code}, {len(results[-1])} tests, {len(failed)} failed, "
                  f"{seconds[-1]:.0f} s" + "".join(f"\n  FAILED {t}" for t in failed), flush=True)
            if code not in (0, 1):  # 1: some test failed (tallied); anything else: the run itself broke
                print(f"repeat: round {index}: pytest exited {code}: see {args.out}/round-{index}.log", flush=True)
                return code
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    counts = tally(results)
    with open(os.path.join(args.out, "repeat.json"), "w", encoding="utf-8") as handle:
        json.dump({"rounds": args.rounds, "hogs": args.hogs, "python": args.python, "pytest_args": args.pytest_args,
                   "seconds": seconds, "tests": counts}, handle, indent=1)
    print("\n".join(table(counts, args.rounds, args.hogs, seconds)))
    return 1 if any(c["failed"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
