"""The search policy's promises, checked for every state hypothesis can reach (stateful tests).

The machine below drives the pure policy against a simulated device: a microbatch of size m fits
iff m <= `threshold`; the threshold can change for good (fragmentation, a longer context); a
one-off OOM can strike any attempt (a long sequence, memory left by an eval or a checkpoint).
Configs cover both search modes, with and without the memory prediction, 1..5 stable batches,
every size from 1 to the batch, and the pipeline's restricted sizes (equal microbatches, at least
two of them). Promises checked after every step:

- a one-off OOM (one not following another OOM) at a size that ran clean never ends the run,
  reruns that very split with the hooks on, and after a clean rerun the size is not below it;
- the run ends (`CannotFitError`) only at the smallest size, and only for an OOM there that
  repeats one or hits a size that never ran clean;
- no split has a part of size 0, a size above the batch, or a sum other than the batch; with
  restricted sizes every split is equal parts of an allowed size;
- a settled split never reaches a size known to fail;
- with the prediction on, a size that fit only before the first optimizer step (whose state it
  does not yet hold; the success reports the projected peak) is never accepted, and costs no OOM;
- the hooks are on in every phase but STEADY;
- from any state, a device that stops surprising it converges within a bounded number of
  attempts (bisect: on the largest size that fits), and the hooks come off after exactly
  `stable_batches` clean batches.

Every counterexample hypothesis found while this was written is a plain test in test_policy.py.
"""

from __future__ import annotations

import math
from typing import Optional

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from automicro.core.policy import (
    OOM,
    BatchSizeChanged,
    CannotFitError,
    Phase,
    PolicyConfig,
    Rearm,
    SearchPolicy,
    Success,
    Thrash,
)

MAX_BATCH = 48


