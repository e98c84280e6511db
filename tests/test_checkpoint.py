"""Sharded (torch.distributed.checkpoint) checkpoints through `automicro.Trainer(checkpoint_format='sharded')`:
every rank writes only its own FSDP2 shards; loading restores exactly the saved model and optimizer
state and Composer's state (timestamp, the microbatch size the search found); a resumed run trains
exactly as an uninterrupted one; bad settings fail with a message naming what to change."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import automicro
from automicro.config import CHECKPOINT_FORMATS as YAML_CHECKPOINT_FORMATS
from automicro.config import ConfigError, load_config
from automicro.engine.config import FSDP2ConfigError
from automicro.composer.checkpointing import CHECKPOINT_FORMATS, CallbackStateLoadPlanner
from automicro.testing.multiprocess import run_multiprocess
from tests import checkpoint_cases as cases
from tests.toy_models import ComposerStack

REPO = Path(__file__).resolve().parents[1]
CPU_YAML = str(REPO / "configs" / "tiny-cpu.yaml")
TOLERANCE = 1e-6
CASES = ("auto", "fixed")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sharded_ckpt"))
    return folder, run_multiprocess(cases.run_checkpoint_cases, world_size=2, args=(folder,), timeout_s=300)


def _ok(result):
    assert "crash" not in result, result.get("crash")
    return result


# ---- what is on disk ---------------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_every_rank_writes_only_its_own_shards_and_no_full_state_is_written(run, case):
    folder, per_rank = run
    for result in per_rank:
        _ok(result[case])
    root = os.path.join(folder, case)
    checkpoint = os.path.join(root, f"ep0-ba{cases.CHECKPOINT_AT}")
    assert sorted(os.listdir(checkpoint)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # The only other entry is Composer's "latest" symlink, which points at the folder: no .pt file
    # with a gathered state dict was written anywhere.
    others = sorted(set(os.listdir(root)) - {f"ep0-ba{cases.CHECKPOINT_AT}"})
    assert others == ["latest-rank0.pt"], others
    latest = os.path.join(root, "latest-rank0.pt")
    assert os.path.islink(latest) and os.path.realpath(latest) == os.path.realpath(checkpoint)

    metadata = FileSystemReader(checkpoint).read_metadata()
    # Which file holds each (tensor, chunk offset); `relative_path` is the file a rank wrote.
    files = {
        index.fqn + str(tuple(index.offset or ())): info.relative_path for index, info in metadata.storage_data.items()
    }
    moments = ("exp_avg", "exp_avg_sq")
    sharded = {
        fqn: md
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
        and (fqn.startswith("state.model.") or (fqn.startswith("state.optimizers.") and fqn.endswith(moments)))
    }
    model_keys = [fqn for fqn in sharded if fqn.startswith("state.model.")]
    assert len(model_keys) == len(ComposerStack().state_dict()), model_keys
    assert len(sharded) == 3 * len(model_keys)
    for fqn, md in sharded.items():
        # Two dim-0 shards, one per rank, each written by its own rank, together the whole tensor.
        assert len(md.chunks) == 2, (fqn, md.chunks)
        assert sum(chunk.sizes.numel() for chunk in md.chunks) == md.size.numel(), fqn
        by_offset = sorted(md.chunks, key=lambda chunk: chunk.offsets[0])
        for rank, chunk in enumerate(by_offset):
            assert files[fqn + str(tuple(chunk.offsets))] == f"__{rank}_0.distcp", (fqn, chunk)
    assert "state.callbacks.AutoMicrobatching.policy.found" in metadata.state_dict_metadata or case == "fixed"


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_sharded_save_runs_without_ddp_and_reports_its_format(run, case):
    _, per_rank = run
    for result in per_rank:
        result = _ok(result[case])
        assert result["first_checkpoint_format"] == "sharded"
        assert result["first_is_ddp"] is False and result["resumed_is_ddp"] is False
        assert result["saved_checkpoints"], result


# ---- round trip and resume ---------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_load_restores_the_saved_parameters_and_optimizer_state_exactly(run, case):
    _, per_rank = run
    for rank, result in enumerate(per_rank):
        result = _ok(result[case])
        # 16 parameters, 3 AdamW tensors each (step, exp_avg, exp_avg_sq), plus the group's numbers.
        assert result["loaded_keys"] > 4 * 16, result["loaded_keys"]
        assert result["load_differences"] == [], (rank, result["load_differences"])
        assert result["resumed_at_batch"] == cases.CHECKPOINT_AT


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_resumed_run_trains_like_an_uninterrupted_one(run, case):
    _, per_rank = run
    for rank, result in enumerate(per_rank):
        result = _ok(result[case])
        uninterrupted = {int(k): v for k, v in result["uninterrupted_losses"].items()}
        saved = {int(k): v for k, v in result["saved_losses"].items()}
        resumed = {int(k): v for k, v in result["resumed_losses"].items()}
        assert sorted(saved) == list(range(cases.CHECKPOINT_AT))
        assert sorted(resumed) == list(range(cases.CHECKPOINT_AT, cases.TOTAL)), resumed
        for batch, loss in {**saved, **resumed}.items():
            assert abs(loss - uninterrupted[batch]) <= TOLERANCE, (rank, batch, loss, uninterrupted[batch])
        assert result["param_error_vs_uninterrupted"] <= TOLERANCE, result["param_error_vs_uninterrupted"]
        assert result["optim_error_vs_uninterrupted"] <= TOLERANCE, result["optim_error_vs_uninterrupted"]


@pytest.mark.multiproc
def test_auto_microbatching_resumes_with_the_size_it_found(run):
    _, per_rank = run
    for result in per_rank:
        result = _ok(result["auto"])
        assert result["saved_found_size"] == 5 and result["resumed_found_size"] == 5
        history = result["resumed_history"]
        # The search's history and OOM count came back from the checkpoint ...
        before = [r for r in history if r["batch"] < cases.CHECKPOINT_AT]
        assert [r["outcome"] for r in before].count("oom") == 2 and result["resumed_ooms_total"] == 2, before
        # ... and the resumed batches run the found size's even split at once, without a new search.
        after = [r for r in history if r["batch"] >= cases.CHECKPOINT_AT]
        assert [r["batch"] for r in after] == list(range(cases.CHECKPOINT_AT, cases.TOTAL)), after
        assert all(r["attempt"] == 1 and r["outcome"] == "ok" and r["split"] == [4, 4] for r in after), after


# ---- the load planner on its own (one process) -------------------------------------------------


@contextlib.contextmanager
def _single_process():
    """DCP without a process group runs on this process alone, with a warning saying so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _saved_callbacks_checkpoint(path: str) -> dict:
    saved = {
        "state": {
            "model": {"w": torch.arange(6.0)},
            "callbacks": {
                "Search": {"policy": {"size": 5, "found": True}, "history": [{"split": (4, 4)}, {"split": (5, 3)}]},
                "WithTensor": {"count": torch.tensor([3, 4])},
            },
        }
    }
    with _single_process():
        dcp.save(saved, storage_writer=FileSystemWriter(path))
    return saved


