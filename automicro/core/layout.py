"""The layout search: once the microbatch size has settled, try the trades of memory for speed the
measured headroom allows, one at a time, and keep a trade only when interleaved timing shows it
faster (DESIGN.md, "What the search searches": its layout).

A *layout* is the set of trades in use. The trades (the FSDP2 engine applies them,
`automicro.engine.layout`):

- ``grad_sync_once``: gradients are reduced on the last microbatch of a batch only (the others
  accumulate unsharded gradients; one reduce-scatter per block per batch instead of one per
  microbatch). Costs the unsharded gradients of every block; only where a batch has several
  microbatches.
- ``no_reshard``: parameters are not resharded after forward (ZeRO-2: no all-gather again in
  backward), nor after the backward of a microbatch other than the batch's last (no all-gather
  again in the next forward). Costs the unsharded parameters of every block between forward and
  backward (held across the batch's microbatches: the same peak).
- ``no_recompute``: where the blocks checkpoint their activations
  (``parallelism_config.fsdp2.activation_checkpointing: true``), checkpointing is switched off:
  the backward uses the activations the forward kept instead of running each block's forward
  again. Costs every block's activations at the microbatch size; those bytes are not projected
  (they depend on the model's layers), so this trade is tried last and its first batch is the
  measurement: an OOM in it undoes it (below; allocator retries in a trial's batches are timed, not
  counted as thrashing).
- ``recompute``: where the user did not ask for checkpointing, the engine checkpoints every block
  switched off (`automicro.engine.sharding.shard`'s ``checkpoint_switch``) and this trade switches
  it on: a forward per block again in backward, for activations that no longer grow with the
  microbatch as fast. Slower at the same size, so it is only ever tried at a *larger* microbatch
  (an upsize trial, below), and never undone under pressure (the size shrinks instead: undoing it
  at the larger size would surely run out of memory).

- ``fused_head``: where the run asked for ``head: auto`` (`automicro.batch.head_choice`), the vocabulary head
  computes its loss from the hidden states in chunks (`automicro.engine.head`) instead of through the whole logits:
  fewer bytes per sample (the logits, their fp32 copy and their gradient are gone) and less eager work over the
  vocabulary. It changes what fits, so it is tried first, before the trades above (they are tried again on top
  of it): priced from the profiled batch (`automicro.batch.trial_price`), measured in one batch near the size found
  (two microbatch sizes up to its largest: `automicro.core.policy.near_split`; the probe's split where there is no
  such split), its own memory model as ``recompute``'s below, then timed at the largest microbatch that model fits
  against the size found without it (at the size found where it fits no larger one); kept, the size policy
  settles there (`automicro.core.policy.Adopt`). Never undone under pressure (it holds less than the plain head;
  the size shrinks instead). Every line of it starts with ``head:``.

How one trade is tried (`LayoutSearch`): when the size policy is steady and no trial runs, the
next candidate whose projected extra bytes fit under the agreed capacity (peak + extra <=
capacity; no margin) is tried; one that does not fit is passed over without an attempt. A trial
alternates batches with the trade on and off (on first), ``trial_batches`` of each; then every
rank's batch times are agreed (the max over ranks, one consensus round) and the trade is kept when
the median with it is below the median without it by more than both ``min_gain`` and the larger
median absolute deviation of the two arms. Under memory pressure (an out-of-memory error or
thrashing at the settled size) the trade on trial, else the last kept trade, is undone and the
batch reruns at the same size: trades go before the microbatch shrinks. Not a kept trade whose trial's
batches peaked lower with it than without it at the same size (`LayoutSearch.saves`: on one rank
``grad_sync_once`` holds bf16 gradients unsharded where the plain layout reduces them into fp32 ones
every microbatch): undoing it would raise the peak. A trade that did not fit
(undone under pressure, or projected not to fit) is tried again only once the microbatch the
size policy settles on is smaller than the one it did not fit at; a trade that was not faster is
tried again only on top of a different layout (another trade kept or undone since: trades
interact, as gradients reduced once per batch gains more where the parameters stay unsharded).
Trades that were each faster, but by less than the rule asks, are tried together once on that
layout (two H200s: +0.8% and +1.0% alone, +4% together); that trial is judged as one trade.

A smaller microbatch with more trades can be faster than the largest that fits without them (one
H100, a 3B model: microbatch 2 with both trades 10% faster than 3 without). So once nothing is left
to try at the size found, the trades that did not fit there are tried together (else each alone)
at the largest smaller microbatch the size policy's memory model says they fit at: a *downsize
trial*, its "with" batches at that size and trades, its "without" batches at the size found and
the kept layout, judged by the same rule on whole-batch times. Kept, the size policy settles on
the smaller size (`automicro.core.policy.Adopt`). Once per size found; pressure in its "with"
batches ends it as a trial's does.

``no_recompute``'s bytes are not projected from the model, so before its downsize trial one batch
*measures* them: it runs with checkpointing off at the probe's split (the two smallest sizes,
`automicro.core.policy.probe_split`), its microbatch peaks are tracked by size (after the first
microbatch, before the optimizer step: activations, not the step's own peak; with ``grad_sync_once`` kept, the last
microbatch's peak, which holds the batch's gradient reduction, only raises the line: `automicro.core.memory.MicrobatchPeaks`), and the two peaks give the
memory model of the layout with the trade (`MeasuredLine`: fixed bytes and bytes per sample, `lines`,
checkpointed), the way the size policy's own model is made, but of that layout alone: the policy's model
may mix layouts (a trade kept or the head fused since its samples were taken; it cannot tell then). The
downsize trial's size is the largest that line fits under the policy's safety margin (a slope measured at the
smallest sizes is extrapolated). A line holds for the layout it was measured on top of: once another is
settled, the trade is measured again before a downsize. Pressure in the measuring batch ends it, and the
trade is never measured again (one OOM at most, at the smallest sizes).

Where the microbatch found is small, checkpointing can pay for its recomputation with a larger
microbatch (a 3B model on one H100 settles on 1). So once nothing else is left to try at the size
found, ``recompute`` is measured in one batch (on, at the probe's split: its own memory model,
fixed bytes plus bytes per sample, from its microbatch peaks) and, where that model fits a larger
microbatch than the one found under the policy's margin (`fits_up_to`), an *upsize trial* runs
that size with it against the size found without it, by the same rule. Kept, the size policy
settles on the larger size (`automicro.core.policy.Adopt`). Once per size found; pressure in the
measuring batch ends it for good, and so does pressure in a trial's "with" batches: a trial that ran
out is not tried again this run (each OOM costs memory another process on the card may take) until
the capacity grows past the one it ran out under. A kept one is undone once the capacity grows past
the one it was kept under (another process gave memory back: without it a larger microbatch may fit
now, and be faster): the size policy searches upward again from the size found without it, and the
trade is measured and tried again from there. Not
measured where the size found already runs the whole batch in one microbatch; its trial waits while
the capacity is below the one its bytes were measured under (another process took memory since).

Every decision is a function of agreed values only, so every rank takes the same one.

Owns: the trade names, the trial state machine and its checkpoint form. May not touch: torch,
Composer, FSDP2 (the engine's `LayoutEngine` applies a layout), the size policy (but for its
`capacity_moved` rule).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from automicro.core.policy import capacity_moved

FUSED_HEAD = "fused_head"
GRAD_SYNC_ONCE = "grad_sync_once"
NO_RESHARD = "no_reshard"
NO_RECOMPUTE = "no_recompute"
RECOMPUTE = "recompute"
# `automicro.engine.recompute`'s ``op`` rung: each block keeps its matrix products' and attention's outputs and recomputes
# the rest. The ladder's first rung below size 1 where the blocks recompute nothing; where the user asked for full
# recompute, a trade down from it (tried after ``no_recompute``, measured as it is: fewer bytes than none, more than full).
RECOMPUTE_OP = "recompute_op"
TRADES = (FUSED_HEAD, GRAD_SYNC_ONCE, NO_RESHARD, NO_RECOMPUTE, RECOMPUTE, RECOMPUTE_OP)  # also the order they are tried in
# Trades whose bytes grow with the microbatch and are measured, not projected from the model.
MEASURED = (NO_RECOMPUTE, RECOMPUTE_OP)
# Trades that save bytes per sample at a cost in time: tried only at a larger microbatch (an upsize
# trial), measured first, never undone under pressure. Where the blocks recompute nothing and carry the engine's dial,
# ``recompute_op`` is one too, tried first (`LayoutSearch.upsize`): it saves fewer bytes than full and recomputes only the
# cheap work.
UPSIZE = (RECOMPUTE,)
# Trades that save bytes per sample and may be faster at any size: tried first, measured, then at the largest
# microbatch they fit (else at the size found); never undone under pressure.
GROWS = (FUSED_HEAD,)
# What a pinned layout may name: checkpointing on is `activation_checkpointing: true`, the fused head `head: fused`.
PINNABLE = tuple(t for t in TRADES if t not in UPSIZE and t not in GROWS and t != RECOMPUTE_OP)
DESCRIPTIONS = {
    FUSED_HEAD: "the vocabulary head fused (the loss without the whole logits)",
    GRAD_SYNC_ONCE: "gradients reduced once per batch",
    NO_RESHARD: "no resharding after forward, nor between microbatches",
    NO_RECOMPUTE: "activation checkpointing off",
    RECOMPUTE: "activation checkpointing on",
    RECOMPUTE_OP: "selective recompute on (matrix products and attention kept)",
}
MODES = ("auto", "fixed")
# A trial's price (`automicro.batch.trial_price`), asked before it starts: ``priced(label, kind, facts)`` returns why
# it does not pay (it does not run), or None (it runs; its cost is committed).
Priced = Callable[[str, str, dict[str, float]], Optional[str]]
# The name of a size trial's result (`TrialResult.trade`): no trade, a smaller microbatch.
SIZE_TRIAL = "smaller_microbatch"
# The microbatches a size trial tries, as shares of the largest microbatch at the size found, in
# order (samples; a token budget passes its own, finer: `automicro.batch.batch_kinds`).
SIZE_FRACTIONS = (0.5, 0.25)


class LayoutConfigError(ValueError):
    """A bad ``layout`` value; the message says what is allowed."""


@dataclass(frozen=True)
class LayoutConfig:
    """``layout``: ``auto`` searches the trades; ``fixed`` keeps the engine's own layout; a list of
    trade names pins that layout (no search)."""

    mode: str = "fixed"
    pinned: tuple[str, ...] = ()
    trial_batches: int = 3
    min_gain: float = 0.01
    # The default (``layout`` not given): ``auto`` on a CUDA device, ``fixed`` elsewhere. A CPU
    # batch's time says nothing of a GPU's, and CPU runs are tests and demos; ``layout: auto``
    # given explicitly searches on any device.
    gpu_only: bool = False
    # ``layout: auto`` also times smaller microbatches than the size found (size trials, below).
    size_trials: bool = True

    def resolve(self, device_type: str) -> "LayoutConfig":
        """The config on this device: the default turns into ``fixed`` off CUDA."""
        if self.gpu_only and device_type != "cuda":
            return LayoutConfig("fixed", (), self.trial_batches, self.min_gain, size_trials=False)
        return self

    @classmethod
    def parse(
        cls, value: Union[str, Sequence[str], None], trial_batches: int = 3, min_gain: float = 0.01,
        size_trials: bool = True,
    ) -> "LayoutConfig":
        if isinstance(trial_batches, bool) or not isinstance(trial_batches, int) or trial_batches < 1:
            raise LayoutConfigError(f"layout_trial_batches={trial_batches!r}: must be a positive int")
        if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0.0 <= min_gain < 1.0:
            raise LayoutConfigError(f"layout_min_gain={min_gain!r}: must be a number in [0, 1)")
        if not isinstance(size_trials, bool):
            raise LayoutConfigError(
                f"layout_size_trials={size_trials!r}: must be true (layout: auto also times smaller microbatches than the "
                "size found and keeps the fastest) or false (the largest size that fits is kept)"
            )
        if value is None:
            return cls("auto", (), trial_batches, float(min_gain), gpu_only=True, size_trials=size_trials)
        if isinstance(value, str):
            if value not in MODES:
                raise LayoutConfigError(
                    f"layout={value!r}: must be 'auto' (try the trades once the size settles), 'fixed' (the "
                    f"engine's own layout) or a list of trades to pin, from {list(PINNABLE)}"
                )
            return cls(value, (), trial_batches, float(min_gain), size_trials=size_trials and value == "auto")
        if not isinstance(value, (list, tuple)):
            raise LayoutConfigError(f"layout={value!r}: must be 'auto', 'fixed' or a list of trades from {list(PINNABLE)}")
        if FUSED_HEAD in value:
            raise LayoutConfigError(
                f"layout={list(value)!r}: the fused head is the head key's (head: fused pins it, head: auto times it), "
                "not a layout trade to pin; drop it from layout"
            )
        if any(v in UPSIZE for v in value):
            raise LayoutConfigError(
                f"layout={list(value)!r}: {RECOMPUTE!r} is chosen by layout: auto only (at a larger microbatch); "
                "to checkpoint every block, set parallelism_config.fsdp2.activation_checkpointing: true"
            )
        unknown = [v for v in value if v not in TRADES]
        if unknown:
            raise LayoutConfigError(f"layout={list(value)!r}: unknown trade(s) {unknown}; known: {list(PINNABLE)}")
        return cls("fixed", tuple(t for t in TRADES if t in value), trial_batches, float(min_gain))


def describe(layout: Sequence[str]) -> str:
    """One phrase for the console: ``default`` or the trades in use."""
    return ", ".join(DESCRIPTIONS[t] for t in TRADES if t in layout) or "default"


@dataclass(frozen=True)
class MeasuredLine:
    """A measured trade's memory model (`LayoutSearch.lines`): the peak of a microbatch of n samples is `fixed` +
    `per_sample` x n with the trade on top of the layout `on` (the settled trades when it was measured)."""

    fixed: float
    per_sample: float
    on: tuple[str, ...] = ()

    def peak(self, size: int) -> float:
        return self.fixed + self.per_sample * size

    def to_list(self) -> list[Any]:
        return [self.fixed, self.per_sample, list(self.on)]

    @classmethod
    def from_list(cls, value: Sequence[Any]) -> "MeasuredLine":
        return cls(float(value[0]), float(value[1]), tuple(t for t in TRADES if t in value[2]))


@dataclass
class Trial:
    """One trial: `trades` on top of the kept ones against the kept ones alone. A trial with a
    `size` (a downsize trial) runs its "with" batches at that smaller microbatch, its "without"
    batches at `from_size`, the size found."""

    trades: tuple[str, ...]
    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    size: Optional[int] = None
    from_size: Optional[int] = None
    # One batch at `size` with the trade on, to measure its bytes (no timing, no verdict).
    measure: bool = False
    # What a size trial's sizes count: "samples" (a microbatch) or "tokens" (a budget).
    unit: str = "samples"
    # ``recompute_op`` tried up from no recompute (at a larger microbatch, against none), not down from a full recompute.
    up: bool = False
    # The highest agreed peak of the batches with the trade, the lowest of those without (bytes; 0: none yet; -1: a
    # batch's peak was not told, nothing is known): a trade kept whose batches all peaked lower than every batch without
    # it saves memory there (`LayoutSearch.saves`).
    peak_on: int = 0
    peak_off: int = 0

    @property
    def trade(self) -> str:
        return "+".join(self.trades) if self.trades else SIZE_TRIAL

    @property
    def label(self) -> str:
        """What the trial is called in its price's and cost's lines: the trade(s), where it runs them, or the size."""
        if self.sized:
            return f"{'budget' if self.unit == 'tokens' else 'size'} {self.size}"
        if self.measure:
            return f"{self.trade} measured"
        return self.trade if self.size is None else f"{self.trade} at {self.size}"

    @property
    def sized(self) -> bool:
        """A size trial: no trade, a smaller microbatch against the size found."""
        return not self.trades

    @property
    def next_on(self) -> bool:
        return len(self.on) <= len(self.off)

    def restarted(self) -> "Trial":
        return Trial(self.trades, size=self.size, from_size=self.from_size, measure=self.measure, unit=self.unit, up=self.up)

    def heading(self) -> str:
        if self.trades == (FUSED_HEAD,):
            if self.measure:
                return (f"head: the fused head's bytes measured in one batch at two microbatch sizes up to {self.size} "
                        f"(found {self.from_size} with the plain head)")
            if self.size is None:
                return "head: fused against plain at the size found"
            return f"head: fused at microbatch {self.size} against plain at {self.from_size}, the size found"
        if self.trades == (RECOMPUTE_OP,):  # a full recompute asked for, tried down to the ``op`` rung; or up from none
            base = "none" if self.up else "full"
            found = f" (found {self.from_size} with {base})" if self.from_size is not None else ""
            if self.measure:
                return f"recompute: op's bytes measured in one batch at microbatches {self.size} and {self.size + 1}{found}"
            if self.size is None:
                return f"recompute: op (matrix products and attention kept) against {base} at the size found"
            return (f"recompute: op (matrix products and attention kept) at microbatch {self.size} against {base} at "
                    f"{self.from_size}, the size found")
        if self.sized and self.unit == "tokens":
            return f"size trial: budget {self.size} tokens against {self.from_size}, the budget found"
        if self.sized:
            return f"size trial: microbatch {self.size} against {self.from_size}, the size found"
        what = f"{self.trade} ({describe(self.trades)})"
        if self.measure:
            return f"layout trade {what}: measuring its bytes in one batch at microbatches {self.size} and {self.size + 1} (found {self.from_size})"
        if self.size is None:
            return f"layout trial {what}"
        return f"layout trial {what} at microbatch {self.size} (found {self.from_size})"

    @property
    def upsize(self) -> bool:
        return self.size is not None and self.from_size is not None and self.size > self.from_size


@dataclass(frozen=True)
class TrialResult:
    trade: str
    kept: bool
    median_on: float
    median_off: float
    spread: float
    size: Optional[int] = None  # a downsize trial's microbatch
    heading: str = ""
    against: str = "full"  # ``recompute_op``'s other arm: full (tried down from it) or none (tried up)

    @property
    def won_s(self) -> float:
        """What the arm kept won a batch against the other, as they were timed (0 where it was not kept by its gain)."""
        return max(0.0, self.median_off - self.median_on) if self.kept else 0.0

    @property
    def trade_names(self) -> list[str]:
        """The layout trades it tried (none for a size trial)."""
        return [t for t in self.trade.split("+") if t in TRADES]

    def line(self) -> str:
        gain = 0.0 if self.median_off <= 0 else 100.0 * (1.0 - self.median_on / self.median_off)
        times = f"({gain:+.1f}%; spread {self.spread:.4f} s)"
        if self.trade == FUSED_HEAD:
            return (f"{self.heading or 'head: fused against plain'}: {'fused kept' if self.kept else 'plain kept'}; median "
                    f"batch {self.median_on:.4f} s fused, {self.median_off:.4f} s plain {times}")
        if self.trade == RECOMPUTE_OP:
            other = self.against
            return (f"{self.heading or 'recompute: op against ' + other}: {'op kept' if self.kept else other + ' kept'}; "
                    f"median batch {self.median_on:.4f} s op, {self.median_off:.4f} s {other} {times}")
        heading = self.heading or f"layout trial {self.trade} ({describe(self.trade.split('+'))})"
        return (f"{heading}: {'kept' if self.kept else 'not kept'}; median batch {self.median_on:.4f} s "
                f"with it, {self.median_off:.4f} s without {times}")


def _mad(values: Sequence[float]) -> float:
    median = statistics.median(values)
    return statistics.median(abs(v - median) for v in values)


def judge(trade: str, on: Sequence[float], off: Sequence[float], min_gain: float) -> TrialResult:
    """Keep `trade` when its median batch time beats the other arm's by more than `min_gain` (a
    share) and more than the larger median absolute deviation of the two arms."""
    median_on, median_off = statistics.median(on), statistics.median(off)
    spread = max(_mad(on), _mad(off))
    gain = median_off - median_on
    kept = gain > 0 and gain > min_gain * median_off and gain > spread
    return TrialResult(trade, kept, median_on, median_off, spread)


# Why the ladder below size 1 undid a kept ``no_recompute`` (`LayoutSearch.recompute_floor`, and after a resume).
_FLOOR_WHY = "microbatch size 1 did not fit without activation checkpointing"


class LayoutSearch:
    """The trials of one run. The callback asks `layout_for_batch` before each batch (and
    `trial_size` for the split of a downsize trial's batch), reports each batch that succeeded with
    `observe`, agrees the times when `needs_agreement`, and calls `relieve` under memory pressure."""

    def __init__(self, config: LayoutConfig, candidates: Sequence[str]) -> None:
        self.config = config
        # ``recompute_op`` is a trial down from a full recompute asked for (with ``no_recompute``), or up from none (with
        # ``recompute``: the blocks carry the engine's dial and recompute nothing); else the ladder's alone.
        self.candidates = [
            t for t in TRADES if t in candidates and (t != RECOMPUTE_OP or NO_RECOMPUTE in candidates or RECOMPUTE in candidates)
        ]
        # The trades tried at a larger microbatch: ``recompute`` (full), then, where full did not pay (not kept, or not
        # tried) and the blocks recompute nothing, ``recompute_op``: fewer bytes saved, only the cheap work recomputed.
        self.upsize: tuple[str, ...] = tuple(
            t for t in (RECOMPUTE, RECOMPUTE_OP)
            if t in self.candidates and (t != RECOMPUTE_OP or (RECOMPUTE in self.candidates and NO_RECOMPUTE not in self.candidates))
        )
        self.kept: list[str] = list(config.pinned)
        # Kept trades whose trial's batches peaked lower with them than without, at the same size (bytes with, without):
        # never undone under memory pressure (`relieve`).
        self.saves: dict[str, tuple[int, int]] = {}
        self.rejected: dict[str, str] = {}
        # For a trade rejected for memory: the largest microbatch it did not fit at (undone under
        # pressure, or projected not to fit). Below that size it may be tried again.
        self.too_big_at: dict[str, int] = {}
        self.trial: Optional[Trial] = None
        self.results: list[TrialResult] = []
        # For a trade that was not faster: the layouts (kept trades) it was tried on top of.
        self.slower_on: dict[str, list[tuple[str, ...]]] = {}
        # The sizes found from which a downsize trial ran (kept or not): never again from those.
        self.downsized_from: list[int] = []
        # For a layout (kept trades): the trades that were faster on top of it, but not by enough.
        # Two or more are tried together once (each alone may gain less than `min_gain`, together more).
        self.near: dict[tuple[str, ...], list[str]] = {}
        # For a trade in MEASURED: the memory model of the settled layout with it, measured in one batch (None: that
        # batch ran out of memory or could not be read; never measured again).
        self.lines: dict[str, Optional[MeasuredLine]] = {}
        # For a trade in UPSIZE: the largest microbatch its measured memory model fits under the
        # margin (None: its measuring batch ran out of memory or could not be read; never again).
        self.fits_up_to: dict[str, Optional[int]] = {}
        # For a trade in UPSIZE or GROWS whose `fits_up_to` is past the margin (a size its model puts under the capacity
        # itself, whose split runs fewer microbatches than the margin's): the size under the margin. Where its trial at
        # the larger size runs out (in either arm's batch), the trade is tried again at this one, once.
        self.fallback: dict[str, int] = {}
        # (trade, the size that ran out, the size it falls back to) of the last `relieve` that fell back, for its line.
        self.fell_back: Optional[tuple[str, int, int]] = None
        # The sizes found from which an upsize trial ran or was passed over: never again from those (``op``'s own list:
        # passed over at a size found, full is still tried from it).
        self.upsized_from: list[int] = []
        self.op_upsized_from: list[int] = []
        # (size found, smaller size) pairs a size trial ran (kept or not): never again.
        self.sized: list[tuple[int, int]] = []
        # (size found, its largest microbatch) where no size trial was left: asked each steady batch
        # once the trials are done, the scan below runs once per size found, not every batch.
        self._no_smaller: Optional[tuple[int, int]] = None
        self.shared_said = False  # the line that an upsize trial waits for a card not shared was printed
        # For a trade in UPSIZE: the capacity its bytes were measured under. Where less is usable now
        # (another process took memory), its trial waits: what fitted then may not fit now.
        self.fits_capacity: dict[str, int] = {}
        # For a trade in UPSIZE whose trial ran out: the capacity it ran out under. It is measured
        # again only once the capacity grows past that (`capacity_moved`).
        self.failed_under: dict[str, int] = {}
        # For a trade in UPSIZE kept by its trial: the capacity it was kept under and the size found
        # without it. Where the capacity grows past that, it is undone (`reconsider`).
        self.kept_under: dict[str, tuple[int, int]] = {}
        # For a trade its price ruled out (not worth its cost): the size found it was ruled out at (priced again
        # from another; not checkpointed: a resumed run prices again).
        self.priced_out_at: dict[str, Optional[int]] = {}
        # The sizes found from which the fused head was tried: never again from those.
        self.head_from: list[int] = []
        # The size found at which its price ruled the fused head out (priced again from another, or where `repriceable`).
        self.head_priced_out_at: Optional[int] = None
        # A trade its price ruled out for the trials' budget alone may be priced again at the same size found: the
        # budget grew since (a kept trial won). The caller's (`automicro.batch.trial_plan`); not checkpointed.
        self.repriceable: Callable[[str], bool] = lambda label: False
        # The trades the ladder below the floor changed (`recompute_floor`): RECOMPUTE kept, or NO_RECOMPUTE undone. In
        # any mode, for the rest of the run and after a resume.
        self.floor: list[str] = []
        # Trades in UPSIZE that cannot be switched on now, and why (the caller's, each batch; not checkpointed).
        self.held: dict[str, str] = {}
        self._held_said: set[str] = set()  # the held trades whose line was printed (once a run)
        self._found: Optional[int] = None

    @property
    def searching(self) -> bool:
        return self.config.mode == "auto"

    @property
    def current(self) -> tuple[str, ...]:
        """The layout of the next batch."""
        trades = set(self.kept)
        if self.trial is not None and self.trial.next_on:
            trades.update(self.trial.trades)
        return tuple(t for t in TRADES if t in trades)

    @property
    def trial_size(self) -> Optional[int]:
        """The microbatch of the next batch where a downsize trial runs it (None: the size found)."""
        trial = self.trial
        return trial.size if trial is not None and trial.next_on else None

    @property
    def settled(self) -> tuple[str, ...]:
        return tuple(t for t in TRADES if t in self.kept)

    def _untried(self) -> list[str]:
        slower = {t for t, bases in self.slower_on.items() if self.settled in bases}
        priced_out = {t for t, at in self.priced_out_at.items() if at == self._found and not self.repriceable(t)}
        done = set(self.kept) | set(self.rejected) | slower | set(UPSIZE) | set(self.upsize) | set(GROWS) | priced_out
        if NO_RECOMPUTE not in self.too_big_at or RECOMPUTE in self.kept:
            # ``op`` holds more than no recompute and recomputes more: it can pay only where checkpointing off did not
            # fit at this size (kept, slower or priced out, ``op`` would not win more); nor once the ladder put full on.
            done.add(RECOMPUTE_OP)
        return [t for t in self.candidates if t not in done]

    def head_open(self, found: Optional[int]) -> bool:
        """The fused head is still to be decided from the size found `found` (None: not known yet)."""
        trade = FUSED_HEAD
        if trade not in self.candidates or trade in self.kept:
            return False
        if found is None:
            return True
        return found not in self.head_from and (found != self.head_priced_out_at or self.repriceable(trade))

    def reprices(self) -> bool:
        """A trade (the fused head included) its price ruled out at the size found may be priced again now."""
        out = [t for t, at in self.priced_out_at.items() if at == self._found]
        if self._found is not None and self.head_priced_out_at == self._found:
            out.append(FUSED_HEAD)
        return any(self.repriceable(t) for t in out)

    def _readmit(self, size: Optional[int]) -> list[str]:
        """Trades that did not fit at a larger microbatch than `size` may be tried again."""
        lines = []
        for trade, at in list(self.too_big_at.items()):
            if size is not None and size < at:
                del self.too_big_at[trade]
                self.rejected.pop(trade, None)
                lines.append(
                    f"layout trade {trade} ({DESCRIPTIONS[trade]}) may be tried again: the microbatch is now {size}, "
                    f"smaller than {at} where it did not fit"
                )
        return lines

    def _reject_for_memory(self, trade: str, why: str, size: Optional[int]) -> None:
        self.rejected[trade] = why
        if size is not None:
            self.too_big_at[trade] = size
        else:
            self.too_big_at.pop(trade, None)

    def _downsize(
        self, size: Optional[int], found: Optional[int], smaller: Optional[Callable[[tuple[str, ...]], Optional[int]]],
        measure_at: Optional[int] = None,
    ) -> Optional[Trial]:
        """Nothing left to try at the size found: the trades that did not fit there, at the largest
        smaller microbatch the memory model says they fit at (all of them together, else each
        alone, in trade order). Once per size found. A waiting trade in MEASURED is measured first
        (one batch at `measure_at`, the smallest size), where `measure_at` is given."""
        if smaller is None or size is None or found is None or found in self.downsized_from:
            return None
        waiting = tuple(
            t for t in TRADES
            if self.too_big_at.get(t) == size and t in self.candidates and (t not in MEASURED or self.lines.get(t, 0) is not None)
        )
        unmeasured = [t for t in waiting if t in MEASURED and not self.measured_on_settled(t)]
        if unmeasured:
            if measure_at is None or measure_at >= found:
                waiting = tuple(t for t in waiting if t not in unmeasured)
            else:
                return Trial((unmeasured[0],), size=measure_at, from_size=found, measure=True)
        for trades in [waiting] + ([(t,) for t in waiting] if len(waiting) > 1 else []):
            if not trades or (NO_RECOMPUTE in trades and RECOMPUTE_OP in trades):
                continue  # off and ``op`` are two rungs of one dial, never tried together
            target = smaller(trades)
            if target is not None and target < found:
                return Trial(trades, size=target, from_size=found)
        return None

    def _head(
        self, found: Optional[int], measure_at: Optional[int], largest_at: Optional[Callable[[int], int]], outside: int,
        priced: Priced, facts: dict[str, float],
    ) -> tuple[Optional[Trial], list[str]]:
        """The fused head, first of all trades (it changes what fits): priced (`facts`: what its price needs), then
        measured (one batch at `measure_at`; straight to its trial where nothing can be measured), then timed at the
        largest microbatch its model fits where that split's largest microbatch is larger than the size found's, else
        at the size found. Once per size found; not at a larger microbatch while another process holds memory on a
        rank's device (`outside`: as the upsize trial)."""
        trade = FUSED_HEAD
        if found is None or not self.head_open(found):
            return None, []
        if trade not in self.fits_up_to and measure_at is not None:
            why = priced(trade, trade, facts)
            if why is not None:
                self.head_priced_out_at = found
                return None, [f"head: plain kept, the fused head not tried: {why}"]
            self.head_priced_out_at = None  # priced again and admitted: measured, then timed (the plan asks no more)
            # Measured near the size found's largest microbatch (`near_split`; the probe's split where there is none).
            trial = Trial((trade,), size=largest_at(found) if largest_at is not None else measure_at, from_size=found, measure=True)
            return trial, [f"{trial.heading()}: a larger microbatch may fit with it"]
        target = self.fits_up_to.get(trade)
        if trade not in self.fits_up_to:  # nothing measured (no memory figures): at the size found, priced
            why = priced(trade, trade, {**facts, "measure": 0.0, "microbatches": facts.get("found_microbatches", 0.0)})
            if why is not None:
                self.head_priced_out_at = found
                return None, [f"head: plain kept, the fused head not tried: {why}"]
        self.head_from.append(found)
        if target is None and trade in self.fits_up_to:
            return None, ["head: plain kept: the fused head's bytes could not be measured"]
        if target is not None and largest_at is not None and largest_at(target) > largest_at(found) and not outside:
            trial = Trial((trade,), size=target, from_size=found)
            return trial, [f"{trial.heading()}: {self.config.trial_batches} batches each"]
        trial = Trial((trade,))
        why = "" if target is None else (
            f" (it fits microbatch {target} at most, no larger split than at {found})" if not outside else
            " (another process holds memory on a rank's GPU: no larger microbatch for now)")
        return trial, [f"{trial.heading()}{why}: {self.config.trial_batches} batches each"]

    def _upsize(
        self, found: Optional[int], measure_at: Optional[int], largest_at: Optional[Callable[[int], int]] = None,
        capacity: int = 0, whole_batch: Optional[int] = None, outside: int = 0,
    ) -> tuple[Optional[Trial], list[str]]:
        """Nothing else left to try at the size found: a trade in UPSIZE, measured first (one batch
        at `measure_at`), then tried at the largest microbatch its model fits, where that is larger
        than `found` (and, by `largest_at`, its split's largest microbatch too). Once per size found.
        Not where the size found already runs the whole batch (`whole_batch`) in one microbatch, nor,
        for now, while `capacity` is below the one its bytes were measured under, nor while another
        process holds memory on a rank's device (`outside` bytes): a larger microbatch reshapes this
        process's allocations, the caching allocator releases blocks as they change shape, and the
        other process may take them (an H200, `benchmarks/RESULTS.md` 2026-11-27, memory that moves: 9.2 GiB went that way, the size found no
        longer fitted, and the run settled below it). Tried once the card is not shared."""
        lines: list[str] = []
        for trade, ran_out_under in list(self.failed_under.items()):
            if capacity_moved(ran_out_under, capacity) == "grew":
                # The memory its trial ran out under came back: measured again, from any size found.
                del self.failed_under[trade]
                self.fits_up_to.pop(trade, None)
                self.fits_capacity.pop(trade, None)
                self.fallback.pop(trade, None)
                self.upsized_from.clear()
                self.op_upsized_from.clear()
                lines.append(
                    f"layout trade {trade} ({DESCRIPTIONS[trade]}) may be tried again: the memory capacity grew "
                    f"past the {ran_out_under / 2**20:.1f} MiB its trial ran out under"
                )
        if found is None:
            return None, lines
        for trade in self.upsize:
            if trade not in self.candidates or trade in self.kept or found in self._upsized_list(trade) or (
                    trade == RECOMPUTE_OP and RECOMPUTE in self.kept):
                continue
            if trade in self.held:
                if trade not in self._held_said:
                    self._held_said.add(trade)
                    lines.append(f"layout trade {trade} ({DESCRIPTIONS[trade]}) not tried for now: {self.held[trade]}")
                continue
            if whole_batch is not None and (largest_at(found) if largest_at is not None else found) >= whole_batch:
                self._upsized(trade, found)
                if trade == RECOMPUTE_OP:
                    continue  # full's line says it
                lines.append(
                    f"layout trade {trade} ({DESCRIPTIONS[trade]}) not tried: the size found runs the whole batch "
                    "in one microbatch, no larger microbatch exists"
                )
                continue
            if capacity_moved(self.fits_capacity.get(trade), capacity) == "shrank":
                continue  # waits until the memory is back (the line about the capacity said it shrank)
            if outside:
                if not self.shared_said:
                    self.shared_said = True
                    lines.append(
                        f"layout trade {trade} ({DESCRIPTIONS[trade]}) not tried at a larger microbatch for now: "
                        f"another process holds {outside / 2**30:.1f} GiB of a rank's GPU, and memory this process "
                        "frees while its allocations change shape may go to it (tried once the card is not shared)"
                    )
                continue
            self.shared_said = False
            up = trade == RECOMPUTE_OP
            if up and found not in self.upsized_from:
                continue  # full first: ``op`` only once full's upsize from this size found is decided
            if up and RECOMPUTE in self.fits_up_to:
                full = self.fits_up_to[RECOMPUTE]
                if full is None or full <= found or (largest_at is not None and largest_at(full) <= largest_at(found)):
                    # ``op`` keeps more bytes than full: where full fits no larger split, neither does it (its measuring
                    # batch would compile its selective graph for nothing).
                    self._upsized(trade, found)
                    what = ("its bytes could not be measured, or its trial ran out" if full is None else
                            f"it fits no larger microbatch than at {found}")
                    lines.append(
                        f"layout trade {trade} ({DESCRIPTIONS[trade]}) not tried: full recompute did not pay ({what}), "
                        "and op keeps more bytes than full"
                    )
                    continue
            if trade not in self.fits_up_to:
                if measure_at is None:
                    continue
                trial = Trial((trade,), size=measure_at, from_size=found, measure=True, up=up)
                lines.append(f"{trial.heading()}: a larger microbatch may fit with it")
                return trial, lines
            self._upsized(trade, found)
            target = self.fits_up_to[trade]
            if target is None:
                continue
            if target <= found or (largest_at is not None and largest_at(target) <= largest_at(found)):
                lines.append(
                    f"layout trade {trade} ({DESCRIPTIONS[trade]}) not tried: it fits microbatch {target} at most, "
                    f"no larger microbatch than at {found} found"
                )
                continue
            trial = Trial((trade,), size=target, from_size=found, up=up)
            lines.append(
                f"{trial.heading()}: {self.config.trial_batches} batches with it at {target}, as many without at {found}"
            )
            return trial, lines
        return None, lines

    def _upsized_list(self, trade: str) -> list[int]:
        """The sizes found from which `trade`'s upsize is decided."""
        return self.op_upsized_from if trade == RECOMPUTE_OP else self.upsized_from

    def _upsized(self, trade: str, found: int) -> None:
        """`trade`'s upsize from the size found `found` is decided (its trial started, or it was passed over)."""
        done = self._upsized_list(trade)
        if found not in done:
            done.append(found)

    def _smaller(
        self, found: Optional[int], largest_at: Optional[Callable[[int], int]], fractions: Sequence[float] = SIZE_FRACTIONS,
        unit: str = "samples",
    ) -> Optional[Trial]:
        """Nothing else left to try at the size found: a size trial, at the largest size whose
        split's largest microbatch is at most `fractions[0]` (then the next) of the size found's.
        Each pair of sizes once; a kept one is adopted by the size policy, and the trials go on from
        there."""
        if not self.config.size_trials or found is None or largest_at is None:
            return None
        largest = largest_at(found)
        if self._no_smaller == (found, largest):
            return None
        for fraction in fractions:
            limit = int(largest * fraction)
            target = next((n for n in range(found - 1, 0, -1) if largest_at(n) <= limit), None)
            if target is None or largest_at(target) >= largest:
                continue
            # The smallest size with that split (a batch of 32 runs 10 as 8, 8, 8, 8): what the console says.
            while target > 1 and largest_at(target - 1) == largest_at(target):
                target -= 1
            if (found, target) in self.sized:
                continue
            self.sized.append((found, target))
            return Trial((), size=target, from_size=found, unit=unit)
        self._no_smaller = (found, largest)
        return None

    @property
    def head_rung_left(self) -> bool:
        """The ladder's first rung is left: the fused head is the trials' and not on (`recompute_floor`)."""
        return FUSED_HEAD in self.candidates and FUSED_HEAD not in self.kept

    def recompute_floor(self, can_switch_on: bool, selective: bool = False) -> Optional[str]:
        """Microbatch size 1 ran out of memory again (`automicro.batch.floor_ladder`): the next rung, the cheapest first.
        The fused head where it is the trials' (``head: auto``) and not on yet: the plain head's logits (and their fp32
        copy and gradient) are gone, the loss the same and the batch faster (it is one of the trials' trades, kept here
        without its trial: at size 1 the plain head did not fit). Then ``no_recompute`` kept: undone (back to the
        checkpointing asked for), and never tried again this run; else, where the blocks can recompute more
        (`can_switch_on`): ``recompute_op`` (`selective`: the blocks recompute nothing now and carry the selective
        rung), then ``recompute`` (every block's forward, in place of ``recompute_op``). Any trial ends. Returns the
        trade changed; None where none is left. In any mode (a fixed or pinned layout too: it changes what fits, not the
        numbers); never undone this run (`relieve`, `reconsider`: it is in neither's reach); checkpointed (``floor``)."""
        self.trial = None
        if self.head_rung_left:
            self.kept.append(FUSED_HEAD)
            self.floor.append(FUSED_HEAD)
            return FUSED_HEAD
        if NO_RECOMPUTE in self.kept:
            self.kept.remove(NO_RECOMPUTE)
            self.rejected[NO_RECOMPUTE] = _FLOOR_WHY
            self.too_big_at.pop(NO_RECOMPUTE, None)
            self.floor.append(NO_RECOMPUTE)
            return NO_RECOMPUTE
        if not can_switch_on or RECOMPUTE in self.kept:
            return None
        if selective and RECOMPUTE_OP not in self.kept and RECOMPUTE_OP not in self.floor:
            self.kept.append(RECOMPUTE_OP)
            self.floor.append(RECOMPUTE_OP)
            return RECOMPUTE_OP
        if RECOMPUTE_OP in self.kept:
            self.kept.remove(RECOMPUTE_OP)
        self.kept.append(RECOMPUTE)
        self.floor.append(RECOMPUTE)
        return RECOMPUTE

    def _apply_floor(self) -> None:
        """A checkpoint's floor (`recompute_floor`) on this run's layout."""
        for trade in self.floor:
            if trade == FUSED_HEAD and FUSED_HEAD in self.candidates and FUSED_HEAD not in self.kept:
                self.kept.append(FUSED_HEAD)
            if trade == NO_RECOMPUTE and NO_RECOMPUTE in self.kept:
                self.kept.remove(NO_RECOMPUTE)
            if trade == NO_RECOMPUTE:
                self.rejected[NO_RECOMPUTE] = _FLOOR_WHY
            if trade == RECOMPUTE_OP and RECOMPUTE_OP not in self.kept and RECOMPUTE not in self.floor:
                self.kept.append(RECOMPUTE_OP)
            if trade == RECOMPUTE and RECOMPUTE not in self.kept:
                if RECOMPUTE_OP in self.kept:
                    self.kept.remove(RECOMPUTE_OP)
                self.kept.append(RECOMPUTE)

    def reconsider(self, capacity: int) -> tuple[Optional[int], list[str]]:
        """A trade in UPSIZE was kept under less memory than the capacity read now (`capacity`; another
        process gave memory back): without it a larger microbatch may fit now, and may be faster.
        Undo it; it is measured and tried again from the size found next. Returns the size found
        without it (the size policy searches upward from there: `automicro.core.policy.Adopt` with
        `reopen`) and the console lines; (None, []) where nothing is undone, or a trial is running."""
        if not self.searching or self.trial is not None or not capacity:
            return None, []
        for trade in self.upsize:
            if trade not in self.kept or trade not in self.kept_under:
                continue
            kept_under, from_size = self.kept_under[trade]
            if capacity_moved(kept_under, capacity) != "grew":
                continue
            del self.kept_under[trade]
            self.kept.remove(trade)
            for table in (self.fits_up_to, self.fits_capacity, self.failed_under, self.fallback):
                table.pop(trade, None)
            self.upsized_from.clear()
            self.op_upsized_from.clear()
            return from_size, [
                f"layout trade {trade} ({DESCRIPTIONS[trade]}) undone: the memory capacity grew past the "
                f"{kept_under / 2**20:.1f} MiB it was kept under; the size is searched again from {from_size} "
                "without it, then it is measured and tried again"
            ]
        return None, []

    def layout_for_batch(
        self, steady: bool, fits: Callable[[str], Optional[str]], size: Optional[int] = None,
        found: Optional[int] = None, smaller: Optional[Callable[[tuple[str, ...]], Optional[int]]] = None,
        measure_at: Optional[int] = None, largest_at: Optional[Callable[[int], int]] = None,
        capacity: int = 0, whole_batch: Optional[int] = None, outside: int = 0,
        size_fractions: Sequence[float] = SIZE_FRACTIONS, size_unit: str = "samples",
        priced: Optional[Priced] = None, one_microbatch: bool = False,
        count_at: Optional[Callable[[int], int]] = None, microbatches: int = 0,
        order: Optional[Callable[[list[str]], list[str]]] = None,
        head_facts: Optional[dict[str, float]] = None, head_only: bool = False,
    ) -> tuple[tuple[str, ...], list[str]]:
        """The layout of the next batch, and a console line for each trade passed over and for a
        trial that starts. `fits(trade)` returns None when the trade's projected bytes fit (or
        cannot be projected), else why not; `size` is the largest microbatch of the next batch
        (None: unknown, no trade is tried again), `found` the size the search settled on.
        `smaller(trades)`: the largest size found below `found` where those trades' projected bytes
        fit (None: none, or no projection); with it, a downsize trial may start once nothing is
        left to try at `found`. `measure_at`: the smallest microbatch, where a trade in MEASURED
        can be measured (None: it cannot, e.g. no memory figures); `largest_at(n)`: the largest
        microbatch of the split a size found of `n` runs (an upsize trial needs a larger one);
        `capacity`: the usable bytes now (0: unknown), `whole_batch`: this rank's batch in samples
        (None: unknown), `outside`: the most another process holds on any rank's device (0: none),
        all for the upsize trial (`_upsize`); `size_fractions`: the shares of the largest microbatch
        the size trials try (`_smaller`), `size_unit` what their sizes count ("samples", "tokens").
        `priced(label, kind, facts)`: asked before any trial starts (`automicro.batch.trial_price`): why it does not
        pay, or None (it runs); a trial it rules out does not run at this size found (one line names its price).
        `one_microbatch`: the settled split is one microbatch, whose gradients are reduced once per batch already:
        ``grad_sync_once`` is not tried at this size found. `count_at(n)`: the microbatches of the split a size found
        of `n` runs; `microbatches`: the settled split's (a token budget's size trials are priced from it).
        `order(trades)`: the untried trades in the order they are tried (default `TRADES`'; the plan's: the best
        expected value first). `head_facts`: what the fused head's price needs (`_head`); `head_only`: nothing but the head is tried (the model
        runs unsharded for good: FSDP2's trades change nothing)."""
        lines: list[str] = []
        priced = priced or (lambda label, kind, facts: None)
        self._found = found
        if self.searching and steady and self.trial is None:
            lines += self._readmit(size)
            self.trial, more = self._head(found, measure_at, largest_at, outside, priced, dict(head_facts or {}))
            lines += more
            for trade in (order or list)(self._untried()) if self.trial is None and not head_only else ():
                problem = fits(trade)
                why = None
                if trade == GRAD_SYNC_ONCE and one_microbatch:
                    why = "the batch runs in one microbatch: its gradients are reduced once per batch already"
                elif problem is None:
                    why = priced(trade, trade, {})
                if why is not None:
                    self.priced_out_at[trade] = found
                    lines.append(f"layout trade {trade} ({DESCRIPTIONS[trade]}) not tried: {why}")
                    continue
                self.priced_out_at.pop(trade, None)
                if problem is None:
                    self.trial = Trial((trade,))
                    lines.append(f"{self.trial.heading()}: {self.config.trial_batches} batches with it, as many without")
                    break
                self._reject_for_memory(trade, problem, size)
                lines.append(f"layout trade {trade} ({DESCRIPTIONS[trade]}) not tried: {problem}")
            if self.trial is None and not head_only:
                together = tuple(t for t in TRADES if t in self.near.get(self.settled, ()) and t not in self.rejected)
                joint = "+".join(together)
                if len(together) > 1 and self.settled not in self.slower_on.get(joint, []):
                    problem = fits(joint) or priced(joint, "together", {"trades": joint})  # type: ignore[dict-item]
                    if problem is None:
                        self.trial = Trial(together)
                        lines.append(f"{self.trial.heading()}: {self.config.trial_batches} batches with them, as many without")
                    else:
                        self.slower_on.setdefault(joint, []).append(self.settled)
                        if fits(joint) is not None:
                            for trade in together:
                                self._reject_for_memory(trade, f"with {joint}: {problem}", size)
                        lines.append(f"layout trades {joint} not tried together: {problem}")
            if self.trial is None and not head_only:
                self.trial = self._downsize(size, found, smaller, measure_at)
                why = None
                if self.trial is not None:
                    trial = self.trial
                    if trial.measure:
                        why = priced(trial.label, trial.trades[0], {})
                    else:
                        facts = {"trades": trial.trade, "microbatches": float(count_at(trial.size) if count_at and trial.size else microbatches)}
                        why = priced(trial.label, "downsize", facts)  # type: ignore[arg-type]
                if why is not None:
                    assert found is not None and self.trial is not None
                    lines.append(f"{self.trial.heading()}: not tried: {why}")
                    self.downsized_from.append(found)
                    self.trial = None
                elif self.trial is not None and self.trial.measure:
                    lines.append(f"{self.trial.heading()}: it did not fit at {size}")
                elif self.trial is not None:
                    assert found is not None
                    self.downsized_from.append(found)
                    lines.append(
                        f"{self.trial.heading()}: {self.config.trial_batches} batches with "
                        f"{'it' if len(self.trial.trades) == 1 else 'them'} at {self.trial.size}, "
                        f"as many without at {found}"
                    )
            if self.trial is None and not head_only:
                self.trial, more = self._upsize(found, measure_at, largest_at, capacity, whole_batch, outside)
                lines += more
                if self.trial is not None:
                    trial = self.trial
                    count = 1 if trial.measure else (count_at(trial.size) if count_at and trial.size else 1)
                    facts = {"microbatches": float(count), **({"selective": 1.0} if trial.up else {}),
                             **({} if trial.measure else {"measured": 1.0})}
                    why = priced(trial.label, "upsize", facts)
                    if why is not None:
                        lines.append(f"{trial.heading()}: not tried: {why}")
                        if found is not None:
                            self._upsized(trial.trades[0], found)
                        self.trial = None
            if self.trial is None and not head_only:
                self.trial = self._smaller(found, largest_at, size_fractions, size_unit)
                why = None
                if self.trial is not None:
                    trial = self.trial
                    if size_unit == "samples":
                        count = count_at(trial.size) if count_at and trial.size else microbatches
                        why = priced(trial.label, "smaller", {"microbatches": float(count)})
                    elif found and trial.size:
                        fraction = trial.size / found
                        why = priced(trial.label, "smaller", {"fraction": fraction})
                if why is not None:
                    assert self.trial is not None and largest_at is not None and found is not None
                    unit = "microbatch" if size_unit == "samples" else "budget"
                    lines.append(f"size trials below {unit} {found} not run: {why}")
                    self._no_smaller, self.trial = (found, largest_at(found)), None
                if self.trial is not None:
                    lines.append(
                        f"{self.trial.heading()}: {self.config.trial_batches} batches at {self.trial.size}, as many at "
                        f"{found} (the largest that fits is not always the fastest)"
                    )
        elif self.trial is not None and not steady:
            # The size moved: a trial's times would compare different sizes.
            self.trial = self.trial.restarted()
        return self.current, lines

    def observe(self, layout: Sequence[str], seconds: float, peak: int = 0) -> None:
        """A batch that succeeded at `layout` took `seconds` on this rank; `peak`: its peak bytes, the max over ranks
        (agreed; 0: not told)."""
        trial = self.trial
        if trial is None:
            return
        if trial.sized:  # the same layout in both arms: the batch ran the arm `next_on` chose
            on = trial.next_on
        else:
            on = set(trial.trades) <= set(layout)
        (trial.on if on else trial.off).append(float(seconds))
        if not peak:
            trial.peak_on = trial.peak_off = -1  # a batch not told: nothing known of the trade's memory
        elif on and trial.peak_on >= 0:
            trial.peak_on = max(trial.peak_on, int(peak))
        elif not on and trial.peak_off >= 0:
            trial.peak_off = int(peak) if not trial.peak_off else min(trial.peak_off, int(peak))

    @property
    def needs_agreement(self) -> bool:
        trial = self.trial
        return trial is not None and not trial.measure and min(len(trial.on), len(trial.off)) >= self.config.trial_batches

    @property
    def measuring(self) -> Optional[Trial]:
        """The measuring trial whose one batch just succeeded (`measured` ends it)."""
        trial = self.trial
        return trial if trial is not None and trial.measure and trial.on else None

    def measured_on_settled(self, trade: str) -> bool:
        """`trade`'s line is measured, on top of the layout settled now."""
        line = self.lines.get(trade)
        return line is not None and line.on == self.settled

    def measured(
        self, line: Optional[tuple[float, float]], how: str = "", fits_up_to: Optional[int] = None, capacity: int = 0,
        fallback: Optional[int] = None,
    ) -> str:
        """The measuring batch's result (agreed): for a trade in MEASURED, the memory model of the layout with it
        (`line`: fixed bytes and bytes per sample; None where they could not be told; `how`: the figures, for the
        console); for a trade in UPSIZE or GROWS, the largest microbatch its model fits (`fits_up_to`; None: could not
        be told) and, where that size is past the policy's margin, the size under it (`fallback`: tried where the
        larger one runs out, `relieve`). Ends the measurement; returns its console line."""
        trial = self.trial
        assert trial is not None and trial.measure
        self.trial = None
        trade = trial.trades[0]
        if trade in self.upsize + GROWS:
            if fallback is not None and fits_up_to is not None and fallback < fits_up_to:
                self.fallback[trade] = int(fallback)
            else:
                self.fallback.pop(trade, None)
        if trade in GROWS:
            self.fits_up_to[trade] = fits_up_to
            if fits_up_to is None:
                return "head: the fused head's bytes could not be measured; plain kept"
            return f"head: fused fits microbatch {fits_up_to} at most{' (' + how + ')' if how else ''}"
        if trade in self.upsize:
            self.fits_up_to[trade] = fits_up_to
            if capacity:
                self.fits_capacity[trade] = int(capacity)
            if fits_up_to is None:
                return f"layout trade {trade}: its bytes could not be measured; not tried at a larger microbatch"
            return (
                f"layout trade {trade} ({DESCRIPTIONS[trade]}): fits microbatch {fits_up_to} at most"
                f"{' (' + how + ')' if how else ''}"
            )
        if line is None or not line[1] > 0:
            self.lines[trade] = None
            return f"layout trade {trade}: its bytes could not be measured; not tried at a smaller microbatch"
        measured = self.lines[trade] = MeasuredLine(float(line[0]), float(line[1]), self.settled)
        return (
            f"layout trade {trade} ({DESCRIPTIONS[trade]}): {measured.per_sample / 2**20:.2f} MiB per sample with it, "
            f"{measured.fixed / 2**20:.1f} MiB besides{' (' + how + ')' if how else ''}"
        )

    def local_times(self) -> list[float]:
        assert self.trial is not None
        return self.trial.on + self.trial.off

    def won_s(self) -> float:
        """What the trials kept and still keep won a batch, as each was timed (`TrialResult.won_s`): a trade undone
        since (under memory pressure, by the ladder below the floor) wins nothing any more."""
        return sum(r.won_s for r in self.results if all(t in self.kept for t in r.trade_names))

    def decide(self, agreed: Sequence[float], capacity: int = 0) -> TrialResult:
        """`agreed`: `local_times()` after the max over ranks. Ends the trial. A kept downsize trial
        (`result.size`): the caller settles the size policy on that size. `capacity`: the capacity
        read now, which a kept upsize trial is kept under (`reconsider`)."""
        trial = self.trial
        assert trial is not None and len(agreed) == len(trial.on) + len(trial.off)
        on, off = list(agreed[: len(trial.on)]), list(agreed[len(trial.on) :])
        result = judge(trial.trade, on, off, self.config.min_gain)
        result = replace(result, size=trial.size, heading=trial.heading(), against="none" if trial.up else "full")
        self.results.append(result)
        if result.kept:
            if NO_RECOMPUTE in trial.trades and RECOMPUTE_OP in self.kept:
                self.kept.remove(RECOMPUTE_OP)  # checkpointing off in place of the ``op`` rung
            from_size = trial.from_size
            if RECOMPUTE in trial.trades and RECOMPUTE_OP in self.kept:
                # Full in place of an ``op`` kept by its own upsize trial: undone under more memory, back to none at the
                # size found without either.
                self.kept.remove(RECOMPUTE_OP)
                below = self.kept_under.pop(RECOMPUTE_OP, None)
                from_size = below[1] if below is not None else from_size
            for trade in trial.trades:
                self.kept.append(trade)
                self.rejected.pop(trade, None)
                self.too_big_at.pop(trade, None)
                self.saves.pop(trade, None)
                if trial.upsize and trade in self.upsize and capacity and from_size is not None:
                    self.kept_under[trade] = (int(capacity), int(from_size))
            if trial.size is None and 0 < trial.peak_on < trial.peak_off:
                # Its batches all peaked lower than those without it, at the same size: undoing it under pressure would
                # raise the peak (one H100, Qwen3-MoE's blocks: grad_sync_once kept at 72.8 GiB against 77.2 without;
                # undone for a thrash, the size then ran out at 6 and 4 and fell to 2, 2.2 -> 4.1 s a batch).
                for trade in trial.trades:
                    self.saves[trade] = (trial.peak_on, trial.peak_off)
        elif trial.size is None:
            self.slower_on.setdefault(trial.trade, []).append(self.settled)
            if len(trial.trades) == 1 and result.median_on < result.median_off:
                self.near.setdefault(self.settled, []).append(trial.trade)
        self.trial = None
        return result

    def relieve(
        self, failed_layout: Sequence[str], why: str, size: Optional[int] = None, capacity: int = 0,
    ) -> Optional[str]:
        """Memory pressure at the settled size in a batch run at `failed_layout` (largest microbatch
        `size`): undo the trade on trial if it was on, else the last kept trade but one in UPSIZE (a
        trial whose trade was off ends untried). Returns the trade undone; None when none is left
        (the size policy acts then). A downsize or upsize trial's trades stay where they were. `fell_back` says
        whether this call sent a trade tried past the margin back to the margin's size."""
        self.fell_back = None
        if self.trial is not None and self.trial.sized:
            self.trial = None  # no trade to undo: the trial ends (its pair is not tried again)
        elif self.trial is not None:
            trial, self.trial = self.trial, None
            if trial.measure:
                # Even the smallest microbatch did not fit with it: never measured again.
                if trial.trades[0] in self.upsize + GROWS:
                    self.fits_up_to[trial.trades[0]] = None
                else:
                    self.lines[trial.trades[0]] = None
            trade = trial.trades[0]
            if (trial.upsize and not trial.measure and len(trial.trades) == 1 and trade in self.fallback
                    and self.fits_up_to.get(trade) == trial.size):
                # Past the margin and it ran out: tried again at the size under the margin (its first try's one batch
                # rerun is what the larger size risked), from the same size found. Also where the batch that showed it
                # ran without the trade: its arms alternate, and the larger size leaves the allocator's pool cut for it
                # (Mixtral's 2 blocks on one H100: the fused head's batch at 8 retried, then the plain head's at 7
                # after it; a trial's retries are timed since, not a thrash: `TrainingSearch._trained`).
                below = self.fallback.pop(trade)
                self.fits_up_to[trade] = below
                assert trial.from_size is not None
                done = self.head_from if trade in GROWS else self._upsized_list(trade)
                if trial.from_size in done:
                    done.remove(trial.from_size)
                self.fell_back = (trade, int(trial.size), below)
                # In the batch without it, nothing kept is undone: the pool its own batch cut explains the pressure.
                return trial.trade if set(trial.trades) <= set(failed_layout) else None
            elif set(trial.trades) <= set(failed_layout):
                if trial.upsize and not trial.measure:
                    # Its model was wrong at that size: not tried again this run (each try that runs
                    # out costs memory other processes on the card may take), unless the capacity
                    # (`capacity`, read when it ran out) grows.
                    for trade in trial.trades:
                        self.fits_up_to[trade] = None
                        if capacity and trade in self.upsize:
                            self.failed_under[trade] = int(capacity)
                if trial.size is None:
                    for trade in trial.trades:
                        self._reject_for_memory(trade, why, size)
                return trial.trade
            if trial.size is None:
                for trade in trial.trades:
                    self._reject_for_memory(trade, f"trial stopped: {why} without it", size)
        # A trade in UPSIZE or GROWS stays: the size it admitted would not fit without it (the size shrinks).
        # Nor the ladder's ``op`` (size 1 did not fit without it: `recompute_floor`; a full recompute asked for and
        # tried down to ``op`` goes back to full).
        # Nor a trade whose trial's batches peaked lower with it (`saves`): undone, the peak would rise.
        floor_op = RECOMPUTE_OP if RECOMPUTE_OP in self.floor else None
        undoable = [t for t in self.kept if t not in self.upsize and t not in GROWS and t != floor_op and t not in self.saves]
        if undoable and self.config.mode == "auto":
            trade = undoable[-1]
            self.kept.remove(trade)
            self._reject_for_memory(trade, why, size)
            return trade
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "kept": list(self.kept),
            "rejected": dict(self.rejected),
            "slower_on": {t: [list(b) for b in bases] for t, bases in self.slower_on.items()},
            "too_big_at": dict(self.too_big_at),
            "downsized_from": list(self.downsized_from),
            "near": [[list(base), list(trades)] for base, trades in self.near.items()],
            # Only once measured: a run without checkpointing keeps the state (and its bytes) it had.
            **({"lines": {t: None if v is None else v.to_list() for t, v in self.lines.items()}} if self.lines else {}),
            **({"fits_up_to": dict(self.fits_up_to)} if self.fits_up_to else {}),
            **({"fallback": dict(self.fallback)} if self.fallback else {}),
            **({"upsized_from": list(self.upsized_from)} if self.upsized_from else {}),
            **({"op_upsized_from": list(self.op_upsized_from)} if self.op_upsized_from else {}),
            **({"sized": [list(pair) for pair in self.sized]} if self.sized else {}),
            **({"fits_capacity": dict(self.fits_capacity)} if self.fits_capacity else {}),
            **({"failed_under": dict(self.failed_under)} if self.failed_under else {}),
            **({"kept_under": {t: list(v) for t, v in self.kept_under.items()}} if self.kept_under else {}),
            **({"head_from": list(self.head_from)} if self.head_from else {}),
            **({"floor": list(self.floor)} if self.floor else {}),
            **({"saves": {t: list(v) for t, v in self.saves.items()}} if self.saves else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The ladder's step holds in any mode: without it, size 1 did not fit.
        self.floor = [t for t in state.get("floor", []) if t in (FUSED_HEAD, NO_RECOMPUTE, RECOMPUTE, RECOMPUTE_OP)]
        if self.config.mode != "auto":
            self._apply_floor()
            return  # a pinned or fixed layout wins over what a checkpoint chose
        self.kept = [t for t in state.get("kept", []) if t in self.candidates]
        self.saves = {t: (int(v[0]), int(v[1])) for t, v in state.get("saves", {}).items() if t in self.kept}
        self.rejected = {t: str(w) for t, w in state.get("rejected", {}).items() if t in TRADES}
        self.too_big_at = {
            t: int(n) for t, n in state.get("too_big_at", {}).items() if t in self.rejected and not isinstance(n, bool)
        }
        self.slower_on = {
            t: [tuple(x for x in TRADES if x in b) for b in bases]
            for t, bases in state.get("slower_on", {}).items() if all(x in TRADES for x in t.split("+"))
        }
        self.downsized_from = [int(n) for n in state.get("downsized_from", [])]
        self.near = {
            tuple(t for t in TRADES if t in base): [t for t in trades if t in TRADES] for base, trades in state.get("near", [])
        }
        # (A checkpoint of an earlier version kept bytes per sample over the size policy's model, "per_sample": not
        # read; such a trade is measured again, one batch.)
        self.lines = {
            t: (None if v is None else MeasuredLine.from_list(v)) for t, v in state.get("lines", {}).items() if t in MEASURED
        }
        self.fits_up_to = {
            t: (None if v is None else int(v)) for t, v in state.get("fits_up_to", {}).items() if t in self.upsize + GROWS
        }
        self.fallback = {
            t: int(n) for t, n in state.get("fallback", {}).items() if t in self.fits_up_to and self.fits_up_to[t] is not None
        }
        self.head_from = [int(n) for n in state.get("head_from", [])]
        self.upsized_from = [int(n) for n in state.get("upsized_from", [])]
        self.op_upsized_from = [int(n) for n in state.get("op_upsized_from", [])]
        self.sized = [(int(a), int(b)) for a, b in state.get("sized", [])]
        self.fits_capacity = {t: int(c) for t, c in state.get("fits_capacity", {}).items() if t in self.upsize}
        self.failed_under = {t: int(c) for t, c in state.get("failed_under", {}).items() if t in self.upsize}
        self.kept_under = {
            t: (int(c), int(n)) for t, (c, n) in state.get("kept_under", {}).items() if t in self.upsize and t in self.kept
        }
        for trade in state.get("tried", []):  # checkpoints before "slower_on": every trade tried
            if trade in TRADES and trade not in self.kept and trade not in self.rejected:
                self.rejected[trade] = "tried before the checkpoint"
        self._apply_floor()
        self.trial = None

__all__ = [
    "DESCRIPTIONS", "FUSED_HEAD", "GROWS", "GRAD_SYNC_ONCE", "LayoutConfig", "LayoutConfigError", "LayoutSearch", "MEASURED",
    "MeasuredLine", "NO_RECOMPUTE",
    "NO_RESHARD", "PINNABLE", "RECOMPUTE", "RECOMPUTE_OP", "SIZE_FRACTIONS", "SIZE_TRIAL",
    "TRADES", "UPSIZE",
    "TrialResult", "describe", "judge",
]
