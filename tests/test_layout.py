"""The layout search (`automicro.core.layout`): once the size settles, `auto` tries trading memory
for speed (gradients reduced once per batch, no resharding after forward, activation checkpointing
off), keeps a trade only when
interleaved batch times show it faster, undoes trades before it shrinks the microbatch, and keeps
the layout in checkpoints. The rule on its own here; on 1, 2 and 4 CPU ranks in `layout_cases`."""

from __future__ import annotations

import pytest

from automicro.core.layout import (
    FUSED_HEAD, GRAD_SYNC_ONCE, NO_RECOMPUTE, NO_RESHARD, RECOMPUTE, RECOMPUTE_OP, TRADES, LayoutConfig, LayoutConfigError, LayoutSearch,
    MeasuredLine,
    judge,
)
from automicro.testing.multiprocess import run_multiprocess
from tests import layout_cases as cases

# ---- the rule ----------------------------------------------------------------------------------


def test_a_trade_is_kept_only_when_its_gain_beats_both_the_minimum_and_the_spread():
    assert judge(GRAD_SYNC_ONCE, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 0.01).kept
    assert not judge(GRAD_SYNC_ONCE, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 0.01).kept  # slower
    assert not judge(GRAD_SYNC_ONCE, [1.995, 1.995], [2.0, 2.0], 0.01).kept  # 0.25% < min_gain
    # 10% faster by the medians, but each arm spreads by 0.3 s: noise, not a gain.
    assert not judge(GRAD_SYNC_ONCE, [1.5, 1.8, 2.1], [1.7, 2.0, 2.3], 0.01).kept
    assert judge(GRAD_SYNC_ONCE, [1.79, 1.8, 1.81], [1.99, 2.0, 2.01], 0.01).kept


def _run_trial(search: LayoutSearch, on: float, off: float) -> None:
    """Batches until the trial needs its agreement (one rank: the local times are the agreed ones)."""
    while not search.needs_agreement:
        layout, _ = search.layout_for_batch(True, lambda trade: None)
        search.observe(layout, on if search.trial.trade in layout else off)
    search.decide(search.local_times())


def test_trials_alternate_with_and_without_the_trade_and_run_one_trade_at_a_time():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=2), [GRAD_SYNC_ONCE, NO_RESHARD])
    assert search.layout_for_batch(False, lambda t: None)[0] == ()  # not steady: no trial
    seen = []
    for _ in range(4):
        layout, _ = search.layout_for_batch(True, lambda t: None)
        seen.append(layout)
        search.observe(layout, 1.0 if GRAD_SYNC_ONCE in layout else 2.0)
    assert seen == [(GRAD_SYNC_ONCE,), (), (GRAD_SYNC_ONCE,), ()]
    assert search.needs_agreement
    assert search.decide(search.local_times()).kept
    # The next trial runs on top of what was kept.
    layout, line = search.layout_for_batch(True, lambda t: None)
    assert layout == (GRAD_SYNC_ONCE, NO_RESHARD) and len(line) == 1 and "no_reshard" in line[0]
    search.observe(layout, 3.0)
    assert search.layout_for_batch(True, lambda t: None)[0] == (GRAD_SYNC_ONCE,)


def test_a_trade_whose_projection_does_not_fit_is_passed_over_without_a_trial():
    search = LayoutSearch(LayoutConfig.parse("auto"), [GRAD_SYNC_ONCE, NO_RESHARD])
    layout, lines = search.layout_for_batch(True, lambda t: "no room" if t == GRAD_SYNC_ONCE else None)
    assert layout == (NO_RESHARD,) and search.rejected == {GRAD_SYNC_ONCE: "no room"}
    # Both are said: the trade passed over and the trial that starts.
    assert [line.split(" (")[0] for line in lines] == ["layout trade grad_sync_once", "layout trial no_reshard"]
    assert lines[0].endswith("not tried: no room")


def test_pressure_undoes_the_trade_on_trial_then_the_last_kept_then_leaves_it_to_the_size():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    _run_trial(search, 1.0, 2.0)
    assert search.settled == (GRAD_SYNC_ONCE,)
    layout, _ = search.layout_for_batch(True, lambda t: None)  # no_reshard on trial, on in this batch
    assert search.relieve(layout, "oom") == NO_RESHARD
    assert search.settled == (GRAD_SYNC_ONCE,)
    assert search.relieve((GRAD_SYNC_ONCE,), "oom") == GRAD_SYNC_ONCE
    assert search.relieve((), "oom") is None
    # Nothing undone is tried again.
    assert search.layout_for_batch(True, lambda t: None) == ((), [])


def test_a_kept_trade_whose_batches_peaked_lower_than_those_without_it_is_not_undone_under_pressure():
    """One H100, Qwen3-MoE's blocks on one rank: grad_sync_once's batches peaked at 72.8 GiB against 77.2 without it
    (bf16 gradients held unsharded, against fp32 ones reduced every microbatch); undone for a thrash, the size ran out
    at 6 and at 4. A trade that saves memory stays; one that costs it goes first, as before."""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    peaks = {GRAD_SYNC_ONCE: -4 * 2**30, NO_RESHARD: 2 * 2**30}
    for _ in range(2):
        while not search.needs_agreement:
            layout, _ = search.layout_for_batch(True, lambda trade: None)
            trade = search.trial.trade
            search.observe(layout, 1.0 if trade in layout else 2.0, 77 * 2**30 + (peaks[trade] if trade in layout else 0))
        assert search.decide(search.local_times()).kept
    assert search.settled == (GRAD_SYNC_ONCE, NO_RESHARD)
    assert search.saves == {GRAD_SYNC_ONCE: (73 * 2**30, 77 * 2**30)}
    assert search.relieve(search.settled, "thrashing at size 6", 6) == NO_RESHARD
    assert search.relieve(search.settled, "thrashing at size 6", 6) is None  # the size policy acts
    assert search.settled == (GRAD_SYNC_ONCE,)
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    restored.load_state_dict(search.state_dict())
    assert restored.saves == search.saves and restored.relieve(restored.settled, "oom", 6) is None
    # Every batch with it must peak below every batch without it: one batch without it as low (a routed model's
    # peaks move with its routing) leaves it undoable; so does a batch whose peak was not told.
    for lowest_off, told in ((73 * 2**30, True), (78 * 2**30, False)):
        overlap = LayoutSearch(LayoutConfig.parse("auto", trial_batches=2), [GRAD_SYNC_ONCE])
        while not overlap.needs_agreement:
            layout, _ = overlap.layout_for_batch(True, lambda trade: None)
            on = GRAD_SYNC_ONCE in layout
            off_peak = lowest_off if len(overlap.trial.off) == 0 else 77 * 2**30
            overlap.observe(layout, 1.0 if on else 2.0, (73 * 2**30 if on else off_peak) if told or on else 0)
        assert overlap.decide(overlap.local_times()).kept and overlap.saves == {}
        assert overlap.relieve(overlap.settled, "oom", 6) == GRAD_SYNC_ONCE
    # Without peaks told (0), nothing is known to save memory: undone as before.
    plain = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE])
    _run_trial(plain, 1.0, 2.0)
    assert plain.saves == {} and plain.relieve(plain.settled, "oom", 6) == GRAD_SYNC_ONCE


def test_pressure_in_a_trial_batch_without_the_trade_ends_the_trial_and_undoes_a_kept_one():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    _run_trial(search, 1.0, 2.0)
    search.layout_for_batch(True, lambda t: None)
    search.observe((GRAD_SYNC_ONCE, NO_RESHARD), 1.0)
    layout, _ = search.layout_for_batch(True, lambda t: None)  # the trial's "without" arm
    assert layout == (GRAD_SYNC_ONCE,)
    assert search.relieve(layout, "oom") == GRAD_SYNC_ONCE
    assert search.trial is None and NO_RESHARD in search.rejected


def test_a_trade_that_did_not_fit_is_tried_again_only_once_the_microbatch_is_smaller():
    """Pressure at size 11 (the trade on trial) and a projection that did not fit at 11: both come
    back once the size policy settles on microbatches of 8, neither at 11 again; a trade that was
    slower never comes back; the sizes survive a checkpoint."""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), list(TRADES))
    layout, _ = search.layout_for_batch(True, lambda t: None, 11)
    assert layout == (GRAD_SYNC_ONCE,)
    assert search.relieve(layout, "thrashing at size 11", 11) == GRAD_SYNC_ONCE
    # Next steady batch at 11: no_reshard is projected not to fit, no_recompute is tried.
    no_room = {NO_RESHARD: "no room"}
    layout, lines = search.layout_for_batch(True, lambda t: no_room.get(t), 11)
    assert layout == (NO_RECOMPUTE,) and search.rejected[NO_RESHARD] == "no room"
    assert [line.split(" (")[0] for line in lines] == ["layout trade no_reshard", "layout trial no_recompute"]
    search.observe(layout, 3.0)
    layout, _ = search.layout_for_batch(True, lambda t: None, 11)
    search.observe(layout, 2.0)
    assert not search.decide(search.local_times()).kept  # slower
    assert search.layout_for_batch(True, lambda t: None, 11) == ((), [])
    assert search.too_big_at == {GRAD_SYNC_ONCE: 11, NO_RESHARD: 11}

    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), list(TRADES))
    restored.load_state_dict(search.state_dict())
    assert restored.too_big_at == search.too_big_at and restored.layout_for_batch(True, lambda t: None, 11) == ((), [])
    for s in (search, restored):
        layout, lines = s.layout_for_batch(True, lambda t: None, 8)
        assert layout == (GRAD_SYNC_ONCE,), lines
        assert [line.split(" (")[0] for line in lines] == [
            "layout trade grad_sync_once", "layout trade no_reshard", "layout trial grad_sync_once",
        ]
        assert lines[0].endswith("may be tried again: the microbatch is now 8, smaller than 11 where it did not fit")
        assert s.too_big_at == {} and NO_RECOMPUTE not in s._untried()


def test_a_slower_trade_is_tried_again_only_on_top_of_a_different_layout():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    _run_trial(search, 2.0, 1.0)  # grad_sync_once slower on the engine's own layout
    _run_trial(search, 1.0, 2.0)  # no_reshard faster: kept
    assert search.settled == (NO_RESHARD,) and search.trial is None
    layout, lines = search.layout_for_batch(True, lambda t: None)
    assert layout == (GRAD_SYNC_ONCE, NO_RESHARD) and lines[0].startswith("layout trial grad_sync_once")
    search.observe(layout, 1.5)
    layout, _ = search.layout_for_batch(True, lambda t: None)
    search.observe(layout, 1.0)
    assert not search.decide(search.local_times()).kept
    assert search.layout_for_batch(True, lambda t: None) == ((NO_RESHARD,), [])
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    restored.load_state_dict(search.state_dict())
    assert restored.slower_on == {GRAD_SYNC_ONCE: [(), (NO_RESHARD,)]}
    assert restored.layout_for_batch(True, lambda t: None) == ((NO_RESHARD,), [])
    # Undone under pressure, the layout under it is the one it was slower on: not tried again.
    assert search.relieve((NO_RESHARD,), "oom", 4) == NO_RESHARD
    assert search.layout_for_batch(True, lambda t: None, 4) == ((), [])


