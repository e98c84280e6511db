"""Pipeline parallelism (`automicro.engine.pipeline`) with auto microbatching, on CPU gloo ranks.

Multi-rank cases run under `run_multiprocess`'s hang watchdog: a hang fails the test.
"""

from __future__ import annotations

import pytest

from automicro.core import policy
from automicro.engine.config import FSDP2ConfigError, PipelineConfig, fsdp2_from_parallelism_config
from automicro.engine.pipeline import Action, PipelineModelError, lockstep_table, split_blocks
from automicro.testing.multiprocess import run_multiprocess
from tests import matrix
from tests import pipeline_cases as cases

# ---- the lockstep timing ---------------------------------------------------------------------


def _orders(text: dict[int, str]) -> dict[int, list[Action]]:
    return {r: [Action(a[1], int(a[0]), int(a[2:])) for a in row.split()] for r, row in text.items()}


def _check_dependencies(table: dict[int, list], last: int) -> None:
    when = {(a.kind, a.stage, a.microbatch): t for row in table.values() for t, a in enumerate(row) if a}
    for (kind, stage, mb), t in when.items():
        if kind == "F" and stage > 0:
            assert when[("F", stage - 1, mb)] < t
        if kind in "BI":
            assert when[("F", stage, mb)] < t
            if stage < last:
                assert min(when.get((k, stage + 1, mb), 10**9) for k in "BI") < t
        if kind == "W":
            assert when[("I", stage, mb)] < t


def test_lockstep_table_runs_every_action_after_what_it_needs_and_keeps_each_ranks_order():
    orders = _orders({0: "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2", 1: "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"})
    table = lockstep_table(orders, 2)
    _check_dependencies(table, 1)
    for rank, row in table.items():
        assert [a for a in row if a] == orders[rank]
    assert len(table[0]) == len(table[1])  # one barrier per step on every rank


def test_lockstep_table_refuses_orders_that_wait_on_each_other():
    with pytest.raises(RuntimeError, match="wait on each other"):
        lockstep_table(_orders({0: "0B0 0F0", 1: "1F0 1B0"}), 2)


def test_blocks_split_into_contiguous_runs_earlier_stages_take_the_extra_blocks():
    assert split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert split_blocks(22, 4) == [range(0, 6), range(6, 12), range(12, 17), range(17, 22)]
    with pytest.raises(PipelineModelError, match="at most one stage per block"):
        split_blocks(2, 3)


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"stages": 1}, "stages=1: must be an int >= 2"),
        ({"stages": 2, "schedule": "ZB"}, "schedule='ZB': unknown"),
        ({"stages": 2, "schedul": "1F1B"}, "did you mean 'schedule'"),
        ({"stages": 2, "keep_graph_after_input_grad": "yes"}, "must be true or false"),
    ],
)
def test_bad_pipeline_settings_name_the_key_and_what_is_allowed(values, message):
    with pytest.raises(FSDP2ConfigError, match=message):
        PipelineConfig.from_dict(values)


def test_parallelism_config_accepts_pipeline_next_to_fsdp2():
    assert fsdp2_from_parallelism_config({"pipeline": {"stages": 2}, "fsdp2": {}}) is not None


# ---- the search over sizes a pipeline can run -------------------------------------------------


