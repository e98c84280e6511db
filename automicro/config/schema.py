"""The run configuration's schema: one dataclass per YAML section, each field with its default,
its docstring and its checks (``choices`` / ``check`` / ``parse`` metadata read by
`automicro.config.convert`), and the cross-field checks of a whole section (``_cross_check``).

The YAML maps one to one onto these dataclasses: every YAML key is a field name here (the
``model:`` shorthand -- a `LlamaConfig` field written directly under ``model`` -- is folded into
``model.overrides``, not renamed). Checks shared with `automicro.Trainer` live in one place:
`check_microbatch_size` and `auto_eval_problem` here, the ``parallelism_config.fsdp2`` section in
`automicro.engine.config` (wrapped into `ConfigError` with its dotted key), the callback names in
`automicro.config.registry`.

May not touch: YAML / omegaconf / files (`automicro.config.load`), the trainer and its builders;
Composer and `automicro.models` are imported only inside the checks that need them.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from automicro.config.convert import ConfigError, _check_type, _did_you_mean, _is_optional
from automicro.config.registry import KNOWN_CALLBACKS
from automicro.engine.compile import CompileConfig, CompileConfigError
from automicro.engine.config import CHECKPOINT_FORMATS, SAVE_FAILURES, FSDP2Config, FSDP2ConfigError, PipelineConfig

AUTO = "auto"
MODEL_PRESETS = ("tiny", "125m", "1b", "3b", "7b")
INIT_DEVICES = ("cpu", "meta")
DATA_KINDS = ("text", "synthetic", "varlen")
OPTIMIZERS = ("adamw", "decoupled_adamw", "sgd")
SCHEDULERS = ("constant", "cosine_with_warmup", "linear_with_warmup")
DEVICES = ("cpu", "gpu")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")


# --------------------------------------------------------------------------------------------
# Field helpers
# --------------------------------------------------------------------------------------------


def _cfg(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field with validation metadata.

    meta keys: ``choices`` (allowed values), ``check`` (callable(value) -> error text or None,
    run after the type check), ``parse`` (callable(value, key) -> converted value, replaces the
    generic type check entirely).
    """
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _positive(v: Any) -> Optional[str]:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> Optional[str]:
    return None if v >= 0 else "must be >= 0"


def _optional_positive(v: Any) -> Optional[str]:
    return None if v is None or v > 0 else "must be > 0 (or null)"


def _time_check(*, allow_dur: bool = True, positive: bool = False) -> Callable[[Any], Optional[str]]:
    examples = "'30ba', '2ep', '1000tok', '500sp'" + (", '0.1dur'" if allow_dur else "")

    def check(v: Any) -> Optional[str]:
        if v is None:
            return None
        from composer.core import Time, TimeUnit

        try:
            t = Time.from_timestring(v)
        except Exception as e:  # ValueError / TypeError / AssertionError from Composer's parser
            return f"must be a Composer time string such as {examples} ({e})"
        if not allow_dur and t.unit == TimeUnit.DURATION:
            return f"must not be in 'dur' units; use e.g. {examples}"
        if t.value < 0 or (positive and t.value == 0):
            return f"must be {'> 0' if positive else '>= 0'}; use e.g. {examples}"
        return None

    return check


def check_microbatch_size(value: Any, key: str) -> Union[int, str]:
    """A microbatch size is a positive int or ``'auto'``: the one check, for the YAML's
    ``device_train/eval_microbatch_size`` and for `automicro.Trainer`'s string argument."""
    if value == AUTO and isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(f"{key}={value!r}: must be a positive int or '{AUTO}'")


def auto_eval_problem(*, train_auto: bool, sharded: bool) -> Optional[str]:
    """Why ``device_eval_microbatch_size='auto'`` cannot run here, or None: the one check, for
    the YAML (with ``eval_interval`` set) and for `automicro.Trainer`'s auto evaluators."""
    if sharded and train_auto:
        return None
    return (
        "needs parallelism_config.fsdp2 and device_train_microbatch_size='auto' (automicro's eval search "
        "runs on its FSDP2 engine, on the training search's consensus)"
    )


