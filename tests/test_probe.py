"""The probe (`PolicyConfig.probe`): two small sizes in the first attempt, then the memory model
ends the search (at most 2 OOMs, converged early, never a size that fails later).

A simulated device, as a GPU behaves: a microbatch's peak is the fixed bytes (parameters, the
optimizer state once the first step made it) + the gradients (from the second microbatch on: the
first one's backward creates them) + bytes per sample. An attempt runs out of memory when any
microbatch's peak exceeds the usable memory, which may be below the reported capacity
(fragmentation, `loss`). Before the first step the reported peaks carry the optimizer state that
step will create (`Success.projected`), as `AutoMicrobatching` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automicro.testing.multiprocess import run_multiprocess
from tests import optimizer_cases
from automicro.core.policy import (
    OOM,
    PREDICTED_EDGE,
    Phase,
    PolicyConfig,
    SearchPolicy,
    SearchState,
    Success,
    Thrash,
    chunk_split,
    even_split,
    probe_split,
)

GIB = 2**30


@dataclass
class Device:
    fixed: int
    grads: int
    per_sample: int
    optimizer: int
    capacity: int
    loss: float = 0.0  # the share of the capacity the allocator cannot use
    # What the capacity reading says (None: the capacity): a shared card read as if it were all ours.
    reported: Optional[int] = None

    @property
    def read(self) -> int:
        return self.capacity if self.reported is None else self.reported

    def peaks(self, split: tuple[int, ...], stepped: bool) -> list[int]:
        state = self.optimizer if stepped else 0
        return [self.fixed + state + (self.grads if i else 0) + self.per_sample * m for i, m in enumerate(split)]

    def fits(self, split: tuple[int, ...], stepped: bool) -> bool:
        return max(self.peaks(split, stepped)) <= self.capacity * (1 - self.loss)

    def reached(self, split: tuple[int, ...], stepped: bool) -> int:
        """What a failed attempt had reached: the peaks of the microbatches before the one that ran
        out, and that one's bytes up to the allocation that failed (a sixteenth of its activations:
        one layer's largest tensor, or the logits)."""
        usable, reached = self.capacity * (1 - self.loss), 0
        for m, peak in zip(split, self.peaks(split, stepped)):
            if peak > usable:
                return int(max(reached, usable - self.per_sample * m / 16))
            reached = max(reached, peak)
        raise AssertionError(f"{split} fits")

    def largest_fit(self, batch: int) -> int:
        """The largest size whose split of the batch fits once the optimizer state exists (0: none)."""
        return max((m for m in range(1, batch + 1) if self.fits(chunk_split(batch, m), True)), default=0)


@dataclass
class Run:
    found: int
    ooms: int
    batches: int  # batches until the size was found (the batch that found it counted)
    tried: list[tuple[tuple[int, ...], str]]


def search(device: Device, batch: int, config: PolicyConfig = PolicyConfig(probe=True), max_attempts: int = 40) -> Run:
    policy = SearchPolicy(config, batch)
    stepped, ooms, batches, tried = False, 0, 0, []
    while policy.phase == Phase.SEARCHING:
        split = policy.current_split()
        assert sum(split) == batch and max(split) == policy.state.size, split
        if not device.fits(split, stepped):
            tried.append((split, "oom"))
            ooms += 1
            policy.observe(OOM(max(split), reached_bytes=device.reached(split, stepped), capacity_bytes=device.read))
        else:
            peaks = device.peaks(split, stepped)
            pending = 0 if stepped else device.optimizer
            by_size: dict[int, int] = {}
            for i, (m, peak) in enumerate(zip(split, peaks)):
                if i:
                    by_size[m] = max(by_size.get(m, 0), peak + pending)
            tried.append((split, "ok"))
            policy.observe(
                Success(
                    max(split), max(peaks) + pending, device.read, projected=not stepped,
                    peaks_by_size=tuple(sorted(by_size.items())),
                )
            )
            stepped, batches = True, batches + 1
        assert len(tried) <= max_attempts, tried
    return Run(policy.state.found, ooms, batches, tried)


