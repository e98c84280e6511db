"""Typed run configuration: an omegaconf YAML file plus CLI overrides onto validated dataclasses.

    from automicro.config import load_config, parse_cli
    yaml_path, overrides = parse_cli(sys.argv[1:])
    cfg = load_config(yaml_path, overrides)      # TrainConfig, fully validated

Everything here runs before any process group starts and fails with a `ConfigError` whose
message names the full dotted key, the bad value and what is allowed, e.g.::

    device_train_microbatch_size='big': must be a positive int or 'auto'

Loading order: dataclass defaults <- YAML file <- ``key=value`` overrides (YAML-typed values,
dotted keys), then omegaconf interpolations (``${run_name}``, ``${oc.env:HOME}``) are resolved
on the merged tree (so defaults such as ``run_dir: runs/${run_name}`` see the final values), and
the plain tree is converted field by field by this module (not by omegaconf's structured
configs, whose errors are cryptic).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from automicro.engine.config import FSDP2Config, FSDP2ConfigError

USAGE = "usage: python scripts/train.py CONFIG.yaml [key=value ...]"

MODEL_PRESETS = ("tiny", "125m", "1b", "3b", "7b")
INIT_DEVICES = ("cpu", "meta")
DATA_KINDS = ("text", "synthetic")
OPTIMIZERS = ("adamw", "decoupled_adamw", "sgd")
SCHEDULERS = ("constant", "cosine_with_warmup", "linear_with_warmup")
DEVICES = ("cpu", "gpu")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
KNOWN_CALLBACKS = (
    "speed_monitor",
    "memory_monitor",
    "lr_monitor",
    "runtime_estimator",
    "auto_microbatching",
    "fault_injector",
    "memory_cap",
)
PARALLELISM_KEYS = ("fsdp2",)
CHECKPOINT_FORMATS = ("full", "sharded")  # automicro.Trainer(checkpoint_format=...) checks against these too

_OVERRIDE_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


class ConfigError(ValueError):
    """A bad configuration; the message names the dotted key, the bad value and what is allowed."""


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


def _microbatch_parse(value: Any, key: str) -> Union[int, str]:
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(f"{key}={value!r}: must be a positive int or 'auto'")


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


def _llama_config_cls() -> Optional[type]:
    """`automicro.models.llama.LlamaConfig`, or None when it cannot be imported (yet)."""
    try:
        from automicro.models.llama import LlamaConfig  # noqa: PLC0415 - lazy on purpose
    except Exception:
        return None
    return LlamaConfig if dataclasses.is_dataclass(LlamaConfig) else None


def _llama_fields() -> Optional[dict[str, Any]]:
    """LlamaConfig field name -> type hint (None: not importable, skip the checks)."""
    llama_cls = _llama_config_cls()
    if llama_cls is None:
        return None
    try:
        hints = typing.get_type_hints(llama_cls)
    except Exception:
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(llama_cls)}


_SCALARS = (int, float, bool, str)


def _check_llama_value(value: Any, hint: Any, key: str) -> Any:
    optional, inner = _is_optional(hint)
    if hint in _SCALARS or (optional and inner in _SCALARS):  # the model checks anything richer
        return _check_type(value, hint, key)
    return value


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
    llama = _llama_fields()
    if llama is None:
        return out
    for k, v in out.items():
        if k not in llama:
            raise ConfigError(
                f"{key}.{k}={v!r}: unknown LlamaConfig field{_did_you_mean(k, llama)}; "
                f"allowed keys: {', '.join(llama)}"
            )
        out[k] = _check_llama_value(v, llama[k], f"{key}.{k}")
    return out


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
    keys are checked against `automicro.models.llama.LlamaConfig` when it is importable.
    Shorthand: a LlamaConfig field written directly under ``model:`` (``model.n_layers=3``)
    is folded into ``overrides``."""

    @staticmethod
    def _fold_extra(value: Mapping, prefix: str) -> Mapping:
        """Move ``model.<LlamaConfig field>`` keys into ``model.overrides``."""
        own = [f.name for f in dataclasses.fields(ModelConfig)]
        extras = {k: v for k, v in value.items() if k not in own}
        if not extras:
            return value
        llama = _llama_fields()
        if llama is None:  # cannot tell a LlamaConfig field from a typo: report it as unknown
            k, v = next(iter(extras.items()))
            raise ConfigError(
                f"{prefix}{k}={v!r}: unknown key{_did_you_mean(str(k), own)}; allowed keys at model: "
                f"{', '.join(own)} (LlamaConfig fields are accepted here only when "
                "automicro.models.llama imports; use model.overrides meanwhile)"
            )
        for k, v in extras.items():
            if k not in llama:
                raise ConfigError(
                    f"{prefix}{k}={v!r}: unknown key{_did_you_mean(str(k), own + list(llama))}; "
                    f"allowed keys at model: {', '.join(own)}, or a LlamaConfig field "
                    f"({', '.join(f for f in llama if f not in own)})"
                )
            extras[k] = _check_llama_value(v, llama[k], f"{prefix}{k}")
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
    """``text`` (byte-level text files) or ``synthetic`` (random tokens)."""
    paths: Optional[list[str]] = None
    """Text files / directories; null means the Python standard library's own sources."""
    seq_len: int = _cfg(128, check=_positive)
    """Tokens per sample."""
    max_bytes: int = _cfg(8_000_000, check=_positive)
    """Cap on the bytes of text read."""
    num_samples: int = _cfg(4096, check=_positive)
    """Number of samples (synthetic data)."""
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
    """``parallelism_config:`` only ``fsdp2`` is supported."""

    fsdp2: Optional[FSDP2Config] = _cfg(None, parse=lambda v, k: _fsdp2_parse(v, k))
    """FSDP2 engine settings; ``fsdp2: {}`` (or ``fsdp2:`` with no value) uses every default."""


