"""Token-budget packing: which samples of a batch go into which microbatch (pure, no torch).

A microbatch's memory follows its tokens. For a batch padded to its longest sample (Hugging Face
padding collators), a microbatch re-padded to *its* longest sample costs
``len(microbatch) * longest`` tokens (`padded_tokens`). Sorting by length and cutting the sorted
order into runs keeps that padding small: each run holds samples of similar length.

- `pack_under_budget(lengths, budget)`: the fewest runs whose padded tokens stay within
  `budget` (a sample longer than the budget runs alone: the floor is one sample).
- `split_into(lengths, count, cap)`: exactly `count` runs, none above `cap`, with the fewest
  padded tokens in all and then the smallest largest run (a rank that needs fewer microbatches
  than the agreed count splits its batch further this way, so every rank runs the same number of
  microbatches). Padded tokens are computed whether or not they carry a token: fewer is faster.

Both return lists of sample indices into `lengths`, longest samples first; every index appears
exactly once.

Packed microbatches (`packing: true`: a microbatch is one row of its samples end to end, attention
kept within each sample) cost their real tokens (`packed_tokens`), whatever their lengths:

- `pack_packed_under_budget(lengths, budget)`: the fewest microbatches of at most `budget` real
  tokens (first fit, longest first; a sample longer than the budget runs alone).
- `split_packed_into(lengths, count, cap)`: exactly `count` microbatches, none above `cap` real
  tokens unless it is one sample, as even as the greedy gets them (longest first into the
  lightest): the largest microbatch sets the memory, and the ranks wait for it.

Owns: the packing arithmetic. May not touch: tensors, collectives, the policy.
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_tokens(lengths: Sequence[int], group: Sequence[int]) -> int:
    """Tokens of `group` re-padded to its own longest sample."""
    return len(group) * max((lengths[i] for i in group), default=0)


def _sorted_indices(lengths: Sequence[int]) -> list[int]:
    # Longest first; ties by index, so that every rank and every retry packs the same way.
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _greedy(lengths: Sequence[int], order: list[int], cap: int) -> list[list[int]]:
    runs: list[list[int]] = []
    for index in order:
        # `order` is longest first: a run's first sample is its longest.
        if runs and (len(runs[-1]) + 1) * lengths[runs[-1][0]] <= cap:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _check(lengths: Sequence[int]) -> None:
    if not lengths:
        raise ValueError("token packing: the batch has no samples")
    if any(not isinstance(n, int) or n < 0 for n in lengths):
        raise ValueError(f"token packing: lengths must be ints >= 0, got {list(lengths)[:8]}...")


def pack_under_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The fewest length-sorted runs with at most `budget` padded tokens each (runs of one sample
    may exceed it: a sample is never cut)."""
    _check(lengths)
    if budget < 1:
        raise ValueError(f"token packing: budget={budget}: must be >= 1")
    return _greedy(lengths, _sorted_indices(lengths), budget)


def split_into(lengths: Sequence[int], count: int, cap: int) -> list[list[int]]:
    """Exactly `count` length-sorted runs (1 <= count <= samples) with the fewest padded tokens in
    all, no run above `cap` padded tokens unless it is one sample (a sample is never cut), and,
    among splits as good, the smallest largest run. `count` must be at least what
    `pack_under_budget(lengths, cap)` needs."""
    _check(lengths)
    if not 1 <= count <= len(lengths):
        raise ValueError(f"token packing: count={count}: must be in 1..{len(lengths)} (the samples of the batch)")
    order = _sorted_indices(lengths)
    if count == len(order):
        return [[i] for i in order]
    if len(order) > DP_LIMIT:
        return _halve_to(lengths, _greedy(lengths, order, cap), count)
    return _fewest_padded(lengths, order, count, cap)


DP_LIMIT = 128  # samples per batch up to which the split is exact (O(count x samples^2) steps)