def sharded_checkpoint_problem(*, sharded: bool) -> Optional[str]:
    """Why ``checkpoint_format='sharded'`` cannot run here, or None: the one check, for the YAML
    and for `automicro.Trainer(checkpoint_format=...)`."""
    if sharded:
        return None
    return "saves FSDP2 shards and needs parallelism_config.fsdp2 (e.g. parallelism_config: {fsdp2: {}}); without FSDP2 use checkpoint_format: full"


SEED_MAX = 2**32 - 1  # numpy's and Composer's bound on a seed


def _seed_check(v: int) -> Optional[str]:
    return None if 0 <= v <= SEED_MAX else f"must be in [0, {SEED_MAX}] (2^32 - 1)"


DCP_METADATA_FILENAME = ".metadata"  # what torch.distributed.checkpoint's FileSystemWriter writes


def load_path_problem(load_path: Optional[str], checkpoint_format: str) -> Optional[str]:
    """Why ``load_path`` cannot be loaded with ``checkpoint_format``, or None: the one check, for
    the YAML's ``load_path`` and `automicro.Trainer(load_path=...)`. A remote URI (``s3://...``) is
    Composer's to fetch and is not checked here."""
    if load_path is None or "://" in load_path:
        return None
    path = os.path.expanduser(load_path)
    if not os.path.exists(path):
        what = "the folder a sharded save wrote (e.g. save_folder/ep0-ba100)" if checkpoint_format == "sharded" else (
            "the .pt file a save wrote (e.g. save_folder/ep0-ba100-rank0.pt)"
        )
        return f"no such file or directory; point load_path at {what}, or set load_path to null to start fresh"
    is_dcp = os.path.isdir(path) and os.path.exists(os.path.join(path, DCP_METADATA_FILENAME))
    if checkpoint_format == "full" and is_dcp:
        return "is a sharded (DCP) checkpoint folder; load it with checkpoint_format='sharded'"
    if checkpoint_format == "full" and os.path.isdir(path):
        return (
            "is a folder, not a checkpoint file; with checkpoint_format='full' point load_path at the .pt file a save "
            "wrote (e.g. save_folder/ep0-ba100-rank0.pt)"
        )
    if checkpoint_format == "sharded" and not is_dcp:
        return (
            f"is not a sharded checkpoint folder (no {DCP_METADATA_FILENAME}); with checkpoint_format='sharded' point "
            "load_path at the folder a sharded save wrote (e.g. save_folder/ep0-ba100), or load a full .pt checkpoint "
            "with checkpoint_format='full'"
        )
    return None


def _betas_check(v: list) -> Optional[str]:
    if len(v) != 2:
        return "must be a list of 2 floats in [0, 1)"
    if not all(0.0 <= b < 1.0 for b in v):
        return "each beta must be in [0, 1)"
    return None


def _eval_subset_check(v: int) -> Optional[str]:
    return None if v > 0 or v == -1 else "must be a positive int, or -1 for the whole eval set"


# --------------------------------------------------------------------------------------------
# Dataclasses
# --------------------------------------------------------------------------------------------


def _llama_fields() -> dict[str, Any]:
    """`automicro.models.llama.LlamaConfig` field name -> type hint.

    Imported here, not at the top: `automicro.models.llama` imports torch and Composer, which the
    schema does not at import time."""
    from automicro.models.llama import LlamaConfig  # noqa: PLC0415 - lazy on purpose (see above)

    hints = typing.get_type_hints(LlamaConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(LlamaConfig)}


_SCALARS = (int, float, bool, str)


def _check_llama_value(value: Any, hint: Any, key: str) -> Any:
    optional, inner = _is_optional(hint)
    if hint in _SCALARS or (optional and inner in _SCALARS):  # the model checks anything richer
        return _check_type(value, hint, key)
    return value