def pipeline_sizes(batch_size: int) -> tuple[int, ...]:
    """What a 2-stage pipeline can run: equal microbatches, at least two of them."""
    return tuple(m for m in range(1, batch_size + 1) if batch_size % m == 0 and batch_size // m >= 2)


def _even_batch(draw_value: int, pipeline: bool) -> int:
    # A pipeline needs at least two microbatches: its batch has at least 2 samples.
    return max(2, draw_value) if pipeline else draw_value


class PolicyAgainstDevice(RuleBasedStateMachine):
    policy: SearchPolicy
    ended: bool

    @initialize(
        batch=st.integers(1, MAX_BATCH),
        threshold=st.integers(1, MAX_BATCH),
        search=st.sampled_from(["bisect", "halve"]),
        stable=st.integers(1, 5),
        prediction=st.booleans(),
        pipeline=st.booleans(),
        start=st.none() | st.integers(1, MAX_BATCH),
        pre_step_extra=st.integers(0, MAX_BATCH),
    )
    def start(self, batch, threshold, search, stable, prediction, pipeline, start, pre_step_extra):
        self.config = PolicyConfig(
            search=search, stable_batches=stable, use_prediction=prediction, start_size=start,
            sizes_for=pipeline_sizes if pipeline else None,
        )
        self.pipeline = pipeline
        self.threshold = threshold
        self.policy = SearchPolicy(self.config, _even_batch(batch, pipeline))
        self.ended = False
        self.clean: set[int] = set()  # sizes that ran clean at this batch size
        self.last_oom: Optional[int] = None  # the size of the previous outcome, if it was an OOM
        self.rerun_of: Optional[int] = None  # a one-off OOM at a clean size waits for its rerun
        self.surprised = False  # a thrash or a threshold change: the bisect's result is not exact
        self.other_rank_ran_out = False  # another rank's one-off already met the pending rerun
        # Before the first optimizer step the device fits `pre_step_extra` samples more (the state
        # that step creates does not exist yet); successes then report the projected peak.
        self.pre_step_extra = pre_step_extra
        self.stepped = False

    # ---- helpers -----------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return max(self.policy.current_split())

    @property
    def floor(self) -> int:
        b = self.policy.batch_size
        return pipeline_sizes(b)[0] if self.pipeline else 1

    def _peak(self, m: int) -> tuple[int, int]:
        # A linear device consistent with the threshold (feeds the prediction when it is on).
        fixed, per = 1000, 100
        return fixed + per * m, fixed + per * self.threshold + per // 2

    def _oom(self, m: int, one_off: bool, ranks: tuple[int, ...] = ()) -> None:
        state_before = self.policy.state
        repeat = self.last_oom == m
        try:
            decision = self.policy.observe(OOM(m, ranks=ranks))
        except CannotFitError:
            assert m == self.floor, f"the run ended at {m}, above the smallest size {self.floor}"
            assert repeat or m not in self.clean, "a one-off OOM at a size that ran clean ended the run"
            assert self.policy.state == state_before, "a failed transition leaves the state alone"
            self.ended = True
            return
        if one_off and m in self.clean:
            assert (decision.rerun, decision.hooks, decision.next_size) == (True, True, m), decision
            assert max(decision.split) == m
            self.rerun_of, self.other_rank_ran_out = m, False
        else:
            # A size that never ran clean cannot tell a one-off from its limit: it counts as failed.
            self.surprised = self.surprised or one_off
            self.rerun_of = None
        self.last_oom = m

    def _success(self, m: int) -> None:
        projected = not self.stepped
        decision = self.policy.observe(Success(m, *self._peak(m), projected=projected))
        self.stepped = True  # every clean batch ends in an optimizer step
        if projected and m > self.threshold and m > self.floor:
            if self.config.use_prediction:
                # Fits only before the state exists: never accepted, no OOM spent on it.
                assert m not in self.policy.state.successes and not decision.rerun, self.policy.state
                assert self.policy.phase == Phase.SEARCHING or self.size < m, self.policy.state
                self.rerun_of, self.last_oom = None, None
                return
            self.surprised = True  # accepted, as before the projection: it runs out at batch 1
        self.clean.add(m)
        if self.rerun_of is not None:
            assert decision.next_size >= self.rerun_of, (
                f"a one-off OOM at {self.rerun_of} left the size at {decision.next_size}"
            )
        self.rerun_of = None
        self.last_oom = None

    # ---- rules -------------------------------------------------------------------------------

    @precondition(lambda self: not self.ended)
    @rule()
    def batch_on_the_device(self):
        m = self.size
        if m <= self.threshold + (0 if self.stepped else self.pre_step_extra):
            self._success(m)
        else:
            self._oom(m, one_off=False)

    @precondition(lambda self: not self.ended and self.last_oom is None)
    @rule()
    def one_off_oom(self):
        self._oom(self.size, one_off=True, ranks=(0,))

    @precondition(lambda self: not self.ended and self.rerun_of is not None and not self.other_rank_ran_out)
    @rule()
    def another_ranks_one_off(self):
        """With the hooks off, a rank stopped by another's OOM meets its own one-off in the rerun
        (once: rank 1 running out again would be a repeat)."""
        m = self.size
        assert m == self.rerun_of
        decision = self.policy.observe(OOM(m, ranks=(1,)))
        assert (decision.rerun, decision.next_size) == (True, m), "another rank's one-off is not a repeat"
        self.last_oom, self.other_rank_ran_out = m, True

    @precondition(lambda self: not self.ended and self.size <= self.threshold)
    @rule()
    def thrash(self):
        m = self.size
        self.policy.observe(Thrash(m))  # never raises, even at the floor
        self.surprised = True
        self.rerun_of, self.last_oom = None, None

    @precondition(lambda self: self.ended)
    @rule()
    def relaunch(self):
        """The run ended: the user relaunches it (a fresh policy, as without a checkpoint)."""
        self.policy = SearchPolicy(self.config, self.policy.batch_size)
        self.ended, self.clean, self.rerun_of, self.last_oom = False, set(), None, None
        self.stepped = False  # a fresh optimizer too

    @precondition(lambda self: not self.ended)
    @rule()
    def rearm(self):
        phase = self.policy.phase
        decision = self.policy.observe(Rearm("eval"))
        assert decision.hooks and not decision.rerun
        assert decision.phase == (Phase.SETTLING if phase == Phase.STEADY else phase)

    @precondition(lambda self: not self.ended)
    @rule(new_threshold=st.integers(1, MAX_BATCH))
    def memory_changes_for_good(self, new_threshold):
        self.threshold = new_threshold
        self.surprised = True

    @precondition(lambda self: not self.ended)
    @rule(new_batch=st.integers(1, MAX_BATCH))
    def batch_size_changes(self, new_batch):
        self.policy.observe(BatchSizeChanged(_even_batch(new_batch, self.pipeline)))
        self.clean = set()  # a size's record is per batch size in this model (conservative)
        self.rerun_of, self.last_oom = None, None
        self.surprised = True

    @precondition(lambda self: not self.ended and self.threshold >= self.floor)
    @rule()
    def device_stops_surprising(self):
        """From here on the device only answers the threshold: the search must converge and go steady."""
        b = self.policy.batch_size
        bound = 2 * (len(self.policy.state.successes) + math.ceil(math.log2(b)) + 4)
        attempts = clean_batches = 0
        while self.policy.phase != Phase.STEADY:
            if self.policy.phase == Phase.SEARCHING or self.size > self.threshold:
                # Searching, or settled on a size that no longer fits (its repeat searches on).
                attempts += 1
                assert attempts <= bound, f"no convergence in {bound} attempts: {self.policy.state}"
                self.batch_on_the_device()
                assert not self.ended
                clean_batches = 0
                continue
            self.batch_on_the_device()
            clean_batches += 1
            assert clean_batches <= self.config.stable_batches, "the hooks must come off after stable_batches"
        settled_at = self.policy.found_size
        assert not self.policy.hooks
        if self.config.search == "bisect" and not self.surprised:
            allowed = pipeline_sizes(b) if self.pipeline else range(1, b + 1)
            assert settled_at == max(s for s in allowed if s <= self.threshold), (settled_at, self.threshold)

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def split_is_sane(self):
        if self.ended:
            return
        b = self.policy.batch_size
        split = self.policy.current_split()
        assert sum(split) == b and all(1 <= part <= b for part in split), split
        if self.pipeline:
            assert len(set(split)) == 1 and split[0] in pipeline_sizes(b), split

    @invariant()
    def hooks_on_unless_steady(self):
        if not self.ended:
            assert self.policy.hooks == (self.policy.phase != Phase.STEADY)

    @invariant()
    def a_size_that_fit_only_before_the_first_step_is_never_settled_on(self):
        state = self.policy.state
        if self.ended or state.found is None or not self.config.use_prediction or self.surprised:
            return
        assert self.size <= max(self.threshold, self.floor), (self.size, self.threshold, state)

    @invariant()
    def settled_split_below_known_failure(self):
        state = self.policy.state
        if self.ended or state.found is None:
            return
        assert self.size <= state.found
        if state.first_failure is not None:
            assert self.size < state.first_failure, state


TestPolicyAgainstDevice = PolicyAgainstDevice.TestCase
TestPolicyAgainstDevice.settings = settings(
    max_examples=1000, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