def test_a_kept_trade_undone_under_pressure_comes_back_at_a_smaller_size_and_the_count_is_bounded():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE])
    trials = []
    for size in [6, 6, 5, 5, 3, 3, 3]:  # pressure after every kept trial: the size policy shrinks
        layout, lines = search.layout_for_batch(True, lambda t: None, size)
        if search.trial is not None:
            trials.append(size)
            _run_trial(search, 1.0, 2.0)
            assert search.settled == (GRAD_SYNC_ONCE,)
            assert search.relieve(search.settled, "oom", size) == GRAD_SYNC_ONCE
        else:
            assert layout == () and lines == []
    assert trials == [6, 5, 3]  # once at each size


def test_fixed_and_pinned_layouts_never_search_and_a_checkpoint_does_not_override_them():
    import automicro

    # The default searches on CUDA devices only; on CPU it is the engine's own layout. `auto` given
    # explicitly searches anywhere.
    default = automicro.AutoMicrobatching().layout_config
    assert default == LayoutConfig.parse(None)
    assert default.resolve("cuda").mode == "auto" and default.resolve("cpu").mode == "fixed"
    assert LayoutConfig.parse("auto").resolve("cpu").mode == "auto"
    assert LayoutConfig.parse("fixed").resolve("cuda").mode == "fixed"
    fixed = LayoutSearch(LayoutConfig.parse("fixed"), [GRAD_SYNC_ONCE, NO_RESHARD])
    assert fixed.layout_for_batch(True, lambda t: None) == ((), [])
    pinned = LayoutSearch(LayoutConfig.parse([NO_RESHARD]), [GRAD_SYNC_ONCE, NO_RESHARD])
    pinned.load_state_dict({"kept": [GRAD_SYNC_ONCE]})
    assert pinned.layout_for_batch(True, lambda t: None) == ((NO_RESHARD,), [])
    assert pinned.relieve((NO_RESHARD,), "oom") is None  # a pinned trade is the user's: the size gives


def test_a_checkpoint_restores_the_kept_layout_and_what_was_tried():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    _run_trial(search, 1.0, 2.0)
    _run_trial(search, 3.0, 1.0)
    restored = LayoutSearch(LayoutConfig.parse("auto"), [GRAD_SYNC_ONCE, NO_RESHARD])
    restored.load_state_dict(search.state_dict())
    assert restored.settled == (GRAD_SYNC_ONCE,)
    assert restored.layout_for_batch(True, lambda t: None) == ((GRAD_SYNC_ONCE,), [])


@pytest.mark.parametrize(
    "value, kwargs, message",
    [
        ("fast", {}, "must be 'auto'"),
        (["grad_sync"], {}, "unknown trade(s) ['grad_sync']"),
        (3, {}, "must be 'auto', 'fixed' or a list"),
        ("auto", {"trial_batches": 0}, "layout_trial_batches=0"),
        ("auto", {"min_gain": 1.5}, "layout_min_gain=1.5"),
    ],
)
def test_a_bad_layout_value_names_what_is_allowed(value, kwargs, message):
    with pytest.raises(LayoutConfigError) as error:
        LayoutConfig.parse(value, **kwargs)
    assert message in str(error.value)


def test_a_pinned_trade_a_model_cannot_take_is_refused_at_set_up_naming_the_fix():
    import torch

    from automicro.engine.unsharded import UnshardedModel
    from automicro.batch.layout_trials import LayoutTrials

    unsharded = UnshardedModel(module=torch.nn.Linear(2, 2), device=torch.device("cpu"))
    with pytest.raises(ValueError) as error:
        LayoutTrials(LayoutConfig.parse([GRAD_SYNC_ONCE]), unsharded, None, print, recoverable=True, pipeline=False)
    assert "a model without FSDP2" in str(error.value) and "layout: fixed" in str(error.value)
    # Without a pinned trade, a model without FSDP2 simply has no layout to search.
    trials = LayoutTrials(LayoutConfig.parse("auto"), unsharded, None, print, recoverable=True, pipeline=False)
    assert trials.engine is None and trials.search.candidates == [] and trials.metrics() == {}


def test_the_yaml_key_reaches_the_callback_and_a_bad_value_is_a_config_error(tmp_path):
    from automicro.config import ConfigError, load_config
    from automicro.composer.builders import build_callbacks

    good = tmp_path / "good.yaml"
    good.write_text("callbacks:\n  auto_microbatching:\n    layout: [grad_sync_once]\n")
    [callback] = [c for c in build_callbacks(load_config(str(good))) if type(c).__name__ == "AutoMicrobatching"]
    assert callback.layout_config.pinned == (GRAD_SYNC_ONCE,)
    bad = tmp_path / "bad.yaml"
    bad.write_text("callbacks:\n  auto_microbatching:\n    layout: quick\n")
    with pytest.raises((ConfigError, ValueError)) as error:
        build_callbacks(load_config(str(bad)))
    assert "layout='quick'" in str(error.value)


# ---- on CPU ranks ----------------------------------------------------------------------------------


_RUNS: dict[int, list] = {}


def _suite(world: int) -> list:
    """`cases.suite` on `world` ranks, once per module run (a module-scoped fixture by hand: the
    tests below take different rank counts from it)."""
    if world not in _RUNS:
        _RUNS[world] = run_multiprocess(cases.suite, world_size=world, timeout_s=900)
    return _RUNS[world]


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2])
def test_the_faster_trade_is_kept_the_slower_not_and_parameters_equal_a_fixed_run(world):
    results = _suite(world)
    for rank in range(world):
        auto = results[rank]["trades"]
        assert auto["found"] == 2, auto["history"]
        assert auto["results"] == [[GRAD_SYNC_ONCE, True], [NO_RESHARD, False]], auto
        assert auto["settled"] == [GRAD_SYNC_ONCE] and auto["state"]["kept"] == [GRAD_SYNC_ONCE]
        # Interleaved, after the size settled: with, without, then the next trade on top of the kept one.
        steady = next(r[0] for r in auto["history"] if "sync hooks off" in r[3])
        trials = auto["layouts"][steady + 1 : steady + 5]
        assert trials == [[GRAD_SYNC_ONCE], [], [GRAD_SYNC_ONCE, NO_RESHARD], [GRAD_SYNC_ONCE]], auto["layouts"]
        assert all(layout == [] for layout in auto["layouts"][: steady + 1])
        assert auto["layouts"][-1] == [GRAD_SYNC_ONCE]
        assert "layout: gradients reduced once per batch" in auto["summary"]
        assert auto["diff"] < 1e-5, auto["diff"]
    assert len({str(results[r]["trades"]["layouts"]) for r in range(world)}) == 1  # the same on every rank


@pytest.mark.multiproc
def test_retries_in_trials_and_the_batch_after_them_are_no_thrash():
    """Mixtral's blocks on one H100 (benchmarks/RESULTS.md 2026-12-07, the thrash in a trial): no_reshard's last
    batch retried the allocator and so did the plain batch after the trial ended; the streak counted both as a thrash
    at the settled size and shrank it 6 -> 4 (-7% a batch). Retries in every trial batch (4-7) and the one after: the
    trials' retries are theirs to time, the streak starts again after each; grad_sync_once is kept as timed and
    stays, no_reshard is not, and the cache is emptied once more after its trial (the pool holds its shapes)."""
    results = _suite(2)
    for rank in range(2):
        auto, plain = results[rank]["dropped_retries"], results[rank]["trades"]
        assert auto["layouts"][4:9] == [[GRAD_SYNC_ONCE], [], [GRAD_SYNC_ONCE, NO_RESHARD], [GRAD_SYNC_ONCE], [GRAD_SYNC_ONCE]], auto
        assert auto["results"] == [[GRAD_SYNC_ONCE, True], [NO_RESHARD, False]], auto
        assert [r for r in auto["history"] if r[2] == "thrash"] == [], auto["history"]
        assert auto["settled"] == [GRAD_SYNC_ONCE] and auto["found"] == 2 and auto["splits"] == plain["splits"], auto
        # The cache emptied after each OOM of the search and once after no_reshard's trial (not kept: the pool holds
        # its shapes), here as in the same run without retries.
        ooms = sum(r[2] == "oom" for r in auto["history"])
        assert auto["emptied"] == plain["emptied"] == ooms + 1, (auto["emptied"], plain["emptied"], auto["history"])
        assert auto["diff"] < 1e-5


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2])
def test_a_smaller_microbatch_timed_faster_is_kept_and_parameters_equal_a_fixed_run(world):
    """Size trials on 1 and 2 ranks: the whole batch (4) fits, in one microbatch (gradients reduced once is not
    tried: they are already); once the other trade is tried, 2 (split 2, 2) is timed against 4, faster, kept: the
    size policy settles on 2. At 2 (two microbatches) gradients reduced once is tried, then 1 is timed, slower, not
    kept. Interleaved with the size found; the same on every rank; parameters equal a fixed run at 2."""
    results = _suite(world)
    for rank in range(world):
        sized = results[rank]["sized"]
        assert sized["results"] == [
            [NO_RESHARD, False], ["smaller_microbatch", True], [GRAD_SYNC_ONCE, False], ["smaller_microbatch", False]
        ], sized["trial_lines"]
        steady = next(r[0] for r in sized["history"] if "sync hooks off" in r[3])
        assert sized["splits"][steady + 3 : steady + 5] == [[2, 2], [4]], sized["splits"]
        assert sized["splits"][steady + 7 : steady + 9] == [[1, 1, 1, 1], [2, 2]], sized["splits"]
        assert all(s == [2, 2] for s in sized["splits"][steady + 8 :]) and sized["found"] == 2, sized["splits"]
        assert sized["trial_lines"][1].startswith("size trial: microbatch 2 against 4, the size found: kept"), sized["trial_lines"]
        assert "OOMs 0" in sized["summary"] and sized["diff"] < 1e-5, (sized["summary"], sized["diff"])
    assert len({str(results[r]["sized"]["splits"]) for r in range(world)}) == 1


@pytest.mark.multiproc
def test_priced_trials_run_where_they_pay_the_same_on_every_rank_and_the_configuration_is_final_by_batch_25():
    """2 ranks, a run of 1,000 batches stopped after 30 (the machine's own times and profile): the trades are priced
    from a profiled batch; the size trials' estimate (two more microbatches each, no allocator retries) rules them
    out; every rank takes the same decisions; final by batch 25 with the price line; the numbers of the same run with
    `trials: false`."""
    world, results = 2, _suite(2)
    priced = [results[rank]["priced"] for rank in range(world)]
    for run in priced:
        lines = run["plan_lines"]
        assert any(line.startswith("a batch profiled: ") for line in lines), lines
        assert any(line.startswith("size trials below microbatch 2 not run: expected -") for line in lines), lines
        assert not any(line.startswith("size trial: microbatch") for line in lines), lines
        assert run["final_at"] is not None and run["final_at"] <= 25, lines
        assert run["price"].startswith(f"trials: the configuration was final at batch {run['final_at']}; the trials cost "), lines
        assert "% of this run's 1,000 batches" in run["price"] and run["batches"] == cases.PRICED_BATCHES
        assert run["diff"] < 1e-5, run["diff"]
    # Every decision was agreed: the same trials, layouts and splits on both ranks.
    assert priced[0]["results"] == priced[1]["results"] and priced[0]["layouts"] == priced[1]["layouts"]
    assert [r["splits"] for r in priced] == [priced[0]["splits"]] * world
    assert priced[0]["final_at"] == priced[1]["final_at"]