def _fresh_template() -> dict:
    return {
        "state": {
            "model": {"w": torch.zeros(6)},
            "callbacks": {
                "Search": {"policy": None, "history": []},  # a fresh callback: other shape
                "WithTensor": {"count": torch.zeros(2, dtype=torch.int64)},
                "AddedOnResume": {"anything": 1},  # not in the checkpoint
            },
        }
    }


def test_callback_state_of_another_shape_loads_back_exactly(tmp_path):
    saved = _saved_callbacks_checkpoint(str(tmp_path))
    template = _fresh_template()
    with _single_process():
        dcp.load(template, storage_reader=FileSystemReader(str(tmp_path)), planner=CallbackStateLoadPlanner())
    callbacks = template["state"]["callbacks"]
    assert callbacks["Search"] == saved["state"]["callbacks"]["Search"]
    assert torch.equal(callbacks["WithTensor"]["count"], torch.tensor([3, 4]))
    assert callbacks["AddedOnResume"] == {}
    assert torch.equal(template["state"]["model"]["w"], torch.arange(6.0))


def test_the_default_planner_cannot_load_it_so_the_rebuild_is_needed(tmp_path):
    _saved_callbacks_checkpoint(str(tmp_path))
    with _single_process(), pytest.raises(CheckpointException, match="Missing key.*policy"):
        dcp.load(_fresh_template(), storage_reader=FileSystemReader(str(tmp_path)), planner=DefaultLoadPlanner())


