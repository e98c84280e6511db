"""Static shapes once the size settles: the compiled blocks are compiled again at the settled
split, and kept so where they measure no slower.

With compile's ``dynamic: null`` (the default) dynamo compiles a block static at the first
microbatch size it sees and, at the second, again with the batch dimension dynamic; every later
size runs that dynamic graph, whose kernels were chosen for the size it was compiled at. The
search visits many sizes (the probe's 1 and 2, then its predictions, then the size trials), so
the graph that trains the rest of the run is a dynamic one tuned for a size the run never trains
at. Measured on one H200 (transformers Llama in TinyLlama's shape, seq 2048, compiled, split
(16, 16), `benchmarks/RESULTS.md` session 33): 1.24 s a batch under `auto`, 1.16 s with the
blocks compiled dynamic at 16, 1.12 s compiled static at 16.

Once the search has settled (the sync hooks are off) and the layout trials have nothing running,
`StaticShapes` times `batches` batches as they are, compiles the blocks again
(`CompiledBlocks.recompile(None)`: every graph dropped, torch's automatic dynamic from scratch, so
the settled microbatch size is compiled static and only what still varies, such as a layer index,
becomes dynamic), lets one batch compile, times as many batches again, and keeps the new graphs
unless the old ones were faster by more than `min_gain` and the spread; then the blocks are
compiled dynamic (one graph for every size) instead. The batch times are the slowest rank's (one
consensus round). One line says what was kept, with both medians. Nothing changes the numbers:
the same blocks, the same parameters, the same optimizer state.

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
from automicro.integration.trial_timing import BatchClock, agreed_times
from automicro.engine.compile import CompiledBlocks

BATCHES = 3  # timed batches each side (the layout trials' default)
MIN_GAIN = 0.01


class StaticShapes:
    """Asked before and after each batch that the training search runs (`before_batch`,
    `after_batch`); states: waiting -> timing the dynamic graphs -> compiling -> timing the static
    ones -> static | dynamic; `off` where it does not apply."""

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
        self.times: dict[str, list[float]] = {"dynamic": [], "static": []}
        self.result: Optional[Any] = None  # the `TrialResult` once decided
        self.clock = BatchClock(device)
        self._timing = False  # the clock runs for the batch in progress
        # Tests replace it to make one arm look faster or slower without depending on the machine.
        self.timing: Callable[[str, float], float] = lambda arm, seconds: seconds

    @property
    def _arm(self) -> Optional[str]:
        return {"timing_dynamic": "dynamic", "timing_static": "static"}.get(self.state)

    def before_batch(self, steady: bool, trial_running: bool, split: tuple[int, ...]) -> None:
        """`steady`: the search has settled (hooks off); `trial_running`: a layout trial runs or
        starts with this batch; `split`: this batch's split."""
        if self.state == "waiting" and steady and not trial_running:
            self.state, self.split = "timing_dynamic", split
        elif self.state == "timing_dynamic" and (not steady or trial_running or split != self.split):
            self.state, self.times["dynamic"] = "waiting", []  # the size moved: start again once settled
        if self._arm is not None or self.state == "compiling":
            self.clock.start()
            self._timing = True

    def after_batch(self, attempts: int, split: tuple[int, ...]) -> None:
        """The batch succeeded after `attempts` attempts at `split`."""
        if self.state in ("static", "dynamic", "off", "waiting"):
            return
        seconds = self.clock.stop() if self._timing else 0.0
        self._timing = False
        arm = self._arm
        if self.state == "compiling":
            self.state = "timing_static"  # that batch compiled the static graphs: not timed
            return
        assert arm is not None
        if attempts == 1 and split == self.split:
            self.times[arm].append(self.timing(arm, seconds))
        elif arm == "static":  # an OOM or another size: nothing to compare against; keep static
            self._decide(compared=False)
            return
        if len(self.times[arm]) < self.batches:
            return
        if arm == "dynamic":
            assert self.compiled is not None
            self.compiled.recompile(None)
            self.state = "compiling"
        else:
            self._decide(compared=True)

    def _decide(self, compared: bool) -> None:
        assert self.compiled is not None and self.split is not None
        where = f"microbatch {max(self.split)} (split {list(self.split)})"
        if not compared or not self.times["dynamic"] or not self.times["static"]:
            self.state = "static"
            self.info(f"compile: the blocks compiled again at the settled {where}; kept, not compared (the size moved)")
            return
        dynamic, static = (agreed_times(self.consensus, self.times[arm]) for arm in ("dynamic", "static"))
        self.result = judge("dynamic", dynamic, static, self.min_gain)
        medians = (
            f"median batch {statistics.median(static):.4f} s compiled again, {statistics.median(dynamic):.4f} s as the search "
            f"compiled them ({100.0 * (1.0 - statistics.median(static) / statistics.median(dynamic)):+.1f}%; "
            f"spread {self.result.spread:.4f} s)"
        )
        if self.result.kept:  # the dynamic graphs were faster beyond the noise
            self.compiled.recompile(True)
            self.state = "dynamic"
            self.info(f"compile: the blocks compiled again at the settled {where}: not kept, {medians}; the blocks "
                      "compiled with dynamic shapes")
        else:
            self.state = "static"
            self.info(f"compile: the blocks compiled again at the settled {where} (static in the batch): kept; {medians}")


__all__ = ["StaticShapes"]
