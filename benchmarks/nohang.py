"""Suite nohang: short auto runs under random per-rank memory fractions; none may hang.

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/nohang.py --out DIR [--runs 12]
    # CPU check (gloo, tiny Llama, limits emulated by MemoryCapCallback):
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/nohang.py --out DIR --device cpu --tiny

`--runs` short auto runs (6 batches) under random per-rank memory fractions (seeded): equal,
asymmetric, one rank tight; case 0 also measures each rank's forward and backward peaks and case
1 puts the last rank's limit between them (aiming at an OOM in backward on one rank only). Per
run: fractions, attempts, OOMs, failing ranks and sites, seconds to a stable size, found size,
whether it ended. A per-case watchdog (faulthandler, `--case-timeout`) dumps every thread's stack
and ends the process if a case hangs; the shell script's `timeout` is the outer watchdog.
Writes DIR/nohang.json (rewritten after every case) and DIR/nohang_table.txt.
"""

from __future__ import annotations

import os
import sys
import random
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import Ctx, common_parser, finish_args, fractions_arg, main as launch, rnd, run_case, splitfmt  # noqa: E402
from harness import fmt, median  # noqa: E402


def parse_args(argv: Optional[list[str]] = None):
    p = common_parser(__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=12, help="number of runs (the issue asks >= 20)")
    p.add_argument("--nohang-batches", type=int, default=6)
    p.add_argument("--fraction-range", default="0.15,0.55", help="random fractions lo,hi")
    p.add_argument("--probe-fraction", type=float, default=0.45,
                   help="case 0 (every rank) and case 1 (the other ranks): fraction with room to spare")
    p.add_argument("--bwd-position", type=float, default=0.6,
                   help="case 1: the last rank's limit at this point between its forward and backward peaks")
    return finish_args(p, argv)


