#!/usr/bin/env python3
"""How fast this machine runs the gate's kind of work today, in seconds (`.ci/run`: against the recorded
calibration, the speed factor that scales the recorded costs: `.ci/costs.py predict`).

    .venv/bin/python .ci/calibrate.py

Two processes at once (the tests' ranks come in twos on two cores), each what a test launch does: start an
interpreter, import torch, run Python (a search's bookkeeping) and single-threaded tensor work (a tiny model's
steps). Prints the wall seconds of the whole, the best of three rounds after an untimed one (a round is about
3 s on the recording machine). A machine with its cores shared (another process on each) or fewer of them takes longer alike.
"""

from __future__ import annotations

import subprocess
import sys
import time

WORK = """
import torch
torch.set_num_threads(1)
total = 0
for i in range(1_500_000):
    total += (i * 7) % 13
a = torch.randn(256, 256)
for _ in range(400):
    a = torch.tanh(a @ a.T / 256)
"""


def one_round() -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORK]) for _ in range(2)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("calibrate: a worker failed")
    return time.perf_counter() - started


def main() -> int:
    one_round()  # untimed: the first imports after a venv build read torch's files from disk (one run read 1.3x slow)
    seconds = min(one_round() for _ in range(3))
    print(f"{seconds:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
