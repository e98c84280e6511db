"""What a user sees first when they reach automicro from where Composer users already are:
a stock `composer.Trainer` with `AutoMicrobatching`, Composer's own FSDP2 / parallelism configs,
and the inputs that used to end in raw tracebacks. Each case asserts automicro's message, naming
what to change; none depends on timing."""

from __future__ import annotations

import json
import sys
import warnings

import composer
import pytest
import torch

import automicro
from automicro import AutoMicrobatching
from automicro.composer import _composer_internals
from automicro.composer.stock_trainer import StockTrainerError
from tests.toy_models import ComposerStack, make_data

FIX = "replace `from composer import Trainer` with `from automicro import Trainer`"


def _loader():
    return torch.utils.data.DataLoader(make_data(2, 4), batch_size=None)


def _stock_trainer(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return composer.Trainer(model=ComposerStack(), train_dataloader=_loader(), max_duration="1ba", **kwargs)


# ------------------------------------------------------------------------------------------
# Item 3: stock composer.Trainer + AutoMicrobatching
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, composer_own_refusal",
    [
        # CPU: Composer's `_is_auto_microbatching` refuses 'auto' off GPU before anything else.
        pytest.param({"device": "cpu", "device_train_microbatch_size": "auto"}, "adaptive", id="auto-cpu"),
        # GPU: with FSDP2 Composer refuses 'auto' outside FSDP1. Checked before Composer builds the
        # device, so it runs here without a GPU just as it would on one.
        pytest.param(
            {"device": "gpu", "device_train_microbatch_size": "auto", "parallelism_config": {"fsdp2": {}}},
            "FSDP1",
            id="auto-gpu-fsdp2",
        ),
        # Fixed size: Composer accepts it and the callback would do nothing, silently.
        pytest.param({"device": "cpu", "device_train_microbatch_size": 2}, None, id="fixed-cpu"),
    ],
)
def test_stock_composer_trainer_with_the_callback_is_refused_first_naming_the_fix(kwargs, composer_own_refusal):
    with pytest.raises(StockTrainerError) as info:
        _stock_trainer(callbacks=[AutoMicrobatching(log_attempts=False)], **kwargs)
    message = str(info.value)
    assert FIX in message, message
    assert "AutoMicrobatching needs automicro's Trainer" in message
    if composer_own_refusal is None:
        assert "device_train_microbatch_size=2" in message and "remove AutoMicrobatching from callbacks" in message
    else:
        assert composer_own_refusal not in message.split("(")[0]  # automicro's words, not Composer's


def test_stock_composer_trainer_without_the_callback_is_left_alone():
    trainer = _stock_trainer(device="cpu", device_train_microbatch_size=2, loggers=[], progress_bar=False)
    trainer.close()


def test_automicro_trainer_with_a_fixed_size_keeps_the_callback_idle_not_refused():
    callback = AutoMicrobatching(log_attempts=False)
    trainer = automicro.Trainer(
        model=ComposerStack(), train_dataloader=_loader(), max_duration="1ba", device="cpu",
        device_train_microbatch_size=2, callbacks=[callback], loggers=[], progress_bar=False,
    )
    assert trainer.auto_microbatching is None
    trainer.close()


def test_without_the_early_check_the_callback_refuses_the_stock_trainer_at_init(monkeypatch):
    """The fallback where the check before Composer's cannot be installed (another Composer version)."""
    monkeypatch.setattr(_composer_internals, "_TRAINER_INIT_CHECKS", [])
    with pytest.raises(StockTrainerError, match="remove AutoMicrobatching from callbacks"):
        _stock_trainer(device="cpu", device_train_microbatch_size=2, callbacks=[AutoMicrobatching(log_attempts=False)])


# ------------------------------------------------------------------------------------------
# Item 4: raw tracebacks become `config error:` lines (scripts/train.py, one process)
# ------------------------------------------------------------------------------------------

from tests.launch import run as _launch  # noqa: E402

