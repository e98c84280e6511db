"""Build the pieces of a run (model, data, optimizer, scheduler, loggers, callbacks) from a
`TrainConfig`. Everything here runs before any process group exists, so a bad callback argument
fails at once with a message naming it."""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Optional

import torch
from composer.callbacks import LRMonitor, MemoryMonitor, RuntimeEstimator, SpeedMonitor
from composer.core import Callback, State
from composer.loggers import ConsoleLogger, Logger, LoggerDestination, WandBLogger
from composer.optim import (
    ConstantScheduler,
    CosineAnnealingWithWarmupScheduler,
    DecoupledAdamW,
    LinearWithWarmupScheduler,
)
from composer.utils import dist

from automicro.config import ConfigError, TrainConfig
from automicro.data import ByteTextCorpus, SyntheticTokens, build_dataloader
from automicro.integration.callback import AutoMicrobatching
from automicro.models import build_model
from automicro.testing.faults import FaultInjector
from automicro.testing.memory_cap import MemoryCap


class MemoryCapCallback(Callback):
    """`automicro.testing.MemoryCap` as a Composer callback: an emulated per-rank memory limit on
    CPU for the whole fit, which also feeds AutoMicrobatching's memory figures.

    YAML: ``callbacks: {memory_cap: {limit_bytes: {0: 6000000, 1: 9000000}}}``
    """

    def __init__(self, limit_bytes: Any, retry_band: float = 0.10) -> None:
        if isinstance(limit_bytes, dict):
            bad = {k: v for k, v in limit_bytes.items() if not isinstance(k, int) or not isinstance(v, int) or v <= 0}
            if bad:
                raise ValueError(f"memory_cap.limit_bytes: entries {bad} must map a rank (int) to a positive int of bytes")
        elif isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise ValueError(f"memory_cap.limit_bytes={limit_bytes!r}: must be a positive int of bytes or a {{rank: bytes}} map")
        self.cap = MemoryCap(limit_bytes, retry_band=retry_band)
        self._entered = False

    def fit_start(self, state: State, logger: Logger) -> None:
        if not self._entered:
            self.cap.__enter__()
            self._entered = True
            self.cap.track_existing(state.model, check=False)
            for callback in state.callbacks:
                if isinstance(callback, AutoMicrobatching):
                    callback.set_memory_source(CapMemory(self.cap))

    def fit_end(self, state: State, logger: Logger) -> None:
        self.close()

    def close(self, state: Optional[State] = None, logger: Optional[Logger] = None) -> None:
        if self._entered:
            self._entered = False
            self.cap.__exit__(None, None, None)


class CapMemory:
    """`MemorySource` over a `MemoryCap`."""

    def __init__(self, cap: MemoryCap) -> None:
        self.cap = cap

    def reset_peak(self) -> None:
        self.cap.reset_peak()

    def peak_bytes(self) -> int:
        return int(self.cap.peak_bytes)

    def allocated_bytes(self) -> int:
        return int(self.cap.live_bytes)

    def capacity_bytes(self) -> int:
        return int(self.cap.limit_bytes or 0)

    def alloc_retries(self) -> int:
        return int(self.cap.memory_stats()["num_alloc_retries"])

    def empty_cache(self) -> None:
        pass


