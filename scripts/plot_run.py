"""Draw a run's story from ``RUN_DIR/metrics.jsonl`` (no wandb needed):

    python scripts/plot_run.py RUN_DIR [-o run.png] [--all]

Panel 1: throughput (tokens/s, Composer's SpeedMonitor) per batch.
Panel 2: the microbatch size in use (step plot) and the number of microbatches per batch.
Both panels: grey background while automicro's sync hooks are on; a red x (with a dotted
line) for every attempt that ran out of memory, at the failing size and with the rank and
site; orange for thrash events; each trial's batches shaded in its own colour (the
`automicro/trial` traces), labelled with its name, what it decided and its cost. A run without
auto microbatching gets the throughput panel only.

The x axis is the 0-based batch index, as in the ``[automicro] batch N attempt M`` console
lines (Composer logs a batch's metrics at step N + 1). ``metrics.jsonl`` is appended to by each
launch into the same RUN_DIR; the plot shows the latest launch unless ``--all`` is given.

Loss parity (issue: auto vs the found size fixed from the start)::

    python scripts/plot_run.py --parity gpu_auto_parity.json [--control gpu_auto_parity_control.json] -o parity.png

reads the JSON of `benchmarks/parity.py` (older runs: `gpu_auto.py --suite parity`): panel 1 the two loss curves (grey
background while the auto run searched, red x at batches with an OOM), panel 2 |auto - fixed| per
batch and, with `--control` (the same suite run with `--parity-control SIZE`: two identical
fixed-size runs), the run-to-run noise floor |fixed - fixed| beside it, both with a 20-batch mean.

Needs matplotlib (``pip install -e '.[plot]'``). Exit status 2 with a message naming the path
when RUN_DIR or its metrics.jsonl is missing or holds no metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

TOKENS = "throughput/tokens_per_sec"
SAMPLES = "throughput/samples_per_sec"
MFU = "throughput/device/mfu"
SIZE = "automicro/microbatch_size"
BUDGET = "automicro/budget_tokens"  # budget: tokens (the size is then tokens per microbatch)
WASTE = "automicro/padding_waste"
COUNT = "automicro/num_microbatches"
HOOKS = "automicro/hooks_active"
EVENT = "automicro/event"
TRIAL = "automicro/trial"  # one trace per trial that ended (`automicro.batch.trial_plan.TrialPlan.take_records`)

OOM_COLOR = "#d62728"
THRASH_COLOR = "#ff7f0e"
HOOKS_COLOR = "#d9d9d9"
PROFILE_COLOR = "#e5e5c0"  # the profiled batch the trials are priced from
TRIAL_COLORS = ("#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#f7b6d2", "#dbdb8d", "#9edae5")


class PlotError(Exception):
    """A problem with the input, reported with exit status 2."""


@dataclass
class Run:
    name: str
    batches: dict[int, dict[str, Any]] = field(default_factory=dict)  # batch index -> merged metrics
    events: list[dict[str, Any]] = field(default_factory=list)
    trials: list[dict[str, Any]] = field(default_factory=list)  # the trials that ended, first batch first
    skipped_lines: int = 0

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs = [b for b in sorted(self.batches) if isinstance(self.batches[b].get(key), (int, float))]
        return xs, [float(self.batches[b][key]) for b in xs]

    def last(self, key: str) -> Optional[float]:
        xs, ys = self.series(key)
        return ys[-1] if ys else None


def metrics_path(run_dir: str) -> str:
    if os.path.isfile(run_dir) and run_dir.endswith(".jsonl"):
        return run_dir
    if not os.path.isdir(run_dir):
        raise PlotError(f"run directory not found: {run_dir}")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"no metrics.jsonl in {run_dir} (expected {path}; is loggers.jsonl true?)")
    return path


def read_run(path: str, all_launches: bool = False, default_name: str = "") -> Run:
    rows: list[dict[str, Any]] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1  # e.g. the last line of a killed run
                continue
            if isinstance(row, dict):
                rows.append(row)
    starts = [i for i, row in enumerate(rows) if row.get("trace") and isinstance(row.get("run_start"), dict)]
    name = default_name
    if starts:
        name = rows[starts[-1]]["run_start"].get("run_name") or name
        if not all_launches:
            rows = rows[starts[-1] :]
    run = Run(name=name, skipped_lines=skipped)
    for row in rows:
        step = row.get("step")
        if row.get("trace"):
            if isinstance(row.get(EVENT), dict):
                run.events.append(row[EVENT])
            if isinstance(row.get(TRIAL), dict):
                run.trials.append(row[TRIAL])
            continue
        if not isinstance(step, int):
            continue
        values = {k: v for k, v in row.items() if k != "step"}
        # Batch-end metrics (automicro/*, throughput/*) of batch N are logged at step N + 1.
        if any(k.startswith(("automicro/", "throughput/")) for k in values):
            run.batches.setdefault(step - 1, {}).update(values)
    if not run.batches and not run.events:
        raise PlotError(f"{path} holds no throughput/ or automicro/ metrics (is speed_monitor configured?)")
    return run


def spans(xs: list[int], flags: list[float]) -> list[tuple[float, float]]:
    """Contiguous runs of batches whose flag is 1, as (start, end) x ranges around the batches."""
    out: list[tuple[float, float]] = []
    start = prev = None
    for x, flag in zip(xs, flags):
        if flag >= 0.5 and start is not None and x == prev + 1:
            prev = x
        elif flag >= 0.5:
            if start is not None:
                out.append((start - 0.5, prev + 0.5))
            start = prev = x
        elif start is not None:
            out.append((start - 0.5, prev + 0.5))
            start = prev = None
    if start is not None:
        out.append((start - 0.5, prev + 0.5))
    return out


def trial_shades(run: Run) -> list[tuple[float, float, str, str]]:
    """Each trial that ended: (x from, x to, its colour, "name: what it decided, its cost"); one colour per trial
    name, in the order they first ran."""
    colors: dict[str, str] = {}
    out = []
    for trial in sorted(run.trials, key=lambda t: int(t.get("first", 0))):
        name = str(trial.get("trial", "trial"))
        color = PROFILE_COLOR if name == "profile" else colors.setdefault(name, TRIAL_COLORS[len(colors) % len(TRIAL_COLORS)])
        cost = trial.get("cost_s")
        text = name + (f": {trial['outcome']}" if trial.get("outcome") else "") + (f", {cost:+.2f} s" if isinstance(cost, (int, float)) else "")
        out.append((int(trial.get("first", 0)) - 0.5, int(trial.get("last", 0)) + 0.5, color, text))
    return out


def title_of(run: Run) -> str:
    lines = [run.name or "run"]
    facts = []
    found = run.last("automicro/found_size")
    split_size, split_count = run.last(SIZE), run.last(COUNT)
    tokens_budget = run.last(BUDGET) is not None
    if found:
        facts.append(f"token budget found {int(found):,}" if tokens_budget else f"microbatch size found {int(found)}")
    waste = run.last(WASTE)
    if tokens_budget and waste is not None:
        facts.append(f"padding {100 * waste:.1f}% of trained tokens")
    if split_size is not None and split_count is not None:
        facts.append(f"in use: {int(split_count)} microbatch{'es' if split_count != 1 else ''} of up to {int(split_size)}")
    ooms = run.last("automicro/ooms_total")
    if ooms is not None:
        oom_events = sum(1 for e in run.events if e.get("outcome") == "oom")
        thrash = run.last("automicro/thrash_events") or 0
        facts.append(f"{int(ooms)} OOM{'s' if ooms != 1 else ''}, {int(thrash)} thrash")
        if oom_events != ooms and run.events:
            facts[-1] += f" ({oom_events} OOM events logged)"
        search_s = run.last("automicro/search_time_s")
        if search_s:
            facts.append(f"{search_s:.1f} s in failed attempts")
    batches = max(run.batches) + 1 if run.batches else 0
    facts.append(f"{batches} batches")
    _, tokens = run.series(TOKENS)
    if tokens:
        facts.append(f"median {statistics.median(tokens):,.0f} tokens/s")
    mfu = run.last(MFU)
    if mfu is not None:
        facts.append(f"MFU {100 * mfu:.1f}%")
    line = ""
    for fact in facts:  # wrap between facts, about 105 characters a line
        if line and len(line) + 3 + len(fact) > 105:
            lines.append(line)
            line = fact
        else:
            line = f"{line} | {fact}" if line else fact
    lines.append(line)
    return "\n".join(lines)


def plot(run: Run, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    auto = any(SIZE in m for m in run.batches.values()) or bool(run.events)
    ratios = [1.0, 1.0, 0.38] if auto else [1.0]
    fig, axes = plt.subplots(
        len(ratios), 1, figsize=(11, 8.2 if auto else 4.5), sharex=True, squeeze=False,
        gridspec_kw={"height_ratios": ratios},
    )
    axes = [row[0] for row in axes]
    ax_tp = axes[0]

    hook_xs, hook_flags = run.series(HOOKS)
    # automicro/hooks_active is read at batch end: the batch at whose end the hooks came off
    # still ran with them, so a batch counts as guarded if its flag or its predecessor's is 1.
    at_end = dict(zip(hook_xs, hook_flags))
    guarded = [max(at_end[x], at_end.get(x - 1, 0.0)) for x in hook_xs]
    hook_spans = spans(hook_xs, guarded)
    oom_events = [e for e in run.events if e.get("outcome") == "oom"]
    thrash_events = [e for e in run.events if e.get("outcome") == "thrash"]
    trial_spans = trial_shades(run)
    for ax in axes:
        for lo, hi in hook_spans:
            ax.axvspan(lo, hi, color=HOOKS_COLOR, alpha=0.6, lw=0, zorder=0)
        for lo, hi, color, _ in trial_spans:
            ax.axvspan(lo, hi, color=color, alpha=0.55, lw=0, zorder=0)
        for events, color in ((oom_events, OOM_COLOR), (thrash_events, THRASH_COLOR)):
            for x in sorted({int(e.get("batch", -1)) for e in events}):
                ax.axvline(x, color=color, ls=":", lw=1.2, alpha=0.8, zorder=1)
        ax.grid(True, axis="y", alpha=0.3)

    # Panel 1: throughput.
    xs, tokens = run.series(TOKENS)
    label, unit = "tokens/s", TOKENS
    if not tokens:
        xs, tokens = run.series(SAMPLES)
        label, unit = "samples/s", SAMPLES
    if tokens:
        ax_tp.plot(xs, tokens, color="#1f77b4", marker="o", ms=3.5, lw=1.6, label=f"{label} ({unit})", zorder=3)
        ax_tp.set_ylim(bottom=0, top=max(tokens) * 1.15)
        ax_tp.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        first = xs[0]
        if first > 0:
            ax_tp.annotate(
                f"SpeedMonitor reports from batch {first}\n(once its window is full)",
                xy=(first, tokens[0]), xytext=(8, -28), textcoords="offset points", fontsize=8, color="#555555",
            )
    else:
        ax_tp.text(0.5, 0.5, "no throughput/* metrics (add callbacks.speed_monitor)", ha="center", va="center",
                   transform=ax_tp.transAxes, color="#555555")
    ax_tp.set_ylabel(label)
    ax_tp.set_title("throughput", loc="left", fontsize=10)
    for lo, hi, color, text in trial_spans:  # each trial named where it ran, top of the throughput panel
        ax_tp.annotate(text, xy=((lo + hi) / 2, 1.0), xycoords=("data", "axes fraction"), xytext=(0, -4),
                       textcoords="offset points", fontsize=7, rotation=90, ha="center", va="top", color="#333333",
                       zorder=6)

    handles = []
    if hook_spans:
        handles.append(Patch(color=HOOKS_COLOR, alpha=0.6, label="sync hooks on (searching / settling)"))
    if trial_spans:
        handles.append(Patch(color=trial_spans[0][2], alpha=0.55, label="a trial's batches (named above: what it decided, cost)"))
    if oom_events:
        handles.append(Line2D([], [], color=OOM_COLOR, marker="x", ls=":", ms=9, mew=2, label="OOM (failed attempt)"))
    if thrash_events:
        handles.append(Line2D([], [], color=THRASH_COLOR, marker="x", ls=":", ms=9, mew=2, label="thrash"))

    # Panel 2: microbatch size and count.
    if auto:
        ax_mb = axes[1]
        budget_xs, budgets = run.series(BUDGET)
        sx, sizes = (budget_xs, budgets) if budgets else run.series(SIZE)
        what = "token budget per microbatch" if budgets else "microbatch size (largest of the split)"
        ax_mb.step(sx, sizes, where="mid", color="#2ca02c", lw=2.2, label=what, zorder=3)
        ax_mb.plot(sx, sizes, ls="", marker="o", ms=3, color="#2ca02c", zorder=3)
        found = run.last("automicro/found_size")
        if found:
            ax_mb.axhline(found, color="#555555", ls="--", lw=1, zorder=2,
                          label=f"largest budget that ran: {int(found):,} tokens (batches packed under it)" if budgets
                          else f"largest size that fit: {int(found)} (the batch is then split evenly)")
        ax_n = axes[2]
        cx, counts = run.series(COUNT)
        ax_n.step(cx, counts, where="mid", color="#9467bd", lw=2, zorder=3)
        ax_n.plot(cx, counts, ls="", marker="o", ms=3, color="#9467bd", zorder=3)
        ax_n.set_ylabel("microbatches\nper batch")
        ax_n.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
        ax_n.set_ylim(0, max(counts or [1]) * 1.35 + 0.3)
        top = max(sizes + [float(e.get("size", 0)) for e in run.events] + [1.0])
        for events, color, word in ((oom_events, OOM_COLOR, "OOM"), (thrash_events, THRASH_COLOR, "thrash")):
            for e in events:
                x, y = int(e.get("batch", -1)), float(e.get("size", 0))
                ax_mb.plot([x], [y], marker="x", color=color, ms=11, mew=2.5, ls="", zorder=5)
                where = ""
                if e.get("ranks"):
                    ranks = ",".join(str(r) for r in e["ranks"])
                    where = f"\nrank {ranks}" + (f" @ {e['site']}" if e.get("site") else "")
                ax_mb.annotate(
                    f"{word} at {int(y)}{where}", xy=(x, y), xytext=(8, 5), textcoords="offset points",
                    fontsize=8, color=color, va="bottom", zorder=6,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
                )
        ax_mb.set_ylim(0, top * 1.55 + 0.5)  # headroom for the legend above the curve
        ax_mb.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax_mb.set_ylabel("tokens per microbatch" if budgets else "samples per microbatch")
        ax_mb.set_title(
            f"auto microbatching: {'token budget' if budgets else 'microbatch size'} per batch, failed attempts marked",
            loc="left", fontsize=10,
        )
        lines = ax_mb.get_legend_handles_labels()[0]
        ax_mb.legend(handles=lines + handles, loc="upper right", fontsize=8, framealpha=0.9)
    elif handles:
        ax_tp.legend(handles=handles, loc="lower right", fontsize=8)
    if tokens:
        ax_tp.legend(handles=ax_tp.get_legend_handles_labels()[0] + ([] if auto else handles), loc="lower right",
                     fontsize=8, framealpha=0.9)

    last_ax = axes[-1]
    last_ax.set_xlabel("batch (0-based, as in the [automicro] console lines)")
    last_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    all_x = list(run.batches) + [int(e.get("batch", 0)) for e in run.events]
    if all_x:
        last_ax.set_xlim(min(all_x) - 0.7, max(all_x) + 0.7)
    fig.suptitle(title_of(run), fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def read_parity(path: str) -> dict[str, Any]:
    """Losses and the auto run's search batches from a gpu_auto parity JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise PlotError(f"{path}: cannot read the parity JSON ({error})") from None
    report = doc.get("report") or {}
    losses = report.get("losses") or {}
    first, second = losses.get("auto") or [], losses.get("fixed") or []
    if not first or not second:
        raise PlotError(f"{path}: no losses under report.losses (is it the JSON of `benchmarks/parity.py`?)")
    cases = doc.get("cases") or []
    names = [c.get("name", "") for c in cases]
    rows = cases[0].get("rows", []) if cases else []
    return {
        "names": names,
        "first": first,
        "second": second,
        "size": report.get("size"),
        "searching": [i for i, r in enumerate(rows) if r.get("hooks")],
        "oom_batches": [r["batch"] for r in rows if r.get("attempts", 1) > 1],
        "title": f"{doc.get('model')} seq {doc.get('seq_len')}, {doc.get('world_size')} x {doc.get('device')}, torch {doc.get('torch')}",
    }