@pytest.mark.multiproc
def test_trials_false_runs_the_search_and_nothing_else():
    world, results = 2, _suite(2)
    for rank in range(world):
        run = results[rank]["no_trials"]
        assert run["results"] == [] and all(layout == [] for layout in run["layouts"]), run
        assert run["found"] == 2 and run["price"] is None and run["diff"] < 1e-5, run
        assert not any(line.startswith(("a batch profiled", "layout trial", "size trial")) for line in run["plan_lines"])


@pytest.mark.multiproc
def test_a_pinned_layout_runs_from_the_first_batch_and_parameters_equal_a_fixed_run():
    world, results = 2, _suite(2)
    for rank in range(world):
        pinned = results[rank]["pinned"]
        assert pinned["found"] == 2 and pinned["results"] == []
        assert all(layout == [GRAD_SYNC_ONCE, NO_RESHARD] for layout in pinned["layouts"]), pinned["layouts"]
        assert pinned["diff"] < 1e-5


@pytest.mark.multiproc
def test_an_oom_at_the_settled_size_undoes_the_last_trade_and_the_size_stays():
    world, results = 2, _suite(2)
    for rank in range(world):
        auto = results[rank]["pressure"]
        assert auto["found"] == 2
        assert [r[3] for r in auto["history"] if r[2] == "oom" and r[1] == 2] == [
            "layout undone first; rerun at the same size, now gradients reduced once per batch"
        ], auto["history"]
        assert auto["settled"] == [GRAD_SYNC_ONCE] and NO_RESHARD in auto["rejected"]
        assert all(r[1] == 2 for r in auto["history"] if r[0] >= 2), auto["history"]  # never shrank
        assert auto["diff"] < 1e-5


@pytest.mark.multiproc
def test_thrashing_at_the_settled_size_undoes_each_kept_trade_before_the_size_shrinks():
    """Qwen3-MoE's blocks on one H100 (benchmarks/RESULTS.md 2026-12-06, the fused head on Qwen3-MoE): a thrash undid
    grad_sync_once and began the settling; the next thrash in it shrank the size 3 -> 2 (-18% a batch) with no_reshard
    (+8.7%) still kept."""
    world, results = 2, _suite(2)
    for rank in range(world):
        auto = results[rank]["thrash_pressure"]
        assert auto["found"] == 2, auto["history"]
        thrash = [r for r in auto["history"] if r[2] == "thrash"]
        assert [(r[1], r[3]) for r in thrash] == [
            (2, "layout now gradients reduced once per batch"), (2, "layout now default"),
        ], auto["history"]
        assert auto["settled"] == [] and set(auto["rejected"]) == {GRAD_SYNC_ONCE, NO_RESHARD}, auto
        assert all(r[1] == 2 for r in auto["history"] if r[0] >= 2), auto["history"]  # never shrank
        assert auto["layouts"][-2:] == [[], []] and all(max(split) == 2 for split in auto["splits"][2:]), auto
        assert auto["diff"] < 1e-5
        # Each trade undone for thrashing leaves its shapes in the allocator's pool: the cache is emptied, as for an OOM
        # (on Qwen3-MoE's blocks on one H100 the batches after grad_sync_once's undo retried on, and undid no_reshard).
        ooms = sum(r[2] == "oom" for r in auto["history"])
        assert auto["emptied"] == ooms + len(thrash), (auto["emptied"], auto["history"])


@pytest.mark.multiproc
def test_trades_whose_bytes_do_not_fit_are_not_tried():
    world, results = 2, _suite(2)
    for rank in range(world):
        auto = results[rank]["no_room"]
        assert auto["found"] == 2 and auto["results"] == [] and auto["settled"] == []
        assert set(auto["rejected"]) == {GRAD_SYNC_ONCE, NO_RESHARD} and "needs" in auto["rejected"][NO_RESHARD]
        assert all(layout == [] for layout in auto["layouts"]) and len(auto["layouts"]) == 5


@pytest.mark.multiproc
@pytest.mark.many_ranks
def test_activation_checkpointing_off_is_kept_when_faster_on_four_ranks():
    """``no_recompute`` on 4 ranks (the module's 4-rank run): tried last, kept when timed faster, the
    same layouts on every rank; parameters equal a fixed run with checkpointing."""
    results = _suite(4)
    for rank in range(4):
        kept = results[rank]["recompute_kept"]
        assert kept["found"] == 4 and kept["diff"] < 1e-5, (kept["history"], kept["diff"])
        # The whole batch in one microbatch: gradients reduced once is not tried (they are already).
        assert kept["results"] == [[NO_RESHARD, False], [NO_RECOMPUTE, True], [NO_RESHARD, False]], kept
        assert kept["settled"] == [NO_RECOMPUTE] and kept["layouts"][-1] == [NO_RECOMPUTE]
    assert len({str(results[r]["recompute_kept"]["layouts"]) for r in range(4)}) == 1


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.many_ranks)])
def test_checkpointing_on_is_measured_then_kept_at_the_larger_microbatch_it_admits_when_faster(world):
    """``recompute`` on 1, 2 and 4 ranks, the user not asking for checkpointing: under a cap where 2
    fits without it and 3 does not, ``grad_sync_once`` (timed faster) is kept at 2 and ``no_reshard``
    (not faster) not; then one batch measures checkpointing at the probe's split, then 4 with it
    against 2 without; faster, 4 is adopted with checkpointing on, no OOM, the same layouts on every
    rank. An OOM in the last batch undoes ``grad_sync_once``, never checkpointing, and the batch
    reruns at 4. Parameters equal a fixed run at 2 without it. (On 4 ranks this is also the run where a
    trade is kept and another not: the module's 4-rank launch runs no other such case.) On 1 and 2
    ranks also (a card not all ours): the rerun with the trade undone runs out too (an error-level line), and
    the memory coming back undoes checkpointing (the size searched again without it)."""
    results = _suite(world)
    gso, both = [GRAD_SYNC_ONCE], [GRAD_SYNC_ONCE, RECOMPUTE]
    for rank in range(world):
        without2, without3, with4, limit = results[rank]["upsize_limit"]
        assert without2 <= limit < without3 and with4 < limit, results[rank]["upsize_limit"]
        # The switch is carried under auto (each of the two blocks), where the layout is pinned too (switched off there:
        # only the ladder below size 1 would turn it on, `automicro.batch.floor_ladder`).
        up = results[rank]["upsize"]
        assert up["checkpointed"] == cases.MODEL["n_layers"]
        assert results[rank].get("pinned_checkpointed", cases.MODEL["n_layers"]) == cases.MODEL["n_layers"]
        assert up["diff"] < 1e-5 and "OOMs 1" in up["summary"], (up["diff"], up["summary"])
        steady = next(r[0] for r in up["history"] if "sync hooks off" in r[3])
        # The two other trades at 2, then the measuring batch, then 4 with it, 2 without.
        assert up["layouts"][steady + 1 : steady + 8] == [gso, [], [GRAD_SYNC_ONCE, NO_RESHARD], gso, both, both, gso], up["layouts"]
        assert up["splits"][steady + 5 : steady + 8] == [[1, 1, 2], [4], [2, 2]], up["splits"]
        assert up["state"]["fits_up_to"] == {RECOMPUTE: 4} and up["state"]["upsized_from"] == [2]
        assert up["results"][:3] == [[GRAD_SYNC_ONCE, True], [NO_RESHARD, False], [RECOMPUTE, True]], up["results"]
        assert all(s == [4] for s in up["splits"][steady + 8 :]) and all(RECOMPUTE in x for x in up["layouts"][steady + 8 :])
        # The OOM in the last batch, at 4: grad_sync_once undone, checkpointing kept, the size kept.
        [(batch, size, note)] = [(r[0], r[1], r[3]) for r in up["history"] if r[2] == "oom"]
        assert (batch, size) == (len(up["splits"]) - 1, 4), up["history"]
        assert note == "layout undone first; rerun at the same size, now activation checkpointing on", note
        assert up["found"] == 4 and up["settled"] == [RECOMPUTE] and GRAD_SYNC_ONCE in up["rejected"], up
        if world > 2:
            continue  # the two runs below are not launched on 4 ranks (`layout_cases.upsize_cases`)
        # Twice: the rerun with grad_sync_once undone runs out at 4 too: one error-level line, then
        # the size policy's own rerun (a one-off at a size that ran clean) trains the batch.
        twice = results[rank]["rerun_out"]
        assert [r[2] for r in twice["history"] if r[0] == len(twice["splits"]) - 1] == ["oom", "oom", "ok"], twice["history"]
        assert len(twice["errors"]) == 1 and twice["errors"][0].startswith(
            f"automicro: microbatch size 4 runs out again in batch {len(twice['splits']) - 1} with layout trade "
            "grad_sync_once undone: the trade was not what held the memory"
        ), twice["errors"]
        assert twice["found"] == 4 and twice["diff"] < 1e-5, (twice["found"], twice["diff"])
        # The memory came back at batch 13 (4x the cap): checkpointing, kept at 4 under the cap, is
        # undone and the size searched again from 2 without it: 4 fits; the same parameters, no OOM.
        back = results[rank]["returned"]
        assert "OOMs 0" in back["summary"] and back["diff"] < 1e-5, (back["summary"], back["history"])
        assert any(RECOMPUTE in x for x in back["layouts"][:13]), back["layouts"]
        assert back["settled"] == [GRAD_SYNC_ONCE] and back["found"] == 4, (back["settled"], back["history"])
        assert back["splits"][-1] == [4] and RECOMPUTE not in back["layouts"][-1], (back["splits"], back["layouts"])
        assert all(x == [GRAD_SYNC_ONCE] for x in back["layouts"][14:]), back["layouts"]
        # The batch after the capacity grew was searched again (hooks on), and 4 ran without it.
        assert (14, 4, "ok", "ok at 4 -> converged on 4, split (4,)") in [tuple(r) for r in back["history"]], back["history"]
        # Another process holds memory on the last rank's card: checkpointing is neither measured nor
        # tried at a larger microbatch on any rank; the same two trials as `upsize` at 2.
        shared = results[rank]["shared"]
        assert shared["found"] == 2 and "OOMs 0" in shared["summary"] and shared["diff"] < 1e-5, shared["history"]
        assert shared["results"] == [[GRAD_SYNC_ONCE, True], [NO_RESHARD, False]], shared["results"]
        assert all(RECOMPUTE not in x for x in shared["layouts"]) and not shared["state"].get("fits_up_to"), shared["layouts"]
        assert all(s == [2, 2] for s in shared["splits"][-3:]) and shared["shared_said"], (shared["splits"], shared)
    assert len({str(results[r]["upsize"]["layouts"]) for r in range(world)}) == 1


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2])
def test_activation_checkpointing_off_is_a_trade_kept_when_faster_undone_by_an_oom_then_measured_and_downsized(world):
    """``no_recompute`` on 1 and 2 ranks, the blocks checkpointed: tried after the other trades, last; kept
    when timed faster; under a cap it cannot meet, its trial's first batch runs out of memory, the
    trade is undone, the batch reruns at the same size and it is not tried again at that size. The
    full recompute asked for is tried down to ``op`` there next: out of memory too, undone. Then one
    batch at size 1 measures checkpointing off's bytes, one more ``op``'s (fewer), and the downsize
    trial runs off at the largest smaller size they fit at: faster, that size is adopted with no
    other OOM. Parameters equal a fixed run with checkpointing at size 4."""
    for rank in range(world):
        kept, oom = _suite(world)[rank]["recompute_kept"], _suite(world)[rank]["recompute_oom"]
        for run in (kept, oom):
            assert run["diff"] < 1e-5, run["diff"]
            steady = next(r[0] for r in run["history"] if "sync hooks off" in r[3])
            # One microbatch (size 4): gradients reduced once is not tried (they are already).
            assert [x for x in run["layouts"][steady + 1 : steady + 5]] == [[NO_RESHARD], [], [NO_RECOMPUTE], []]
        # The slower trade comes back on top of the new layout (batch 8), not kept again.
        assert kept["results"] == [[NO_RESHARD, False], [NO_RECOMPUTE, True], [NO_RESHARD, False]], kept
        assert kept["settled"] == [NO_RECOMPUTE] and kept["layouts"][-1] == [NO_RECOMPUTE]
        assert "layout: activation checkpointing off" in kept["summary"] and kept["found"] == 4
        [(batch, size, note), (op_batch, op_size, op_note)] = [(r[0], r[1], r[3]) for r in oom["history"] if r[2] == "oom"]
        undone = "layout undone first; rerun at the same size, now default"
        assert size == op_size == 4 and note == op_note == undone, oom["history"]
        assert oom["layouts"][batch] == [NO_RECOMPUTE] and oom["splits"][batch] == [4]
        # Undone; three clean batches at 4 (sync hooks off again), then ``op`` in place of full at 4: out of memory.
        assert op_batch == batch + 3 and oom["layouts"][batch + 1 : op_batch + 1] == [[], [], [RECOMPUTE_OP]], oom
        # Undone; three clean batches, then the measuring batches at the probe's split (off, then ``op``), then the
        # downsize trial (with: 2 + 2 without checkpointing; without: 4 with it).
        assert oom["layouts"][op_batch + 1 : op_batch + 7] == [[], [], [NO_RECOMPUTE], [RECOMPUTE_OP], [NO_RECOMPUTE], []], oom
        assert oom["splits"][op_batch + 3 : op_batch + 7] == [[1, 1, 2], [1, 1, 2], [2, 2], [4]], oom["splits"]
        lines = {t: MeasuredLine.from_list(v) for t, v in oom["state"]["lines"].items()}
        # ``op`` keeps less a sample than off, each line measured on top of the layout settled then (the full recompute)
        assert 0 < lines[RECOMPUTE_OP].per_sample < lines[NO_RECOMPUTE].per_sample, oom["state"]
        assert lines[RECOMPUTE_OP].on == lines[NO_RECOMPUTE].on == (), oom["state"]
        assert lines[NO_RECOMPUTE].peak(2) < _suite(world)[rank]["limit"], oom["state"]
        # At the size adopted, two microbatches: gradients reduced once is tried there, not kept.
        assert oom["results"] == [[NO_RESHARD, False], [NO_RECOMPUTE, True], [GRAD_SYNC_ONCE, False]], oom
        assert oom["found"] == 3 and oom["splits"][-1] == [2, 2] and oom["settled"] == [NO_RECOMPUTE]
        assert oom["state"]["too_big_at"] == {} and oom["state"]["downsized_from"] == [4]
        assert "OOMs 2" in oom["summary"]


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2])
def test_checkpointing_off_measured_after_op_was_kept_is_measured_on_its_own_line_and_downsized_with_it(world):
    """Full recompute asked for; off runs out at the size found, ``op`` fits there and is kept (the size policy's
    samples then mix full's and ``op``'s peaks, as a GPU run's did once the head was fused: its line could not tell
    off's bytes). Off's measuring batch gives its own line on top of ``op``: its bytes a sample are those two fixed
    runs without checkpointing show, and the downsize trial runs off at the largest smaller size that line fits,
    faster: adopted, no other OOM, the same parameters as a fixed run with checkpointing at 4."""
    for rank in range(world):
        run = _suite(world)[rank]["recompute_op_kept"]
        assert run["diff"] < 1e-5, run["diff"]
        [(batch, size, note)] = [(r[0], r[1], r[3]) for r in run["history"] if r[2] == "oom"]
        assert size == 4 and run["layouts"][batch] == [NO_RECOMPUTE], run["history"]
        assert [NO_RECOMPUTE, True] in run["results"] and [RECOMPUTE_OP, True] in run["results"], run["results"]
        assert run["results"].index([RECOMPUTE_OP, True]) < run["results"].index([NO_RECOMPUTE, True])
        line = MeasuredLine.from_list(run["state"]["lines"][NO_RECOMPUTE])
        assert line.on == (RECOMPUTE_OP,), run["state"]
        off = _suite(world)[rank]["off_per_sample"]
        assert abs(line.per_sample - off) < 0.05 * off, (line, off)
        measured = run["layouts"].index([NO_RECOMPUTE, RECOMPUTE_OP])
        assert run["splits"][measured] == [1, 1, 2], run["splits"]
        # The downsize trial next: off at 2 + 2 against ``op`` at 4; kept, the size found 3.
        assert run["layouts"][measured + 1 : measured + 3] == [[NO_RECOMPUTE, RECOMPUTE_OP], [RECOMPUTE_OP]], run["layouts"]
        assert run["splits"][measured + 1 : measured + 3] == [[2, 2], [4]], run["splits"]
        assert run["found"] == 3 and run["settled"] == [NO_RECOMPUTE] and run["splits"][-1] == [2, 2]
        assert "OOMs 1" in run["summary"], run["summary"]


