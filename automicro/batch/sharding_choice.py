"""One rank: FSDP2 or the model unsharded, measured (``parallelism_config.fsdp2.on_one_rank``).

On one rank FSDP2 shards nothing, and what it costs depends on the model, the compile and the
microbatch: with each block compiled, transformers' Llama ran 1.13x faster under FSDP2 than with the
whole model compiled unsharded (one H200, `benchmarks/RESULTS.md` 2026-11-28, one GPU against Composer), while Qwen2.5-0.5B under a torch cap of 0.3, at
8 microbatches of 4, ran 1.9x faster unsharded (95.0k tokens/s against 50.3k: FSDP2's per-parameter
casts and copies at every unshard and its hooks each microbatch left the GPU idle 57% of a batch;
2026-11-29, the capped row profiled). So where the job has one rank, `auto` times both on the user's model at the settled size.

How: the trainer builds the model's unsharded twin beside its FSDP2 form (`automicro.engine.twin`: the
same parameter storage, no copy). Once the size is steady and the compiled blocks' graphs have settled
(`compile_shapes`), after `IDLE_BATCHES` batch(es) more, and before the compile scope and the layout trials
(they wait for this choice: the gap it closes can be 1.9x where theirs are a few percent, and every
batch they spend first runs at FSDP2's speed), `ShardingChoice` lets the twin run one batch untimed (it
compiles the whole model where compile is on), then alternates `batches` batches through the twin and
as many through FSDP2 (each block compiled, its own layout), at the same split, each batch's seconds
weighed against the average batch (a token budget's batches vary), the device synchronized at both
ends (a size that moves mid-trial starts it again; after `MAX_RESTARTS` FSDP2 is kept untimed). The twin
is kept where its median beats FSDP2's by more than `min_gain` and the spread
(`automicro.core.layout.judge`); one line says what was kept with both medians and what the twin's first
batch took. Kept, every later batch runs through the twin, and the compile scope and the layout trials
(FSDP2's trades, and the size trials bound to them) do not run. Not kept, they run as before. Nothing
else moves: the optimizer, its state, checkpoints and evaluation stay on the FSDP2 model, whose
parameters the twin's are.

Under memory pressure (an OOM in a batch through the twin, trial or kept) the batch reruns through
FSDP2 and FSDP2 stays for the rest of the run, said once, before the layout trades or the size give
way; thrashing through the twin (allocator retries) ends it the same way from the next batch. So does
an error other than an OOM through the twin (its whole-model compile can fail where each block's did
not): the batch reruns through FSDP2, the error and its traceback go to the log, and an error of the
model's own, met again through FSDP2, ends the run as any error does. Not
measured (FSDP2 stays, one line says why): several ranks; a pipeline; ``cpu_offload`` or
``activation_checkpointing`` (FSDP2-only); a model the twin cannot copy; a ``mixed_precision`` whose
compute autocast does not give (the twin computes under Composer's precision), routed experts held as 3-d weights
among them (`automicro.batch.routing.grouped_experts`: autocast does not cast them); on CPU unless
``on_one_rank: auto`` (as the layout trials: a CPU's time says nothing of a GPU's). The choice is in
the checkpoint (`state_dict`): a resumed run keeps it without timing again (the twin compiles in its
first batch); one stopped mid-trial times again. The size found under FSDP2 is the size the twin runs
at (not searched again unsharded).

Owns: when the twin is timed, the decision, its line, and whether the next batch runs through the twin.
May not touch: the search policy, the layout trials and the compile scope (it only asks whether they
run), the twin's binding (the engine's), Composer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from automicro.batch.trial_timing import BatchClock, enough, judged
from automicro.engine.twin import UnshardedTwin

BATCHES = 3  # timed batches each way at most (the layout trials' default; 2 where the spread is tiny)
MIN_GAIN = 0.01
IDLE_BATCHES = 0  # batches at the settled size and graphs, once given the turn, before the twin is timed
# Trials begun again because the size moved, before FSDP2 is kept untimed (a size that keeps moving would
# otherwise hold the layout and scope trials off for good).
MAX_RESTARTS = 3


class ShardingChoice:
    """States: off | waiting -> compiling (the twin's first batch) -> trial (alternating) -> unsharded | sharded.
    A trial of `automicro.batch.trial_plan` ("one_rank"): the plan gives it the turn (`before_batch`'s `ready`)
    or decides it without running it (`rule_out`)."""

    name = "one_rank"
    profiled = True

    def __init__(
        self, twin: Optional[UnshardedTwin], consensus: Any, info: Callable[[str], None], device: torch.device,
        why_not: Optional[str] = None, batches: int = BATCHES, min_gain: float = MIN_GAIN,
        release: Callable[[], None] = lambda: None,
    ) -> None:
        """`release()`: drop every other reference to the twin once FSDP2 is kept for good (its parameters
        would otherwise hold storage FSDP2 may replace)."""
        self.twin, self.consensus, self.info, self.release = twin, consensus, info, release
        self.batches, self.min_gain = batches, min_gain
        self.state = "waiting" if twin is not None and why_not is None else "off"
        if twin is not None and why_not is not None:
            info(f"one rank: FSDP2 kept ({why_not}); the model unsharded is not timed against it")
            self.twin = None
            release()
        self.idle = 0
        self.split: Optional[tuple[int, ...]] = None
        self.arm = "unsharded"  # the arm of the batch in progress
        self.times: dict[str, list[float]] = {"unsharded": [], "sharded": []}
        self.first_s = 0.0
        self.restarts = 0  # trials begun again because the size moved
        self.paused = False  # this batch of a trial is not timed: not ready (the hooks back on after an eval, a rearm)
        self.result: Any = None
        self.decided_times: dict[str, list[float]] = {}  # each arm's agreed times once decided (the scope trial reuses the kept one's)
        self.clock = BatchClock(device)
        # Tests replace it to make one arm look faster or slower without depending on the machine.
        self.timing: Callable[[str, float], float] = lambda arm, seconds: seconds

    # ---- the plan's questions (`automicro.batch.trial_plan.PlannedTrial`) ---------------------------------

    @property
    def pending(self) -> bool:
        return self.state == "waiting"

    @property
    def running(self) -> bool:
        return self.timing_now

    @property
    def label(self) -> Optional[str]:
        return self.name if self.running else None

    def candidates(self) -> list[tuple[str, str, dict[str, float]]]:
        # The twin's first batch compiles where compile is on and not done yet: its blocks (one graph), or the whole
        # model unsharded as one graph (every block inlined: a graph's compile per block).
        twin = self.twin
        compiles = twin is not None and twin.compile_kwargs is not None and not twin.compiled
        graphs = 1.0 if twin is None or twin.scope == "blocks" else float(max(1, len(getattr(twin, "blocks", ()) or ())))
        return [(self.name, "one_rank", {"compiles": float(compiles), "graphs": graphs})]

    def rule_out(self, why: str) -> None:
        self._keep_fsdp2()
        self.info(f"one rank: FSDP2 kept, the model unsharded not timed: {why}")

    def outcome(self) -> str:
        return {"unsharded": "the model unsharded kept", "sharded": "FSDP2 kept"}.get(self.state, self.state)

    @property
    def won_s(self) -> float:
        """What the model unsharded won a batch against FSDP2, as timed, while it is kept (0 otherwise)."""
        return self.result.won_s if self.result is not None and self.state == "unsharded" else 0.0

    def projection(self) -> str:
        if self.state == "waiting":
            return f"the twin's first batch (each block compiled where compile is on), then up to {2 * self.batches} timed batches"
        done = sum(len(t) for t in self.times.values())
        return f"{2 * self.batches - done} timed batch(es) at most"

    @property
    def blocks_layout(self) -> bool:
        """The model runs unsharded for good: FSDP2's layout trades change nothing (they do not run)."""
        return self.state == "unsharded"

    @property
    def timing_now(self) -> bool:
        """The twin is being timed against FSDP2 (no other trial may start: the times would mix)."""
        return self.state in ("compiling", "trial")

    @property
    def through_twin(self) -> bool:
        """The next attempt runs through the twin."""
        return self.state in ("compiling", "unsharded") or (self.state == "trial" and self.arm == "unsharded" and not self.paused)

    def before_batch(self, ready: bool, split: tuple[int, ...], where: str = "") -> Optional[UnshardedTwin]:
        """`ready`: steady, the compiled graphs and the scope settled, no layout trial running or
        starting with this batch; `split`: the settled split (a token budget's: its budget); `where`: how
        the console names it. Returns the twin where the batch runs through it."""
        if self.state == "waiting":
            self.idle = self.idle + 1 if ready and split == self.split else (1 if ready else 0)
            self.split = split
            if self.idle > IDLE_BATCHES:
                assert self.twin is not None
                compiles = self.twin.compile()
                self.state, self.arm = "compiling", "unsharded"
                again = " again (the size moved)" if self.restarts else ""
                self.info(
                    f"one rank: the model unsharded timed against FSDP2{again}, up to {self.batches} batches each (2 where their "
                    f"spread is tiny), alternately, at "
                    f"{where or f'microbatch {max(split)}'} (its first batch untimed{': it compiles ' + self._compiles() if compiles else ''})"
                )
        self.paused = self.state == "trial" and not ready and split == self.split
        if self.paused:
            return None  # FSDP2 runs it untimed; the trial goes on once ready again, its times kept
        if self.state == "trial" and split != self.split:
            self.state, self.idle = "waiting", 0  # the size moved: time again once it settles
            self.restarts += 1
            if self.restarts > MAX_RESTARTS:
                self._keep_fsdp2()
                self.info(f"one rank: FSDP2 kept, not timed against the model unsharded (the size moved during "
                          f"{self.restarts} of its trials)")
            self.times = {"unsharded": [], "sharded": []}
        if self.state in ("compiling", "trial"):
            self.clock.start()
        return self.twin if self.through_twin else None

    def after_batch(self, attempts: int, split: tuple[int, ...], weight: float = 1.0) -> None:
        """The batch succeeded after `attempts` attempts, the settled split then `split`; `weight`: its
        work against the average batch (1.0 with samples)."""
        if self.state not in ("compiling", "trial") or self.paused:
            return
        seconds = self.clock.stop()
        if self.state == "compiling":
            self.first_s, self.state, self.arm = seconds, "trial", "sharded"
            return
        if attempts == 1 and split == self.split:  # agreed: every rank appends alike
            self.times[self.arm].append(self.timing(self.arm, seconds / (weight or 1.0)))
        self.arm = "sharded" if self.arm == "unsharded" else "unsharded"
        # Both arms have as many times after an unsharded batch (the trial times FSDP2 first).
        if self.arm == "sharded" and enough(self.consensus, list(self.times.values()), self.batches, self.min_gain):
            self._decide()

    def relieve(self, why: str = "out of memory", rerun: bool = True) -> bool:
        """Memory pressure in a batch through the twin (an OOM; thrashing, `rerun` False): FSDP2 from
        now on, the batch rerun through it where it failed. Thrashing in any batch of the trial, FSDP2's arm
        too, is the trial's: the twin's batches (its compile first) leave the allocator's pool fragmented for the
        FSDP2 batch after them (measured on one H100, a routed model: retries in the twin's first batch and the FSDP2
        batch after it). True where that was done."""
        in_trial = not rerun and self.timing_now
        if not self.through_twin and not in_trial:
            return False
        was, arm = self.state, self.arm
        self._keep_fsdp2()
        self.clock.stop()
        then = "the batch is rerun through FSDP2, and FSDP2 stays" if rerun else "FSDP2 from the next batch on"
        if was == "trial" and arm == "sharded":
            where = "in the trial of the model unsharded (FSDP2's batch, after the twin's)"
        else:
            where = f"through the model unsharded ({'kept' if was == 'unsharded' else 'during its trial'})"
        self.info(f"one rank: {why} {where}; {then} for the rest of the run")
        return True

    def _compiles(self) -> str:
        assert self.twin is not None
        return "each block" if self.twin.scope == "blocks" else "the whole model"

    def _keep_fsdp2(self) -> None:
        self.state, self.twin = "sharded", None
        self.release()

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state if self.state in ("unsharded", "sharded") else None}

    def load_state_dict(self, saved: Optional[dict[str, Any]]) -> None:
        """A decided choice from a checkpoint (before the first batch): kept as it was, not timed again.
        Nothing where this run has no twin (another world size, a pin) or the checkpoint had no decision."""
        decided = (saved or {}).get("state")
        if self.state != "waiting" or decided not in ("unsharded", "sharded"):
            return
        assert self.twin is not None
        if decided == "sharded":
            self._keep_fsdp2()
        self.state = decided
        if decided == "unsharded":
            compiles = self.twin.compile()
            self.info(f"one rank: the model unsharded, as kept before the checkpoint (not timed again"
                      f"{'; its first batch compiles ' + self._compiles() if compiles else ''})")
        else:
            self.info("one rank: FSDP2, as kept before the checkpoint (not timed again)")

    def _decide(self) -> None:
        self.result, medians, (on, off) = judged(self.consensus, "unsharded", self.times["unsharded"], self.times["sharded"],
                                                 self.min_gain, "unsharded", "FSDP2")
        self.decided_times = {"unsharded": on, "sharded": off}
        medians += f"; its first batch {self.first_s:.1f} s"
        if self.result.kept:
            self.state = "unsharded"
        else:
            self._keep_fsdp2()
        self.info(f"one rank: {'the model unsharded kept' if self.result.kept else 'FSDP2 kept'}; {medians}")


__all__ = ["BATCHES", "IDLE_BATCHES", "MAX_RESTARTS", "MIN_GAIN", "ShardingChoice"]