def nohang_plan(ctx: Ctx) -> list[dict[str, Any]]:
    """Case 0: probe (equal, generous); case 1: designed backward-OOM on rank 1 (filled in later);
    then equal / asymmetric / one-rank-tight in turn, seeded."""
    args = ctx.args
    lo, hi = (float(x) for x in args.fraction_range.split(","))
    rng = random.Random(args.seed)
    plan: list[dict[str, Any]] = [
        {"kind": "probe-equal", "fractions": (args.probe_fraction,) * ctx.world},
        {"kind": "backward-designed", "fractions": None},
    ]
    kinds = ("equal", "asymmetric", "one-tight")
    n = 0
    while len(plan) < args.runs:
        kind = kinds[n % len(kinds)]
        if kind == "equal":
            f = round(rng.uniform(lo, hi), 3)
            fractions = (f,) * ctx.world
        elif kind == "asymmetric":
            while True:
                fractions = tuple(round(rng.uniform(lo, hi), 3) for _ in range(ctx.world))
                if max(fractions) - min(fractions) >= 0.05:
                    break
        else:
            tight = (n // len(kinds)) % ctx.world
            fractions = tuple(
                round(rng.uniform(lo, lo + 0.3 * (hi - lo)), 3) if r == tight else 0.9 for r in range(ctx.world)
            )
        plan.append({"kind": kind, "fractions": fractions})
        n += 1
    return plan[: args.runs]


def designed_backward(ctx: Ctx, probe_case: dict[str, Any]) -> dict[str, Any]:
    """From the probe's per-rank forward and backward peaks (steady batches): rank 1's limit at
    `--bwd-position` between them, rank 0 keeps the probe fraction, start at the probe's size."""
    args = ctx.args
    if probe_case is None or probe_case.get("status") != "ok":
        return {"designable": False, "why": "the probe run did not finish", "rank": ctx.world - 1, "start_size": None,
                "fractions": [args.probe_fraction] * (ctx.world - 1) + [round(args.probe_fraction / 2.5, 4)]}
    rows = probe_case["rows"]
    final = rows[-1]["size"] if rows else None
    use = [i for i, r in enumerate(rows) if r["batch"] >= 2 and r["size"] == final and r["attempts"] == 1]
    info: dict[str, Any] = {"start_size": final, "batches_used": [rows[i]["batch"] for i in use]}
    fractions = list(probe_case["fractions"])
    target = ctx.world - 1
    pr = probe_case["ranks"][target]["per_batch"]
    fwd = max((pr["fwd_peak"][i] or 0) for i in use) if use else 0
    bwd = max((pr["bwd_peak"][i] or 0) for i in use) if use else 0
    info.update({"rank": target, "fwd_peak": fwd, "bwd_peak": bwd})
    if not use or bwd <= fwd * 1.005:
        info["designable"] = False
        info["why"] = "backward peak not above the forward peak" if use else "no steady probe batches"
        fractions[target] = round(args.probe_fraction / 2.5, 4)
    else:
        cap = fwd + args.bwd_position * (bwd - fwd)
        info.update({"designable": True, "cap_bytes": int(cap)})
        fractions[target] = round(cap / ctx.total_bytes, 6)
    info["fractions"] = fractions
    return info


def suite_nohang(ctx: Ctx) -> None:
    args = ctx.args
    plan = nohang_plan(ctx)
    ctx.extra["plan"] = [{"kind": p["kind"], "fractions": p["fractions"]} for p in plan]
    probe_case: Optional[dict[str, Any]] = None
    for i, item in enumerate(plan):
        name = f"run{i:02d}-{item['kind']}"
        if not ctx.within_budget(name):
            break
        auto_kwargs: dict[str, Any] = {}
        fractions = item["fractions"]
        note = ""
        if item["kind"] == "backward-designed":
            design = ctx.decide(designed_backward(ctx, probe_case) if ctx.rank == 0 else None)
            ctx.extra["backward_design"] = design
            fractions = tuple(design["fractions"])
            if design.get("start_size"):
                auto_kwargs["start_size"] = int(design["start_size"])
            note = "designed: rank %d limit between its forward and backward peaks" % design["rank"] if design.get("designable") else "not designable"
        case = run_case(ctx, name, fractions=fractions, auto_kwargs=auto_kwargs, batches=args.nohang_batches,
                        probe=item["kind"] == "probe-equal", note=note)
        if ctx.rank == 0:
            case["kind"] = item["kind"]
            if item["kind"] == "probe-equal":
                probe_case = case
    if ctx.rank == 0:
        cases = ctx.cases
        ctx.extra["totals"] = {
            "runs": len(cases),
            "ended": sum(1 for c in cases if c["summary"].get("ended")),
            "cannot_fit": sum(1 for c in cases if c["status"] == "cannot_fit"),
            "hung": 0,  # a hang never reaches here: the watchdog ends the process, the case stays in_progress
            "ooms": sum(c.get("ooms_total") or 0 for c in cases),
            "backward_oom_runs": sum(1 for c in cases if any(p.startswith("backward") for p in c["summary"].get("oom_phases", []))),
            "one_rank_backward_oom_runs": sum(
                1 for c in cases
                if any(len(f["ranks"]) == 1 and f["outcome"] == "oom" and (f["phases"][0] or "").startswith("backward")
                       for f in c["summary"].get("failures", []))
            ),
            "one_rank_oom_runs": sum(1 for c in cases if any(len(f["ranks"]) == 1 for f in c["summary"].get("failures", []))),
        }
    ctx.write(done=True)
    rows = []
    for c in ctx.cases:
        s = c["summary"]
        rows.append([
            c["name"], ",".join(f"{f:.3f}" for f in c["fractions"]), c["status"], f"{c['batches_done']}/{c['batches']}",
            s.get("attempts_total"), c.get("ooms_total"), s.get("failing_ranks"),
            ",".join(s.get("oom_sites", [])) or "-",
            ",".join(sorted({p.split("@")[0] for p in s.get("oom_phases", [])})) or "-", s.get("seconds_to_stable"), c.get("found_size"),
            splitfmt(c.get("final_split")), c.get("thrash_events"), "no" if s.get("ended") else "?",
        ])
    ctx.table(["run", "fractions", "status", "batches", "attempts", "OOMs", "OOM ranks", "OOM sites",
                "OOM phases", "s to stable", "found", "split", "thrash", "hung"], rows)
    if ctx.rank == 0:
        print(f"[bench] nohang totals: {ctx.extra['totals']}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    return launch("nohang", parse_args(argv), suite_nohang)


if __name__ == "__main__":
    sys.exit(main())
