"""Static shapes once the size settles: the compiled blocks are compiled again at the settled
split, and kept so where they measure no slower.

With compile's ``dynamic: null`` (the default) dynamo compiles a block static at the first
microbatch size it sees and, at the second, again with the batch dimension dynamic; every later
size runs that dynamic graph, whose kernels were chosen for the size it was compiled at. The
search visits many sizes (the probe's 1 and 2, then its predictions, then the size trials), so
the graph that trains the rest of the run is a dynamic one tuned for a size the run never trains
at. Measured on one H200 (transformers Llama in TinyLlama's shape, seq 2048, compiled, split
(16, 16), `benchmarks/RESULTS.md`, 2026-11-29, the compiled TinyLlama row): 1.24 s a batch under `auto`, 1.16 s with the
blocks compiled dynamic at 16, 1.12 s compiled static at 16.

Once the search has settled (the sync hooks are off) and the layout trials have nothing running,
`StaticShapes` times `batches` batches as they are, compiles the blocks again
(`CompiledBlocks.recompile(None)`: every graph dropped, torch's automatic dynamic from scratch, so
the settled microbatch size is compiled static and only what still varies, such as a layer index,
becomes dynamic), lets one batch compile, times as many batches again, and keeps the new graphs
unless the old ones were faster by more than `min_gain` and the spread. Then the blocks are
compiled once more dynamic in the batch dimension only (the kind of graph the search left, now
compiled at the settled size; not ``dynamic: true``, which makes every dimension dynamic: on one
H200, Qwen2.5-0.5B's shape, 0.654 s a batch against 0.593 s as the search compiled them, session
34), timed the same way, and kept unless the static graphs beat them beyond the noise (then static
again). The batch times are the slowest rank's (one consensus round). One line says each decision,
with both medians. Nothing changes the numbers: the same blocks, the same parameters, the same
optimizer state.

A size that changes later (an OOM, a last short batch) makes torch's automatic dynamic compile
one dynamic graph beside the static one, as at the start. Not tried, said once: compile's
``dynamic`` set (the user's choice), a token budget (every microbatch has its own shape: the
graphs stay dynamic); ``scope: model`` and a pipeline compile no blocks.

Owns: when the blocks are compiled again, the measurement and the line. May not touch: the
search policy, the layout trials (it only asks whether one runs), Composer.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, Optional

import torch

from automicro.core.layout import judge
from automicro.batch.trial_timing import BatchClock, agreed_times, enough, timed_arm
from automicro.engine.compile import CompiledBlocks

BATCHES = 3  # timed batches each side at most (the layout trials' default; 2 where the spread is tiny)
MIN_GAIN = 0.01


# The arms, in the order they run: the graphs as the search compiled them; compiled again from
# scratch (static at the settled size); compiled again dynamic in the batch only (the search's kind
# of graph at the settled size), timed only where the search's graphs beat the static ones.
ARMS = ("search", "static", "batch")


class StaticShapes:
    """Asked before and after each batch that the training search runs (`before_batch`,
    `after_batch`); states: waiting -> timing_search -> compiling -> timing_static -> static, or
    -> compiling -> timing_batch -> batch | static; `off` where it does not apply or its price rules it out. A
    trial of the plan (`automicro.batch.trial_plan`, "static"), priced without a profile: it changes the kernels
    themselves."""

    name = "static"
    profiled = False

    def __init__(
        self, compiled: Optional[CompiledBlocks], consensus: Any, info: Callable[[str], None], device: torch.device,
        why_not: Optional[str] = None, batches: int = BATCHES, min_gain: float = MIN_GAIN,
    ) -> None:
        self.compiled, self.consensus, self.info = compiled, consensus, info
        self.batches, self.min_gain = batches, min_gain
        self.state = "off" if compiled is None or why_not is not None else "waiting"
        if compiled is not None and why_not is not None:
            info(f"compile: the blocks stay as compiled ({why_not}); no static recompile at the settled size")
        self.split: Optional[tuple[int, ...]] = None
        self.times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        self.result: Optional[Any] = None  # the last `TrialResult` once decided
        self.clock = BatchClock(device)
        self._next = ""  # the arm the batch in progress compiles ("compiling")
        self.compile_batch_s = 0.0  # the longest batch that compiled the blocks anew (what a compile of them costs)
        # Tests replace it to make one arm look faster or slower without depending on the machine.
        self.timing: Callable[[str, float], float] = lambda arm, seconds: seconds

    @property
    def _arm(self) -> Optional[str]:
        return timed_arm(self.state)

    @property
    def done(self) -> bool:
        """Decided, or not tried: the blocks' graphs stay as they are."""
        return self.state in ("static", "batch", "off")

    @property
    def pending(self) -> bool:
        return self.state == "waiting"

    @property
    def running(self) -> bool:
        return not self.done and self.state != "waiting"

    @property
    def label(self) -> Optional[str]:
        return self.name if self.running else None

    def candidates(self) -> list[tuple[str, str, dict[str, float]]]:
        return [(self.name, "static", {})]

    def rule_out(self, why: str) -> None:
        self.state = "off"
        self.info(f"compile: the blocks stay as the search compiled them, not compiled again at the settled size: {why}")

    def outcome(self) -> str:
        if self.state == "static":
            return "compiled again, static: kept"
        if self.state == "batch":
            return "compiled again, dynamic in the batch: kept"
        return "not compiled again" if self.state == "off" else self.state

    @property
    def won_s(self) -> float:
        """What the graphs kept won a batch against the search's, as timed, where they won by the rule for keeping (the
        static recompile is kept unless beaten: a level one won nothing)."""
        kept, search = self.times.get(self.state) if self.state in ("static", "batch") else None, self.times.get("search")
        if not kept or not search or self.state == "search":
            return 0.0
        return judge(self.state, kept, search, self.min_gain).won_s

    def projection(self) -> str:
        return f"a compile of the blocks and up to {2 * self.batches} timed batches (one more compile and {self.batches} where the search's graphs win)"

    def before_batch(self, ready: bool, split: tuple[int, ...]) -> None:
        """`ready`: the plan gives this trial the batch (the size settled, no other trial running); `split`:
        this batch's split."""
        if self.state == "waiting" and ready:
            self.state, self.split = "timing_search", split
        elif self.state == "timing_search" and (not ready or split != self.split):
            self.state, self.times["search"] = "waiting", []  # the size moved: start again once settled
        if self._arm is not None or self.state == "compiling":
            self.clock.start()

    def after_batch(self, attempts: int, split: tuple[int, ...]) -> None:
        """The batch succeeded after `attempts` attempts at `split`."""
        if self.state in ("static", "batch", "off", "waiting"):
            return
        seconds = self.clock.stop()
        if self.state == "compiling":
            self.state = f"timing_{self._next}"  # that batch compiled the new graphs: not timed
            self.compile_batch_s = max(self.compile_batch_s, seconds)
            return
        arm = self._arm
        assert arm is not None and self.compiled is not None
        if attempts == 1 and split == self.split:
            self.times[arm].append(self.timing(arm, seconds))
        elif arm != "search":  # an OOM or another size: nothing to compare against; keep these graphs
            self._settle(arm, None)
            return
        if not enough(self.consensus, [self.times[arm]], self.batches, self.min_gain):
            return
        if arm == "search":
            self._compile("static")
        elif arm == "static":
            self._decide_static()
        else:
            self._decide_batch()

    def _compile(self, arm: str) -> None:
        assert self.compiled is not None
        self.compiled.recompile(None, batch_dynamic=arm == "batch")
        self.state, self._next = "compiling", arm

    def _where(self) -> str:
        assert self.split is not None
        return f"microbatch {max(self.split)} (split {list(self.split)})"

    def _medians(self, first: str, second: str) -> str:
        a, b = (statistics.median(self.times[arm]) for arm in (first, second))
        assert self.result is not None
        return (f"median batch {a:.4f} s {_NAMES[first]}, {b:.4f} s {_NAMES[second]} ({100.0 * (1.0 - a / b):+.1f}%; "
                f"spread {self.result.spread:.4f} s)")

    def _agree(self, arm: str) -> list[float]:
        self.times[arm] = agreed_times(self.consensus, self.times[arm])
        return self.times[arm]

    def _decide_static(self) -> None:
        self.result = judge("search", self._agree("search"), self._agree("static"), self.min_gain)
        if not self.result.kept:
            self._settle("static", f"compile: the blocks compiled again at the settled {self._where()} (static in the batch): "
                                   f"kept; {self._medians('static', 'search')}")
            return
        self.info(f"compile: the blocks compiled again at the settled {self._where()} (static in the batch): not kept, "
                  f"{self._medians('static', 'search')}; compiling them dynamic in the batch at that size (as the search "
                  "compiled them), timed against static")
        self._compile("batch")

    def _decide_batch(self) -> None:
        self.result = judge("static", self.times["static"], self._agree("batch"), self.min_gain)
        if self.result.kept:  # static beats the batch-dynamic graphs beyond the noise: back to static
            assert self.compiled is not None
            self.compiled.recompile(None)
            self._settle("static", f"compile: the blocks dynamic in the batch: not kept, {self._medians('batch', 'static')}; "
                                   "compiled static again")
        else:
            self._settle("batch", f"compile: the blocks dynamic in the batch: kept; {self._medians('batch', 'static')}")

    def _settle(self, arm: str, line: Optional[str]) -> None:
        self.state = arm
        self.info(line or f"compile: the blocks compiled again at the settled {self._where()} "
                          f"({_NAMES[arm]}); kept, not compared (the size moved)")


_NAMES = {"search": "as the search compiled them", "static": "compiled again", "batch": "dynamic in the batch"}


__all__ = ["StaticShapes"]