def llama_1b(capacity_gib: float, loss: float = 0.0) -> Device:
    """Roughly the 1B Llama of the issue's table, seq 2048, unsharded with autocast."""
    return Device(
        fixed=int(6 * GIB), grads=int(4 * GIB), per_sample=int(6.5 * GIB), optimizer=int(8 * GIB),
        capacity=int(capacity_gib * GIB), loss=loss,
    )


def test_probe_split():
    assert probe_split(32) == (1, 1) + (2,) * 15
    assert probe_split(33) == (1, 1) + (2,) * 15 + (1,)
    assert probe_split(4) == (1, 1, 2)
    assert probe_split(3) is None, "too small to run both sizes after the first microbatch"
    assert probe_split(16, floor=2) == (2, 2, 3, 3, 3, 3)
    assert probe_split(6, floor=2) is None
    with pytest.raises(ValueError, match="floor"):
        probe_split(8, floor=0)


def test_first_attempt_is_the_probe_only_where_it_applies():
    assert SearchPolicy(PolicyConfig(probe=True), 32).current_split() == probe_split(32)
    assert SearchPolicy(PolicyConfig(probe=True), 3).current_split() == (3,), "too small: the whole batch"
    assert SearchPolicy(PolicyConfig(), 32).current_split() == (32,), "off: the whole batch first, as before"
    for off in (PolicyConfig(probe=True, search="halve"), PolicyConfig(probe=True, use_prediction=False),
                PolicyConfig(probe=True, sizes_for=lambda b: (1, 2, 4, 8, 16, 32))):
        assert SearchPolicy(off, 32).current_split() == (32,), off
    with pytest.raises(ValueError, match="start_size"):
        PolicyConfig(probe=True, start_size=4)
    with pytest.raises(ValueError, match="probe"):
        PolicyConfig(probe=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity_gib, loss", [(32, 0.0), (32, 0.03), (50, 0.0), (76, 0.0), (76, 0.04), (139, 0.02)])
def test_llama_levels_converge_with_at_most_one_oom(capacity_gib, loss):
    """The issue's memory levels (0.40 and 0.95 of an H100, an H200): the size found is the largest
    that fits under the model's margin, or larger, and never one that runs out later."""
    device = llama_1b(capacity_gib, loss)
    run = search(device, 32)
    truth = device.largest_fit(32)
    assert run.tried[0][0] == probe_split(32)
    assert 1 <= run.found <= truth, run
    assert run.found >= truth - 1 - int(0.05 * device.capacity / device.per_sample + 1), run
    assert run.ooms <= 1, run
    assert run.batches <= 3, run


def test_old_start_spends_the_ooms_the_probe_saves():
    """The same device without the probe: halving down from the whole batch (the numbers on GPUs)."""
    device = llama_1b(32)
    old, new = search(device, 32, PolicyConfig()), search(device, 32)
    assert old.found == new.found == device.largest_fit(32) == 2
    assert old.ooms >= 4 and new.ooms == 0, (old, new)


def test_converges_without_trying_above_when_the_model_says_it_cannot_fit():
    device = llama_1b(32)  # 2 fits, 3 does not
    run = search(device, 32)
    assert [outcome for _, outcome in run.tried] == ["ok"], run
    assert run.found == 2 and run.batches == 1


def test_edge_try_once_then_converge():
    """Upward, the margin says no, the whole capacity says one more: that size is tried once; its
    OOM ends the search at the best success without a bisection."""
    device = llama_1b(80, loss=0.06)  # the margin says 8, the whole capacity 9; 9 does not fit
    run = search(device, 32)
    sizes = [max(split) for split, _ in run.tried]
    assert sizes == [2, 8, 9] and [o for _, o in run.tried] == ["ok", "ok", "oom"], run
    assert run.found == 8 and run.ooms == 1 and run.batches == 2, run  # batch 2 reruns at 8, settling
    fits = search(llama_1b(80), 32)  # no loss: 9 fits, and the model now says 10 cannot
    assert [max(split) for split, _ in fits.tried] == [2, 8, 9] and fits.found == 9 and fits.ooms == 0, fits


def test_event_says_why_it_stopped():
    device = llama_1b(32)
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    peaks = device.peaks(probe_split(32), False)
    d = policy.observe(Success(2, max(peaks) + device.optimizer, device.capacity, projected=True,
                               peaks_by_size=((1, peaks[1] + device.optimizer), (2, peaks[2] + device.optimizer))))
    assert d.phase == Phase.SETTLING and d.next_size == 2 and PREDICTED_EDGE in d.event, d


def test_everything_fits_goes_to_the_whole_batch():
    device = Device(fixed=GIB, grads=GIB, per_sample=GIB // 64, optimizer=2 * GIB, capacity=80 * GIB)
    run = search(device, 32)
    assert run.found == 32 and run.ooms == 0 and run.batches == 2, run
    assert run.tried[1][0] == (32,)


def test_probe_size_that_does_not_fit():
    """Even the probe's larger size runs out: an OOM, then the floor."""
    device = Device(fixed=60 * GIB, grads=8 * GIB, per_sample=7 * GIB, optimizer=0, capacity=80 * GIB)
    run = search(device, 16)
    assert run.tried[0] == (probe_split(16), "oom")
    assert run.found == 1 and run.ooms == 1, run


def test_probe_projected_not_to_fit_searches_below_without_an_oom():
    """The probe ran before the optimizer state existed, and with it size 2 would not fit."""
    device = Device(fixed=30 * GIB, grads=8 * GIB, per_sample=7 * GIB, optimizer=30 * GIB, capacity=80 * GIB)
    assert device.fits(probe_split(16), False) and not device.fits((2, 2), True)
    run = search(device, 16)
    assert run.found == 1 and run.ooms == 0, run


def test_model_overestimates_the_usable_memory():
    """A size the model says fits runs out (a large loss): the next try is predicted under the
    model's peak at that size, and the search still ends within two OOMs."""
    device = llama_1b(76, loss=0.12)
    run = search(device, 32)
    assert run.found == device.largest_fit(32) or run.found == device.largest_fit(32) - 1, run
    assert run.ooms <= 2, run


def test_an_oom_the_line_cannot_explain_is_bisected_and_the_search_spends_no_second_oom():
    """The probe's outcomes on a CPU rank under torch 2.11 (`optimizer_cases.fit`, the limit halfway
    between sizes 4 and 8, 2026-11-29), replayed. Something fixed holds the small sizes' peak up there
    (0.35 MB a sample from 1 to 2, 1.33 from 6 to 8; torch 2.7: 0.62, then 1.0): the line through the
    probe's sizes predicts 10, which runs out below where the line puts its peak. Predicting again
    under what that OOM reached gave 9, which ran out too, then 5. The failure the line cannot explain
    is bisected instead: 6 fits, its two sizes give a line that says 7 does not, and the search ends at
    6, the largest size that fits, after one OOM."""
    capacity = 20_283_706
    policy = SearchPolicy(PolicyConfig(probe=True), 16)
    d = policy.observe(Success(2, 16_608_817, capacity, projected=True, peaks_by_size=((1, 16_280_241), (2, 16_608_817))))
    assert d.next_size == 10 and "predicted" in d.event, d
    d = policy.observe(OOM(10, ranks=(0,), reached_bytes=19_992_898, capacity_bytes=capacity))
    assert d.next_size == 6 and d.event == "OOM at 10 -> try 6 (bounds 2..10)", d
    d = policy.observe(Success(6, 20_054_334, capacity, peaks_by_size=((4, 17_855_550), (6, 20_054_334))))
    assert policy.phase == Phase.SETTLING and policy.state.found == 6 and PREDICTED_EDGE in d.event, d


def test_without_per_size_peaks_the_search_still_converges():
    """Where the microbatches' peaks are not measured (a memory source without them), the attempt's
    peak is the one sample: the probe's size, and the search goes on as before from there."""
    device = llama_1b(76)
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    stepped, attempts = False, 0
    while policy.phase == Phase.SEARCHING and attempts < 40:
        split, attempts = policy.current_split(), attempts + 1
        if device.fits(split, stepped):
            pending = 0 if stepped else device.optimizer
            policy.observe(Success(max(split), max(device.peaks(split, stepped)) + pending, device.capacity, projected=not stepped))
            stepped = True
        else:
            policy.observe(OOM(max(split)))
    assert policy.state.found == device.largest_fit(32)


def test_probe_state_survives_a_checkpoint():
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    restored = SearchState.from_dict(policy.state.to_dict())
    assert restored == policy.state
    resumed = SearchPolicy(PolicyConfig(probe=True), 32)
    resumed.state = restored
    assert resumed.current_split() == probe_split(32)


def _physical(batch, fixed, grads, per_tenth, optimizer, capacity, loss_pct, reported=None):
    """The drawn device (sizes in GiB, a tenth of a GiB per sample), or None where it is not
    physical: even size 1 does not fit (CannotFitError, tested in test_policy), or a larger size fits
    and a smaller not (one microbatch, no gradients yet)."""
    device = Device(
        fixed=fixed * GIB, grads=grads * GIB, per_sample=per_tenth * GIB // 10, optimizer=optimizer * GIB,
        capacity=capacity * GIB, loss=loss_pct / 100, reported=reported,
    )
    truth = device.largest_fit(batch)
    if truth == 0 or not all(device.fits(chunk_split(batch, m), True) for m in range(1, truth + 1)):
        return None
    return device


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 96),
    fixed=st.integers(1, 40),
    grads=st.integers(0, 10),
    per_tenth=st.integers(1, 200),
    optimizer=st.integers(0, 20),
    capacity=st.integers(20, 140),
    loss_pct=st.integers(0, 8),
)
def test_property_never_a_size_that_fails_later_at_most_two_ooms(batch, fixed, grads, per_tenth, optimizer, capacity, loss_pct):
    device = _physical(batch, fixed, grads, per_tenth, optimizer, capacity, loss_pct)
    if device is None:
        return
    run = search(device, batch)
    # Never a size that runs out once the optimizer state exists, as far as the reported capacity
    # tells (memory the allocator loses is only found by running out: the floor rule's rerun).
    lossless = Device(device.fixed, device.grads, device.per_sample, device.optimizer, device.capacity)
    assert 1 <= run.found <= lossless.largest_fit(batch), run
    assert lossless.fits(even_split(batch, run.found), True), run
    assert run.ooms <= 2 and run.batches <= 3, run


