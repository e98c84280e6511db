"""`automicro.torchtitan`: torchtitan's own `Trainer` with ``--training.local_batch_size auto``.

torchtitan 0.3.0 needs torch >= 2.12: CI installs it on the torch 2.15 leg only (marker ``torchtitan``,
`.ci/run`); elsewhere this file is skipped. The launches run torchtitan's llama3 debug model on 2 and
1 gloo CPU ranks, and its routed DeepSeek-V3 debug model on 2 (tests/titan_cases.py); the rest reads torchtitan's
config registry, no launch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed on CI's torch 2.15 leg only")

from automicro.testing.multiprocess import run_multiprocess  # noqa: E402
from tests import titan_cases as cases  # noqa: E402
from tests.adapter_checks import check_steady_oom  # noqa: E402

pytestmark = pytest.mark.torchtitan
TOLERANCE = 2e-5  # float32 on CPU: the same sums in another order (each microbatch's backward is torchtitan's own)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("titan"))
    cases.make_assets(f"{folder}/assets")
    return {case: run_multiprocess(cases.run, world_size=2, args=(folder, case), timeout_s=300)
            for case in ("search", "reference", "resumed")}


@pytest.mark.multiproc
def test_a_search_where_one_rank_runs_out_then_a_late_oom_train_like_torchtitan_at_the_split_in_use(two_ranks):
    for rank in range(2):
        run, reference = two_ranks["search"][rank], two_ranks["reference"][rank]
        assert "error" not in run, cases.describe(run)
        # Each rank's batch of a step is global_batch_size / 2 ranks; only rank 1 ran out, above 4 a microbatch.
        assert run["batch"] == cases.BATCH
        ooms = [h for h in run["history"] if h["outcome"] == "oom"]
        assert ooms and all(h["failed_ranks"] == [1] for h in ooms), run["history"]
        assert all(r["split"] == [4, 4] for r in run["results"]), run["results"]
        assert run["results"][0]["attempts"] > 1
        # Hooks off from batch 3; the OOM in batch 4's backward cost one rerun of that batch at the same split.
        check_steady_oom({**run, "reference": reference["params"]}, 1, rank, batch=4)
        assert run["results"][-1]["hooks"] is False and run["step"] == 6
        # torchtitan's token count saw each batch once, though batch 0 and 4 ran twice.
        assert "error" not in reference, cases.describe(reference)
        assert run["ntokens_seen"] == reference["ntokens_seen"] == 6 * cases.BATCH * cases.SEQ
        assert run["metrics"]["automicro/found_size"] == 4
        # torchtitan's metrics carry the automicro/* keys beside its own, every step.
        assert len(run["logged"]) == 6 and run["logged"][-1]["automicro/found_size"] == 4, run["logged"]
        # torchtitan's validation ran at the microbatch size in use at step 1, at steps 1 and 6.
        assert run["validation"] == {"batch": 4, "runs": 2}, run["validation"]
        assert cases.max_error(run["params"], reference["params"]) <= TOLERANCE, rank


@pytest.mark.multiproc
def test_a_run_resumed_from_torchtitans_checkpoint_keeps_the_size_and_ends_like_an_unbroken_run(two_ranks):
    for rank in range(2):
        resumed = two_ranks["resumed"][rank]
        assert "error" not in resumed, cases.describe(resumed)
        assert resumed["step"] == 6
        # The search's state came back from torchtitan's DCP checkpoint: the resumed steps start at [4, 4], no OOM.
        assert len(resumed["results"]) == 3, resumed["results"]
        assert all(r["split"] == [4, 4] and r["attempts"] == 1 for r in resumed["results"]), resumed["results"]
        assert not [h for h in resumed["history"] if h["batch"] >= 3 and h["outcome"] == "oom"], resumed["history"]
        assert cases.max_error(resumed["params"], two_ranks["reference"][rank]["params"]) <= TOLERANCE, rank


@pytest.mark.multiproc
def test_one_rank_compiled_searches_down_to_size_one_and_trains_like_torchtitan_at_one_sample(tmp_path):
    folder = str(tmp_path)
    cases.make_assets(f"{folder}/assets")
    (run,) = run_multiprocess(cases.run, world_size=1, args=(folder, "one_rank"), timeout_s=300)
    (reference,) = run_multiprocess(cases.run, world_size=1, args=(folder, "one_rank_reference"), timeout_s=300)
    assert "error" not in run, cases.describe(run)
    assert "error" not in reference, cases.describe(reference)
    # torchtitan's compiled blocks and loss (aot_eager on CPU): sizes 3 then 1, each compiled, the sync hooks eager.
    assert [r["split"] for r in run["results"]] == [[1, 1, 1]] * 3, run["results"]
    assert run["metrics"]["automicro/found_size"] == 1
    assert cases.max_error(run["params"], reference["params"]) <= TOLERANCE


# ---- no launch: the command line and what is refused ------------------------------------------------------


def _config(*extra: str, name: str = "llama3_debugmodel"):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", "llama3", "--config", name, *extra])


def test_the_command_line_takes_auto_and_the_settings_and_leaves_the_rest_to_torchtitan():
    from automicro.torchtitan import TorchtitanConfigError, split_arguments

    rest, auto, settings = split_arguments(
        ["--module", "llama3", "--training.local_batch_size", "auto", "--automicro.stable_batches", "4",
         "--automicro.search=bisect", "--training.steps", "10"]
    )
    assert auto and rest == ["--module", "llama3", "--training.steps", "10"]
    assert settings == {"stable_batches": 4, "search": "bisect"}
    rest, auto, _ = split_arguments(["--training.local_batch_size=auto"])
    assert auto and rest == []
    rest, auto, _ = split_arguments(["--training.local_batch_size", "4"])
    assert not auto and rest == ["--training.local_batch_size", "4"]
    with pytest.raises(TorchtitanConfigError, match="unknown automicro setting"):
        split_arguments(["--training.local_batch_size", "auto", "--automicro.stable_batch", "4"])
    with pytest.raises(TorchtitanConfigError, match="without --training.local_batch_size auto"):
        split_arguments(["--automicro.stable_batches", "4"])
    with pytest.raises(TorchtitanConfigError, match="give the setting a value"):
        split_arguments(["--training.local_batch_size", "auto", "--automicro.stable_batches"])


def test_each_ranks_batch_of_a_step_is_the_global_batch_over_the_ranks_or_the_configs_own():
    from automicro.torchtitan import TorchtitanConfigError, per_rank_batch, refusals

    assert per_rank_batch(_config("--training.global_batch_size", "64"), 8)[0] == 8
    assert per_rank_batch(_config(), 8)[0] == 8  # llama3_debugmodel's local_batch_size 8, no global batch
    # A real size from torchtitan's zoo, as its registry has it: accepted, one sample a rank a step until a global
    # batch is set (the run says so), the global batch over the ranks then.
    real = _config(name="llama3_8b")
    assert refusals(real) == [] and per_rank_batch(real, 8)[0] == 1
    assert per_rank_batch(_config("--training.global_batch_size", "256", name="llama3_8b"), 8)[0] == 32
    with pytest.raises(TorchtitanConfigError, match="not a multiple of the data-parallel degree 8"):
        per_rank_batch(_config("--training.global_batch_size", "60"), 8)


@pytest.mark.parametrize(
    "extra, name, says",
    [
        (("--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"), "llama3_debugmodel",
         "the microbatches are the schedule's"),
        (("--parallelism.context_parallel_degree", "2"), "llama3_debugmodel", "context parallel"),
        (("--parallelism.tensor_parallel_degree", "2"), "llama3_debugmodel", "tensor parallel"),
        (("--parallelism.expert_parallel_degree", "2"), "llama3_debugmodel", "expert parallel"),
        (("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
         "llama3_debugmodel", "is DDP"),
        (("--training.enable_cpu_offload",), "llama3_debugmodel", "offloading"),
    ],
    ids=["pipeline", "context", "tensor", "expert", "ddp", "cpu-offload"],
)
def test_what_auto_does_not_run_is_refused_at_start_with_what_to_set(extra, name, says):
    from automicro.torchtitan import AutoTrainer, TorchtitanConfigError, refusals

    config = _config(*extra, name=name)
    lines = refusals(config)
    assert len(lines) == 1 and says in lines[0], lines
    assert "set" in lines[0] or "use" in lines[0]
    with pytest.raises(TorchtitanConfigError, match=says):
        AutoTrainer(config)  # before any process group or model is made
    assert refusals(_config()) == []


def test_a_token_budget_and_unknown_settings_are_refused():
    from automicro.torchtitan import AutoTrainer, TorchtitanConfigError

    with pytest.raises(TorchtitanConfigError, match="sample budget is the token budget"):
        AutoTrainer(_config(), {"budget": "tokens"})
    with pytest.raises(TypeError, match="unknown automicro setting"):
        AutoTrainer(_config(), {"stable_batch": 2})


@pytest.mark.multiproc
def test_the_module_runs_under_torchrun_with_one_key_changed(tmp_path):
    """`torchrun -m automicro.torchtitan` with torchtitan's own arguments and `--training.local_batch_size auto`:
    the run trains, says each rank's batch, finds the size and exits 0."""
    import os
    import sys

    from tests.launch import python_path, run

    assets = cases.make_assets(str(tmp_path / "assets"))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "automicro.torchtitan",
        *cases.argv(assets, str(tmp_path / "out"), 2, "--training.global_batch_size", "2"),
        "--training.local_batch_size", "auto", "--automicro.stable_batches", "1",
    ]
    done = run(command, 240, env={**os.environ, "PYTHONPATH": python_path(), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-4000:]
    assert "each rank trains 2 samples a step (training.global_batch_size 2 / 1 ranks" in done.stdout, done.stdout[-4000:]
    assert "microbatch size found: 2" in done.stdout, done.stdout[-4000:]


def test_another_torchtitan_version_is_refused_with_the_one_to_install(monkeypatch):
    import torchtitan

    from automicro.torchtitan import AutoTrainer

    monkeypatch.setattr(torchtitan, "__version__", "0.2.1")
    with pytest.raises(RuntimeError, match=r"torchtitan 0.2.1 is installed; automicro supports torchtitan 0.3.0"):
        AutoTrainer(_config())


@pytest.mark.multiproc
def test_torchtitans_routed_debug_model_searches_reruns_a_late_oom_and_counts_each_experts_tokens_once(tmp_path):
    """torchtitan's DeepSeek-V3 debug model (8 experts, 3 a token): its MoE counts the tokens each expert got in every
    training forward, and its optimizer step moves the expert bias by them. A late OOM in backward on rank 1 reruns
    the batch; what the failed attempt counted is undone (`automicro.batch.forward_state`): the counts each layer holds
    as its forwards begin are those of torchtitan's own run at 4 (without the undo they reach 3,072 where torchtitan's
    stop at 2,304), and so are the parameters and the expert bias."""
    folder = str(tmp_path)
    cases.make_assets(f"{folder}/assets")
    runs = {case: run_multiprocess(cases.run, world_size=2, args=(folder, case), timeout_s=300)
            for case in ("moe_search", "moe_reference")}
    for rank in range(2):
        run, reference = runs["moe_search"][rank], runs["moe_reference"][rank]
        assert "error" not in run, cases.describe(run)
        assert "error" not in reference, cases.describe(reference)
        assert all(r["split"] == [4, 4] for r in run["results"]), run["results"]
        assert run["results"][0]["attempts"] > 1 and run["results"][4]["attempts"] == 2, run["results"]
        assert run["expert_counts"] and sorted(set(run["expert_counts"])) == sorted(set(reference["expert_counts"]))
        assert any("expert_bias" in name for name in reference["params"])
        assert cases.max_error(run["params"], reference["params"]) <= TOLERANCE, rank