def _llama_values(values: Mapping[str, Any], prefix: str, unknown: Callable[[str, Any, dict], str]) -> dict:
    """Every key of ``values`` must be a `LlamaConfig` field (else `ConfigError(unknown(key,
    value, fields))`); scalar fields are type-checked under the dotted key ``prefix + key``."""
    llama = _llama_fields()
    out = {}
    for k, v in values.items():
        if k not in llama:
            raise ConfigError(unknown(k, v, llama))
        out[k] = _check_llama_value(v, llama[k], f"{prefix}{k}")
    return out


def _model_overrides_parse(value: Any, key: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}={value!r}: must be a mapping of LlamaConfig field -> value")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise ConfigError(f"{key}.{k}={v!r}: keys must be strings (LlamaConfig field names)")
        out[k] = v
    return _llama_values(
        out,
        f"{key}.",
        lambda k, v, llama: (
            f"{key}.{k}={v!r}: unknown LlamaConfig field{_did_you_mean(k, llama)}; allowed keys: {', '.join(llama)}"
        ),
    )


@dataclass
class ModelConfig:
    """``model:`` which Llama to build and where to initialise it."""

    preset: str = _cfg("tiny", choices=MODEL_PRESETS)
    """Size preset: tiny, 125m, 1b, 3b or 7b."""
    init_device: str = _cfg("cpu", choices=INIT_DEVICES)
    """``cpu`` materialises weights on the host; ``meta`` defers allocation to sharding."""
    tie_embeddings: bool = False
    """Share the input embedding and the output projection weights."""
    overrides: dict = _cfg(factory=dict, parse=_model_overrides_parse)
    """Free-form `LlamaConfig` field overrides on top of the preset, e.g. ``{n_layers: 3}``;
    keys are checked against `automicro.models.llama.LlamaConfig`.
    Shorthand: a LlamaConfig field written directly under ``model:`` (``model.n_layers=3``)
    is folded into ``overrides``."""

    @staticmethod
    def _fold_extra(value: Mapping, prefix: str) -> Mapping:
        """Move ``model.<LlamaConfig field>`` keys into ``model.overrides``."""
        own = [f.name for f in dataclasses.fields(ModelConfig)]
        extras = {k: v for k, v in value.items() if k not in own}
        if not extras:
            return value
        extras = _llama_values(
            extras,
            prefix,
            lambda k, v, llama: (
                f"{prefix}{k}={v!r}: unknown key{_did_you_mean(str(k), own + list(llama))}; "
                f"allowed keys at model: {', '.join(own)}, or a LlamaConfig field "
                f"({', '.join(f for f in llama if f not in own)})"
            ),
        )
        explicit = value.get("overrides")
        if explicit is not None and not isinstance(explicit, Mapping):
            return value  # the `overrides` parser reports it
        explicit = dict(explicit or {})
        for k, v in extras.items():
            if k in explicit and explicit[k] != v:
                raise ConfigError(
                    f"{prefix}{k}={v!r}: conflicts with {prefix}overrides.{k}={explicit[k]!r}; set one of them"
                )
        folded = {k: v for k, v in value.items() if k in own}
        folded["overrides"] = {**explicit, **extras}
        return folded


