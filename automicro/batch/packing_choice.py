"""Packed rows or padded batches under a token budget: measured, not ruled.

With ``budget: tokens`` and ``packing`` left out, which is faster depends on the model's attention:
packed rows carry no padding, but a model that masks a dense square of each row (transformers'
sdpa and eager) pays each row's tokens squared (benchmarks/RESULTS.md: packed 2.14x the padded budget with flex
attention, 0.92x with sdpa). So where the model keeps packed samples apart and its attention skips
the other samples' tokens (`packed_input.measurable`: a model that says it takes packed rows, flash
or flex attention), `PackingChoice` measures it: once the token budget has settled (the sync hooks
are off) and no layout trial runs, the next `batches` batches alternate packed and padded at the
same budget (a packed microbatch's real tokens under it, a padded one's padded tokens: the memory
of a packed microbatch is no larger), each batch's seconds weighed against the average batch
(variable lengths), the slowest rank's. Packing is kept when its median beats padding's by more
than `min_gain` and the spread; one line says what was chosen, with both medians and the real
tokens per second of each. Nothing changes the numbers beyond rounding: the loss is normalised per
loss token over the whole batch either way, and a packed sample's first label, which a shifting
model would predict from the sample before, is never a loss in a padded row either.

Under memory pressure (an OOM at the settled budget) a packed batch is rerun padded and packing
is off for the rest of the run, said once, before the layout trades or the budget give way. Not
measured: on CPU unless ``packing: auto`` (as the layout trials: a CPU's time says nothing of a
GPU's); with the loss normalised per sample; where the model cannot keep packed samples apart or
masks a dense square (one line says why: padded). ``packing: true | false`` pins it. The choice
is not checkpointed: a resumed run measures again once its budget settles.

Owns: the trial, its line, and whether the next batch packs (`TokenBudget.packing`). May not
touch: the search policy, the layout trials (it only asks whether one runs), the batch itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from automicro.core.layout import judge
from typing import Optional

from automicro.batch.trial_timing import BatchClock, agreed_times, enough
from automicro.batch.token_budget import TokenBudget

BATCHES = 3  # batches each way at most (the layout trials' default; 2 where the spread is tiny)
MIN_GAIN = 0.01


class PackingChoice:
    """States: waiting (for the budget to settle) -> trial (alternating) -> packed | padded. A trial of the plan
    (`automicro.batch.trial_plan`, "packing"), priced without a profile (from the padding's share): padding is
    device work."""

    name = "packing"
    profiled = False

    def __init__(
        self, tokens: TokenBudget, consensus: Any, info: Callable[[str], None], device: torch.device,
        batches: int = BATCHES, min_gain: float = MIN_GAIN,
    ) -> None:
        self.tokens, self.consensus, self.info = tokens, consensus, info
        self.batches, self.min_gain = batches, min_gain
        self.state = "waiting"
        self.arm = "packed"  # the arm of the batch in progress (trial)
        self.times: dict[str, list[float]] = {"packed": [], "padded": []}
        self.real: dict[str, list[int]] = {"packed": [], "padded": []}  # the busiest rank's real tokens per batch
        self.result: Any = None
        self.clock = BatchClock(device)
        # Tests replace it to make one arm look faster or slower without depending on the machine.
        self.timing: Callable[[str, float], float] = lambda arm, seconds: seconds

    @property
    def trialing(self) -> bool:
        return self.state == "trial"

    @property
    def pending(self) -> bool:
        return self.state == "waiting"

    @property
    def running(self) -> bool:
        return self.trialing

    @property
    def label(self) -> Optional[str]:
        return self.name if self.running else None

    def candidates(self) -> list[tuple[str, str, dict[str, float]]]:
        return [(self.name, "packing", {})]

    def rule_out(self, why: str) -> None:
        self.state = "padded"
        self.tokens.packing = False
        self.info(f"packing: padded batches kept, packed rows not timed: {why}")

    def outcome(self) -> str:
        return {"packed": "packed rows kept", "padded": "padded batches kept"}.get(self.state, self.state)

    @property
    def won_s(self) -> float:
        """What packed rows won a batch against padded ones, as timed, while they are kept (0 otherwise)."""
        return self.result.won_s if self.result is not None and self.state == "packed" else 0.0

    def projection(self) -> str:
        done = sum(len(t) for t in self.times.values())
        return f"up to {2 * self.batches - done} batch(es) alternating packed and padded"

    def before_batch(self, ready: bool, steady: bool) -> None:
        """Before the batch's domain is agreed (`TokenBudget.agree_domain` reads `packing`). `ready`: the plan
        gives this trial the batch; `steady`: the budget has settled."""
        if self.state == "waiting" and ready:
            self.state, self.arm = "trial", "packed"
            self.info(f"packing trial: up to {self.batches} batches packed, as many padded, alternately, at the settled budget "
                      f"(2 each where their spread is tiny)")
        elif self.state == "trial" and not steady:
            # The budget moved (an OOM while padded): the times would compare different budgets.
            self.state = "waiting"
            self.times = {"packed": [], "padded": []}
            self.real = {"packed": [], "padded": []}
        self.tokens.packing = self.state == "packed" or (self.state == "trial" and self.arm == "packed")
        if self.state == "trial":
            self.clock.start()

    def after_batch(self, attempts: int, weight: float, most_real: int) -> None:
        """The batch succeeded after `attempts` attempts; `weight`: its work against the average
        batch (`TokenBatches.batch_weight`); `most_real`: the most real tokens any rank held."""
        if self.state != "trial":
            return
        seconds = self.clock.stop()
        arm = self.arm
        if attempts == 1:  # agreed: every rank appends alike, so every rank decides at the same batch
            self.times[arm].append(self.timing(arm, seconds / (weight or 1.0)))
            self.real[arm].append(most_real)
        self.arm = "padded" if arm == "packed" else "packed"
        if self.arm == "packed" and enough(self.consensus, [self.times["packed"], self.times["padded"]], self.batches, self.min_gain):
            self._decide()

    def relieve(self) -> bool:
        """An OOM at the settled budget: where this batch packs, rerun it padded and pad from now on.
        True where that was done (the caller reruns at the same budget)."""
        # `packing` (the intent, the same on every rank), not whether this rank's batch could pack.
        if not self.tokens.packing or self.state not in ("trial", "packed"):
            return False
        was = self.state
        self.tokens.stop_packing()
        self.state = "padded"
        self.info(
            f"packing: out of memory with packed rows at the settled budget ({'during its trial' if was == 'trial' else 'kept'}); "
            "the batch is rerun padded, and batches are padded from now on"
        )
        return True

    def _decide(self) -> None:
        packed, padded = (agreed_times(self.consensus, self.times[arm]) for arm in ("packed", "padded"))
        self.result = judge("packing", packed, padded, self.min_gain)
        rate = {
            arm: statistics.mean(self.real[arm]) / statistics.median(times) if times and self.real[arm] else 0.0
            for arm, times in (("packed", packed), ("padded", padded))
        }
        medians = (
            f"median {statistics.median(packed):.4f} s per average batch packed, {statistics.median(padded):.4f} s padded "
            f"({100.0 * (1.0 - statistics.median(packed) / statistics.median(padded)):+.1f}%; spread {self.result.spread:.4f} s); "
            f"real tokens/s of the busiest rank: {rate['packed']:,.0f} packed, {rate['padded']:,.0f} padded"
        )
        self.state = "packed" if self.result.kept else "padded"
        self.tokens.packing = self.result.kept
        self.info(f"packing: {'packed rows kept' if self.result.kept else 'padded batches kept'}; {medians}")


__all__ = ["PackingChoice"]