def _state_dict_type_error(key: str, value: Any) -> ConfigError:
    """Composer's `fsdp_config.state_dict_type` has no place in automicro's engine config."""
    return ConfigError(
        f"{key}={value!r}: Composer's FSDP key is not used by automicro's engine; set the top-level "
        f"key checkpoint_format: {value if value in CHECKPOINT_FORMATS else 'sharded'} instead "
        f"(one of {', '.join(CHECKPOINT_FORMATS)})"
    )


def _fsdp2_parse(value: Any, key: str) -> FSDP2Config:
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"{key}={value!r}: must be a mapping of FSDP2 settings (or {{}} for defaults)")
    known = [f.name for f in dataclasses.fields(FSDP2Config)]
    for k, v in (value or {}).items():
        if k == "state_dict_type":
            raise _state_dict_type_error(f"{key}.{k}", v)
        if k not in known:
            raise ConfigError(
                f"{key}.{k}={v!r}: unknown key{_did_you_mean(str(k), known)}; "
                f"allowed keys at {key}: {', '.join(known)}"
            )
    try:
        return FSDP2Config.from_dict(dict(value) if value is not None else None)
    except FSDP2ConfigError as e:
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
    seed: int = _cfg(17, check=_non_negative)
    """Global random seed."""
    device: str = _cfg("cpu", choices=DEVICES)
    """``cpu`` (gloo) or ``gpu`` (nccl)."""
    model: ModelConfig = _cfg(factory=ModelConfig)
    data: DataConfig = _cfg(factory=DataConfig)
    global_train_batch_size: int = _cfg(16, check=_positive)
    """Samples per optimizer step over all ranks; must divide by the world size."""
    device_train_microbatch_size: Union[int, str] = _cfg("auto", parse=_microbatch_parse)
    """Samples per forward/backward per rank: a positive int, or ``auto`` to search for it."""
    device_eval_microbatch_size: Union[int, str] = _cfg("auto", parse=_microbatch_parse)
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
    parallelism_config: Optional[ParallelismConfig] = None
    """``{fsdp2: {...}}`` shards the model with FSDP2; null trains without FSDP."""
    callbacks: dict[str, dict] = _cfg(factory=dict, parse=_callbacks_parse)
    """Callback name -> keyword arguments; names from `KNOWN_CALLBACKS`."""
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
        if self.checkpoint_format == "sharded" and self.fsdp2 is None:
            raise ConfigError(
                f"{prefix}checkpoint_format='sharded': saves FSDP2 shards and needs parallelism_config.fsdp2 "
                "(e.g. parallelism_config: {fsdp2: {}}); without FSDP2 use checkpoint_format: full"
            )
        if self.eval_interval is not None and self.device_eval_microbatch_size == "auto" and self.parallelism_config is None:
            raise ConfigError(
                f"{prefix}device_eval_microbatch_size='auto': needs parallelism_config.fsdp2 (automicro's "
                "eval search runs on its FSDP2 engine); set a positive int or enable fsdp2"
            )

    @property
    def fsdp2(self) -> Optional[FSDP2Config]:
        """The FSDP2 settings, or None when the run is not sharded."""
        return self.parallelism_config.fsdp2 if self.parallelism_config is not None else None

    def per_rank_batch_size(self, world_size: int) -> int:
        """Samples per rank per optimizer step; checks the batch sizes against ``world_size``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size={world_size!r}: must be a positive int")
        gbs = self.global_train_batch_size
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


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


def _did_you_mean(name: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_optional(tp: Any) -> tuple[bool, Any]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args:
            rest = tuple(a for a in args if a is not type(None))
            return True, rest[0] if len(rest) == 1 else Union[rest]
    return False, tp


def _describe(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if optional:
        return f"{_describe(inner)} or null"
    origin = typing.get_origin(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an int"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if origin in (list, Sequence) or tp is list:
        args = typing.get_args(tp)
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    return {str: "strings", int: "ints", float: "numbers", bool: "booleans"}.get(tp, _describe(tp))


class _TypeMismatch(Exception):
    pass


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` to ``tp`` without coercion (except int -> float); ConfigError otherwise."""
    try:
        return _convert(value, tp, key)
    except _TypeMismatch:
        note = ""
        if isinstance(value, bool) and tp in (int, float):
            note = " (true/false is not a number)"
        elif isinstance(value, float) and tp is int:
            note = " (no fractional values)"
        raise ConfigError(f"{key}={value!r}: must be {_describe(tp)}{note}") from None