# ---- the downsize trial: a smaller microbatch with the trades that did not fit ---------------------


def _downsize_search(smaller_at: int = 2) -> LayoutSearch:
    """Both trades projected not to fit at the size found, 3; the model says they fit at 2."""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    layout, lines = search.layout_for_batch(True, lambda t: "no room", 3, 3, lambda trades: smaller_at)
    assert search.rejected == {GRAD_SYNC_ONCE: "no room", NO_RESHARD: "no room"}
    return search


def test_trades_that_do_not_fit_at_the_size_found_are_tried_together_at_a_smaller_one():
    search = _downsize_search()
    trial = search.trial
    assert trial is not None and trial.trades == (GRAD_SYNC_ONCE, NO_RESHARD) and (trial.size, trial.from_size) == (2, 3)
    # The "with" batch runs at 2 with both trades, the "without" batch at the size found.
    assert search.current == (GRAD_SYNC_ONCE, NO_RESHARD) and search.trial_size == 2
    search.observe(search.current, 1.0)
    assert search.current == () and search.trial_size is None
    search.observe((), 2.0)
    result = search.decide(search.local_times())
    assert result.kept and result.size == 2 and "at microbatch 2 (found 3): kept" in result.line()
    assert search.settled == (GRAD_SYNC_ONCE, NO_RESHARD) and search.rejected == {} and search.too_big_at == {}
    assert search.downsized_from == [3]


def test_a_downsize_trial_runs_once_per_size_found_and_pressure_in_it_keeps_the_size():
    slower = _downsize_search()
    slower.observe(slower.current, 3.0)
    slower.observe((), 2.0)
    assert not slower.decide(slower.local_times()).kept
    assert slower.layout_for_batch(True, lambda t: "no room", 3, 3, lambda trades: 2) == ((), [])
    assert set(slower.rejected) == {GRAD_SYNC_ONCE, NO_RESHARD}
    # An OOM in the "with" batch: the trial ends, the trades stay rejected at 3, the batch reruns at 3.
    pressed = _downsize_search()
    assert pressed.relieve(pressed.current, "out of memory at size 2", 2) == f"{GRAD_SYNC_ONCE}+{NO_RESHARD}"
    assert pressed.trial is None and pressed.trial_size is None and pressed.too_big_at == {GRAD_SYNC_ONCE: 3, NO_RESHARD: 3}
    assert pressed.layout_for_batch(True, lambda t: "no room", 3, 3, lambda trades: 2) == ((), [])
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    restored.load_state_dict(pressed.state_dict())
    assert restored.downsized_from == [3] and restored.layout_for_batch(True, lambda t: "no room", 3, 3, lambda t: 2) == ((), [])


def test_a_downsize_trial_takes_each_trade_alone_when_both_do_not_fit_and_none_without_a_projection():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    search.layout_for_batch(True, lambda t: "no room", 3, 3, lambda trades: 1 if len(trades) == 1 else None)
    assert search.trial.trades == (GRAD_SYNC_ONCE,) and search.trial.size == 1
    none = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, NO_RESHARD])
    assert none.layout_for_batch(True, lambda t: "no room", 3, 3, lambda trades: None)[0] == ()
    assert none.trial is None and none.downsized_from == []


def _recompute_rejected_at(found: int = 4) -> LayoutSearch:
    """``no_recompute`` ran out of memory at the size found (`found`), undone: it waits for a downsize."""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [NO_RECOMPUTE])
    search.layout_for_batch(True, lambda t: None, found, found)
    assert search.trial is not None and search.current == (NO_RECOMPUTE,)
    assert search.relieve(search.current, f"out of memory at size {found}", found) == NO_RECOMPUTE
    assert search.too_big_at == {NO_RECOMPUTE: found}
    return search


def test_no_recompute_is_measured_in_one_batch_at_the_smallest_size_then_downsized_with_its_bytes():
    search = _recompute_rejected_at()
    # Without a size to measure at (no memory figures): no downsize, nothing measured.
    assert search.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: 2, None) == ((), [])
    layout, lines = search.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: 2, 1)
    trial = search.trial
    assert trial is not None and trial.measure and (trial.size, trial.from_size) == (1, 4)
    assert layout == (NO_RECOMPUTE,) and search.trial_size == 1 and search.downsized_from == []
    assert lines == [f"layout trade {NO_RECOMPUTE} (activation checkpointing off): measuring its bytes in one batch "
                     "at microbatches 1 and 2 (found 4): it did not fit at 4"]
    assert search.measuring is None and not search.needs_agreement
    search.observe(layout, 5.0)
    assert search.measuring is trial and not search.needs_agreement
    assert "3.00 MiB per sample with it, 10.0 MiB besides" in search.measured((10 * 2**20, 3 * 2**20))
    assert search.trial is None and search.lines == {NO_RECOMPUTE: MeasuredLine(10 * 2**20, 3 * 2**20, ())}
    # Next batch: the downsize trial, at the size `smaller` gives with those bytes.
    asked: list[tuple[str, ...]] = []
    layout, lines = search.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: asked.append(trades) or 2, 1)
    assert asked == [(NO_RECOMPUTE,)] and search.trial is not None and not search.trial.measure
    assert (search.trial.size, search.trial.from_size, search.downsized_from) == (2, 4, [4])
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [NO_RECOMPUTE])
    restored.load_state_dict(search.state_dict())
    assert restored.lines == search.lines and restored.too_big_at == {NO_RECOMPUTE: 4}


