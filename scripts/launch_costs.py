#!/usr/bin/env python3
"""Where a test launch's seconds go : the fixed part of a 2-rank test, measured.

    python scripts/launch_costs.py [--out DIR] [--reps N]      # from the repo root, in the test venv

Measures, on this machine, each in a fresh process where it is a start-up cost:
- ``import``: a fresh interpreter (``pass``), then importing torch, Composer, automicro, transformers
  (each on top of the ones before; cold-ish: the second of two runs);
- ``run_multiprocess``: 2 gloo ranks from the forkserver (the tests' default) and by spawn, a function
  that does nothing: the first launch of a process (the forkserver starts and preloads), the next ones;
  inside the ranks, the seconds from the fork to the function (unpickling it imports its module;
  ``init_process_group``) and from its return to the parent's result (teardown);
- the same with a function of a test-case module (`tests.optimizer_cases`, `tests.hf_cases`): the
  imports each rank pays after the fork;
- ``trainer``: in 2 ranks, `automicro.Trainer` built on the tiny model with FSDP2 (the tests' common
  shape), then its ``fit`` for 1 and for 4 batches (the difference: the batches themselves);
- ``launcher``: the composer launcher on the demo config for 2 and 6 batches (its fixed cost is what
  the line through the two leaves at 0 batches).

Writes ``DIR/launch_costs.json`` and prints a table. Timings are of this machine (2 cores here, 16 on
a GPU machine's CPUs): `benchmarks/RESULTS.md` keeps the ones cited, with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _seconds(argv: list[str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def imports(reps: int) -> dict[str, float]:
    steps = {"python": "pass", "+ torch": "import torch", "+ composer": "import torch, composer",
             "+ automicro": "import torch, composer, automicro, automicro.composer.callback",
             "+ transformers": "import torch, composer, automicro, automicro.composer.callback, transformers"}
    env = {**os.environ, "PYTHONPATH": REPO}
    out = {}
    for name, code in steps.items():
        _seconds([sys.executable, "-c", code], env)  # warm the page cache
        out[name] = statistics.median(_seconds([sys.executable, "-c", code], env) for _ in range(reps))
    return out


def _launches(fn: Callable[..., Any], reps: int, start_method: str, world: int = 2, **kwargs: Any) -> dict[str, Any]:
    from automicro.testing.multiprocess import run_multiprocess

    walls, inner = [], []
    for _ in range(reps):
        started = time.time()
        results = run_multiprocess(fn, world_size=world, start_method=start_method, timeout_s=600, **kwargs)
        ended = time.time()
        walls.append(ended - started)
        inner.append({
            "to_fn_s": max(r["entered"] for r in results) - started,
            "fn_s": max(r["left"] - r["entered"] for r in results),
            "after_fn_s": ended - max(r["left"] for r in results),
            **{k: max(r.get(k, 0.0) for r in results) for k in results[0] if k.endswith("_s")},
        })
    return {"first_s": walls[0], "next_s": statistics.median(walls[1:]) if len(walls) > 1 else None,
            "first": inner[0], "next": inner[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="launch-costs")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-launcher", action="store_true")
    parser.add_argument("--parent-imports", action="store_true",
                        help="import Composer, automicro's integration and the case modules here first, as pytest's "
                        "collection does before the first launch (the forkserver then preloads them); without it, "
                        "the launches pay what a forkserver without them does (before the preload: every test run)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    from tests import launch_cost_cases as cases

    if args.parent_imports:
        import importlib

        from automicro.testing import multiprocess

        for module in (*multiprocess._PRELOAD_IF_IMPORTED, "tests.optimizer_cases", "tests.hf_cases"):
            importlib.import_module(module)

    doc: dict[str, Any] = {"python": sys.version.split()[0], "cores": os.cpu_count(), "parent_imports": args.parent_imports}
    import torch

    doc["torch"] = torch.__version__
    doc["imports_s"] = imports(args.reps)
    doc["forkserver_noop"] = _launches(cases.noop, args.reps + 1, "forkserver")
    doc["spawn_noop"] = _launches(cases.noop, args.reps, "spawn")
    doc["forkserver_optimizer_cases"] = _launches(cases.noop_importing, args.reps, "forkserver", args=("tests.optimizer_cases",))
    doc["forkserver_hf_cases"] = _launches(cases.noop_importing, args.reps, "forkserver", args=("tests.hf_cases",))
    doc["trainer"] = _launches(cases.trainer_phases, 2, "forkserver")
    if not args.skip_launcher:
        composer = os.path.join(os.path.dirname(sys.executable), "composer")
        runs = {}
        for batches in (2, 6):
            command = [composer, "-n", "2", "scripts/train.py", "configs/tiny-cpu.yaml", f"max_duration={batches}ba",
                       f"run_dir={os.path.abspath(args.out)}/run{batches}"]
            runs[batches] = statistics.median(_seconds(command) for _ in range(2))
        per_batch = (runs[6] - runs[2]) / 4
        doc["launcher"] = {"2ba_s": runs[2], "6ba_s": runs[6], "per_batch_s": per_batch, "fixed_s": runs[2] - 2 * per_batch}
    with open(os.path.join(args.out, "launch_costs.json"), "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
    print(f"launch costs: torch {doc['torch']}, {doc['cores']} cores, parent imports {'Composer and the cases' if args.parent_imports else 'nothing'}")
    for name, seconds in doc["imports_s"].items():
        print(f"  import {name:<16} {seconds:6.2f} s")
    for key in ("forkserver_noop", "spawn_noop", "forkserver_optimizer_cases", "forkserver_hf_cases", "trainer"):
        row = doc[key]
        nxt = row["next"]
        extra = " ".join(f"{k} {v:.2f}" for k, v in nxt.items() if k not in ("to_fn_s", "fn_s", "after_fn_s"))
        print(f"  {key:<27} first {row['first_s']:6.2f} s, next {row['next_s'] or float('nan'):6.2f} s "
              f"(to fn {nxt['to_fn_s']:.2f}, fn {nxt['fn_s']:.2f}, after {nxt['after_fn_s']:.2f}) {extra}")
    if "launcher" in doc:
        row = doc["launcher"]
        print(f"  composer launcher          2 batches {row['2ba_s']:.2f} s, 6 batches {row['6ba_s']:.2f} s: "
              f"fixed {row['fixed_s']:.2f} s + {row['per_batch_s']:.2f} s a batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