@dataclass
class DataConfig:
    """``data:`` the training / eval token stream."""

    kind: str = _cfg("text", choices=DATA_KINDS)
    """``text`` (byte-level text files), ``synthetic`` (random tokens) or ``varlen`` (random tokens of
    log-normal lengths up to seq_len, padded to each batch's longest: fine-tuning data's shape)."""
    paths: Optional[list[str]] = None
    """Text files / directories; null means the Python standard library's own sources."""
    seq_len: int = _cfg(128, check=_positive)
    """Tokens per sample."""
    max_bytes: int = _cfg(8_000_000, check=_positive)
    """Cap on the bytes of text read."""
    num_samples: int = _cfg(4096, check=_positive)
    """Number of samples (synthetic and varlen data)."""
    median_len: int = _cfg(64, check=_positive)
    """varlen: the median sample length in tokens (lengths are log-normal, clipped to 8..seq_len)."""
    sigma: float = _cfg(0.8, check=_non_negative)
    """varlen: the log-normal spread of the lengths (0: every sample median_len tokens)."""
    vocab_size: Optional[int] = _cfg(None, check=_optional_positive)
    """Vocabulary size; null takes the model's."""
    num_workers: int = _cfg(0, check=_non_negative)
    """DataLoader worker processes."""
    shuffle: bool = True
    """Shuffle the training samples."""

    def _cross_check(self, prefix: str) -> None:
        if self.kind == "text" and self.paths is not None:
            for i, p in enumerate(self.paths):
                if not os.path.exists(os.path.expanduser(p)):
                    raise ConfigError(f"{prefix}paths[{i}]={p!r}: no such file or directory")


@dataclass
class OptimizerConfig:
    """``optimizer:``"""

    name: str = _cfg("decoupled_adamw", choices=OPTIMIZERS)
    """adamw (torch), decoupled_adamw (Composer) or sgd."""
    lr: float = _cfg(3e-3, check=_positive)
    """Peak learning rate (> 0)."""
    weight_decay: float = _cfg(0.0, check=_non_negative)
    """Weight decay (>= 0)."""
    betas: list[float] = _cfg(factory=lambda: [0.9, 0.95], check=_betas_check)
    """Adam betas: two floats in [0, 1)."""
    eps: float = _cfg(1e-8, check=_positive)
    """Adam epsilon (> 0)."""


@dataclass
class SchedulerConfig:
    """``scheduler:``"""

    name: str = _cfg("constant", choices=SCHEDULERS)
    """constant, cosine_with_warmup or linear_with_warmup."""
    t_warmup: str = _cfg("0ba", check=_time_check())
    """Warmup length, a Composer time string (``100ba``, ``0.1dur``)."""
    alpha_f: float = _cfg(0.1, check=_non_negative)
    """Final learning-rate multiplier of the warmup schedulers."""


