#!/usr/bin/env python3
"""The last lines of `.ci/run`: every failing test of every leg with the line it failed on, the seed, and the command
that repeats each leg's failures (from the files `tests/failures.py` wrote: DIR/failures-LEG.jsonl). Standard library
only (it runs whatever state the venvs are in).

    python3 .ci/failures.py DIR SEED FAILED_STEP
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    folder, seed, step = argv
    legs = sorted(name for name in os.listdir(folder) if name.startswith("failures-") and name.endswith(".jsonl")) \
        if os.path.isdir(folder) else []
    count = 0
    for name in legs:
        leg = name[len("failures-"):-len(".jsonl")]
        repeat = None
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            for text in handle:
                if not text.strip():
                    continue
                row = json.loads(text)
                if "repeat" in row:
                    repeat = row["repeat"]
                    continue
                count += 1
                print(f"=== FAILED [{leg}] {row['test']} ({row['when']}) at {row['where'] or '?'}: {row['error']}")
        if repeat:
            print(f"=== repeat {leg}'s failures: {repeat}")
    if step:
        what = f"{count} failing test(s) above" if count else "no test failed: read the step's own output above"
        print(f"=== .ci/run failed in step {step}: {what}")
    print(f"=== AUTOMICRO_TEST_SEED={seed} (AUTOMICRO_TEST_SEED={seed} .ci/run repeats this run's draws)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
