"""Composer callbacks that record what the benchmark suites measure; top-level, shared by every suite.

Owns: `Mem` (the memory figures of a case: CUDA allocator or the CPU `MemoryCap` emulation),
`Recorder` (per batch: wall time, attempts, split, hooks, memory, retries, consensus rounds, and
where a failed attempt was), `MetricsLog` (SpeedMonitor's metrics in memory) and `WindowClock`
(the timed windows of an interleaved comparison). Reads the AutoMicrobatching callback only
through its public read-only figures (`used_split`, `batch_attempts`, `consensus_rounds`,
`consensus_finish_s`, `hooks_active`, `policy`, `ooms_total`, `thrash`); never a private attribute.
Imported after the process group exists (suites import it inside their functions).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from composer.core import Callback
from composer.loggers import LoggerDestination

from automicro.composer.callback import AutoMicrobatching
from harness import WindowTimer


class Mem:
    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.cap = None  # automicro.testing.MemoryCap of the current case (CPU)

    def reset_peak(self) -> None:
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        elif self.cap is not None:
            self.cap.reset_peak()

    def peak(self) -> int:
        if self.gpu:
            return int(torch.cuda.max_memory_allocated())
        return int(self.cap.peak_bytes) if self.cap is not None else 0

    def reserved_peak(self) -> int:
        if self.gpu:
            return int(torch.cuda.max_memory_reserved())
        return self.peak()

    def allocated(self) -> int:
        if self.gpu:
            return int(torch.cuda.memory_allocated())
        return int(self.cap.live_bytes) if self.cap is not None else 0

    def retries(self) -> int:
        if self.gpu:
            return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
        return int(self.cap.memory_stats()["num_alloc_retries"]) if self.cap is not None else 0


class Recorder(Callback):
    """Per batch: wall time, attempts, split, hooks, memory, retries, consensus rounds.
    With `probe`, also the forward(+loss) and backward peaks of every microbatch."""

    def __init__(self, mem: Mem, probe: bool = False) -> None:
        self.mem = mem
        self.probe = probe
        self.rows: list[dict[str, Any]] = []
        self.auto: Optional[AutoMicrobatching] = None
        self.index = -1
        self.stop_on_step_down = False
        self.stopped_early = False
        self._attempt = 0
        self._failed: list[list[Any]] = []
        self._phase, self._microbatch = "batch_start", -1

    def fit_start(self, state, logger) -> None:
        self.auto = next((c for c in state.callbacks if isinstance(c, AutoMicrobatching)), None)

    def _sync_count(self) -> int:
        return self.auto.consensus_rounds if self.auto is not None else 0

    def _finish_seconds(self) -> float:
        return self.auto.consensus_finish_s if self.auto is not None else 0.0

    def batch_start(self, state, logger) -> None:
        self.index = int(state.timestamp.batch)
        # Hooks during this batch: on now, or about to come on (the policy starts with the first batch).
        self._hooks0 = bool(self.auto is not None and (self.auto.hooks_active or self.auto.policy is None))
        self._attempt = 0
        self._failed: list[list[Any]] = []
        self._sync0 = self._sync_count()
        self._finish0 = self._finish_seconds()
        self._retries0 = self.mem.retries()
        self._fwd = 0
        self._bwd = 0
        self.mem.reset_peak()
        self._t0 = time.perf_counter()

    # Where this rank was when an attempt failed (Composer events; finer than automicro's
    # sites, which name the last FSDP-module hook: an OOM in the loss or in its backward,
    # before the first module backward hook, is reported there at `forward`).
    def before_train_batch(self, state, logger) -> None:
        if self._attempt > 0:
            self._failed.append([self._attempt, self._phase, self._microbatch])
        self._attempt += 1
        self._phase, self._microbatch = "batch_start", -1

    def before_forward(self, state, logger) -> None:
        self._phase = "forward"
        self._microbatch += 1
        if self.probe:
            self.mem.reset_peak()

    def after_forward(self, state, logger) -> None:
        self._phase = "loss"

    def before_backward(self, state, logger) -> None:
        self._phase = "backward"
        if self.probe:
            self._fwd = max(self._fwd, self.mem.peak())  # forward + loss of this microbatch
            self.mem.reset_peak()

    def after_backward(self, state, logger) -> None:
        self._phase = "after_backward"
        if self.probe:
            self._bwd = max(self._bwd, self.mem.peak())

    def after_train_batch(self, state, logger) -> None:
        self._phase = "optimizer"

    def failed_attempt_phases(self) -> list[list[Any]]:
        """For a fit that ended inside a batch (cannot fit): that batch's failures so far, plus the last."""
        return self._failed + ([[self._attempt, self._phase, self._microbatch]] if self._attempt else [])

    def batch_end(self, state, logger) -> None:
        seconds = time.perf_counter() - self._t0
        auto = self.auto
        split = list(auto.used_split) if auto is not None and auto.used_split else None
        size = max(split) if split else state.device_train_microbatch_size
        self.rows.append(
            {
                "batch": self.index,
                "s": round(seconds, 5),
                "attempts": auto.batch_attempts if auto is not None else 1,
                "size": int(size) if size is not None else None,
                "split": split,
                "hooks": self._hooks0,
                "hooks_after": bool(auto is not None and auto.hooks_active),
                "rounds": self._sync_count() - self._sync0,
                "finish_s": round(self._finish_seconds() - self._finish0, 6),
                "retries": self.mem.retries() - self._retries0,
                "peak": self.mem.peak(),
                "reserved_peak": self.mem.reserved_peak(),
                "fwd_peak": self._fwd if self.probe else None,
                "bwd_peak": self._bwd if self.probe else None,
                "failed_phases": self._failed,
            }
        )
        self._attempt = 0
        # Sweep runs: a size that had to step down has shown what it had to show. ooms_total and
        # thrash events are agreed by every rank, so every rank stops at the same batch.
        if self.stop_on_step_down and auto is not None and (auto.ooms_total or auto.thrash.events):
            self.stopped_early = True
            state.stop_training()