@dataclass
class LoggerConfig:
    """``loggers:``"""

    console: bool = True
    """Log metrics to stdout."""
    console_interval: str = _cfg("1ba", check=_time_check(allow_dur=False, positive=True))
    """How often the console logger prints, a Composer time string."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: Optional[str] = None
    """W&B project (null: W&B's default)."""
    wandb_entity: Optional[str] = None
    """W&B entity (null: W&B's default)."""
    jsonl: bool = True
    """Write metrics as JSON lines under ``run_dir``."""


@dataclass
class ParallelismConfig:
    """``parallelism_config:`` ``fsdp2`` and, over it, ``pipeline``."""

    fsdp2: Optional[FSDP2Config] = _cfg(None, parse=lambda v, k: _fsdp2_parse(v, k))
    """FSDP2 engine settings; ``fsdp2: {}`` (or ``fsdp2:`` with no value) uses every default."""
    pipeline: Optional[PipelineConfig] = _cfg(None, parse=lambda v, k: _pipeline_parse(v, k))
    """Pipeline parallelism (`automicro.engine.PipelineConfig`: ``stages``, ``schedule``: 1F1B or
    ZeroBubble); each stage is sharded with ``fsdp2`` over world/stages ranks. null: no pipeline."""


def _describe_parallelism(value: Optional[ParallelismConfig]) -> str:
    return "null" if value is None else "without fsdp2"


def _fsdp2_parse(value: Any, key: str) -> FSDP2Config:
    """The engine reads (and checks) its own section; its error becomes a `ConfigError`."""
    try:
        return FSDP2Config.from_dict(value, key)
    except FSDP2ConfigError as e:
        raise ConfigError(str(e)) from e


def _pipeline_parse(value: Any, key: str) -> Optional[PipelineConfig]:
    if value is None:
        return None
    try:
        return PipelineConfig.from_dict(value)
    except FSDP2ConfigError as e:
        raise ConfigError(str(e)) from e


def pipeline_problem(
    *, eval_interval: Any, save_folder: Any, load_path: Any, precision: Optional[str], sharded: bool, checkpoint_format: Any
) -> Optional[str]:
    """Why a pipeline cannot run with these settings (None: it can). Shared with `automicro.Trainer`."""
    if not sharded:
        return "needs parallelism_config.fsdp2 (each stage is sharded with FSDP2 over its ranks): add fsdp2: {}"
    if eval_interval is not None:
        return "does not evaluate yet (Composer's eval runs the whole model on one rank); set eval_interval: null"
    if (save_folder is not None or load_path is not None) and checkpoint_format != "sharded":
        return (
            "saves and loads sharded checkpoints only (each stage's ranks write their own shards; a full "
            "checkpoint would hold rank 0's stage alone); set checkpoint_format: sharded"
        )
    if precision == "amp_fp16":
        return "does not support amp_fp16 (no gradient scaler across stages); use amp_bf16 or fp32"
    return None


def _compile_parse(value: Any, key: str) -> Optional[CompileConfig]:
    try:
        return CompileConfig.from_value(value, key)
    except CompileConfigError as e:
        raise ConfigError(str(e)) from e


def _callbacks_parse(value: Any, key: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}={value!r}: must be a mapping of callback name -> kwargs mapping")
    out: dict[str, dict] = {}
    for name, kwargs in value.items():
        if name not in KNOWN_CALLBACKS:
            raise ConfigError(
                f"{key}.{name}={kwargs!r}: unknown callback{_did_you_mean(str(name), KNOWN_CALLBACKS)}; "
                f"allowed: {', '.join(KNOWN_CALLBACKS)}"
            )
        if kwargs is None:  # `speed_monitor:` with no value means no kwargs
            kwargs = {}
        if not isinstance(kwargs, Mapping):
            raise ConfigError(f"{key}.{name}={kwargs!r}: must be a mapping of keyword arguments (or {{}})")
        for k in kwargs:
            if not isinstance(k, str):
                raise ConfigError(f"{key}.{name}.{k}={kwargs[k]!r}: keyword argument names must be strings")
        out[name] = dict(kwargs)
    return out


@dataclass
class TrainConfig:
    """The whole run: one YAML file."""

    run_name: str = _cfg("automicro", check=lambda v: None if v else "must be a non-empty string")
    """Name of the run (loggers, ``run_dir``)."""
    seed: int = _cfg(17, check=_seed_check)
    """Global random seed."""
    device: str = _cfg("cpu", choices=DEVICES)
    """``cpu`` (gloo) or ``gpu`` (nccl)."""
    model: ModelConfig = _cfg(factory=ModelConfig)
    data: DataConfig = _cfg(factory=DataConfig)
    global_train_batch_size: int = _cfg(16, check=_positive)
    """Samples per optimizer step over all ranks; must divide by the world size."""
    device_train_microbatch_size: Union[int, str] = _cfg(AUTO, parse=check_microbatch_size)
    """Samples per forward/backward per rank: a positive int, or ``auto`` to search for it."""
    device_eval_microbatch_size: Union[int, str] = _cfg(AUTO, parse=check_microbatch_size)
    """Samples per eval forward per rank: a positive int or ``auto``."""
    max_duration: str = _cfg("30ba", check=_time_check(allow_dur=False, positive=True))
    """Training length, a Composer time string (``30ba``, ``1ep``, ``1e6tok``)."""
    eval_interval: Optional[str] = _cfg(None, check=_time_check(positive=True))
    """How often to evaluate (Composer time string); null: no evaluation."""
    eval_subset_num_batches: int = _cfg(2, check=_eval_subset_check)
    """Batches per evaluation (-1: the whole eval set)."""
    precision: str = _cfg("fp32", choices=PRECISIONS)
    """fp32, amp_bf16 or amp_fp16 (amp needs ``device: gpu``)."""
    optimizer: OptimizerConfig = _cfg(factory=OptimizerConfig)
    scheduler: SchedulerConfig = _cfg(factory=SchedulerConfig)
    loggers: LoggerConfig = _cfg(factory=LoggerConfig)
    parallelism_config: Optional[ParallelismConfig] = _cfg(factory=lambda: ParallelismConfig(fsdp2=FSDP2Config()))
    """``{fsdp2: {...}}`` (default: ``{fsdp2: {}}``, what the default ``auto`` needs) shards the
    model with FSDP2; null trains without FSDP (with a positive int microbatch size)."""
    compile: Optional[CompileConfig] = _cfg(None, parse=_compile_parse)
    """``torch.compile``: null / false (eager), true (the defaults) or a mapping of ``scope`` (null, the
    default: each sharded block, with the whole model timed against them under ``auto``; ``blocks``:
    each sharded block; ``model``: Composer's whole-model compile), ``mode``, ``dynamic``,
    ``fullgraph``, ``backend`` (`automicro.engine.CompileConfig`)."""
    callbacks: dict[str, dict] = _cfg(factory=dict, parse=_callbacks_parse)
    """Callback name -> keyword arguments; names from `automicro.config.registry.CALLBACK_REGISTRY`."""
    save_folder: Optional[str] = None
    """Checkpoint folder (null: no checkpoints)."""
    save_interval: str = _cfg("1000ba", check=_time_check(allow_dur=False, positive=True))
    """How often to checkpoint, a Composer time string."""
    load_path: Optional[str] = None
    """Checkpoint to resume from (null: start fresh); with ``checkpoint_format: sharded`` the
    folder a sharded save wrote (``<save_folder>/ep0-ba100``)."""
    autoresume: bool = False
    """Composer's autoresume: resume from the latest checkpoint in ``save_folder`` if there is one
    (needs ``save_folder``; the run name must stay the same across restarts)."""
    checkpoint_format: str = _cfg("full", choices=CHECKPOINT_FORMATS)
    """``full``: rank 0 writes one ``.pt`` file with the whole state; ``sharded``: every rank writes
    its own FSDP2 shards (torch.distributed.checkpoint; needs ``parallelism_config.fsdp2``).
    Applies to saving and to loading ``load_path``."""
    save_failure: str = _cfg("continue", choices=SAVE_FAILURES)
    """A checkpoint save that failed on any rank (disk full, an I/O error): ``continue`` prints one
    error line naming the rank and the path and trains on (``latest`` and the kept checkpoints stay
    as they were); ``stop`` stops every rank with that error."""
    dist_timeout: float = _cfg(300.0, check=_positive)
    """Seconds before a collective is declared hung."""
    run_dir: str = "runs/${run_name}"
    """Directory for local outputs (metrics, traces); omegaconf interpolation applies."""

    def _cross_check(self, prefix: str) -> None:
        if self.precision.startswith("amp") and self.device != "gpu":
            raise ConfigError(
                f"{prefix}precision={self.precision!r}: precision {self.precision!r} needs device: gpu "
                f"(device is {self.device!r}; use precision: fp32 on cpu)"
            )
        if self.autoresume and self.save_folder is None:
            raise ConfigError(
                f"{prefix}autoresume=true: resumes from the latest checkpoint in save_folder; set save_folder "
                "(e.g. save_folder: runs/${{run_name}}/checkpoints) or autoresume: false"
            )
        if self.checkpoint_format == "sharded":
            problem = sharded_checkpoint_problem(sharded=self.fsdp2 is not None)
            if problem:
                raise ConfigError(f"{prefix}checkpoint_format='sharded': {problem}")
        if self.eval_interval is not None and self.device_eval_microbatch_size == AUTO:
            problem = auto_eval_problem(train_auto=self.device_train_microbatch_size == AUTO, sharded=self.fsdp2 is not None)
            if problem:
                raise ConfigError(f"{prefix}device_eval_microbatch_size='auto': {problem}; or set a positive int")
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if self.device_train_microbatch_size == AUTO and self.fsdp2 is None and world > 1:
            raise ConfigError(
                f"{prefix}device_train_microbatch_size='auto': without parallelism_config.fsdp2 (it is "
                f"{_describe_parallelism(self.parallelism_config)}) auto runs on one rank only, and this job has {world} "
                "(DDP is not supported with auto); set parallelism_config: {fsdp2: {}} to shard over the ranks, or a "
                "positive int device_train_microbatch_size"
            )
        if self.model.init_device == "meta" and self.fsdp2 is None:
            raise ConfigError(
                f"{prefix}model.init_device='meta': the model is built without memory, and only FSDP2 materializes "
                f"it (shard by shard); parallelism_config is {_describe_parallelism(self.parallelism_config)}. Set "
                "model.init_device: cpu, or parallelism_config: {fsdp2: {}}"
            )
        problem = load_path_problem(self.load_path, self.checkpoint_format)
        if problem:
            raise ConfigError(f"{prefix}load_path={self.load_path!r}: {problem}")
        if self.compile is not None and self.compile.scope == "blocks" and self.fsdp2 is None:  # unset: model
            raise ConfigError(
                f"{prefix}compile.scope='blocks': compiles each block the FSDP2 engine shards and needs "
                "parallelism_config.fsdp2; set scope: model to compile without FSDP2"
            )
        if self.compile is not None and self.pipeline is not None:
            raise ConfigError(f"{prefix}compile: not supported with parallelism_config.pipeline yet; set compile: null")
        if self.pipeline is not None:
            problem = pipeline_problem(
                eval_interval=self.eval_interval, save_folder=self.save_folder, load_path=self.load_path,
                precision=self.precision, sharded=self.fsdp2 is not None, checkpoint_format=self.checkpoint_format,
            )
            if problem:
                raise ConfigError(f"{prefix}parallelism_config.pipeline: {problem}")

    @property
    def fsdp2(self) -> Optional[FSDP2Config]:
        """The FSDP2 settings, or None when the run is not sharded."""
        return self.parallelism_config.fsdp2 if self.parallelism_config is not None else None

    @property
    def pipeline(self) -> Optional[PipelineConfig]:
        """The pipeline settings, or None without a pipeline."""
        return self.parallelism_config.pipeline if self.parallelism_config is not None else None

    def data_parallel_size(self, world_size: int) -> int:
        """How many copies of the model take their own share of each global batch: the world size,
        or world/stages with a pipeline (the stages of one pipeline run the same samples)."""
        if self.pipeline is None:
            return world_size
        stages = self.pipeline.stages
        if world_size % stages != 0:
            raise ConfigError(
                f"parallelism_config.pipeline.stages={stages}: must divide the world size {world_size} "
                "(each stage runs on world/stages ranks)"
            )
        return world_size // stages

    def per_rank_batch_size(self, world_size: int) -> int:
        """Samples per rank per optimizer step; checks the batch sizes against ``world_size``. With a
        pipeline every rank of one pipeline gets the same samples: global batch / (world / stages)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r}: must be a positive int")
        gbs = self.global_train_batch_size
        world_size = self.data_parallel_size(world_size)
        if gbs % world_size != 0:
            raise ConfigError(
                f"global_train_batch_size={gbs}: must be divisible by the world size {world_size} "
                f"(nearest valid: {max(world_size, gbs // world_size * world_size)} or "
                f"{(gbs // world_size + 1) * world_size})"
            )
        per_rank = gbs // world_size
        mb = self.device_train_microbatch_size
        if isinstance(mb, int) and mb > per_rank:
            raise ConfigError(
                f"device_train_microbatch_size={mb}: must not exceed the per-rank batch size {per_rank} "
                f"(global_train_batch_size={gbs} / world size {world_size}); lower it or use 'auto'"
            )
        return per_rank

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of every setting (for hyperparameter logging)."""
        return dataclasses.asdict(self)
