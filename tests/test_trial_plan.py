"""The trials' plan (`automicro.batch.trial_plan`) and what bounds them (`automicro.batch.batch_profile`): which
trial holds the batch, which are decided without running because a profiled batch says they cannot win, when
two batches a side decide, and what the trials cost. No processes: the plan and the profile's reading on their
own; the runs through a real model are in tests/test_sharding_choice.py (a bound that rules the twin out, a slow
FSDP2 path measured and the twin kept, the scope trial reusing the one-rank trial's times)."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from automicro.batch import batch_profile
from automicro.batch.batch_profile import BatchProfile, figures
from automicro.batch.trial_plan import PROFILE, SETTLED_BATCHES, TARGET_BATCH, TrialPlan
from automicro.batch.trial_timing import enough
from automicro.core.layout import GRAD_SYNC_ONCE, NO_RESHARD, LayoutConfig, LayoutSearch
from automicro.engine._torch_internals import ProfiledEvent


def _event(name, on_device, start, end, correlation=0, linked=0, thread=1):
    return ProfiledEvent((name, on_device, start * 1000, end * 1000, correlation, linked, thread))


def test_a_gpu_batchs_kernels_are_placed_by_the_range_that_launched_them():
    """Times in microseconds. Each kernel names its launch (a runtime call of the same correlation id) or, where
    that is missing, the operator its linked id names."""
    events = [
        _event("FSDP::all_gather (layers.0)", False, 0, 100),
        _event("Torch-Compiled Region: 0/1", False, 100, 300),
        _event("Optimizer.step#AdamW.step", False, 300, 400),
        _event("aten::cross_entropy_loss", False, 400, 450, correlation=77),
        _event("cudaLaunchKernel", False, 10, 11, correlation=1),  # in FSDP2's range
        _event("cuLaunchKernelEx", False, 110, 111, correlation=2),  # in the compiled region
        _event("cudaLaunchKernel", False, 310, 311, correlation=3),  # in the optimizer's step
        _event("cudaLaunchKernel", False, 410, 411, correlation=4),  # outside every range: a GEMM
        _event("cudaLaunchKernel", False, 420, 421, correlation=5),  # outside every range: elementwise
        _event("split_with_sizes_copy_out", True, 20, 60, correlation=1),
        _event("triton_poi_fused_add_mul_0", True, 120, 320, correlation=2),
        _event("multi_tensor_apply_kernel", True, 320, 360, correlation=3),
        _event("sm90_xmma_gemm_bf16bf16", True, 420, 470, correlation=4),
        _event("vectorized_elementwise_kernel", True, 470, 480, correlation=5),
        _event("log_softmax_forward", True, 480, 500, correlation=999, linked=77),  # placed by its operator
        _event("ncclDevKernel_AllGather", True, 500, 520),
        _event("mystery_kernel", True, 520, 530, correlation=12345),  # nothing names it
        _event("FSDP::all_gather (layers.0)", True, 0, 600),  # the range shown on the device: not work
    ]
    # The optimizer step's own gap (its kernels at 320-360 and 600-610, the device idle between): not a trial's.
    events += [_event("cudaLaunchKernel", False, 390, 391, correlation=6), _event("multi_tensor_apply_kernel", True, 600, 610, correlation=6)]
    events[2] = _event("Optimizer.step#AdamW.step", False, 300, 400)
    profile = figures(events, wall_s=0.001, device="cuda")
    # Busy 20-60, 120-360, 420-530 and 600-610 (the kernels' union) between the first and the last kernel: the gaps at
    # the clocked batch's ends are the clock's. The optimizer step's own gaps (from its first kernel, 320, to its last,
    # 610: 360-420 and 530-600) are the step's. What is left: 60-120.
    assert profile.idle_s == pytest.approx(60e-6)
    assert profile.fsdp_s == pytest.approx(40e-6)
    assert profile.comm_s == pytest.approx(20e-6)
    assert profile.fusable_s == pytest.approx(30e-6)  # the elementwise kernel and the loss's, not the GEMM nor the optimizer
    assert profile.unattributed_s == pytest.approx(10e-6) and profile.unattributed_names == ("mystery_kernel",)
    # Every bound holds the unattributed work: it is never smaller than the truth.
    assert profile.can_win(batch_profile.UNSHARDED) == pytest.approx(profile.idle_s + 40e-6 + 10e-6)
    assert profile.can_win(batch_profile.SCOPE) == pytest.approx(profile.idle_s + 30e-6 + 10e-6)
    assert "mystery_kernel" in profile.line()


def test_a_cpu_batchs_operators_are_its_device_work():
    events = [
        _event("FSDP::pre_forward", False, 0, 100),
        _event("aten::copy_", False, 10, 50),  # FSDP2's copy: its own work
        _event("aten::mm", False, 100, 300),  # a product: not fusable
        _event("aten::gelu", False, 300, 340),  # eager, fusable
        _event("Optimizer.step#SGD.step", False, 400, 500),
        _event("aten::_foreach_add_", False, 410, 480),  # the optimizer's: not fusable
        _event("c10d::allreduce_", False, 500, 520),
    ]
    profile = figures(events, wall_s=0.001, device="cpu")
    assert profile.fsdp_s == pytest.approx(40e-6) and profile.comm_s == pytest.approx(20e-6)
    assert profile.fusable_s == pytest.approx(40e-6)
    assert profile.idle_s == pytest.approx(0.001 - (40 + 240 + 70 + 20) * 1e-6)


def test_a_bound_under_the_rule_for_keeping_names_itself_and_one_over_it_does_not():
    profile = BatchProfile(wall_s=2.0, idle_s=0.004, fsdp_s=0.006, comm_s=0.1, fusable_s=0.5, device="cuda")
    assert profile.rules_out(batch_profile.UNSHARDED, 0.01) == (
        "it can win at most 0.50% of a 2.0000 s batch (the GPU idle 0.20%, FSDP2's own work 0.30%), under the 1% a "
        "trial must win")
    assert profile.rules_out(batch_profile.TRADE, 0.01) is None  # the collectives are 5%
    assert profile.rules_out(batch_profile.SCOPE, 0.01) is None
    assert profile.rules_out(batch_profile.SMALLER, 0.01) is not None  # idle only
    assert BatchProfile.from_micros(profile.to_micros(), "cuda") == profile


class _Consensus:
    """One rank: the agreed maximum is this rank's own."""

    def agree_max(self, values):
        return list(values)