def test_pressure_in_the_measuring_batch_or_no_measure_ends_it_for_good():
    pressed = _recompute_rejected_at()
    pressed.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: 2, 1)
    assert pressed.relieve(pressed.current, "out of memory at size 1", 1) == NO_RECOMPUTE
    assert pressed.trial is None and pressed.lines == {NO_RECOMPUTE: None}
    # Never measured again, nor downsized; the checkpoint keeps it so.
    assert pressed.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: 2, 1) == ((), [])
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [NO_RECOMPUTE])
    restored.load_state_dict(pressed.state_dict())
    assert restored.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: 2, 1) == ((), [])
    unknown = _recompute_rejected_at()
    unknown.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: 2, 1)
    unknown.observe(unknown.current, 5.0)
    assert "could not be measured" in unknown.measured(None) and unknown.lines == {NO_RECOMPUTE: None}
    assert unknown.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: 2, 1) == ((), [])
    # A measured trade that fits nowhere smaller: no downsize trial.
    nowhere = _recompute_rejected_at()
    nowhere.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: None, 1)
    nowhere.observe(nowhere.current, 5.0)
    nowhere.measured((0.0, 2**30))
    assert nowhere.layout_for_batch(True, lambda t: None, 4, 4, lambda trades: None, 1) == ((), [])


# ---- a full recompute asked for, tried down to the ``op`` rung -------------------------------------------------

DOWN = [NO_RECOMPUTE, RECOMPUTE_OP]  # the candidates where the user asked for full recompute (`LayoutEngine.candidates`)


def _off_did_not_fit(found: int = 4) -> LayoutSearch:
    """Full recompute asked for: ``no_recompute`` tried first at the size found, out of memory there."""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), DOWN)
    layout, lines = search.layout_for_batch(True, lambda t: None, found, found)
    assert layout == (NO_RECOMPUTE,) and [line.split(" (")[0] for line in lines] == ["layout trial no_recompute"]
    assert search.relieve(layout, f"out of memory at size {found}", found) == NO_RECOMPUTE
    return search


def test_a_full_recompute_asked_for_is_tried_down_to_op_where_off_did_not_fit_and_op_kept_when_faster():
    search = _off_did_not_fit()
    layout, lines = search.layout_for_batch(True, lambda t: None, 4, 4)
    assert layout == (RECOMPUTE_OP,) and search.trial_size is None  # at the size found
    assert lines == ["recompute: op (matrix products and attention kept) against full at the size found: "
                     "1 batches with it, as many without"]
    search.observe(layout, 1.5)
    layout, _ = search.layout_for_batch(True, lambda t: None, 4, 4)
    assert layout == ()  # the "without" arm: the full recompute asked for
    search.observe(layout, 2.0)
    result = search.decide(search.local_times())
    assert result.kept and search.settled == (RECOMPUTE_OP,)
    assert result.line() == ("recompute: op (matrix products and attention kept) against full at the size found: op kept; "
                             "median batch 1.5000 s op, 2.0000 s full (+25.0%; spread 0.0000 s)")
    assert search.layout_for_batch(True, lambda t: None, 4, 4) == ((RECOMPUTE_OP,), [])  # nothing left to try
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), DOWN)
    restored.load_state_dict(search.state_dict())
    assert restored.settled == (RECOMPUTE_OP,) and restored.layout_for_batch(True, lambda t: None, 4, 4)[0] == (RECOMPUTE_OP,)
    # Under pressure at the settled size it is undone first: back to full, which holds less.
    assert search.relieve((RECOMPUTE_OP,), "out of memory at size 4", 4) == RECOMPUTE_OP and search.settled == ()
    # A smaller size later: off comes back first, and kept it takes ``op``'s place (two rungs of one dial).
    search.kept.append(RECOMPUTE_OP)
    search.too_big_at.pop(RECOMPUTE_OP)
    search.rejected.pop(RECOMPUTE_OP)
    layout, lines = search.layout_for_batch(True, lambda t: None, 2, 2)
    assert layout == (NO_RECOMPUTE, RECOMPUTE_OP) and search.trial.trades == (NO_RECOMPUTE,), lines
    _run_trial(search, 1.0, 2.0)
    assert search.settled == (NO_RECOMPUTE,)


def test_op_is_not_tried_where_off_fitted_whether_kept_or_slower():
    for off_s, kept in ((1.0, True), (3.0, False)):
        search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), DOWN)
        search.layout_for_batch(True, lambda t: None, 4, 4)
        _run_trial(search, off_s, 2.0)
        assert search.settled == ((NO_RECOMPUTE,) if kept else ())
        assert search.layout_for_batch(True, lambda t: None, 4, 4) == (search.settled, []) and search.trial is None
    # Beside ``recompute`` (no recompute asked for) it is tried up, before full; alone it is the ladder's rung only.
    up = LayoutSearch(LayoutConfig.parse("auto"), [RECOMPUTE, RECOMPUTE_OP])
    assert up.candidates == [RECOMPUTE, RECOMPUTE_OP] and up.upsize == (RECOMPUTE, RECOMPUTE_OP) and up._untried() == []
    assert LayoutSearch(LayoutConfig.parse("auto"), [RECOMPUTE_OP]).candidates == []
    assert LayoutSearch(LayoutConfig.parse("auto"), DOWN).upsize == ()


def test_where_neither_fits_at_the_size_found_both_are_measured_and_downsized_alone_never_together():
    search = _off_did_not_fit()
    search.layout_for_batch(True, lambda t: None, 4, 4)
    assert search.relieve((RECOMPUTE_OP,), "out of memory at size 4", 4) == RECOMPUTE_OP
    assert search.too_big_at == {NO_RECOMPUTE: 4, RECOMPUTE_OP: 4}
    sizes = {(NO_RECOMPUTE,): None, (RECOMPUTE_OP,): 3}  # off fits nowhere smaller; op at 3
    asked: list[tuple[str, ...]] = []

    def smaller(trades):
        asked.append(trades)
        return sizes.get(trades)

    measured = []
    for _ in range(2):  # one measuring batch each, off first
        layout, lines = search.layout_for_batch(True, lambda t: None, 4, 4, smaller, 1)
        assert search.trial.measure and search.trial.size == 1 and len(layout) == 1, lines
        measured.append((layout[0], lines))
        search.observe(layout, 5.0)
        search.measured((0.0, 2**20 if layout == (NO_RECOMPUTE,) else 2**19))
    assert [trade for trade, _ in measured] == [NO_RECOMPUTE, RECOMPUTE_OP]
    assert measured[1][1] == ["recompute: op's bytes measured in one batch at microbatches 1 and 2 (found 4 with full): "
                              "it did not fit at 4"]
    assert search.lines == {NO_RECOMPUTE: MeasuredLine(0.0, 2**20), RECOMPUTE_OP: MeasuredLine(0.0, 2**19)}
    layout, lines = search.layout_for_batch(True, lambda t: None, 4, 4, smaller, 1)
    assert asked == [(NO_RECOMPUTE,), (RECOMPUTE_OP,)]  # never the two together
    assert layout == (RECOMPUTE_OP,) and (search.trial.size, search.trial.from_size) == (3, 4)
    assert lines == ["recompute: op (matrix products and attention kept) at microbatch 3 against full at 4, the size found: "
                     "1 batches with it at 3, as many without at 4"]


def test_below_size_1_the_fused_head_is_the_ladders_first_rung_where_it_is_the_trials_and_pressure_never_undoes_a_rung():
    """``head: auto``, checkpointing not asked for: size 1 out of memory with the plain head steps the fused head on
    first (no trial of it after: it is kept), then ``op``, then full; a checkpoint (any mode) keeps the rungs. Pressure
    at a settled size later undoes neither the head nor the ladder's ``op`` (size 1 did not fit without them: the size
    shrinks instead). With a full recompute asked for and off kept, the head still goes first, then off is undone."""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [FUSED_HEAD])
    assert search.head_rung_left
    assert [search.recompute_floor(True, selective=True) for _ in range(2)] == [FUSED_HEAD, RECOMPUTE_OP]
    assert search.settled == (FUSED_HEAD, RECOMPUTE_OP) and not search.head_rung_left
    assert search.layout_for_batch(True, lambda t: None, 1, 1) == ((FUSED_HEAD, RECOMPUTE_OP), [])  # no head trial
    assert search.relieve(search.settled, "out of memory at size 2", 2) is None and search.settled == (FUSED_HEAD, RECOMPUTE_OP)
    for mode in ("auto", "fixed"):
        restored = LayoutSearch(LayoutConfig.parse(mode, trial_batches=1), [FUSED_HEAD])
        restored.load_state_dict(search.state_dict())
        assert restored.settled == (FUSED_HEAD, RECOMPUTE_OP) and restored.floor == [FUSED_HEAD, RECOMPUTE_OP], mode
    assert search.recompute_floor(True, selective=True) == RECOMPUTE and search.settled == (FUSED_HEAD, RECOMPUTE)

    asked = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [FUSED_HEAD, *DOWN])
    asked.kept.append(NO_RECOMPUTE)
    assert [asked.recompute_floor(False) for _ in range(3)] == [FUSED_HEAD, NO_RECOMPUTE, None]
    assert asked.settled == (FUSED_HEAD,)
    plain = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [])  # the head not the trials' (plain or fused)
    assert not plain.head_rung_left and plain.recompute_floor(True, selective=True) == RECOMPUTE_OP


def test_over_tokens_the_size_policy_adopts_only_a_smaller_budget():
    """A size trial over a token budget: a smaller budget is adopted, the budget is
    the size; a larger one is refused (no trade admits a larger budget)."""
    from automicro.core import policy as search

    p = search.SearchPolicy(search.PolicyConfig(unit="tokens"), 720)
    for outcome in (search.Success(720), search.Success(720), search.Success(720), search.Success(720)):
        p.observe(outcome)
    assert p.phase == search.Phase.STEADY and p.found_size == 720
    decision = p.observe(search.Adopt(540))
    assert p.found_size == 540 and p.state.size == 540 and decision.event == "layout: microbatch now 540, budget 540 tokens"
    with pytest.raises(ValueError, match="over tokens, a smaller one"):
        p.observe(search.Adopt(600))


