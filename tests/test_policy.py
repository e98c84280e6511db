"""The microbatch-size search policy, read as a specification.

Most tests are tables: a batch size, a threshold (a microbatch of size m fits iff m <= T), and
the sizes the policy must try, in order, with the size and split it must settle on.
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from automicro.core import policy as P
from automicro.core.policy import (
    OOM,
    SAFETY_MARGIN,
    BatchSizeChanged,
    CannotFitError,
    Decision,
    HookReason,
    Phase,
    PolicyConfig,
    Rearm,
    SearchPolicy,
    SearchState,
    Success,
    Thrash,
    chunk_split,
    even_split,
    predict_max_size,
    transition,
)

POLICY_FILE = Path(P.__file__)


def drive(policy: SearchPolicy, threshold: int, max_attempts: int = 1000, memory=None):
    """Run the search against a device where size m fits iff m <= threshold.

    memory=(fixed, per_sample): successes also report a linear peak and a capacity consistent
    with the threshold, so the memory prediction takes part. Returns the list of (size, ok) tried. Checks on every step that the split covers the batch
    and that every size is strictly between the facts known so far (largest size seen to fit,
    smallest seen to fail).
    """
    tried: list[tuple[int, bool]] = []
    while policy.phase == Phase.SEARCHING:
        split = policy.current_split()
        m = max(split)
        b = policy.state.batch_size
        assert sum(split) == b and all(1 <= s <= b for s in split), split
        assert split == chunk_split(b, m), "while searching the size itself must be tried"
        known_ok = max((s for s, ok in tried if ok), default=0)
        known_bad = min((s for s, ok in tried if not ok), default=b + 1)
        assert known_ok < m < known_bad, (tried, m)
        ok = m <= threshold
        tried.append((m, ok))
        if not ok:
            policy.observe(OOM(m))
        elif memory is None:
            policy.observe(Success(m))
        else:
            fixed, per = memory
            policy.observe(Success(m, fixed + per * m, fixed + per * threshold + per // 2))
        assert len(tried) <= max_attempts, tried
    return tried


def settle_to_steady(policy: SearchPolicy) -> list[Decision]:
    decisions = []
    while policy.phase == Phase.SETTLING:
        decisions.append(policy.observe(Success(max(policy.current_split()))))
        assert len(decisions) <= policy.config.stable_batches, "must go steady after stable_batches"
    return decisions


# ---- the search, as tables -------------------------------------------------------------------

SEARCH_TABLE = [
    # id, B, threshold, config, sizes tried (+ fits, x OOM), found, final split
    ("B16-fits-11", 16, 11, {}, "16x 8+ 12x 10+ 11+", 11, (8, 8)),
    ("never-fails", 16, 16, {}, "16+", 16, (16,)),
    ("B1", 1, 1, {}, "1+", 1, (1,)),
    ("fits-only-1", 16, 1, {}, "16x 8x 4x 2x 1+", 1, (1,) * 16),
    ("B10-fits-4-even-split", 10, 4, {}, "10x 5x 2+ 4+", 4, (4, 3, 3)),
    ("B64-fits-37", 64, 37, {}, "64x 32+ 48x 40x 36+ 38x 37+", 37, (32, 32)),
    ("B12-fits-7", 12, 7, {}, "12x 6+ 9x 7+ 8x", 7, (6, 6)),
    ("not-power-of-two-B", 24, 13, {}, "24x 12+ 18x 15x 13+ 14x", 13, (12, 12)),
    ("start-size-searches-up", 16, 16, {"start_size": 4}, "4+ 11+ 14+ 16+", 16, (16,)),
    ("start-size-up-then-down", 16, 12, {"start_size": 4}, "4+ 11+ 14x 12+ 13x", 12, (8, 8)),
    ("start-size-clamped-to-B", 8, 8, {"start_size": 100}, "8+", 8, (8,)),
    ("min-size-floor", 16, 5, {"min_size": 4}, "16x 9x 6x 4+ 5+", 5, (4, 4, 4, 4)),
    # halve: Composer's policy (m -> max(int(m/2), 1), settle on the first success, chunked split)
    ("halve-16-to-4", 16, 5, {"search": "halve"}, "16x 8x 4+", 4, (4, 4, 4, 4)),
    ("halve-16-fits-11", 16, 11, {"search": "halve"}, "16x 8+", 8, (8, 8)),
    ("halve-10-chunked", 10, 3, {"search": "halve"}, "10x 5x 2+", 2, (2, 2, 2, 2, 2)),
    ("halve-to-1", 16, 1, {"search": "halve"}, "16x 8x 4x 2x 1+", 1, (1,) * 16),
    ("halve-remainder", 16, 6, {"search": "halve", "start_size": 6}, "6+", 6, (6, 6, 4)),
    ("halve-no-upward-search", 16, 16, {"search": "halve", "start_size": 4}, "4+", 4, (4, 4, 4, 4)),
]


def _fmt(tried: list[tuple[int, bool]]) -> str:
    return " ".join(f"{m}{'+' if ok else 'x'}" for m, ok in tried)


@pytest.mark.parametrize(
    "batch_size, threshold, config, expected, found, split",
    [row[1:] for row in SEARCH_TABLE],
    ids=[row[0] for row in SEARCH_TABLE],
)
def test_search_table(batch_size, threshold, config, expected, found, split):
    policy = SearchPolicy(PolicyConfig(**config), batch_size)
    assert policy.phase == Phase.SEARCHING and policy.found_size is None and policy.state.hooks
    tried = drive(policy, threshold)
    assert _fmt(tried) == expected
    assert policy.found_size == found
    assert policy.phase == Phase.SETTLING
    assert policy.current_split() == split


def test_example_decisions_step_by_step():
    """B=16, fits up to 11: 16(OOM) -> 8(ok) -> 12(OOM) -> 10(ok) -> 11(ok) -> m_max=11, (8, 8)."""
    policy = SearchPolicy(PolicyConfig(), 16)
    assert policy.current_split() == (16,)
    steps = [
        (OOM(16), 8, (8, 8), True, Phase.SEARCHING),
        (Success(8), 12, (12, 4), False, Phase.SEARCHING),
        (OOM(12), 10, (10, 6), True, Phase.SEARCHING),
        (Success(10), 11, (11, 5), False, Phase.SEARCHING),
        (Success(11), 8, (8, 8), False, Phase.SETTLING),
    ]
    for outcome, next_size, split, rerun, phase in steps:
        d = policy.observe(outcome)
        assert (d.next_size, d.split, d.rerun, d.phase, d.hooks) == (next_size, split, rerun, phase, True), d
        assert d.event
    assert policy.found_size == 11
    assert policy.state.best_success == 11 and policy.state.first_failure == 12
    assert policy.state.successes == (8, 10, 11)


def test_event_text_names_sizes_and_bounds():
    policy = SearchPolicy(PolicyConfig(), 16)
    policy.observe(OOM(16))
    policy.observe(Success(8))
    d = policy.observe(OOM(12))
    assert d.event == "OOM at 12 -> try 10 (bounds 8..12)"


# ---- failure at the floor --------------------------------------------------------------------


def test_cannot_fit_at_size_1():
    policy = SearchPolicy(PolicyConfig(), 8)
    for m in (8, 4, 2):
        policy.observe(OOM(m))
    before = policy.state
    with pytest.raises(CannotFitError, match="even microbatch size 1 does not fit") as info:
        policy.observe(OOM(1))
    assert info.value.size == 1
    assert policy.state == before, "a failed transition leaves the state alone"


def test_cannot_fit_at_min_size():
    policy = SearchPolicy(PolicyConfig(min_size=4), 16)
    with pytest.raises(CannotFitError, match="size 4"):
        drive(policy, threshold=2)


def test_every_decision_names_why_the_hooks_are_on_or_off():
    policy = SearchPolicy(PolicyConfig(stable_batches=2, use_prediction=False), 16)
    seen = [(policy.observe(OOM(16)).reason, policy.hooks)]
    seen.append((policy.observe(Success(8)).reason, policy.hooks))  # bounds 8..16: still searching
    while policy.phase == Phase.SEARCHING:
        size = max(policy.current_split())
        seen.append((policy.observe(Success(size) if size <= 11 else OOM(size)).reason, policy.hooks))
    assert seen[0] == (HookReason.OOM, True) and seen[1] == (HookReason.SEARCHING, True)
    assert seen[-1][1] is True and seen[-1][0] in (HookReason.SETTLING, HookReason.OOM)
    size = max(policy.current_split())
    assert (policy.observe(Success(size)).reason, policy.hooks) == (HookReason.SETTLING, True)
    assert (policy.observe(Success(size)).reason, policy.hooks) == (HookReason.STABLE, False)
    assert (policy.observe(Success(size)).reason, policy.hooks) == (HookReason.STEADY, False)
    assert (policy.observe(Rearm("eval")).reason, policy.hooks) == (HookReason.REARM, True)
    assert policy.observe(BatchSizeChanged(8)).reason is HookReason.BATCH_SIZE_CHANGED
    assert policy.observe(Thrash(max(policy.current_split()))).reason is HookReason.THRASH


@pytest.mark.parametrize("search", ["bisect", "halve"])
def test_a_one_off_oom_at_size_1_in_steady_reruns_at_1(search):
    """The floor rule: size 1 ran clean, so one OOM there is an event; only its repeat ends the run."""
    policy = SearchPolicy(PolicyConfig(search=search), 4)
    drive(policy, threshold=1)
    settle_to_steady(policy)
    d = policy.observe(OOM(1))
    assert (d.phase, d.hooks, d.rerun, d.split) == (Phase.SETTLING, True, True, (1, 1, 1, 1))
    assert d.event == "OOM at 1 in steady phase -> rerun at 1 with sync hooks on"
    d = policy.observe(Success(1))
    assert policy.found_size == 1 and d.split == (1, 1, 1, 1)
    assert len(settle_to_steady(policy)) == 2  # the rerun was the first clean batch of 3


def test_each_ranks_own_one_off_after_another_gets_its_rerun_but_a_rank_running_out_twice_is_a_repeat():
    """With the hooks off, a rank stopped by another rank's OOM meets its own one-off in the rerun:
    that is a second one-off, not a repeat. A rank that runs out again is."""
    policy = SearchPolicy(PolicyConfig(), 4)
    drive(policy, threshold=1)
    settle_to_steady(policy)
    assert policy.observe(OOM(1, ranks=(1,))).rerun
    d = policy.observe(OOM(1, ranks=(0,)))  # rank 0's own one-off, one attempt later
    assert (d.rerun, d.next_size, policy.state.retrying_ranks) == (True, 1, (0, 1))
    with pytest.raises(CannotFitError):
        policy.observe(OOM(1, ranks=(1,)))  # rank 1 again: a repeat at the floor
    policy = SearchPolicy(PolicyConfig(), 4)
    drive(policy, threshold=1)
    settle_to_steady(policy)
    policy.observe(OOM(1, ranks=(1,)))
    with pytest.raises(CannotFitError):
        policy.observe(OOM(1))  # ranks unknown: a repeat


def test_an_oom_that_already_cost_a_run_is_never_a_one_off():
    """The failure note of a launch that could not recover: the resumed run starts below that size."""
    policy = SearchPolicy(PolicyConfig(), 10)
    drive(policy, threshold=4)
    settle_to_steady(policy)
    d = policy.observe(OOM(4, may_rerun=False))
    assert (d.phase, d.next_size) == (Phase.SEARCHING, 3)


def test_a_repeated_oom_at_size_1_ends_the_run():
    policy = SearchPolicy(PolicyConfig(), 4)
    drive(policy, threshold=1)
    settle_to_steady(policy)
    policy.observe(OOM(1))
    with pytest.raises(CannotFitError, match="even microbatch size 1 does not fit"):
        policy.observe(OOM(1))


def test_a_one_off_oom_at_size_1_right_after_eval_reruns_at_1():
    """After an eval the policy is SETTLING (hooks on): an OOM there at a size that ran clean is a
    one-off too (memory left by the eval), at the floor as at any size."""
    policy = SearchPolicy(PolicyConfig(), 4)
    drive(policy, threshold=1)
    settle_to_steady(policy)
    policy.observe(Rearm("eval"))
    d = policy.observe(OOM(1))
    assert (d.phase, d.rerun, d.next_size) == (Phase.SETTLING, True, 1)


def test_a_one_off_oom_after_eval_does_not_shrink_a_clean_size():
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)  # split (8, 8)
    settle_to_steady(policy)
    policy.observe(Rearm("eval"))
    assert policy.observe(OOM(8)).split == (8, 8)
    policy.observe(Success(8))
    assert policy.found_size == 11 and policy.current_split() == (8, 8)


def test_an_oom_at_a_size_that_never_ran_clean_is_a_failure_at_once():
    policy = SearchPolicy(PolicyConfig(), 1)
    with pytest.raises(CannotFitError):
        policy.observe(OOM(1))
    policy = SearchPolicy(PolicyConfig(), 8)
    assert policy.observe(OOM(8)).next_size == 4


def test_pipeline_floor_rule_and_batch_size_change_keep_allowed_sizes():
    """Hypothesis found it: a pipeline (equal microbatches, at least 2) whose batch shrank from 6
    to 2 settled on a success of the old batch size (2) that the new one cannot run as a split."""
    def sizes_for(b):
        return tuple(m for m in range(1, b + 1) if b % m == 0 and b // m >= 2)

    config = PolicyConfig(start_size=2, use_prediction=False, sizes_for=sizes_for, stable_batches=1)
    policy = SearchPolicy(config, 6)
    policy.observe(Success(2))
    d = policy.observe(BatchSizeChanged(2))
    assert d.split == (1, 1)
    policy.observe(Success(1))  # converges on 1 (2 cannot run a batch of 2)
    settle_to_steady(policy)
    assert policy.found_size == 1 and policy.phase == Phase.STEADY
    d = policy.observe(OOM(1))  # the pipeline's floor ran clean: a one-off
    assert (d.rerun, d.split) == (True, (1, 1))
    with pytest.raises(CannotFitError):
        policy.observe(OOM(1))


@pytest.mark.parametrize("search", ["bisect", "halve"])
def test_cannot_fit_halve_and_bisect_batch_of_one(search):
    policy = SearchPolicy(PolicyConfig(search=search), 1)
    with pytest.raises(CannotFitError):
        policy.observe(OOM(1))


def test_thrash_at_size_1_stays_at_1():
    """Thrashing at the floor still runs: nowhere lower to go, so settle there instead of failing."""
    policy = SearchPolicy(PolicyConfig(), 4)
    for m in (4, 2):
        policy.observe(OOM(m))
    policy.observe(Success(1))
    d = policy.observe(Thrash(1))
    assert (d.next_size, d.phase, d.hooks, d.rerun) == (1, Phase.SETTLING, True, False)
    assert policy.found_size == 1


def test_thrashing_at_the_floor_once_settled_counts_toward_the_clean_batches_that_take_the_hooks_off():
    """Allocator retries every other batch at size 1 (one H200, Llama-3.2 1B's shape at 65,536 tokens a sample) kept
    the hooks on for the whole run: settled at the floor, a thrashing batch trained and counts as a clean one."""
    policy = SearchPolicy(PolicyConfig(stable_batches=3), 2)
    policy.observe(OOM(2))
    policy.observe(Success(1))  # converged on 1: settling
    reasons = [policy.observe(outcome).reason for outcome in (Thrash(1), Success(1), Thrash(1))]
    assert policy.phase == Phase.STEADY and policy.found_size == 1, policy.state
    assert reasons == [HookReason.THRASH, HookReason.SETTLING, HookReason.STABLE]
    d = policy.observe(Thrash(1))
    assert (d.phase, d.hooks, d.next_size, d.reason) == (Phase.STEADY, False, 1, HookReason.STEADY)
    assert d.event.startswith("thrash at 1: cannot go lower")


# ---- thrash ----------------------------------------------------------------------------------


def test_thrash_counts_as_failure_without_rerun():
    policy = SearchPolicy(PolicyConfig(), 16)
    policy.observe(OOM(16))
    policy.observe(Success(8))  # next 12
    d = policy.observe(Thrash(12))  # the batch at 12 succeeded, but thrashed
    assert (d.next_size, d.rerun, d.hooks, d.phase) == (10, False, True, Phase.SEARCHING)
    assert d.event.startswith("thrash at 12")
    assert policy.state.first_failure == 12
    policy.observe(Success(10))  # next 11
    policy.observe(Success(11))
    d = policy.observe(Thrash(11))  # 11 succeeded once, then thrashed: no longer trusted
    assert policy.found_size == 10 and d.phase == Phase.SETTLING
    assert d.split == (8, 8) and policy.state.first_failure == 11


def test_thrash_in_steady_searches_down():
    policy = SearchPolicy(PolicyConfig(), 10)
    drive(policy, threshold=4)  # found 4, split (4, 3, 3)
    settle_to_steady(policy)
    d = policy.observe(Thrash(4))
    assert (d.phase, d.hooks, d.rerun, d.next_size) == (Phase.SEARCHING, True, False, 3)


@pytest.mark.parametrize("search", ["bisect", "halve"])
def test_halve_thrash_halves(search):
    policy = SearchPolicy(PolicyConfig(search=search), 16)
    d = policy.observe(Thrash(16))
    assert d.next_size == 8 and not d.rerun


def test_a_thrash_timed_faster_than_the_size_below_takes_the_size_and_its_bound_back():
    """`Retried` (`automicro.batch.thrash_timing`): back to the size that retried, its failure bound from before the
    thrash restored, the phase and the memory model kept."""
    policy = SearchPolicy(PolicyConfig(), 10)
    drive(policy, threshold=4)  # found 4, split (4, 3, 3); 5 ran out
    settle_to_steady(policy)
    bound = policy.state.first_failure
    assert bound == 5
    policy.observe(Thrash(4))
    policy.observe(Success(3))
    settle_to_steady(policy)
    assert policy.found_size == 3 and policy.state.first_failure == 4
    before = policy.state
    d = policy.observe(P.Retried(4, bound))
    assert (d.phase, d.hooks, d.next_size, d.split, d.reason) == (Phase.STEADY, False, 4, (4, 3, 3), HookReason.STEADY)
    assert d.event == "thrash at 4 timed faster than 3: back to 4, split (4, 3, 3)"
    state = policy.state
    assert (state.found, state.best_success, state.first_failure) == (4, 4, 5)
    assert (state.samples, state.successes, state.stable_count) == (before.samples, before.successes, before.stable_count)
    # Settling below: the count of clean batches is kept, the hooks stay on until it is reached.
    policy = SearchPolicy(PolicyConfig(stable_batches=3), 10)
    drive(policy, threshold=4)
    settle_to_steady(policy)
    policy.observe(Thrash(4))
    policy.observe(Success(3))
    policy.observe(Success(3))
    d = policy.observe(P.Retried(4, None))
    assert (d.phase, d.hooks, policy.state.stable_count, policy.state.first_failure) == (Phase.SETTLING, True, 1, None)
    assert d.reason == HookReason.SETTLING


@pytest.mark.parametrize("when", ["searching", "not above", "never ran", "tokens"])
def test_a_thrash_timed_back_is_refused_where_the_policy_is_not_settled_below_a_size_that_ran(when):
    config = PolicyConfig(unit="tokens") if when == "tokens" else PolicyConfig()
    policy = SearchPolicy(config, 10)
    if when != "tokens":
        drive(policy, threshold=4)
        settle_to_steady(policy)
    if when == "searching":
        policy.observe(Thrash(4))
    size = {"searching": 4, "not above": 4, "never ran": 6, "tokens": 8}[when]
    with pytest.raises(ValueError, match="needs a search over samples settled below"):
        policy.observe(P.Retried(size))


# ---- settling, steady, re-search, rearm ------------------------------------------------------


@pytest.mark.parametrize("stable_batches", [1, 3, 5])
def test_settle_then_steady_after_stable_batches(stable_batches):
    policy = SearchPolicy(PolicyConfig(stable_batches=stable_batches), 16)
    drive(policy, threshold=11)
    decisions = settle_to_steady(policy)
    assert len(decisions) == stable_batches
    for i, d in enumerate(decisions[:-1], start=1):
        assert (d.phase, d.hooks, d.split) == (Phase.SETTLING, True, (8, 8))
        assert d.event == f"clean batch {i}/{stable_batches} at split (8, 8)"
    last = decisions[-1]
    assert (last.phase, last.hooks, last.split, last.rerun) == (Phase.STEADY, False, (8, 8), False)
    assert "hooks off" in last.event
    d = policy.observe(Success(8))
    assert (d.phase, d.hooks, d.event) == (Phase.STEADY, False, "")
    assert policy.found_size == 11


@pytest.mark.parametrize("search", ["bisect", "halve"])
def test_converging_batch_is_not_counted_as_clean(search):
    policy = SearchPolicy(PolicyConfig(search=search, stable_batches=2), 8)
    d = policy.observe(Success(8))
    assert d.phase == Phase.SETTLING and policy.state.stable_count == 0
    assert policy.observe(Success(8)).phase == Phase.SETTLING
    assert policy.observe(Success(8)).phase == Phase.STEADY


def test_one_oom_in_steady_reruns_the_same_split_with_hooks_on():
    policy = SearchPolicy(PolicyConfig(), 10)
    drive(policy, threshold=4)
    settle_to_steady(policy)
    split = policy.current_split()
    d = policy.observe(OOM(max(split)))  # a one-off: a long sequence, memory left over from eval
    assert (d.phase, d.hooks, d.rerun, d.split) == (Phase.SETTLING, True, True, split)
    assert policy.found_size == 4 and policy.state.first_failure == 5, "the bounds do not move"
    assert "steady" in d.event
    for _ in range(3):
        d = policy.observe(Success(max(split)))
    assert (d.phase, d.hooks, d.split) == (Phase.STEADY, False, split)


def test_oom_in_steady_then_in_its_rerun_searches_down_keeping_known_successes():
    policy = SearchPolicy(PolicyConfig(), 10)
    assert _fmt(drive(policy, threshold=4)) == "10x 5x 2+ 4+"
    settle_to_steady(policy)
    assert policy.observe(OOM(4)).phase == Phase.SETTLING  # the rerun, same split
    d = policy.observe(OOM(4))  # e.g. fragmentation: 4 no longer fits
    assert (d.phase, d.hooks, d.rerun, d.next_size, d.split) == (Phase.SEARCHING, True, True, 3, (3, 3, 3, 1))
    assert policy.found_size is None
    assert (policy.state.best_success, policy.state.first_failure) == (2, 4), "2 is still known to fit"
    assert "settling" in d.event
    d = policy.observe(Success(3))
    assert (d.phase, d.split, policy.found_size) == (Phase.SETTLING, (3, 3, 2, 2), 3)


def test_oom_in_steady_ignores_successes_at_or_above_the_failure():
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)  # successes 8, 10, 11; split (8, 8)
    settle_to_steady(policy)
    policy.observe(OOM(8))  # steady: rerun at 8
    d = policy.observe(OOM(8))
    assert (policy.state.best_success, policy.state.first_failure) == (0, 8)
    assert (d.next_size, d.split) == (4, (4, 4, 4, 4))
    assert _fmt(drive(policy, threshold=6)) == "4+ 6+ 7x"
    assert policy.found_size == 6 and policy.current_split() == (6, 5, 5)


def test_oom_in_settling_converges_at_once_when_bounds_are_adjacent():
    policy = SearchPolicy(PolicyConfig(), 10)
    drive(policy, threshold=4)  # successes 2, 4; split (4, 3, 3)
    policy.observe(Success(4))  # one clean batch, then 4 stops fitting
    d = policy.observe(OOM(4))  # 4 ran clean: a one-off until it repeats
    assert (d.phase, d.next_size, d.rerun) == (Phase.SETTLING, 4, True)
    d = policy.observe(OOM(4))  # the repeat
    assert d.phase == Phase.SEARCHING and d.next_size == 3
    policy.observe(Success(3))
    settle_to_steady(policy)
    policy.observe(OOM(3))  # steady: the rerun at 3 ...
    d = policy.observe(OOM(3))  # ... fails too; 2 is known to fit and 3 failed: converged immediately
    assert (d.phase, d.split, d.rerun, policy.found_size) == (Phase.SETTLING, (2, 2, 2, 2, 2), True, 2)


def test_halve_oom_in_steady_halves_from_current_size():
    policy = SearchPolicy(PolicyConfig(search="halve"), 16)
    drive(policy, threshold=5)  # found 4
    settle_to_steady(policy)
    assert policy.observe(OOM(4)).phase == Phase.SETTLING  # steady: rerun at 4 first
    d = policy.observe(OOM(4))
    assert (d.phase, d.next_size, d.hooks, d.rerun) == (Phase.SEARCHING, 2, True, True)
    assert policy.observe(Success(2)).split == (2,) * 8


def test_rearm_in_steady_turns_hooks_on_until_stable_again():
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)
    settle_to_steady(policy)
    d = policy.observe(Rearm("eval"))
    assert (d.phase, d.hooks, d.split, d.rerun) == (Phase.SETTLING, True, (8, 8), False)
    assert "eval" in d.event
    assert policy.found_size == 11
    assert len(settle_to_steady(policy)) == 3


def test_rearm_in_settling_resets_the_count():
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)
    policy.observe(Success(8))
    policy.observe(Success(8))
    d = policy.observe(Rearm("checkpoint loaded"))
    assert (d.phase, d.hooks, policy.state.stable_count) == (Phase.SETTLING, True, 0)
    assert len(settle_to_steady(policy)) == 3


def test_rearm_while_searching_changes_nothing_else():
    policy = SearchPolicy(PolicyConfig(), 16)
    policy.observe(OOM(16))
    before = policy.state
    d = policy.observe(Rearm("eval"))
    assert (d.phase, d.hooks, d.next_size, d.rerun) == (Phase.SEARCHING, True, 8, False)
    assert policy.state == before


# ---- prediction ------------------------------------------------------------------------------

FIXED, PER_SAMPLE, CAPACITY = 1000, 100, 5000  # peak(m) = 1000 + 100 m; fits iff m <= 40


def _peak(m: int) -> int:
    return FIXED + PER_SAMPLE * m


def test_predict_max_size():
    # (5000 * 0.95 - 1000) / 100 = 37.5 -> 37
    assert SAFETY_MARGIN == 0.95
    assert predict_max_size(((4, _peak(4), CAPACITY), (35, _peak(35), CAPACITY))) == 37
    assert predict_max_size(((35, _peak(35), CAPACITY), (4, _peak(4), CAPACITY))) == 37
    assert predict_max_size(((4, _peak(4), CAPACITY),)) is None
    assert predict_max_size(()) is None
    assert predict_max_size(((4, 2000, CAPACITY), (8, 2000, CAPACITY))) is None, "no growth: cannot tell"
    assert predict_max_size(((4, 2000, CAPACITY), (8, 1500, CAPACITY))) is None
    assert predict_max_size(((4, _peak(4), 6000), (8, _peak(8), CAPACITY))) == 37, "the smaller capacity"
    assert predict_max_size(((4, _peak(4), CAPACITY), (8, _peak(8), CAPACITY)), margin=1.0) == 40


def test_prediction_used_when_strictly_between_bounds():
    policy = SearchPolicy(PolicyConfig(start_size=4), 64)
    d = policy.observe(Success(4, _peak(4), CAPACITY))  # one sample: bisect up
    assert d.next_size == (4 + 65 + 1) // 2 == 35 and "predicted" not in d.event
    d = policy.observe(Success(35, _peak(35), CAPACITY))
    assert d.next_size == 37 and "predicted" in d.event
    d = policy.observe(Success(37, _peak(37), CAPACITY))  # prediction 37 == lo: bisect
    assert d.next_size == (37 + 65 + 1) // 2 == 51 and "predicted" not in d.event
    assert [s[0] for s in policy.state.samples] == [35, 37], "the two latest distinct sizes"


def test_prediction_ignored_when_disabled():
    policy = SearchPolicy(PolicyConfig(start_size=4, use_prediction=False), 64)
    policy.observe(Success(4, _peak(4), CAPACITY))
    d = policy.observe(Success(35, _peak(35), CAPACITY))
    assert d.next_size == (35 + 65 + 1) // 2 == 50


def test_prediction_ignored_below_lower_bound():
    policy = SearchPolicy(PolicyConfig(), 64)
    policy.observe(OOM(64))
    policy.observe(Success(32, _peak(32), CAPACITY))  # next 48
    policy.observe(OOM(48))  # next 40
    d = policy.observe(Success(40, _peak(40), CAPACITY))  # predicts 37 < lo = 40
    assert d.next_size == (40 + 48 + 1) // 2 == 44 and "predicted" not in d.event


def test_prediction_ignored_at_or_above_upper_bound():
    big = 10**9  # predicts far beyond the batch
    policy = SearchPolicy(PolicyConfig(start_size=2), 64)
    policy.observe(Success(2, _peak(2), big))
    d = policy.observe(Success(34, _peak(34), big))
    assert d.next_size == (34 + 65 + 1) // 2 == 50
    state = replace(
        SearchState(batch_size=64, size=38, best_success=35, first_failure=38, successes=(4, 35)),
        samples=((4, _peak(4), CAPACITY), (35, _peak(35), CAPACITY)),
    )
    state, d = transition(state, OOM(37), PolicyConfig())  # predicts 37, not < first failure 37
    assert d.next_size == 36 and "predicted" not in d.event


def test_prediction_used_downward_after_oom():
    state = SearchState(
        batch_size=64,
        size=64,
        best_success=8,
        successes=(4, 8),
        samples=((4, _peak(4), CAPACITY), (8, _peak(8), CAPACITY)),
    )
    state, d = transition(state, OOM(64), PolicyConfig())
    assert (d.next_size, d.rerun) == (37, True) and "predicted" in d.event
    assert d.event == "OOM at 64 -> try 37 (predicted; bounds 8..64)"


def test_prediction_not_used_in_halve_mode():
    policy = SearchPolicy(PolicyConfig(search="halve", start_size=4), 64)
    policy.observe(Success(4, _peak(4), CAPACITY))
    assert policy.found_size == 4


def test_samples_keep_two_latest_distinct_sizes_and_need_capacity():
    policy = SearchPolicy(PolicyConfig(start_size=4), 64)
    policy.observe(Success(4, _peak(4), CAPACITY))
    policy.observe(Success(35, _peak(35)))  # no capacity: not a sample
    assert [s[0] for s in policy.state.samples] == [4]
    state = replace(policy.state, samples=((4, 1, 2), (35, 3, 4)))
    state, _ = transition(state, Success(4, _peak(4), CAPACITY), PolicyConfig())
    assert [s[0] for s in state.samples] == [35, 4]


@pytest.mark.parametrize("capacity", [3000, 4000, 5000, 7000, 9000])
def test_prediction_with_a_linear_memory_model_finds_the_exact_limit(capacity):
    limit = (capacity - FIXED) // PER_SAMPLE  # true largest fitting size
    for start in (None, 2, 5):
        policy = SearchPolicy(PolicyConfig(start_size=start), 64)
        tried = []
        while policy.phase == Phase.SEARCHING:
            m = max(policy.current_split())
            ok = m <= limit
            tried.append(m)
            policy.observe(Success(m, _peak(m), capacity) if ok else OOM(m))
            assert len(tried) <= math.ceil(math.log2(64)) + 2, tried
        assert policy.found_size == min(limit, 64), (capacity, start, tried)


# ---- splits ----------------------------------------------------------------------------------

EVEN_SPLITS = [
    (10, 4, (4, 3, 3)),
    (16, 11, (8, 8)),
    (16, 16, (16,)),
    (16, 8, (8, 8)),
    (16, 1, (1,) * 16),
    (7, 3, (3, 2, 2)),
    (9, 4, (3, 3, 3)),
    (17, 8, (6, 6, 5)),
    (64, 37, (32, 32)),
    (1, 1, (1,)),
]


@pytest.mark.parametrize("batch_size, max_size, expected", EVEN_SPLITS, ids=[f"{b}/{m}" for b, m, _ in EVEN_SPLITS])
def test_even_split_table(batch_size, max_size, expected):
    assert even_split(batch_size, max_size) == expected


def test_even_split_properties():
    for b in range(1, 65):
        for m in range(1, b + 1):
            parts = even_split(b, m)
            assert sum(parts) == b
            assert len(parts) == math.ceil(b / m), "fewest microbatches"
            assert max(parts) <= m and max(parts) - min(parts) <= 1
            assert list(parts) == sorted(parts, reverse=True), "larger first"


@pytest.mark.parametrize(
    "batch_size, size, expected",
    [(10, 4, (4, 4, 2)), (16, 6, (6, 6, 4)), (16, 8, (8, 8)), (16, 16, (16,)), (5, 1, (1,) * 5)],
)
def test_chunk_split_is_composers(batch_size, size, expected):
    assert chunk_split(batch_size, size) == expected


@pytest.mark.parametrize("args", [(0, 1), (4, 0), (4, 5), (4, 2.0), (True, 1)])
def test_split_argument_checks(args):
    with pytest.raises(ValueError):
        even_split(*args)
    with pytest.raises(ValueError):
        chunk_split(*args)


# ---- batch size changes ----------------------------------------------------------------------


def test_batch_size_grows_after_convergence():
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)
    settle_to_steady(policy)
    d = policy.observe(BatchSizeChanged(32))
    assert (d.phase, d.hooks, d.split, d.next_size, d.rerun) == (Phase.SETTLING, True, (11, 11, 10), 11, False)
    assert policy.found_size == 11 and policy.state.first_failure == 12
    assert policy.batch_size == 32 and policy.state.stable_count == 0


def test_batch_size_shrinks_below_found_size():
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)
    d = policy.observe(BatchSizeChanged(8))
    assert (d.split, policy.found_size, policy.state.first_failure) == ((8,), 8, None)
    assert d.hooks and d.phase == Phase.SETTLING


def test_batch_size_change_while_searching_clips_bounds():
    policy = SearchPolicy(PolicyConfig(), 16)
    policy.observe(OOM(16))  # next 8
    d = policy.observe(BatchSizeChanged(32))
    assert (d.phase, d.next_size, d.split, policy.state.first_failure) == (Phase.SEARCHING, 8, (8, 8, 8, 8), 16)
    d = policy.observe(BatchSizeChanged(4))
    assert (d.phase, d.next_size, d.split, policy.state.first_failure) == (Phase.SEARCHING, 4, (4,), None)
    assert _fmt(drive(policy, threshold=4)) == "4+"


def test_batch_size_change_halve_mode_keeps_chunking():
    policy = SearchPolicy(PolicyConfig(search="halve"), 16)
    drive(policy, threshold=5)  # found 4
    assert policy.observe(BatchSizeChanged(10)).split == (4, 4, 2)


def test_batch_size_change_rejects_non_positive():
    policy = SearchPolicy(PolicyConfig(), 16)
    with pytest.raises(ValueError, match="new_B"):
        policy.observe(BatchSizeChanged(0))


# ---- state round trip, purity ----------------------------------------------------------------


def _scripted_policy() -> SearchPolicy:
    policy = SearchPolicy(PolicyConfig(), 64)
    policy.observe(OOM(64))
    policy.observe(Success(32, _peak(32), CAPACITY))
    policy.observe(OOM(48))
    return policy


def test_state_round_trip_through_json():
    policy = _scripted_policy()
    d = json.loads(json.dumps(policy.state.to_dict()))
    restored = SearchState.from_dict(d)
    assert restored == policy.state
    assert d["phase"] == "SEARCHING" and d["first_failure"] == 48 and d["samples"] == [[32, _peak(32), CAPACITY]]
    # the restored policy takes the same decisions
    other = SearchPolicy(PolicyConfig(), 64)
    other.state = restored
    for outcome in (Success(40, _peak(40), CAPACITY), OOM(44), Success(42), Success(43)):
        assert other.observe(outcome) == policy.observe(outcome)
    assert other.state == policy.state


@pytest.mark.parametrize("phase", list(Phase))
def test_state_round_trip_every_phase(phase):
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)
    if phase == Phase.STEADY:
        settle_to_steady(policy)
    elif phase == Phase.SEARCHING:
        policy.observe(OOM(8))  # 8 ran clean: rerun
        policy.observe(OOM(8))  # the repeat searches
    assert policy.phase == phase
    assert SearchState.from_dict(policy.state.to_dict()) == policy.state


def test_state_round_trip_keeps_a_pending_rerun():
    """A checkpoint taken between a one-off OOM and its rerun: the resumed policy still counts
    the next OOM at that size as the repeat."""
    policy = SearchPolicy(PolicyConfig(), 16)
    drive(policy, threshold=11)
    settle_to_steady(policy)
    policy.observe(OOM(8))
    restored = SearchState.from_dict(policy.state.to_dict())
    assert restored == policy.state and restored.retrying == 8
    assert transition(restored, OOM(8), PolicyConfig())[1].phase == Phase.SEARCHING


@pytest.mark.parametrize(
    "patch, match",
    [({"version": 99}, "version"), ({"phase": "NAPPING"}, "phase"), ({"size": 0}, "out of range")],
)
def test_state_from_dict_rejects_bad_data(patch, match):
    d = {**_scripted_policy().state.to_dict(), **patch}
    with pytest.raises(ValueError, match=match):
        SearchState.from_dict(d)


def test_transition_is_pure():
    state = _scripted_policy().state
    snapshot = state.to_dict()
    a = transition(state, Success(40), PolicyConfig())
    b = transition(state, Success(40), PolicyConfig())
    assert a == b and state.to_dict() == snapshot


def test_outcome_size_checked():
    policy = SearchPolicy(PolicyConfig(), 16)
    for bad in (0, 17, 2.5):
        with pytest.raises(ValueError, match="outcome size"):
            policy.observe(OOM(bad))
    with pytest.raises(TypeError):
        policy.observe("oom")  # type: ignore[arg-type]


def test_policy_module_is_pure_python():
    tree = ast.parse(POLICY_FILE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "enum", "math", "dataclasses", "typing"}, imported
    # loaded on its own (not through the automicro package), it pulls in no torch or composer
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('policy_alone', {str(POLICY_FILE)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['policy_alone'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "p = mod.SearchPolicy(mod.PolicyConfig(), 16); p.observe(mod.OOM(16))\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'composer', 'automicro')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_imports_nothing_above_it():
    """The layering: `automicro.core` is the bottom floor. No module in it imports the
    engine, the integration, the config, the testing kit, the models, the data, or Composer, not even
    inside a function: engine -> core and integration -> engine and core only."""
    above = ("composer", "automicro.engine", "automicro.batch", "automicro.composer", "automicro.step", "automicro.hf",
             "automicro.lightning", "automicro.config", "automicro.testing",
             "automicro.models", "automicro.data", "llmfoundry")
    core = Path(POLICY_FILE).parent
    bad = []
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            )
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names if n == "automicro" or n.startswith(above)]
    assert len(list(core.glob("*.py"))) > 10 and not bad, bad


def test_the_callback_only_dispatches():
    """`composer/callback.py` dispatches Composer's events to the rooms that own the
    behaviour (settings, runtime, training_search, layout_trials, eval_search, batch_kinds): under 500
    lines, and no branch on the batch kind, the pipeline or the layout inside it (a room answers)."""
    path = Path(POLICY_FILE).parent.parent / "composer" / "callback.py"
    text = path.read_text()
    assert len(text.splitlines()) < 500, len(text.splitlines())
    branches = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.If, ast.IfExp)):
            test = ast.unparse(node.test)
            if any(word in test for word in ("tokens", "budget", "pipeline is not None", "layout_config.mode")):
                branches.append(f"line {node.lineno}: if {test}")
    assert not branches, branches


# ---- config validation -----------------------------------------------------------------------

BAD_CONFIGS = [
    ({"search": "linear"}, r"search='linear'.*'bisect', 'halve'"),
    ({"stable_batches": 0}, "stable_batches=0: must be an int >= 1"),
    ({"stable_batches": "3"}, "stable_batches"),
    ({"stable_batches": True}, "stable_batches"),
    ({"use_prediction": "yes"}, "use_prediction='yes': must be true or false"),
    ({"start_size": 0}, "start_size=0"),
    ({"start_size": 2.5}, "start_size"),
    ({"min_size": 0}, "min_size=0: must be an int >= 1"),
]


@pytest.mark.parametrize("kwargs, match", BAD_CONFIGS, ids=[next(iter(k)) + "-" + repr(v) for k, _ in BAD_CONFIGS for v in k.values()])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyConfig(**kwargs)


def test_config_defaults_and_bad_batch_size():
    c = PolicyConfig()
    assert (c.search, c.stable_batches, c.use_prediction, c.start_size, c.min_size) == ("bisect", 3, True, None, 1)
    with pytest.raises(ValueError, match="batch_size"):
        SearchPolicy(c, 0)
    assert SearchPolicy(None, 4).config == c


# ---- the convergence guarantee, exhaustively -------------------------------------------------

MAX_B = 64


@pytest.mark.parametrize(
    "use_prediction, memory",
    [(False, None), (True, None), (True, (1000, 100)), (True, (100_000, 10)), (True, (10, 1000))],
    ids=["no-prediction", "prediction-no-peaks", "linear-1000+100m", "linear-100000+10m", "linear-10+1000m"],
)
def test_bisect_converges_to_exact_threshold_for_every_b_and_t(use_prediction, memory):
    """For every B <= 64 and every threshold T in 1..B: found == T within ceil(log2 B) + 2 tries."""
    for b in range(1, MAX_B + 1):
        bound = math.ceil(math.log2(b)) + 2
        for t in range(1, b + 1):
            policy = SearchPolicy(PolicyConfig(use_prediction=use_prediction), b)
            tried = drive(policy, t, max_attempts=bound, memory=memory)
            assert policy.found_size == t, (b, t, tried)
            split = policy.current_split()
            assert sum(split) == b and max(split) <= t and len(split) == math.ceil(b / t)


@pytest.mark.parametrize("start_size", [1, 3, 8, 33])
def test_bisect_converges_from_any_start_size(start_size):
    for b in range(1, MAX_B + 1):
        for t in range(1, b + 1):
            policy = SearchPolicy(PolicyConfig(start_size=start_size), b)
            tried = drive(policy, t, max_attempts=math.ceil(math.log2(b)) + 3)
            assert policy.found_size == t, (b, t, tried)


@pytest.mark.parametrize("search", ["bisect", "halve"])
def test_reconverges_after_the_limit_drops_in_steady(search):
    """Memory shrinks later (fragmentation, a longer sequence): run batches against the new,
    lower limit until steady again; the final split must fit it. Stale successes above the new
    limit cost extra OOMs but never a wrong final answer."""
    for b in range(2, 33):
        for t in range(1, b + 1):
            policy = SearchPolicy(PolicyConfig(search=search), b)
            drive(policy, t)
            settle_to_steady(policy)
            steady = policy.state
            for lower in range(1, max(policy.current_split())):
                p = SearchPolicy(PolicyConfig(search=search), b)
                p.state = steady
                for _ in range(40):
                    split = p.current_split()
                    assert sum(split) == b
                    m = max(split)
                    p.observe(Success(m) if m <= lower else OOM(m))
                    if p.phase == Phase.STEADY:
                        break
                assert p.phase == Phase.STEADY, (b, t, lower)
                assert max(p.current_split()) <= lower, (b, t, lower, p.state)


def test_halve_converges_to_largest_b_over_power_of_two_under_t():
    for b in range(1, MAX_B + 1):
        for t in range(1, b + 1):
            k = 0
            while b // 2**k > t:
                k += 1
            policy = SearchPolicy(PolicyConfig(search="halve"), b)
            tried = drive(policy, t)
            assert [m for m, _ in tried] == [b // 2**i for i in range(k + 1)], (b, t, tried)
            assert policy.found_size == b // 2**k
            assert policy.current_split() == chunk_split(b, b // 2**k)


def test_success_at_or_above_the_failure_bound_lifts_the_stale_bound():
    """A size that failed once and then ran clean: that failure did not reproduce, drop the bound."""
    policy = SearchPolicy(PolicyConfig(), 16)
    policy.observe(OOM(12))
    assert policy.state.first_failure == 12
    d = policy.observe(Success(12))
    assert policy.state.first_failure is None and policy.state.best_success == 12
    assert (d.phase, d.next_size) == (Phase.SEARCHING, (12 + 17 + 1) // 2)
    d = policy.observe(Success(15))
    assert d.next_size == 16
    assert policy.observe(Success(16)).split == (16,)


# ---- the thrash timed (`automicro.batch.thrash_timing`) -----------------------------------------


class _TwoRanks:
    """`agree_max` against another rank whose values `other(local)` gives (default: all 0)."""

    def __init__(self, other=None):
        self.other = other or (lambda values: [0] * len(values))
        self.rounds = 0

    def agree_max(self, values):
        self.rounds += 1
        return [max(a, b) for a, b in zip(values, self.other(list(values)))]


def _thrash_timing(consensus, lines):
    from automicro.batch.thrash_timing import ThrashTiming

    return ThrashTiming(2, 0.01, lambda: consensus, lines.append, enabled=True)


GiB = 2**30


def _steady_thrash_at_8(timing, seconds):
    """Batches 10 and 11 at 8 (settled, hooks off) retried: the thrash in 11; then 12 searched, 13-15 settled at 4
    (hooks on), 16-19 steady (hooks off)."""
    for b in (10, 11):
        timing.after_batch(b, 8, (8,), False, True)
        seconds[b] = 1.0
    timing.thrash(11, 8, 8, 1, 9, 40 * GiB, searching=False, samples=True)
    timing.after_batch(12, None, (4, 4), True, True)
    seconds[12] = 5.0
    for b in (13, 14, 15):
        timing.after_batch(b, 4, (4, 4), True, True)
        seconds[b] = 0.5  # with the hooks on: the retrying batches had them off
    for b in (16, 17, 18, 19):
        seconds[b] = 2.0


def test_a_thrash_timed_judges_the_size_below_on_batches_with_the_hooks_as_the_retrying_ones_had_them():
    lines, consensus, seconds = [], _TwoRanks(), {}
    timing = _thrash_timing(consensus, lines)
    _steady_thrash_at_8(timing, seconds)
    assert timing.holding
    decided = []
    for b in (16, 17, 18):
        timing.after_batch(b, 4, (4, 4), False, True)
        decided.append(timing.decide(b, 4, 40 * GiB, {k: v for k, v in seconds.items() if k < b}, {}))
    # 13-15 had the hooks on: left out; 16 and 17 known once 18 trained (the plan's clock: start to start); one round.
    assert decided[:2] == [None, None]
    assert decided[2] == P.Retried(8, 9) and not timing.holding and consensus.rounds == 1
    assert lines == ["thrash at 8 timed: median batch 1.0000 s at 8 with the allocator's retries (batches 10, 11), "
                     "2.0000 s at 4 (batches 16, 17) (+50.0%; spread 0.0000 s): 8 again from batch 19, its retries "
                     "accepted (no thrash counted there; an OOM there still shrinks the size)"]
    assert timing.accepts(8) and not timing.accepts(4)
    timing.after_batch(19, 8, (8,), False, True)
    assert timing.accepts(8)
    # Checkpointed: a resumed run accepts them too; once the size found moves, they are timed again.
    state = timing.state_dict()
    timing.after_batch(20, 6, (6, 2), True, True)
    assert not timing.accepts(8)
    timing.load_state_dict(state)
    assert timing.accepts(8)


def test_a_thrash_timed_leaves_out_a_batch_that_compiled_on_another_rank_and_keeps_the_size_below_where_faster():
    lines, seconds = [], {}
    # The other rank compiled a graph in batch 16 (the third of the arms' batches: 10, 11, 16, 17).
    rounds = []

    def other(local):
        rounds.append(local)
        return [0] * 6 + ([10**6, 0] if len(rounds) == 1 else [0, 0])

    consensus = _TwoRanks(other)
    timing = _thrash_timing(consensus, lines)
    _steady_thrash_at_8(timing, seconds)
    for b in (16, 17, 18, 19):
        seconds[b] = 0.8
        timing.after_batch(b, 4, (4, 4), False, True)
        got = timing.decide(b, 4, 40 * GiB, {k: v for k, v in seconds.items() if k < b}, {})
        assert got is None
        if b == 18:
            assert timing.holding and not lines  # 16 left out: 17 and 18 next
    assert not timing.holding and consensus.rounds == 2
    assert lines == ["thrash at 8 timed: median batch 1.0000 s at 8 with the allocator's retries (batches 10, 11), "
                     "0.8000 s at 4 (batches 17, 18) (-25.0%; spread 0.0000 s): 4 kept, as the thrash rule had it"]
    assert not timing.accepts(8)


def test_a_thrash_timing_that_finds_no_batch_to_time_stops_and_lets_the_trials_run():
    """The size below's batches all had the sync hooks on where the retrying ones had them off (or each compiled a
    graph): no arm, and the trial plan is held off meanwhile. Past `WAIT_BATCHES` the timing stops, with a line."""
    from automicro.batch.thrash_timing import WAIT_BATCHES

    lines, seconds = [], {}
    timing = _thrash_timing(_TwoRanks(), lines)
    _steady_thrash_at_8(timing, seconds)
    last = 11 + WAIT_BATCHES + 1
    for b in range(16, last + 1):
        seconds[b - 1] = 2.0
        timing.after_batch(b, 4, (4, 4), True, True)
        assert timing.decide(b, 4, 40 * GiB, seconds, {}) is None
        assert timing.holding == (b < last), b
    assert lines == [f"thrash at 8: not timed against the size below (no 2 batches fit to time at the size below within "
                     f"{WAIT_BATCHES} batches); the size below stays"]


def _cascade(timing, seconds, at_4):
    """The thrash at 8 (batches 10, 11), then 12 (4, 4) searched, 13 and 14 at 4 (settled, hooks on) retried: a thrash
    at 4 in 14 while the one at 8 waits; 15 searched at 2, 16 settled at 3."""
    for b in (10, 11):
        timing.after_batch(b, 8, (8,), False, True)
        seconds[b] = 1.0
    timing.thrash(11, 8, 8, 1, 9, 40 * GiB, searching=False, samples=True)
    timing.after_batch(12, None, (4, 4), True, True)
    for b in (13, 14):
        timing.after_batch(b, 4, (4, 4), True, True)
    seconds.update({12: 5.0, 13: at_4, 14: at_4})
    kept = timing.below_thrashed(14, 4)
    timing.after_batch(15, None, (2, 2, 2, 2), True, True)
    seconds[15] = 3.0
    return kept


@pytest.mark.parametrize("faster", [8, 4])
def test_a_thrash_at_the_size_below_one_being_timed_gives_its_retrying_batches_as_the_other_arm(faster):
    lines, consensus, seconds = [], _TwoRanks(), {}
    timing = _thrash_timing(consensus, lines)
    assert _cascade(timing, seconds, 2.0 if faster == 8 else 0.5) and timing.holding
    # Still searching below (15): nothing to decide; 16 settled at 3: the retrying batches at 4 (12 was the first at its
    # split) are the arm, the hooks on and all.
    assert timing.decide(15, None, 40 * GiB, seconds, {}) is None and timing.holding
    timing.after_batch(16, 3, (3, 3, 2), True, True)
    got = timing.decide(16, 3, 40 * GiB, seconds, {})
    assert not timing.holding and consensus.rounds == 1
    if faster == 8:
        assert got == P.Retried(8, 9) and timing.accepts(8)
        assert lines == ["thrash at 8 timed: median batch 1.0000 s at 8 with the allocator's retries (batches 10, 11), "
                         "2.0000 s at 4 with its retries too (batches 13, 14) (+50.0%; spread 0.0000 s): 8 again from "
                         "batch 17, its retries accepted (no thrash counted there; an OOM there still shrinks the size)"]
    else:
        assert got is None and not timing.accepts(8)
        assert lines == ["thrash at 8 timed: median batch 1.0000 s at 8 with the allocator's retries (batches 10, 11), "
                         "0.5000 s at 4 with its retries too (batches 13, 14) (-100.0%; spread 0.0000 s): 3 kept, as "
                         "the thrash rule had it"]


def test_a_retrying_arm_below_that_compiled_on_another_rank_gives_way_to_the_settled_size_below():
    lines, seconds = [], {}
    rounds = []

    def other(local):  # the other rank compiled a graph in 13 and 14 (of 10, 11, 13, 14) in the first round
        rounds.append(local)
        return [0] * 6 + ([10**6] * 2 if len(rounds) == 1 else [0, 0])

    consensus = _TwoRanks(other)
    timing = _thrash_timing(consensus, lines)
    _cascade(timing, seconds, 2.0)
    timing.after_batch(16, 3, (3, 3, 2), False, True)
    assert timing.decide(16, 3, 40 * GiB, seconds, {}) is None and timing.holding and not lines
    # Nothing is left of that arm: the settled size's batches are (16 the first at its split) 17 and 18.
    for b in (17, 18, 19):
        seconds[b - 1] = 0.9
        timing.after_batch(b, 3, (3, 3, 2), False, True)
        got = timing.decide(b, 3, 40 * GiB, seconds, {})
    assert got is None and not timing.holding and consensus.rounds == 2
    assert lines == ["thrash at 8 timed: median batch 1.0000 s at 8 with the allocator's retries (batches 10, 11), "
                     "0.9000 s at 3 (batches 17, 18) (-11.1%; spread 0.0000 s): 3 kept, as the thrash rule had it"]


@pytest.mark.parametrize("case", ["no batch fit", "not below"])
def test_a_thrash_while_one_is_timed_stops_it_where_it_gives_no_arm_below(case):
    lines = []
    timing = _thrash_timing(_TwoRanks(), lines)
    for b in (10, 11):
        timing.after_batch(b, 8, (8,), False, True)
    timing.thrash(11, 8, 8, 1, 9, 40 * GiB, searching=False, samples=True)
    if case == "no batch fit":  # 12 the first at (4, 4), 13 the first at (7, 1)
        timing.after_batch(12, None, (4, 4), True, True)
        timing.after_batch(13, None, (7, 1), True, True)
        assert not timing.below_thrashed(13, 7)
    else:  # the search went back to 8 and it retried there
        timing.after_batch(12, None, (8,), True, True)
        timing.after_batch(13, None, (8,), True, True)
        assert not timing.below_thrashed(13, 8)
    assert not timing.holding
    why = "at the size below, in no batch fit to time" if case == "no batch fit" else "at 8"
    assert lines == [f"thrash at 8: not timed against the size below (another thrash came first, {why}); the size "
                     "below stays"]


@pytest.mark.parametrize("why", ["capacity", "above", "another thrash"])
def test_a_thrash_timing_stops_where_the_memory_moved_or_the_search_went_above(why):
    lines, seconds = [], {}
    timing = _thrash_timing(_TwoRanks(), lines)
    _steady_thrash_at_8(timing, seconds)
    if why == "capacity":
        assert timing.decide(16, 4, 36 * GiB, seconds, {}) is None
        assert lines == ["thrash at 8: not timed against the size below (the memory capacity moved, 40960.0 -> "
                         "36864.0 MiB); the size below stays"]
    elif why == "above":
        assert timing.decide(16, 8, 40 * GiB, seconds, {}) is None
        assert lines == ["thrash at 8: not timed against the size below (the search went to 8); the size below stays"]
    else:
        timing.stop("another thrash came first, at the size below")
    assert not timing.holding


@pytest.mark.parametrize("split", [(8,), (7, 1)])
def test_a_thrash_in_the_batches_right_after_the_search_converged_is_timed_where_they_ran_the_size_found(split):
    """Batch 10 converged on 8 (the size found after it: None in its record), 11 at 8: both retried. At 8's split, 10
    is 8's batch too (a new size's pool settling: on one H100 the thrashes at 4 and 3 retried in their converging
    batch); converged in a batch of (7, 1) with 8's split (8,), it is not."""
    lines = []
    timing = _thrash_timing(_TwoRanks(), lines)
    timing.after_batch(10, None, split, True, True)
    timing.after_batch(11, 8, (8,), True, True)
    timing.thrash(11, 8, 8, 1, None, 40 * GiB, searching=False, samples=True)
    assert timing.holding == (split == (8,)) and not lines


@pytest.mark.parametrize("case", ["floor", "searching", "tokens", "off", "mixed sizes"])
def test_a_thrash_is_not_timed_at_the_floor_while_searching_over_tokens_or_off_a_gpu(case):
    lines = []
    timing = _thrash_timing(_TwoRanks(), lines)
    timing.enabled = case != "off"
    timing.after_batch(10, 6 if case == "mixed sizes" else 8, (8,), False, True)
    timing.after_batch(11, 8, (8,), False, True)
    timing.thrash(11, 8, 1 if case == "floor" else 8, 1, None, 40 * GiB, searching=case == "searching",
                  samples=case != "tokens")
    assert not timing.holding and not lines