def _fewest_padded(lengths: Sequence[int], order: list[int], count: int, cap: int) -> list[list[int]]:
    """Cut the sorted order into `count` runs: fewest padded tokens in all, then the smallest
    largest run (dynamic programming over cut points; a run's cost is its size x its first length)."""
    n = len(order)
    sorted_lengths = [lengths[i] for i in order]
    inf = (float("inf"), float("inf"))
    # best[k][j]: (padded total, largest run) of the first j samples in k runs; cut[k][j]: where run k starts.
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = (0, 0)
    for k in range(1, count + 1):
        for j in range(k, n - (count - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                run = (j - i) * sorted_lengths[i]
                if run > cap and j - i > 1:
                    continue
                total, largest = best[k - 1][i]
                candidate = (total + run, max(largest, run))
                if candidate < best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    if best[count][n] == inf:  # cannot happen when the greedy under `cap` needs <= count runs
        return _halve_to(lengths, _greedy(lengths, order, cap), count)
    runs, j = [], n
    for k in range(count, 0, -1):
        i = cut[k][j]
        runs.append(order[i:j])
        j = i
    return runs[::-1]


def _halve_to(lengths: Sequence[int], runs: list[list[int]], count: int) -> list[list[int]]:
    """Halve the costliest runs until there are `count` (for very large batches)."""
    runs = [list(r) for r in runs]
    while len(runs) < count:
        at = max(
            (i for i in range(len(runs)) if len(runs[i]) > 1),
            key=lambda i: (padded_tokens(lengths, runs[i]), -i),
        )
        run = runs[at]
        half = (len(run) + 1) // 2
        runs[at : at + 1] = [run[:half], run[half:]]
    return runs


# ---- packed microbatches: the cost is the real tokens -------------------------------------------


def packed_tokens(lengths: Sequence[int], group: Sequence[int]) -> int:
    """Tokens of `group` packed end to end in one row (no padding)."""
    return sum(lengths[i] for i in group)


def _first_fit(lengths: Sequence[int], order: list[int], cap: int) -> list[list[int]]:
    runs: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        n = lengths[index]
        at = next((k for k, load in enumerate(loads) if load + n <= cap), None)
        if at is None:
            runs.append([index])
            loads.append(n)
        else:
            runs[at].append(index)
            loads[at] += n
    return runs


def pack_packed_under_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The fewest packed microbatches of at most `budget` real tokens each (first fit, longest
    first; a sample longer than the budget runs alone: a sample is never cut)."""
    _check(lengths)
    if budget < 1:
        raise ValueError(f"token packing: budget={budget}: must be >= 1")
    return _first_fit(lengths, _sorted_indices(lengths), budget)


def split_packed_into(lengths: Sequence[int], count: int, cap: int) -> list[list[int]]:
    """Exactly `count` packed microbatches (1 <= count <= samples), none above `cap` real tokens
    unless it is one sample, as even as the greedy gets them. `count` must be at least what
    `pack_packed_under_budget(lengths, cap)` needs."""
    _check(lengths)
    if not 1 <= count <= len(lengths):
        raise ValueError(f"token packing: count={count}: must be in 1..{len(lengths)} (the samples of the batch)")
    order = _sorted_indices(lengths)
    # Longest first into the lightest microbatch (ties: the first); an empty one first, so that none
    # stays empty (samples of length 0 included).
    runs: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for index in order:
        at = min(range(count), key=lambda k: (bool(runs[k]), loads[k], k))
        runs[at].append(index)
        loads[at] += lengths[index]
    if all(load <= cap or len(run) == 1 for run, load in zip(runs, loads)):
        return runs
    # The even cut overflows where first fit does not: first fit under the cap, then the fullest
    # microbatch halved (alternate samples: both halves as even) until there are `count`.
    runs = _first_fit(lengths, order, cap)
    while len(runs) < count:
        at = max((k for k in range(len(runs)) if len(runs[k]) > 1), key=lambda k: (packed_tokens(lengths, runs[k]), -k))
        run = runs[at]
        runs[at : at + 1] = [run[0::2], run[1::2]]
    return runs


__all__ = [
    "pack_packed_under_budget", "pack_under_budget", "packed_tokens", "padded_tokens", "split_into", "split_packed_into",
]
