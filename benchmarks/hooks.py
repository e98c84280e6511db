"""Suite hooks: step time with the sync hooks on vs off at one fixed size, interleaved.

    python3 -m torch.distributed.run --standalone --nproc_per_node N benchmarks/hooks.py --out DIR \\
        [--hooks-size 4 --combos all:auto,collectives:auto --rounds 3 --window 3]
    # CPU check:  .venv/bin/python benchmarks/hooks.py --out DIR --device cpu --tiny --hooks-size 2

Per combination of sync points (`all`, `collectives`) and consensus transport (`auto`, `shm`,
`process_group`), two trainers in one process, built once, both
`AutoMicrobatching(search="halve", start_size=--hooks-size)`: `hooks-off` (`stable_batches=1`: the
hooks come off after the first clean batch, in the warm-up window) and `hooks-on`
(`stable_batches` larger than the run: the hooks stay on). Then `--rounds` rounds of one timed
window each, off, on, off, on, …; on GPU one profiled window each (GPU busy fraction); then
the same with the order reversed, rounds pooled (`cases.interleaved`; `--on-first` starts with on). Ratio:
hooks-on / hooks-off step time per round, "claimed" only when its range is smaller than
|median − 1| (`harness.py`). At world size 1 every consensus round is local (no other process
takes part): the figure is the hooks' own host cost, not the cost of agreeing across ranks.
Writes DIR/hooks.json and DIR/hooks_table.txt.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from cases import Ctx, common_parser, finish_args, interleaved_args, fractions_arg, interleaved, main as launch  # noqa: E402

FOREVER = 10**9  # stable_batches that no run reaches: the hooks stay on


def parse_args(argv: Optional[list[str]] = None):
    p = common_parser(__doc__.split("\n")[0])
    p.set_defaults(fractions="none", per_rank_batch=24)
    p.add_argument("--hooks-size", type=int, default=4, help="the fixed microbatch size measured")
    p.add_argument("--combos", default="all:auto", help="sync_points:transport pairs, e.g. all:shm,collectives:process_group")
    interleaved_args(p)
    p.add_argument("--on-first", action="store_true",
                   help="hooks-on is variant A (the base; ratio off / on): checks that the order does not make the result")
    return finish_args(p, argv)


def suite_hooks(ctx: Ctx) -> None:
    args = ctx.args
    rows = []
    for combo in args.combos.split(","):
        sync_points, transport = combo.split(":")
        label = f"size-{args.hooks_size}-{sync_points}-{transport}"
        if not ctx.within_budget(label):
            break
        common = {"search": "halve", "start_size": args.hooks_size, "sync_points": sync_points, "consensus_transport": transport}
        variants = {
            "hooks-off": {"micro": "auto", "auto_kwargs": dict(common, stable_batches=1)},
            "hooks-on": {"micro": "auto", "auto_kwargs": dict(common, stable_batches=FOREVER)},
        }
        if args.on_first:
            label += "-on-first"
            variants = dict(reversed(list(variants.items())))
        rep = interleaved(ctx, label, variants, rounds=args.rounds, window=args.window, warmup_windows=args.warmup_windows,
            profile=not args.no_profile, counterbalance=not args.no_counterbalance,
            fractions=fractions_arg(args.fractions))
        if ctx.rank == 0:
            rows += harness.comparison_rows(rep, label)
            for name in ("hooks-off", "hooks-on"):
                v = rep["variants"][name]
                ctx.say(f"{label} {name}: hooks on in timed windows {v['hooks_on_in_timed_windows']}, "
                        f"consensus rounds/batch {v['rounds_per_batch']}, OOMs {v['ooms_in_timed_windows']}")
    ctx.write(done=True)
    ctx.table(harness.COMPARISON_HEADER, rows)


def main(argv: Optional[list[str]] = None) -> int:
    return launch("hooks", parse_args(argv), suite_hooks)


if __name__ == "__main__":
    sys.exit(main())