def test_the_size_policy_adopts_another_size_only_when_steady():
    from automicro.core import policy as search

    p = search.SearchPolicy(search.PolicyConfig(), 8)
    with pytest.raises(ValueError, match="Adopt"):
        p.observe(search.Adopt(2))  # still searching
    for _ in range(4):
        p.observe(search.Success(8))
    assert p.phase == search.Phase.STEADY and p.found_size == 8
    decision = p.observe(search.Adopt(3))
    assert p.found_size == 3 and p.phase == search.Phase.STEADY and decision.split == p.current_split() == p.split_for(3)
    assert decision.event == "layout: microbatch now 3, split (3, 3, 2)" and not decision.hooks
    for bad in (3, 9, 0):  # the size found itself, beyond the batch, below 1
        with pytest.raises(ValueError, match="Adopt|must be an int in 1..8"):
            p.observe(search.Adopt(bad))
    # Larger (checkpointing on admitted it): the bounds and the memory model were the other layout's.
    q = search.SearchPolicy(search.PolicyConfig(), 8)
    q.observe(search.Success(8, peak_bytes=800, capacity_bytes=900))
    q.observe(search.OOM(4))
    q.observe(search.Success(2, peak_bytes=300, capacity_bytes=900))
    while q.phase != search.Phase.STEADY:
        q.observe(search.Success(max(q.current_split()), peak_bytes=400, capacity_bytes=900))
    assert q.found_size < 4 and q.state.first_failure is not None and q.state.samples
    decision = q.observe(search.Adopt(6))
    assert q.found_size == 6 and q.state.first_failure is None and q.state.samples == () and q.state.best_success == 6
    assert decision.split == (4, 4) and q.projected_peak(6) is None and q.phase == search.Phase.STEADY
    shelved = q.state.shelved
    assert shelved, "the model without the trade is kept aside"
    restored = search.SearchState.from_dict(q.state.to_dict())
    assert restored.shelved == shelved
    # The trade undone (the memory came back, 900 -> 2000): upward again from the size found
    # without it, under the model from before the trade, read at the capacity now; hooks on.
    decision = q.observe(search.Adopt(3, reopen=True, capacity_bytes=2000))
    assert q.phase == search.Phase.SEARCHING and decision.hooks and decision.reason == search.HookReason.SEARCHING
    assert q.state.first_failure is None and q.state.best_success == 3 and q.state.shelved == ()
    assert q.state.samples == tuple((m, p, 2000) for m, p, _ in shelved)
    assert decision.event.startswith("layout: the trade that admitted a larger size is undone, 3 is the size found without it -> try ")
    assert max(decision.split) > 3
    # Also while searching (the size policy reopened for the memory that came back first).
    searching = search.SearchPolicy(search.PolicyConfig(), 8)
    searching.observe(search.Success(8, peak_bytes=800, capacity_bytes=900))
    searching.observe(search.OOM(4))
    assert searching.phase == search.Phase.SEARCHING
    assert searching.observe(search.Adopt(2, reopen=True, capacity_bytes=2000)).hooks and searching.state.best_success == 2
    # Nothing left above it: settled there.
    whole = search.SearchPolicy(search.PolicyConfig(), 4)
    decision = whole.observe(search.Adopt(4, reopen=True))
    assert whole.found_size == 4 and decision.event.endswith("; split (4,)")


@pytest.mark.multiproc
def test_a_smaller_microbatch_with_the_trades_is_adopted_when_faster_and_parameters_equal_a_fixed_run():
    """2 ranks, the probe, a cap where size 2 fits but neither trade on top of it, both at size 1:
    the downsize trial runs size 1 with both trades against 2 without; faster, size 1 and the
    trades are kept (no OOM); slower, size 2 stays. Parameters equal a fixed run at size 2."""
    for report in run_multiprocess(cases.downsize_case, world_size=2, timeout_s=600):
        assert report["fits_at_1"] and report["fits_at_2"], report
        auto, slower = report["auto"], report["slower"]
        for run in (auto, slower):
            assert run["diff"] < 1e-5, run["diff"]
            assert "OOMs 0" in run["summary"], run["summary"]
            steady = next(r[0] for r in run["history"] if "sync hooks off" in r[3])
            # The trades passed over at 2, then one batch with both at 1, one without at 2.
            assert run["splits"][steady + 1 : steady + 3] == [[1, 1, 1, 1], [2, 2]], run["splits"]
            assert run["layouts"][steady + 1 : steady + 3] == [[GRAD_SYNC_ONCE, NO_RESHARD], []], run["layouts"]
        assert auto["found"] == 1 and auto["settled"] == [GRAD_SYNC_ONCE, NO_RESHARD], auto
        # Checkpointing on (the engine carries it switched off) is measured after that and tried at a
        # larger size where its split has a larger microbatch; timed no faster, it is not kept; then the
        # ``op`` rung (the engine's dial) likewise, measured and tried up, not kept.
        def without_recompute(run, start):
            return [s for s, x in zip(run["splits"][start:], run["layouts"][start:]) if RECOMPUTE not in x and RECOMPUTE_OP not in x]

        assert [RECOMPUTE, False] in auto["results"] and [RECOMPUTE, True] not in slower["results"]
        assert [RECOMPUTE_OP, False] in auto["results"] and auto["results"].index([RECOMPUTE_OP, False]) > \
            auto["results"].index([RECOMPUTE, False]), auto["results"]
        assert set(map(tuple, without_recompute(auto, steady + 3))) == {(1, 1, 1, 1)} and "microbatch size found: 1" in auto["summary"]
        assert slower["found"] == 2 and slower["settled"] == [] and set(map(tuple, without_recompute(slower, steady + 2))) == {(2, 2)}


def test_trades_each_faster_by_too_little_are_tried_together_once():
    """Each trade 5% faster, under a min_gain of 10%: neither is kept alone; together (the two
    H200s' case) they are tried once as one, kept when that beats the rule; a pair whose bytes do
    not fit together is not tried, its trades stay rejected at that size (a downsize may follow)."""
    config = LayoutConfig.parse("auto", trial_batches=1, min_gain=0.1)
    search = LayoutSearch(config, [GRAD_SYNC_ONCE, NO_RESHARD])
    _run_trial(search, 1.9, 2.0)
    _run_trial(search, 1.9, 2.0)
    assert search.settled == () and search.near == {(): [GRAD_SYNC_ONCE, NO_RESHARD]}
    layout, lines = search.layout_for_batch(True, lambda t: None)
    assert layout == (GRAD_SYNC_ONCE, NO_RESHARD) and lines == [
        "layout trial grad_sync_once+no_reshard (gradients reduced once per batch, no resharding after forward, nor "
        "between microbatches): 1 batches with them, as many without"
    ]
    search.observe(layout, 1.5)
    search.observe(search.layout_for_batch(True, lambda t: None)[0], 2.0)
    assert search.decide(search.local_times()).kept and search.settled == (GRAD_SYNC_ONCE, NO_RESHARD)
    # Slower together: tried once on that layout, never again.
    slower = LayoutSearch(config, [GRAD_SYNC_ONCE, NO_RESHARD])
    _run_trial(slower, 1.9, 2.0)
    _run_trial(slower, 1.9, 2.0)
    _run_trial(slower, 2.5, 2.0)
    assert slower.layout_for_batch(True, lambda t: None) == ((), [])
    # Not fitting together (each alone did): both rejected at that size, for a downsize trial.
    tight = LayoutSearch(config, [GRAD_SYNC_ONCE, NO_RESHARD])
    _run_trial(tight, 1.9, 2.0)
    _run_trial(tight, 1.9, 2.0)
    layout, lines = tight.layout_for_batch(True, lambda t: "no room" if "+" in t else None, 6, 6, lambda trades: 4)
    assert lines[0] == "layout trades grad_sync_once+no_reshard not tried together: no room"
    assert tight.too_big_at == {GRAD_SYNC_ONCE: 6, NO_RESHARD: 6}
    assert tight.trial is not None and tight.trial.size == 4 and tight.trial.trades == (GRAD_SYNC_ONCE, NO_RESHARD)
    restored = LayoutSearch(config, [GRAD_SYNC_ONCE, NO_RESHARD])
    restored.load_state_dict(search.state_dict())
    assert restored.settled == (GRAD_SYNC_ONCE, NO_RESHARD) and restored.near == search.near


# ---- checkpointing on, at a larger microbatch (`recompute`) -------------------------------------


def _upsize_search(found: int = 2) -> LayoutSearch:
    """``grad_sync_once`` tried at `found` (slower); ``recompute`` waits, never tried at that size.
    (No size trials: the upsize trial alone.)"""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1, size_trials=False), [GRAD_SYNC_ONCE, RECOMPUTE])
    _run_trial(search, 3.0, 2.0)
    assert search.settled == () and search.trial is None
    return search


def _measure(search: LayoutSearch, found: int, fits_up_to) -> list[str]:
    layout, lines = search.layout_for_batch(True, lambda t: None, found, found, None, 1)
    trial = search.trial
    assert trial is not None and trial.measure and (trial.size, trial.from_size) == (1, found), lines
    assert layout == (RECOMPUTE,) and search.measuring is None
    search.observe(layout, 9.0)
    assert search.measuring is trial and not search.needs_agreement
    return lines + [search.measured(None, "how", fits_up_to=fits_up_to)]


def test_recompute_held_while_the_whole_model_is_compiled_is_neither_measured_nor_tried_until_let_go():
    """`LayoutSearch.held` (the whole model compiled: `LayoutEngine.recompute_held`): no measuring batch, no upsize
    trial, the size found not spent; once let go, measured and tried from the same size."""
    search = _upsize_search()
    search.held = {RECOMPUTE: "the whole model is compiled"}
    said = ["layout trade recompute (activation checkpointing on) not tried for now: the whole model is compiled"]
    for lines in (said, [], []):  # said once
        assert search.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), lines)
    assert search.trial is None and search.upsized_from == [] and RECOMPUTE not in search.fits_up_to
    search.held = {}
    _measure(search, 2, 4)
    layout, _ = search.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    assert layout == (RECOMPUTE,) and search.trial_size == 4 and search.upsized_from == [2]


def test_recompute_is_measured_then_tried_at_the_larger_size_it_fits_and_never_undone_under_pressure():
    search = _upsize_search()
    # Without a size to measure at (no probe, no memory figures): nothing is tried.
    assert search.layout_for_batch(True, lambda t: None, 2, 2, None, None) == ((), [])
    assert _measure(search, 2, 4) == [
        "layout trade recompute (activation checkpointing on): measuring its bytes in one batch at microbatches 1 "
        "and 2 (found 2): a larger microbatch may fit with it",
        "layout trade recompute (activation checkpointing on): fits microbatch 4 at most (how)",
    ]
    assert search.trial is None and search.fits_up_to == {RECOMPUTE: 4} and search.settled == ()
    layout, lines = search.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    assert layout == (RECOMPUTE,) and search.trial_size == 4 and search.trial.upsize and search.upsized_from == [2]
    assert lines == [
        "layout trial recompute (activation checkpointing on) at microbatch 4 (found 2): 1 batches with it at 4, "
        "as many without at 2"
    ]
    search.observe(layout, 1.0)
    layout, _ = search.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    assert layout == () and search.trial_size is None
    search.observe(layout, 2.0)
    result = search.decide(search.local_times())
    assert result.kept and result.size == 4 and search.settled == (RECOMPUTE,)
    # At 4 (adopted): the trades are tried again on top; recompute is never tried, nor measured, again.
    layout, lines = search.layout_for_batch(True, lambda t: None, 4, 4, None, 1)
    assert layout == (GRAD_SYNC_ONCE, RECOMPUTE) and search.trial.size is None, lines
    search.observe(layout, 1.0)
    search.observe(search.layout_for_batch(True, lambda t: None, 4, 4, None, 1)[0], 2.0)
    assert search.decide(search.local_times()).kept and search.settled == (GRAD_SYNC_ONCE, RECOMPUTE)
    assert search.layout_for_batch(True, lambda t: None, 4, 4, None, 1) == ((GRAD_SYNC_ONCE, RECOMPUTE), [])
    # Pressure: the other trade goes; checkpointing stays (the size shrinks instead).
    assert search.relieve(search.current, "out of memory at size 4", 4) == GRAD_SYNC_ONCE
    assert search.relieve(search.current, "out of memory at size 4", 4) is None and search.settled == (RECOMPUTE,)
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE, RECOMPUTE])
    restored.load_state_dict(search.state_dict())
    assert restored.settled == (RECOMPUTE,) and restored.fits_up_to == {RECOMPUTE: 4} and restored.upsized_from == [2]


