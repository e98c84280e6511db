"""Token-budget packing (`automicro.core.token_packing`), as properties over any batch of lengths."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automicro.core.token_packing import (
    pack_packed_under_budget,
    pack_under_budget,
    packed_tokens,
    padded_tokens,
    split_into,
    split_packed_into,
)

lengths_st = st.lists(st.integers(0, 4096), min_size=1, max_size=64)


def _is_partition(runs, n):
    flat = [i for run in runs for i in run]
    return sorted(flat) == list(range(n)) and all(runs)


@settings(max_examples=400, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 40000))
def test_packing_under_a_budget_keeps_every_sample_once_and_every_run_of_two_or_more_within_it(lengths, budget):
    runs = pack_under_budget(lengths, budget)
    assert _is_partition(runs, len(lengths))
    for run in runs:
        assert len(run) == 1 or padded_tokens(lengths, run) <= budget
    # Longest first, so each run's padding is only what its own samples differ by.
    flat = [lengths[i] for run in runs for i in run]
    assert flat == sorted(flat, reverse=True)


@settings(max_examples=400, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 40000))
def test_packing_is_fewest_runs_for_sorted_cuts(lengths, budget):
    """No two neighbouring runs could be one run within the budget (the greedy is tight)."""
    runs = pack_under_budget(lengths, budget)
    for a, b in zip(runs, runs[1:]):
        assert padded_tokens(lengths, a + b) > budget


def test_a_rank_needing_fewer_microbatches_splits_further_evenly():
    lengths = [100] * 8
    assert sorted(len(r) for r in split_into(lengths, 3, cap=800)) == [2, 3, 3]
    assert [len(r) for r in split_into(lengths, 8, cap=800)] == [1] * 8


def test_long_and_short_samples_are_not_padded_together():
    lengths = [4000, 60, 70, 3900, 80, 65]
    runs = pack_under_budget(lengths, 8000)
    assert sorted(sorted(r) for r in runs) == [[0, 3], [1, 2, 4, 5]]
    assert padded_tokens(lengths, [1, 2, 4, 5]) == 4 * 80


@pytest.mark.parametrize("bad, message", [([], "no samples"), ([3, -1], "ints >= 0")])
def test_bad_lengths_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        pack_under_budget(bad, 10)


def test_bad_count_and_budget_are_refused():
    with pytest.raises(ValueError, match="count=4"):
        split_into([1, 2, 3], 4, cap=10)
    with pytest.raises(ValueError, match="budget=0"):
        pack_under_budget([1, 2, 3], 0)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), lengths=lengths_st, budget=st.integers(1, 40000))
def test_a_capped_split_keeps_the_cap_and_pads_no_more_than_the_budget_packing(data, lengths, budget):
    """What each rank runs: its batch in the agreed count (>= what it needs) under the budget."""
    own = pack_under_budget(lengths, budget)
    count = data.draw(st.integers(len(own), len(lengths)))
    runs = split_into(lengths, count, cap=budget)
    assert len(runs) == count and _is_partition(runs, len(lengths))
    assert all(len(run) == 1 or padded_tokens(lengths, run) <= budget for run in runs)
    total = sum(padded_tokens(lengths, run) for run in runs)
    assert total <= sum(padded_tokens(lengths, run) for run in own)


def test_a_capped_split_keeps_long_and_short_samples_apart():
    lengths = [4000, 3000, 2900, 2800, 300, 280, 260, 250, 240, 230]
    runs = split_into(lengths, 3, cap=12000)
    assert [sorted(lengths[i] for i in run) for run in runs] == [[4000], [2800, 2900, 3000], [230, 240, 250, 260, 280, 300]]


# ---- packed microbatches (packing: true): a microbatch costs its real tokens -----------------------


@settings(max_examples=400, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 40000))
def test_packed_microbatches_keep_every_sample_once_within_the_budget_and_no_two_would_fit_as_one(lengths, budget):
    runs = pack_packed_under_budget(lengths, budget)
    assert _is_partition(runs, len(lengths))
    for run in runs:
        assert len(run) == 1 or packed_tokens(lengths, run) <= budget
    # First fit: no two microbatches could be merged within the budget.
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            assert packed_tokens(lengths, a + b) > budget
    # Never more microbatches than the padded cut needs (padding only adds tokens).
    assert len(runs) <= len(pack_under_budget(lengths, budget))


@settings(max_examples=400, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 40000), extra=st.integers(0, 64))
def test_a_packed_split_into_exactly_count_stays_within_the_cap_and_is_even(lengths, budget, extra):
    own = len(pack_packed_under_budget(lengths, budget))
    count = min(len(lengths), own + extra)
    runs = split_packed_into(lengths, count, cap=budget)
    assert len(runs) == count and _is_partition(runs, len(lengths))
    for run in runs:
        assert len(run) == 1 or packed_tokens(lengths, run) <= budget
    # As even as the greedy: the largest microbatch is within one sample of the average, or a
    # single sample (which nothing can split), or the cap forced the fallback (still within it).
    loads = sorted((packed_tokens(lengths, run) for run in runs), reverse=True)
    largest_sample = max(lengths)
    assert loads[0] <= max(sum(lengths) / count + largest_sample, budget)


def test_a_packed_split_balances_what_a_padded_split_would_pad():
    """Lengths 100, 90, 10 x 9 in 2 microbatches: packed halves hold 140 real tokens each."""
    lengths = [100, 90] + [10] * 9
    runs = split_packed_into(lengths, 2, cap=1000)
    loads = sorted(packed_tokens(lengths, run) for run in runs)
    assert loads == [140, 140]
    assert sum(packed_tokens(lengths, run) for run in runs) == sum(lengths)


def test_packed_count_out_of_range_is_refused():
    with pytest.raises(ValueError, match="count=3"):
        split_packed_into([5, 5], 3, cap=10)