class MetricsLog(LoggerDestination):
    """Metrics in memory, keyed by the batch index the recorder is on when they arrive."""

    KEYS = ("throughput/tokens_per_sec", "throughput/device/mfu", "loss/train/total")

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.rows: dict[str, dict[int, float]] = {k: {} for k in self.KEYS}

    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        for key in self.KEYS:
            if key in metrics:
                value = metrics[key]
                self.rows[key][self.recorder.index] = float(value.item() if hasattr(value, "item") else value)


class WindowClock(Callback):
    """Times one window of `steps` batches of a trainer that fits again and again (interleaved
    comparisons): from the first batch's start to the last batch's end, device-synchronised at
    both ends only (the host may run ahead inside the window, as in training), plus the training
    thread's CPU time. `arm(steps)` before each `fit(duration=...)`; `result` after it."""

    def __init__(self, cuda: bool) -> None:
        self.timer = WindowTimer(cuda)
        self.steps = 0
        self.seen = 0
        self.batch_ends: list[float] = []
        self.hooks: list[bool] = []  # sync hooks on at each batch's start (AutoMicrobatching runs only)
        self.result: Optional[dict[str, Any]] = None
        self.auto: Optional[AutoMicrobatching] = None

    def arm(self, steps: int) -> None:
        self.steps, self.seen, self.result, self.batch_ends, self.hooks = steps, 0, None, [], []

    def fit_start(self, state, logger) -> None:
        self.auto = next((c for c in state.callbacks if isinstance(c, AutoMicrobatching)), None)

    def batch_start(self, state, logger) -> None:
        if self.auto is not None:
            self.hooks.append(self.auto.hooks_active)
        if self.steps and self.seen == 0:
            self.timer.start()

    def batch_end(self, state, logger) -> None:
        if not self.steps:
            return
        self.seen += 1
        self.batch_ends.append(time.perf_counter())
        if self.seen == self.steps:
            self.result = self.timer.stop(self.steps)
            # host-side batch ends (no sync inside the window): how evenly the window ran
            marks = [self.timer.t0] + self.batch_ends
            self.result["host_batch_s"] = [round(b - a, 6) for a, b in zip(marks, marks[1:])]
            self.result["hooks_on"] = sorted(set(self.hooks)) if self.auto is not None else None
            self.steps = 0
