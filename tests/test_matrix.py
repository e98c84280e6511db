"""The sampled fault matrices (tests/matrix.py): every row in every run, the draw repeatable."""

from __future__ import annotations

import pytest

from tests import matrix

CELLS = [(site, who, where) for site in ("forward", "backward", "loss") for who in ("one", "every") for where in ("first", "last")]


@pytest.fixture(autouse=True)
def own_record(monkeypatch):
    monkeypatch.setattr(matrix, "DRAWN", {})  # the suite's own summary line stays the suite's


def test_a_draw_covers_every_row_and_repeats_with_its_seed(monkeypatch):
    monkeypatch.delenv(matrix.FULL_ENV, raising=False)
    monkeypatch.setenv(matrix.SEED_ENV, "5")
    first = matrix.sample("test", CELLS)
    assert first == matrix.sample("test", CELLS), "the same seed, the same cells"
    assert sorted(c[0] for c in first) == ["backward", "forward", "loss"], first
    assert [c for c in CELLS if c in first] == first, "in the matrix's own order"
    two = matrix.sample("test", CELLS, per_key=2)
    assert len(two) == 6 and all(sum(c[0] == s for c in two) == 2 for s in ("forward", "backward", "loss"))
    kept = matrix.sample("test", CELLS, always=lambda c: c == ("loss", "every", "last"))
    assert ("loss", "every", "last") in kept and len(kept) == 3, "a cell kept always counts toward its row"
    draws = set()
    for seed in range(20):
        monkeypatch.setenv(matrix.SEED_ENV, str(seed))
        draws.add(tuple(matrix.sample("test", CELLS)))
    assert len(draws) > 5, "other seeds draw other cells"
    assert "seed 19" in matrix.summary() and "test 3/12" in matrix.summary()


def test_full_runs_every_cell_and_bad_input_says_what_to_change(monkeypatch):
    monkeypatch.setenv(matrix.FULL_ENV, "1")
    assert matrix.sample("test", CELLS) == CELLS
    monkeypatch.delenv(matrix.FULL_ENV)
    monkeypatch.setenv(matrix.SEED_ENV, "abc")
    with pytest.raises(ValueError, match="AUTOMICRO_TEST_SEED='abc': must be an int"):
        matrix.seed()
    monkeypatch.setenv(matrix.SEED_ENV, "1")
    with pytest.raises(ValueError, match="a cell appears twice"):
        matrix.sample("test", CELLS + CELLS[:1])


def test_version_shares_are_complementary_deal_one_launch_files_whole_and_repeat_with_the_seed(monkeypatch):
    monkeypatch.delenv(matrix.FULL_ENV, raising=False)
    monkeypatch.setenv(matrix.SEED_ENV, "3")
    singles = [(f"s{i}.py", "test one") for i in range(6)]
    groups = [("a.py", f"fixture {i}") for i in range(5)] + singles + [("c.py", "x"), ("c.py", "y")]
    first, second = matrix.shares("launches", groups, 1, 2), matrix.shares("launches", groups, 2, 2)
    assert first | second == set(groups), "the two legs together run every launch"
    assert not first & second, "no launch runs twice, a file with one launch neither"
    assert {f for f, _ in first} >= {"a.py", "c.py"} <= {f for f, _ in second}, "a file with launches to deal: on each leg"
    assert sorted(len(set(singles) & share) for share in (first, second)) == [3, 3], "one-launch files dealt evenly"
    assert sorted(len([g for g in share if g[0] == "a.py"]) for share in (first, second)) == [2, 3], "dealt evenly"
    assert matrix.shares("launches", groups, 1, 2) == first, "the same seed, the same shares"
    deals = set()
    for seed in range(12):
        monkeypatch.setenv(matrix.SEED_ENV, str(seed))
        deals.add(frozenset(matrix.shares("launches", groups, 1, 2)))
    assert len(deals) > 3, "other seeds deal otherwise"
    assert "launches 1/2" in matrix.summary()
    monkeypatch.setenv(matrix.FULL_ENV, "1")
    assert matrix.shares("launches", groups, 2, 2) == set(groups)


@pytest.mark.parametrize("text", ["", "2", "0/2", "3/2", "a/b"])
def test_a_bad_versions_share_says_what_to_write(text):
    with pytest.raises(ValueError, match="expected K/N with 1 <= K <= N"):
        matrix.parse_share(text)
    assert matrix.parse_share(" 2 / 2 ") == (2, 2)