def test_the_yaml_key_reaches_the_callback_and_bad_values_say_what_to_change(tmp_path):
    import torch

    from automicro.config import ConfigError, load_config
    from automicro.engine.unsharded import UnshardedModel
    from automicro.composer.builders import build_callbacks
    from automicro.composer.callback import AutoMicrobatching

    def callback(body: str):
        path = tmp_path / "c.yaml"
        path.write_text("callbacks:\n  auto_microbatching:\n" + body)
        return next(c for c in build_callbacks(load_config(str(path))) if type(c).__name__ == "AutoMicrobatching")

    assert callback("    start_size: probe\n").policy_config.probes
    assert not callback("    start_size: batch\n").policy_config.probes
    assert callback("    start_size: 4\n").policy_config.start_size == 4
    default = callback("    stable_batches: 3\n")
    assert default.start == "auto" and not default.policy_config.probe, "resolved at attach, by the device"
    for body, message in [
        ("    start_size: quick\n", "start_size='quick': must be left out"),
        ("    start_size: probe\n    search: halve\n", "start_size='probe' needs search='bisect'"),
        ("    start_size: probe\n    budget: tokens\n", "budget='tokens'"),
        ("    start_size: probe\n    use_prediction: false\n", "use_prediction=true"),
        ("    start_size: 0\n", "start_size=0"),
    ]:
        with pytest.raises((ConfigError, ValueError)) as error:
            callback(body)
        assert message in str(error.value), (body, str(error.value))
    # The default resolves by the device the model trains on: the whole batch first on CPU, the
    # probe on a GPU (a CUDA device object is all `attach` reads of it here).
    for device, probes in (("cpu", False), ("cuda", True)):
        auto = AutoMicrobatching(log_attempts=False)
        auto.attach(UnshardedModel(module=torch.nn.Linear(2, 2), device=torch.device(device)))
        assert auto.policy_config.probe is probes, device
        auto.close(None, None)


