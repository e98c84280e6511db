"""Every trial recorded with a profile: its bound, the estimate `automicro.batch.trial_price` gives it, what it won.

    python3 benchmarks/trial_calibration.py [LOG ...]     # default: every *.log under docs/results/

Reads the console lines of recorded runs (`[automicro] a batch profiled: ...` then the trials decided after it),
rebuilds each profile, and prices each trial that ran after it with the run's figures (the microbatches of the
split, the per-rank batch); the static recompile (no profile: it comes first) is listed from every log with its
constant estimate. Prints a markdown table (trial, where, the bound, the estimate, what it won) and the mean
absolute error of the estimate and of the bound, per kind: what `trial_price`'s calibration is checked against
(`benchmarks/RESULTS.md`, "2026-12-03 — trials priced before they run"). Standard library and automicro only; no
GPU, no torch process group.
"""

from __future__ import annotations

import glob
import math
import os
import re
import statistics
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from automicro.batch import batch_profile, trial_price  # noqa: E402
from automicro.batch.batch_profile import BatchProfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = re.compile(r"a batch profiled: ([0-9.]+) s, the (\w+) busy ([0-9.]+)% \(idle ([0-9.]+)%\); FSDP2's own work ([0-9.]+)%"
                     r"(?: \(and the \w+ idle under its host code ([0-9.]+)%\))?, collectives ([0-9.]+)%, eager work a compile "
                     r"could fuse ([0-9.]+)%(?:, unattributed ([0-9.]+)%)?")
GAIN = r"\(([+-][0-9.]+)%; spread"
ONE_RANK = re.compile(r"one rank: (?:the model unsharded kept|FSDP2 kept); median batch .*? " + GAIN)
SCOPE = re.compile(r"compile: the whole model( \(unsharded\))?: (?:kept|not kept), median batch .*? " + GAIN)
SCOPE_KEPT = re.compile(r"compile: the whole model( \(unsharded\))?: kept; median batch .*? " + GAIN)
TRADE = re.compile(r"layout trial (grad_sync_once|no_reshard) \(.*?\): (?:kept|not kept); median batch .*? " + GAIN)
SIZE = re.compile(r"size trial: microbatch (\d+) against (\d+), the size found: (?:kept|not kept); median batch .*? " + GAIN)
STATIC = re.compile(r"compile: the blocks compiled again at the settled microbatch (\d+) .*?: (kept|not kept)[;,] median batch "
                    r"([0-9.]+) s compiled again, ([0-9.]+) s as the search")
SPLIT = re.compile(r"split in use \[([0-9, ]+)\]|at split \[([0-9, ]+)\]")
BATCH = re.compile(r"per-rank batch (\d+)")


def _profile(match: re.Match) -> BatchProfile:
    wall = float(match.group(1))
    share = lambda i: float(match.group(i) or 0.0) / 100.0 * wall  # noqa: E731
    return BatchProfile(wall, idle_s=share(4), fsdp_s=share(5), comm_s=share(7), fusable_s=share(8),
                        unattributed_s=share(9), device="cuda" if match.group(2) == "GPU" else match.group(2).lower(),
                        fsdp_idle_s=share(6))


def rows_of(path: str) -> list[dict[str, Any]]:
    lines = [line.split("[automicro] ", 1)[1].rstrip() for line in open(path, encoding="utf-8", errors="replace")
             if "[automicro] " in line]
    where = os.path.relpath(path, ROOT)
    per_rank = next((int(m.group(1)) for line in lines if (m := BATCH.search(line))), None)
    split: Optional[list[int]] = None
    profile: Optional[BatchProfile] = None
    out = []
    for line in lines:
        if (m := SPLIT.search(line)) is not None:
            split = [int(x) for x in (m.group(1) or m.group(2)).split(",")]
        if (m := STATIC.search(line)) is not None:
            again, search = float(m.group(3)), float(m.group(4))
            won = 100.0 * (1.0 - again / search)
            out.append({"trial": "static", "where": where, "bound": None, "estimate": 100 * trial_price.STATIC_WIN, "won": won})
            continue
        if (m := PROFILE.search(line)) is not None:
            profile = _profile(m)
            continue
        if profile is None:
            continue
        n = len(split) if split else 1
        measured = trial_price.Measured(batch_s=profile.wall_s, left=1000, planned=1000, profile=profile, microbatches=n)
        pct = lambda s: 100.0 * s / profile.wall_s  # noqa: E731
        if (m := ONE_RANK.search(line)) is not None:
            price = trial_price.price("one_rank", "one_rank", measured)
            out.append({"trial": "one_rank", "where": where, "bound": pct(profile.can_win(batch_profile.UNSHARDED)),
                        "estimate": pct(price.win_s), "won": float(m.group(1))})
        elif (m := SCOPE.search(line)) is not None:
            unsharded = bool(m.group(1))
            price = trial_price.price("scope", "scope", measured, unsharded=float(unsharded))
            out.append({"trial": "scope (unsharded)" if unsharded else "scope", "where": where,
                        "bound": pct(profile.can_win(batch_profile.SCOPE)), "estimate": pct(price.win_s), "won": float(m.group(2))})
        elif (m := TRADE.search(line)) is not None:
            price = trial_price.price(m.group(1), m.group(1), measured)
            out.append({"trial": m.group(1), "where": where, "bound": pct(profile.can_win(batch_profile.TRADE)),
                        "estimate": pct(price.win_s), "won": float(m.group(2))})
        elif (m := SIZE.search(line)) is not None and per_rank:
            size, found = int(m.group(1)), int(m.group(2))
            count = math.ceil(per_rank / size)
            at_found = trial_price.Measured(batch_s=profile.wall_s, left=1000, planned=1000, profile=profile,
                                            microbatches=math.ceil(per_rank / found))
            price = trial_price.price(f"size {size}", "smaller", at_found, microbatches=count)
            out.append({"trial": f"size {size} of {found}", "where": where, "bound": pct(profile.can_win(batch_profile.SMALLER)),
                        "estimate": pct(price.win_s), "won": float(m.group(3))})
    return out


def main(argv: list[str]) -> int:
    paths = argv or sorted(glob.glob(os.path.join(ROOT, "docs", "results", "**", "*.log"), recursive=True))
    rows = [row for path in paths for row in rows_of(path)]
    print("| trial | log | bound (%) | estimate (%) | won (%) |")
    print("|---|---|---|---|---|")
    for row in rows:
        bound = "–" if row["bound"] is None else f"{row['bound']:.1f}"
        print(f"| {row['trial']} | `{row['where']}` | {bound} | {row['estimate']:+.1f} | {row['won']:+.1f} |")
    kinds: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(row["trial"].split(" ")[0], []).append(row)
    print()
    print("| kind | trials | mean error of the estimate (points) | mean error of the bound (points) |")
    print("|---|---|---|---|")
    for kind, group in kinds.items():
        est = statistics.mean(abs(r["estimate"] - r["won"]) for r in group)
        bounded = [abs(r["bound"] - r["won"]) for r in group if r["bound"] is not None]
        print(f"| {kind} | {len(group)} | {est:.1f} | {statistics.mean(bounded):.1f} |" if bounded else f"| {kind} | {len(group)} | {est:.1f} | – |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
