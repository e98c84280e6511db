"""The trials' plan (`automicro.batch.trial_plan`), their prices (`automicro.batch.trial_price`) and the profile they
are priced from (`automicro.batch.batch_profile`): which trial holds the batch, which are decided without running
because their expected win does not pay for their predicted cost or does not fit the budget, when two batches a side
decide, and what the trials cost. No processes: the plan, the prices and the profile's reading on their own; the runs
through a real model are in tests/test_sharding_choice.py and tests/test_layout.py (priced trials on CPU ranks)."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from automicro.batch import batch_profile, trial_price
from automicro.batch.batch_profile import BatchProfile, figures
from automicro.batch.trial_plan import PROFILE, SETTLED_BATCHES, TARGET_BATCH, TRIAL_CODES, TrialPlan
from automicro.batch.trial_price import Budget, Measured, allocate, fit_microbatch_cost, price, worth
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
    assert profile.products_s == pytest.approx(50e-6)  # the GEMM: what the ``op`` rung of recompute keeps
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
    assert profile.products_s == pytest.approx(200e-6)
    assert profile.idle_s == pytest.approx(0.001 - (40 + 240 + 70 + 20) * 1e-6)




def test_a_routed_models_grouped_expert_products_are_products_not_eager_work_a_compile_could_fuse():
    """transformers 5's experts run `aten::_grouped_mm` (seen on torch 2.11's CPU, tests/test_routing.py); on a GPU its
    kernels (CUTLASS's grouped GEMM, inductor's template of it). Counted as fusable, they would let the whole-model
    compile trial's bound grow by the experts' whole time."""
    cpu = figures([_event("aten::_grouped_mm", False, 0, 200), _event("aten::_scaled_grouped_mm", False, 200, 260),
                   _event("aten::silu", False, 260, 300)], wall_s=0.0003, device="cpu")
    assert cpu.fusable_s == pytest.approx(40e-6)  # the activation only
    assert cpu.products_s == pytest.approx(260e-6)
    gpu = figures([_event("cudaLaunchKernel", False, 0, 1, correlation=1), _event("cudaLaunchKernel", False, 2, 3, correlation=2),
                   _event("cudaLaunchKernel", False, 4, 5, correlation=3),
                   _event("triton_tem_fused__grouped_mm_0", True, 10, 110, correlation=1),
                   _event("void grouped_gemm_bf16_kernel<128>", True, 110, 150, correlation=2),
                   _event("triton_poi_fused_silu_1", True, 150, 160, correlation=3)], wall_s=0.0002, device="cuda")
    assert gpu.fusable_s == pytest.approx(10e-6)


def test_a_profile_travels_between_ranks_as_micros_and_bounds_each_kind_from_above():
    profile = BatchProfile(wall_s=2.0, idle_s=0.004, fsdp_s=0.006, comm_s=0.1, fusable_s=0.5, device="cuda", products_s=1.2)
    assert BatchProfile.from_micros(profile.to_micros(), "cuda") == profile
    assert profile.can_win(batch_profile.UNSHARDED) == pytest.approx(0.010)
    assert profile.can_win(batch_profile.TRADE) == pytest.approx(0.110)
    assert profile.can_win(batch_profile.SCOPE) == pytest.approx(0.504)
    assert profile.can_win(batch_profile.SMALLER) == pytest.approx(0.004)


# ---- prices ------------------------------------------------------------------------------------------


def test_the_microbatch_cost_model_is_fitted_from_batches_timed_at_other_microbatch_counts():
    """seconds = 0.05 per microbatch + 0.01 per sample, at 1, 2 and 4 microbatches of a batch of 32 (and noise on one
    point, which the median of its count absorbs); one microbatch count tells nothing."""
    points = [(1, 32, 0.37), (2, 32, 0.42), (4, 32, 0.52), (4, 32, 0.52), (4, 32, 0.90), (4, 32, 0.52)]
    assert fit_microbatch_cost(points) == pytest.approx(0.05, abs=1e-9)
    # Variable samples (a token budget's batches): both terms are fitted.
    varied = [(n, s, 0.05 * n + 0.01 * s) for n, s in [(1, 20, ), (2, 40), (3, 35), (5, 50)]]
    assert fit_microbatch_cost(varied) == pytest.approx(0.05, abs=1e-9)
    assert fit_microbatch_cost([(4, 32, 0.5), (4, 32, 0.6)]) is None


def _measured(**kw) -> Measured:
    base = dict(batch_s=1.0, left=975, planned=1000,
                profile=BatchProfile(1.0, idle_s=0.02, fsdp_s=0.03, comm_s=0.02, fusable_s=0.05, device="cuda"),
                microbatches=2, graph_compile_s=4.0, blocks=16)
    return Measured(**{**base, **kw})


def test_a_smaller_microbatch_is_expected_to_lose_what_its_extra_microbatches_cost_unless_the_size_found_retries():
    measured = _measured()  # a microbatch's fixed cost from the profile: (idle + FSDP2 + collectives) / 2 = 3.5%
    quarter = price("size 8", "smaller", measured, microbatches=8)
    assert quarter is not None and quarter.win_s == pytest.approx(-6 * 0.035)
    assert worth(quarter, measured, 0.01).startswith("expected -21.0% a batch (6 more microbatch(es) at 3.5% each")
    # The search's own batches at other microbatch counts give the fixed cost where they exist.
    fitted = price("size 8", "smaller", _measured(microbatch_fit_s=0.001), microbatches=8)
    assert fitted.win_s == pytest.approx(-0.006) and "fitted from the batches timed" in fitted.basis
    # Allocator retries in every settled batch at the size found: the idle they cost is what a smaller size may win.
    retried = price("size 4", "smaller", _measured(retried_share=1.0, microbatch_fit_s=0.001), microbatches=3)
    assert retried.win_s == pytest.approx(0.02 - 0.001)
    assert worth(retried, _measured(), 0.01) is None


def test_a_whole_model_compile_is_priced_from_the_compiles_this_run_timed_and_ruled_out_where_it_cannot_pay():
    eager_heavy = _measured(profile=BatchProfile(1.0, idle_s=0.02, fsdp_s=0.03, comm_s=0.0, fusable_s=0.50, device="cuda"))
    fsdp2 = price("scope", "scope", eager_heavy)
    assert fsdp2.cost_s == pytest.approx(4 * 4.0 + 3 * (0.15 * 0.50 - 0.03))  # four graphs of the blocks' 4 s
    unsharded = price("scope", "scope", eager_heavy, unsharded=1)
    assert unsharded.cost_s == pytest.approx(16 * 4.0 + 3 * 0.15 * 0.50)  # one graph per block inlined
    # Over 975 batches of 1 s, 4.5% a batch pays for 16 s; over 75 it does not; 7.5% does not pay for 64 s over 975
    # batches, and over 9,975 it does but does not fit a budget of 1% of 1,000 s.
    assert worth(fsdp2, eager_heavy, 0.01) is None
    assert "less than 2 x its predicted cost" in worth(fsdp2, _measured(left=75, profile=eager_heavy.profile), 0.01)
    assert "less than 2 x its predicted cost of 64.2 s" in worth(unsharded, eager_heavy, 0.01)
    long_run = _measured(left=9975, planned=10000, profile=eager_heavy.profile)
    assert worth(unsharded, long_run, 0.01) is None
    assert "does not fit" in allocate([unsharded], long_run, Budget(planned_s=1000.0), 0.01)[1]["scope"]
    # Under FSDP2, little eager work to fuse: expected to lose (its hooks break the graph at every block).
    assert price("scope", "scope", _measured()).win_s < 0


def test_a_full_recompute_tried_down_to_op_is_priced_by_the_matrix_products_it_no_longer_runs_twice():
    """``recompute_op`` (full recompute asked for by hand): a quarter of the products' and attention's device time (the
    forward's share of the busy time, `RECOMPUTE_OF_BUSY`), a compile of the blocks' selective graph where the blocks
    compile, and one batch an OOM may rerun; in a downsize trial its estimate is a gain as ``no_recompute``'s is."""
    products = BatchProfile(1.0, idle_s=0.02, fsdp_s=0.03, comm_s=0.02, fusable_s=0.05, device="cuda", products_s=0.6)
    compiled = _measured(profile=products)
    op = price("recompute_op", "recompute_op", compiled)
    assert op.win_s == pytest.approx(0.25 * 0.6)
    assert op.cost_s == pytest.approx(4.0 + 3 * 0.15 + 1.0) and "selective graph" in op.costs
    assert worth(op, compiled, 0.01) is None and "not recomputed, 0.25 x their device time (60.0%)" in op.basis
    eager = price("recompute_op", "recompute_op", _measured(profile=products, graph_compile_s=0.0))
    assert eager.cost_s == pytest.approx(3 * 0.15 + 1.0) and "selective graph" not in eager.costs
    # Nothing measured in matrix products: nothing to win, not tried.
    assert "under the 1% it must win" in worth(price("recompute_op", "recompute_op", _measured()), _measured(), 0.01)
    down = price("recompute_op at 3", "downsize", compiled, trades="recompute_op", microbatches=3)
    assert down.win_s == pytest.approx(0.15 - 1 * compiled.microbatch_s()[0])


def test_op_tried_up_is_priced_by_the_work_it_recomputes_outside_the_matrix_products_and_two_selective_compiles():
    """An upsize trial: the microbatches it saves less what it recomputes. Full: a quarter of the busy time; the ``op``
    rung tried up from none (``selective``): a quarter of the busy time beyond the matrix products and attention, and
    its selective graph compiled at the measuring split and at the new size; after its measuring batch (``measured``)
    only the compile at the new size, the arms and one OOM's rerun are left to price."""
    products = BatchProfile(1.0, idle_s=0.02, fsdp_s=0.03, comm_s=0.02, fusable_s=0.05, device="cuda", products_s=0.6)
    m = _measured(profile=products, microbatches=4)
    a = m.microbatch_s()[0]
    full = price("recompute at 8", "upsize", m, microbatches=2)
    op = price("recompute_op at 6", "upsize", m, microbatches=2, selective=1)
    assert full.win_s == pytest.approx(2 * a - 0.25 * 0.98) and op.win_s == pytest.approx(2 * a - 0.25 * (0.98 - 0.6))
    assert op.cost_s - full.cost_s == pytest.approx(4.0 + 3 * (abs(op.win_s) - abs(full.win_s))), (op.cost_s, full.cost_s)
    assert "outside the matrix products and attention recomputed" in op.basis and "selective graph at two sizes" in op.costs
    assert "the forward recomputed" in full.basis and "selective" not in full.costs
    # After its measuring batch, the trial at the size the measured bytes fit: that batch and the selective graph's first
    # compile are spent; one compile (at the new size), its arms and one batch an OOM may rerun are left.
    op_after = price("recompute_op at 6", "upsize", m, microbatches=2, selective=1, measured=1)
    full_after = price("recompute at 8", "upsize", m, microbatches=2, measured=1)
    assert op_after.win_s == op.win_s and full_after.win_s == full.win_s
    assert op.cost_s - op_after.cost_s == pytest.approx(4.0 + m.batch_s), (op.cost_s, op_after.cost_s)
    assert full.cost_s - full_after.cost_s == pytest.approx(m.batch_s), (full.cost_s, full_after.cost_s)
    assert op_after.costs == "a compile of the blocks' selective graph at the new size, its arms' batches and one batch an OOM may rerun"
    assert "measuring" not in full_after.costs and "a compile at the new size" in full_after.costs


def test_the_budget_goes_to_the_trials_worth_most_and_keeps_within_one_percent():
    measured = _measured(profile=BatchProfile(1.0, idle_s=0.0, fsdp_s=0.20, comm_s=0.05, fusable_s=0.0, device="cuda"))
    budget = Budget(planned_s=1000.0)  # 10 s
    twin = price("one_rank", "one_rank", measured)  # 0.8 x (20% - 8%): 9.6% a batch; a 4 s compile and its arms
    no_reshard = price("no_reshard", "no_reshard", measured)  # 10% a batch, its arms only
    grad_once = price("grad_sync_once", "grad_sync_once", measured)  # 3.1% a batch
    assert (twin.win_s, no_reshard.win_s, grad_once.win_s) == (pytest.approx(0.096), pytest.approx(0.10), pytest.approx(0.03125))
    chosen, refused = allocate([grad_once, twin, no_reshard], measured, budget, 0.01)
    assert [p.label for p in chosen] == ["no_reshard", "one_rank", "grad_sync_once"]
    assert sum(p.cost_s for p in chosen) <= budget.total_s and not refused
    tight = Budget(planned_s=300.0)  # 3 s: the twin's compile alone does not fit
    chosen, refused = allocate([grad_once, twin, no_reshard], measured, tight, 0.01)
    assert [p.label for p in chosen] == ["no_reshard", "grad_sync_once"]
    assert refused["one_rank"].endswith("left after the trials worth more (no_reshard)")


def test_the_static_recompile_is_kept_unless_beaten_so_it_is_priced_on_its_expected_gain_alone():
    quick = _measured(profile=None, graph_compile_s=2.0)
    static = price("static", "static", quick)
    assert static is not None and not static.keeps_on_gain
    assert static.cost_s == pytest.approx(2.0 * 1.25 + 3 * 0.02)
    assert worth(static, quick, 0.01) is None  # 0.8% of 975 one-second batches (7.8 s) against 2 x 2.56 s
    # A compile of 4 s pays over 10,000 batches, not over 1,000.
    slow = price("static", "static", _measured(profile=None))
    assert worth(slow, _measured(profile=None), 0.01).endswith("less than 2 x its predicted cost of 5.06 s (a compile of "
                                                                "the blocks (4.00 s) and its arms' batches)")
    assert worth(slow, _measured(profile=None, left=9975, planned=10000), 0.01) is None
    # A trial that needs a profile is not priced without one.
    assert price("one_rank", "one_rank", _measured(profile=None)) is None


def test_a_compile_of_the_blocks_again_costs_at_least_what_their_first_compile_took():
    """A routed model's blocks on one H100 broke their graphs (18 graphs): one graph's median (8.8 s) priced the twin's
    compile, which took 27 s, as the launch's first batch had (31.5 s beyond a settled batch)."""
    plain = _measured(profile=PROFILED, graph_compile_s=2.0)
    first = _measured(profile=PROFILED, graph_compile_s=2.0, first_compile_s=30.0)
    twin, twin_first = price("one_rank", "one_rank", plain), price("one_rank", "one_rank", first)
    assert twin_first.cost_s == pytest.approx(twin.cost_s - 2.0 + 30.0)
    assert "the twin's compile (30.0 s, as their first compile took)" in twin_first.costs, twin_first.costs
    assert "the twin's compile (1 graph(s) of 2.00 s)" in twin.costs, twin.costs
    static, static_first = price("static", "static", plain), price("static", "static", first)
    assert static_first.cost_s == pytest.approx(static.cost_s + (30.0 - 2.0) * 1.25)
    assert "a compile of the blocks (30.0 s, as their first compile took)" in static_first.costs
    # Where nothing compiles in the trial (the twin compiled already), nothing is charged for it.
    assert price("one_rank", "one_rank", first, compiles=0.0).cost_s == pytest.approx(
        price("one_rank", "one_rank", plain, compiles=0.0).cost_s)
    # A first compile shorter than the graphs the trial compiles changes nothing.
    assert price("one_rank", "one_rank", _measured(profile=PROFILED, graph_compile_s=2.0, first_compile_s=1.0),
                 graphs=4).cost_s == pytest.approx(price("one_rank", "one_rank", plain, graphs=4).cost_s)


# ---- the plan ----------------------------------------------------------------------------------------


class _Consensus:
    """One rank: the agreed maximum is this rank's own."""

    rounds = 0

    def agree_max(self, values):
        self.rounds += 1
        return list(values)


class _Trial:
    """A trial as the plan sees it: pending until given the batch, then running for `batches` batches. `kind` is its
    price's (`trial_price.KINDS`); `profiled`: priced from a batch profile."""

    def __init__(self, name: str, kind: str, batches: int = 2, profiled: bool = True, waits_for: tuple = (),
                 facts: Optional[dict] = None, wins: float = 0.0) -> None:
        self.name, self.kind, self.batches, self.profiled, self.waits_for = name, kind, batches, profiled, waits_for
        self.facts = facts or {}
        self.wins = wins  # what its kept arm wins a batch, as timed, once it is decided
        self.min_gain = 0.01
        self.state = "pending"
        self.left = batches
        self.ruled_out: list[str] = []

    pending = property(lambda self: self.state == "pending")
    running = property(lambda self: self.state == "running")
    label = property(lambda self: self.name if self.running else None)

    def candidates(self):
        return [(self.name, self.kind, self.facts)]

    def rule_out(self, why):
        self.state = "ruled out"
        self.ruled_out.append(why)

    def projection(self):
        return f"{self.left} batches"

    def outcome(self):
        return "kept" if self.state == "done" else self.state

    @property
    def won_s(self):
        return self.wins if self.state == "done" else 0.0

    def begin(self, turn):
        """Given the batch: it runs (its label holds the batch)."""
        if turn == self.name:
            self.state = "running"

    def end(self, turn):
        """The batch trained: a batch fewer to go; the last decides."""
        if turn == self.name:
            self.left -= 1
            if self.left == 0:
                self.state = "done"


PROFILED = BatchProfile(1.0, idle_s=0.02, fsdp_s=0.20, comm_s=0.05, fusable_s=0.5, device="cpu")


def _run(trials, profile=PROFILED, batches=40, planned=1000, steady_from=2, seconds=None, monkeypatch=None, **plan_kw):
    """Each batch's loop seconds: `seconds(batch, turn)` (1 s by default), through the plan's clock."""
    lines: list[str] = []
    now = [0.0]
    if monkeypatch is not None:
        monkeypatch.setattr("automicro.batch.trial_plan.time.perf_counter", lambda: now[0])
    plan = TrialPlan(trials, _Consensus(), lines.append, torch.device("cpu"), **plan_kw)
    plan.measured = lambda measured: profile
    plan.planned_batches = planned
    plan.compile_s = lambda: 2.0
    plan.split_now = lambda: (8, 8)
    turns = []
    for batch in range(batches):
        turn = plan.before_batch(batch, batch >= steady_from, ("configuration",))
        turns.append(turn)
        for trial in trials:
            trial.begin(turn)
        plan.hold(next((t.label for t in trials if t.name == turn), None), turn)
        for trial in trials:
            trial.end(turn)
        plan.after_batch(1, split=(8, 8))
        now[0] += seconds(batch, turn) if seconds else 1.0
    return plan, turns, lines


def test_the_device_work_trials_run_first_then_one_profile_prices_the_rest_which_run_in_their_order(monkeypatch):
    static = _Trial("static", "static", batches=3, profiled=False)
    one_rank = _Trial("one_rank", "one_rank")
    scope = _Trial("scope", "scope", waits_for=("one_rank",), facts={"unsharded": 0})
    layout = _Trial("layout", "no_reshard")
    plan, turns, lines = _run([static, one_rank, scope, layout], planned=2000, monkeypatch=monkeypatch)
    assert turns[:2] == [None, None]  # the size not settled yet
    assert turns[2:5] == ["static"] * 3
    assert turns[5:7] == [PROFILE, PROFILE]  # a clocked batch, then the profiled one
    # The whole model under FSDP2 is expected to win 0.15 x 50% less 3%: 4.5%, for 4 graphs of 2 s: it pays, and the
    # budget (1% of 2,000 one-second batches) holds it beside the twin (9.6%) and the layout's no_reshard.
    assert turns[7:13] == ["one_rank", "one_rank", "scope", "scope", "layout", "layout"], turns
    text = "\n".join(lines)
    assert "trials: static runs: expected +0.8% a batch" in text
    assert "a batch profiled: 1.0000 s" in text
    assert "trials: one_rank runs: expected +9.6% a batch (0.8 x FSDP2's own work beyond 8% of a batch (20.0%))" in text
    assert "trials: scope runs: expected +4.5% a batch" in text
    assert plan.final_at == 13 and turns[13:] == [None] * (40 - 13)
    assert any(line.startswith("trials: the configuration was final at batch 13; the trials cost ") for line in lines), lines


def test_a_batch_given_to_a_trial_that_starts_nothing_is_the_final_configurations_first(monkeypatch):
    """The layout given a batch whose trades its price then rules out (8,192 tokens a sample on one H100: final at batch
    26, the batch after the layout's last decisions, where 25 ran the final configuration already)."""

    class Empty(_Trial):
        def begin(self, turn):  # its turn: nothing left worth trying, nothing starts
            if turn == self.name:
                self.state = "ruled out"

    static = _Trial("static", "static", batches=3, profiled=False)
    layout = Empty("layout", "no_reshard")
    plan, turns, lines = _run([static, layout], monkeypatch=monkeypatch)
    assert turns[2:8] == ["static"] * 3 + [PROFILE, PROFILE, "layout"], turns
    assert plan.final_at == 7 and turns[8:] == [None] * (40 - 8), (plan.final_at, turns)
    assert any(line.startswith("trials: the configuration was final at batch 7; ") for line in lines), lines


def test_a_trial_its_price_rules_out_never_runs_and_says_why(monkeypatch):
    one_rank = _Trial("one_rank", "one_rank")
    layout = _Trial("layout", "no_reshard")
    little = BatchProfile(1.0, idle_s=0.002, fsdp_s=0.003, comm_s=0.2, fusable_s=0.0, device="cpu")
    _, turns, lines = _run([one_rank, layout], profile=little, monkeypatch=monkeypatch)
    assert one_rank.state == "ruled out" and "one_rank" not in turns
    assert one_rank.ruled_out == ["expected +0.0% a batch (0.8 x FSDP2's own work beyond 8% of a batch (0.3%)), under the 1% "
                                  "it must win to be kept"]
    assert turns.count("layout") == 2


def test_a_short_run_profiles_nothing_and_prices_every_trial_out_then_says_its_price(monkeypatch):
    """40 batches of 1 s: a budget of 0.4 s cannot hold a profiled batch; the static recompile's compile does not pay."""
    static = _Trial("static", "static", profiled=False)
    one_rank = _Trial("one_rank", "one_rank")
    plan, turns, lines = _run([static, one_rank], planned=40, monkeypatch=monkeypatch)
    assert set(turns) == {None} and static.state == one_rank.state == "ruled out"
    assert "cannot hold a profiled batch and a trial" in one_rank.ruled_out[0]
    assert plan.final_at == 2
    assert plan.price == (f"trials: the configuration was final at batch 2; the trials cost 0.00 s against the settled "
                          f"configuration (1.0000 s a batch, the median of the {SETTLED_BATCHES} batches after), 0.0% of "
                          "this run's 40 batches; none ran (static, one_rank priced out)")


def test_trials_false_runs_no_trial_and_says_so_once(monkeypatch):
    static = _Trial("static", "static", profiled=False)
    layout = _Trial("layout", "no_reshard")
    plan, turns, lines = _run([static, layout], enabled=False, monkeypatch=monkeypatch)
    assert set(turns) == {None} and static.pending and layout.pending
    assert [line for line in lines if line.startswith("trials:")] == [
        "trials: off (trials: false): the size search and nothing else; the configuration stays as the search left it"]
    assert plan.price is None


def test_each_trial_that_ends_says_its_real_and_predicted_cost_and_leaves_a_record(monkeypatch):
    """The twin's batches take 1.5 s against 1 s settled: 2 batches cost 1.0 s."""
    one_rank = _Trial("one_rank", "one_rank")
    plan, turns, lines = _run([one_rank], monkeypatch=monkeypatch,
                              seconds=lambda batch, turn: 1.5 if turn == "one_rank" else 1.0)
    ended = [line for line in lines if line.startswith("trials: one_rank ended")]
    assert ended == [ended[0]] and ended[0].startswith("trials: one_rank ended (kept): cost 1.00 s over 2 batch(es) "
                                                       "against the batch before it, predicted ")
    assert ended[0].endswith(" budget left")
    records = plan.take_records()
    assert [r["trial"] for r in records] == [PROFILE, "one_rank"]
    assert records[1]["first"] == turns.index("one_rank") and records[1]["cost_s"] == pytest.approx(1.0)
    assert records[1]["predicted_s"] == pytest.approx(price("one_rank", "one_rank", _measured(profile=PROFILED, graph_compile_s=2.0)).cost_s)
    assert plan.take_records() == []  # each once
    assert plan.metrics() == {"automicro/trial": TRIAL_CODES[None], "automicro/trials_s": pytest.approx(1.0)}


def test_the_price_counts_the_trials_window_against_the_batches_after_it(monkeypatch):
    """The loop's clock, start to start: 2 s a trial batch, 1 s a settled one. The trials' window is every batch
    from the first with the size settled to the last before the final configuration ran."""
    trial = _Trial("static", "static", batches=4, profiled=False)
    plan, _, _ = _run([trial], batches=20, planned=100, monkeypatch=monkeypatch, bound=False,
                      seconds=lambda batch, turn: 2.0 if turn == "static" else 1.0)
    assert plan.final_at == 6  # batches 2-5 held the trial
    assert plan.price.startswith(f"trials: the configuration was final at batch 6; the trials cost 4.00 s against the settled "
                                 f"configuration (1.0000 s a batch, the median of the {SETTLED_BATCHES} batches after), 4.0% of "
                                 "this run's 100 batches; 1 ran (static)")
    assert plan.summary().startswith("trials cost 4.00 s against the settled configuration")


def test_what_is_still_running_at_the_target_batch_is_said_in_seconds_with_why(monkeypatch):
    slow = _Trial("static", "static", batches=TARGET_BATCH + 5, profiled=False)
    _, _, lines = _run([slow], batches=TARGET_BATCH + 2, planned=100000, monkeypatch=monkeypatch)
    line = next(line for line in lines if line.startswith(f"trials: not final at batch {TARGET_BATCH}"))
    assert line.startswith(f"trials: not final at batch {TARGET_BATCH} (the size settled at batch 2): about ")
    assert "(static running); left: static: " in line, line



def test_two_batches_a_side_decide_where_the_spread_is_tiny_and_three_otherwise():
    consensus = _Consensus()
    assert enough(consensus, [[1.000, 1.001], [2.0, 2.0]], 3, 0.01)  # spreads 0.05% and 0
    assert not enough(consensus, [[1.00, 1.02], [2.0, 2.0]], 3, 0.01)  # 1%: a third batch a side
    assert enough(consensus, [[1.00, 1.02, 1.01], [2.0, 2.0, 2.0]], 3, 0.01)
    assert not enough(consensus, [[1.0], [2.0]], 3, 0.01)
    assert not enough(consensus, [[1.0, 1.0], [2.0]], 3, 0.01)  # the arms unequal: not yet
    assert enough(consensus, [[1.0]], 1, 0.01)  # a trial of one batch a side


def test_a_trade_kept_on_a_gain_under_three_times_its_spread_runs_on_in_pairs_up_to_twice_its_batches():
    consensus = _Consensus()
    weak_on, weak_off = [0.98, 1.00, 0.97], [1.00, 1.01, 0.99]  # +2.0%, spread 0.01 s: kept, under 3x the spread
    assert enough(consensus, [weak_on, weak_off], 3, 0.01)  # without `extend`: judged at 3
    assert not enough(consensus, [weak_on, weak_off], 3, 0.01, extend=True)
    assert not enough(consensus, [weak_on + [0.98], weak_off], 3, 0.01, extend=True)  # the pair half run
    # A fourth pair that makes the gain clear (spread 0.005 s, gain 0.02 s) ends it; one that does not, runs on.
    assert enough(consensus, [weak_on + [0.98], weak_off + [1.00]], 3, 0.01, extend=True)
    assert not enough(consensus, [weak_on + [0.99], weak_off + [1.00]], 3, 0.01, extend=True)  # +1.5%, spread 0.01 s
    six_on, six_off = weak_on + [1.00, 0.97, 1.00], weak_off + [0.99, 1.01, 0.98]
    assert enough(consensus, [six_on, six_off], 3, 0.01, extend=True)  # twice its batches: judged whatever
    # Clear at 3 either way: judged at 3.
    assert enough(consensus, [[0.90, 0.90, 0.91], [1.00, 1.00, 1.01]], 3, 0.01, extend=True)  # +10%, spread 0
    assert enough(consensus, [[1.00, 1.02, 0.99], [1.00, 1.01, 0.99]], 3, 0.01, extend=True)  # not kept


def _layout(candidates=(GRAD_SYNC_ONCE, NO_RESHARD)):
    return LayoutSearch(LayoutConfig("auto", (), 3, 0.01), list(candidates))


def test_the_layout_search_asks_each_trade_and_size_trial_its_price_and_passes_over_what_does_not_pay():
    search = _layout()
    asked = []

    def priced(label, kind, facts):
        asked.append((label, kind, dict(facts)))
        return "expected +0.4% a batch, under the 1% it must win to be kept" if kind != "smaller" else "expected -20.0% a batch"

    layout, lines = search.layout_for_batch(True, lambda trade: None, size=8, found=8, largest_at=lambda n: n,
                                            priced=priced, count_at=lambda n: -(-32 // n), microbatches=4)
    assert search.trial is None and layout == ()
    assert lines == [
        "layout trade grad_sync_once (gradients reduced once per batch) not tried: expected +0.4% a batch, under the 1% it must win to be kept",
        "layout trade no_reshard (no resharding after forward, nor between microbatches) not tried: expected +0.4% a batch, under the 1% it must win to be kept",
        "size trials below microbatch 8 not run: expected -20.0% a batch",
    ], lines
    assert asked == [(GRAD_SYNC_ONCE, GRAD_SYNC_ONCE, {}), (NO_RESHARD, NO_RESHARD, {}), ("size 4", "smaller", {"microbatches": 8.0})]
    assert search.layout_for_batch(True, lambda trade: None, size=8, found=8, largest_at=lambda n: n, priced=priced)[1] == []
    # Another size found: priced again (here it pays), in the order asked (the best expected value first).
    search.layout_for_batch(True, lambda trade: None, size=6, found=6, largest_at=lambda n: n,
                            priced=lambda label, kind, facts: None, order=lambda trades: sorted(trades, reverse=True))
    assert search.trial is not None and search.trial.trades == (NO_RESHARD,)


def test_gradients_reduced_once_is_not_tried_where_the_batch_runs_in_one_microbatch():
    search = _layout()
    _, lines = search.layout_for_batch(True, lambda trade: None, size=8, found=8, one_microbatch=True)
    assert lines[0] == ("layout trade grad_sync_once (gradients reduced once per batch) not tried: the batch runs in one "
                        "microbatch: its gradients are reduced once per batch already")
    assert search.trial is not None and search.trial.trades == (NO_RESHARD,)


def test_once_the_price_is_said_only_the_recent_batches_figures_are_kept(monkeypatch):
    trial = _Trial("static", "static", batches=2, profiled=False)
    plan, _, _ = _run([trial], batches=400, planned=100, monkeypatch=monkeypatch, bound=False)
    assert plan.price is not None
    assert len(plan.seconds) <= 2 * 64 and min(plan.seconds) >= 400 - 2 * 64, (len(plan.seconds), min(plan.seconds))
    assert len(plan.held) <= 2 * 64


def test_what_a_kept_trial_won_raises_the_budget_by_half_and_the_spend_stays_under_one_percent_plus_the_win():
    budget = Budget(planned_s=1000.0)
    assert budget.total_s == pytest.approx(10.0) and budget.basis() == "1% of the run's planned seconds"
    budget.win("layout", 40.0)
    assert budget.total_s == pytest.approx(10.0 + trial_price.WON_SHARE * 40.0) and trial_price.WON_SHARE <= 1.0
    assert budget.basis() == "1% of the run's planned seconds and 50% of the 40.0 s the trials kept won over the batches left (layout)"
    budget.win("layout", -40.0)  # the trade it kept was undone: it wins nothing any more
    assert budget.total_s == pytest.approx(10.0) and budget.won_s == 0.0


def _twin_after_static(wins: float, monkeypatch):
    """The static recompile (its compile of 2 s fits a budget of 10 s), then a twin whose 8 graphs of 2 s do not fit
    what is left of 1% of 1,000 one-second batches: only what the recompile won can pay for it."""
    static = _Trial("static", "static", batches=3, profiled=False, wins=wins)
    twin = _Trial("one_rank", "one_rank", facts={"graphs": 8.0})
    plan, turns, lines = _run([static, twin], planned=1000, monkeypatch=monkeypatch)
    return plan, twin, turns, lines


def test_a_trial_refused_only_for_the_budget_runs_once_what_a_kept_trial_won_has_raised_it(monkeypatch):
    plan, twin, turns, lines = _twin_after_static(0.0, monkeypatch)
    assert "one_rank" not in turns and twin.state == "ruled out" and "does not fit" in twin.ruled_out[0], twin.ruled_out

    plan, twin, turns, lines = _twin_after_static(0.05, monkeypatch)
    text = "\n".join(lines)
    # Kept at batch 5 (batches 2-4 held it): 0.05 s a batch over the 995 batches left.
    assert ("trials: static ended (kept): cost 0.00 s over 3 batch(es) against the batch before it, predicted 2.56 s; it won "
            "0.05 s a batch as timed, 49.8 s over the 995 batches left: the budget grows by 50% of it") in text, text
    assert turns.count("one_rank") == 2 and twin.state == "done"
    assert "trials: one_rank runs: expected +9.6% a batch" in text
    assert plan.budget.total_s == pytest.approx(0.01 * 1000 + 0.5 * 0.05 * 995)
    # Never a net loss: what the trials spend stays under 1% of the run and what they won.
    assert plan.budget.spent_s + sum(plan.budget.running.values()) <= 0.01 * 1000 + 0.05 * 995
    assert plan.price.endswith("; the budget 34.9 s: 1% of the run's planned seconds and 50% of the 49.8 s the trials kept won "
                               "over the batches left (static)"), plan.price


def test_what_a_trial_won_is_its_kept_arms_timed_gain_and_nothing_once_undone_or_level():
    from automicro.batch.compile_shapes import StaticShapes
    from automicro.core.layout import TrialResult, judge

    assert judge(NO_RESHARD, [0.90, 0.91, 0.90], [1.00, 1.01, 1.00], 0.01).won_s == pytest.approx(0.10)
    assert judge(NO_RESHARD, [0.999, 1.0, 0.999], [1.00, 1.00, 1.00], 0.01).won_s == 0.0  # level: not kept, won nothing
    search = _layout()
    search.results = [TrialResult(NO_RESHARD, True, 0.9, 1.0, 0.0), TrialResult(GRAD_SYNC_ONCE, False, 0.99, 1.0, 0.0),
                      TrialResult("smaller_microbatch", True, 0.95, 1.0, 0.0, size=4)]
    search.kept = [NO_RESHARD]
    assert search.won_s() == pytest.approx(0.10 + 0.05)
    search.kept = []  # no_reshard undone under memory pressure: its win is gone
    assert search.won_s() == pytest.approx(0.05)
    # The static recompile is kept unless beaten: it wins only what it won by the rule for keeping.
    shapes = StaticShapes(None, _Consensus(), lambda line: None, torch.device("cpu"))
    shapes.times = {"search": [1.0, 1.0, 1.01], "static": [0.95, 0.95, 0.96], "batch": []}
    shapes.state = "static"
    assert shapes.won_s == pytest.approx(0.05)
    shapes.times["static"] = [0.999, 1.0, 1.0]
    assert shapes.won_s == 0.0


class _SlowerRank(_Consensus):
    """Two ranks: the other one timed every kept arm's win at half this one's."""

    def agree_max(self, values):
        self.rounds += 1
        if len(values) == 2:  # a trial ended: its cost and what it won (negated, offset)
            from automicro.batch.trial_plan import _OFFSET_US

            other = [values[0], _OFFSET_US - (_OFFSET_US - values[1]) // 2]
            return [max(a, b) for a, b in zip(values, other)]
        return list(values)


def test_every_rank_credits_the_least_any_rank_timed_a_trial_winning(monkeypatch):
    monkeypatch.setattr("automicro.batch.trial_plan.time.perf_counter", lambda: 0.0)
    static = _Trial("static", "static", batches=3, profiled=False, wins=0.05)
    plan = TrialPlan([static], _SlowerRank(), lambda line: None, torch.device("cpu"), bound=False)
    plan.planned_batches = 1000
    for batch in range(8):
        turn = plan.before_batch(batch, batch >= 2, ("configuration",))
        static.begin(turn)
        plan.hold(static.label, turn)
        static.end(turn)
        plan.after_batch(1, split=(8, 8))
    assert plan.budget.won == {"static": pytest.approx(0.025 * 995)}


def test_a_trial_the_allocation_refused_for_the_budget_runs_when_its_turn_comes_after_a_kept_trial_won(monkeypatch):
    """Both priced from one profile: the layout trade (cheap, first) fits 1% of 1,000 one-second batches, the twin's
    8 graphs of 2 s do not fit beside it. The trade wins 0.05 s a batch; when the twin's turn comes it is priced
    again against the budget that win raised, and runs."""
    twin = _Trial("one_rank", "one_rank", facts={"graphs": 8.0})
    allocated = []
    monkeypatch.setattr(TrialPlan, "_allocate", lambda self, _a=TrialPlan._allocate: (_a(self), allocated.append(set(self.over_budget))))
    plan, turns, lines = _run([_Trial("layout", "no_reshard", wins=0.05), twin], planned=1000, monkeypatch=monkeypatch)
    assert allocated == [{"one_rank"}]  # refused by the allocation: it did not fit beside the trade
    assert any(line.startswith("trials: one_rank runs: ") and line.endswith("of the 34.9 s budget left") for line in lines), lines
    assert turns.count("layout") == 2 and turns.count("one_rank") == 2 and twin.state == "done", (turns, twin.ruled_out)
    assert turns.index("layout") < turns.index("one_rank")
    assert not plan.over_budget

    # Without the win the refusal stands.
    layout = _Trial("layout", "no_reshard", wins=0.0)
    twin = _Trial("one_rank", "one_rank", facts={"graphs": 8.0})
    plan, turns, lines = _run([layout, twin], planned=1000, monkeypatch=monkeypatch)
    assert "one_rank" not in turns and "does not fit" in twin.ruled_out[0], twin.ruled_out
    # Asked again (a layout trade or the fused head the layout search priced out at this size found): only once the
    # budget grew since, then priced against it.
    assert not plan.reprices("one_rank") and not plan.reprices("no_reshard")
    plan.budget.win("layout", 30.0)
    assert plan.reprices("one_rank")
    assert plan.admit("one_rank", "one_rank", 0.01, graphs=8.0) is None and not plan.reprices("one_rank")
    # Another like it does not fit beside it: asked again only once the budget grows; priced again then and found not
    # to pay (here: a rule of +500% to be kept), it is not asked again (each ask would say the same line).
    assert "budget" in plan.admit("twin2", "one_rank", 0.01, graphs=8.0) and not plan.reprices("twin2")
    plan.budget.win("layout", 100.0)
    assert plan.reprices("twin2")
    assert "under the 500% it must win" in plan.admit("twin2", "one_rank", 5.0, graphs=8.0) and not plan.reprices("twin2")


def test_a_trial_at_a_new_size_is_priced_without_a_compile_once_the_last_new_size_compiled_nothing():
    """Dynamo marks the blocks' batch dimension dynamic at the second size it sees: later sizes run the same graph.
    Mixtral's fused head on one H100 was priced 10.2 s with a graph's compile (7-8 s) and cost 1.3 s; the opening
    budget (9.2 s) refused it for that compile, and it ran 14 batches later. A new size 1 says nothing (dynamo
    specializes it); the run's first batch neither (its first compile)."""
    plan = TrialPlan([], _Consensus(), print, torch.device("cpu"))
    graphs = [0]
    plan.graphs = lambda: graphs[0]
    plan.compile_s = lambda: 8.0

    def batch(index: int, split: tuple[int, ...], compiled: int) -> None:
        plan.before_batch(index, index > 1, ("configuration",))
        graphs[0] += compiled
        plan.after_batch(1, split=split)

    assert plan._snapshot().sizes_compile  # nothing known: a new size compiles
    for index, (split, compiled) in enumerate([((2, 2, 2, 2, 2, 2, 2, 2), 1), ((7, 7, 2), 1), ((7, 7, 2), 0)]):
        batch(index, split, compiled)
    plan.before_batch(3, True, ("configuration",))
    assert plan._snapshot().sizes_compile  # 7 compiled (the graph made dynamic)
    graphs[0] += 0
    plan.after_batch(1, split=(6, 5, 5))
    batch(4, (6, 6, 3, 1), 1)  # 3 and 1 new, 1's own graph compiled: no news of 3
    plan.before_batch(5, True, ("configuration",))
    measured = plan._snapshot()
    assert not measured.sizes_compile and measured.graph_compile_s == 8.0
    profile = BatchProfile(wall_s=1.0, idle_s=0.1, fsdp_s=0.02, comm_s=0.0, fusable_s=0.2, head_s=0.3, head_eager_s=0.2)
    facts = dict(microbatches=2.0, measure_microbatches=4.0, measure=1.0, near=1.0)
    for sizes_compile in (True, False):
        m = Measured(batch_s=1.0, left=900, planned=1000, profile=profile, microbatches=3, graph_compile_s=8.0,
                     sizes_compile=sizes_compile)
        head = price("fused_head", "fused_head", m, **facts)
        full = price("recompute", "upsize", m, microbatches=1.0)
        op = price("recompute_op", "upsize", m, microbatches=1.0, selective=1.0)
        smaller = price("size 4", "smaller", m, microbatches=4.0)
        assert ("a compile at the new size" in head.costs) is sizes_compile, head.costs
        assert ("a compile at the new size" in full.costs) is sizes_compile, full.costs
        assert ("a compile at the new size" in smaller.costs) is sizes_compile, smaller.costs
        assert "selective graph at two sizes" in op.costs  # its own graph, whatever the sizes do
        if not sizes_compile:
            assert head.cost_s == pytest.approx(with_compile[0].cost_s - 8.0)
            assert full.cost_s == pytest.approx(with_compile[1].cost_s - 8.0) and op.cost_s == with_compile[2].cost_s
            assert head.costs == "a measuring batch near the size found, its arms' batches"
            assert full.costs == "a measuring batch, its arms' batches"
        with_compile = (head, full, op)
    # The next new size compiles (a guard failed, the graph specialized): priced with one again.
    plan.after_batch(1, split=(8, 8))
    graphs[0] += 1
    plan.before_batch(6, True, ("configuration",))
    assert plan._snapshot().sizes_compile