def _convert(value: Any, tp: Any, key: str) -> Any:
    if tp is Any:
        return value
    optional, inner = _is_optional(tp)
    if optional:
        return None if value is None else _convert(value, inner, key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _TypeMismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _TypeMismatch
    origin = typing.get_origin(tp)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise _TypeMismatch
        args = typing.get_args(tp)
        if not args:
            return list(value)
        return [_check_type(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _TypeMismatch
        args = typing.get_args(tp)
        vt = args[1] if args else Any
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}.{k}={v!r}: keys must be strings")
            out[k] = _check_type(v, vt, f"{key}.{k}")
        return out
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _convert(value, arm, key)
            except (_TypeMismatch, ConfigError):
                continue
        raise _TypeMismatch
    raise TypeError(f"automicro.config: unsupported field type {tp!r} at {key}")  # programming error


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, value: Any, key: str) -> Any:
    """Build dataclass ``cls`` from mapping ``value`` found at dotted ``key`` ("" = top level)."""
    where = key or "top level"
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key or 'config'}={value!r}: must be a mapping of {cls.__name__} settings")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{key}." if key else ""
    fold = getattr(cls, "_fold_extra", None)
    if fold is not None:
        value = fold(value, prefix)
    for k, v in value.items():
        if k not in fields:
            raise ConfigError(
                f"{prefix}{k}={v!r}: unknown key{_did_you_mean(str(k), fields)}; "
                f"allowed keys at {where}: {', '.join(fields)}"
            )
    hints = _hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name not in value:
            continue
        raw = value[name]
        fkey = f"{prefix}{name}"
        parse = f.metadata.get("parse")
        v = parse(raw, fkey) if parse is not None else _check_type(raw, hints[name], fkey)
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            raise ConfigError(
                f"{fkey}={raw!r}: must be one of {', '.join(map(str, choices))}{_did_you_mean(str(raw), choices)}"
            )
        check = f.metadata.get("check")
        if check is not None and v is not None:
            problem = check(v)
            if problem:
                raise ConfigError(f"{fkey}={raw!r}: {problem}")
        kwargs[name] = v
    obj = cls(**kwargs)
    cross = getattr(obj, "_cross_check", None)
    if cross is not None:
        cross(prefix)
    return obj


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _defaults_tree(cls: type) -> dict[str, Any]:
    """The dataclass defaults as a plain tree (the base the YAML is merged onto)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if dataclasses.is_dataclass(default):
            default = _defaults_tree(type(default))
        out[f.name] = default
    return out


def _deep_merge(base: Any, update: Any) -> Any:
    """Mapping onto mapping merges key by key; anything else replaces."""
    if isinstance(base, Mapping) and isinstance(update, Mapping):
        out = dict(base)
        for k, v in update.items():
            out[k] = _deep_merge(out[k], v) if k in out else v
        return out
    return update


def _split_override(item: Any) -> tuple[str, str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r}: must be key=value (dotted key, YAML value); {USAGE}")
    key, value = item.split("=", 1)
    key = key.strip()
    if not _OVERRIDE_KEY_RE.match(key):
        raise ConfigError(
            f"override {item!r}: bad key {key!r}; keys are dotted names such as model.overrides.n_layers; {USAGE}"
        )
    return key, value


def _check_override_key(key: str, item: str) -> None:
    """Walk the dataclass schema along ``key``; stop at the first free-form (non-dataclass) field."""
    cls: Any = TrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        _, inner = _is_optional(cls)
        if not dataclasses.is_dataclass(inner):
            return
        fields = {f.name: f for f in dataclasses.fields(inner)}
        if part not in fields and hasattr(inner, "_fold_extra"):
            return  # e.g. model.n_layers: a LlamaConfig field, checked when the tree is built
        if part not in fields and inner is FSDP2Config and part == "state_dict_type":
            raise _state_dict_type_error(key, item.split("=", 1)[1] if "=" in item else None)
        if part not in fields:
            here = ".".join(parts[:i]) or "top level"
            raise ConfigError(
                f"override {item!r}: unknown key {key!r}{_did_you_mean(part, fields)}; "
                f"allowed keys at {here}: {', '.join(fields)}"
            )
        cls = _hints(inner)[part]


def _parse_override(item: str) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    key, value = _split_override(item)
    _check_override_key(key, item)
    try:
        tree = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]), resolve=False)
    except (OmegaConfBaseException, ValueError) as e:  # yaml.YAMLError is not a ValueError
        raise ConfigError(f"override {item!r}: cannot parse the value: {_one_line(e)}") from e
    except Exception as e:
        raise ConfigError(f"override {item!r}: cannot parse the value: {_one_line(e)}") from e
    return tree


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _read_yaml(path: str) -> Any:
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r}: not found")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r}: not a file")
    try:
        conf = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r}: invalid YAML: {e}") from e
    except (OmegaConfBaseException, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"config file {path!r}: cannot load: {e}") from e
    tree = OmegaConf.to_container(conf, resolve=False)
    if tree is None:
        return {}
    if not isinstance(tree, Mapping):
        raise ConfigError(f"config file {path!r}: the top level must be a mapping of settings, got {tree!r}")
    return tree


def _resolve(tree: dict[str, Any], where: str) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: cannot resolve interpolations: {_one_line(e)}") from e


def load_config(path: Union[str, os.PathLike], overrides: Sequence[str] = ()) -> TrainConfig:
    """Read ``path`` (YAML), apply ``key=value`` overrides, resolve interpolations, validate.

    Raises:
        ConfigError: on a missing file, bad YAML, a bad override, an unknown key, a wrong type
            or an out-of-range value; the message names the dotted key and the value.
    """
    path = os.fspath(path)
    if isinstance(overrides, str):
        overrides = [overrides]
    tree = _deep_merge(_defaults_tree(TrainConfig), _read_yaml(path))
    for item in overrides:
        tree = _deep_merge(tree, _parse_override(item))
    return _build(TrainConfig, _resolve(tree, f"config file {path!r}"), "")


def from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """Validate a plain nested dict (e.g. `TrainConfig.to_dict()`'s output): defaults are merged
    under it and interpolations resolved exactly as for a YAML file."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"config={values!r}: must be a mapping of settings")
    tree = _deep_merge(_defaults_tree(TrainConfig), dict(values))
    return _build(TrainConfig, _resolve(tree, "config"), "")


def parse_cli(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``sys.argv[1:]`` -> (yaml_path, overrides); ``CONFIG.yaml [key=value ...]``."""
    argv = list(argv)
    if not argv:
        raise ConfigError(f"missing the config file; {USAGE}")
    path, rest = argv[0], argv[1:]
    if path in ("-h", "--help") or path.startswith("-") or "=" in path:
        raise ConfigError(f"first argument {path!r} must be the config YAML path; {USAGE}")
    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(f"first argument {path!r} must be a .yaml / .yml config file; {USAGE}")
    for item in rest:
        if item.startswith("-"):
            raise ConfigError(f"argument {item!r}: options are not supported, only key=value overrides; {USAGE}")
        _split_override(item)
    return path, rest


__all__ = [
    "ConfigError",
    "DataConfig",
    "KNOWN_CALLBACKS",
    "LoggerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "SchedulerConfig",
    "TrainConfig",
    "USAGE",
    "from_dict",
    "load_config",
    "parse_cli",
]
