"""Build the pieces of a run (model, data, optimizer, scheduler, callbacks) from a `TrainConfig`.
Everything here runs before any process group exists, so a bad callback argument fails at once
with a message naming it. Loggers: `automicro.composer.loggers`.

Owns: turning config sections into objects. May not touch: the fault kit (`automicro.testing`)
at import time -- a kit callback's module is imported by `callback_class` only when a config
names it; validation (the config did it; only what needs the built class, the callback's
keyword arguments, is checked here).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any

import torch
from composer.core import Callback
from composer.optim import (
    ConstantScheduler,
    CosineAnnealingWithWarmupScheduler,
    DecoupledAdamW,
    LinearWithWarmupScheduler,
)

from automicro.config import CALLBACK_REGISTRY, ConfigError, TrainConfig
from automicro.data import ByteTextCorpus, SyntheticTokens, VariableLengthTokens, build_dataloader, count_tokens, pad_collate
from automicro.data.datasets import DataError
from automicro.models import build_model


def callback_class(name: str) -> type:
    """The class the registry names for ``name`` (`automicro.config.registry.CALLBACK_REGISTRY`),
    imported now: a fault-kit callback's module is imported only when a config asks for it."""
    target = CALLBACK_REGISTRY.get(name)
    if target is None:
        raise ConfigError(f"callbacks.{name}: unknown callback; choose from {sorted(CALLBACK_REGISTRY)}")
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


# Arguments of Composer's own callbacks that Composer accepts and fails on later (mid-run).
_POSITIVE_INT_ARGUMENTS = {"speed_monitor": ("window_size",)}


def build_callbacks(cfg: TrainConfig) -> list[Callback]:
    callbacks = []
    for name, kwargs in cfg.callbacks.items():
        cls = callback_class(name)
        try:
            inspect.signature(cls).bind(**kwargs)
        except TypeError as error:
            allowed = [p for p in inspect.signature(cls).parameters if p != "self"]
            raise ConfigError(f"callbacks.{name}={kwargs!r}: {error}; allowed arguments: {allowed}") from None
        for argument in _POSITIVE_INT_ARGUMENTS.get(name, ()):
            value = kwargs.get(argument)
            if argument in kwargs and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"callbacks.{name}.{argument}={value!r}: must be a positive int")
        try:
            callbacks.append(cls(**kwargs))
        except (ValueError, TypeError) as error:
            raise ConfigError(f"callbacks.{name}: {error}") from None
    return callbacks


def build_model_from(cfg: TrainConfig) -> Any:
    """The Llama the config asks for; a shape the model refuses (LlamaConfig's checks, run before
    anything is allocated) is a `ConfigError` naming the preset and ``model.overrides``."""
    overrides = dict(cfg.model.overrides)
    if cfg.model.tie_embeddings:
        overrides["tie_embeddings"] = True
    if cfg.data.kind == "synthetic" and cfg.data.vocab_size is not None:
        overrides.setdefault("vocab_size", cfg.data.vocab_size)
    overrides.setdefault("max_seq_len", max(cfg.data.seq_len, 1))
    try:
        return build_model(cfg.model.preset, init_device=cfg.model.init_device, **overrides)
    except ValueError as error:
        raise ConfigError(
            f"model (preset {cfg.model.preset!r}, overrides {dict(cfg.model.overrides)}): {error}; change "
            "model.overrides (or the preset)"
        ) from error


def build_dataset(cfg: TrainConfig, vocab_size: int, split_seed: int = 0) -> Any:
    if cfg.data.kind == "varlen":
        try:
            return VariableLengthTokens(
                cfg.data.num_samples, cfg.data.vocab_size or vocab_size, median_len=cfg.data.median_len,
                sigma=cfg.data.sigma, min_len=min(8, cfg.data.seq_len), max_len=cfg.data.seq_len, seed=cfg.seed + split_seed,
            )
        except DataError as error:
            raise ConfigError(f"data (kind 'varlen'): {error}; change data.median_len, data.sigma or data.seq_len") from error
    if cfg.data.kind == "synthetic":
        return SyntheticTokens(cfg.data.num_samples, cfg.data.seq_len, cfg.data.vocab_size or vocab_size, seed=cfg.seed + split_seed)
    if vocab_size < 256:
        raise ConfigError(f"data.kind='text' needs a byte vocabulary (256); the model has vocab_size={vocab_size}")
    try:
        return ByteTextCorpus(cfg.data.paths, cfg.data.seq_len, max_bytes=cfg.data.max_bytes)
    except DataError as error:
        raise ConfigError(f"data (kind 'text'): {error}; change data.paths, data.max_bytes or data.seq_len") from error


def build_train_dataloader(cfg: TrainConfig, dataset: Any, per_rank_batch: int) -> Any:
    replicas = None
    if cfg.pipeline is not None:
        from composer.utils import dist

        # The ranks of one pipeline (same rank % dp) read the same samples.
        dp = cfg.data_parallel_size(dist.get_world_size())
        replicas = (dp, dist.get_global_rank() % dp)
    try:
        return build_dataloader(
            dataset, per_rank_batch, shuffle=cfg.data.shuffle, seed=cfg.seed, drop_last=True,
            num_workers=cfg.data.num_workers, replicas=replicas, collate_fn=collate_for(cfg),
        )
    except DataError as error:
        raise ConfigError(
            f"data: {error} (global_train_batch_size={cfg.global_train_batch_size}); change data.num_samples, "
            "data.max_bytes or global_train_batch_size"
        ) from error


def collate_for(cfg: TrainConfig) -> Any:
    """The batch collator of the data kind (None: torch's default)."""
    return pad_collate if cfg.data.kind == "varlen" else None


def train_data(cfg: TrainConfig, dataloader: Any) -> Any:
    """What the Trainer gets as train_dataloader: variable-length batches count real tokens (for
    throughput and per-token loss accumulation) instead of Composer's padded count."""
    if cfg.data.kind != "varlen":
        return dataloader
    from composer.core import DataSpec

    return DataSpec(dataloader, get_num_tokens_in_batch=count_tokens)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "decoupled_adamw":
        return DecoupledAdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


def build_scheduler(cfg: TrainConfig) -> Any:
    s = cfg.scheduler
    if s.name == "cosine_with_warmup":
        return CosineAnnealingWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    if s.name == "linear_with_warmup":
        return LinearWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    return ConstantScheduler()


# Old homes of names that moved (kept for one release; each import warns with the new path).
_MOVED = {
    "MemoryCapCallback": "automicro.testing.callbacks",
    "CapMemory": "automicro.testing.callbacks",
    "JSONLLogger": "automicro.composer.loggers",
    "AutomicroWandBLogger": "automicro.composer.loggers",
    "build_loggers": "automicro.composer.loggers",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"automicro.composer.builders.{name} moved to {_MOVED[name]}.{name}; the old path goes "
            "in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    if name == "CALLBACKS":
        warnings.warn(
            "automicro.composer.builders.CALLBACKS (name -> class) is replaced by "
            "automicro.config.CALLBACK_REGISTRY (name -> 'module:attribute') and "
            "automicro.composer.builders.callback_class(name); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return {n: callback_class(n) for n in CALLBACK_REGISTRY}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
