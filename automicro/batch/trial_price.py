"""What a trial is expected to win and what it will cost, priced before it runs from what this run measured.

A trial is a cost every run pays: its batches at the slower arm and, for some, a compile. A bound (what a
trial *can* win at most: `batch_profile`'s shares) let through trials that lost 40-130%, so each trial is
priced instead, from what this run has already measured:

- the settled batch (its seconds, and where a profiled batch's time goes: `batch_profile.BatchProfile`);
- a microbatch's fixed cost (what one more microbatch of the same batch costs): fitted from the batches that
  ran at two or more microbatch counts without a compile (the search's own), else the profiled batch's host idle,
  FSDP2's own work and collectives spread over its microbatches (they repeat per microbatch);
- the allocator's retries in the settled batches (a smaller microbatch wins mainly where the largest retries);
- one graph's compile, as dynamo timed this run's compiles (`compile_s`), and the compiled blocks' count;
- whether a microbatch size the run has not trained yet compiles a graph (`sizes_compile`): the last batch that
  trained one (2 or more: dynamo specializes 1) compiled none once the blocks' graph is dynamic in the batch (dynamo
  marks it so at the second size it sees); a trial at a new size then costs no compile. Mixtral's and OLMoE's fused
  head on one H100 were priced 10.2 and 9.7 s with one (a graph's median compile, 7-8 s) and cost 1.3 and 0.7 s, and
  the opening budget refused them for it;
- the blocks' whole first compile, as this launch's first batch took it beyond a settled batch (`first_compile_s`):
  a compile that does it again (the static recompile, the twin's blocks) costs at least that. One graph's median
  under-prices a block whose graph breaks: a routed model's experts on one H100 (transformers 5.17, 18 graphs)
  were priced 8.8 s for the twin's compile, which took 27 s, as the first compile had (31.5 s).

Each kind of trial's **expected win** per batch is a calibrated share of those figures (below; checked against
every trial recorded with a profile: `benchmarks/RESULTS.md`, "2026-12-03 — trials priced before they run"), and
its **predicted cost** is what it spends before it can keep anything: its compile(s) and its arms' batches at
the expected difference (at least `NOISE` of a batch: a trial that decides level still moves its batches).

`Budget` keeps them all within `BUDGET_SHARE` of the run's planned seconds (planned batches x the settled
batch), raised by `WON_SHARE` of what the trials kept have won as timed (their arms' medians) over the batches left
when each was kept: a trial runs only where its expected win over the batches left is at least `MARGIN` times its
predicted cost, where it is expected to clear its own rule for keeping, and where its cost fits what is left
of the budget, the best expected value first (`allocate`). What the trials spend stays under 1% of the run plus
what they won: never a net loss over the run.

Owns: the estimates, their calibration, the costs and the budget. May not touch: which trial holds the batch
(`trial_plan`), how a trial times its arms, torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from automicro.batch.batch_profile import BatchProfile

# ---- the rules of the price ---------------------------------------------------------------------------
BUDGET_SHARE = 0.01  # all trials together: 1% of the run's planned seconds
# ... raised by this share of what the trials kept have won, as timed, over the batches left when each was kept: the
# trials spend at most 1% of the run and half of what they already won (never a net loss over the run).
WON_SHARE = 0.5
MARGIN = 2.0  # a trial's expected win over the batches left must be this many times its predicted cost
NOISE = 0.02  # the least a trial's arm batches cost, as a share of a batch (trials that decide level move this much)
ARM_BATCHES = 3  # the batches of a trial's losing arm (3 a side at most; 2 where the spread is tiny)
# What the profile costs, in batches: the profiled batch took 1.8-3.5x a settled one on one H200 (the profiler's own
# host and device bookkeeping), the clocked batch before it a little more than one.
PROFILE_BATCHES = 2.0

# ---- calibration (benchmarks/RESULTS.md, "2026-12-03 — trials priced before they run": every trial recorded
# with a profile, its bound, this estimate and what it won) -----------------------------------------------
# The model unsharded on one rank removes FSDP2's own work (its casts and copies, and the device idle while its host
# code runs) at most. On the whole card, where that was 3-9% of a batch, it won -6.1% to +1.5% (TinyLlama's Llama,
# OLMo-2 1B, Qwen2.5-0.5B, GPT-2 large, one H200, twice each): nothing to expect below `UNSHARDED_FLOOR`. Where FSDP2's
# work was a large share it won most of it (Qwen2.5 +10.9% of 13.2% + 4.6% unattributed; under a memory cap, host-bound
# at small microbatches, 1.9x).
UNSHARDED_OF_FSDP = 0.8
UNSHARDED_FLOOR = 0.08
# A layout trade removes a share of FSDP2's work and collectives: no_reshard the all-gather again in backward (half
# of the gathers), grad_sync_once all but the last microbatch's reduce-scatter (of the other half).
TRADE_OF_FSDP_AND_COMM = {"no_reshard": 0.4, "grad_sync_once": 0.25}
# The whole model compiled fuses some of the eager work outside the blocks; under FSDP2 its hooks break the graph
# at every block and it lost on every family but one (-21.4%, -8%, -3.4%, -3.1%; +1.8%): a loss of its own.
SCOPE_OF_FUSABLE = 0.15
SCOPE_FSDP2_LOSS = 0.03
# The blocks compiled again, static at the settled size: the mean of what 13 recorded recompiles won where kept
# (+2.6% .. -3.4%; the losing ones undone): 0.8% of a batch. One in four loses and compiles a third time.
STATIC_WIN = 0.008
STATIC_LOSES = 0.25
# A whole-model compile, in graphs of the blocks' compile: under FSDP2 dynamo compiles about four blocks' worth
# (6.6 s against 1.4 s, 12.5 against 4.6, 17.7 against 4.4 on one H200); unsharded, every block inlined (62 s
# against 2.9 s for 24 layers, 70 against 2.7 for 22): one graph per block.
SCOPE_FSDP2_GRAPHS = 4.0
# Packed rows remove the padding's device work; attention pays more than the rest for it (2.14x with flex at
# 35% padding): the padding's share.
PACKING_OF_PADDING = 1.0
# Activation checkpointing recomputes each block's forward in backward: about a quarter of the device's busy time.
RECOMPUTE_OF_BUSY = 0.25
# The fused head runs the plain head's matrix products and replaces its eager work over the vocabulary (the fp32
# upcast, the log-softmax, the loss and their backward: several passes over microbatch x sequence x vocabulary) with
# one pass a chunk. Won at the same microbatch count, over the head's eager work in the profile (one H200, liger-kernel,
# `benchmarks/RESULTS.md` "2026-12-04 — the vocabulary head"): Qwen2.5-0.5B 19.8 of 21.3%, Llama-3.2 1B 9.7 of 10.6%,
# OLMo-2 1B 7.3 of 8.2%, TinyLlama 2.7 of 3.0% (0.89-0.93); Gemma-3 1B 23.3 of 16.9%, with 4 microbatches fewer.
HEAD_EAGER_SAVED = 0.9
# Its measuring batch at the probe's split (17 microbatches of 1 and 2 samples in a batch of 32) cost 2.9-6.8 batches over
# the settled one on those five (median 3.7): what it costs where the size found leaves no split near it. Since, it
# runs near the size found's largest microbatch (`automicro.core.policy.near_split`: (16, 15, 1) for 16 x 2): its extra
# microbatches at the fitted fixed cost, not measured on a GPU yet.
HEAD_MEASURE_BATCHES = 4.0

# What a kind of trial is expected to win from, for the words of its line.
KINDS = ("static", "packing", "one_rank", "scope", "grad_sync_once", "no_reshard", "together", "no_recompute",
         "recompute_op", "smaller", "downsize", "upsize", "fused_head")
# The recompute trades a downsize trial may carry (their own estimates are its gains).
RECOMPUTE_TRADES = ("no_recompute", "recompute_op")


@dataclass(frozen=True)
class Measured:
    """What this run has measured, as every rank agreed (the plan's)."""

    batch_s: float  # the settled batch's seconds
    left: int  # batches left of the planned run
    planned: int  # the run's planned batches
    planned_known: bool = True  # `planned` is the loop's (max_duration), not the default
    profile: Optional[BatchProfile] = None
    microbatches: int = 1  # of the settled split
    microbatch_fit_s: Optional[float] = None  # one more microbatch's cost, fitted from the search's batches
    retried_share: float = 0.0  # share of the settled batches with allocator retries
    graph_compile_s: float = 0.0  # one graph's compile as timed here (0: nothing compiled)
    blocks: int = 0  # compiled blocks (0: eager)
    first_compile_s: float = 0.0  # the first batch's seconds beyond a settled batch, where it ran in one attempt (0: unknown)
    sizes_compile: bool = True  # a microbatch size not trained yet compiles a graph (False: the last one did not)
    padding_share: float = 0.0  # budget: tokens: share of the trained tokens that were padding

    def microbatch_s(self) -> tuple[float, str]:
        """One more microbatch's cost, and where it comes from."""
        if self.microbatch_fit_s is not None:
            return max(0.0, self.microbatch_fit_s), "fitted from the batches timed at other microbatch counts"
        p = self.profile
        if p is None:
            return 0.0, "unknown (no profile)"
        per = (p.idle_s + p.fsdp_s + p.comm_s) / max(1, self.microbatches)
        return per, f"the profile's idle, FSDP2's work and collectives over its {self.microbatches} microbatch(es)"


@dataclass(frozen=True)
class Price:
    """A trial's expected win per batch (seconds; negative: expected to lose) and predicted cost (seconds)."""

    label: str
    kind: str
    win_s: float
    cost_s: float
    basis: str  # where the expected win comes from, in words
    costs: str  # what the cost is, in words
    keeps_on_gain: bool = True  # kept only where faster by its rule for keeping (the static recompile is not)

    def value(self, left: int) -> float:
        return self.win_s * left - self.cost_s

    def share(self, batch_s: float) -> str:
        return f"{100.0 * self.win_s / batch_s:+.1f}%" if batch_s > 0 else "0%"


def fit_microbatch_cost(points: Iterable[tuple[int, int, float]]) -> Optional[float]:
    """The fixed cost of one microbatch from batches `(microbatches, samples, seconds)` timed without a compile or a
    retry: least squares of ``seconds = a * microbatches + b * samples`` over two or more microbatch counts (None with
    fewer); ``a`` is the fixed cost. Each microbatch count's median counts once (outliers do not steer the line)."""
    by: dict[tuple[int, int], list[float]] = {}
    for count, samples, seconds in points:
        by.setdefault((count, samples), []).append(seconds)
    rows = [(n, s, statistics.median(t)) for (n, s), t in by.items()]
    if len({n for n, _, _ in rows}) < 2:
        return None
    # Normal equations of a two-column fit (no intercept: a batch of no microbatch and no sample costs nothing).
    snn = sum(n * n for n, _, _ in rows)
    sss = sum(s * s for _, s, _ in rows)
    sns = sum(n * s for n, s, _ in rows)
    snt = sum(n * t for n, _, t in rows)
    sst = sum(s * t for _, s, t in rows)
    det = snn * sss - sns * sns
    if abs(det) < 1e-12:
        # One sample count throughout: seconds = a * n + c; the slope of the line through the counts' medians.
        ns = [n for n, _, _ in rows]
        ts = [t for _, _, t in rows]
        mean_n, mean_t = statistics.mean(ns), statistics.mean(ts)
        var = sum((n - mean_n) ** 2 for n in ns)
        return sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / var if var else None
    return (snt * sss - sst * sns) / det


def seconds(value: float) -> str:
    """Seconds for a line: two decimals under 10 s, one above."""
    return f"{value:.2f} s" if abs(value) < 10 else f"{value:.1f} s"


def _arms(win_s: float, m: Measured, batches: int = ARM_BATCHES) -> float:
    return batches * max(abs(win_s), NOISE * m.batch_s)


def _pct(seconds: float, m: Measured) -> str:
    return f"{100.0 * seconds / m.batch_s:.1f}%" if m.batch_s > 0 else "0%"


def price(label: str, kind: str, m: Measured, **facts: float) -> Optional[Price]:
    """The price of trial `label` of `kind` (`KINDS`), or None where it cannot be priced (no profile for a kind
    that needs one). `facts`: ``microbatches`` (the trial arm's count: a size trial's, a downsize or upsize
    trial's), ``trades`` (a downsize trial's trades, joined by "+"), ``selective`` and ``measured`` (an upsize trial
    of the ``op`` rung; one after its measuring batch), ``unsharded`` (1: the scope trial would
    compile the model's unsharded twin), ``compiles`` (0: the trial compiles nothing), ``fraction`` (a token budget's
    size trial: its share of the budget found)."""
    p, w = m.profile, m.batch_s
    compiles = facts.get("compiles", 1.0) and m.graph_compile_s > 0
    graph = m.graph_compile_s if compiles else 0.0
    sized = graph if m.sizes_compile else 0.0  # the compile a trial at a new microbatch size makes (the same graph else)
    # The blocks compiled again: at least what their first compile took (`first_compile_s`).
    blocks_again = max(graph, m.first_compile_s if compiles else 0.0)
    if kind == "static":
        win = STATIC_WIN * w
        cost = blocks_again * (1.0 + STATIC_LOSES) + _arms(win, m)
        return Price(label, kind, win, cost, f"{100 * STATIC_WIN:.1f}% of a batch (what recompiles at the settled size "
                     "won, on average)", f"a compile of the blocks ({seconds(blocks_again)}"
                     + (", as their first compile took" if blocks_again > graph else "") + ") and its arms' batches", keeps_on_gain=False)
    if kind == "packing":
        win = PACKING_OF_PADDING * m.padding_share * w
        return Price(label, kind, win, _arms(win, m), f"the padding, {100 * m.padding_share:.1f}% of the tokens", "its arms' batches")
    if p is None:
        return None
    a, a_from = m.microbatch_s()
    n = max(1, m.microbatches)
    if kind == "one_rank":
        own = p.fsdp_s + p.fsdp_idle_s
        win = UNSHARDED_OF_FSDP * max(0.0, own - UNSHARDED_FLOOR * w)
        graphs = facts.get("graphs", 1.0)
        compile_s = max(graphs * graph, blocks_again)
        twin = (f"the twin's compile ({seconds(compile_s)}, as their first compile took)" if compile_s > graphs * graph
                else f"the twin's compile ({graphs:g} graph(s) of {seconds(graph)})")
        return Price(label, kind, win, compile_s + _arms(win, m),
                     f"{UNSHARDED_OF_FSDP:g} x FSDP2's own work beyond {100 * UNSHARDED_FLOOR:g}% of a batch ({_pct(own, m)}"
                     + (f", {_pct(p.fsdp_idle_s, m)} of it the device idle under FSDP2's host code)" if p.fsdp_idle_s else ")"),
                     (f"{twin} and " if graph else "") + "its arms' batches")
    if kind == "scope":
        unsharded = bool(facts.get("unsharded"))
        win = SCOPE_OF_FUSABLE * p.fusable_s - (0.0 if unsharded else SCOPE_FSDP2_LOSS * w)
        graphs = max(1, m.blocks) if unsharded else SCOPE_FSDP2_GRAPHS
        compile_s = graphs * m.graph_compile_s
        basis = f"{SCOPE_OF_FUSABLE:g} x the eager work a compile could fuse ({_pct(p.fusable_s, m)})"
        if not unsharded:
            basis += f", less {100 * SCOPE_FSDP2_LOSS:g}% (FSDP2's hooks break its graph at every block)"
        what = f"the whole model {'unsharded ' if unsharded else ''}compiled ({graphs:g} graphs of the blocks' {seconds(m.graph_compile_s)})"
        return Price(label, kind, win, compile_s + _arms(win, m), basis, what + " and its arms' batches")
    if kind in TRADE_OF_FSDP_AND_COMM:
        share = TRADE_OF_FSDP_AND_COMM[kind] * (1.0 if kind == "no_reshard" else (n - 1) / n)
        own = p.fsdp_s + p.fsdp_idle_s + p.comm_s
        win = share * own
        return Price(label, kind, win, _arms(win, m),
                     f"{share:.2g} x FSDP2's own work and collectives ({_pct(own, m)})", "its arms' batches")
    if kind == "together":  # trades each faster by too little, tried together: the sum of their estimates
        trades = [t for t in str(facts.get("trades", "")).split("+") if t in TRADE_OF_FSDP_AND_COMM]
        win = sum(price(label, t, m).win_s for t in trades)  # type: ignore[union-attr]
        return Price(label, kind, win, _arms(win, m), "the sum of its trades' estimates", "its arms' batches")
    if kind == "no_recompute":
        win = RECOMPUTE_OF_BUSY * (p.wall_s - p.idle_s)
        return Price(label, kind, win, _arms(win, m) + w, f"the forward recomputed, {RECOMPUTE_OF_BUSY:g} x the device's busy time",
                     "its arms' batches and one batch an OOM may rerun")
    if kind == "recompute_op":
        # Full recompute asked for by hand, tried down to ``op``: the blocks' matrix products and attention no longer run
        # twice (their share of the recomputed forward: of the batch's, as the profile shows them); a compiled block
        # compiles its selective graph once.
        win = RECOMPUTE_OF_BUSY * p.products_s
        return Price(label, kind, win, graph + _arms(win, m) + w,
                     f"the matrix products and attention not recomputed, {RECOMPUTE_OF_BUSY:g} x their device time "
                     f"({_pct(p.products_s, m)})",
                     ("a compile of the blocks' selective graph, " if graph else "") + "its arms' batches and one batch an OOM may rerun")
    if kind == "fused_head":
        # Fewer microbatches where the size it fits (predicted from the plain head's measured bytes) is larger, and
        # part of the head's eager work; its measuring batch runs at the probe's split.
        count = int(facts.get("microbatches", n)) or n
        eager = HEAD_EAGER_SAVED * p.head_eager_s
        win = (n - count) * a + eager
        measuring = int(facts.get("measure_microbatches", 0)) if facts.get("measure", 0.0) else 0
        if not measuring:
            measure = 0.0
        elif facts.get("near", 0.0):
            measure = max(0, measuring - n) * a + NOISE * w
        else:
            measure = HEAD_MEASURE_BATCHES * w
        compile_s = sized if count != n else 0.0
        # Tried past the policy's margin (`automicro.batch.layout_trials.LayoutTrials._past_margin`): an OOM at that
        # size reruns one batch, as an upsize's or a downsize's may.
        rerun = w if facts.get("past_margin", 0.0) else 0.0
        basis = (f"{HEAD_EAGER_SAVED:g} x the head's eager work ({_pct(p.head_eager_s, m)})"
                 + (f" and {n - count} fewer microbatch(es) at {_pct(a, m)} each ({a_from})" if count != n else ""))
        where = "near the size found" if facts.get("near", 0.0) else "at the probe's split"
        costs = ((f"a measuring batch {where}, " if measuring else "") + ("a compile at the new size and " if compile_s else "")
                 + "its arms' batches" + (" and one batch an OOM past the margin may rerun" if rerun else ""))
        return Price(label, kind, win, measure + compile_s + _arms(win, m) + rerun, basis, costs)
    fraction = facts.get("fraction")
    count = int(facts.get("microbatches", math.ceil(n / fraction) if fraction else n))
    if kind == "smaller":
        retry = m.retried_share * p.idle_s
        padding = PACKING_OF_PADDING * m.padding_share * (1.0 - fraction) * w if fraction else 0.0
        win = retry + padding - (count - n) * a
        basis = (f"{count - n} more microbatch(es) at {_pct(a, m)} each ({a_from})"
                 + (f", less the allocator's retries in {100 * m.retried_share:.0f}% of the settled batches (the idle, {_pct(p.idle_s, m)})" if retry else "; no allocator retries at the size found")
                 + (f", less padding ({100 * m.padding_share:.1f}% of the tokens)" if padding else ""))
        return Price(label, kind, win, sized + _arms(win, m), basis, "a compile at the new size and its arms' batches" if sized else "its arms' batches")
    if kind == "downsize":
        gains = sum(price(label, t, m).win_s for t in str(facts.get("trades", "")).split("+") if t in TRADE_OF_FSDP_AND_COMM or t in RECOMPUTE_TRADES)
        win = gains - (count - n) * a
        return Price(label, kind, win, sized + _arms(win, m) + w,
                     f"its trades' estimates less {count - n} more microbatch(es) at {_pct(a, m)} each ({a_from})",
                     ("a compile at the new size, " if sized else "") + "its arms' batches and one batch an OOM may rerun")
    if kind == "upsize":
        # Checkpointing on for a larger microbatch: fewer microbatches, the forward recomputed. Before its bytes are
        # measured the largest microbatch is not known: priced at the whole batch in one (the most it can win).
        # ``selective`` (the ``op`` rung, up from none): only the work outside the matrix products and attention runs
        # again; a compiled block compiles its selective graph at the measuring split and at the new size.
        # ``measured``: the trial at the size its measured bytes fit, after its measuring batch: that batch and the
        # compile it made are spent (priced again, Mixtral's ``op`` on one H100 was refused 12.3 s short of its 19.8 s
        # after its measuring batch had spent 17.4 s of it), the compile at the new size and its arms' batches are left.
        selective = bool(facts.get("selective"))
        measured = bool(facts.get("measured"))
        busy = p.wall_s - p.idle_s
        recomputed = RECOMPUTE_OF_BUSY * (max(0.0, busy - p.products_s) if selective else busy)
        win = (n - count) * a - recomputed
        # Full recompute's hooks sit outside the compiled forward: its new size is the size's compile alone.
        compile_s = graph * (2.0 if not measured else 1.0) if selective else sized
        what = (f"the work outside the matrix products and attention recomputed ({RECOMPUTE_OF_BUSY:g} x the device's busy "
                f"time beyond them, {_pct(max(0.0, busy - p.products_s), m)})" if selective else
                f"the forward recomputed ({RECOMPUTE_OF_BUSY:g} x the device's busy time)")
        if measured:
            costs = ("a compile of the blocks' selective graph at the new size" if selective else "a compile at the new size")
            costs = (costs + ", " if compile_s else "") + "its arms' batches and one batch an OOM may rerun"
        else:
            costs = ("a measuring batch, " + ("a compile of the blocks' selective graph at two sizes and " if selective else
                                              "a compile at the new size and " if compile_s else "") + "its arms' batches")
        return Price(label, kind, win, compile_s + _arms(win, m) + (1 if measured else 2) * w,
                     f"{n - count} fewer microbatch(es) at {_pct(a, m)} each ({a_from}), less {what}", costs)
    raise ValueError(f"unknown kind of trial {kind!r}; known: {KINDS}")


def worth(price_: Price, m: Measured, min_gain: float) -> Optional[str]:
    """Why `price_` does not pay on its own (None: it does): expected under its rule for keeping, or its expected
    win over the batches left under `MARGIN` times its predicted cost."""
    w = m.batch_s
    words = f"expected {price_.share(w)} a batch ({price_.basis})"
    if price_.keeps_on_gain and price_.win_s <= min_gain * w:
        return f"{words}, under the {100 * min_gain:g}% it must win to be kept"
    gain = price_.win_s * m.left
    if gain < MARGIN * price_.cost_s:
        whose = "this run's" if m.planned_known else "a run of"
        return (f"{words}: {seconds(gain)} over the {m.left:,} batches left of {whose} {m.planned:,}, less than "
                f"{MARGIN:g} x its predicted cost of {seconds(price_.cost_s)} ({price_.costs})")
    return None


@dataclass
class Budget:
    """The trials' seconds: `BUDGET_SHARE` of the run's planned seconds and `WON_SHARE` of what the trials kept have
    won (`won_s`). `running`: the predicted cost of each trial let run that has not ended; `spent_s`: the real cost of
    those that ended (the plan's clock)."""

    share: float = BUDGET_SHARE
    running: dict[str, float] = field(default_factory=dict)
    spent_s: float = 0.0
    planned_s: float = 0.0  # the run's planned seconds, as last measured
    set_aside_s: float = 0.0  # what the last allocation set aside for trials worth more, still to start
    # What the trials kept won, as timed, over the batches left when each was kept, by trial (`win`).
    won: dict[str, float] = field(default_factory=dict)

    @property
    def won_s(self) -> float:
        return max(0.0, sum(self.won.values()))

    @property
    def total_s(self) -> float:
        return self.share * self.planned_s + WON_SHARE * self.won_s

    def win(self, trial: str, seconds_: float) -> None:
        """Trial `trial`'s kept configuration wins `seconds_` over the run (as timed: its win a batch times the batches
        left); a later figure for the same trial adds to it (negative: a trade it kept was undone)."""
        self.won[trial] = self.won.get(trial, 0.0) + seconds_

    def basis(self) -> str:
        """What the budget is, in words."""
        words = f"{100 * self.share:g}% of the run's planned seconds"
        if self.won_s > 0:
            who = ", ".join(name for name, s in self.won.items() if s > 0)
            words += f" and {100 * WON_SHARE:g}% of the {seconds(self.won_s)} the trials kept won over the batches left ({who})"
        return words

    def left_s(self) -> float:
        """What is left for another trial: the budget less what ended, what runs and what is set aside."""
        return self.total_s - self.spent_s - sum(self.running.values()) - self.set_aside_s

    def fits(self, price_: Price) -> Optional[str]:
        if price_.cost_s <= self.left_s():
            return None
        return (f"its predicted cost of {seconds(price_.cost_s)} ({price_.costs}) is more than the {seconds(max(0.0, self.left_s()))} "
                f"left of the trials' budget ({seconds(self.total_s)}: {self.basis()})")

    def commit(self, price_: Price) -> None:
        self.running[price_.label] = price_.cost_s

    def settle(self, label: str, cost_s: float) -> None:
        """`label` ended having cost `cost_s` against the settled batch (a kept trial's batches can be faster than
        that: nothing is given back to the budget)."""
        self.running.pop(label, None)
        self.spent_s += max(0.0, cost_s)


def allocate(prices: Sequence[Price], m: Measured, budget: Budget, min_gain: float) -> tuple[list[Price], dict[str, str]]:
    """The trials that pay, best expected value first, as many as the budget holds (in value order), and why each
    other one does not run."""
    refused: dict[str, str] = {}
    paying = []
    for candidate in prices:
        why = worth(candidate, m, min_gain)
        if why is None:
            paying.append(candidate)
        else:
            refused[candidate.label] = why
    paying.sort(key=lambda c: -c.value(m.left))
    chosen: list[Price] = []
    left = budget.left_s()
    for candidate in paying:
        if candidate.cost_s <= left:
            chosen.append(candidate)
            left -= candidate.cost_s
        else:
            better = ", ".join(c.label for c in chosen)
            refused[candidate.label] = (
                f"expected {candidate.share(m.batch_s)} a batch, {seconds(candidate.value(m.left))} net over the batches left, but "
                f"its predicted cost of {seconds(candidate.cost_s)} does not fit the {seconds(max(0.0, left))} of the trials' budget "
                f"({seconds(budget.total_s)}) left" + (f" after the trials worth more ({better})" if better else ""))
    return chosen, refused


__all__ = [
    "ARM_BATCHES", "BUDGET_SHARE", "Budget", "KINDS", "MARGIN", "Measured", "NOISE", "PROFILE_BATCHES", "Price",
    "WON_SHARE", "allocate", "fit_microbatch_cost", "price", "seconds", "worth",
]
