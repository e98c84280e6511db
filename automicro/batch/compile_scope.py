"""The compile scope, measured: the whole model compiled against each block compiled.

Which scope is faster depends on the model, and the difference is not small (one H200, FSDP2 on one
rank, seq 2048, per-rank batch 32, fixed microbatch 16, `benchmarks/RESULTS.md`, 2026-11-29: Qwen2.5-0.5B's
shape 106.5k tokens/s with each block compiled, 98.0k with the whole model; `automicro.models`' Llama 1B,
2026-11-28: the whole model 1.8% faster). With compile's ``scope`` unset (the default) the blocks are
compiled, and once the size has settled `ScopeChoice` may time the whole model against them, when the trial
plan (`automicro.batch.trial_plan`) gives it the turn: after the model unsharded is timed against FSDP2 on one
rank, for whichever of the two runs on (FSDP2's blocks, or the unsharded twin's), and only where a batch's
profile says the whole model can win beyond the rule for keeping it (host idle and the eager work a compile
could fuse, `automicro.batch.batch_profile`; otherwise one line names the bound and nothing is compiled).

How: where the one-rank trial just timed the blocks of the configuration that won, at this split, and
nothing changed since, its agreed times are the "each block" arm (a compile made for one trial serves the
next); otherwise one batch passes and the blocks are timed. Then the whole model's ``forward`` is compiled
(every block eager again; the blocks' graphs stay cached), one batch compiles it, as many batches are timed,
and the whole model is kept only where it is faster beyond `min_gain` and the spread; otherwise the blocks'
compiled forwards come back as they were (no compile). The batch times are the slowest rank's (one consensus
round). An OOM or a new split while the whole model is timed undoes it (its graphs may hold more memory than
the blocks'). One line says what was kept, with both medians and what the whole model's compile batch took.
Nothing changes the numbers: the same modules, parameters and optimizer state; only which ``forward`` dynamo
compiles.

Not tried: a ``scope`` the user set (``blocks`` or ``model``), a token budget (every microbatch has its
own shape), a model whose only FSDP2 unit is its root (one scope), no FSDP2 (``model`` from the start).

Owns: when the scope is tried (once given the turn), the measurement and the line. May not touch: the
search policy, the other trials (the plan orders them), Composer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

from automicro.batch.trial_timing import BatchClock, enough, judged, timed_arm
from automicro.engine.compile import CompiledBlocks

BATCHES = 3  # timed batches each side at most (the layout trials' default; 2 where the spread is tiny)
MIN_GAIN = 0.01


class ScopeTarget(Protocol):
    """What compiles either scope: FSDP2's `CompiledBlocks`, or the unsharded twin (`UnshardedTwin`)."""

    def compile_model(self) -> None: ...

    def back_to_blocks(self) -> None: ...