@pytest.mark.multiproc
def test_two_ranks_probe_first_finds_the_size_with_fewer_ooms_than_the_whole_batch_first():
    """On CPU ranks: the probe's split first ((1, 1, 2, ...)), the size its two
    agreed per-microbatch peaks predict, at most one OOM, none once the size is chosen; the same
    training as a fixed run at that size."""
    ranks = run_multiprocess(optimizer_cases.probe, world_size=2, timeout_s=600)
    for out in ranks:
        probe, whole = out["probe"], out["batch"]
        _check_probe(out)
        assert whole["ooms"] > probe["ooms"], (whole["history"], probe["history"])
        # The largest size that fits, or one below it where the model's margin stops it.
        assert probe["found"] in (whole["found"], whole["found"] - 1), (probe["history"], whole["history"])
        assert out["next_size_peak"] is None or out["next_size_peak"] > out["limit"] * 0.95, out
        _check_shared_card(out)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.many_ranks)])
def test_one_and_four_ranks_probe_first_and_train_like_the_fixed_size(world):
    for out in run_multiprocess(optimizer_cases.probe, world_size=world, args=(False,), timeout_s=900):
        # On one rank the split alone moves AdamW's parameters by 3.7e-5 to 7.2e-5 after 6 batches
        # (fixed runs at sizes 2, 4 and 6 against each other, measured 2026-11-26): the bound is
        # that floor, not 1e-5. On 4 ranks 1.21e-5 on one machine (deterministic, before 2026-11-29
        # too; under 1e-5 on CI's): the same rounding, so 5e-5 (a leaked attempt moves them by ~lr).
        _check_probe(out, tolerance=5e-5 if world > 1 else 1e-4)
        _check_shared_card(out, tolerance=5e-5 if world > 1 else 1e-4)