class JSONLLogger(LoggerDestination):
    """Every logged metric as one JSON line per batch in ``RUN_DIR/metrics.jsonl`` (rank 0).

    Traces (``Logger.log_traces``, e.g. AutoMicrobatching's ``automicro/event`` per failed
    attempt) are rows too, marked ``"trace": true``; their ``step`` is the current batch count
    (the step the batch's metrics are logged at) and does not advance anything. Each launch
    begins with a ``{"trace": true, "run_start": {"run_name": ...}}`` row: the file is appended to.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = None
        self._state: Optional[State] = None

    def init(self, state: State, logger: Logger) -> None:
        self._state = state
        if dist.get_global_rank() == 0:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            # Marks where this launch's rows begin (the file is appended to) and names the run.
            self._write({"step": int(state.timestamp.batch), "trace": True}, {"run_start": {"run_name": state.run_name}})

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self._write({"step": step}, metrics)

    def log_traces(self, traces: dict[str, Any]) -> None:
        step = None if self._state is None else int(self._state.timestamp.batch)
        self._write({"step": step, "trace": True}, traces)

    def _write(self, row: dict[str, Any], values: dict[str, Any]) -> None:
        if self._file is None:
            return
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.item() if value.numel() == 1 else value.tolist()
            row[key] = value
        self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()

    def close(self, state: State, logger: Logger) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


CALLBACKS: dict[str, type] = {
    "speed_monitor": SpeedMonitor,
    "memory_monitor": MemoryMonitor,
    "lr_monitor": LRMonitor,
    "runtime_estimator": RuntimeEstimator,
    "auto_microbatching": AutoMicrobatching,
    "fault_injector": FaultInjector,
    "memory_cap": MemoryCapCallback,
}


def build_callbacks(cfg: TrainConfig) -> list[Callback]:
    callbacks = []
    for name, kwargs in cfg.callbacks.items():
        cls = CALLBACKS.get(name)
        if cls is None:
            raise ConfigError(f"callbacks.{name}: unknown callback; choose from {sorted(CALLBACKS)}")
        try:
            inspect.signature(cls).bind(**kwargs)
        except TypeError as error:
            allowed = [p for p in inspect.signature(cls).parameters if p != "self"]
            raise ConfigError(f"callbacks.{name}={kwargs!r}: {error}; allowed arguments: {allowed}") from None
        try:
            callbacks.append(cls(**kwargs))
        except (ValueError, TypeError) as error:
            raise ConfigError(f"callbacks.{name}: {error}") from None
    return callbacks


def build_model_from(cfg: TrainConfig) -> Any:
    overrides = dict(cfg.model.overrides)
    if cfg.model.tie_embeddings:
        overrides["tie_embeddings"] = True
    if cfg.data.kind == "synthetic" and cfg.data.vocab_size is not None:
        overrides.setdefault("vocab_size", cfg.data.vocab_size)
    overrides.setdefault("max_seq_len", max(cfg.data.seq_len, 1))
    return build_model(cfg.model.preset, init_device=cfg.model.init_device, **overrides)


def build_dataset(cfg: TrainConfig, vocab_size: int, split_seed: int = 0) -> Any:
    if cfg.data.kind == "synthetic":
        return SyntheticTokens(cfg.data.num_samples, cfg.data.seq_len, cfg.data.vocab_size or vocab_size, seed=cfg.seed + split_seed)
    if vocab_size < 256:
        raise ConfigError(f"data.kind='text' needs a byte vocabulary (256); the model has vocab_size={vocab_size}")
    return ByteTextCorpus(cfg.data.paths, cfg.data.seq_len, max_bytes=cfg.data.max_bytes)


def build_train_dataloader(cfg: TrainConfig, dataset: Any, per_rank_batch: int) -> Any:
    return build_dataloader(
        dataset, per_rank_batch, shuffle=cfg.data.shuffle, seed=cfg.seed, drop_last=True, num_workers=cfg.data.num_workers
    )


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


def build_loggers(cfg: TrainConfig) -> list[LoggerDestination]:
    """Console, ``RUN_DIR/metrics.jsonl`` and wandb, as configured under ``loggers``.

    wandb is offline unless asked otherwise: with ``WANDB_MODE`` unset and no ``wandb_project``
    the run is written under ``RUN_DIR/wandb/`` only (``wandb sync`` uploads it later). Setting a
    project (and not ``WANDB_MODE=offline``) logs online. wandb groups panels by the prefix before
    the first ``/``: ``throughput/``, ``memory/``, ``automicro/``, ``loss/``, ``metrics/``.
    """
    loggers: list[LoggerDestination] = []
    if cfg.loggers.console:
        loggers.append(ConsoleLogger(log_interval=cfg.loggers.console_interval))
    if cfg.loggers.jsonl:
        loggers.append(JSONLLogger(os.path.join(cfg.run_dir, "metrics.jsonl")))
    if cfg.loggers.wandb:
        if not os.environ.get("WANDB_MODE") and not cfg.loggers.wandb_project:
            os.environ["WANDB_MODE"] = "offline"
            if dist.get_global_rank() == 0:
                print(
                    f"[automicro] wandb offline (no loggers.wandb_project, WANDB_MODE unset): run files under "
                    f"{os.path.join(cfg.run_dir, 'wandb')}; `wandb sync` uploads them",
                    flush=True,
                )
        os.makedirs(cfg.run_dir, exist_ok=True)
        loggers.append(
            AutomicroWandBLogger(
                project=cfg.loggers.wandb_project,
                entity=cfg.loggers.wandb_entity,
                name=cfg.run_name,
                init_kwargs={"dir": cfg.run_dir},
            )
        )
    return loggers


class AutomicroWandBLogger(WandBLogger):
    """Composer's `WandBLogger` that also keeps traces: Composer's drops them. Each
    ``automicro/event`` (one per failed attempt) is appended to the run summary's
    ``automicro/events`` list, which does not advance wandb's step."""

    def log_traces(self, traces: dict[str, Any]) -> None:
        if not self._enabled:
            return
        import wandb

        if wandb.run is None:
            return
        for key, value in traces.items():
            if key == "automicro/event":
                events = list(wandb.run.summary.get("automicro/events", []) or []) + [value]
                wandb.run.summary["automicro/events"] = events
            else:
                wandb.run.summary[key] = value
