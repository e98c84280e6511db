"""Suite throughput: auto (bisect, and Composer's halving) vs a sweep of fixed sizes, one run each.

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/throughput.py --out DIR [--fractions 0.22,0.32]

One fixed fraction pair: auto (bisect), auto (halve, Composer's policy), a sweep of fixed sizes
1..found+1 (each run as AutoMicrobatching(search="halve", start_size=m), so an OOM is safe and
shows as a step-down). Steady-state tokens/s (median of SpeedMonitor's `throughput/tokens_per_sec`
over the last batches, plus our own per-batch timing), ratio auto / best hand-tuned, search cost
(attempts and OOMs to converge), consensus rounds per batch. Every figure is ONE run: for a
ratio that must hold up, compare interleaved (`vs_plain.py`, `hooks.py`).
Writes DIR/throughput.json and DIR/throughput_table.txt.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import Ctx, common_parser, finish_args, fractions_arg, main as launch, rnd, run_case, splitfmt  # noqa: E402
from harness import fmt, median  # noqa: E402


def parse_args(argv: Optional[list[str]] = None):
    p = common_parser(__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=14, help="batches per run")
    p.add_argument("--sweep", default="auto", help="fixed sizes, 'auto' = 1..found+1, or e.g. 2,3,4,5")
    p.add_argument("--sweep-stable", type=int, default=4,
                   help="sweep: stable_batches (hooks-on batches measured before hooks come off)")
    return finish_args(p, argv)


def suite_throughput(ctx: Ctx) -> None:
    args = ctx.args
    fractions = fractions_arg(args.fractions)
    B = args.per_rank_batch
    N = args.batches

    bisect = run_case(ctx, "auto-bisect", fractions=fractions, batches=N)
    info = ctx.decide({"found": bisect.get("found_size"), "split": bisect.get("final_split")} if ctx.rank == 0 else None)
    found = info["found"] or B
    if ctx.within_budget("auto-halve"):
        run_case(ctx, "auto-halve", fractions=fractions, auto_kwargs={"search": "halve"}, batches=N)

    if args.sweep == "auto":
        top = min(B, found + 1)
        sizes = [found] + ([found + 1] if found + 1 <= top else []) + list(range(found - 1, 0, -1))
    else:
        sizes = [int(x) for x in args.sweep.split(",")]
    ctx.extra["sweep_sizes"] = sizes
    for m in sizes:
        if ctx.within_budget(f"fixed-{m}"):
            run_case(ctx, f"fixed-{m}", fractions=fractions, batches=N, stop_on_step_down=True,
                     auto_kwargs={"search": "halve", "start_size": m, "stable_batches": args.sweep_stable},
                     note="fixed size as AutoMicrobatching(search=halve, start_size=m): an OOM steps down instead of hanging")
    best = ctx.decide(best_fixed(ctx) if ctx.rank == 0 else None)

    if ctx.rank == 0:
        ctx.extra["report"] = throughput_report(ctx, best)
    ctx.write(done=True)
    rows = []
    for c in ctx.cases:
        s = c["summary"]
        rows.append([
            c["name"], c["status"], c.get("found_size", c["micro"]), splitfmt(c.get("final_split")), s.get("attempts_to_converge"),
            s.get("ooms_to_converge"), "yes" if s.get("stepped_down") else "no", fmt(s.get("tokens_per_s_speedmonitor"), ",.0f"),
            fmt(s.get("tokens_per_s_own"), ",.0f"), fmt(s.get("step_s_hooks_on"), ".4f"), fmt(s.get("step_s_hooks_off"), ".4f"),
            fmt(s.get("hooks_on_overhead"), "+.2%"), s.get("rounds_per_batch_hooks_on"), s.get("rounds_per_batch_hooks_off"),
        ])
    ctx.table(["case", "status", "found/size", "split", "att→conv", "OOM→conv", "stepped", "tok/s SM",
                "tok/s own", "step on", "step off", "overhead", "rounds on", "rounds off"], rows)
    if ctx.rank == 0:
        print_throughput_report(ctx.extra["report"])


def print_throughput_report(rep: dict[str, Any]) -> None:
    best = rep.get("best_hand_tuned") or {}
    sweep = sorted(rep.get("sweep") or [], key=lambda r: r["size"])
    print("[bench] fixed-size sweep: " + " | ".join(
        f"{r['size']}: {fmt(r['tokens_per_s'], ',.0f')} tok/s" if r["fits"]
        else f"{r['size']}: OOM at {','.join(r['oom_sites'] or []) or '?'} -> stepped to {r['stepped_down_to']}"
        for r in sweep), flush=True)
    for key in ("auto-bisect", "auto-halve"):
        r = rep.get(key)
        if not r:
            continue
        print(
            f"[bench] {key}: found {r['found_size']} split {splitfmt(r['split'])}; {r['attempts_to_converge']} attempts / "
            f"{r['ooms_to_converge']} OOMs to converge ({fmt(r['search_seconds'], '.2f')} s in attempts, "
            f"{fmt(r['seconds_to_stable'], '.2f')} s to stable); {fmt(r['tokens_per_s'], ',.0f')} tok/s = "
            f"{fmt(r['ratio_to_best_hand_tuned'], '.4f')} x best hand-tuned (size {best.get('size')}, "
            f"{fmt(best.get('tokens_per_s'), ',.0f')} tok/s; median step times: {fmt(r.get('ratio_own_median'), '.4f')}); step hooks on {fmt(r['step_s_hooks_on'], '.4f')} s vs off "
            f"{fmt(r['step_s_hooks_off'], '.4f')} s ({fmt(r['hooks_on_overhead'], '+.2%')}; history {fmt(r['history_s_hooks_on'], '.4f')} s "
            f"vs SpeedMonitor {fmt(r['step_s_hooks_off_speedmonitor'], '.4f')} s: {fmt(r['hooks_on_overhead_history_vs_speedmonitor'], '+.2%')}); consensus all-reduces per batch "
            f"on {r['rounds_per_batch_hooks_on']} / off {r['rounds_per_batch_hooks_off']} "
            f"(off: {fmt((r['finish_s_per_batch_hooks_off'] or 0) * 1e3, '.3f')} ms in it)",
            flush=True,
        )
    print(f"[bench] target auto/best >= 0.995 met: {rep.get('target_ratio_met')}; hooks-on overhead per sweep size: "
          f"{ {k: fmt(v, '+.2%') for k, v in (rep.get('sweep_hooks_on_overhead') or {}).items()} }", flush=True)


def best_fixed(ctx: Ctx) -> Optional[dict[str, Any]]:
    """Best hand-tuned size: the fastest sweep run that stayed at its own size (no step-down)."""
    fitting = [c for c in ctx.cases if c["name"].startswith("fixed-") and not c["summary"].get("stepped_down")
               and c["summary"].get("tokens_per_s_speedmonitor")]
    if not fitting:
        return None
    top = max(fitting, key=lambda c: c["summary"]["tokens_per_s_speedmonitor"])
    own = max((c["summary"].get("tokens_per_s_own") or 0 for c in fitting), default=0) or None
    return {"size": int(top["name"].split("-")[1]), "tokens_per_s": top["summary"]["tokens_per_s_speedmonitor"],
            "tokens_per_s_own": own}


def throughput_report(ctx: Ctx, best: Optional[dict[str, Any]]) -> dict[str, Any]:
    by = {c["name"]: c for c in ctx.cases}
    rep: dict[str, Any] = {"best_hand_tuned": best}
    for key in ("auto-bisect", "auto-halve"):
        c = by.get(key)
        if c is None:
            continue
        s = c["summary"]
        rep[key] = {
            "found_size": c.get("found_size"),
            "split": c.get("final_split"),
            "attempts_to_converge": s.get("attempts_to_converge"),
            "ooms_to_converge": s.get("ooms_to_converge"),
            "search_seconds": s.get("search_seconds"),
            "seconds_to_stable": s.get("seconds_to_stable"),
            "tokens_per_s": s.get("tokens_per_s_speedmonitor"),
            "ratio_to_best_hand_tuned": rnd(s["tokens_per_s_speedmonitor"] / best["tokens_per_s"], 4)
            if best and s.get("tokens_per_s_speedmonitor") else None,
            "tokens_per_s_own_median": s.get("tokens_per_s_own"),
            "ratio_own_median": rnd(s["tokens_per_s_own"] / best["tokens_per_s_own"], 4)
            if best and best.get("tokens_per_s_own") and s.get("tokens_per_s_own") else None,
            "step_s_hooks_on": s.get("step_s_hooks_on"),
            "step_s_hooks_off": s.get("step_s_hooks_off"),
            "hooks_on_overhead": s.get("hooks_on_overhead"),
            "history_s_hooks_on": s.get("history_s_hooks_on"),
            "step_s_hooks_off_speedmonitor": s.get("step_s_hooks_off_speedmonitor"),
            "hooks_on_overhead_history_vs_speedmonitor": s.get("hooks_on_overhead_history_vs_speedmonitor"),
            "rounds_per_batch_hooks_on": s.get("rounds_per_batch_hooks_on"),
            "rounds_per_batch_hooks_off": s.get("rounds_per_batch_hooks_off"),
            "finish_s_per_batch_hooks_off": s.get("finish_s_per_batch_hooks_off"),
        }
    if "auto-bisect" in rep:
        rep["target_ratio_met"] = (rep["auto-bisect"]["ratio_to_best_hand_tuned"] or 0) >= 0.995
    rep["sweep"] = [
        {
            "size": int(c["name"].split("-")[1]),
            "fits": not c["summary"].get("stepped_down"),
            "stepped_down_to": c["summary"].get("final_size") if c["summary"].get("stepped_down") else None,
            "oom_sites": c["summary"].get("oom_sites"),
            "oom_phases": c["summary"].get("oom_phases"),
            "tokens_per_s": c["summary"].get("tokens_per_s_speedmonitor"),
            "tokens_per_s_own": c["summary"].get("tokens_per_s_own"),
            "step_s_hooks_on": c["summary"].get("step_s_hooks_on"),
            "step_s_hooks_off": c["summary"].get("step_s_hooks_off"),
        }
        for c in ctx.cases
        if c["name"].startswith("fixed-")
    ]
    overheads = {c["name"]: c["summary"].get("hooks_on_overhead") for c in ctx.cases if c["name"].startswith("fixed-")}
    rep["sweep_hooks_on_overhead"] = overheads
    return rep


def main(argv: Optional[list[str]] = None) -> int:
    return launch("throughput", parse_args(argv), suite_throughput)


if __name__ == "__main__":
    sys.exit(main())
