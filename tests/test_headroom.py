"""Headroom that knows the world size (`automicro.core.headroom`): the size settled on keeps
a job-level rerun rate under the target at the run's world size, tested with injected per-rank OOM rates."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from automicro.batch.settings import Settings
from automicro.batch.training_search import TrainingSearch
from automicro.core import headroom
from automicro.core import policy as search

GIB = 1 << 30
FIXED, PER_SAMPLE, USABLE, SIGMA = 20 * GIB, 2 * GIB, 80 * GIB, GIB // 2


def _settling_peaks(size: int, world: int, batches: int = 3, seed: int = 0) -> np.ndarray:
    """Every rank's peak in each settling batch: the model's mean at `size`, spread SIGMA (variable lengths,
    fragmentation), independent across ranks and batches."""
    rng = np.random.default_rng(seed)
    return FIXED + PER_SAMPLE * size + SIGMA * rng.standard_normal((batches, world))


def _job_rerun_rate(size: int, world: int, batches: int = 2000, seed: int = 1) -> float:
    """Injected per-rank OOMs: each rank of each batch runs out where its peak passes the usable memory;
    the batch reruns when any rank does."""
    rng = np.random.default_rng(seed)
    reruns = 0
    for _ in range(batches // 100):
        peaks = FIXED + PER_SAMPLE * size + SIGMA * rng.standard_normal((100, world))
        reruns += int((peaks > USABLE).any(axis=1).sum())
    return reruns / batches


def test_the_per_rank_rate_and_the_spreads_it_takes_grow_with_the_world():
    assert headroom.per_rank_rate(0.01, 1) == pytest.approx(0.01)
    assert headroom.job_rerun_rate(headroom.per_rank_rate(0.01, 4096), 4096) == pytest.approx(0.01)
    zs = [headroom.z_for(0.01, n) for n in (1, 8, 512, 4096, 16384)]
    assert zs == sorted(zs) and zs[0] == pytest.approx(2.326, abs=1e-3) and zs[-2] == pytest.approx(4.57, abs=0.01)
    with pytest.raises(ValueError, match="between 0 and 1"):
        headroom.per_rank_rate(1.5, 8)


@pytest.mark.parametrize("world, kept", [(1, 29), (8, 29), (4096, 28), (16384, 28)])
def test_the_size_settled_on_keeps_the_job_under_one_percent_at_its_world_size(world, kept):
    """Found 29 (its mean peak 78 GiB, 4 spreads below the usable 80): safe on one rank, but over 4,096
    ranks 12% of the batches would rerun; the headroom steps to 28 there, and the injected OOMs agree."""
    # Over as many settling batches as MIN_PEAKS peaks take where the world is too small for 3 to give them.
    batches = max(3, -(-headroom.MIN_PEAKS // world))
    chosen = headroom.decide(29, _settling_peaks(29, world, batches).tolist(), USABLE, PER_SAMPLE, world)
    assert chosen.size == kept
    assert chosen.line.startswith("headroom: ") and f"{world} rank(s)" in chosen.line
    assert _job_rerun_rate(chosen.size, world) <= 0.01
    if kept != 29:
        assert "29 -> 28" in chosen.line
        assert _job_rerun_rate(29, world) > 0.05  # without it: the injected per-rank rate, times the ranks


def test_no_spread_no_step_and_an_unknown_slope_steps_one_sample():
    flat = [[FIXED + PER_SAMPLE * 29] * 64] * 3
    assert headroom.decide(29, flat, USABLE, PER_SAMPLE, 64).size == 29
    wide = (FIXED + PER_SAMPLE * 29 + 4 * GIB * np.random.default_rng(2).standard_normal((3, 64))).tolist()
    stepped = headroom.decide(29, wide, USABLE, None, 64)
    assert stepped.size == 28 and "one step" in stepped.line
    assert headroom.decide(29, [[1]], USABLE, PER_SAMPLE, 1).line.startswith("headroom: not measured")
    assert headroom.decide(1, wide, USABLE, PER_SAMPLE, 64, floor=1).size == 1  # never below the floor


@pytest.mark.parametrize("value", [-0.1, 1.0, True, "1%"])
def test_rerun_target_must_be_a_fraction(value):
    with pytest.raises(ValueError, match="rerun_target"):
        Settings.parse(rerun_target=value)


def _search_at(world: int, target: float, peaks_of) -> tuple[TrainingSearch, list[str]]:
    """The training search's own steps (policy, settling, `_headroom`) with every rank's peaks given."""
    lines: list[str] = []
    runtime = SimpleNamespace(settings=Settings.parse(rerun_target=target), info=lines.append, memory=None, rank=0)
    trainer = TrainingSearch(runtime.settings, runtime)
    trainer.policy = search.SearchPolicy(search.PolicyConfig(), 30)  # the size found is the microbatch run
    trainer.batch_attempts = 1
    policy = trainer.policy
    for _ in range(40):
        phase_before, found = policy.phase, policy.found_size
        size = max(policy.current_split())
        mean = FIXED + PER_SAMPLE * size
        if mean > USABLE:
            policy.observe(search.OOM(size, (0,), capacity_bytes=USABLE))
            continue
        rows = peaks_of(size, world)
        verdict = SimpleNamespace(reports=[SimpleNamespace(peak_bytes=int(p)) for p in rows], capacity_bytes=USABLE)
        decision = policy.observe(search.Success(size, peak_bytes=int(max(rows)), capacity_bytes=USABLE))
        trainer._headroom(phase_before, decision, verdict, found, False)
        if policy.phase == search.Phase.STEADY and phase_before == search.Phase.STEADY:
            break
    return trainer, lines


def _spread(size: int, world: int, rng=np.random.default_rng(3)) -> np.ndarray:
    # The mean sits 4 spreads under the usable at 30 (78 GiB): safe on one rank, not over 4,096.
    return FIXED - 2 * GIB + PER_SAMPLE * size + SIGMA * rng.standard_normal(world)


def test_the_training_search_adopts_the_headroom_at_a_large_world_and_says_why():
    trainer, lines = _search_at(4096, 0.01, _spread)
    line = next(line for line in lines if line.startswith("headroom: "))
    assert trainer.policy.phase == search.Phase.STEADY
    assert trainer.policy.found_size == 29 and "size 30 -> 29" in line and "4096 rank(s)" in line
    # Under 30 the fewest microbatches, as even as possible: 2 of 15 (the policy's split rule).
    assert trainer.policy.current_split() == (15, 15)
    assert any("layout: microbatch now" in line for line in lines)  # the policy's Adopt event
    assert sum(line.startswith("headroom: ") for line in lines) == 1  # decided once per size found


def test_no_spread_or_too_few_peaks_keep_the_size_found_and_a_zero_target_turns_it_off():
    trainer, lines = _search_at(64, 0.01, lambda size, world: np.full(world, FIXED + PER_SAMPLE * size))
    found = trainer.policy.found_size
    assert found == 30 and any(line.startswith(f"headroom: size {found} keeps") for line in lines)
    # One rank settles over 3 peaks: too few for a spread (a small job keeps the one-off rule), whatever they are.
    few, lines = _search_at(1, 0.01, _spread)
    assert few.policy.found_size == 30 and any(line.startswith("headroom: not measured (3 peak(s)") for line in lines)
    off, quiet = _search_at(4096, 0.0, _spread)
    assert not any(line.startswith("headroom: ") for line in quiet)
    assert off.policy.found_size == 30


def test_only_the_clean_batches_in_a_row_that_settled_the_size_are_measured():
    """A one-off OOM while settling restarts the count of clean batches: the peaks before it are not the
    settling batches' (CI, 2026-11-29: 4 ranks, memory held in reference cycles growing each batch; 2 batches
    before the OOM and 2 after made 16 peaks, and the growth read as a spread stepped the size down)."""
    lines: list[str] = []
    runtime = SimpleNamespace(settings=Settings.parse(rerun_target=0.01), info=lines.append, memory=None, rank=0)
    trainer = TrainingSearch(runtime.settings, runtime)
    trainer.policy = policy = search.SearchPolicy(search.PolicyConfig(), 30)
    world, held = 4, 0

    def clean(attempts: int = 1) -> None:
        nonlocal held
        trainer.batch_attempts = attempts
        phase_before, found = policy.phase, policy.found_size
        size = max(policy.current_split())
        rows = FIXED + PER_SAMPLE * size + held + np.arange(world)
        verdict = SimpleNamespace(reports=[SimpleNamespace(peak_bytes=int(p)) for p in rows], capacity_bytes=USABLE)
        decision = policy.observe(search.Success(size, peak_bytes=int(max(rows)), capacity_bytes=USABLE))
        trainer._headroom(phase_before, decision, verdict, found, False)
        held += 4 * GIB  # what each batch leaves in reference cycles

    clean()  # the whole batch (30) fits: found, settling
    assert policy.phase == search.Phase.SETTLING
    clean(), clean()  # clean batches 1 and 2 of 3
    decision = policy.observe(search.OOM(30, (2,), capacity_bytes=USABLE))  # the held memory ran out
    assert decision.rerun and policy.phase == search.Phase.SETTLING
    held = 0  # the wipe collected the cycles
    clean(attempts=2)  # the rerun: clean batch 1 of 3
    clean(), clean()  # 2 and 3: steady
    assert policy.phase == search.Phase.STEADY and policy.found_size == 30
    line = next(line for line in lines if line.startswith("headroom: "))
    assert line.startswith("headroom: not measured (8 peak(s)"), line