def _measure_up(search: LayoutSearch, trade: str, found: int, fits_up_to, base: tuple = (), priced=None) -> list[str]:
    layout, lines = search.layout_for_batch(True, lambda t: None, found, found, None, 1, priced=priced)
    trial = search.trial
    assert trial is not None and trial.measure and trial.trades == (trade,) and (trial.size, trial.from_size) == (1, found), lines
    assert layout == tuple(t for t in (RECOMPUTE, RECOMPUTE_OP) if t in (trade, *base)) or layout == (trade,), layout
    search.observe(layout, 9.0)
    return lines + [search.measured(None, "how", fits_up_to=fits_up_to)]


def test_op_is_tried_up_where_full_recompute_did_not_pay_and_full_then_from_the_size_op_admitted():
    """No recompute asked for, the blocks carrying the engine's dial (`LayoutEngine.candidates`: ``recompute`` and
    ``recompute_op``): full is measured and timed at the larger size it fits first; slower, the ``op`` rung is measured
    and timed at the size it fits against none at the size found (priced as a selective upsize); kept, full is tried
    again from there against ``op`` and, kept, takes its place (one dial), undone under more memory back to none at
    the first size found. Neither is undone under pressure; the state survives a checkpoint."""
    config = LayoutConfig.parse("auto", trial_batches=1, size_trials=False)
    search = LayoutSearch(config, [RECOMPUTE, RECOMPUTE_OP])
    prices: list[tuple[str, str, dict]] = []

    def priced(label, kind, facts):
        prices.append((label, kind, dict(facts)))
        return None

    def step(found: int, on: float, off: float):
        lines = []
        while not search.needs_agreement:
            layout, more = search.layout_for_batch(True, lambda t: None, found, found, None, 1, priced=priced, capacity=100)
            lines += more
            search.observe(layout, on if search.trial.trades[0] in layout else off)
        return search.decide(search.local_times(), capacity=100), lines

    assert _measure_up(search, RECOMPUTE, 2, 6)[-1] == \
        "layout trade recompute (activation checkpointing on): fits microbatch 6 at most (how)"
    result, _ = step(2, 3.0, 2.0)  # full at 6 slower than none at 2
    assert not result.kept and result.size == 6 and search.settled == () and search.upsized_from == [2]
    lines = _measure_up(search, RECOMPUTE_OP, 2, 4, priced=priced)
    # Its measuring batch is priced with the whole sequence (that batch, both compiles, the arms): not ``measured``.
    assert prices[-1][1:] == ("upsize", {"microbatches": 1.0, "selective": 1.0}), prices
    assert lines == [
        "recompute: op's bytes measured in one batch at microbatches 1 and 2 (found 2 with none): a larger microbatch "
        "may fit with it",
        "layout trade recompute_op (selective recompute on (matrix products and attention kept)): fits microbatch 4 at "
        "most (how)",
    ], lines
    result, lines = step(2, 1.0, 2.0)  # op at 4 faster than none at 2
    assert lines[0] == ("recompute: op (matrix products and attention kept) at microbatch 4 against none at 2, the size "
                        "found: 1 batches with it at 4, as many without at 2"), lines
    # Priced after its measuring batch: that batch and its compile are spent (`trial_price`'s ``measured``).
    assert prices[-1] == ("recompute_op at 4", "upsize", {"microbatches": 1.0, "selective": 1.0, "measured": 1.0}), prices
    assert prices[0] == ("recompute at 6", "upsize", {"microbatches": 1.0, "measured": 1.0}), prices
    assert result.kept and result.size == 4 and search.settled == (RECOMPUTE_OP,) and search.op_upsized_from == [2]
    assert result.line().startswith("recompute: op (matrix products and attention kept) at microbatch 4 against none at "
                                    "2, the size found: op kept; median batch 1.0000 s op, 2.0000 s none"), result.line()
    # Pressure: ``op`` stays (the size shrinks instead).
    assert search.relieve(search.current, "out of memory at size 4", 4) is None and search.settled == (RECOMPUTE_OP,)
    restored = LayoutSearch(config, [RECOMPUTE, RECOMPUTE_OP])
    restored.load_state_dict(search.state_dict())
    assert restored.settled == (RECOMPUTE_OP,) and restored.op_upsized_from == [2] and restored.fits_up_to == search.fits_up_to
    assert restored.kept_under == {RECOMPUTE_OP: (100, 2)}
    # From 4 (adopted with op): full at 6 (measured already) against op at 4; kept, in op's place.
    layout, lines = search.layout_for_batch(True, lambda t: None, 4, 4, None, 1, priced=priced, capacity=100)
    assert layout == (RECOMPUTE, RECOMPUTE_OP) and search.trial.size == 6 and not search.trial.up, lines
    search.observe(layout, 1.0)
    search.observe(search.layout_for_batch(True, lambda t: None, 4, 4, None, 1, priced=priced, capacity=100)[0], 2.0)
    result = search.decide(search.local_times(), capacity=100)
    assert result.kept and search.settled == (RECOMPUTE,) and search.kept_under == {RECOMPUTE: (100, 2)}
    assert search.layout_for_batch(True, lambda t: None, 6, 6, None, 1, capacity=100) == ((RECOMPUTE,), [])
    # More memory: full undone, back to none, the size searched again from 2 (the size found without either).
    assert search.reconsider(200)[0] == 2 and search.settled == () and search.op_upsized_from == []


def test_op_is_not_measured_where_full_fits_no_larger_split_nor_tried_where_full_was_kept():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1, size_trials=False), [RECOMPUTE, RECOMPUTE_OP])
    _measure_up(search, RECOMPUTE, 2, 2)  # full fits no more than the size found: op, which keeps more, neither
    layout, lines = search.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    assert layout == () and search.trial is None and lines == [
        "layout trade recompute (activation checkpointing on) not tried: it fits microbatch 2 at most, no larger "
        "microbatch than at 2 found",
        "layout trade recompute_op (selective recompute on (matrix products and attention kept)) not tried: full "
        "recompute did not pay (it fits no larger microbatch than at 2), and op keeps more bytes than full"], lines
    assert search.upsized_from == [2] and search.op_upsized_from == [2] and RECOMPUTE_OP not in search.fits_up_to
    assert search.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), [])
    # Full fits a larger size but op's own measurement does not: op not tried, said once.
    other = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1, size_trials=False), [RECOMPUTE, RECOMPUTE_OP])
    _measure_up(other, RECOMPUTE, 2, 4)
    other.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    other.observe((RECOMPUTE,), 3.0)
    other.observe(other.layout_for_batch(True, lambda t: None, 2, 2, None, 1)[0], 2.0)
    assert not other.decide(other.local_times()).kept
    _measure_up(other, RECOMPUTE_OP, 2, 2)
    assert other.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), [
        "layout trade recompute_op (selective recompute on (matrix products and attention kept)) not tried: it fits "
        "microbatch 2 at most, no larger microbatch than at 2 found"])
    assert other.trial is None and other.op_upsized_from == [2]
    kept = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1, size_trials=False), [RECOMPUTE, RECOMPUTE_OP])
    _measure_up(kept, RECOMPUTE, 2, 4)
    kept.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    kept.observe((RECOMPUTE,), 1.0)
    kept.observe(kept.layout_for_batch(True, lambda t: None, 2, 2, None, 1)[0], 2.0)
    assert kept.decide(kept.local_times()).kept and kept.settled == (RECOMPUTE,)
    assert kept.layout_for_batch(True, lambda t: None, 4, 4, None, 1) == ((RECOMPUTE,), []) and kept.trial is None


