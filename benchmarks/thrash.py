"""Suite thrash: allocator retries without OOM, the thrash detector's step-down.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False python3 -m torch.distributed.run --standalone \
        --nproc_per_node 2 benchmarks/thrash.py --out DIR

Measures the peak at the size (`--thrash-size`, or the split auto used in DIR/throughput.json,
else 4) with room to spare, then runs auto at that size with the limit a few percent above the
peak (largest margin first) until the thrash detector fires; its step-down and tokens/s before
and after. Writes DIR/thrash.json and DIR/thrash_table.txt.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import Ctx, common_parser, finish_args, fractions_arg, main as launch, rnd, run_case, splitfmt  # noqa: E402
from harness import fmt, median  # noqa: E402


def parse_args(argv: Optional[list[str]] = None):
    p = common_parser(__doc__.split("\n")[0])
    p.add_argument("--thrash-size", type=int, default=0,
                   help="microbatch size (0: the split auto used in OUT/throughput.json, else 4)")
    p.add_argument("--thrash-margins", default=None,
                   help="limit = steady peak allocated * (1 + margin), tried in order until the detector fires "
                        "(default 0.12,0.06,0.03: on H200 at microbatch 4 reserved/allocated is ~1.19 unconstrained; CPU 0.025,0.012)")
    p.add_argument("--thrash-batches", type=int, default=12)
    p.add_argument("--thrash-probe-fraction", type=float, default=0.6)
    p.add_argument("--thrash-search", default="bisect", choices=("bisect", "halve"))
    args = finish_args(p, argv)
    if args.thrash_margins is None:
        args.thrash_margins = "0.025,0.012" if args.device == "cpu" else "0.12,0.06,0.03"
    return args


def thrash_size(ctx: Ctx) -> tuple[int, str]:
    args = ctx.args
    if args.thrash_size:
        return args.thrash_size, "--thrash-size"
    path = os.path.join(args.out, "throughput.json")
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
        for c in doc.get("cases", []):
            if c["name"] == "auto-bisect" and c.get("final_split"):
                return int(max(c["final_split"])), f"auto-bisect split in {path}"
    except (OSError, ValueError, KeyError):
        pass
    return min(4, args.per_rank_batch), "default 4"


def suite_thrash(ctx: Ctx) -> None:
    args = ctx.args
    size, source = ctx.decide(thrash_size(ctx) if ctx.rank == 0 else None)
    ctx.extra["thrash_size"] = {"size": size, "source": source}
    if ctx.gpu:
        ctx.extra["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    probe = run_case(
        ctx, f"probe-{size}", fractions=(args.thrash_probe_fraction,) * ctx.world, batches=6,
        auto_kwargs={"search": "halve", "start_size": size}, note="peak memory at this size with room to spare",
    )
    peaks = None
    if ctx.rank == 0:
        rows = probe["rows"]
        use = [i for i, r in enumerate(rows) if r["batch"] >= 2 and r["size"] == size]
        peaks = [
            {"peak": max(r["per_batch"]["peak"][i] for i in use), "reserved_peak": max(r["per_batch"]["reserved_peak"][i] for i in use)}
            if use else None
            for r in probe["ranks"]
        ]
    peaks = ctx.decide(peaks)
    ctx.extra["probe_peaks"] = peaks
    results = []
    if not peaks or any(p is None for p in peaks):
        ctx.say("thrash: the probe did not run at the size; nothing to measure")
    else:
        for margin in [float(x) for x in args.thrash_margins.split(",")]:
            name = f"thrash-{size}-margin{margin:g}"
            if not ctx.within_budget(name):
                break
            fractions = tuple(min(1.0, round(p["peak"] * (1 + margin) / ctx.total_bytes, 6)) for p in peaks)
            case = run_case(
                ctx, name, fractions=fractions, batches=args.thrash_batches,
                auto_kwargs={"search": args.thrash_search, "start_size": size, "thrash_batches": 2},
                note=f"limit = steady peak x {1 + margin:g}",
            )
            fired = ctx.decide(bool(case.get("thrash_events")) if ctx.rank == 0 else None)
            if ctx.rank == 0:
                results.append(thrash_report(ctx, case, size, margin))
            if fired:
                break
    if ctx.rank == 0:
        ctx.extra["report"] = {
            "size": size,
            "probe_peaks": peaks,
            "candidates": results,
            "provoked": any(r["thrash_events"] for r in results),
            "retries_without_oom_seen": any(r["clean_batches_with_retries"] for r in results),
        }
    ctx.write(done=True)
    rows = [[r["name"], r["margin"], r["fractions"], r["clean_batches_with_retries"], r["ooms"], r["thrash_events"],
             r["size_before"], r["size_after"], fmt(r["tokens_per_s_before"], ",.0f"), fmt(r["tokens_per_s_after"], ",.0f")]
            for r in results]
    ctx.table(["case", "margin", "fractions", "batches w/ retries", "OOMs", "thrash", "size before", "size after",
                "tok/s before", "tok/s after"], rows)
    if ctx.rank == 0:
        rep = ctx.extra["report"]
        print(f"[bench] thrash provoked: {rep['provoked']}; retries without OOM seen: {rep['retries_without_oom_seen']}", flush=True)


def thrash_report(ctx: Ctx, case: dict[str, Any], size: int, margin: float) -> dict[str, Any]:
    rows = case["rows"]
    history = case.get("history") or []
    # retries per batch, any rank
    retries_any = [max(r["per_batch"]["retries"][i] for r in case["ranks"]) for i in range(len(rows))]
    clean_with_retries = [rows[i]["batch"] for i in range(len(rows)) if retries_any[i] > 0 and rows[i]["attempts"] == 1]
    thrash_at = [h["batch"] for h in history if h["outcome"] == "thrash"]
    first = thrash_at[0] if thrash_at else None
    before = [r for r in rows if r["batch"] >= 1 and r["attempts"] == 1 and r["size"] == size and (first is None or r["batch"] <= first)]
    final = rows[-1]["size"] if rows else None
    after = [r for r in rows if first is not None and r["batch"] > thrash_at[-1] and r["attempts"] == 1 and r["size"] == final]
    step_before = median([r["s"] for r in before])
    step_after = median([r["s"] for r in after[-ctx.args.steady_window:]])
    return {
        "name": case["name"],
        "margin": margin,
        "fractions": case["fractions"],
        "status": case["status"],
        "retries_per_batch_any_rank": retries_any,
        "clean_batches_with_retries": clean_with_retries,
        "ooms": case.get("ooms_total"),
        "thrash_events": case.get("thrash_events"),
        "thrash_batches": thrash_at,
        "thrash_records": [h for h in history if h["outcome"] == "thrash"],
        "size_before": size,
        "size_after": final if first is not None else None,
        "final_split": case.get("final_split"),
        "tokens_per_s_before": rnd(ctx.tokens_per_batch / step_before, 1) if step_before else None,
        "tokens_per_s_after": rnd(ctx.tokens_per_batch / step_after, 1) if step_after else None,
        "batches_before": [r["batch"] for r in before],
        "batches_after": [r["batch"] for r in after],
    }


def main(argv: Optional[list[str]] = None) -> int:
    return launch("thrash", parse_args(argv), suite_thrash)


if __name__ == "__main__":
    sys.exit(main())