def _check_shared_card(out, tolerance=1e-5):
    """A card not all ours on 1, 2 and 4 ranks (`optimizer_cases.shared_card`): the capacity reads 3x the limit:
    at most 3 OOMs to converge, a size that fits, the parameters of a fixed run at it. The limit drops
    below size 4's peak at batch 4 and comes back at batch 8: the run goes on, shrinks with a line that
    says why, and is back at its size once the memory is."""
    shared = out["shared"]
    told, moving = shared["told"], shared["moving"]
    assert told["ooms"] <= 3, told["history"]
    assert 4 <= told["found"] < 8, told["history"]
    assert shared["diff"] < tolerance, shared["diff"]
    used = [max(split) for split in moving["used"]]
    assert len(used) == 12, moving["history"]
    before, during, after = used[3], used[4:8], used[-1]
    assert 4 <= before < 8 and max(during[1:]) < 4, (used, moving["history"])
    assert after >= before, (used, moving["history"])
    notes = " / ".join(note for _, _, _, note in moving["history"])
    assert "memory capacity shrank" in notes and "memory capacity grew" in notes, moving["history"]
    # Memory only reference cycles hold (the cyclic collector off, as llm-foundry's scheduled_gc
    # has it): the failed attempt's wipe collects it, the rerun at the size found fits, and the run
    # never settles below that size (before the fix: 4, 3, 2, then 1 in ten batches).
    held = shared["held"]
    used = [max(split) for split in held["used"]]
    assert len(used) == 10 and 4 <= used[3] < 8, held["history"]
    assert min(used[3:]) >= used[3], (used, held["history"])
    late = [i for i, (batch, _, outcome, _) in enumerate(held["history"]) if outcome == "oom" and batch > 3]
    assert late, ("the garbage never ran the size found out: the case tests nothing", held["history"])
    for i in late:
        batch, size, _, _ = held["history"][i]
        assert held["history"][i + 1][:3] == (batch, size, "ok"), held["history"]


def _check_probe(out, tolerance=1e-5):
    probe = out["probe"]
    assert out["peaks"][4][1] < out["limit"] < out["peaks"][8][1], out
    assert probe["splits"][0] == [1, 1] + [2] * 7, probe["splits"]
    assert probe["ooms"] <= 1, probe["history"]
    assert not any("phase" in note for _, _, outcome, note in probe["history"] if outcome == "oom")
    assert 4 <= probe["found"] < 8, probe["history"]
    assert out["diff"] < tolerance, out["diff"]


# ---- a card that is not all ours ------------------------------------------------------------