def _divisor_sizes(batch_size: int) -> tuple[int, ...]:
    return tuple(m for m in range(1, batch_size + 1) if batch_size % m == 0 and batch_size // m >= 2)


def test_search_only_tries_sizes_the_pipeline_can_run_and_converges_on_the_largest_that_fits():
    config = policy.PolicyConfig(sizes_for=_divisor_sizes, use_prediction=False)
    p = policy.SearchPolicy(config, 12)
    tried = []
    while p.phase == policy.Phase.SEARCHING:
        size = p.state.size
        tried.append(size)
        p.observe(policy.OOM(size) if size > 3 else policy.Success(size))
    assert set(tried) <= set(_divisor_sizes(12)) and tried[0] == 6
    assert p.found_size == 3 and p.current_split() == (3, 3, 3, 3)


def test_search_with_no_runnable_size_says_so():
    config = policy.PolicyConfig(sizes_for=lambda b: ())
    with pytest.raises(policy.CannotFitError, match="no microbatch size can run"):
        policy.SearchPolicy(config, 4)


# ---- multi-rank: the fault matrix over stages -------------------------------------------------

FAULTS_1F1B = [("forward", 0, 0), ("forward", 1, 1), ("backward_input", 1, 0), ("backward_input", 0, 1)]
FAULTS_ZB = FAULTS_1F1B + [("backward_weight", 0, 0), ("backward_weight", 1, 1)]
# Sampled (tests/matrix.py): every site in each run, the stage and the microbatch drawn.
FAULTS_1F1B = matrix.sample("pipeline 1F1B", FAULTS_1F1B)
FAULTS_ZB = matrix.sample("pipeline ZeroBubble", FAULTS_ZB)


@pytest.fixture(scope="module", params=["1F1B", "ZeroBubble"])
def fault_results(request):
    faults = FAULTS_1F1B if request.param == "1F1B" else FAULTS_ZB
    return request.param, faults, run_multiprocess(cases.fault_matrix, world_size=2, args=(request.param, faults), timeout_s=400)


def test_an_oom_on_one_stage_in_forward_di_or_dw_at_the_first_or_last_microbatch_is_retried_without_hang(fault_results):
    schedule, faults, ranks = fault_results
    for rank, out in enumerate(ranks):
        assert [c["case"] for c in out["cases"]] == [tuple(f) for f in faults]
        for case in out["cases"]:
            site, failing, _ = case["case"]
            first = case["history"][0]
            assert first[1:4] == (4, "oom", [failing]), (schedule, case)
            assert first[4] == [site], (schedule, case)
            assert case["fired"] == (1 if rank == failing else 0)
            assert case["clean"], (schedule, case)


def test_after_a_failed_attempt_on_one_stage_the_parameters_equal_a_fixed_size_run(fault_results):
    schedule, _, ranks = fault_results
    for out in ranks:
        for case in out["cases"]:
            assert case["diff"] < 1e-5, (schedule, case["case"], case["diff"])


def _left_nothing(schedule, case):
    """Live tensor bytes allocated during each failed attempt and still held after its wipe, on
    both stages (counted exactly by a memory cap with no limit; a few bytes of gloo buffers may be
    in flight): the stage's activations, the schedule's sends and the gradients are all gone."""
    exact, checked = case["left_behind"]
    assert checked.get("train", 0) >= 1, (schedule, case)
    assert exact <= 4096, (schedule, case["case"], exact)


def test_a_failed_attempt_on_one_stage_leaves_nothing_allocated_on_any_stage(fault_results):
    schedule, _, ranks = fault_results
    for out in ranks:
        for case in out["cases"]:
            _left_nothing(schedule, case)


def test_a_failed_steady_attempt_that_drained_its_schedule_leaves_nothing_allocated(steady_results):
    schedule, ranks = steady_results
    for out in ranks:
        for case in out["cases"]:
            _left_nothing(schedule, case)


# ---- multi-rank: the search under a memory limit on one rank, 2 stages and 2 stages x 2 -------


@pytest.mark.parametrize("schedule", ["1F1B", "ZeroBubble"])
def test_search_on_two_stages_finds_a_size_that_fits_and_trains_like_a_fixed_size_run(schedule):
    ranks = run_multiprocess(cases.search_under_limit, world_size=2, args=(schedule, 0), timeout_s=400)
    for out in ranks:
        assert [h[1:4] for h in out["history"]][:2] == [(4, "oom", [0]), (2, "ok", [])], out["history"]
        assert out["found"] == 2
        # Another size changes only float rounding (Adam amplifies it over 5 steps at lr 1e-2).
        assert out["diff_fixed"] < 1e-5 and out["diff_other_size"] < 2e-3
        assert out["loss"] == pytest.approx(out["fixed_loss"], rel=1e-5)
    # Composer counts each sample once per pipeline (the later stage reports none).
    assert ranks[0]["samples"] == ranks[1]["samples"] == 5 * cases.PER_PIPELINE_BATCH


@pytest.fixture(scope="module")
def data_parallel():
    """2 simulated nodes x 2 ranks: each stage's data-parallel pair on one node, the pipeline's
    sends and receives between the nodes (the usual multi-host layout); one launch for the search
    and the steady-phase OOM on rank 3 (node 1's second rank)."""
    return run_multiprocess(cases.data_parallel_stages, world_size=4, nodes=2, timeout_s=900)


def test_search_on_two_stages_of_two_data_parallel_ranks_agrees_on_every_rank(data_parallel):
    ranks = [out["search"] for out in data_parallel]
    assert [r["stage"] for r in ranks] == [0, 0, 1, 1]
    for out in ranks:
        assert out["found"] == 2
        assert out["history"][0][1:4] == (4, "oom", [3]), out["history"]
        assert out["diff_fixed"] < 1e-5
    assert ranks[0]["samples"] == 5 * 2 * cases.PER_PIPELINE_BATCH


STEADY_FAULTS = {
    "1F1B": [("forward", 0, 1), ("loss", 1, 0), ("backward_input", 0, 0), ("backward_input", 1, -1)],
    "ZeroBubble": [("backward_weight", 0, 0), ("forward", 1, 1), ("backward_input", 0, -1)],
}


@pytest.fixture(scope="module", params=["1F1B", "ZeroBubble"])
def steady_results(request):
    faults = STEADY_FAULTS[request.param]
    return request.param, run_multiprocess(cases.steady_faults, world_size=2, args=(request.param, faults), timeout_s=500)


def test_after_the_size_settles_a_pipeline_batch_takes_three_consensus_rounds_not_one_per_time_step(steady_results):
    """The barriers before every time step's exchange come off with the sync hooks (one
    data-parallel rank per stage): a batch keeps one barrier before and one after its set-up, and
    the attempt's agreement. While searching (hooks on) there is one per time step."""
    schedule, ranks = steady_results
    for out in ranks:
        for case in out["cases"]:
            attempts = {}
            for record in case["history"]:
                attempts[record[0]] = attempts.get(record[0], 0) + (record[2] != "ok")
            # Batch 3 (after 2 stable ones) is the one without sync hooks that ran in one attempt
            # (batch 4 fails and reruns with the hooks on; they come off again after batch 5).
            quiet = [b for b, on in enumerate(case["hooks_at_start"]) if b > 0 and not on and attempts.get(b, 0) == 0]
            assert quiet == [3], (schedule, case["case"], case["hooks_at_start"], case["history"])
            assert case["rounds"][3] == 3, (schedule, case["case"], case["rounds"])
            # Batches 1 and 2 (hooks on): a barrier per time step and before the set-up, the
            # agreement, and the sync hooks' points.
            assert min(case["rounds"][1:3]) >= case["time_steps"] + 2, (schedule, case["rounds"], case["time_steps"])


def test_an_oom_on_one_stage_without_barriers_drains_its_schedule_and_reruns_the_batch_at_the_same_size(steady_results):
    schedule, ranks = steady_results
    drained = 0
    for rank, out in enumerate(ranks):
        for case in out["cases"]:
            site, failing, _ = case["case"]
            steady = [(h, hooks) for h, hooks in zip(case["history"], case["hooks"]) if h[0] == 4]
            (first, first_hooks), (second, _) = steady[0], steady[1]
            assert first[1:5] == (4, "oom", [failing], [site]), (schedule, case)
            assert first_hooks is False and "in steady phase" in first[5], (schedule, case)
            assert second[1:3] == (4, "ok"), (schedule, case)
            assert case["found"] == 4 and case["clean"]
            assert case["fired"] == (1 if rank == failing else 0)
            assert case["drains"] == (1 if rank == failing else 0), (schedule, case)
            drained += case["drained_steps"]
            assert case["diff"] < 1e-5, (schedule, case["case"], case["diff"])
    assert drained > 0  # some faults left sends and receives to drain (a stage's last action leaves none)


@pytest.mark.many_ranks
def test_a_middle_stage_of_four_drains_to_both_neighbours_and_the_batch_is_rerun():
    """Four stages of one block: stage 1 fails in a forward and stage 2 in an input gradient,
    each with sends and receives left on both sides."""
    faults = [("forward", 1, 2), ("backward_input", 2, 1)]
    ranks = run_multiprocess(cases.steady_faults, world_size=4, args=("1F1B", faults, 4), timeout_s=600)
    for rank, out in enumerate(ranks):
        for case in out["cases"]:
            site, failing, _ = case["case"]
            steady = [(h, on) for h, on in zip(case["history"], case["hooks"]) if h[0] == 4]
            assert steady[0][0][1:5] == (case["found"], "oom", [failing], [site]) and steady[0][1] is False, case
            assert steady[1][0][2] == "ok", case
            assert case["drains"] == (1 if rank == failing else 0), case
            if rank == failing:
                assert case["drained_steps"] > 0, case
            assert case["diff"] < 1e-5, (case["case"], case["diff"])


def test_an_oom_on_a_stage_of_several_data_parallel_ranks_after_the_hooks_came_off_reruns_the_batch(data_parallel):
    """Two data-parallel ranks per stage: the sync hooks and the per-step barriers stay on, and the
    consensus is hierarchical across the two simulated nodes."""
    for rank, each in enumerate(data_parallel):
        out = each["steady"]
        steady = [h for h in out["history"] if h[0] == 4]
        assert steady[0][1:5] == (4, "oom", [3], ["backward_input"]), out["history"]
        assert "in steady phase" in steady[0][5], steady[0]
        assert steady[1][1:3] == (4, "ok"), out["history"]
        assert out["found"] == 4 and out["clean"]
        assert out["fired"] == (1 if rank == 3 else 0)
        assert out["diff"] < 1e-5, out["diff"]
    assert data_parallel[0]["steady"]["transport"] == "hierarchical"


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule, microbatch", [("1F1B", "auto"), ("ZeroBubble", 2)])
def test_train_metrics_live_on_the_stage_device_update_on_the_last_stage_and_every_rank_logs_the_same(schedule, microbatch):
    """The GPU crash (NCCL cannot gather the CPU metric state of a stage) on CPU: `TokensSeen`'s
    state is born on the meta device, so a stage that does not move its metrics fails here too."""
    ranks = run_multiprocess(cases.train_metrics_on_stages, world_size=2, args=(schedule, microbatch), timeout_s=300)
    first, last = ranks[0]["series"], ranks[1]["series"]
    assert first == last, "every rank logs the same values"
    tokens = first["metrics/train/TokensSeen"]
    assert tokens == [cases.PER_PIPELINE_BATCH * cases.SEQ] * 3, tokens  # one pipeline's batch, counted once
    cross_entropy, loss = first["metrics/train/LanguageCrossEntropy"], first["loss/train/total"]
    assert all(abs(ce - lo) < 1e-4 for ce, lo in zip(cross_entropy, loss)), (cross_entropy, loss)
    assert len(set(cross_entropy)) == 3, "reset every batch: three different batches, three values"
    # SpeedMonitor sums flops_per_batch over the ranks: the pipeline's flops are counted once.
    assert ranks[0]["flops_per_batch"] > 0 and ranks[1]["flops_per_batch"] == 0


@pytest.mark.multiproc
def test_a_train_metric_a_pipeline_cannot_sync_is_refused_naming_it():
    for message in run_multiprocess(cases.sum_free_metric, world_size=2, timeout_s=200):
        assert message.startswith("PipelineMetricError") and "'Max'" in message and "get_metrics(is_train=True)" in message


def test_a_fixed_size_the_schedule_cannot_run_is_refused_with_the_sizes_that_can():
    for message in run_multiprocess(cases.fixed_bad_size, world_size=2, timeout_s=200):
        assert "device_train_microbatch_size=3" in message and "[1, 2, 4]" in message


def test_zero_bubble_with_activation_checkpointing_is_refused_with_what_to_change():
    from automicro.engine.config import FSDP2Config
    from automicro.engine.pipeline import build_pipeline
    from automicro.models import build_model

    with pytest.raises(PipelineModelError, match="use schedule: 1F1B with activation checkpointing"):
        build_pipeline(build_model("tiny", n_layers=4), PipelineConfig(schedule="ZeroBubble"), FSDP2Config(activation_checkpointing=True))


def test_an_oom_re_raised_by_torch_s_pipeline_stage_still_counts_as_an_oom():
    import torch

    from automicro.core.attempt import is_oom
    from automicro.core.consensus import OOMOnOtherRank

    def wrapped(inner: BaseException) -> RuntimeError:
        try:
            try:
                raise inner
            except BaseException as error:
                raise RuntimeError("stage 1 failed to run forward") from error
        except RuntimeError as outer:
            return outer

    assert is_oom(wrapped(torch.OutOfMemoryError("out of memory")))
    assert is_oom(wrapped(OOMOnOtherRank("another rank")))
    assert not is_oom(wrapped(ValueError("shape mismatch")))


def test_a_pipeline_saves_sharded_checkpoints_and_resumes_to_the_same_parameters(tmp_path):
    for out in run_multiprocess(cases.checkpoint_resume, world_size=2, args=("ZeroBubble", str(tmp_path)), timeout_s=400):
        assert out["diff"] < 1e-6, out["diff"]
        # The search state came back with the checkpoint: batches 0-1 from the save, 2-3 after it.
        assert out["found"] == 4 and [h[0] for h in out["resumed_history"]] == [0, 1, 2, 3], out["resumed_history"]


# ---- the YAML ----------------------------------------------------------------------------------

PP_YAML = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu-pp.yaml")


def test_the_pipeline_yaml_loads_and_a_pipeline_batch_is_per_pipeline():
    from automicro.config import load_config

    cfg = load_config(PP_YAML)
    assert cfg.pipeline == PipelineConfig(stages=2, schedule="ZeroBubble")
    assert cfg.per_rank_batch_size(2) == 12  # one pipeline of 2 stages: the whole global batch
    assert cfg.per_rank_batch_size(4) == 6  # two pipelines


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallelism_config.pipeline.stages=3"], "stages=3: must divide the world size 2"),
        (["eval_interval=2ba"], "does not evaluate yet"),
        (["save_folder=ckpt"], "set checkpoint_format: sharded"),
        (["parallelism_config.pipeline.schedule=GPipe"], "schedule='GPipe': unknown"),
    ],
)
def test_bad_pipeline_yaml_is_one_config_error_naming_the_key(overrides, message):
    from automicro.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(PP_YAML, overrides).per_rank_batch_size(2)


def test_a_pipeline_with_sharded_checkpoints_passes_the_yaml_checks():
    from automicro.config import load_config

    assert load_config(PP_YAML, ["save_folder=ckpt", "checkpoint_format=sharded"]).checkpoint_format == "sharded"


def test_a_model_without_pipeline_marks_is_refused_naming_the_methods_to_add():
    from automicro.engine.pipeline import check_pipeline_model

    with pytest.raises(PipelineModelError, match="implement pipeline_blocks\\(\\), pipeline_stage\\(blocks, first, last\\)"):
        check_pipeline_model(object())


def test_tied_embeddings_cannot_be_split_across_stages():
    from automicro.models import build_model

    model = build_model("tiny", tie_embeddings=True)
    with pytest.raises(ValueError, match="set tie_embeddings: false"):
        model.pipeline_stage(range(0, 1), first=True, last=False)