# ---- checkpoints as commits: both formats in the process group above, and sharded on
# ---- two simulated nodes of two ranks --------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Sharded commits on 2 simulated nodes (2 launchers) of 2 ranks each."""
    folder = str(tmp_path_factory.mktemp("commit_nodes"))
    return run_multiprocess(cases.run_commit_on_two_nodes, world_size=4, nodes=2, args=(folder,), timeout_s=400)


def _commit_results(run, request, layout):
    if layout == "2x2 sharded":  # asked for here: the 2-rank layouts do not launch it (legs 2 and 3 run those)
        return [_ok(result) for result in request.getfixturevalue("two_nodes")], "sharded"
    checkpoint_format = layout.split()[1]
    return [_ok(result[f"commit_{checkpoint_format}"]) for result in run[1]], checkpoint_format


LAYOUTS = ("1x2 full", "1x2 sharded", "2x2 sharded")


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS)
def test_autoresume_skips_a_broken_newest_checkpoint_and_trains_like_a_run_loaded_from_the_good_one(run, request, layout):
    results, checkpoint_format = _commit_results(run, request, layout)
    assert any(r["fault_fired"] for r in results), "the fault kit broke the save at batch 4"
    broken, good = ("ep0-ba4", "ep0-ba2") if checkpoint_format == "sharded" else ("ep0-ba4-rank0.pt", "ep0-ba2-rank0.pt")
    why = f"shard __{len(results) - 1}_0.distcp is missing" if checkpoint_format == "sharded" else "not a whole zip archive"
    for r in results:  # every rank took the same choice
        assert r["resumed_from"] == good and r["skipped"] == [broken], r
        assert why in r["skip_reasons"][0], r["skip_reasons"]
        assert r["resumed_at_batch"] == 2
        # The broken one set aside (a later save reused its name), `latest` moved on with training.
        assert f"{broken}.incomplete" in r["folder_after"] and broken in r["folder_after"], r["folder_after"]
        assert r["latest_after"] == ("ep0-ba6" if checkpoint_format == "sharded" else "ep0-ba6-rank0.pt")
        assert r["param_error_vs_loaded"] <= 1e-5 and r["optim_error_vs_loaded"] <= 1e-5, r


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_continue_or_stop_does_what_it_says(run, request, layout):
    results, checkpoint_format = _commit_results(run, request, layout)
    failing = len(results) - 1 if checkpoint_format == "sharded" else 0  # a full checkpoint is rank 0's alone
    good = "ep0-ba1" if checkpoint_format == "sharded" else "ep0-ba1-rank0.pt"
    for r in results:
        # continue: every rank counts the failed save and trains on; batch 2's save left nothing
        # behind, `latest` moved past it to batch 3 (on 2 ranks; 2x2 runs stop only).
        if layout == "2x2 sharded":
            assert "continue_error" not in r
        else:
            assert r["continue_error"] is None and r["continue_failed_saves"] == 1 and r["continue_batches"] == 3, r
            assert r["continue_folder"] == [good.replace("ba1", "ba3"), "latest-rank0.pt"], r["continue_folder"]  # keep 1
            assert r["continue_latest"] == good.replace("ba1", "ba3")
        # stop: every rank raises the same error, naming the rank, the path and the last good one.
        assert r["stop_batches"] == 2 and r["stop_failed_saves"] == 1, r
        assert f"checkpoint save failed on rank {failing} (" in r["stop_error"], r["stop_error"]
        assert "No space left on device" in r["stop_error"] and "save_failure: stop" in r["stop_error"]
        assert r["stop_error"].split(" at batch 2;")[1].startswith(" the last good checkpoint is ") and good in r["stop_error"]
        # Retention (save_num_checkpoints_to_keep=1) kept the last good one through the failed save.
        assert r["stop_folder"] == [good, "latest-rank0.pt"] and r["stop_latest"] == good, r
    assert len({r["stop_error"] for r in results}) == 1, "one message on every rank"