def train(policy: SearchPolicy, device: Device, batches: int, stepped: bool = True) -> tuple[list[tuple[int, ...]], int]:
    """`batches` batches as `AutoMicrobatching` runs them (an OOM reruns the same batch at the next
    split): the split each batch trained at, and the OOMs spent."""
    used, ooms = [], 0
    for _ in range(batches):
        for _attempt in range(40):
            split = policy.current_split()
            if device.fits(split, stepped):
                pending = 0 if stepped else device.optimizer
                by_size: dict[int, int] = {}
                for i, (m, peak) in enumerate(zip(split, device.peaks(split, stepped))):
                    if i:
                        by_size[m] = max(by_size.get(m, 0), peak + pending)
                peaks_by_size = tuple(sorted(by_size.items())) if policy.phase == Phase.SEARCHING else ()
                policy.observe(Success(max(split), max(device.peaks(split, stepped)) + pending, device.read,
                                       projected=not stepped, peaks_by_size=peaks_by_size))
                used.append(split)
                stepped = True
                break
            ooms += 1
            policy.observe(OOM(max(split), reached_bytes=device.reached(split, stepped), capacity_bytes=device.read))
        else:
            raise AssertionError(f"no split fits after 40 attempts: {used}")
    return used, ooms


@pytest.mark.parametrize("held_gib", [99.4, 103.0, 60.0])
def test_a_card_another_process_holds_converges_within_two_ooms(held_gib):
    """The issue's first row: 143 GiB read, another process holds most of it. Before, the
    prediction walked down one size per OOM (16 to 17 OOMs in one batch); the reached bytes of
    the first OOM now set the capacity."""
    device = llama_1b(143 - held_gib)
    device.reported = 143 * GIB
    run = search(device, 32)
    truth = device.largest_fit(32)
    # Under the margin, and under what the OOM reached (the allocation that failed is not in it).
    assert 1 <= run.found <= truth and run.found >= truth - 2, run
    assert run.ooms <= 2, run


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(1, 96),
    fixed=st.integers(1, 40),
    grads=st.integers(0, 10),
    per_tenth=st.integers(1, 200),
    optimizer=st.integers(0, 20),
    capacity=st.integers(20, 140),
    wrong_by=st.sampled_from([1.0, 1.3, 2.0, 3.0]),
    loss_pct=st.integers(0, 4),
)
def test_property_a_capacity_read_wrong_by_up_to_3x_costs_at_most_3_ooms(batch, fixed, grads, per_tenth, optimizer, capacity, wrong_by, loss_pct):
    device = _physical(batch, fixed, grads, per_tenth, optimizer, capacity, loss_pct, reported=int(wrong_by * capacity * GIB))
    if device is None:
        return  # not physical, as above
    truth = device.largest_fit(batch)
    policy = SearchPolicy(PolicyConfig(probe=True), batch)
    used, ooms = train(policy, device, 6, stepped=False)
    # A read that is right and memory the allocator does not lose: at most 2. Memory lost (loss_pct)
    # makes even a right read wrong by that much, found only by running out (the floor rule's rerun,
    # as in the property above): drawn in a CI run of 2026-11-28, batch 4, loss 4%: 3 OOMs (3; 2; its
    # rerun). The size that ran before the first step had a projected peak above the ceiling the OOM
    # at 3 then set; the policy does not yet re-judge a projected success against a later ceiling.
    assert ooms <= (2 if wrong_by == 1.0 and loss_pct == 0 else 3), (used, ooms, policy.state)
    assert policy.state.found is not None and 1 <= policy.state.found <= truth, policy.state
    assert device.fits(used[-1], True), "the size settled on trains"


def test_a_limit_that_shrinks_then_grows_back_neither_ends_the_run_nor_stays_below_what_fits():
    """Another process takes memory at batch 10 and gives it back at batch 20: the capacity read
    says so each time; the search shrinks at once (no rerun of a size that cannot fit any more, a
    line that says why) and goes back up once the memory is back."""
    device = llama_1b(76)
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    used, _ = train(policy, device, 10, stepped=False)
    before = max(used[-1])
    assert before == device.largest_fit(32) or before == device.largest_fit(32) - 1

    device.capacity = device.reported = int(40 * GIB)
    used, ooms = train(policy, device, 10)
    assert ooms == 1, "the first OOM under less memory shrinks: the capacity read shrank too"
    shrunk = max(used[-1])
    assert shrunk < before and device.fits(used[-1], True) and shrunk >= device.largest_fit(32) - 1
    assert policy.state.phase == Phase.STEADY

    device.capacity = device.reported = int(76 * GIB)
    decisions = []
    original = policy.observe
    policy.observe = lambda outcome: decisions.append(original(outcome)) or decisions[-1]  # type: ignore[method-assign]
    used, ooms = train(policy, device, 10)
    assert max(used[-1]) >= before - 1 and ooms <= 1, (used, ooms)
    assert any("memory capacity grew" in d.event for d in decisions), [d.event for d in decisions]


