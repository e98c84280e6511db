"""`automicro.config`: YAML + overrides -> validated `TrainConfig`; every bad input is a `ConfigError`
naming the dotted key and the value, raised before any process group exists."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from pathlib import Path
from typing import Optional

import pytest

from automicro.config import (
    KNOWN_CALLBACKS,
    ConfigError,
    TrainConfig,
    from_dict,
    load_config,
    parse_cli,
)
from automicro.engine.config import FSDP2Config

REPO = Path(__file__).resolve().parents[1]
CPU_YAML = str(REPO / "configs" / "tiny-cpu.yaml")
GPU_YAML = str(REPO / "configs" / "tiny-gpu.yaml")
THIS_FILE = str(Path(__file__).resolve())


@dataclasses.dataclass
class _FakeLlamaConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    tie_embeddings: bool = False


@pytest.fixture(autouse=True)
def fake_llama(monkeypatch):
    """Pin the LlamaConfig the model checks see, whatever state automicro/models/llama.py is in."""
    mod = types.ModuleType("automicro.models.llama")
    mod.LlamaConfig = _FakeLlamaConfig
    monkeypatch.setitem(sys.modules, "automicro.models.llama", mod)


def _load(*overrides: str) -> TrainConfig:
    return load_config(CPU_YAML, list(overrides))


# ------------------------------------------------------------------------------------------
# Valid configs
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, device, precision, gbs, seq_len, mixed_precision",
    [
        pytest.param(CPU_YAML, "cpu", "fp32", 16, 128, "FULL", id="tiny-cpu"),
        pytest.param(GPU_YAML, "gpu", "amp_bf16", 32, 512, "DEFAULT", id="tiny-gpu"),
    ],
)
def test_shipped_configs_load(path, device, precision, gbs, seq_len, mixed_precision):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert cfg.device == device and cfg.precision == precision
    assert cfg.global_train_batch_size == gbs and cfg.data.seq_len == seq_len
    assert cfg.device_train_microbatch_size == "auto"
    assert cfg.device_eval_microbatch_size == "auto"
    assert cfg.model.preset == "tiny" and cfg.data.kind == "text" and cfg.data.paths is None
    assert cfg.max_duration == "30ba"
    assert isinstance(cfg.fsdp2, FSDP2Config) and cfg.fsdp2.mixed_precision == mixed_precision
    assert cfg.callbacks["speed_monitor"] == {"window_size": 5}
    assert "auto_microbatching" in cfg.callbacks
    assert ("memory_cap" in cfg.callbacks) == (device == "cpu")
    assert cfg.loggers.console is True
    assert cfg.run_dir == f"runs/{cfg.run_name}"  # interpolation resolved
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.betas == [0.9, 0.95]


def test_empty_yaml_gives_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    cfg = load_config(p)
    assert cfg == from_dict({})
    assert cfg.run_dir == "runs/automicro"  # the default's interpolation sees the default run_name
    # The defaults run: FSDP2 with every default is on (the search also runs unsharded on one rank).
    assert cfg.fsdp2 == FSDP2Config()
    assert cfg.device_train_microbatch_size == "auto"


def test_defaults_interpolate_against_yaml_values(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run_name: abc\nsave_folder: ${run_dir}/ckpt\n")
    cfg = load_config(p)
    assert (cfg.run_dir, cfg.save_folder) == ("runs/abc", "runs/abc/ckpt")


OVERRIDE_CASES = [
    pytest.param(["max_duration=10ba"], lambda c: c.max_duration, "10ba", id="time-string"),
    pytest.param(["model.n_layers=3"], lambda c: c.model.overrides, {"n_layers": 3}, id="model-shorthand-folds"),
    pytest.param(["model.overrides.n_layers=3"], lambda c: c.model.overrides, {"n_layers": 3}, id="model-overrides"),
    pytest.param(["model.overrides.rope_theta=5"], lambda c: c.model.overrides["rope_theta"], 5.0, id="llama-int-to-float"),
    pytest.param(["model.preset=125m"], lambda c: c.model.preset, "125m", id="nested-enum"),
    pytest.param(["optimizer.lr=1e-4"], lambda c: c.optimizer.lr, 1e-4, id="float-sci"),
    pytest.param(["optimizer.lr=1"], lambda c: (c.optimizer.lr, type(c.optimizer.lr)), (1.0, float), id="int-for-float"),
    pytest.param(["optimizer.betas=[0.8, 0.99]"], lambda c: c.optimizer.betas, [0.8, 0.99], id="list"),
    pytest.param(["device_train_microbatch_size=auto"], lambda c: c.device_train_microbatch_size, "auto", id="mb-auto"),
    pytest.param(["device_train_microbatch_size=2"], lambda c: c.device_train_microbatch_size, 2, id="mb-int"),
    # Without FSDP the search cannot run: a fixed size (`auto` without fsdp2 is a ConfigError).
    pytest.param(["parallelism_config=null", "device_train_microbatch_size=4"], lambda c: (c.parallelism_config, c.fsdp2), (None, None), id="no-fsdp"),
    pytest.param(
        ["parallelism_config.fsdp2.reshard_after_forward=false"],
        lambda c: c.fsdp2.reshard_after_forward,
        False,
        id="fsdp2-bool",
    ),
    pytest.param(["parallelism_config.fsdp2.wrap=[LlamaBlock]"], lambda c: c.fsdp2.wrap, ["LlamaBlock"], id="fsdp2-wrap"),
    pytest.param(
        ["callbacks.lr_monitor={}"],
        lambda c: c.callbacks,
        {**load_config(CPU_YAML).callbacks, "lr_monitor": {}},
        id="callback-added",
    ),
    pytest.param(["callbacks.lr_monitor=null"], lambda c: c.callbacks["lr_monitor"], {}, id="callback-null-kwargs"),
    pytest.param(["callbacks.speed_monitor.window_size=9"], lambda c: c.callbacks["speed_monitor"], {"window_size": 9}, id="callback-kwarg"),
    pytest.param(["data.kind=synthetic", "data.vocab_size=256"], lambda c: (c.data.kind, c.data.vocab_size), ("synthetic", 256), id="data"),
    pytest.param([f"data.paths=[{THIS_FILE}]"], lambda c: c.data.paths, [THIS_FILE], id="data-paths-exist"),
    pytest.param(["run_name=foo"], lambda c: c.run_dir, "runs/foo", id="interpolation-follows-override"),
    pytest.param(["loggers.wandb=true", "loggers.wandb_project=p"], lambda c: (c.loggers.wandb, c.loggers.wandb_project), (True, "p"), id="loggers"),
    pytest.param(["eval_interval=5ba", "device_eval_microbatch_size=8"], lambda c: c.eval_interval, "5ba", id="optional-time"),
    pytest.param(["scheduler.t_warmup=0.1dur"], lambda c: c.scheduler.t_warmup, "0.1dur", id="warmup-dur"),
    pytest.param(["seed=1", "seed=2"], lambda c: c.seed, 2, id="last-override-wins"),
    pytest.param(["device=gpu", "precision=amp_fp16"], lambda c: c.precision, "amp_fp16", id="amp-on-gpu"),
]


@pytest.mark.parametrize("overrides, get, expected", OVERRIDE_CASES)
def test_overrides_apply(overrides, get, expected):
    assert get(_load(*overrides)) == expected


# ------------------------------------------------------------------------------------------
# Bad values: each message names the dotted key and the value
# ------------------------------------------------------------------------------------------

BAD_CASES = [
    # unknown keys
    pytest.param("foo=1", ["'foo=1'", "unknown key 'foo'", "run_name"], id="unknown-top-level"),
    pytest.param("data.foo=1", ["'data.foo=1'", "unknown key 'data.foo'", "seq_len"], id="unknown-nested"),
    pytest.param("loggers.wandbproject=x", ["loggers.wandbproject", "did you mean 'wandb_project'"], id="unknown-nested-typo"),
    pytest.param("model.n_layrs=3", ["model.n_layrs=3", "unknown key", "did you mean 'n_layers'"], id="unknown-model-key"),
    pytest.param("model.overrides.bogus=1", ["model.overrides.bogus=1", "unknown LlamaConfig field"], id="unknown-llama-field"),
    # wrong types
    pytest.param("seed=abc", ["seed='abc'", "must be an int"], id="str-for-int"),
    pytest.param("seed=true", ["seed=True", "must be an int"], id="bool-for-int"),
    pytest.param("seed=1.5", ["seed=1.5", "must be an int"], id="float-for-int"),
    pytest.param("global_train_batch_size='16'", ["global_train_batch_size='16'", "must be an int"], id="quoted-int"),
    pytest.param("data.shuffle=1", ["data.shuffle=1", "must be true or false"], id="int-for-bool"),
    pytest.param("optimizer.lr=fast", ["optimizer.lr='fast'", "must be a number"], id="str-for-float"),
    pytest.param("optimizer.lr=true", ["optimizer.lr=True", "must be a number"], id="bool-for-float"),
    pytest.param("run_name=5", ["run_name=5", "must be a string"], id="int-for-str"),
    pytest.param("data.paths=foo", ["data.paths='foo'", "must be a list of strings or null"], id="str-for-list"),
    pytest.param("optimizer.betas=[0.9, x]", ["optimizer.betas[1]='x'", "must be a number"], id="list-item"),
    pytest.param("loggers=5", ["loggers=5", "must be a mapping"], id="scalar-for-section"),
    pytest.param("model.n_layers=3.5", ["model.n_layers=3.5", "must be an int"], id="llama-field-type"),
    # enums
    pytest.param("device=tpu", ["device='tpu'", "cpu, gpu"], id="enum-device"),
    pytest.param("precision=fp8", ["precision='fp8'", "fp32, amp_bf16, amp_fp16"], id="enum-precision"),
    pytest.param("model.preset=13b", ["model.preset='13b'", "tiny, 125m, 1b, 3b, 7b"], id="enum-preset"),
    pytest.param("model.init_device=cuda", ["model.init_device='cuda'", "cpu, meta"], id="enum-init-device"),
    pytest.param("optimizer.name=adam", ["optimizer.name='adam'", "adamw, decoupled_adamw, sgd"], id="enum-optimizer"),
    pytest.param("scheduler.name=cosine", ["scheduler.name='cosine'", "cosine_with_warmup"], id="enum-scheduler"),
    pytest.param("data.kind=images", ["data.kind='images'", "text, synthetic"], id="enum-data-kind"),
    # microbatch sizes
    pytest.param(["eval_interval=5ba", "parallelism_config=null"], ["device_eval_microbatch_size='auto'", "fsdp2"], id="eval-auto-without-fsdp2"),
    pytest.param("device_train_microbatch_size=0", ["device_train_microbatch_size=0", "positive int or 'auto'"], id="mb-zero"),
    pytest.param("device_train_microbatch_size=-1", ["device_train_microbatch_size=-1", "positive int or 'auto'"], id="mb-negative"),
    pytest.param("device_train_microbatch_size=big", ["device_train_microbatch_size='big'", "positive int or 'auto'"], id="mb-big"),
    pytest.param("device_train_microbatch_size=2.5", ["device_train_microbatch_size=2.5", "positive int or 'auto'"], id="mb-float"),
    pytest.param("device_train_microbatch_size=true", ["device_train_microbatch_size=True", "positive int or 'auto'"], id="mb-bool"),
    pytest.param("device_eval_microbatch_size=0", ["device_eval_microbatch_size=0", "positive int or 'auto'"], id="eval-mb-zero"),
    # time strings
    pytest.param("max_duration=30batches", ["max_duration='30batches'", "Composer time string"], id="time-bad-unit"),
    pytest.param("max_duration=30", ["max_duration=30", "must be a string"], id="time-bare-int"),
    pytest.param("max_duration=1.5ba", ["max_duration='1.5ba'", "Composer time string"], id="time-fractional-batches"),
    pytest.param("max_duration=0.5dur", ["max_duration='0.5dur'", "'dur'"], id="time-dur-duration"),
    pytest.param("max_duration=0ba", ["max_duration='0ba'", "> 0"], id="time-zero-duration"),
    pytest.param("scheduler.t_warmup=-1ba", ["scheduler.t_warmup='-1ba'", ">= 0"], id="time-negative"),
    pytest.param("scheduler.t_warmup=soon", ["scheduler.t_warmup='soon'", "Composer time string"], id="time-warmup"),
    pytest.param("eval_interval=often", ["eval_interval='often'", "Composer time string"], id="time-eval-interval"),
    pytest.param("loggers.console_interval=x", ["loggers.console_interval='x'", "Composer time string"], id="time-console"),
    # ranges
    pytest.param("global_train_batch_size=0", ["global_train_batch_size=0", "> 0"], id="gbs-zero"),
    pytest.param("optimizer.lr=0", ["optimizer.lr=0", "> 0"], id="lr-zero"),
    pytest.param("optimizer.weight_decay=-0.1", ["optimizer.weight_decay=-0.1", ">= 0"], id="wd-negative"),
    pytest.param("optimizer.betas=[0.9]", ["optimizer.betas=[0.9]", "2 floats"], id="betas-length"),
    pytest.param("optimizer.betas=[0.9, 1.0]", ["optimizer.betas=[0.9, 1.0]", "[0, 1)"], id="betas-range"),
    pytest.param("data.seq_len=0", ["data.seq_len=0", "> 0"], id="seq-len-zero"),
    pytest.param("data.num_workers=-1", ["data.num_workers=-1", ">= 0"], id="workers-negative"),
    pytest.param("dist_timeout=0", ["dist_timeout=0", "> 0"], id="timeout-zero"),
    pytest.param("eval_subset_num_batches=0", ["eval_subset_num_batches=0", "-1"], id="eval-subset-zero"),
    # fsdp2
    pytest.param("parallelism_config.fsdp2.bogus=1", ["parallelism_config.fsdp2.bogus", "unknown key", "reshard_after_forward"], id="fsdp2-bad-key"),
    pytest.param("parallelism_config.fsdp2.mixed_precision=HALF", ["parallelism_config.fsdp2.mixed_precision='HALF'", "FULL, DEFAULT, PURE"], id="fsdp2-bad-value"),
    pytest.param("parallelism_config.fsdp2.replicate=0", ["parallelism_config.fsdp2.replicate=0", ">= 1"], id="fsdp2-replicate"),
    pytest.param("parallelism_config.fsdp2.reshard_after_forward=0", ["parallelism_config.fsdp2.reshard_after_forward=0"], id="fsdp2-reshard"),
    pytest.param("parallelism_config.fsdp2.wrap=Block", ["parallelism_config.fsdp2.wrap='Block'", "list of module class names"], id="fsdp2-wrap-str"),
    pytest.param("parallelism_config.fsdp2=5", ["parallelism_config.fsdp2=5", "mapping"], id="fsdp2-scalar"),
    pytest.param("parallelism_config.megatron={}", ["parallelism_config.megatron", "unknown key", "fsdp2"], id="parallelism-unknown"),
    # cross-field and filesystem
    pytest.param("precision=amp_bf16", ["precision='amp_bf16'", "needs device: gpu"], id="amp-on-cpu"),
    pytest.param("data.paths=[/definitely/not/here.txt]", ["data.paths[0]='/definitely/not/here.txt'", "no such file"], id="data-path-missing"),
    # callbacks
    pytest.param("callbacks.foo_monitor={}", ["callbacks.foo_monitor", "unknown callback", "speed_monitor"], id="callback-unknown"),
    pytest.param("callbacks.lr_monitor=5", ["callbacks.lr_monitor=5", "mapping of keyword arguments"], id="callback-not-dict"),
    pytest.param("callbacks=[speed_monitor]", ["callbacks=['speed_monitor']", "mapping"], id="callbacks-list"),
    # interpolation
    pytest.param("run_dir=${nope}", ["run_dir", "nope"], id="interpolation-missing"),
]


@pytest.mark.parametrize("override, fragments", BAD_CASES)
def test_bad_values_raise_config_error(override, fragments):
    with pytest.raises(ConfigError) as info:
        _load(*override) if isinstance(override, list) else _load(override)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


@pytest.mark.parametrize(
    "yaml_text, fragments",
    [
        pytest.param("foo: 1\n", ["foo=1", "unknown key", "allowed keys at top level"], id="unknown-top-level"),
        pytest.param("model:\n  prest: tiny\n", ["model.prest='tiny'", "did you mean 'preset'"], id="unknown-nested"),
        pytest.param("device_train_microbatch_size: big\n", ["device_train_microbatch_size='big'", "positive int or 'auto'"], id="mb-big"),
        pytest.param("parallelism_config:\n  fsdp2:\n    cpu_offload: 1\n", ["parallelism_config.fsdp2.cpu_offload=1"], id="fsdp2-value"),
        pytest.param("callbacks:\n  speed_monitor: 5\n", ["callbacks.speed_monitor=5"], id="callback-not-dict"),
        pytest.param("- 1\n- 2\n", ["top level must be a mapping"], id="top-level-list"),
        pytest.param("a: [1, 2\n", ["invalid YAML"], id="yaml-syntax"),
    ],
)
def test_bad_yaml_files(tmp_path, yaml_text, fragments):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    if "invalid YAML" in fragments:
        assert str(p) in msg and "line 2" in msg  # the file and the parser's own message


@pytest.mark.parametrize(
    "override",
    [
        pytest.param("noequals", id="no-equals"),
        pytest.param("=3", id="empty-key"),
        pytest.param("model..preset=tiny", id="empty-segment"),
        pytest.param("+seed=3", id="hydra-append"),
        pytest.param("seed[0]=1", id="brackets"),
        pytest.param("model.overrides.n_layers=[1,", id="unparsable-value"),
    ],
)
def test_bad_override_syntax(override):
    with pytest.raises(ConfigError, match="override") as info:
        _load(override)
    assert repr(override) in str(info.value)


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="not a file"):
        load_config(tmp_path)


# ------------------------------------------------------------------------------------------
# Batch sizes against the world size
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gbs, mb, world, expected",
    [
        pytest.param(16, 4, 1, 16, id="1-rank"),
        pytest.param(16, 4, 2, 8, id="2-ranks"),
        pytest.param(16, 4, 4, 4, id="mb-equals-per-rank"),
        pytest.param(16, "auto", 16, 1, id="auto-any-world"),
    ],
)
def test_per_rank_batch_size(gbs, mb, world, expected):
    cfg = _load(f"global_train_batch_size={gbs}", f"device_train_microbatch_size={mb}")
    assert cfg.per_rank_batch_size(world) == expected


@pytest.mark.parametrize(
    "gbs, mb, world, fragments",
    [
        pytest.param(16, 4, 3, ["global_train_batch_size=16", "world size 3"], id="indivisible"),
        pytest.param(16, 4, 8, ["device_train_microbatch_size=4", "per-rank batch size 2", "world size 8"], id="mb-exceeds-per-rank"),
        pytest.param(16, 4, 0, ["world_size=0"], id="world-zero"),
    ],
)
def test_per_rank_batch_size_errors(gbs, mb, world, fragments):
    cfg = _load(f"global_train_batch_size={gbs}", f"device_train_microbatch_size={mb}")
    with pytest.raises(ConfigError) as info:
        cfg.per_rank_batch_size(world)
    for fragment in fragments:
        assert fragment in str(info.value)


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def test_parse_cli_ok():
    assert parse_cli(["configs/tiny-cpu.yaml", "max_duration=10ba", "model.n_layers=3"]) == (
        "configs/tiny-cpu.yaml",
        ["max_duration=10ba", "model.n_layers=3"],
    )
    assert parse_cli(["c.yml"]) == ("c.yml", [])


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param([], id="empty"),
        pytest.param(["max_duration=10ba"], id="override-first"),
        pytest.param(["--help"], id="flag"),
        pytest.param(["config.txt"], id="not-yaml"),
        pytest.param(["c.yaml", "oops"], id="bare-word"),
        pytest.param(["c.yaml", "--seed", "3"], id="option"),
    ],
)
def test_parse_cli_errors(argv):
    with pytest.raises(ConfigError, match=r"python -m automicro.train \[--check\] CONFIG \[key=value \.\.\.\]"):
        parse_cli(argv)


def test_a_shipped_configs_name_stands_for_its_file_and_a_near_miss_is_named():
    """`python -m automicro.train tiny-cpu` from anywhere: the names are the YAMLs shipped in
    configs/; a path is taken as given; a wrong name lists the names and the nearest."""
    from automicro.config import resolve_config, shipped_configs

    names = shipped_configs()
    assert {"tiny-cpu", "tiny-cpu-varlen", "tiny-cpu-pp", "tiny-gpu"} <= set(names), names
    path, overrides = parse_cli(["tiny-cpu", "max_duration=2ba"])
    assert os.path.isfile(path) and os.path.basename(path) == "tiny-cpu.yaml" and overrides == ["max_duration=2ba"]
    assert load_config(path, overrides).max_duration == "2ba"
    assert resolve_config("elsewhere/my.yml") == "elsewhere/my.yml"
    with pytest.raises(ConfigError, match=r"'tiny-cpux' is neither .* \(did you mean 'tiny-cpu'\?\)") as caught:
        parse_cli(["tiny-cpux"])
    assert "tiny-gpu" in str(caught.value)


# ------------------------------------------------------------------------------------------
# Misc
# ------------------------------------------------------------------------------------------


def test_to_dict_round_trips():
    cfg = load_config(GPU_YAML, ["model.n_layers=3", "callbacks.lr_monitor={}"])
    d = cfg.to_dict()
    assert d["parallelism_config"]["fsdp2"]["mixed_precision"] == "DEFAULT"
    assert d["model"]["overrides"] == {"n_layers": 3}
    assert from_dict(d) == cfg


def test_config_error_is_value_error_and_no_process_group():
    import torch.distributed as dist

    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        _load("seed=x")
    assert not (dist.is_available() and dist.is_initialized())


def test_the_config_accepts_exactly_the_registry_and_each_name_builds_a_composer_callback():
    from composer.core import Callback

    from automicro.config import CALLBACK_REGISTRY
    from automicro.composer.builders import callback_class

    assert KNOWN_CALLBACKS == tuple(CALLBACK_REGISTRY)  # derived, not a second list
    for name in CALLBACK_REGISTRY:
        assert name in _load(f"callbacks.{name}={{}}").callbacks
        cls = callback_class(name)
        assert isinstance(cls, type) and issubclass(cls, Callback), (name, cls)
    with pytest.raises(ConfigError, match=r"callbacks\.not_registered=\{\}: unknown callback"):
        _load("callbacks.not_registered={}")


def test_the_config_imports_no_composer_and_reading_one_no_trainer_or_fault_kit():
    import subprocess

    def loaded(prefixes):
        return f"sorted(m for m in sys.modules if m.startswith({prefixes!r}))"

    code = (
        "import sys; import automicro.config; "
        f"print({loaded(('composer', 'automicro.models', 'omegaconf'))}); "
        f"automicro.config.load_config({CPU_YAML!r}); "
        f"print({loaded(('automicro.composer', 'automicro.batch', 'automicro.testing'))})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout


def test_the_real_llama_config_tells_model_shorthand_keys_from_typos(monkeypatch):
    monkeypatch.delitem(sys.modules, "automicro.models.llama")
    assert _load("model.n_layers=3").model.overrides == {"n_layers": 3}
    with pytest.raises(ConfigError, match="n_layrs"):
        _load("model.n_layrs=3")


def test_autoresume_needs_a_save_folder_and_is_passed_on_with_one():
    with pytest.raises(ConfigError, match=r"autoresume=true: .* set save_folder"):
        _load("autoresume=true")
    cfg = _load("autoresume=true", "save_folder=/tmp/ckpt")
    assert cfg.autoresume is True and cfg.save_folder == "/tmp/ckpt"


# ------------------------------------------------------------------------------------------
# One check per fact: the YAML and automicro.Trainer refuse the same input with the same text
# ------------------------------------------------------------------------------------------


def _trainer_error(**kwargs) -> str:
    import torch

    import automicro

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError) as info:
        automicro.Trainer(model=model, device="cpu", max_duration="1ba", **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    "override, trainer_kwargs",
    [
        pytest.param("device_train_microbatch_size=big", {"device_train_microbatch_size": "big"}, id="microbatch"),
        pytest.param("parallelism_config.fsdp2.bogus=1", {"parallelism_config": {"fsdp2": {"bogus": 1}}}, id="fsdp2-key"),
        pytest.param(
            "parallelism_config.fsdp2.state_dict_type=sharded",
            {"parallelism_config": {"fsdp2": {"state_dict_type": "sharded"}}},
            id="state-dict-type",
        ),
        pytest.param(
            "parallelism_config.fsdp2.mixed_precision=HALF",
            {"parallelism_config": {"fsdp2": {"mixed_precision": "HALF"}}},
            id="fsdp2-value",
        ),
        pytest.param("parallelism_config.fsdp2=5", {"parallelism_config": {"fsdp2": 5}}, id="fsdp2-scalar"),
    ],
)
def test_yaml_and_trainer_refuse_the_same_input_with_the_same_message(override, trainer_kwargs):
    with pytest.raises(ConfigError) as info:
        _load(override)
    assert str(info.value) in _trainer_error(**trainer_kwargs)


@pytest.mark.filterwarnings("ignore:Setting `device_eval_microbatch_size='auto'`:UserWarning")
def test_yaml_and_trainer_give_the_same_reason_for_an_auto_eval_without_an_auto_search():
    import torch
    from composer.core import Evaluator

    from automicro.config import auto_eval_problem

    reason = auto_eval_problem(train_auto=False, sharded=True)
    with pytest.raises(ConfigError) as info:
        _load("eval_interval=5ba", "device_train_microbatch_size=2")
    assert "device_eval_microbatch_size='auto'" in str(info.value) and reason in str(info.value)
    evaluator = Evaluator(label="eval", dataloader=torch.utils.data.DataLoader([0, 1], batch_size=1), device_eval_microbatch_size="auto")
    assert reason in _trainer_error(device_train_microbatch_size=2, eval_dataloader=evaluator)


def test_trials_false_reaches_every_loop_and_a_key_that_asks_for_a_trial_beside_it_says_which_to_drop():
    """`trials: false` (the YAML key, `AutoMicrobatching`, `AutoStep` and the adapters, which take `AutoStep`'s
    settings): the size search and nothing else; `layout: auto` or `packing: auto` beside it is refused by name."""
    from automicro.batch.settings import Settings
    from automicro.composer.callback import AutoMicrobatching
    from automicro.step import SETTINGS

    assert "trials" in SETTINGS  # AutoStep, and through it the HF Trainer, Lightning and torchtitan adapters
    assert _load("callbacks.auto_microbatching.trials=false").callbacks["auto_microbatching"]["trials"] is False
    quiet = AutoMicrobatching(trials=False)
    assert quiet.settings.trials is False and quiet.settings.layout_config.mode == "fixed"
    assert Settings.parse(trials=False, budget="tokens").kind.tokens is not None
    with pytest.raises(ValueError, match="layout='auto' runs the layout trials and trials=false turns every trial off"):
        AutoMicrobatching(trials=False, layout="auto")
    with pytest.raises(ValueError, match="packing='auto' times packed rows against padded batches"):
        Settings.parse(trials=False, budget="tokens", packing="auto")
    with pytest.raises(ValueError, match="trials='no': must be true"):
        Settings.parse(trials="no")
    assert AutoMicrobatching(trials=False, layout=["no_reshard"]).settings.layout_config.pinned == ("no_reshard",)