def _moving_mean(values: list[float], window: int = 20) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_parity(parity: dict[str, Any], control: Optional[dict[str, Any]], out: str) -> dict[str, float]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, f = parity["first"], parity["second"]
    n = min(len(a), len(f))
    xs = list(range(n))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for lo, hi in spans(xs, [1.0 if i in set(parity["searching"]) else 0.0 for i in xs]):
        top.axvspan(lo, hi, color=HOOKS_COLOR, lw=0)
    top.plot(xs, a[:n], lw=1.2, label=f"auto ({parity['names'][0] if parity['names'] else 'auto'})")
    top.plot(xs, f[:n], lw=1.2, ls="--", label=f"fixed size {parity['size']} from the start")
    for b in parity["oom_batches"]:
        if b < n:
            top.plot([b], [a[b]], "x", color=OOM_COLOR, ms=8)
    top.set_yscale("log")
    top.set_ylabel("train loss (per batch)")
    top.legend(loc="upper right")
    top.set_title(f"Loss parity: auto microbatching vs the found size fixed\n{parity['title']}")
    diff = [abs(x - y) for x, y in zip(a[:n], f[:n])]
    bottom.plot(xs, diff, lw=0.6, alpha=0.5, color="C0")
    bottom.plot(xs, _moving_mean(diff), lw=1.6, color="C0", label="|auto - fixed|, 20-batch mean")
    summary = {"mean_abs_diff": sum(diff) / len(diff)}
    if control is not None:
        c1, c2 = control["first"], control["second"]
        m = min(len(c1), len(c2), n)
        noise = [abs(x - y) for x, y in zip(c1[:m], c2[:m])]
        bottom.plot(xs[:m], noise, lw=0.6, alpha=0.4, color="grey")
        bottom.plot(xs[:m], _moving_mean(noise), lw=1.6, color="black", ls=":",
                    label="noise floor: |fixed - fixed| (two identical runs), 20-batch mean")
        summary["control_mean_abs_diff"] = sum(noise) / len(noise)
    bottom.set_ylabel("absolute loss difference")
    bottom.set_xlabel("batch")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", help="the run's run_dir (holding metrics.jsonl), or the metrics.jsonl itself")
    parser.add_argument("--parity", default=None, help="plot loss parity from a gpu_auto parity JSON instead")
    parser.add_argument("--control", default=None, help="with --parity: the parity-control JSON (noise floor)")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: RUN_DIR/run.png)")
    parser.add_argument("--all", action="store_true", help="plot every launch appended to metrics.jsonl, not just the latest")
    parser.add_argument("--name", default=None, help="run name for the title (default: the name the run logged)")
    args = parser.parse_args(argv)
    if args.parity is not None or args.control is not None:
        return _main_parity(args)
    if args.run_dir is None:
        parser.error("give RUN_DIR (or --parity JSON)")
    try:
        path = metrics_path(args.run_dir)
        default_name = os.path.basename(os.path.normpath(os.path.dirname(os.path.abspath(path))))
        run = read_run(path, all_launches=args.all, default_name=default_name)
    except PlotError as error:
        print(f"plot_run: {error}", file=sys.stderr)
        return 2
    if args.name:
        run.name = args.name
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_run: matplotlib is not installed: pip install -e '.[plot]' (or pip install matplotlib)", file=sys.stderr)
        return 2
    out = args.output or os.path.join(os.path.dirname(os.path.abspath(path)), "run.png")
    plot(run, out)
    if run.skipped_lines:
        print(f"plot_run: skipped {run.skipped_lines} unreadable line(s) of {path}", file=sys.stderr)
    print(f"plot_run: wrote {out} ({run.name}: {len(run.batches)} batches, {len(run.events)} events)")
    return 0


def _main_parity(args: argparse.Namespace) -> int:
    if args.parity is None:
        print("plot_run: --control needs --parity", file=sys.stderr)
        return 2
    try:
        parity = read_parity(args.parity)
        control = read_parity(args.control) if args.control else None
    except PlotError as error:
        print(f"plot_run: {error}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_run: matplotlib is not installed: pip install -e '.[plot]' (or pip install matplotlib)", file=sys.stderr)
        return 2
    out = args.output or os.path.splitext(args.parity)[0] + ".png"
    summary = plot_parity(parity, control, out)
    print(f"plot_run: wrote {out} ({len(parity['first'])} batches; "
          + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
