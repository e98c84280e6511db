"""The compile scope, measured: the whole model compiled against each block compiled.

Which scope is faster depends on the model, and the difference is not small (one H200, FSDP2 on one
rank, seq 2048, per-rank batch 32, fixed microbatch 16, `benchmarks/RESULTS.md` session 34: Qwen2.5-0.5B's
shape 106.5k tokens/s with each block compiled, 98.0k with the whole model; `automicro.models`' Llama 1B,
session 32: the whole model 1.8% faster). With compile's ``scope`` unset (the default) the blocks are
compiled, and once the search has settled, the layout trials have nothing running and the blocks'
graphs are settled (`compile_shapes.StaticShapes` decided or does not apply), `ScopeChoice` lets one
batch pass, times `batches` batches with the blocks, compiles the whole model's ``forward`` instead
(`CompiledBlocks.compile_model`: every block eager again, every graph dropped), lets one batch compile,
times as many, and keeps the whole model only where it is faster beyond `min_gain` and the spread;
otherwise the blocks are compiled again as they were (static or dynamic in the batch). The batch
times are the slowest rank's (one consensus round). An OOM or a new split while the whole model is
timed undoes it (its graphs may hold more memory than the blocks'). One line says what was kept, with
both medians and what the whole model's compile batch took. Nothing changes the numbers: the same
modules, parameters and optimizer state; only which ``forward`` dynamo compiles.

Not tried: a ``scope`` the user set (``blocks`` or ``model``), a token budget (every microbatch has its
own shape), a model whose only FSDP2 unit is its root (one scope), no FSDP2 (``model`` from the start).
The cost: one whole-model compile (Qwen2.5-0.5B's shape on one H200: a 24.7 s first batch against
3.2 s for the blocks, session 34) and, where the blocks stay, one blocks' compile more.

Owns: when the scope is tried, the measurement and the line. May not touch: the search policy, the
layout trials and the static recompile (it only asks whether they run), Composer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from automicro.engine.compile import CompiledBlocks
from automicro.batch.trial_timing import BatchClock, judged, timed_arm

BATCHES = 3  # timed batches each side (the layout trials' default)
MIN_GAIN = 0.01


class ScopeChoice:
    """Asked before and after each batch the training search runs (`before_batch`, `after_batch`);
    states: waiting -> warming -> timing_blocks -> compiling -> timing_model -> model | blocks;
    `off` where it does not apply."""

    def __init__(
        self, compiled: Optional[CompiledBlocks], consensus: Any, info: Callable[[str], None], device: torch.device,
        why_not: Optional[str] = None, batches: int = BATCHES, min_gain: float = MIN_GAIN,
    ) -> None:
        self.compiled, self.consensus, self.info = compiled, consensus, info
        self.batches, self.min_gain = batches, min_gain
        applies = compiled is not None and compiled.config.measures_scope and compiled.has_other_scope
        self.state = "waiting" if applies and why_not is None else "off"
        if applies and why_not is not None:
            info(f"compile: each block stays compiled ({why_not}); the whole model is not timed against them")
        self.split: Optional[tuple[int, ...]] = None
        self.times: dict[str, list[float]] = {"blocks": [], "model": []}
        self.compile_s = 0.0  # the whole model's compile batch
        self.result: Optional[Any] = None
        self.clock = BatchClock(device)
        self._blocks_form: tuple[Optional[bool], bool] = (None, False)  # (dynamic, batch_dynamic) to go back to
        # Tests replace it to make one scope look faster or slower without depending on the machine.
        self.timing: Callable[[str, float], float] = lambda arm, seconds: seconds

    @property
    def running(self) -> bool:
        """The scope is being timed (its batches must not be another trial's)."""
        return self.state in ("warming", "timing_blocks", "compiling", "timing_model")

    @property
    def _arm(self) -> Optional[str]:
        return timed_arm(self.state)

    def before_batch(self, ready: bool, trial_running: bool, split: tuple[int, ...]) -> None:
        """`ready`: the search has settled and the blocks' graphs with it (the static recompile is
        done); `trial_running`: a layout trial runs or starts with this batch; `split`: this batch's."""
        if self.state == "waiting" and ready and not trial_running:
            self.state, self.split = "warming", split  # one batch untimed: graphs compiled last batch settle
        elif self.state in ("warming", "timing_blocks") and (not ready or trial_running or split != self.split):
            self.state, self.times["blocks"] = "waiting", []  # the size moved: start again once settled
        if self._arm is not None or self.state == "compiling":
            self.clock.start()

    def after_batch(self, attempts: int, split: tuple[int, ...]) -> None:
        """The batch succeeded after `attempts` attempts at `split`."""
        if self.state == "warming":
            self.state = "timing_blocks"
            return
        if self.state not in ("timing_blocks", "compiling", "timing_model"):
            return
        seconds = self.clock.stop()
        if self.state == "compiling":
            self.compile_s, self.state = seconds, "timing_model"
            if attempts != 1 or split != self.split:
                self._back("undone: an OOM or a new split in the batch that compiled it")
            return
        arm = self._arm
        assert arm is not None and self.compiled is not None
        if attempts == 1 and split == self.split:
            self.times[arm].append(self.timing(arm, seconds))
        elif arm == "model":  # an OOM or another split under the whole model: back to the blocks
            self._back("undone: an OOM or a new split while it was timed")
            return
        if len(self.times[arm]) < self.batches:
            return
        if arm == "blocks":
            self._blocks_form = (self.compiled.dynamic, self.compiled.batch_dynamic)
            self.compiled.compile_model()
            self.state = "compiling"
            self.info(f"compile: the whole model timed against each block compiled, {self.batches} batches each "
                      f"at microbatch {max(self.split or (0,))} (the first with the whole model compiles it)")
            return
        self.result, medians = judged(self.consensus, "model", self.times["model"], self.times["blocks"], self.min_gain,
                                      "the whole model", "each block")
        medians += f"; its compile batch {self.compile_s:.1f} s"
        if self.result.kept:
            self.state = "model"
            self.info(f"compile: the whole model: kept; {medians}")
        else:
            self._back(f"not kept, {medians}")

    def _back(self, why: str) -> None:
        assert self.compiled is not None
        dynamic, batch_dynamic = self._blocks_form
        self.compiled.recompile(dynamic, batch_dynamic=batch_dynamic)
        self.state = "blocks"
        form = "dynamic in the batch" if batch_dynamic else "dynamic" if dynamic else "static in the batch"
        self.info(f"compile: the whole model: {why}; each block compiled again ({form})")


__all__ = ["ScopeChoice"]