SWEEP = [
    # (overrides, fragments of the one `config error:` line)
    pytest.param(["load_path=/definitely/not/here.pt"], ["load_path='/definitely/not/here.pt'", "no such file", "load_path to null"], id="load-path-missing"),
    pytest.param(["parallelism_config=null", "compile.scope=blocks"], ["compile.scope='blocks'", "parallelism_config.fsdp2", "scope: model"], id="compile-blocks-without-fsdp2"),
    pytest.param(["parallelism_config=null", "model.init_device=meta"], ["model.init_device='meta'", "only FSDP2 materializes", "model.init_device: cpu"], id="meta-without-fsdp2"),
    pytest.param(["seed=99999999999"], ["seed=99999999999", "4294967295"], id="seed-range"),
    pytest.param(["device=gpu"], ["device='gpu'", "no CUDA device", "device: cpu"], id="gpu-without-cuda"),
    pytest.param(["run_dir=/proc/automicro-test/x"], ["run_dir='/proc/automicro-test/x'", "cannot create or write"], id="run-dir-unwritable"),
    pytest.param(["save_folder=/proc/automicro-test"], ["save_folder='/proc/automicro-test'", "cannot create or write"], id="save-folder-unwritable"),
    pytest.param(["model.overrides.n_heads=5"], ["model (preset 'tiny'", "n_heads (5)", "change model.overrides"], id="model-shape"),
    pytest.param(["data.max_bytes=10"], ["data (kind 'text')", "max_bytes=10", "data.max_bytes"], id="data-too-small"),
    pytest.param(["data.kind=synthetic", "data.num_samples=1"], ["data: the dataloader has no batches", "data.num_samples"], id="data-no-batches"),
    pytest.param(["parallelism_config.fsdp2.reshard_after_forward=3"], ["parallelism_config.fsdp2.reshard_after_forward=3", "divide the shard group size 1"], id="reshard-vs-world"),
    pytest.param(["callbacks.speed_monitor.window_size=0"], ["callbacks.speed_monitor.window_size=0", "positive int"], id="speed-monitor-window"),
    pytest.param(["load_path=configs/tiny-cpu.yaml"], ["load_path='configs/tiny-cpu.yaml'", "cannot be read as a Composer checkpoint"], id="load-path-not-a-checkpoint"),
    pytest.param(["load_path=configs"], ["load_path='configs'", "is a folder", ".pt file"], id="load-path-folder-for-full"),
    pytest.param(["checkpoint_format=sharded", "load_path=configs"], ["load_path='configs'", "not a sharded checkpoint folder"], id="load-path-not-dcp"),
]


def _argv(overrides: list[str], run_dir: str) -> list[str]:
    args = ["configs/tiny-cpu.yaml", "max_duration=1ba", *overrides]
    return args if any(o.startswith("run_dir=") for o in overrides) else [*args, f"run_dir={run_dir}"]


@pytest.fixture(scope="module")
def sweep_results(tmp_path_factory) -> dict[str, dict]:
    """Every case of SWEEP through `scripts/train.py`'s `main`, in one process (tests/config_error_run.py:
    one import of torch and Composer instead of one per case; 13 s each before)."""
    from tests.config_error_run import MARKER

    ids = [case.id for case in SWEEP]
    argvs = [_argv(list(case.values[0]), str(tmp_path_factory.mktemp(case.id))) for case in SWEEP]
    result = _launch([sys.executable, "tests/config_error_run.py", json.dumps(argvs)], timeout_s=600)
    assert result.returncode == 0 and MARKER in result.stdout, result.stdout[-4000:]
    results = json.loads(result.stdout.split(MARKER, 1)[1].splitlines()[0])
    return dict(zip(ids, results))


@pytest.mark.parametrize("overrides, fragments", SWEEP)
def test_a_bad_top_level_value_ends_in_one_config_error_line_not_a_traceback(sweep_results, request, overrides, fragments):
    result = sweep_results[request.node.callspec.id]
    output = result["output"]
    lines = [line for line in output.splitlines() if line.strip()]
    assert result["returncode"] == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    error_lines = [line for line in lines if line.startswith("config error: ")]
    assert len(error_lines) == 1 and error_lines[0] == lines[-1], lines[-5:]
    for fragment in fragments:
        assert fragment in error_lines[0], (fragment, error_lines[0])


