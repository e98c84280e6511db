"""Suite vs_plain: automicro with its hooks off at a fixed size vs plain Composer at that size, interleaved.

    python3 -m torch.distributed.run --standalone --nproc_per_node N benchmarks/vs_plain.py --out DIR \\
        --sizes 2,3,4,8 [--rounds 3 --window 3 --per-rank-batch 24]
    # one rank needs no launcher:  python3 benchmarks/vs_plain.py --out DIR --sizes 4
    # CPU check:  .venv/bin/python benchmarks/vs_plain.py --out DIR --device cpu --tiny --sizes 2

Per size, two trainers in one process, built once: `plain-m` (Composer's own batch step at
`device_train_microbatch_size=m`; automicro only shards) and `automicro-m`
(`AutoMicrobatching(search="halve", start_size=m, stable_batches=1)`: the sync hooks come off
after the first clean batch, in the untimed warm-up window; what is left per batch is the
end-of-batch consensus round and the collective ledger). Then `--rounds` rounds of one timed
window of `--window` batches each, plain, automicro, plain, automicro, …; on GPU one profiled
window each for the GPU busy fraction (host-bound or not). Then the same again with the
build and window order reversed, the rounds of both orders pooled (`cases.interleaved`). Ratio: automicro step time / plain
step time per round; "claimed" only when its range over the rounds is smaller than |median − 1|
(`harness.py`). The two trainers of a size are freed before the next size is built.
Writes DIR/vs_plain.json and DIR/vs_plain_table.txt.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from cases import Ctx, common_parser, finish_args, interleaved_args, fractions_arg, interleaved, main as launch  # noqa: E402


def parse_args(argv: Optional[list[str]] = None):
    p = common_parser(__doc__.split("\n")[0])
    p.set_defaults(fractions="none", per_rank_batch=24)
    p.add_argument("--sizes", default="2,3,4,8", help="fixed microbatch sizes (each should divide --per-rank-batch)")
    interleaved_args(p)
    return finish_args(p, argv)


def suite_vs_plain(ctx: Ctx) -> None:
    args = ctx.args
    rows = []
    for size in [int(x) for x in args.sizes.split(",")]:
        label = f"size-{size}"
        if not ctx.within_budget(label):
            break
        rep = interleaved(ctx, label, {
            f"plain-{size}": {"micro": size},
            f"automicro-{size}": {"micro": "auto", "auto_kwargs": {"search": "halve", "start_size": size, "stable_batches": 1}},
        }, rounds=args.rounds, window=args.window, warmup_windows=args.warmup_windows,
            profile=not args.no_profile, counterbalance=not args.no_counterbalance,
            fractions=fractions_arg(args.fractions))
        if ctx.rank == 0:
            rows += harness.comparison_rows(rep, label)
            auto = rep["variants"][f"automicro-{size}"]
            ctx.say(f"{label}: automicro hooks on in timed windows {auto['hooks_on_in_timed_windows']}, "
                    f"consensus rounds/batch {auto['rounds_per_batch']}, OOMs {auto['ooms_in_timed_windows']}; "
                    f"models freed {rep['models_freed']}")
    ctx.write(done=True)
    ctx.table(harness.COMPARISON_HEADER, rows)


def main(argv: Optional[list[str]] = None) -> int:
    return launch("vs_plain", parse_args(argv), suite_vs_plain)


if __name__ == "__main__":
    sys.exit(main())