class _Trial:
    """A trial as the plan sees it: pending until given the batch, then running for `batches` batches."""

    def __init__(self, name: str, kind: Optional[str], batches: int = 2, cost: float = 0.0, waits_for: tuple = ()) -> None:
        self.name, self.kind, self.batches, self.cost, self.waits_for = name, kind, batches, cost, waits_for
        self.min_gain = 0.01
        self.state = "pending"
        self.left = batches
        self.ruled_out: list[str] = []

    pending = property(lambda self: self.state == "pending")
    running = property(lambda self: self.state == "running")

    def bound_kind(self):
        return self.kind

    def rule_out(self, why):
        self.state = "ruled out"
        self.ruled_out.append(why)

    def projection(self):
        return f"{self.left} batches"

    def projected_cost_s(self, block_compile_s):
        return self.cost, "a compile"

    def step(self, turn):
        if turn == self.name:
            self.state = "running"
            self.left -= 1
            if self.left == 0:
                self.state = "done"


def _run(trials, profile, batches=40, planned=None, steady_from=2):
    lines: list[str] = []
    plan = TrialPlan(trials, _Consensus(), lines.append, torch.device("cpu"))
    plan.measured = lambda measured: profile
    plan.planned_batches = planned
    turns = []
    for batch in range(batches):
        turn = plan.before_batch(batch, batch >= steady_from, ("configuration",))
        turns.append(turn)
        for trial in trials:
            trial.step(turn)
        plan.after_batch(1)
    return plan, turns, lines


def test_the_unbounded_trials_run_first_then_one_profile_bounds_the_rest_in_order_of_what_they_can_win():
    static = _Trial("static", None, batches=3)
    one_rank = _Trial("one_rank", batch_profile.UNSHARDED)
    scope = _Trial("scope", batch_profile.SCOPE, waits_for=("one_rank",))
    layout = _Trial("layout", batch_profile.TRADE)
    # Collectives make the layout trades the most to win; the twin next; the scope waits for the twin.
    profile = BatchProfile(1.0, idle_s=0.02, fsdp_s=0.03, comm_s=0.2, fusable_s=0.5, device="cpu")
    plan, turns, lines = _run([static, one_rank, scope, layout], profile)
    assert turns[:2] == [None, None]  # the size not settled yet
    assert turns[2:5] == ["static"] * 3
    assert turns[5:7] == [PROFILE, PROFILE]  # a clocked batch, then the profiled one
    assert turns[7:13] == ["layout", "layout", "one_rank", "one_rank", "scope", "scope"], turns
    assert lines[0].startswith("a batch profiled: 1.0000 s"), lines
    assert plan.final_at == 13 and turns[13:] == [None] * (40 - 13)
    assert any(line.startswith("trials: the configuration was final at batch 13; the trials cost ") for line in lines), lines


def test_a_trial_the_profile_rules_out_never_runs_and_says_its_bound():
    one_rank = _Trial("one_rank", batch_profile.UNSHARDED)
    layout = _Trial("layout", batch_profile.TRADE)
    profile = BatchProfile(1.0, idle_s=0.002, fsdp_s=0.003, comm_s=0.2, fusable_s=0.0, device="cpu")
    _, turns, _ = _run([one_rank, layout], profile)
    assert one_rank.state == "ruled out" and "one_rank" not in turns
    assert one_rank.ruled_out == ["it can win at most 0.50% of a 1.0000 s batch (the CPU idle 0.20%, FSDP2's own work "
                                  "0.30%), under the 1% a trial must win"]
    assert turns.count("layout") == 2