def test_load_path_is_checked_by_the_yaml_and_by_the_trainer_with_the_same_reason(tmp_path):
    from automicro.config import ConfigError, load_config, load_path_problem

    missing = str(tmp_path / "nope.pt")
    reason = load_path_problem(missing, "full")
    with pytest.raises(ConfigError) as info:
        load_config("configs/tiny-cpu.yaml", [f"load_path={missing}"])
    assert reason and reason in str(info.value)
    with pytest.raises(ValueError) as info:
        automicro.Trainer(model=ComposerStack(), device="cpu", max_duration="1ba", load_path=missing)
    assert reason in str(info.value)
    assert load_path_problem("s3://bucket/ckpt.pt", "full") is None  # remote: Composer fetches it


# ------------------------------------------------------------------------------------------
# Multi-process: resume with a stateless optimizer, Composer's configs end to end
# ------------------------------------------------------------------------------------------

from automicro.testing.multiprocess import MultiprocessFailure, run_multiprocess  # noqa: E402
from tests import user_error_cases as cases  # noqa: E402


@pytest.fixture(scope="module")
def trainer_cases(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("user_errors"))
    return run_multiprocess(cases.run_trainer_cases, world_size=2, args=(folder,), timeout_s=400)


def _ok(result):
    assert "crash" not in result, result.get("crash")
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_resume_with_an_optimizer_that_keeps_no_state_restores_and_trains_on_exactly(trainer_cases, checkpoint_format):
    """Plain SGD (no momentum): a full checkpoint used to fail inside torch's set_optimizer_state_dict
    with a bare AssertionError."""
    for result in trainer_cases:
        result = _ok(result[f"resume/{checkpoint_format}"])
        assert result["resumed_at_batch"] == cases.SAVE_AT
        assert result["load_differences"] == [], result
        assert result["final_differences"] == [], result


@pytest.mark.multiproc
def test_composers_own_fsdp2_config_is_carried_over_with_its_checkpoint_format(trainer_cases):
    for result in trainer_cases:
        default = _ok(result["composer/fsdp2_default"])  # Composer's default state_dict_type is 'sharded'
        full = _ok(result["composer/parallelism_full"])
        for run in (default, full):
            assert run["sharded_blocks"] and run["batches"] == 3 and run["found_size"] == 5, run
        assert default["checkpoint_format"] == "sharded" and full["checkpoint_format"] == "full"


# ------------------------------------------------------------------------------------------
# Multi-process: a non-OOM error on one rank with the hooks off; every rank names it
# ------------------------------------------------------------------------------------------


def _every_rank_names_rank_1(info: MultiprocessFailure, err: str) -> None:
    """Rank 1 failed first. A rank that returned names rank 1 in its exception; a rank ended by
    the watcher (exit code 3, blocked in a collective) names it on its stderr line."""
    for rank in (0, 1):
        result = info.results.get(rank)
        if result is not None:
            message = result["exception"]["message"]
            assert "rank 1" in message and "Connection closed" not in message, (rank, message)
            assert result["exception"]["type"] == "FatalRecoveryError", (rank, result)
        else:
            assert info.exitcodes.get(rank) == 3, (rank, info.exitcodes)
            lines = [line for line in err.splitlines() if line.startswith(f"[automicro] rank {rank} stops") or
                     line.startswith(f"[automicro] automicro: rank {rank} stops")]
            assert lines and "rank 1" in lines[-1].split("stops:", 1)[1], (rank, err[-3000:])


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["run_error_without_ledger", "run_error_between_batches"])
def test_a_non_oom_error_on_one_rank_is_named_on_every_rank(capfd, case):
    """`steady_recovery=False` (no ledger: the job-lost alarm tells the others) and an error in a
    callback between batches (the ledger's board tells them); before, the other rank's last line
    was gloo's "Connection closed by peer"."""
    with pytest.raises(MultiprocessFailure) as failure:
        # spawn: the workers' stderr reaches capfd (a forkserver's workers write to the server's)
        run_multiprocess(getattr(cases, case), world_size=2, timeout_s=120, failure_grace_s=30, start_method="spawn")
    _every_rank_names_rank_1(failure.value, capfd.readouterr().err)