def test_a_capacity_that_shrank_says_so_and_does_not_rerun():
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    device = llama_1b(76)
    train(policy, device, 6, stepped=False)
    found = policy.state.found
    d = policy.observe(OOM(found, reached_bytes=int(35 * GIB), capacity_bytes=int(40 * GIB)))
    assert "memory capacity shrank" in d.event and "another process took memory" in d.event, d.event
    assert d.next_size < found and policy.state.retrying is None
    one_off = SearchPolicy(PolicyConfig(probe=True), 32)
    train(one_off, device, 6, stepped=False)
    d = one_off.observe(OOM(found, reached_bytes=int(70 * GIB), capacity_bytes=device.read))
    assert d.next_size == found and "rerun" in d.event, "the same capacity: a one-off, rerun at that size"


def test_the_ceiling_survives_a_checkpoint():
    device = llama_1b(40)
    device.reported = 143 * GIB
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    train(policy, device, 4, stepped=False)
    assert policy.state.ceiling is not None and policy.state.bound_capacity == 143 * GIB
    assert SearchState.from_dict(policy.state.to_dict()) == policy.state


def test_thrashing_under_less_memory_is_no_bound_once_the_memory_is_back():
    """An H200 (2026-11-26, a shared card): another process took 12 GiB, `auto` thrashed at 8 and settled on 5; the
    memory came back and the size stayed at 5. A thrash now records the capacity it happened under."""
    device = llama_1b(60)
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    train(policy, device, 6, stepped=False)
    before = policy.state.found
    policy.observe(Thrash(before))
    assert policy.state.first_failure == before and policy.state.bound_capacity == 60 * GIB
    train(policy, device, 6)
    assert policy.state.found < before
    device.capacity = device.reported = int(76 * GIB)
    events = []
    original = policy.observe
    policy.observe = lambda outcome: events.append(original(outcome).event) or None  # type: ignore[method-assign]
    train(policy, device, 8)
    assert policy.state.found >= before and any("memory capacity grew" in e for e in events), (events, policy.state)


@pytest.mark.parametrize("gib", [28, 33])
def test_a_size_the_model_capped_under_less_memory_is_searched_above_once_the_memory_is_back(gib):
    """An H200 (2026-11-27, memory that moves): another process held 12 GiB from the launch; `auto` converged on 2
    because the model predicted 3 would not fit (no OOM, so no bound); the 12 GiB came back at
    batch 14 and the size stayed at 2 for the rest of the run. 28 GiB: the size above ran, but its
    peak with the optimizer state was projected not to fit (a bound no OOM set)."""
    device = llama_1b(gib)
    policy = SearchPolicy(PolicyConfig(probe=True), 32)
    train(policy, device, 6, stepped=False)
    before = policy.state.found
    assert policy.state.phase == Phase.STEADY and policy.state.ceiling is None and before == device.largest_fit(32)
    assert (policy.state.first_failure is not None) == (gib == 28), policy.state
    train(policy, device, 4)
    assert policy.state.phase == Phase.STEADY and policy.state.found == before, "the same memory: nothing reopens"
    device.capacity = device.reported = int(50 * GIB)
    events = []
    original = policy.observe
    policy.observe = lambda outcome: events.append(original(outcome).event) or None  # type: ignore[method-assign]
    used, ooms = train(policy, device, 8)
    assert policy.state.found > before and ooms == 0, (events, policy.state)
    assert any("memory capacity grew" in e for e in events), events
    assert device.fits(used[-1], True) and max(used[-1]) >= device.largest_fit(32) - 1, (used, device.largest_fit(32))
