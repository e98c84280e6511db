"""The microbatch-size search policy: a pure state machine (no torch, no I/O, no collectives).

In the style of FSDP2's `TrainingState`: an enum of phases (`Phase`) and one pure transition
function, `transition(state, outcome, config) -> (new_state, decision)`. Every field of
`SearchState` is plain data, so the state goes into a checkpoint through `to_dict()` /
`SearchState.from_dict()`. All ranks feed it identical, already all-reduced outcomes, so all
ranks take identical decisions.

Phases:

- ``SEARCHING``: the bounds have not converged; sync hooks on. The split is Composer's chunking
  (chunks of the size under test and a smaller remainder), so that size itself is really tried.
- ``SETTLING``: the size is chosen; sync hooks still on while `stable_batches` consecutive clean
  batches are counted. The split is the fewest microbatches, as even as possible.
- ``STEADY``: hooks off. An OOM sends the policy back to ``SETTLING`` at the same split (the
  batch is rerun with the hooks on); a repeat of that OOM, or a thrash, sends it back to
  ``SEARCHING`` (downward, keeping the sizes known to fit); a `Rearm` sends it back to ``SETTLING``. A thrash
  timed faster than the size it shrank to (`Retried`) takes that size back, in the phase the policy is in.

The floor rule, the same at every size, the smallest one included: an OOM at a size that already
ran clean is a one-off until it repeats (a long sequence, fragmentation, memory left by an eval or
a checkpoint): the batch is rerun at that size with the hooks on (`SearchState.retrying`). Only
a repeat moves the bounds, and only a repeat at the smallest size ends the run (`CannotFitError`).

Search modes (`PolicyConfig.search`):

- ``bisect``: keeps `best_success` (largest size that fit, below the failure bound; 0 if none)
  and `first_failure` (smallest size that failed or thrashed; None if none) and bisects between
  them, downward after a failure and upward after a success, optionally jumping to a size
  predicted from the peak memory of two successful sizes (before the first optimizer step, a
  success's peak includes the state that step adds: a size whose projected peak does not fit
  is searched below like a failure, without an OOM; `Success.projected`). Every size tried while searching is
  strictly between the bounds, so the search ends in at most about log2(B) + 2 attempts.
- ``halve``: Composer's own policy, as a baseline: halve on failure, settle on the first success,
  split into chunks of that size.

The probe (`PolicyConfig.probe`, bisect mode with prediction): instead of starting at the whole
batch and halving down through OOMs, the first attempt runs a split of two small sizes, the
floor twice, then chunks of the floor + 1 (`probe_split`, e.g. 32 -> (1, 1, 2, ..., 2)). The
attempt reports the peak of each size over the microbatches after the first (their peaks hold
the gradients, as every later microbatch's do; `Success.peaks_by_size`): two samples from one
attempt, so the next size is predicted at once. Then the model ends the search: upward, where the
margin's prediction is no larger than the best success, the size predicted to fill the whole
capacity is tried; where even that is no larger than the best success, or after an OOM where nothing
predicted lies between the bounds, the search converges on the best success without spending an
OOM on the sizes between.

The capacity is read, not known (another process, a per-process fraction): an OOM that moves a bound
carries the bytes its attempt had reached (`OOM.reached_bytes`), and the most any OOM reached is the
`ceiling` the model plans under wherever the capacity read says more (no "whole capacity" try under
it; a failure the model cannot explain even under it is bisected: where the line puts the peak of the size
that ran out under what the OOMs showed usable, the peak grows faster than linearly past the samples,
and a size predicted just below the failure would run out too). An OOM under a capacity read more
than `CAPACITY_CHANGE` below the last success's shrinks at once (no one-off rerun: the memory went to
another process); a success under one that grew by as much past the one a bound was set under (an
OOM's or a thrash's) drops that bound and the ceiling, and searches above again.

Where only some sizes can run (a pipeline: equal microbatches, enough of them for the schedule),
`PolicyConfig.sizes_for(batch_size)` lists them: every size tried, bisected and settled on is one
of them (the middle one between the bounds), and a split is then always equal parts.

Owns: the phases, the search, the splits and why the hooks are on (`HookReason`). May not touch:
torch, I/O, collectives, Composer: it is fed agreed outcomes and returns decisions.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

#: Predicted sizes aim at this fraction of the usable memory.
SAFETY_MARGIN = 0.95
#: A capacity read that moves by more than this fraction is a change (`automicro.core.memory` too).
CAPACITY_CHANGE = 0.05


def capacity_moved(before: Optional[int], now: Optional[int]) -> Optional[str]:
    """"grew" or "shrank" where the capacity read `now` moved by more than `CAPACITY_CHANGE` from
    `before`; None where it did not, or either is unknown (0 or None). The one rule for the policy,
    the layout trials and the console."""
    if not before or not now or abs(now - before) <= CAPACITY_CHANGE * before:
        return None
    return "grew" if now > before else "shrank"

SEARCH_MODES = ("bisect", "halve")
#: How a decision says the probe's memory model ended the search.
PREDICTED_EDGE = "the next size is predicted not to fit"
STATE_VERSION = 1


class CannotFitError(RuntimeError):
    """Even the smallest microbatch size (1 sample by default) ran out of memory."""

    def __init__(self, size: int, message: Optional[str] = None) -> None:
        self.size = size
        if message is None:
            if size <= 1:
                message = "out of memory even with microbatch size 1: even microbatch size 1 does not fit"
            else:
                message = (
                    f"out of memory at microbatch size {size}, the configured min_size: even microbatch "
                    f"size {size} does not fit"
                )
        super().__init__(message)


class Phase(enum.Enum):
    SEARCHING = "SEARCHING"
    SETTLING = "SETTLING"
    STEADY = "STEADY"


class HookReason(enum.Enum):
    """Why the sync hooks are on or off: carried by every `Decision` (the policy's reasons) and
    passed by the Composer adapter for the trainer's own lifecycle (the rest)."""

    # The policy's reasons, one per kind of decision.
    SEARCHING = "searching"  # the size is not settled
    SETTLING = "settling"  # counting clean batches at the chosen split
    STABLE = "stable"  # `stable_batches` clean batches: the hooks come off
    STEADY = "steady"  # nothing changes
    OOM = "out of memory"
    THRASH = "thrashing"
    REARM = "rearm"  # eval, a loaded checkpoint: guard the next batches
    BATCH_SIZE_CHANGED = "batch size changed"
    # The trainer's lifecycle.
    FIT_START = "fit start"
    FIT_END = "fit end"
    CLOSED = "trainer closed"
    EVAL = "eval"
    AFTER_EVAL = "after eval"


# ---- outcomes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Success:
    """A full batch at microbatch size `size` finished on every rank.

    peak_bytes: max over ranks of the peak memory during the attempt; capacity_bytes: min over
    ranks of the usable memory. Both optional; they feed the memory prediction. projected: the
    attempt ran before memory that later batches will hold existed (the optimizer state of the
    first step), and peak_bytes already includes it: a projected peak above the capacity is a
    size that would run out of memory later. It is not kept as a
    success; the search goes on below it without spending an OOM (`_on_projected_failure`).
    """

    size: int
    peak_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    projected: bool = False
    # (size, peak_bytes) per distinct microbatch size of the attempt, each the max over ranks and
    # over the microbatches of that size after the first (the probe; empty: not measured).
    peaks_by_size: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class OOM:
    """An attempt at `size` ran out of memory on some rank; the batch is rerun. `ranks`: the
    ranks that ran out (empty: unknown)."""

    size: int
    ranks: tuple[int, ...] = ()
    # False: this OOM already cost a run (a failure note from the last launch): never a one-off.
    may_rerun: bool = True
    # The least, over the ranks that ran out, of the bytes their attempt had reached when it failed
    # (the peak before the allocation that failed, nothing projected): what the process can get is
    # at least this and less than this plus the one allocation that failed. None: not measured.
    reached_bytes: Optional[int] = None
    # The capacity read when it failed (min over ranks; None: unknown).
    capacity_bytes: Optional[int] = None


@dataclass(frozen=True)
class Thrash:
    """The batch succeeded, but allocator retries in consecutive batches: `size` counts as failed."""

    size: int


@dataclass(frozen=True)
class Rearm:
    """Sync hooks are wanted again without changing the size (eval ran, checkpoint loaded)."""

    reason: str = ""


@dataclass(frozen=True)
class BatchSizeChanged:
    """The per-rank batch size is now `new_B` samples."""

    new_B: int


@dataclass(frozen=True)
class DomainGrew:
    """The sizes the search may choose now reach up to `new_B` (a token budget's domain: the
    largest batch seen, in tokens). A size bounded by a failure stays as it is, hooks included;
    a size that was the whole old domain (nothing ever failed) is searched upward again."""

    new_B: int


@dataclass(frozen=True)
class Adopt:
    """The layout search settles the microbatch at `size`, other than the one found: its trial ran
    `size` with trades that did not fit at the larger one (or, larger, with a trade that saves
    bytes per sample), clean, and faster (`automicro.core.layout`); or a size trial ran the smaller
    `size` (a token budget, over tokens) faster. Only while STEADY; over tokens only a smaller one.

    `reopen`: the layout undid a trade that had let a larger size fit, because the memory it was kept
    under came back (`LayoutSearch.reconsider`): `size` is the size found without it. The bounds and
    the ceiling came from runs with the trade, so they go, and the memory model is the one from
    before that trade was adopted (`SearchState.shelved`, under the capacity read now); the search
    runs upward again from `size` with the sync hooks on. Any phase, over samples."""

    size: int
    reopen: bool = False
    capacity_bytes: Optional[int] = None


@dataclass(frozen=True)
class Retried:
    """A thrash at `size` was timed (`automicro.batch.thrash_timing`): its batches, the allocator's retries and all,
    were faster than those at the size the search settled on below it. The size found is `size` again, in the phase
    the policy is in (its count of clean batches kept); the thrash's failure bound at `size` goes and `bound` (the
    failure bound before the thrash; None: there was none) comes back; the memory model stays (the same layout ran
    both sizes). Only while SETTLING or STEADY on a smaller size, over samples, where `size` ran clean."""

    size: int
    bound: Optional[int] = None


Outcome = Union[Success, OOM, Thrash, Rearm, BatchSizeChanged, DomainGrew, Adopt, Retried]


# ---- config, state, decision -----------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PolicyConfig:
    search: str = "bisect"
    stable_batches: int = 3
    use_prediction: bool = True
    start_size: Optional[int] = None
    min_size: int = 1
    # Where only some sizes can run (a pipeline: equal microbatches, enough of them for the
    # schedule): the allowed sizes for a batch size, ascending. None: every size 1..B.
    sizes_for: Optional[Callable[[int], tuple[int, ...]]] = None
    # What a size counts: "samples" per microbatch, or "tokens" (a token budget: the split is
    # planned outside the policy, from the budget; `batch_size` is then the budget's domain).
    unit: str = "samples"
    # Start with `probe_split` and let the memory model end the search (module docstring). Applies
    # in bisect mode with prediction, sizes in samples and every size allowed; ignored elsewhere.
    probe: bool = False

    def __post_init__(self) -> None:
        if self.unit not in ("samples", "tokens"):
            raise ValueError(f"unit={self.unit!r}: must be 'samples' or 'tokens'")
        if self.search not in SEARCH_MODES:
            raise ValueError(f"search={self.search!r}: must be one of {', '.join(repr(m) for m in SEARCH_MODES)}")
        if not _is_int(self.stable_batches) or self.stable_batches < 1:
            raise ValueError(f"stable_batches={self.stable_batches!r}: must be an int >= 1")
        if not isinstance(self.use_prediction, bool):
            raise ValueError(f"use_prediction={self.use_prediction!r}: must be true or false")
        if self.start_size is not None and (not _is_int(self.start_size) or self.start_size < 1):
            raise ValueError(f"start_size={self.start_size!r}: must be None (the batch size) or an int >= 1")
        if not _is_int(self.min_size) or self.min_size < 1:
            raise ValueError(f"min_size={self.min_size!r}: must be an int >= 1")
        if not isinstance(self.probe, bool):
            raise ValueError(f"probe={self.probe!r}: must be true or false")
        if self.probe and self.start_size is not None:
            raise ValueError(f"probe=True with start_size={self.start_size!r}: the probe chooses the first sizes itself")

    @property
    def probes(self) -> bool:
        """Whether the probe applies to this config (module docstring)."""
        return (
            self.probe and self.search == "bisect" and self.use_prediction and self.unit == "samples"
            and self.sizes_for is None and self.start_size is None
        )


@dataclass(frozen=True)
class SearchState:
    """Everything the policy knows; plain data only.

    size: the microbatch size of the next attempt (the largest part of its split).
    found: the chosen maximum size m_max while SETTLING/STEADY, else None.
    best_success: largest size that succeeded and is below first_failure (0 if none).
    first_failure: smallest size that failed or thrashed (None if none).
    successes: every size that ever succeeded, sorted.
    samples: up to two (size, peak_bytes, capacity_bytes) of the latest successes at distinct sizes.
    retrying: the size whose one-off OOM is being rerun (None when no rerun is pending): an OOM
    in that rerun is a repeat, which shrinks (at whatever size it is reported: a token budget's
    rerun may report the microbatch that failed) -- unless only ranks that had not run out yet
    ran out (`retrying_ranks`: every rank's own one-off, one after the other when the hooks were off).
    """

    batch_size: int
    phase: Phase = Phase.SEARCHING
    size: int = 1
    found: Optional[int] = None
    best_success: int = 0
    first_failure: Optional[int] = None
    successes: tuple[int, ...] = ()
    stable_count: int = 0
    samples: tuple[tuple[int, int, int], ...] = ()
    attempts: int = 0
    retrying: Optional[int] = None
    retrying_ranks: tuple[int, ...] = ()
    # The memory the OOMs showed usable: the most their attempts reached (`OOM.reached_bytes`), or a
    # later success's peak. An OOM came just above it, so predictions stay under it where the
    # capacity read says more. None: no OOM moved a bound since the capacity last grew.
    ceiling: Optional[int] = None
    # The capacity read when the failure bound (and the ceiling) was set: a capacity that grows past
    # it by more than CAPACITY_CHANGE reopens the sizes that ran out under less memory.
    bound_capacity: Optional[int] = None
    # The samples of the layout before an `Adopt` of a larger size (a trade that saves bytes per
    # sample): they are the model again where that trade is undone (`Adopt(reopen=True)`).
    shelved: tuple[tuple[int, int, int], ...] = ()

    @property
    def hooks(self) -> bool:
        return self.phase != Phase.STEADY

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "batch_size": self.batch_size,
            "phase": self.phase.value,
            "size": self.size,
            "found": self.found,
            "best_success": self.best_success,
            "first_failure": self.first_failure,
            "successes": list(self.successes),
            "stable_count": self.stable_count,
            "samples": [list(s) for s in self.samples],
            "attempts": self.attempts,
            "retrying": self.retrying,
            "retrying_ranks": list(self.retrying_ranks),
            "ceiling": self.ceiling,
            "bound_capacity": self.bound_capacity,
            "shelved": [list(s) for s in self.shelved],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SearchState":
        version = d.get("version", STATE_VERSION)
        if version != STATE_VERSION:
            raise ValueError(f"policy state version {version!r}: this automicro reads version {STATE_VERSION}")
        try:
            phase = Phase(d["phase"])
        except ValueError:
            raise ValueError(f"policy state phase {d['phase']!r}: must be one of {[p.value for p in Phase]}") from None
        state = cls(
            batch_size=int(d["batch_size"]),
            phase=phase,
            size=int(d["size"]),
            found=None if d.get("found") is None else int(d["found"]),
            best_success=int(d.get("best_success", 0)),
            first_failure=None if d.get("first_failure") is None else int(d["first_failure"]),
            successes=tuple(sorted({int(s) for s in d.get("successes", ())})),
            stable_count=int(d.get("stable_count", 0)),
            samples=tuple((int(m), int(p), int(c)) for m, p, c in d.get("samples", ())),
            attempts=int(d.get("attempts", 0)),
            retrying=None if d.get("retrying") is None else int(d["retrying"]),
            retrying_ranks=tuple(int(r) for r in d.get("retrying_ranks", ())),
            ceiling=None if d.get("ceiling") is None else int(d["ceiling"]),
            bound_capacity=None if d.get("bound_capacity") is None else int(d["bound_capacity"]),
            shelved=tuple((int(m), int(p), int(c)) for m, p, c in d.get("shelved", ())),
        )
        if state.batch_size < 1 or not (1 <= state.size <= state.batch_size):
            raise ValueError(f"policy state size {state.size} / batch size {state.batch_size}: out of range")
        return state


@dataclass(frozen=True)
class Decision:
    """What to do for the next attempt."""

    next_size: int
    split: tuple[int, ...]
    hooks: bool
    rerun: bool
    event: str
    phase: Phase
    reason: HookReason = HookReason.STEADY


# ---- pure helpers ----------------------------------------------------------------------------


def chunk_split(batch_size: int, size: int) -> tuple[int, ...]:
    """Composer's split: chunks of `size`, the last one smaller (e.g. 10, 4 -> (4, 4, 2))."""
    _check_split_args(batch_size, size)
    full, rest = divmod(batch_size, size)
    return (size,) * full + ((rest,) if rest else ())


def even_split(batch_size: int, max_size: int) -> tuple[int, ...]:
    """The fewest microbatches of at most `max_size`, sizes differing by at most 1, larger first.

    e.g. (10, 4) -> (4, 3, 3); (16, 11) -> (8, 8).
    """
    _check_split_args(batch_size, max_size)
    n = -(-batch_size // max_size)
    q, r = divmod(batch_size, n)
    return (q + 1,) * r + (q,) * (n - r)


def probe_split(batch_size: int, floor: int = 1) -> Optional[tuple[int, ...]]:
    """The probe's split: `floor` twice, then chunks of `floor` + 1 (e.g. (32, 1) -> (1, 1, 2, ...,
    2)), so each of the two sizes runs at least once after the first microbatch. None where the
    batch is too small for that (fewer than 3 * floor + 1 samples)."""
    if not _is_int(floor) or floor < 1:
        raise ValueError(f"floor={floor!r}: must be an int >= 1")
    if batch_size < 3 * floor + 1:
        return None
    return (floor, floor) + chunk_split(batch_size - 2 * floor, floor + 1)


def near_split(batch_size: int, largest: int, last_apart: bool = False) -> Optional[tuple[int, ...]]:
    """A split that runs two microbatch sizes near `largest` after its first microbatch: `largest`, then
    `largest` - 1, then chunks of `largest` (e.g. (32, 8) -> (8, 7, 8, 8, 1); (32, 16) -> (16, 15, 1)); where those
    chunks leave one size after the first, `largest` then chunks of `largest` (e.g. (16, 6) -> (6, 6, 4), not
    (6, 5, 5)). So a trade's bytes are measured at about the settled microbatches' efficiency (the probe's split runs
    microbatches of 1 and 2).
    `last_apart`: the last microbatch's peak sets no size's (gradients reduced once per batch:
    `automicro.core.memory.MicrobatchPeaks`): two sizes between the first and the last, `largest` and the rest less
    one, then a last of 1 (e.g. (16, 6) -> (6, 6, 3, 1); (32, 8) -> (8, 8, 8, 7, 1)).
    None where no split gives two sizes after the first (a batch too small, `largest` 1)."""
    if not _is_int(largest) or largest < 2 or batch_size - largest < 2:
        return None
    if last_apart:
        rest = batch_size - 2 * largest
        if rest < 2:
            return None
        middle = [largest]
        while rest - 1 >= largest:
            middle.append(largest)
            rest -= largest
        return (largest, *middle, rest - 1, 1)
    if batch_size - (2 * largest - 1) >= 1:
        rest = batch_size - 2 * largest + 1
        split = (largest, largest - 1) + chunk_split(rest, min(largest, rest))
        if len(set(split[1:])) >= 2:
            return split
    rest = batch_size - largest
    tail = chunk_split(rest, min(largest, rest))
    return (largest,) + tail if len(set(tail)) >= 2 else None


def _check_split_args(batch_size: int, size: int) -> None:
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")
    if not _is_int(size) or not (1 <= size <= batch_size):
        raise ValueError(f"size={size!r}: must be an int in 1..{batch_size}")


def predict_max_size(samples: tuple[tuple[int, int, int], ...], margin: float = SAFETY_MARGIN) -> Optional[int]:
    """Largest size whose linear peak-memory estimate stays under margin * capacity.

    From two (size, peak_bytes, capacity_bytes) samples at distinct sizes: bytes per sample =
    (peak2 - peak1) / (m2 - m1), fixed = peak1 - m1 * bytes per sample. None when it cannot tell.
    """
    if len(samples) < 2:
        return None
    (m1, p1, c1), (m2, p2, c2) = samples[-2], samples[-1]
    if m1 == m2:
        return None
    per_sample = (p2 - p1) / (m2 - m1)
    if not per_sample > 0:
        return None
    fixed = p1 - m1 * per_sample
    capacity = min(c1, c2)
    value = (capacity * margin - fixed) / per_sample
    if not math.isfinite(value):
        return None
    return math.floor(value)


def _model_peak(samples: tuple[tuple[int, int, int], ...], size: int) -> int:
    """The linear model's peak at `size`, through the last two samples (`predict_max_size`)."""
    (m1, p1, _), (m2, p2, _) = samples[-2], samples[-1]
    return int(p1 + (size - m1) * (p2 - p1) / (m2 - m1))


def _under(samples: tuple[tuple[int, int, int], ...], capacity: int) -> tuple[tuple[int, int, int], ...]:
    return tuple((m, p, capacity) for m, p, _ in samples)


def _usable(state: "SearchState") -> tuple[tuple[int, int, int], ...]:
    """The samples under the memory the last OOMs showed usable (`SearchState.ceiling`)."""
    if state.ceiling is None:
        return state.samples
    return tuple((m, p, min(c, state.ceiling)) for m, p, c in state.samples)


def _capped(state: "SearchState") -> bool:
    """Whether an OOM's ceiling is below the capacity read: the read one says more than there is."""
    return state.ceiling is not None and any(state.ceiling < c for _, _, c in state.samples)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _allowed(config: PolicyConfig, batch_size: int) -> Optional[tuple[int, ...]]:
    if config.sizes_for is None:
        return None
    sizes = tuple(s for s in config.sizes_for(batch_size) if s >= min(config.min_size, batch_size))
    if not sizes:
        raise CannotFitError(1, f"no microbatch size can run a batch of {batch_size} samples (the schedule needs more)")
    return sizes


def _min_size(config: PolicyConfig, batch_size: int) -> int:
    allowed = _allowed(config, batch_size)
    return allowed[0] if allowed else min(config.min_size, batch_size)


def _snap(config: PolicyConfig, batch_size: int, size: int) -> int:
    """The largest allowed size at or below `size` (the smallest allowed one if none is)."""
    allowed = _allowed(config, batch_size)
    if allowed is None:
        return size
    return max((s for s in allowed if s <= size), default=allowed[0])


def _between(config: PolicyConfig, state: "SearchState", lo: int, hi: int) -> list[int]:
    """The sizes the search may still try strictly between `lo` and `hi`."""
    floor = _min_size(config, state.batch_size)
    allowed = _allowed(config, state.batch_size) or range(1, state.batch_size + 1)
    return [s for s in allowed if lo < s < hi and s >= floor]


def _best_below(config: PolicyConfig, state: "SearchState", hi: int) -> int:
    """The largest size that ran clean below `hi` and can run the current batch (0 if none)."""
    allowed = _allowed(config, state.batch_size)
    return max((s for s in state.successes if s < hi and (allowed is None or s in allowed)), default=0)


def _hi(state: SearchState) -> int:
    return state.first_failure if state.first_failure is not None else state.batch_size + 1


def _bounds(state: SearchState) -> str:
    hi = "?" if state.first_failure is None else str(state.first_failure)
    return f"bounds {state.best_success}..{hi}"


def initial_state(config: PolicyConfig, batch_size: int) -> SearchState:
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")
    start = config.start_size if config.start_size is not None else batch_size
    start = _snap(config, batch_size, max(_min_size(config, batch_size), min(start, batch_size)))
    state = SearchState(batch_size=batch_size, phase=Phase.SEARCHING, size=start)
    split = _probe(state, config)
    return state if split is None else replace(state, size=max(split))


def _probe(state: SearchState, config: PolicyConfig) -> Optional[tuple[int, ...]]:
    """The probe split while nothing has been tried yet (`PolicyConfig.probe`), else None."""
    if not config.probes or state.phase != Phase.SEARCHING or state.attempts or state.successes:
        return None
    if state.first_failure is not None or state.found is not None:
        return None
    return probe_split(state.batch_size, _min_size(config, state.batch_size))


def current_split(state: SearchState, config: PolicyConfig) -> tuple[int, ...]:
    """The microbatch sizes of the next attempt (sum = batch size)."""
    if state.phase == Phase.SEARCHING or state.found is None:
        probe = _probe(state, config)
        if probe is not None and max(probe) == state.size:
            return probe
        return chunk_split(state.batch_size, state.size)
    if config.search == "halve":
        return chunk_split(state.batch_size, state.found)
    return even_split(state.batch_size, state.found)


def _in_use(state: SearchState, config: PolicyConfig) -> str:
    """How an event names the settled split: the split (samples), or the budget (tokens)."""
    if config.unit == "tokens":
        return f"budget {state.found} tokens"
    return f"split {current_split(state, config)}"


def _decide(state: SearchState, config: PolicyConfig, rerun: bool, event: str) -> Decision:
    split = current_split(state, config)
    return Decision(
        next_size=max(split),
        split=split,
        hooks=state.hooks,
        rerun=rerun,
        event=event,
        phase=state.phase,
    )


def _settle(state: SearchState, config: PolicyConfig, found: int) -> SearchState:
    """Converged on `found`: SETTLING, counter reset, size = largest part of the final split."""
    settled = replace(state, phase=Phase.SETTLING, found=found, stable_count=0)
    if config.unit == "tokens":
        return replace(settled, size=found)
    split = current_split(settled, config)
    return replace(settled, size=max(split))


def _next_search_size(state: SearchState, config: PolicyConfig, upward: bool) -> tuple[Optional[int], bool]:
    """Next size strictly between the bounds (bisect mode); (size, predicted). (None, True): the
    probe's memory model says no size above the best success fits: converge on it."""
    lo, hi = state.best_success, _hi(state)
    floor = _min_size(config, state.batch_size)
    samples = _usable(state)
    if config.sizes_for is not None:
        candidates = _between(config, state, lo, hi)
        if config.use_prediction:
            predicted = predict_max_size(samples)
            fitting = [s for s in candidates if predicted is not None and s <= predicted]
            if fitting:
                return fitting[-1], True
        if config.unit == "tokens":
            # Budgets lie on a grid finer at the bottom (`TokenBudget.sizes_for`): bisect the
            # tokens, not the grid's points (the larger of two as near).
            mid = (lo + hi) / 2
            return min(candidates, key=lambda s: (abs(s - mid), -s)), False
        return candidates[len(candidates) // 2], False
    if config.use_prediction:
        predicted = predict_max_size(samples)
        if not upward and predicted is not None and state.ceiling is not None and _model_peak(samples, hi) < state.ceiling:
            # The size that ran out fits under what the OOMs showed usable, by the model (also where
            # it is predicted to fit even under that): the model cannot explain the failure (the peak
            # grows faster than linearly past its samples, as where a fixed workspace holds the peak
            # of small sizes: torch 2.11 on CPU). Its next prediction would sit just below the
            # failure and likely run out too. Bisect: the next success is a sample nearer the edge.
            return (max(lo, floor - 1) + hi) // 2, False
        if predicted is not None and lo < predicted < hi and predicted >= floor:
            return predicted, True
        if config.probes and predicted is not None and lo >= floor:
            if upward and predicted >= hi:
                return hi - 1, True  # everything below the bound is predicted to fit
            if not upward and predicted >= hi:
                # The size that ran out was predicted to fit, and no OOM has shown what is usable
                # (with a ceiling, the failure is bisected above): less memory is usable than the
                # model says (fragmentation, a workspace). Predict again under the model's peak at it.
                below = predict_max_size(_under(samples, _model_peak(samples, hi)))
                if below is not None and lo < below < hi:
                    return below, True
                return None, True
            edge = predict_max_size(samples, margin=1.0)
            # Not where an OOM set the capacity: filling what it showed usable is asking for another.
            if upward and predicted <= lo and edge is not None and lo < edge and not _capped(state):
                return min(edge, hi - 1), True  # the size predicted to fill the whole capacity
            if predicted <= lo:
                return None, True  # nothing above the best success is predicted to fit: converge
    if upward:
        return (lo + hi + 1) // 2, False
    return (max(lo, floor - 1) + hi) // 2, False


# ---- the transition function -----------------------------------------------------------------


def transition(state: SearchState, outcome: Outcome, config: PolicyConfig) -> tuple[SearchState, Decision]:
    """Pure: the new state and the decision for the next attempt. Raises `CannotFitError`."""
    if isinstance(outcome, Success):
        _check_size(state, outcome.size)
        new, decision = _on_success(replace(state, attempts=state.attempts + 1), outcome, config)
        if new.phase == Phase.STEADY:
            reason = HookReason.STEADY if state.phase == Phase.STEADY else HookReason.STABLE
        else:
            reason = HookReason.SEARCHING if new.phase == Phase.SEARCHING else HookReason.SETTLING
    elif isinstance(outcome, (OOM, Thrash)):
        _check_size(state, outcome.size)
        new, decision = _on_failure(replace(state, attempts=state.attempts + 1), outcome, config)
        reason = HookReason.OOM if isinstance(outcome, OOM) else HookReason.THRASH
        if new.phase == Phase.STEADY:  # thrashing at the floor counted toward the clean batches (`_on_failure`)
            reason = HookReason.STEADY if state.phase == Phase.STEADY else HookReason.STABLE
    elif isinstance(outcome, Rearm):
        new, decision = _on_rearm(state, outcome, config)
        reason = HookReason.REARM
    elif isinstance(outcome, Adopt):
        _check_size(state, outcome.size)
        new, decision = _on_adopt(state, outcome, config)
        reason = HookReason.STEADY if new.phase == Phase.STEADY else (
            HookReason.SEARCHING if new.phase == Phase.SEARCHING else HookReason.SETTLING
        )
    elif isinstance(outcome, Retried):
        _check_size(state, outcome.size)
        new, decision = _on_retried(state, outcome, config)
        reason = HookReason.STEADY if new.phase == Phase.STEADY else HookReason.SETTLING
    elif isinstance(outcome, BatchSizeChanged):
        new, decision = _on_batch_size(state, outcome, config)
        reason = HookReason.BATCH_SIZE_CHANGED
    elif isinstance(outcome, DomainGrew):
        new, decision = _on_domain_grew(state, outcome, config)
        reason = {Phase.SEARCHING: HookReason.SEARCHING, Phase.SETTLING: HookReason.SETTLING}.get(
            new.phase, HookReason.STEADY
        )
    else:
        raise TypeError(f"unknown outcome {outcome!r}")
    return new, replace(decision, reason=reason)


def _check_size(state: SearchState, size: Any) -> None:
    if not _is_int(size) or not (1 <= size <= state.batch_size):
        raise ValueError(f"outcome size {size!r}: must be an int in 1..{state.batch_size}")


def _new_samples(state: SearchState, outcome: Success, config: PolicyConfig) -> tuple[tuple[int, int, int], ...]:
    """The prediction's samples after `outcome`: with the probe, the smallest and the largest size
    of this attempt where it measured two; else this attempt's peak joins the latest other one."""
    if outcome.capacity_bytes is None or outcome.capacity_bytes <= 0:
        return state.samples
    capacity = int(outcome.capacity_bytes)
    by_size = sorted({size: peak for size, peak in outcome.peaks_by_size if peak > 0}.items())
    if config.probes and len(by_size) >= 2:
        # Two sizes of one attempt, the same memory around them.
        return tuple((size, int(peak), capacity) for size, peak in (by_size[0], by_size[-1]))
    if config.probes and by_size:
        # One size after the first microbatch (e.g. (9, 7): the 7): measured as the other samples
        # were, unlike the attempt's peak, which may be the first microbatch's, before gradients.
        m, peak = by_size[-1]
    elif outcome.peak_bytes is None:
        return state.samples
    else:
        m, peak = outcome.size, outcome.peak_bytes
    # Every sample under the capacity read now: other processes take and give back memory.
    samples = _under(tuple(s for s in state.samples if s[0] != m), capacity) + ((m, int(peak), capacity),)
    return samples[-2:]


def _record_success(state: SearchState, outcome: Success, config: PolicyConfig) -> SearchState:
    m = outcome.size
    state = replace(state, retrying=None, retrying_ranks=())
    successes = tuple(sorted(set(state.successes) | {m}))
    samples = _new_samples(state, outcome, config)
    first_failure = state.first_failure
    if first_failure is not None and m >= first_failure:
        # The failure did not reproduce at this size: that bound is stale.
        first_failure = None
    ceiling = state.ceiling
    if ceiling is not None and not outcome.projected and outcome.peak_bytes and outcome.peak_bytes > ceiling:
        ceiling = int(outcome.peak_bytes)  # it ran: at least this much is usable
    new = replace(state, successes=successes, samples=samples, first_failure=first_failure, ceiling=ceiling)
    return replace(new, best_success=_best_below(config, new, _hi(new)))


def _projected_to_fail(state: SearchState, outcome: Success, config: PolicyConfig) -> bool:
    return bool(
        outcome.projected
        and config.use_prediction
        and outcome.peak_bytes
        and outcome.capacity_bytes
        # surely will not fit (no margin: a size that may fit stays)
        and outcome.peak_bytes > min(outcome.capacity_bytes, state.ceiling or outcome.capacity_bytes)
        and outcome.size > _min_size(config, state.batch_size)
    )


def _on_projected_failure(state: SearchState, outcome: Success, config: PolicyConfig) -> tuple[SearchState, Decision]:
    """The attempt ran, but its peak with the memory later batches add does not fit: search below
    it as after a failure (the sample still feeds the prediction), no OOM spent. At the smallest
    size there is nowhere lower: that is an ordinary success (`_projected_to_fail`)."""
    m = outcome.size
    samples = _new_samples(state, outcome, config)
    first_failure = m if state.first_failure is None else min(state.first_failure, m)
    state = replace(
        state, samples=samples, phase=Phase.SEARCHING, found=None, stable_count=0, first_failure=first_failure,
        retrying=None, retrying_ranks=(), bound_capacity=int(outcome.capacity_bytes or 0) or state.bound_capacity,
    )
    state = replace(state, best_success=_best_below(config, state, first_failure))
    return _search_below(state, config, m, False, f"ok at {m}, but its peak with the optimizer state the first step adds does not fit")


def _grew(state: SearchState, capacity: Optional[int]) -> Optional[str]:
    """How the capacity read at a success grew past the one the failure bound was set under, or,
    with no bound, past the one the model's samples were under (it converged where the size above
    was predicted not to fit: a limit of the memory read then, as a bound is)."""
    if state.first_failure is None and state.ceiling is None:
        before = min((c for _, _, c in state.samples), default=None) if state.found is not None else None
    else:
        before = state.bound_capacity
    if capacity_moved(before, capacity) != "grew":
        return None
    return f"{_mib(before)} -> {_mib(capacity)}"  # type: ignore[arg-type]


def _on_success(state: SearchState, outcome: Success, config: PolicyConfig) -> tuple[SearchState, Decision]:
    m = outcome.size
    grew = _grew(state, outcome.capacity_bytes)
    if grew is not None:
        # Memory came back (another process gave it up): what ran out, or was predicted not to
        # fit, under less is no bound now.
        state = replace(state, first_failure=None, ceiling=None, bound_capacity=None)
    if _projected_to_fail(state, outcome, config):
        return _on_projected_failure(state, outcome, config)
    lo_before = state.best_success
    state = _record_success(state, outcome, config)
    if grew is not None and state.phase != Phase.SEARCHING and config.search == "bisect" and config.unit == "samples":
        lo = state.best_success
        searching = replace(state, phase=Phase.SEARCHING, found=None, stable_count=0)
        # A size that ran clean before is above the one in use, or the model now has one above.
        if _between(config, state, lo, _hi(state)) and (
            lo > (state.found or 0) or _next_search_size(searching, config, upward=True)[0] is not None
        ):
            return _search_above(searching, config, f"ok at {m}; memory capacity grew ({grew}): larger sizes may fit")
    if state.phase == Phase.STEADY:
        return state, _decide(state, config, False, "")
    if state.phase == Phase.SETTLING:
        count = state.stable_count + 1
        if count >= config.stable_batches:
            state = replace(state, phase=Phase.STEADY, stable_count=count)
            return state, _decide(
                state, config, False, f"stable for {count} batches at {_in_use(state, config)}: sync hooks off"
            )
        state = replace(state, stable_count=count)
        return state, _decide(state, config, False, f"clean batch {count}/{config.stable_batches} at {_in_use(state, config)}")

    # SEARCHING
    if config.search == "halve":
        state = _settle(state, config, m)
        return state, _decide(state, config, False, f"ok at {m} -> settled on {m}, {_in_use(state, config)}")
    lo, hi = state.best_success, _hi(state)
    if config.unit == "tokens" and lo == lo_before and lo < state.size < hi:
        # (tokens) The batch did not fill the budget tried: it ran clean below a bound that ran out,
        # so keep it (not the smaller microbatch that ran: later batches pack more under it). Should a
        # later batch fill it and run out, that OOM is the evidence and the budget steps down.
        budget = state.size
        state = _settle(state, config, budget)
        return state, _decide(
            state, config, False, f"ok at {m} (budget {budget} not filled) -> converged on {budget}, {_in_use(state, config)}"
        )
    if not _between(config, state, lo, hi) or (config.unit == "tokens" and lo == lo_before):
        state = _settle(state, config, lo)
        return state, _decide(
            state, config, False, f"ok at {m} -> converged on {lo}, {_in_use(state, config)}"
        )
    return _search_above(state, config, f"ok at {m}")


def _search_above(state: SearchState, config: PolicyConfig, event: str) -> tuple[SearchState, Decision]:
    """After a success, searching: the next size above the best success, or settle on it where the
    model says nothing above fits. `event` starts the decision's line."""
    lo = state.best_success
    size, predicted = _next_search_size(state, config, upward=True)
    if size is None:
        state = _settle(state, config, lo)
        return state, _decide(state, config, False, f"{event} -> converged on {lo}, {_in_use(state, config)} ({PREDICTED_EDGE})")
    state = replace(state, size=size)
    how = "predicted; " if predicted else ""
    return state, _decide(state, config, False, f"{event} -> try {size} ({how}{_bounds(state)})")


def _on_failure(state: SearchState, outcome: Union[OOM, Thrash], config: PolicyConfig) -> tuple[SearchState, Decision]:
    m = outcome.size
    oom = isinstance(outcome, OOM)
    what = "OOM" if oom else "thrash"
    floor = _min_size(config, state.batch_size)
    was = state.phase
    shrank = _shrank(state, outcome.capacity_bytes if oom else None)  # type: ignore[union-attr]
    if oom and outcome.may_rerun and not shrank and is_one_off(state, m, outcome.ranks):  # type: ignore[union-attr]
        # One OOM at a size that already ran clean is an event (a long sequence, fragmentation,
        # memory left by an eval or a checkpoint), not a new limit: rerun the same split with
        # the sync hooks on. Only a repeat (an OOM in that rerun) moves the bounds.
        phase = Phase.SEARCHING if state.found is None else Phase.SETTLING
        ranks = tuple(sorted(set(state.retrying_ranks) | set(outcome.ranks)))  # type: ignore[union-attr]
        state = replace(state, phase=phase, stable_count=0, retrying=m, retrying_ranks=ranks)
        return state, _decide(
            state, config, True, f"OOM at {m} in {was.value.lower()} phase -> rerun at {m} with sync hooks on"
        )
    state = replace(state, retrying=None, retrying_ranks=())
    if m <= floor:
        if oom:
            raise CannotFitError(m)
        # Thrashing at the smallest size: it still runs, there is nowhere lower to go. Settled there, the batch counts
        # as a clean one toward the hooks coming off (allocator retries every other batch otherwise kept them on
        # for a whole run: one H200, Llama-3.2 1B's shape at 65,536 tokens a sample, the thrashing batches as fast).
        if state.found == floor and state.phase != Phase.SEARCHING:
            state, decision = _on_success(state, Success(m), config)
            more = f"; {decision.event}" if decision.event else ""
            return state, replace(decision, event=f"thrash at {m}: cannot go lower, staying at {floor}{more}")
        state = _settle(replace(state, stable_count=0), config, floor)
        return state, _decide(state, config, False, f"thrash at {m}: cannot go lower, staying at {floor}")

    first_failure = m if state.first_failure is None else min(state.first_failure, m)
    state = replace(state, phase=Phase.SEARCHING, found=None, stable_count=0, first_failure=first_failure)
    if oom:
        state = _learn_from_oom(state, outcome)  # type: ignore[arg-type]
    elif _last_capacity(state):
        # Thrashing under this capacity: memory that comes back later reopens the sizes above too.
        state = replace(state, bound_capacity=_last_capacity(state))
    state = replace(state, best_success=_best_below(config, state, first_failure))
    again = "" if was == Phase.SEARCHING else f" in {was.value.lower()} phase"
    if shrank is not None:
        again += f" (memory capacity shrank: {shrank})"
    return _search_below(state, config, m, oom, f"{what} at {m}{again}")


def _last_capacity(state: SearchState) -> Optional[int]:
    return state.samples[-1][2] if state.samples else None


def _shrank(state: SearchState, capacity: Optional[int]) -> Optional[str]:
    """How the capacity read at a failure shrank since the last success's ("", None: it did not)."""
    before = _last_capacity(state)
    if capacity_moved(before, capacity) != "shrank":
        return None
    return f"{_mib(before)} -> {_mib(capacity)}, another process took memory"  # type: ignore[arg-type]


def _learn_from_oom(state: SearchState, outcome: OOM) -> SearchState:
    """A bound-moving OOM corrects the memory model: what its attempt had reached is usable, and not
    much more (up to the one allocation that failed). The ceiling is the most any OOM (or a later
    success) reached; it stands for the capacity wherever the capacity read says more."""
    ceiling = state.ceiling
    if outcome.reached_bytes:
        ceiling = int(outcome.reached_bytes) if ceiling is None else max(ceiling, int(outcome.reached_bytes))
    bound_capacity = int(outcome.capacity_bytes) if outcome.capacity_bytes else state.bound_capacity
    return replace(state, ceiling=ceiling, bound_capacity=bound_capacity)


def _search_below(state: SearchState, config: PolicyConfig, m: int, rerun: bool, event: str) -> tuple[SearchState, Decision]:
    """After a failure (or a projected one) at `m`, its bound already set: the next size below it,
    or settle where nothing is left between the bounds. `event` starts the decision's line."""
    floor = _min_size(config, state.batch_size)
    if config.search == "halve":
        size = _snap(config, state.batch_size, max(floor, m // 2))
        state = replace(state, size=size)
        return state, _decide(state, config, rerun, f"{event} -> try {size} (halving)")
    lo, hi = state.best_success, _hi(state)
    if lo >= floor and not _between(config, state, lo, hi):
        state = _settle(state, config, lo)
        return state, _decide(state, config, rerun, f"{event} -> converged on {lo}, {_in_use(state, config)}")
    size, predicted = _next_search_size(state, config, upward=False)
    if size is None:
        state = _settle(state, config, lo)
        return state, _decide(state, config, rerun, f"{event} -> converged on {lo}, {_in_use(state, config)} ({PREDICTED_EDGE})")
    state = replace(state, size=size)
    how = "predicted; " if predicted else ""
    return state, _decide(state, config, rerun, f"{event} -> try {size} ({how}{_bounds(state)})")


def is_one_off(state: SearchState, size: int, ranks: tuple[int, ...] = ()) -> bool:
    """Whether an OOM at `size` on `ranks` gets a rerun at that size: the size ran clean, and no
    rerun is pending, or the pending rerun's OOM came only from ranks that had not run out before
    (each rank's own one-off; with the hooks off, a rank stopped by another's failure meets its
    own one attempt later). At most one rerun per rank: then it is a repeat."""
    if size not in state.successes:
        return False
    if state.retrying is None:
        return True
    return state.retrying == size and bool(ranks) and bool(state.retrying_ranks) and not set(ranks) & set(state.retrying_ranks)


def _on_rearm(state: SearchState, outcome: Rearm, config: PolicyConfig) -> tuple[SearchState, Decision]:
    reason = f" ({outcome.reason})" if outcome.reason else ""
    if state.phase == Phase.STEADY:
        state = replace(state, phase=Phase.SETTLING, stable_count=0)
        return state, _decide(
            state, config, False, f"rearm{reason}: sync hooks on until {config.stable_batches} clean batches"
        )
    state = replace(state, stable_count=0)
    return state, _decide(state, config, False, f"rearm{reason}: stable count reset")


def _on_adopt(state: SearchState, outcome: Adopt, config: PolicyConfig) -> tuple[SearchState, Decision]:
    if outcome.reopen:
        return _on_reopen(state, outcome.size, outcome.capacity_bytes, config)
    if (
        state.phase != Phase.STEADY or state.found is None or not _is_int(outcome.size)
        or not 1 <= outcome.size <= state.batch_size or outcome.size == state.found
        or (config.unit == "tokens" and outcome.size > state.found)
    ):
        raise ValueError(
            f"Adopt({outcome.size}) needs a steady search found at another size (over tokens, a smaller one) (state {state})"
        )
    if outcome.size > state.found:
        # A layout that saves bytes per sample made a larger size fit: what failed above the size
        # found, and the memory model, were the other layout's (the model is rebuilt from this one's peaks).
        first_failure = state.first_failure if state.first_failure is not None and state.first_failure > outcome.size else None
        state = replace(
            state, first_failure=first_failure, best_success=outcome.size, samples=(), shelved=state.samples,
            successes=tuple(sorted(set(state.successes) | {outcome.size})),
        )
    state = replace(state, found=outcome.size)
    # Over tokens the size is the budget itself (a size trial's, `automicro.core.layout`).
    state = replace(state, size=outcome.size if config.unit == "tokens" else max(current_split(state, config)))
    return state, _decide(state, config, False, f"layout: microbatch now {outcome.size}, {_in_use(state, config)}")


def _on_retried(state: SearchState, outcome: Retried, config: PolicyConfig) -> tuple[SearchState, Decision]:
    size, found = outcome.size, state.found
    if (
        state.phase == Phase.SEARCHING or found is None or size <= found or size not in state.successes
        or config.unit != "samples"
    ):
        raise ValueError(
            f"Retried({size}) needs a search over samples settled below {size}, where {size} ran clean (state {state})"
        )
    bound = outcome.bound if outcome.bound is not None and outcome.bound > size else None
    state = replace(state, found=size, best_success=max(state.best_success, size), first_failure=bound,
                    retrying=None, retrying_ranks=())
    state = replace(state, size=max(current_split(state, config)))
    return state, _decide(state, config, False, f"thrash at {size} timed faster than {found}: back to {size}, {_in_use(state, config)}")


def _on_reopen(
    state: SearchState, size: int, capacity: Optional[int], config: PolicyConfig,
) -> tuple[SearchState, Decision]:
    """`Adopt(size, reopen=True, capacity_bytes)`: search upward again from `size` (see `Adopt`)."""
    if config.unit == "tokens":
        raise ValueError(f"Adopt({size}, reopen=True) needs a search over samples (unit {config.unit!r})")
    samples = state.shelved if not capacity else _under(state.shelved, int(capacity))
    state = replace(
        state, phase=Phase.SEARCHING, found=None, stable_count=0, best_success=size, first_failure=None,
        successes=tuple(sorted({s for s in state.successes if s <= size} | {size})), samples=samples,
        shelved=(), ceiling=None, bound_capacity=None, retrying=None, retrying_ranks=(),
    )
    event = f"layout: the trade that admitted a larger size is undone, {size} is the size found without it"
    if config.search != "bisect" or not _between(config, state, size, _hi(state)):
        state = _settle(state, config, size)
        return state, _decide(state, config, False, f"{event}; {_in_use(state, config)}")
    state = replace(state, size=size)
    return _search_above(state, config, event)


def _on_batch_size(state: SearchState, outcome: BatchSizeChanged, config: PolicyConfig) -> tuple[SearchState, Decision]:
    new_b = outcome.new_B
    if not _is_int(new_b) or new_b < 1:
        raise ValueError(f"new_B={new_b!r}: must be an int >= 1")
    old_b = state.batch_size
    first_failure = state.first_failure
    if first_failure is not None and first_failure > new_b:
        first_failure = None
    state = replace(state, batch_size=new_b, first_failure=first_failure, stable_count=0)
    state = replace(state, best_success=_best_below(config, state, _hi(state)))
    floor = _min_size(config, new_b)
    prefix = f"batch size {old_b} -> {new_b}"

    if state.found is not None:
        # m_max known: split the new batch with it; hooks on until stable again.
        state = _settle(replace(state, phase=Phase.SETTLING), config, _snap(config, new_b, min(state.found, new_b)))
        return state, _decide(state, config, False, f"{prefix}: {_in_use(state, config)}")

    if config.search == "halve":
        state = replace(state, phase=Phase.SEARCHING, size=_snap(config, new_b, max(floor, min(state.size, new_b))))
        return state, _decide(state, config, False, f"{prefix}: try {state.size}")

    lo, hi = state.best_success, _hi(state)
    if lo >= floor and not _between(config, state, lo, hi):
        state = _settle(state, config, lo)
        return state, _decide(state, config, False, f"{prefix}: converged on {lo}, {_in_use(state, config)}")
    size = _snap(config, new_b, min(state.size, new_b))
    if size not in _between(config, state, lo, hi):
        size, _ = _next_search_size(state, config, upward=state.first_failure is None)
        if size is None:
            state = _settle(state, config, lo)
            return state, _decide(state, config, False, f"{prefix}: converged on {lo}, {_in_use(state, config)} ({PREDICTED_EDGE})")
    state = replace(state, phase=Phase.SEARCHING, size=size)
    return state, _decide(state, config, False, f"{prefix}: try {size} ({_bounds(state)})")


def _on_domain_grew(state: SearchState, outcome: DomainGrew, config: PolicyConfig) -> tuple[SearchState, Decision]:
    new_b = outcome.new_B
    if not _is_int(new_b) or new_b < 1:
        raise ValueError(f"new_B={new_b!r}: must be an int >= 1")
    old_b = state.batch_size
    if new_b <= old_b:
        return state, _decide(state, config, False, "")
    grown = replace(state, batch_size=new_b)
    if state.found is not None and state.first_failure is None:
        # Nothing ever failed: the new, larger batches may fit in fewer microbatches.
        grown = replace(grown, phase=Phase.SEARCHING, found=None, stable_count=0, size=_snap(config, new_b, new_b))
        return grown, _decide(grown, config, False, f"domain {old_b} -> {new_b}: nothing failed yet, try {grown.size}")
    if state.found is None and state.first_failure is None and state.size == old_b:
        grown = replace(grown, size=_snap(config, new_b, new_b))
    return grown, _decide(grown, config, False, "")


# ---- the stateful wrapper --------------------------------------------------------------------


class SearchPolicy:
    """Holds the config and the current `SearchState`; `observe()` runs one transition."""

    def __init__(self, config: Optional[PolicyConfig], batch_size: int) -> None:
        self.config = config if config is not None else PolicyConfig()
        self.state: SearchState = initial_state(self.config, batch_size)

    def observe(self, outcome: Outcome) -> Decision:
        """Feed one (already all-reduced) outcome; on `CannotFitError` the state is unchanged."""
        self.state, decision = transition(self.state, outcome, self.config)
        return decision

    def current_split(self) -> tuple[int, ...]:
        return current_split(self.state, self.config)

    def probe_split(self) -> Optional[tuple[int, ...]]:
        """The probe's split of this batch (two sizes at the floor; None where the batch is too
        small): a layout trade's bytes are measured with it (`automicro.core.layout`)."""
        return probe_split(self.state.batch_size, _min_size(self.config, self.state.batch_size))

    def near_split(self, largest: int, last_apart: bool = False) -> Optional[tuple[int, ...]]:
        """`near_split` of this batch (None where it has no two sizes after its first microbatch)."""
        return near_split(self.state.batch_size, largest, last_apart)

    def split_for(self, found: int) -> tuple[int, ...]:
        """The split a settled search at `found` would run (the found size's own split rule)."""
        return current_split(replace(self.state, phase=Phase.STEADY, found=found), self.config)

    def projected_peak(self, size: int) -> Optional[int]:
        """The memory model's peak bytes for a microbatch of `size` (the last two samples at distinct
        sizes, growing with the size); None where it cannot tell."""
        samples = self.state.samples
        if len(samples) < 2 or samples[-1][0] == samples[-2][0]:
            return None
        (m1, p1, _), (m2, p2, _) = samples[-2], samples[-1]
        if not (p2 - p1) / (m2 - m1) > 0:
            return None
        return _model_peak(samples, size)

    def usable_bytes(self, capacity: int) -> int:
        """`capacity` (read), or less where an OOM showed less usable (`SearchState.ceiling`)."""
        ceiling = self.state.ceiling
        return capacity if ceiling is None or not capacity else min(capacity, ceiling)

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    @property
    def floor(self) -> int:
        """The smallest size this batch allows (below it the run ends, or the ladder steps)."""
        return _min_size(self.config, self.state.batch_size)

    @property
    def found_size(self) -> Optional[int]:
        return self.state.found

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def hooks(self) -> bool:
        return self.state.hooks

    def __repr__(self) -> str:
        return f"SearchPolicy(config={self.config!r}, state={self.state!r})"


__all__ = [
    "SAFETY_MARGIN",
    "Adopt",
    "BatchSizeChanged",
    "CannotFitError",
    "Decision",
    "DomainGrew",
    "HookReason",
    "OOM",
    "Outcome",
    "PREDICTED_EDGE",
    "Phase",
    "PolicyConfig",
    "Rearm",
    "Retried",
    "SearchPolicy",
    "SearchState",
    "Success",
    "Thrash",
    "capacity_moved",
    "chunk_split",
    "current_split",
    "even_split",
    "initial_state",
    "is_one_off",
    "predict_max_size",
    "probe_split",
    "transition",
]