# ------------------------------------------------------------------------------------------
# Item 7: Composer's own FSDP2Config / ParallelismConfig (translation, one process)
# ------------------------------------------------------------------------------------------


def _composer_fsdp2(**kwargs):
    from composer.utils import FSDP2Config as ComposerFSDP2Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ComposerFSDP2Config(**kwargs)


def test_composer_fsdp2_fields_that_mean_the_same_are_carried_over():
    from automicro.composer.composer_config import from_composer_parallelism

    parallelism, fmt = from_composer_parallelism(
        {"fsdp2": _composer_fsdp2(reshard_after_forward=False, activation_checkpointing=True, mixed_precision="PURE")},
        None, precision="amp_bf16", device="gpu",
    )
    engine = parallelism["fsdp2"]
    assert (engine.reshard_after_forward, engine.activation_checkpointing, engine.mixed_precision, engine.replicate) == (
        False, True, "PURE", 1,
    )
    assert fmt == "sharded"  # Composer's default state_dict_type
    # Composer casts to the Trainer's precision: with fp32 there is no cast, the engine's FULL.
    parallelism, _ = from_composer_parallelism({"fsdp2": _composer_fsdp2()}, None, precision="fp32", device="cpu")
    assert parallelism["fsdp2"].mixed_precision == "FULL"


@pytest.mark.parametrize(
    "make, kwargs, fragments",
    [
        pytest.param(lambda: {"fsdp2": _composer_fsdp2(activation_cpu_offload=True)}, {}, ["activation_cpu_offload=True", "set activation_cpu_offload=False"], id="activation-offload"),
        pytest.param(lambda: {"fsdp2": _composer_fsdp2(load_monolith_rank0_only=True)}, {}, ["load_monolith_rank0_only=True", "=False"], id="monolith"),
        pytest.param(lambda: {"fsdp2": _composer_fsdp2()}, {"precision": "amp_fp16", "device": "gpu"}, ["mixed_precision='DEFAULT'", "precision='amp_fp16'", "precision='amp_bf16'"], id="fp16-params"),
        pytest.param(lambda: {"fsdp2": _composer_fsdp2(state_dict_type="sharded")}, {"checkpoint_format": "full"}, ["state_dict_type='sharded'", "checkpoint_format='full'", "disagree"], id="format-conflict"),
    ],
)
def test_composer_fsdp2_fields_without_a_meaning_here_are_refused_naming_the_field(make, kwargs, fragments):
    from automicro.engine.config import FSDP2ConfigError
    from automicro.composer.composer_config import from_composer_parallelism

    checkpoint_format = kwargs.pop("checkpoint_format", None)
    with pytest.raises(FSDP2ConfigError) as info:
        from_composer_parallelism(make(), checkpoint_format, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_composer_parallelism_config_with_fsdp1_is_refused_by_the_trainer_naming_the_field():
    from composer.utils import FSDPConfig, ParallelismConfig

    from automicro.engine.config import FSDP2ConfigError

    with pytest.raises(FSDP2ConfigError, match=r"ParallelismConfig\)\.fsdp: .*FSDP2 only.*set fsdp=None"):
        automicro.Trainer(model=ComposerStack(), device="cpu", max_duration="1ba", parallelism_config=ParallelismConfig(fsdp=FSDPConfig()))


def test_a_meta_device_model_without_fsdp2_is_refused_with_the_fix():
    """Torch's raw `Cannot copy out of meta tensor` became one line naming the fix."""
    import automicro

    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"meta device .* model\.init_device: cpu\) or pass parallelism_config=\{'fsdp2': \{\}\}"):
        automicro.Trainer(model=model, train_dataloader=None, max_duration="1ba", device="cpu",
                          device_train_microbatch_size="auto", parallelism_config=None)