def test_a_trial_whose_compile_costs_more_than_it_can_win_over_the_batches_left_does_not_run():
    """5% of a 1 s batch over the batches left, against a 60 s compile: worth it over 10,000 batches, not 1,000."""
    profile = BatchProfile(1.0, idle_s=0.01, fsdp_s=0.0, comm_s=0.0, fusable_s=0.04, device="cpu")
    short = _Trial("scope", batch_profile.SCOPE, cost=60.0)
    _run([short], profile, planned=1000)
    assert short.state == "ruled out" and short.ruled_out[0].startswith(
        "it can win at most 49.8 s over the 996 batches left of this run's 1,000 (5.00% of a 1.0000 s batch: "), short.ruled_out
    assert short.ruled_out[0].endswith("less than a compile costs (projected 60.0 s)")
    long = _Trial("scope", batch_profile.SCOPE, cost=60.0)
    _run([long], profile, planned=10000)
    assert long.state == "done" and not long.ruled_out


def test_what_is_still_running_at_the_target_batch_is_said_with_its_projection():
    slow = _Trial("static", None, batches=TARGET_BATCH + 5)
    _, _, lines = _run([slow], None, batches=TARGET_BATCH + 2)
    assert f"trials: still running at batch {TARGET_BATCH}, projected: static: " in "\n".join(lines), lines


def test_the_price_counts_the_trials_window_against_the_batches_after_it(monkeypatch):
    """The loop's clock, start to start: 2 s a trial batch, 1 s a settled one. The trials' window is every batch
    from the first with the size settled to the last before the final configuration ran."""
    now = [0.0]
    monkeypatch.setattr("automicro.batch.trial_plan.time.perf_counter", lambda: now[0])
    trial = _Trial("static", None, batches=4)
    lines: list[str] = []
    plan = TrialPlan([trial], _Consensus(), lines.append, torch.device("cpu"))
    plan.planned_batches = 100
    for batch in range(20):
        turn = plan.before_batch(batch, batch >= 2, ())
        trial.step(turn)
        plan.after_batch(1)
        now[0] += 2.0 if turn == "static" else 1.0
    assert plan.final_at == 6  # batches 2-5 held the trial
    assert plan.price == (f"trials: the configuration was final at batch 6; the trials cost 4.0 s against the settled "
                          f"configuration (1.0000 s a batch, the median of the {SETTLED_BATCHES} batches after), 4.0% of "
                          "this run's 100 batches")
    assert plan.summary().startswith("trials cost 4.0 s against the settled configuration")


def test_two_batches_a_side_decide_where_the_spread_is_tiny_and_three_otherwise():
    consensus = _Consensus()
    assert enough(consensus, [[1.000, 1.001], [2.0, 2.0]], 3, 0.01)  # spreads 0.05% and 0
    assert not enough(consensus, [[1.00, 1.02], [2.0, 2.0]], 3, 0.01)  # 1%: a third batch a side
    assert enough(consensus, [[1.00, 1.02, 1.01], [2.0, 2.0, 2.0]], 3, 0.01)
    assert not enough(consensus, [[1.0], [2.0]], 3, 0.01)
    assert not enough(consensus, [[1.0, 1.0], [2.0]], 3, 0.01)  # the arms unequal: not yet
    assert enough(consensus, [[1.0]], 1, 0.01)  # a trial of one batch a side


def _layout(candidates=(GRAD_SYNC_ONCE, NO_RESHARD)):
    return LayoutSearch(LayoutConfig("auto", (), 3, 0.01), list(candidates))


def test_the_layout_search_passes_over_a_trade_or_a_size_trial_its_bound_rules_out():
    search = _layout()
    ruled = {"trade": "it can win at most 0.40% of a 1.0000 s batch", "smaller": "it can win at most 0.10%"}
    layout, lines = search.layout_for_batch(True, lambda trade: None, size=8, found=8, largest_at=lambda n: n,
                                            bounded=ruled.get)
    assert search.trial is None and layout == ()
    assert lines[:2] == [
        "layout trade grad_sync_once (gradients reduced once per batch) not tried: it can win at most 0.40% of a 1.0000 s batch",
        "layout trade no_reshard (no resharding after forward, nor between microbatches) not tried: it can win at most 0.40% of a 1.0000 s batch",
    ], lines
    assert search.layout_for_batch(True, lambda trade: None, size=8, found=8, largest_at=lambda n: n, bounded=ruled.get)[1] == []
    # Another size found: bounded again from a new profile (here it may run).
    search.layout_for_batch(True, lambda trade: None, size=6, found=6, largest_at=lambda n: n, bounded=lambda kind: None)
    assert search.trial is not None and search.trial.trades == (GRAD_SYNC_ONCE,)


def test_gradients_reduced_once_is_not_tried_where_the_batch_runs_in_one_microbatch():
    search = _layout()
    _, lines = search.layout_for_batch(True, lambda trade: None, size=8, found=8, one_microbatch=True)
    assert lines[0] == ("layout trade grad_sync_once (gradients reduced once per batch) not tried: the batch runs in one "
                        "microbatch: its gradients are reduced once per batch already")
    assert search.trial is not None and search.trial.trades == (NO_RESHARD,)