class ScopeChoice:
    """Asked before and after each batch the training search runs (`before_batch`, `after_batch`);
    states: waiting -> [warming -> timing_blocks ->] compiling -> timing_model -> model | blocks;
    `off` where it does not apply. A trial of the plan ("scope")."""

    name = "scope"
    profiled = True
    waits_for = ("one_rank",)

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
        # Which scope target runs now, and its name ("FSDP2" or "unsharded"); the trainer sets it where the twin
        # may win (`automicro.batch.training_search`): FSDP2's compiled blocks otherwise.
        self.target: Callable[[], tuple[str, Optional[ScopeTarget]]] = lambda: ("FSDP2", self.compiled)
        # The agreed "each block" times another trial just took at this split with nothing changed since, or None.
        self.reusable: Callable[[tuple[int, ...]], Optional[list[float]]] = lambda split: None
        self.reused = False
        self._on: tuple[str, Optional[ScopeTarget]] = ("FSDP2", None)  # the target being timed
        # Graph breaks dynamo has traced in the process so far (`automicro.engine.compile.graph_breaks`, summed; the
        # training search sets it): those the whole model's compile batch traced are said in its line.
        self.breaks: Callable[[], int] = lambda: 0
        self._breaks_at = 0
        self.model_breaks = 0  # traced by the whole model's compile batch
        # Tests replace it to make one scope look faster or slower without depending on the machine.
        self.timing: Callable[[str, float], float] = lambda arm, seconds: seconds

    # ---- the plan's questions ---------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return self.state == "waiting"

    @property
    def running(self) -> bool:
        """The scope is being timed (its batches must not be another trial's)."""
        return self.state in ("warming", "timing_blocks", "compiling", "timing_model")

    @property
    def label(self) -> Optional[str]:
        return self.name if self.running else None

    def candidates(self) -> list[tuple[str, str, dict[str, float]]]:
        """The whole model compiled, for whichever runs on: FSDP2's blocks, or the unsharded twin (every block inlined
        into one graph: its compile grows with the blocks, `trial_price`)."""
        name, _ = self.target()
        return [(self.name, "scope", {"unsharded": float(name == "unsharded")})]

    def rule_out(self, why: str) -> None:
        self.state = "blocks"
        self.info(f"compile: each block stays compiled, the whole model not timed: {why}")

    def blocks_only(self, why: str) -> None:
        """Each block compiled from now on, the whole model never again this run (`why`): back to the blocks where the
        whole model runs or is being timed, the trial ruled out where it waits (`automicro.batch.floor_ladder`)."""
        if self.state in ("compiling", "timing_model", "model"):
            self.clock.stop()
            self._back(f"undone: {why}")
        elif self.state not in ("off", "blocks"):
            self.clock.stop()
            self.rule_out(why)

    def outcome(self) -> str:
        return {"model": "the whole model kept", "blocks": "each block kept"}.get(self.state, self.state)

    @property
    def won_s(self) -> float:
        """What the whole model compiled won a batch against each block compiled, as timed, while it is kept."""
        return self.result.won_s if self.result is not None and self.state == "model" else 0.0

    def projection(self) -> str:
        return f"a whole-model compile and up to {2 * self.batches} timed batches"

    @property
    def _arm(self) -> Optional[str]:
        return timed_arm(self.state)

    # ---- one batch ---------------------------------------------------------------------------------

    def before_batch(self, ready: bool, split: tuple[int, ...]) -> None:
        """`ready`: the plan gives this trial the batch (the size settled, no other trial running); `split`: this
        batch's."""
        if self.state == "waiting" and ready:
            self._on, self.split = self.target(), split
            reused = self.reusable(split)
            if reused:
                self.times["blocks"], self.reused = list(reused), True
                self._compile_model()
            else:
                self.state = "warming"  # one batch untimed: graphs compiled last batch settle
        elif self.state in ("warming", "timing_blocks") and (not ready or split != self.split):
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
            self.model_breaks = max(0, self.breaks() - self._breaks_at)
            if attempts != 1 or split != self.split:
                self._back("undone: an OOM or a new split in the batch that compiled it")
            return
        arm = self._arm
        assert arm is not None
        if attempts == 1 and split == self.split:
            self.times[arm].append(self.timing(arm, seconds))
        elif arm == "model":  # an OOM or another split under the whole model: back to the blocks
            self._back("undone: an OOM or a new split while it was timed")
            return
        if arm == "blocks":
            if enough(self.consensus, [self.times["blocks"]], self.batches, self.min_gain):
                self._compile_model()
            return
        if not enough(self.consensus, [self.times["model"]], self.batches, self.min_gain):
            return
        self.result, medians, _ = judged(self.consensus, "model", self.times["model"], self.times["blocks"], self.min_gain,
                                         "the whole model", "each block")
        medians += f"; its compile batch {self.compile_s:.1f} s" + (
            f" (dynamo broke its graph {self.model_breaks} time{'s' if self.model_breaks != 1 else ''})" if self.model_breaks else "")
        if self.result.kept:
            self.state = "model"
            self.info(f"compile: the whole model{self._whose()}: kept; {medians}")
        else:
            self._back(f"not kept, {medians}")

    def _whose(self) -> str:
        return " (unsharded)" if self._on[0] == "unsharded" else ""

    def _compile_model(self) -> None:
        name, target = self._on
        assert target is not None
        target.compile_model()
        self.state, self._breaks_at = "compiling", self.breaks()
        source = f"the one-rank trial's {len(self.times['blocks'])} batches" if self.reused else f"{len(self.times['blocks'])} batches"
        self.info(f"compile: the whole model{self._whose()} timed against each block compiled ({source}) at microbatch "
                  f"{max(self.split or (0,))}; the first batch with the whole model compiles it")

    def _back(self, why: str) -> None:
        _, target = self._on
        assert target is not None
        target.back_to_blocks()
        self.state = "blocks"
        self.info(f"compile: the whole model{self._whose()}: {why}; each block compiled as before (its graphs kept)")


__all__ = ["ScopeChoice"]