@pytest.mark.multiproc
def test_a_rank_killed_mid_save_leaves_a_folder_the_relaunch_resumes_from_like_a_run_loaded_there(tmp_path):
    from automicro.testing.multiprocess import MultiprocessFailure

    folder = str(tmp_path / "saves")
    with pytest.raises(MultiprocessFailure) as killed:
        run_multiprocess(cases.run_killed_save, world_size=2, args=(folder,), timeout_s=200, failure_grace_s=5)
    assert killed.value.exitcodes.get(0) == -9, killed.value.exitcodes  # SIGKILL, in the middle of the write
    per_rank = run_multiprocess(cases.run_resume_after_kill, world_size=2, args=(folder,), timeout_s=300)
    for result in per_rank:
        _ok(result)
        # What the kill left: the save at 2, `latest` at it, and batch 4's half-written temporary file.
        assert result["left"] == [".partial-ep0-ba4-rank0.pt", "ep0-ba2-rank0.pt", "latest-rank0.pt"], result["left"]
        assert result["resumed_from"] == "ep0-ba2-rank0.pt" and result["skipped"] == {} and result["resumed_at_batch"] == 2
        assert result["param_error_vs_loaded"] <= 1e-5, result["param_error_vs_loaded"]
        assert ".partial-ep0-ba4-rank0.pt" not in result["after"] and "ep0-ba6-rank0.pt" in result["after"], result["after"]


# ---- bad settings (raised before any process group exists) -------------------------------------


def _trainer(**kwargs):
    model = ComposerStack()
    args = dict(model=model, optimizers=torch.optim.AdamW(model.parameters()), device="cpu", max_duration="1ba")
    args.update(kwargs)
    return automicro.Trainer(**args)


@pytest.mark.parametrize("value", ["shard", "SHARDED", "", True])  # None: the default (full, or Composer's FSDP2Config's)
def test_a_bad_checkpoint_format_names_the_argument_and_the_choices(value):
    with pytest.raises(ValueError, match=r"checkpoint_format=.*must be one of 'full', 'sharded'"):
        _trainer(parallelism_config={"fsdp2": {}}, checkpoint_format=value)


def test_sharded_checkpoints_need_fsdp2():
    with pytest.raises(ValueError, match=r"checkpoint_format='sharded'.*needs parallelism_config.fsdp2"):
        _trainer(checkpoint_format="sharded")


def test_sharded_checkpoints_refuse_save_metrics():
    with pytest.raises(ValueError, match="save_metrics=False"):
        _trainer(parallelism_config={"fsdp2": {}}, checkpoint_format="sharded", save_metrics=True)


def test_composers_state_dict_type_key_points_to_checkpoint_format():
    with pytest.raises(FSDP2ConfigError, match=r"state_dict_type='sharded'.*checkpoint_format="):
        _trainer(parallelism_config={"fsdp2": {"state_dict_type": "sharded"}})


def test_load_path_of_the_other_format_says_which_format_to_use(tmp_path):
    sharded = tmp_path / "ep0-ba3"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match="sharded .*checkpoint folder.*checkpoint_format='sharded'"):
        _trainer(parallelism_config={"fsdp2": {}}, load_path=str(sharded))
    full = tmp_path / "ep0-ba3-rank0.pt"
    full.write_bytes(b"")
    with pytest.raises(ValueError, match="not a sharded checkpoint folder.*checkpoint_format='full'"):
        _trainer(parallelism_config={"fsdp2": {}}, checkpoint_format="sharded", load_path=str(full))


def test_yaml_key_checkpoint_format():
    assert YAML_CHECKPOINT_FORMATS == CHECKPOINT_FORMATS
    assert load_config(CPU_YAML).checkpoint_format == "full"
    assert load_config(CPU_YAML, ["checkpoint_format=sharded"]).checkpoint_format == "sharded"
    with pytest.raises(ConfigError, match=r"checkpoint_format='shard': must be one of full, sharded"):
        load_config(CPU_YAML, ["checkpoint_format=shard"])
    with pytest.raises(ConfigError, match=r"checkpoint_format='sharded'.*needs parallelism_config.fsdp2"):
        load_config(CPU_YAML, ["checkpoint_format=sharded", "parallelism_config=null", "device_eval_microbatch_size=4"])
    redirect = r"parallelism_config.fsdp2.state_dict_type='sharded'.*checkpoint_format: sharded"
    with pytest.raises(ConfigError, match=redirect):
        load_config(CPU_YAML, ["parallelism_config.fsdp2.state_dict_type=sharded"])
    # The same key written in a YAML file (the mapping's own parser, not the override check).
    with pytest.raises(ConfigError, match=r"parallelism_config.fsdp2.state_dict_type='full'.*checkpoint_format: full"):
        load_config(CPU_YAML, ["parallelism_config={fsdp2: {state_dict_type: full}}"])
