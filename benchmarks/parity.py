"""Suite parity: auto vs the size it found, fixed from the start (plain Composer), on real text.

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/parity.py --out DIR --per-rank-batch 8
    ... --parity-control 3     # the noise floor: two plain runs at size 3, same seed and data

Per-batch losses of both runs (`report.losses`, read by `scripts/plot_run.py --parity`).
Writes DIR/parity.json.
"""

from __future__ import annotations

import os
import sys
import statistics
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import Ctx, common_parser, finish_args, fractions_arg, main as launch, rnd, run_case, splitfmt  # noqa: E402
from harness import fmt, median  # noqa: E402


def parse_args(argv: Optional[list[str]] = None):
    p = common_parser(__doc__.split("\n")[0])
    p.add_argument("--parity-steps", type=int, default=300)
    p.add_argument("--parity-control", type=int, default=0,
                   help="the noise floor instead: two plain runs at this fixed size, same seed and data")
    return finish_args(p, argv)


def suite_parity(ctx: Ctx) -> None:
    args = ctx.args
    fractions = fractions_arg(args.fractions)
    steps = args.parity_steps
    if args.parity_control:
        # Same run twice: how far two identical bf16 GPU runs drift apart (non-deterministic kernels).
        auto = run_case(ctx, f"control-fixed-{args.parity_control}", fractions=fractions, micro=args.parity_control,
                        batches=steps, text=True, losses=True, note="control: first of two identical runs")
        size = args.parity_control
    else:
        auto = run_case(ctx, "parity-auto", fractions=fractions, batches=steps, text=True, losses=True)
        split = ctx.decide(auto.get("final_split") if ctx.rank == 0 else None)
        size = int(max(split)) if split else args.per_rank_batch
    fixed = None
    if ctx.within_budget(f"parity-fixed-{size}"):
        fixed = run_case(ctx, f"parity-fixed-{size}", fractions=fractions, micro=size, batches=steps, text=True, losses=True,
                         note="plain Composer at the size auto settled on")
    if ctx.rank == 0:
        a = auto.get("losses") or []
        f = (fixed or {}).get("losses") or []
        diffs = [abs(x - y) for x, y in zip(a, f) if x is not None and y is not None]
        tail = 20
        ctx.extra["report"] = {
            "size": size,
            "losses": {"auto": a, "fixed": f},
            "max_abs_diff": rnd(max(diffs), 6) if diffs else None,
            "max_abs_diff_first_10": rnd(max(diffs[:10]), 6) if diffs else None,
            "mean_last20": {"auto": rnd(statistics.fmean([x for x in a[-tail:] if x is not None]), 5) if a else None,
                            "fixed": rnd(statistics.fmean([x for x in f[-tail:] if x is not None]), 5) if f else None},
            "first_loss": {"auto": a[0] if a else None, "fixed": f[0] if f else None},
        }
        print(f"[bench] parity: { {k: v for k, v in ctx.extra['report'].items() if k != 'losses'} }", flush=True)
    ctx.write(done=True)


def main(argv: Optional[list[str]] = None) -> int:
    return launch("parity", parse_args(argv), suite_parity)


if __name__ == "__main__":
    sys.exit(main())
