"""The run's logger destinations: console, ``RUN_DIR/metrics.jsonl`` and Weights & Biases, as a
config's ``loggers:`` section asks (`build_loggers`).

Owns: `JSONLLogger`, `AutomicroWandBLogger` and the choice of online / offline wandb. May not
touch: the callbacks, the model, the fault kit; it reads only ``cfg.loggers``, ``cfg.run_dir``
and ``cfg.run_name``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
from composer.core import State
from composer.loggers import ConsoleLogger, Logger, LoggerDestination, WandBLogger
from composer.utils import dist

from automicro.config import TrainConfig


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


def build_loggers(cfg: TrainConfig) -> list[LoggerDestination]:
    """Console, ``RUN_DIR/metrics.jsonl`` and wandb, as configured under ``loggers``.

    wandb is offline unless asked otherwise: with ``WANDB_MODE`` unset and no ``wandb_project``
    the run is written under ``RUN_DIR/wandb/`` only (``wandb sync`` uploads it later). Setting a
    project (and not ``WANDB_MODE=offline``) logs online. The run's wandb config is the resolved
    config (every key of the YAML after overrides and defaults). wandb groups panels by the prefix
    before the first ``/``: ``throughput/``, ``memory/``, ``automicro/``, ``loss/``, ``metrics/``.
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
                # The resolved config is the run's wandb config: runs filter and group by any setting.
                init_kwargs={"dir": cfg.run_dir, "config": cfg.to_dict()},
            )
        )
    return loggers


class AutomicroWandBLogger(WandBLogger):
    """Composer's `WandBLogger` that also keeps traces: Composer's drops them. Each
    ``automicro/event`` (one per failed attempt) is appended to the run summary's
    ``automicro/events`` list, each ``automicro/trial`` (one per trial that ended) to ``automicro/trials``;
    neither advances wandb's step."""

    def log_traces(self, traces: dict[str, Any]) -> None:
        if not self._enabled:
            return
        import wandb

        if wandb.run is None:
            return
        for key, value in traces.items():
            if key in ("automicro/event", "automicro/trial"):
                plural = key + "s"
                wandb.run.summary[plural] = list(wandb.run.summary.get(plural, []) or []) + [value]
            else:
                wandb.run.summary[key] = value


__all__ = ["AutomicroWandBLogger", "JSONLLogger", "build_loggers"]


def output_lines(cfg: TrainConfig, loggers: list[LoggerDestination]) -> list[str]:
    """Where a finished run's outputs are, for the console's last lines (rank 0)."""
    lines = []
    if cfg.loggers.jsonl:
        jsonl = os.path.join(cfg.run_dir, "metrics.jsonl")
        lines.append(f"[automicro] metrics: {jsonl}; plot: python scripts/plot_run.py {cfg.run_dir} -o run.png")
    wandb_logger = next((lg for lg in loggers if isinstance(lg, WandBLogger)), None)
    if wandb_logger is None:
        lines.append("[automicro] wandb: off (loggers.wandb=true turns it on; offline unless a project is set)")
    elif wandb_logger.run_dir:
        run = os.path.dirname(wandb_logger.run_dir)  # wandb's run.dir is the run folder's files/
        online = wandb_logger.run_url and os.environ.get("WANDB_MODE") != "offline"
        where = wandb_logger.run_url if online else f"{run} (offline: `wandb sync {run}` uploads it)"
        lines.append(f"[automicro] wandb run: {where}")
    return lines