def test_recompute_not_kept_or_not_fitting_larger_is_not_tried_again_from_that_size():
    slower = _upsize_search()
    _measure(slower, 2, 4)
    slower.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    slower.observe((RECOMPUTE,), 3.0)
    slower.observe(slower.layout_for_batch(True, lambda t: None, 2, 2, None, 1)[0], 2.0)
    result = slower.decide(slower.local_times())
    assert not result.kept and slower.settled == () and slower.upsized_from == [2]
    assert slower.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), [])
    # From a smaller size found (the policy shrank later): tried again, without measuring again.
    layout, lines = slower.layout_for_batch(True, lambda t: None, 1, 1, None, 1)
    assert layout == (RECOMPUTE,) and slower.trial_size == 4 and not slower.trial.measure, lines
    # Its model fits no larger size than the one found: said once, no trial.
    small = _upsize_search()
    _measure(small, 2, 2)
    assert small.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), [
        "layout trade recompute (activation checkpointing on) not tried: it fits microbatch 2 at most, no larger "
        "microbatch than at 2 found"
    ])
    assert small.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), [])
    # Larger, but its split's largest microbatch is not (a batch of 16: 10 runs as 8, 8, as 8 does).
    same_split = _upsize_search(8)
    _measure(same_split, 8, 10)
    layout, lines = same_split.layout_for_batch(True, lambda t: None, 8, 8, None, 1, lambda n: max(-(-16 // -(-16 // n)), 1))
    assert layout == () and same_split.trial is None and "no larger microbatch than at 8" in lines[0], lines


def test_pressure_in_recomputes_measuring_batch_or_its_trial_ends_it_and_the_batch_reruns_at_the_size_found():
    pressed = _upsize_search()
    pressed.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    assert pressed.relieve(pressed.current, "out of memory at size 2", 2) == RECOMPUTE
    assert pressed.trial is None and pressed.fits_up_to == {RECOMPUTE: None}
    assert pressed.layout_for_batch(True, lambda t: None, 1, 1, None, 1) == ((), [])
    unread = _upsize_search()
    assert "could not be measured" in _measure(unread, 2, None)[-1] and unread.fits_up_to == {RECOMPUTE: None}
    assert unread.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), [])
    trial = _upsize_search()
    _measure(trial, 2, 4)
    trial.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    assert trial.relieve(trial.current, "out of memory at size 4", 4) == RECOMPUTE
    assert trial.trial is None and trial.trial_size is None and trial.rejected == {} and trial.settled == ()
    assert trial.layout_for_batch(True, lambda t: None, 2, 2, None, 1) == ((), [])
    # Its model was wrong at 4: never tried again this run, from a smaller size found neither...
    assert trial.fits_up_to == {RECOMPUTE: None}
    assert trial.layout_for_batch(True, lambda t: None, 1, 1, None, 1) == ((), [])
    # ...unless the memory it ran out under comes back (another process gave it up).
    grown = _upsize_search()
    _measure(grown, 2, 4)
    grown.layout_for_batch(True, lambda t: None, 2, 2, None, 1, capacity=10**9)
    assert grown.relieve(grown.current, "out of memory at size 4", 4, capacity=10**9) == RECOMPUTE
    assert grown.failed_under == {RECOMPUTE: 10**9}
    assert grown.layout_for_batch(True, lambda t: None, 1, 1, None, 1, capacity=10**9) == ((), [])
    layout, lines = grown.layout_for_batch(True, lambda t: None, 1, 1, None, 1, capacity=2 * 10**9)
    assert "may be tried again: the memory capacity grew past the 953.7 MiB its trial ran out under" in lines[0], lines
    assert layout == (RECOMPUTE,) and grown.trial.measure, "measured again"


def test_recompute_is_not_measured_where_the_size_found_runs_the_whole_batch_and_waits_while_memory_is_taken():
    whole = _upsize_search()
    assert whole.layout_for_batch(True, lambda t: None, 2, 2, None, 1, capacity=10**9, whole_batch=2) == ((), [
        "layout trade recompute (activation checkpointing on) not tried: the size found runs the whole batch in one "
        "microbatch, no larger microbatch exists"
    ])
    assert whole.trial is None and whole.upsized_from == [2]
    shrunk = _upsize_search()
    shrunk.layout_for_batch(True, lambda t: None, 2, 2, None, 1, capacity=10**9, whole_batch=8)
    shrunk.observe((RECOMPUTE,), 1.0)
    shrunk.measured(None, "how", fits_up_to=4, capacity=10**9)
    assert shrunk.fits_capacity == {RECOMPUTE: 10**9}
    # Another process took a fifth of the memory since: no trial, nothing said twice, nothing lost.
    assert shrunk.layout_for_batch(True, lambda t: None, 2, 2, None, 1, capacity=8 * 10**8, whole_batch=8) == ((), [])
    assert shrunk.upsized_from == []
    layout, _ = shrunk.layout_for_batch(True, lambda t: None, 2, 2, None, 1, capacity=10**9, whole_batch=8)
    assert layout == (RECOMPUTE,) and shrunk.trial_size == 4, "the memory is back: tried"
    restored = _upsize_search()
    restored.load_state_dict(shrunk.state_dict())
    assert restored.fits_capacity == {RECOMPUTE: 10**9}


def test_recompute_cannot_be_pinned():
    with pytest.raises(LayoutConfigError, match="activation_checkpointing: true"):
        LayoutConfig.parse([RECOMPUTE])


def test_recompute_kept_under_less_memory_is_undone_when_the_memory_comes_back_and_tried_again():
    """A card not all ours (one H200, a 12 GiB neighbour that left): checkpointing was kept at 8 from 2 under
    26.8 GiB; the memory came back (39.1 GiB) and the run stayed at 5 with it, 0.84x Composer's
    size 4 without. A kept upsize trade is undone once the capacity grows past the one it was kept
    under; the size is searched again from the size found without it; then it is measured again."""
    search = _upsize_search()
    _measure(search, 2, 4)
    layout, _ = search.layout_for_batch(True, lambda t: None, 2, 2, None, 1, capacity=10**9)
    search.observe(layout, 1.0)
    search.observe(search.layout_for_batch(True, lambda t: None, 2, 2, None, 1, capacity=10**9)[0], 2.0)
    assert search.decide(search.local_times(), capacity=10**9).kept and search.settled == (RECOMPUTE,)
    assert search.kept_under == {RECOMPUTE: (10**9, 2)}
    assert search.reconsider(int(1.04 * 10**9)) == (None, []), "within 5%: the same memory"
    restored = _upsize_search()
    restored.load_state_dict(search.state_dict())
    assert restored.kept_under == {RECOMPUTE: (10**9, 2)}
    size, lines = restored.reconsider(2 * 10**9)
    assert size == 2 and restored.settled == () and restored.kept_under == {}
    assert lines == [
        "layout trade recompute (activation checkpointing on) undone: the memory capacity grew past the 953.7 MiB "
        "it was kept under; the size is searched again from 2 without it, then it is measured and tried again"
    ]
    assert restored.reconsider(4 * 10**9) == (None, []), "once"
    # From the size found next (say 3 without it), measured again: it may be kept again or not.
    layout, _ = restored.layout_for_batch(True, lambda t: None, 3, 3, None, 1, capacity=2 * 10**9)
    assert layout == (RECOMPUTE,) and restored.trial.measure and restored.trial.from_size == 3
    # A trade kept with no capacity read (no memory figures) is never reconsidered.
    blind = _upsize_search()
    _measure(blind, 2, 4)
    blind.layout_for_batch(True, lambda t: None, 2, 2, None, 1)
    blind.observe((RECOMPUTE,), 1.0)
    blind.observe(blind.layout_for_batch(True, lambda t: None, 2, 2, None, 1)[0], 2.0)
    assert blind.decide(blind.local_times()).kept and blind.reconsider(10**12) == (None, [])


# ---- size trials: the largest microbatch that fits is not always the fastest -------------------


def _halves(batch: int):
    """The largest microbatch of a batch of `batch` split evenly at size found n (the policy's split)."""
    return lambda n: -(-batch // -(-batch // n))


def _sized_run(search: LayoutSearch, found: int, largest_at, with_s: float, without_s: float) -> tuple[list[str], TrialResult]:
    """One size trial from `found` run to its verdict: the "with" batches take `with_s`, the others `without_s`."""
    layout, lines = search.layout_for_batch(True, lambda t: None, largest_at(found), found, None, None, largest_at)
    assert search.trial is not None and search.trial.sized, lines
    while not search.needs_agreement:
        size = search.trial_size
        search.observe(layout, with_s if size is not None else without_s)
        layout, _ = search.layout_for_batch(True, lambda t: None, largest_at(found), found, None, None, largest_at)
    return lines, search.decide(search.local_times())


def test_a_size_trial_runs_half_then_a_quarter_of_the_microbatch_found_once_the_trades_are_done():
    """No trade left (none is a candidate): a size trial runs the largest size whose split's largest
    microbatch is at most half the size found's, interleaved with the size found; slower, not kept,
    then a quarter; each pair of sizes once. A batch of 32, found 26 (split 16, 16)."""
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=2), [])
    largest_at = _halves(32)
    lines, half = _sized_run(search, 26, largest_at, with_s=2.2, without_s=2.0)
    assert lines == [
        "size trial: microbatch 8 against 26, the size found: 2 batches at 8, as many at 26 (the largest that fits "
        "is not always the fastest)"
    ]
    assert not half.kept and half.size == 8 and half.trade == "smaller_microbatch", half
    assert half.line().startswith("size trial: microbatch 8 against 26, the size found: not kept; median batch 2.2000 s")
    lines, quarter = _sized_run(search, 26, largest_at, with_s=2.5, without_s=2.0)
    assert quarter.size == 4 and not quarter.kept, quarter
    assert search.layout_for_batch(True, lambda t: None, 16, 26, None, None, largest_at) == ((), [])
    assert search.sized == [(26, 8), (26, 4)] and search.settled == ()
    # A checkpoint keeps what was tried.
    restored = LayoutSearch(LayoutConfig.parse("auto", trial_batches=2), [])
    restored.load_state_dict(search.state_dict())
    assert restored.sized == [(26, 8), (26, 4)]
    assert restored.layout_for_batch(True, lambda t: None, 16, 26, None, None, largest_at) == ((), [])


def test_a_faster_smaller_size_is_kept_and_the_trials_go_on_from_it():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=3), [])
    largest_at = _halves(32)
    # Arms interleave: with, without, with, ... ; with a spread smaller than the gain.
    _, half = _sized_run(search, 26, largest_at, with_s=1.2, without_s=1.27)
    assert half.kept and half.size == 8, half  # the caller adopts 8 (LayoutTrials.adopted)
    # From 8 (the size policy settled there): half of it next, 4; not faster, then 2.
    _, next_half = _sized_run(search, 8, largest_at, with_s=1.3, without_s=1.2)
    assert next_half.size == 4 and not next_half.kept


def test_no_size_trial_where_no_smaller_split_exists_or_it_is_switched_off():
    largest_at = _halves(32)
    one = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [])
    assert one.layout_for_batch(True, lambda t: None, 1, 1, None, None, largest_at) == ((), []) and one.trial is None
    off = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1, size_trials=False), [])
    assert off.layout_for_batch(True, lambda t: None, 16, 26, None, None, largest_at) == ((), []) and off.trial is None
    # Without the split (a token budget: `largest_at` None), no size trial either.
    tokens = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [])
    assert tokens.layout_for_batch(True, lambda t: None, 16, 26, None, None, None) == ((), [])
    # Not while the size is still searched, nor with a trade left to try: trades go first.
    first = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE])
    assert first.layout_for_batch(False, lambda t: None, 16, 26, None, None, largest_at)[0] == ()
    assert first.trial is None
    layout, _ = first.layout_for_batch(True, lambda t: None, 16, 26, None, None, largest_at)
    assert layout == (GRAD_SYNC_ONCE,) and not first.trial.sized
    with pytest.raises(LayoutConfigError, match="layout_size_trials='yes'"):
        LayoutConfig.parse("auto", size_trials="yes")


def test_pressure_in_a_size_trial_ends_it_and_undoes_the_last_kept_trade():
    search = LayoutSearch(LayoutConfig.parse("auto", trial_batches=1), [GRAD_SYNC_ONCE])
    _run_trial(search, 1.0, 2.0)
    assert search.settled == (GRAD_SYNC_ONCE,)
    largest_at = _halves(32)
    layout, lines = search.layout_for_batch(True, lambda t: None, 16, 26, None, None, largest_at)
    assert search.trial is not None and search.trial.sized and layout == (GRAD_SYNC_ONCE,), lines
    assert search.relieve(layout, "out of memory", 16) == GRAD_SYNC_ONCE
    assert search.trial is None and search.settled == ()
    assert (26, 8) in search.sized  # not tried again from 26


class _Peaks:
    """A memory source whose peak the test sets, one microbatch at a time."""

    def __init__(self) -> None:
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = 0

    def peak_bytes(self) -> int:
        return self.peak


def _by_size(sizes, reduction, last_apart):
    """Microbatch peaks 40,000 + 2,700 a sample, the last one `reduction` more (gradients reduced once per batch)."""
    from automicro.core.memory import MicrobatchPeaks

    source = _Peaks()
    peaks = MicrobatchPeaks(source, sizes, last_apart)
    for index, size in enumerate(sizes):
        peaks.start(index)
        source.peak = 40_000 + 2_700 * size + (reduction if index == len(sizes) - 1 else 0)
    peaks.end()
    return peaks.by_size()


@pytest.mark.parametrize("sizes", [(1, 1, 2, 2, 2, 2, 2, 2, 2), (6, 6, 3, 1), (8, 8, 8, 7, 1)])
def test_with_gradients_reduced_once_the_last_microbatch_raises_the_measured_line_and_sets_no_slope(sizes):
    """Mixtral's blocks on one H100, gradients reduced once per batch: the line through the probe's sizes (the last
    microbatch a 2, its peak holding the reduction) was twice as steep as the model allows (`MicrobatchPeaks`)."""
    (a, pa), (b, pb) = _by_size(sizes, 2_600, last_apart=True)
    assert (pb - pa) / (b - a) == 2_700  # the slope of the microbatches between the first and the last
    assert pa == 40_000 + 2_700 * a + 2_600  # raised by what the last one holds above it: it bounds every microbatch
    (a, pa), (b, pb) = _by_size(sizes, 0, last_apart=True)
    assert pa == 40_000 + 2_700 * a and (pb - pa) / (b - a) == 2_700  # a last microbatch like the others: nothing moves
    if sizes[-1] == max(sizes[1:-1]):
        # Not apart, the last one's peak sets its size's (the line the probe's split measured before).
        (a, pa), (b, pb) = _by_size(sizes, 2_600, last_apart=False)
        assert (pb - pa) / (b - a) == 2_700 + 2_600


def test_with_the_last_microbatch_apart_and_one_size_before_it_the_last_counts_as_any_other():
    assert _by_size((6, 5, 5), 2_600, last_apart=True) == ((5, 40_000 + 2_700 * 5 + 2_600),)
    assert _by_size((2, 1, 2), 0, last_apart=True) == ((1, 42_700), (2, 45_400))
