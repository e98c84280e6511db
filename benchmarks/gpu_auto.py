"""Prove auto microbatching on GPUs: no hangs, throughput vs hand-tuned sizes, search cost, thrash.

One driver, one suite per launch, many Trainers in sequence inside the same process group:

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gpu_auto.py \
        --suite nohang --out runs/gpu_auto [--runs 12]
    ... --suite throughput | thrash | parity
    # CPU check of the same logic (gloo, tiny Llama, emulated memory limits through MemoryCapCallback):
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gpu_auto.py \
        --suite nohang --out /tmp/ga --device cpu --tiny

Suites (each writes OUT/gpu_auto_<suite>.json, rewritten after every case, and prints a table on
rank 0; a case that is running when the process dies is left under "in_progress"):

- nohang: `--runs` short auto runs (6 batches) under random per-rank memory fractions (seeded):
  equal, asymmetric, one rank tight; case 0 also measures each rank's forward and backward peaks
  and case 1 puts rank 1's limit between them (aiming at an OOM in backward on one rank only).
  Per run: fractions, attempts, OOMs, failing ranks and sites, seconds to a stable size, found
  size, whether it ended. A per-case watchdog (faulthandler, `--case-timeout`) dumps every
  thread's stack and ends the process if a case hangs; the shell script's `timeout` is the outer
  watchdog.
- throughput: one fixed fraction pair (`--fractions`, default 0.22,0.32): auto (bisect), auto
  (halve, Composer's policy), a sweep of fixed sizes 1..found+1 (each run as
  AutoMicrobatching(search="halve", start_size=m), so an OOM is safe and shows as a step-down),
  and plain Composer at the best fixed size (no automicro in the batch step). Steady-state
  tokens/s (median of SpeedMonitor's `throughput/tokens_per_sec` over the last batches, plus our
  own per-batch timing), ratio auto / best hand-tuned, search cost (attempts and OOMs to
  converge), step time with sync hooks on vs off at the same split, consensus all-reduces per
  batch and a gloo all-reduce micro-benchmark.
- thrash: allocator retries without OOM: measure the peak at the found size with room to spare,
  then run auto at that size with the limit a few percent above the peak (largest margin first)
  until the thrash detector fires; its step-down and tokens/s before and after.
- parity: auto vs the found size fixed (plain Composer) on real text, per-batch losses of both.
- hooks: step time with the sync hooks on vs off at one size (`--hooks-size`, started there with
  `stable_batches=--sweep-stable`, so the first batches run hooks on and the rest hooks off), for
  sync points all / collectives x consensus transport shm / process_group.

Memory limits: on GPU `torch.cuda.set_per_process_memory_fraction` (set on every rank before
every case, 1.0 when the case has none, since it persists in a process); on CPU
`automicro.testing.MemoryCapCallback` with `fraction * --cpu-total-mb` bytes.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
import weakref
from dataclasses import asdict
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SUITES = ("nohang", "throughput", "thrash", "parity", "hooks")


# ---- arguments ------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", required=True, choices=SUITES)
    p.add_argument("--out", required=True, help="output folder (rank 0 writes gpu_auto_<suite>.json)")
    p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny Llama, seq 128, fp32 (the CPU check)")
    p.add_argument("--model", default=None, help="model preset (default 1b, or tiny with --tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (128 with --tiny)")
    p.add_argument("--per-rank-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="default 3e-4 (3e-3 with --tiny)")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--speed-window", type=int, default=3, help="SpeedMonitor window_size")
    p.add_argument("--steady-window", type=int, default=8, help="last N steady batches measured")
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="start no new case after this many seconds in the suite (rank 0 decides)")
    p.add_argument("--case-timeout", type=float, default=150.0,
                   help="per-case watchdog: dump all stacks and exit if one case takes longer")
    p.add_argument("--dist-timeout", type=float, default=120.0)
    p.add_argument("--sync-points", default="all", choices=("all", "collectives"),
                   help="AutoMicrobatching(sync_points=...): consensus at module boundaries too, or only before collectives")
    p.add_argument("--transport", default="auto", choices=("auto", "shm", "process_group"),
                   help="AutoMicrobatching(consensus_transport=...)")
    p.add_argument("--hooks-size", type=int, default=4, help="hooks: the fixed microbatch size measured")
    p.add_argument("--quiet", action="store_true", help="no [automicro] attempt lines")
    p.add_argument("--cpu-total-mb", type=float, default=60.0,
                   help="CPU only: the emulated device size; a fraction f limits a rank to f * this")
    p.add_argument("--cpu-retry-band", type=float, default=0.03,
                   help="CPU only: MemoryCap retry band (allocations this close to the limit count as retries)")
    # nohang
    p.add_argument("--runs", type=int, default=12, help="nohang: number of runs (the issue asks >= 20)")
    p.add_argument("--nohang-batches", type=int, default=6)
    p.add_argument("--fraction-range", default="0.15,0.55", help="nohang: random fractions lo,hi")
    p.add_argument("--probe-fraction", type=float, default=0.45,
                   help="nohang case 0 (both ranks) and case 1 (rank 0): fraction with room to spare")
    p.add_argument("--bwd-position", type=float, default=0.6,
                   help="nohang case 1: rank 1's limit at this point between its forward and backward peaks")
    # throughput
    p.add_argument("--fractions", default="0.22,0.32", help="throughput/parity: rank0,rank1 fractions")
    p.add_argument("--batches", type=int, default=14, help="throughput: batches per run")
    p.add_argument("--sweep", default="auto", help="throughput: fixed sizes, 'auto' = 1..found+1, or e.g. 2,3,4,5")
    p.add_argument("--sweep-stable", type=int, default=4,
                   help="throughput sweep: stable_batches (hooks-on batches measured before hooks come off)")
    p.add_argument("--no-plain", action="store_true", help="throughput: skip plain Composer at the best size")
    # thrash
    p.add_argument("--thrash-size", type=int, default=0,
                   help="thrash: microbatch size (0: the split auto used in OUT/gpu_auto_throughput.json, else 4)")
    p.add_argument("--thrash-margins", default=None,
                   help="thrash: limit = steady peak allocated * (1 + margin), tried in order until the detector fires "
                        "(default 0.12,0.06,0.03: on H200 at microbatch 4 reserved/allocated is ~1.19 unconstrained; CPU 0.025,0.012)")
    p.add_argument("--thrash-batches", type=int, default=12)
    p.add_argument("--thrash-probe-fraction", type=float, default=0.6)
    p.add_argument("--thrash-search", default="bisect", choices=("bisect", "halve"))
    # parity
    p.add_argument("--parity-steps", type=int, default=300)
    p.add_argument("--parity-control", type=int, default=0,
                   help="parity: the noise floor instead: two plain runs at this fixed size, same seed and data")
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny (a 1B model on CPU is not a check, it is a wait)")
    args.model = args.model or ("tiny" if args.tiny else "1b")
    args.seq_len = args.seq_len or (128 if args.tiny else 2048)
    args.lr = args.lr or (3e-3 if args.tiny else 3e-4)
    if args.thrash_margins is None:
        args.thrash_margins = "0.025,0.012" if args.device == "cpu" else "0.12,0.06,0.03"
    return args


# ---- small helpers --------------------------------------------------------------------------------


def median(values: list[float]) -> Optional[float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def rnd(value: Any, digits: int = 4) -> Any:
    return None if value is None else round(float(value), digits)


def pair(text: str) -> tuple[float, float]:
    a, b = (float(x) for x in text.split(","))
    return a, b


class Ctx:
    """Process-wide settings of this launch."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as tdist

        self.args = args
        self.gpu = args.device == "gpu"
        self.rank = tdist.get_rank()
        self.world = tdist.get_world_size()
        # Control-plane collectives (decisions, result gathering) on a gloo group of our own.
        self.ctl = tdist.new_group(backend="gloo")
        if self.gpu:
            self.total_bytes = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
            self.device_name = torch.cuda.get_device_name()
        else:
            self.total_bytes = int(args.cpu_total_mb * 2**20)
            self.device_name = "cpu (emulated %.0f MB per rank)" % args.cpu_total_mb
        self.global_batch = args.per_rank_batch * self.world
        self.tokens_per_batch = self.global_batch * args.seq_len
        self.suite_t0 = time.perf_counter()
        self.cases: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.case_lines_on_console = args.suite != "nohang"  # nohang's table repeats them
        self.out_path = os.path.join(args.out, f"gpu_auto_{args.suite}.json")

    # rank 0 decides, every rank follows (keeps collectives matched)
    def decide(self, value: Any) -> Any:
        import torch.distributed as tdist

        box = [value if self.rank == 0 else None]
        tdist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as tdist

        out: list[Any] = [None] * self.world
        tdist.all_gather_object(out, obj, group=self.ctl)
        return out

    def elapsed(self) -> float:
        return time.perf_counter() - self.suite_t0

    def within_budget(self, name: str) -> bool:
        go = self.decide(self.elapsed() < self.args.budget_s)
        if not go:
            self.say(f"skip {name}: suite budget {self.args.budget_s:.0f} s used ({self.elapsed():.0f} s)")
            self.extra.setdefault("skipped_for_budget", []).append(name)
        return go

    def say(self, message: str, detail: bool = False) -> None:
        """Rank 0 prints; `[gpu_auto]` lines are the console summary (gpu_auto.sh shows only those),
        `[gpu_auto:detail]` lines go to the log."""
        if self.rank == 0:
            print(f"[gpu_auto{':detail' if detail else ''}] {message}", flush=True)

    def write(self, in_progress: Optional[str] = None, done: bool = False) -> None:
        if self.rank != 0:
            return
        import composer
        import torch

        doc = {
            "suite": self.args.suite,
            "done": done,
            "in_progress": in_progress,
            "elapsed_s": round(self.elapsed(), 2),
            "device": self.device_name,
            "device_total_bytes": self.total_bytes,
            "world_size": self.world,
            "torch": torch.__version__,
            "composer": composer.__version__,
            "model": self.args.model,
            "seq_len": self.args.seq_len,
            "per_rank_batch": self.args.per_rank_batch,
            "global_batch": self.global_batch,
            "tokens_per_batch": self.tokens_per_batch,
            "args": vars(self.args),
            "cases": self.cases,
            **self.extra,
        }
        os.makedirs(self.args.out, exist_ok=True)
        tmp = self.out_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(doc, handle, indent=1, default=str)
        os.replace(tmp, self.out_path)


# ---- memory figures (GPU allocator or CPU MemoryCap) -------------------------------------------------


class Mem:
    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.cap = None  # automicro.testing.MemoryCap of the current case (CPU)

    def reset_peak(self) -> None:
        import torch

        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        elif self.cap is not None:
            self.cap.reset_peak()

    def peak(self) -> int:
        import torch

        if self.gpu:
            return int(torch.cuda.max_memory_allocated())
        return int(self.cap.peak_bytes) if self.cap is not None else 0

    def reserved_peak(self) -> int:
        import torch

        if self.gpu:
            return int(torch.cuda.max_memory_reserved())
        return self.peak()

    def allocated(self) -> int:
        import torch

        if self.gpu:
            return int(torch.cuda.memory_allocated())
        return int(self.cap.live_bytes) if self.cap is not None else 0

    def retries(self) -> int:
        import torch

        if self.gpu:
            return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
        return int(self.cap.memory_stats()["num_alloc_retries"]) if self.cap is not None else 0


def make_recorder_classes():
    """Defined lazily: Composer is imported after the process group exists."""
    from composer.core import Callback
    from composer.loggers import LoggerDestination

    from automicro.integration.callback import AutoMicrobatching

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

    return Recorder, MetricsLog


# ---- one case: build a Trainer, fit, measure, tear down -------------------------------------------------


def fraction_map(fractions: Optional[tuple[float, float]]) -> Optional[dict[int, float]]:
    return None if fractions is None else {i: float(f) for i, f in enumerate(fractions)}


def run_case(
    ctx: Ctx,
    name: str,
    *,
    fractions: Optional[tuple[float, ...]],
    micro: Any = "auto",
    auto_kwargs: Optional[dict[str, Any]] = None,
    batches: int,
    text: bool = False,
    probe: bool = False,
    losses: bool = False,
    stop_on_step_down: bool = False,
    note: str = "",
) -> dict[str, Any]:
    """Runs one Trainer on every rank; returns (on rank 0) the case record, also appended to ctx.cases."""
    import torch
    from composer.callbacks import SpeedMonitor
    from composer.core.engine import Engine
    from composer.optim import DecoupledAdamW
    from composer.utils import reproducibility

    import automicro
    from automicro.data import ByteTextCorpus, SyntheticTokens, build_dataloader
    from automicro.testing import MemoryCapCallback
    from automicro.integration.callback import AutoMicrobatching, MicrobatchSizeError
    from automicro.models import build_model

    args = ctx.args
    Recorder, MetricsLog = make_recorder_classes()
    ctx.write(in_progress=name)
    ctx.say(f"case {name}: fractions {fractions} microbatch {micro} {auto_kwargs or ''} {note}".rstrip(), detail=True)
    # Per-case hang watchdog (build, fit, teardown, gather): dump every thread's stack and end the
    # process; the launcher then stops the other rank and the JSON keeps this case as in_progress.
    faulthandler.dump_traceback_later(args.case_timeout, exit=True)

    gc.collect()
    own_fraction = None if fractions is None else float(fractions[ctx.rank])
    if ctx.gpu:
        torch.cuda.empty_cache()
        # Persists in the process: set on every case, 1.0 when this case has no limit.
        torch.cuda.set_per_process_memory_fraction(own_fraction if own_fraction is not None else 1.0)
        torch.cuda.reset_peak_memory_stats()
    allocated_before = int(torch.cuda.memory_allocated()) if ctx.gpu else 0

    reproducibility.seed_all(args.seed)
    model = build_model(args.model, init_device="meta", max_seq_len=args.seq_len)
    model_ref = weakref.ref(model)
    vocab = model.model.config.vocab_size
    if text:
        dataset = ByteTextCorpus(None, seq_len=args.seq_len)
    else:
        dataset = SyntheticTokens(ctx.global_batch * batches, args.seq_len, vocab, seed=args.seed)
    loader = build_dataloader(dataset, args.per_rank_batch, shuffle=text, seed=args.seed, drop_last=True)
    optimizer = DecoupledAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    mem = Mem(ctx.gpu)
    recorder = Recorder(mem, probe=probe)
    recorder.stop_on_step_down = stop_on_step_down
    metrics = MetricsLog(recorder)
    callbacks: list[Any] = [recorder, SpeedMonitor(window_size=args.speed_window)]
    auto = None
    if micro == "auto":
        kwargs = dict(auto_kwargs or {})
        kwargs.setdefault("log_attempts", not args.quiet)
        kwargs.setdefault("sync_points", args.sync_points)
        kwargs.setdefault("consensus_transport", args.transport)
        auto = AutoMicrobatching(memory_fraction=fraction_map(fractions) if ctx.gpu else None, **kwargs)
        callbacks.append(auto)
    cap_cb = None
    if not ctx.gpu and fractions is not None:
        limits = {i: int(f * ctx.total_bytes) for i, f in enumerate(fractions)}
        cap_cb = MemoryCapCallback(limit_bytes=limits, retry_band=args.cpu_retry_band)
        mem.cap = cap_cb.cap
        callbacks.insert(0, cap_cb)

    trainer = automicro.Trainer(
        model=model,
        parallelism_config={"fsdp2": {"mixed_precision": "DEFAULT" if ctx.gpu else "FULL"}},
        precision="amp_bf16" if ctx.gpu else "fp32",
        device=args.device,
        train_dataloader=loader,
        optimizers=optimizer,
        max_duration=f"{batches}ba",
        device_train_microbatch_size=micro,
        callbacks=callbacks,
        loggers=[metrics],
        progress_bar=False,
        log_to_console=False,
        seed=args.seed,
        dist_timeout=args.dist_timeout,
    )

    status, error_text = "ok", None
    started = time.perf_counter()
    try:
        trainer.fit()
    except MicrobatchSizeError as error:  # raised on every rank at the same attempt: safe to go on
        status, error_text = "cannot_fit", str(error)[:500]
    except BaseException as error:  # noqa: BLE001 - anything else ends this launch, loudly
        faulthandler.cancel_dump_traceback_later()
        message = f"{type(error).__name__}: {error}"
        sys.stderr.write(f"[gpu_auto] rank {ctx.rank} case {name} failed: {message}\n{traceback.format_exc()}")
        if ctx.rank == 0:
            ctx.cases.append({"name": name, "status": "error", "error": message[:2000]})
            ctx.write(in_progress=None)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(3)
    fit_s = time.perf_counter() - started

    batches_done = int(trainer.state.timestamp.batch)
    local: dict[str, Any] = {
        "rank": ctx.rank,
        "fraction": own_fraction,
        "rows": recorder.rows,
        "alloc_retries": sum(r["retries"] for r in recorder.rows),
        "unfinished_batch_failures": recorder.failed_attempt_phases() if status != "ok" else None,
    }
    if cap_cb is not None:
        local["cap_stats"] = {k: v for k, v in cap_cb.cap.stats().items() if k != "rank"}
    shared: dict[str, Any] = {}
    if ctx.rank == 0:
        shared = {
            "batches_done": batches_done,
            "stopped_early": recorder.stopped_early,
            "speed": {k: {str(i): rnd(v, 2) for i, v in d.items()} for k, d in metrics.rows.items() if k != "loss/train/total"},
            "losses": [metrics.rows["loss/train/total"].get(i) for i in range(batches_done)] if losses else None,
        }
        if auto is not None:
            shared.update(
                {
                    "history": [asdict(r) for r in auto.history],
                    "found_size": auto.found_size,
                    "final_split": list(auto.policy.current_split()) if auto.policy is not None else None,
                    "ooms_total": auto.ooms_total,
                    "thrash_events": auto.thrash.events,
                    "hooks_on_at_end": auto.hooks_active,
                    "consensus_transport": auto.transport_name,
                    "search": auto.policy_config.search,
                }
            )

    # ---- tear down: nothing of this case may stay on the device ----
    trainer.close()
    # The last outputs carry FSDP2's pre-backward hooks (-> model) and their autograd graph is
    # held from C++: a cycle the garbage collector cannot see through. Cut it.
    trainer.state.outputs = None
    trainer.state.loss = None
    trainer.state.batch = None
    # Composer's Engine registers atexit(_close, state, logger): that keeps the state (model,
    # optimizer) alive for the whole process. Every engine here is closed: drop them.
    atexit.unregister(Engine._close)
    del trainer, model, optimizer, loader, dataset, callbacks, auto, recorder, metrics, cap_cb
    gc.collect()
    if ctx.gpu:
        torch.cuda.empty_cache()
    local["model_freed"] = model_ref() is None
    local["allocated_after"] = int(torch.cuda.memory_allocated()) if ctx.gpu else 0
    local["allocated_before"] = allocated_before

    per_rank = ctx.gather(local)
    faulthandler.cancel_dump_traceback_later()
    if ctx.rank != 0:
        return {}
    case = {
        "name": name,
        "status": status,
        "note": note,
        "error": error_text,
        "micro": micro,
        "auto_kwargs": {k: v for k, v in (auto_kwargs or {}).items()},
        "fractions": [r["fraction"] for r in per_rank],
        "fit_s": round(fit_s, 3),
        "batches": batches,
        **shared,
        "ranks": [
            {
                "rank": r["rank"],
                "fraction": r["fraction"],
                "alloc_retries": r["alloc_retries"],
                "model_freed": r["model_freed"],
                "allocated_before": r["allocated_before"],
                "allocated_after": r["allocated_after"],
                "cap_stats": r.get("cap_stats"),
                "per_batch": {k: [row[k] for row in r["rows"]] for k in ("retries", "peak", "reserved_peak", "fwd_peak", "bwd_peak", "failed_phases")},
                "unfinished_batch_failures": r.get("unfinished_batch_failures"),
            }
            for r in per_rank
        ],
        "rows": per_rank[0]["rows"],
    }
    try:
        case["summary"] = summarize(ctx, case)
    except Exception as error:  # noqa: BLE001 - a bad summary must not lose the raw data
        case["summary"] = {"error": f"{type(error).__name__}: {error}"}
    ctx.cases.append(case)
    ctx.write()
    s = case["summary"]
    split = case.get("final_split")
    ctx.say(
        f"{name}: {status} {fit_s:.1f}s ba {case['batches_done']}/{batches} "
        + (f"found {case.get('found_size')} split {splitfmt(split)} " if split else f"size {micro} ")
        + f"att {s.get('attempts_total')} oom {case.get('ooms_total', '-')} ranks {s.get('failing_ranks', '-')} "
        f"thr {case.get('thrash_events', '-')} {fmt(s.get('tokens_per_s_speedmonitor'), ',.0f')} tok/s "
        f"leakfree {s.get('leak_free')} (t={ctx.elapsed():.0f}s)",
        detail=not ctx.case_lines_on_console,
    )
    return case


def splitfmt(split: Optional[list[int]]) -> str:
    if not split:
        return "-"
    return ",".join(map(str, split)) if len(split) <= 4 else f"{max(split)}x{len(split)}" + ("" if len(set(split)) == 1 else "~")


def fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


# ---- derived numbers ------------------------------------------------------------------------------------


def summarize(ctx: Ctx, case: dict[str, Any]) -> dict[str, Any]:
    args = ctx.args
    rows = case["rows"]
    history = case.get("history") or []
    out: dict[str, Any] = {
        "ended": case["status"] == "ok" and (case["batches_done"] == case["batches"] or bool(case.get("stopped_early"))),
        "attempts_total": sum(r["attempts"] for r in rows),
    }
    # OOM/thrash events: where and on whom
    out["failures"] = [
        {"batch": h["batch"], "attempt": h["attempt"], "size": h["size"], "outcome": h["outcome"],
         "ranks": h["failed_ranks"], "sites": h["sites"],
         "phases": [failed_phase(case, r, h["batch"], h["attempt"]) for r in h["failed_ranks"]]}
        for h in history
        if h["outcome"] != "ok"
    ]
    out["failing_ranks"] = sorted({r for h in history for r in h["failed_ranks"]})
    out["oom_sites"] = sorted({s for h in history if h["outcome"] == "oom" for s in h["sites"]})
    out["oom_phases"] = sorted({p for f in out["failures"] if f["outcome"] == "oom" for p in f["phases"] if p})
    # convergence: the last attempt that settled the size ("converged on" bisect, "settled on" halve)
    conv = [i for i, h in enumerate(history) if "converged on" in h["note"] or "settled on" in h["note"]]
    if conv:
        j = conv[-1]
        out["attempts_to_converge"] = j + 1
        out["ooms_to_converge"] = sum(1 for h in history[: j + 1] if h["outcome"] == "oom")
        out["converge_batch"] = history[j]["batch"]
        out["search_seconds"] = round(sum(h["seconds"] for h in history[: j + 1]), 4)
    # seconds to a stable size: history seconds until the size stops changing or hooks first come off
    if history:
        stable_from = len(history) - 1
        final = history[-1]["size"]
        for k in range(len(history) - 1, -1, -1):
            if history[k]["size"] == final and history[k]["outcome"] == "ok":
                stable_from = k
            else:
                break
        off = [i for i, h in enumerate(history) if "sync hooks off" in h["note"]]
        end = min([stable_from] + off[:1])
        out["seconds_to_stable"] = round(sum(h["seconds"] for h in history[: end + 1]), 4)
        out["stable_at_batch"] = history[end]["batch"]
    off_rows = [r for r in rows if not r["hooks_after"]] if case["micro"] == "auto" else []
    if off_rows:
        first = off_rows[0]["batch"]
        out["hooks_off_after_batch"] = first
        out["wall_to_hooks_off_s"] = round(sum(r["s"] for r in rows if r["batch"] <= first), 3)

    # steady state: single-attempt batches at the final size with the hooks off (or no automicro)
    sizes = [r["size"] for r in rows]
    final_size = sizes[-1] if sizes else None
    out["final_size"] = final_size
    auto = case["micro"] == "auto"
    steady = [r for r in rows if r["batch"] >= 1 and r["attempts"] == 1 and r["size"] == final_size and not r["hooks"]]
    steady = steady[-args.steady_window:]
    out["steady_batches"] = [r["batch"] for r in steady]
    if steady:
        step = median([r["s"] for r in steady])
        out["step_s_hooks_off"] = rnd(step, 5)
        out["tokens_per_s_own"] = rnd(ctx.tokens_per_batch / step, 1) if step else None
        out["rounds_per_batch_hooks_off"] = median([r["rounds"] for r in steady]) if auto else None
        out["finish_s_per_batch_hooks_off"] = rnd(median([r["finish_s"] for r in steady]), 6) if auto else None
        steady_set = {r["batch"] for r in steady}
        tps = case.get("speed", {}).get("throughput/tokens_per_sec", {})
        window = [
            v for k, v in tps.items()
            if all((int(k) - d) in steady_set for d in range(args.speed_window))
        ]
        out["tokens_per_s_speedmonitor"] = rnd(median(window), 1)
        out["step_s_hooks_off_speedmonitor"] = rnd(ctx.tokens_per_batch / out["tokens_per_s_speedmonitor"], 5) if window else None
        out["speedmonitor_values"] = len(window)
        mfu = case.get("speed", {}).get("throughput/device/mfu", {})
        mfu_window = [v for k, v in mfu.items() if all((int(k) - d) in steady_set for d in range(args.speed_window))]
        out["mfu"] = rnd(median(mfu_window), 4)
    # hooks on (clean single-attempt batches at the final size, not batch 0) vs off
    if auto:
        on = [r for r in rows if r["batch"] >= 1 and r["attempts"] == 1 and r["size"] == final_size and r["hooks"]]
        out["hooks_on_batches"] = [r["batch"] for r in on]
        if on:
            out["step_s_hooks_on"] = rnd(median([r["s"] for r in on]), 5)
            out["rounds_per_batch_hooks_on"] = median([r["rounds"] for r in on])
            hist_on = [h["seconds"] for h in history if h["outcome"] == "ok" and h["hooks"] and h["batch"] >= 1 and h["size"] == final_size and h["attempt"] == 1]
            out["history_s_hooks_on"] = rnd(median(hist_on), 5)
            if out.get("step_s_hooks_off"):
                out["hooks_on_overhead"] = rnd(out["step_s_hooks_on"] / out["step_s_hooks_off"] - 1.0, 4)
            if out.get("history_s_hooks_on") and out.get("step_s_hooks_off_speedmonitor"):
                # the history's attempt seconds (hooks on) vs SpeedMonitor's batch time (hooks off)
                out["hooks_on_overhead_history_vs_speedmonitor"] = rnd(
                    out["history_s_hooks_on"] / out["step_s_hooks_off_speedmonitor"] - 1.0, 4)
    out["stepped_down"] = any(h["outcome"] in ("oom", "thrash") for h in history)
    out["alloc_retries_per_rank"] = [r["alloc_retries"] for r in case["ranks"]]
    out["leak_free"] = all(r["model_freed"] for r in case["ranks"])
    return out


def failed_phase(case: dict[str, Any], rank: int, batch: int, attempt: int) -> Optional[str]:
    """The Composer phase (forward / loss / backward / ...) and microbatch where `rank` was when
    attempt `attempt` of batch `batch` failed, as its recorder saw it."""
    info = case["ranks"][rank]
    batches = [row["batch"] for row in case["rows"]]
    entries = info.get("unfinished_batch_failures") or [] if batch not in batches else info["per_batch"]["failed_phases"][batches.index(batch)]
    for number, phase, microbatch in entries:
        if number == attempt:
            return f"{phase}@mb{microbatch}"
    return None


def table(ctx: Ctx, header: list[str], rows: list[list[Any]]) -> None:
    if ctx.rank != 0:
        return
    text = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(header))]
    lines = []
    for n, row in enumerate(text):
        lines.append(" ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append(" ".join("-" * w for w in widths))
    for line in lines:
        print(f"[gpu_auto] | {line}", flush=True)
    with open(os.path.join(ctx.args.out, f"gpu_auto_{ctx.args.suite}_table.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


# ---- suite: nohang ------------------------------------------------------------------------------------


def nohang_plan(ctx: Ctx) -> list[dict[str, Any]]:
    """Case 0: probe (equal, generous); case 1: designed backward-OOM on rank 1 (filled in later);
    then equal / asymmetric / one-rank-tight in turn, seeded."""
    args = ctx.args
    lo, hi = pair(args.fraction_range)
    rng = random.Random(args.seed)
    plan: list[dict[str, Any]] = [
        {"kind": "probe-equal", "fractions": (args.probe_fraction,) * ctx.world},
        {"kind": "backward-designed", "fractions": None},
    ]
    kinds = ("equal", "asymmetric", "one-tight")
    n = 0
    while len(plan) < args.runs:
        kind = kinds[n % len(kinds)]
        if kind == "equal":
            f = round(rng.uniform(lo, hi), 3)
            fractions = (f,) * ctx.world
        elif kind == "asymmetric":
            while True:
                fractions = tuple(round(rng.uniform(lo, hi), 3) for _ in range(ctx.world))
                if max(fractions) - min(fractions) >= 0.05:
                    break
        else:
            tight = (n // len(kinds)) % ctx.world
            fractions = tuple(
                round(rng.uniform(lo, lo + 0.3 * (hi - lo)), 3) if r == tight else 0.9 for r in range(ctx.world)
            )
        plan.append({"kind": kind, "fractions": fractions})
        n += 1
    return plan[: args.runs]


def designed_backward(ctx: Ctx, probe_case: dict[str, Any]) -> dict[str, Any]:
    """From the probe's per-rank forward and backward peaks (steady batches): rank 1's limit at
    `--bwd-position` between them, rank 0 keeps the probe fraction, start at the probe's size."""
    args = ctx.args
    if probe_case is None or probe_case.get("status") != "ok":
        return {"designable": False, "why": "the probe run did not finish", "rank": ctx.world - 1, "start_size": None,
                "fractions": [args.probe_fraction] * (ctx.world - 1) + [round(args.probe_fraction / 2.5, 4)]}
    rows = probe_case["rows"]
    final = rows[-1]["size"] if rows else None
    use = [i for i, r in enumerate(rows) if r["batch"] >= 2 and r["size"] == final and r["attempts"] == 1]
    info: dict[str, Any] = {"start_size": final, "batches_used": [rows[i]["batch"] for i in use]}
    fractions = list(probe_case["fractions"])
    target = ctx.world - 1
    pr = probe_case["ranks"][target]["per_batch"]
    fwd = max((pr["fwd_peak"][i] or 0) for i in use) if use else 0
    bwd = max((pr["bwd_peak"][i] or 0) for i in use) if use else 0
    info.update({"rank": target, "fwd_peak": fwd, "bwd_peak": bwd})
    if not use or bwd <= fwd * 1.005:
        info["designable"] = False
        info["why"] = "backward peak not above the forward peak" if use else "no steady probe batches"
        fractions[target] = round(args.probe_fraction / 2.5, 4)
    else:
        cap = fwd + args.bwd_position * (bwd - fwd)
        info.update({"designable": True, "cap_bytes": int(cap)})
        fractions[target] = round(cap / ctx.total_bytes, 6)
    info["fractions"] = fractions
    return info


def suite_nohang(ctx: Ctx) -> None:
    args = ctx.args
    plan = nohang_plan(ctx)
    ctx.extra["plan"] = [{"kind": p["kind"], "fractions": p["fractions"]} for p in plan]
    probe_case: Optional[dict[str, Any]] = None
    for i, item in enumerate(plan):
        name = f"run{i:02d}-{item['kind']}"
        if not ctx.within_budget(name):
            break
        auto_kwargs: dict[str, Any] = {}
        fractions = item["fractions"]
        note = ""
        if item["kind"] == "backward-designed":
            design = ctx.decide(designed_backward(ctx, probe_case) if ctx.rank == 0 else None)
            ctx.extra["backward_design"] = design
            fractions = tuple(design["fractions"])
            if design.get("start_size"):
                auto_kwargs["start_size"] = int(design["start_size"])
            note = "designed: rank %d limit between its forward and backward peaks" % design["rank"] if design.get("designable") else "not designable"
        case = run_case(ctx, name, fractions=fractions, auto_kwargs=auto_kwargs, batches=args.nohang_batches,
                        probe=item["kind"] == "probe-equal", note=note)
        if ctx.rank == 0:
            case["kind"] = item["kind"]
            if item["kind"] == "probe-equal":
                probe_case = case
    if ctx.rank == 0:
        cases = ctx.cases
        ctx.extra["totals"] = {
            "runs": len(cases),
            "ended": sum(1 for c in cases if c["summary"].get("ended")),
            "cannot_fit": sum(1 for c in cases if c["status"] == "cannot_fit"),
            "hung": 0,  # a hang never reaches here: the watchdog ends the process, the case stays in_progress
            "ooms": sum(c.get("ooms_total") or 0 for c in cases),
            "backward_oom_runs": sum(1 for c in cases if any(p.startswith("backward") for p in c["summary"].get("oom_phases", []))),
            "one_rank_backward_oom_runs": sum(
                1 for c in cases
                if any(len(f["ranks"]) == 1 and f["outcome"] == "oom" and (f["phases"][0] or "").startswith("backward")
                       for f in c["summary"].get("failures", []))
            ),
            "one_rank_oom_runs": sum(1 for c in cases if any(len(f["ranks"]) == 1 for f in c["summary"].get("failures", []))),
        }
    ctx.write(done=True)
    rows = []
    for c in ctx.cases:
        s = c["summary"]
        rows.append([
            c["name"], ",".join(f"{f:.3f}" for f in c["fractions"]), c["status"], f"{c['batches_done']}/{c['batches']}",
            s.get("attempts_total"), c.get("ooms_total"), s.get("failing_ranks"),
            ",".join(s.get("oom_sites", [])) or "-",
            ",".join(sorted({p.split("@")[0] for p in s.get("oom_phases", [])})) or "-", s.get("seconds_to_stable"), c.get("found_size"),
            splitfmt(c.get("final_split")), c.get("thrash_events"), "no" if s.get("ended") else "?",
        ])
    table(ctx, ["run", "fractions", "status", "batches", "attempts", "OOMs", "OOM ranks", "OOM sites",
                "OOM phases", "s to stable", "found", "split", "thrash", "hung"], rows)
    if ctx.rank == 0:
        print(f"[gpu_auto] nohang totals: {ctx.extra['totals']}", flush=True)


# ---- suite: throughput ----------------------------------------------------------------------------------


def gloo_allreduce_bench(ctx: Ctx, iters: int = 200) -> dict[str, Any]:
    """Cost of the one consensus all-reduce per batch that stays once the hooks are off: the same
    int64 vector (1 + 5 * world) on a gloo group."""
    import torch
    import torch.distributed as tdist

    vec = torch.zeros(1 + 5 * ctx.world, dtype=torch.int64)
    for _ in range(10):
        tdist.all_reduce(vec, op=tdist.ReduceOp.MAX, group=ctx.ctl)
    tdist.barrier(group=ctx.ctl)
    started = time.perf_counter()
    for _ in range(iters):
        tdist.all_reduce(vec, op=tdist.ReduceOp.MAX, group=ctx.ctl)
    per = (time.perf_counter() - started) / iters
    return {"iters": iters, "seconds_per_allreduce": round(per, 7), "elements": int(vec.numel())}


def suite_throughput(ctx: Ctx) -> None:
    args = ctx.args
    fractions = pair(args.fractions)
    B = args.per_rank_batch
    N = args.batches

    bisect = run_case(ctx, "auto-bisect", fractions=fractions, batches=N)
    info = ctx.decide({"found": bisect.get("found_size"), "split": bisect.get("final_split")} if ctx.rank == 0 else None)
    found = info["found"] or B
    if ctx.within_budget("auto-halve"):
        run_case(ctx, "auto-halve", fractions=fractions, auto_kwargs={"search": "halve"}, batches=N)

    if args.sweep == "auto":
        top = min(B, found + 1)
        sizes = [found] + ([found + 1] if found + 1 <= top else []) + list(range(found - 1, 0, -1))
    else:
        sizes = [int(x) for x in args.sweep.split(",")]
    ctx.extra["sweep_sizes"] = sizes
    # Plain Composer runs once the sizes most likely to be best (found, found+1, found-1) are measured,
    # before the small sizes, so a tight budget cuts those first.
    plain_after = min(len(sizes), 3)
    best: Optional[dict[str, Any]] = None
    for i, m in enumerate(sizes):
        if ctx.within_budget(f"fixed-{m}"):
            run_case(ctx, f"fixed-{m}", fractions=fractions, batches=N, stop_on_step_down=True,
                     auto_kwargs={"search": "halve", "start_size": m, "stable_batches": args.sweep_stable},
                     note="fixed size as AutoMicrobatching(search=halve, start_size=m): an OOM steps down instead of hanging")
        if i + 1 == plain_after and not args.no_plain:
            best = ctx.decide(best_fixed(ctx) if ctx.rank == 0 else None)
            if best and ctx.within_budget(f"plain-{best['size']}"):
                # Plain Composer (automicro only shards; Composer's own batch step) at a size the sweep
                # ran without stepping down. An OOM here would end the launch: that is what automicro
                # prevents, and why this uses a size already proven under the same limits.
                run_case(ctx, f"plain-{best['size']}", fractions=fractions, micro=best["size"], batches=N,
                         note="plain Composer fixed size, automicro only shards (FSDP2 engine)")
    best = ctx.decide(best_fixed(ctx) if ctx.rank == 0 else None)

    ctx.extra["gloo_allreduce"] = gloo_allreduce_bench(ctx)
    if ctx.rank == 0:
        ctx.extra["report"] = throughput_report(ctx, best)
    ctx.write(done=True)
    rows = []
    for c in ctx.cases:
        s = c["summary"]
        rows.append([
            c["name"], c["status"], c.get("found_size", c["micro"]), splitfmt(c.get("final_split")), s.get("attempts_to_converge"),
            s.get("ooms_to_converge"), "yes" if s.get("stepped_down") else "no", fmt(s.get("tokens_per_s_speedmonitor"), ",.0f"),
            fmt(s.get("tokens_per_s_own"), ",.0f"), fmt(s.get("step_s_hooks_on"), ".4f"), fmt(s.get("step_s_hooks_off"), ".4f"),
            fmt(s.get("hooks_on_overhead"), "+.2%"), s.get("rounds_per_batch_hooks_on"), s.get("rounds_per_batch_hooks_off"),
        ])
    table(ctx, ["case", "status", "found/size", "split", "att→conv", "OOM→conv", "stepped", "tok/s SM",
                "tok/s own", "step on", "step off", "overhead", "rounds on", "rounds off"], rows)
    if ctx.rank == 0:
        print_throughput_report(ctx.extra["report"])


def print_throughput_report(rep: dict[str, Any]) -> None:
    best = rep.get("best_hand_tuned") or {}
    sweep = sorted(rep.get("sweep") or [], key=lambda r: r["size"])
    print("[gpu_auto] fixed-size sweep: " + " | ".join(
        f"{r['size']}: {fmt(r['tokens_per_s'], ',.0f')} tok/s" if r["fits"]
        else f"{r['size']}: OOM at {','.join(r['oom_sites'] or []) or '?'} -> stepped to {r['stepped_down_to']}"
        for r in sweep), flush=True)
    for key in ("auto-bisect", "auto-halve"):
        r = rep.get(key)
        if not r:
            continue
        print(
            f"[gpu_auto] {key}: found {r['found_size']} split {splitfmt(r['split'])}; {r['attempts_to_converge']} attempts / "
            f"{r['ooms_to_converge']} OOMs to converge ({fmt(r['search_seconds'], '.2f')} s in attempts, "
            f"{fmt(r['seconds_to_stable'], '.2f')} s to stable); {fmt(r['tokens_per_s'], ',.0f')} tok/s = "
            f"{fmt(r['ratio_to_best_hand_tuned'], '.4f')} x best hand-tuned (size {best.get('size')}, "
            f"{fmt(best.get('tokens_per_s'), ',.0f')} tok/s; median step times: {fmt(r.get('ratio_own_median'), '.4f')}); step hooks on {fmt(r['step_s_hooks_on'], '.4f')} s vs off "
            f"{fmt(r['step_s_hooks_off'], '.4f')} s ({fmt(r['hooks_on_overhead'], '+.2%')}; history {fmt(r['history_s_hooks_on'], '.4f')} s "
            f"vs SpeedMonitor {fmt(r['step_s_hooks_off_speedmonitor'], '.4f')} s: {fmt(r['hooks_on_overhead_history_vs_speedmonitor'], '+.2%')}); consensus all-reduces per batch "
            f"on {r['rounds_per_batch_hooks_on']} / off {r['rounds_per_batch_hooks_off']} "
            f"(off: {fmt((r['finish_s_per_batch_hooks_off'] or 0) * 1e3, '.3f')} ms in it)",
            flush=True,
        )
    print(f"[gpu_auto] target auto/best >= 0.995 met: {rep.get('target_ratio_met')}; hooks-on overhead per sweep size: "
          f"{ {k: fmt(v, '+.2%') for k, v in (rep.get('sweep_hooks_on_overhead') or {}).items()} }", flush=True)
    if rep.get("plain_composer"):
        print(f"[gpu_auto] plain Composer at {rep['plain_composer']['size']}: {fmt(rep['plain_composer']['tokens_per_s'], ',.0f')} tok/s; "
              f"auto/plain {rep.get('auto_over_plain')}; automicro hooks-off/plain at the same size "
              f"{rep.get('hooks_off_automicro_over_plain_same_size')}", flush=True)
    g = rep.get("gloo_allreduce") or {}
    print(f"[gpu_auto] one gloo all-reduce of {g.get('elements')} int64 (the consensus left per batch once hooks are off): "
          f"{fmt((g.get('seconds_per_allreduce') or 0) * 1e6, '.1f')} us", flush=True)


def best_fixed(ctx: Ctx) -> Optional[dict[str, Any]]:
    """Best hand-tuned size: the fastest sweep run that stayed at its own size (no step-down)."""
    fitting = [c for c in ctx.cases if c["name"].startswith("fixed-") and not c["summary"].get("stepped_down")
               and c["summary"].get("tokens_per_s_speedmonitor")]
    if not fitting:
        return None
    top = max(fitting, key=lambda c: c["summary"]["tokens_per_s_speedmonitor"])
    own = max((c["summary"].get("tokens_per_s_own") or 0 for c in fitting), default=0) or None
    return {"size": int(top["name"].split("-")[1]), "tokens_per_s": top["summary"]["tokens_per_s_speedmonitor"],
            "tokens_per_s_own": own}


def throughput_report(ctx: Ctx, best: Optional[dict[str, Any]]) -> dict[str, Any]:
    by = {c["name"]: c for c in ctx.cases}
    rep: dict[str, Any] = {"best_hand_tuned": best}
    for key in ("auto-bisect", "auto-halve"):
        c = by.get(key)
        if c is None:
            continue
        s = c["summary"]
        rep[key] = {
            "found_size": c.get("found_size"),
            "split": c.get("final_split"),
            "attempts_to_converge": s.get("attempts_to_converge"),
            "ooms_to_converge": s.get("ooms_to_converge"),
            "search_seconds": s.get("search_seconds"),
            "seconds_to_stable": s.get("seconds_to_stable"),
            "tokens_per_s": s.get("tokens_per_s_speedmonitor"),
            "ratio_to_best_hand_tuned": rnd(s["tokens_per_s_speedmonitor"] / best["tokens_per_s"], 4)
            if best and s.get("tokens_per_s_speedmonitor") else None,
            "tokens_per_s_own_median": s.get("tokens_per_s_own"),
            "ratio_own_median": rnd(s["tokens_per_s_own"] / best["tokens_per_s_own"], 4)
            if best and best.get("tokens_per_s_own") and s.get("tokens_per_s_own") else None,
            "step_s_hooks_on": s.get("step_s_hooks_on"),
            "step_s_hooks_off": s.get("step_s_hooks_off"),
            "hooks_on_overhead": s.get("hooks_on_overhead"),
            "history_s_hooks_on": s.get("history_s_hooks_on"),
            "step_s_hooks_off_speedmonitor": s.get("step_s_hooks_off_speedmonitor"),
            "hooks_on_overhead_history_vs_speedmonitor": s.get("hooks_on_overhead_history_vs_speedmonitor"),
            "rounds_per_batch_hooks_on": s.get("rounds_per_batch_hooks_on"),
            "rounds_per_batch_hooks_off": s.get("rounds_per_batch_hooks_off"),
            "finish_s_per_batch_hooks_off": s.get("finish_s_per_batch_hooks_off"),
        }
    if "auto-bisect" in rep:
        rep["target_ratio_met"] = (rep["auto-bisect"]["ratio_to_best_hand_tuned"] or 0) >= 0.995
    rep["sweep"] = [
        {
            "size": int(c["name"].split("-")[1]),
            "fits": not c["summary"].get("stepped_down"),
            "stepped_down_to": c["summary"].get("final_size") if c["summary"].get("stepped_down") else None,
            "oom_sites": c["summary"].get("oom_sites"),
            "oom_phases": c["summary"].get("oom_phases"),
            "tokens_per_s": c["summary"].get("tokens_per_s_speedmonitor"),
            "tokens_per_s_own": c["summary"].get("tokens_per_s_own"),
            "step_s_hooks_on": c["summary"].get("step_s_hooks_on"),
            "step_s_hooks_off": c["summary"].get("step_s_hooks_off"),
        }
        for c in ctx.cases
        if c["name"].startswith("fixed-")
    ]
    overheads = {c["name"]: c["summary"].get("hooks_on_overhead") for c in ctx.cases if c["name"].startswith("fixed-")}
    rep["sweep_hooks_on_overhead"] = overheads
    plain = [c for c in ctx.cases if c["name"].startswith("plain-")]
    if plain and best:
        p = plain[0]["summary"].get("tokens_per_s_speedmonitor")
        rep["plain_composer"] = {"size": best["size"], "tokens_per_s": p}
        auto_tps = (rep.get("auto-bisect") or {}).get("tokens_per_s")
        if p and auto_tps:
            rep["auto_over_plain"] = rnd(auto_tps / p, 4)
        fixed_same = by.get(f"fixed-{best['size']}")
        if p and fixed_same and fixed_same["summary"].get("tokens_per_s_speedmonitor"):
            rep["hooks_off_automicro_over_plain_same_size"] = rnd(fixed_same["summary"]["tokens_per_s_speedmonitor"] / p, 4)
    rep["gloo_allreduce"] = ctx.extra.get("gloo_allreduce")
    return rep


# ---- suite: thrash ------------------------------------------------------------------------------------


def thrash_size(ctx: Ctx) -> tuple[int, str]:
    args = ctx.args
    if args.thrash_size:
        return args.thrash_size, "--thrash-size"
    path = os.path.join(args.out, "gpu_auto_throughput.json")
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
        for c in doc.get("cases", []):
            if c["name"] == "auto-bisect" and c.get("final_split"):
                return int(max(c["final_split"])), f"auto-bisect split in {path}"
    except (OSError, ValueError, KeyError):
        pass
    return min(4, args.per_rank_batch), "default 4"


def suite_thrash(ctx: Ctx) -> None:
    args = ctx.args
    size, source = ctx.decide(thrash_size(ctx) if ctx.rank == 0 else None)
    ctx.extra["thrash_size"] = {"size": size, "source": source}
    if ctx.gpu:
        ctx.extra["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    probe = run_case(
        ctx, f"probe-{size}", fractions=(args.thrash_probe_fraction,) * ctx.world, batches=6,
        auto_kwargs={"search": "halve", "start_size": size}, note="peak memory at this size with room to spare",
    )
    peaks = None
    if ctx.rank == 0:
        rows = probe["rows"]
        use = [i for i, r in enumerate(rows) if r["batch"] >= 2 and r["size"] == size]
        peaks = [
            {"peak": max(r["per_batch"]["peak"][i] for i in use), "reserved_peak": max(r["per_batch"]["reserved_peak"][i] for i in use)}
            if use else None
            for r in probe["ranks"]
        ]
    peaks = ctx.decide(peaks)
    ctx.extra["probe_peaks"] = peaks
    results = []
    if not peaks or any(p is None for p in peaks):
        ctx.say("thrash: the probe did not run at the size; nothing to measure")
    else:
        for margin in [float(x) for x in args.thrash_margins.split(",")]:
            name = f"thrash-{size}-margin{margin:g}"
            if not ctx.within_budget(name):
                break
            fractions = tuple(min(1.0, round(p["peak"] * (1 + margin) / ctx.total_bytes, 6)) for p in peaks)
            case = run_case(
                ctx, name, fractions=fractions, batches=args.thrash_batches,
                auto_kwargs={"search": args.thrash_search, "start_size": size, "thrash_batches": 2},
                note=f"limit = steady peak x {1 + margin:g}",
            )
            fired = ctx.decide(bool(case.get("thrash_events")) if ctx.rank == 0 else None)
            if ctx.rank == 0:
                results.append(thrash_report(ctx, case, size, margin))
            if fired:
                break
    if ctx.rank == 0:
        ctx.extra["report"] = {
            "size": size,
            "probe_peaks": peaks,
            "candidates": results,
            "provoked": any(r["thrash_events"] for r in results),
            "retries_without_oom_seen": any(r["clean_batches_with_retries"] for r in results),
        }
    ctx.write(done=True)
    rows = [[r["name"], r["margin"], r["fractions"], r["clean_batches_with_retries"], r["ooms"], r["thrash_events"],
             r["size_before"], r["size_after"], fmt(r["tokens_per_s_before"], ",.0f"), fmt(r["tokens_per_s_after"], ",.0f")]
            for r in results]
    table(ctx, ["case", "margin", "fractions", "batches w/ retries", "OOMs", "thrash", "size before", "size after",
                "tok/s before", "tok/s after"], rows)
    if ctx.rank == 0:
        rep = ctx.extra["report"]
        print(f"[gpu_auto] thrash provoked: {rep['provoked']}; retries without OOM seen: {rep['retries_without_oom_seen']}", flush=True)


def thrash_report(ctx: Ctx, case: dict[str, Any], size: int, margin: float) -> dict[str, Any]:
    rows = case["rows"]
    history = case.get("history") or []
    # retries per batch, any rank
    retries_any = [max(r["per_batch"]["retries"][i] for r in case["ranks"]) for i in range(len(rows))]
    clean_with_retries = [rows[i]["batch"] for i in range(len(rows)) if retries_any[i] > 0 and rows[i]["attempts"] == 1]
    thrash_at = [h["batch"] for h in history if h["outcome"] == "thrash"]
    first = thrash_at[0] if thrash_at else None
    before = [r for r in rows if r["batch"] >= 1 and r["attempts"] == 1 and r["size"] == size and (first is None or r["batch"] <= first)]
    final = rows[-1]["size"] if rows else None
    after = [r for r in rows if first is not None and r["batch"] > thrash_at[-1] and r["attempts"] == 1 and r["size"] == final]
    step_before = median([r["s"] for r in before])
    step_after = median([r["s"] for r in after[-ctx.args.steady_window:]])
    return {
        "name": case["name"],
        "margin": margin,
        "fractions": case["fractions"],
        "status": case["status"],
        "retries_per_batch_any_rank": retries_any,
        "clean_batches_with_retries": clean_with_retries,
        "ooms": case.get("ooms_total"),
        "thrash_events": case.get("thrash_events"),
        "thrash_batches": thrash_at,
        "thrash_records": [h for h in history if h["outcome"] == "thrash"],
        "size_before": size,
        "size_after": final if first is not None else None,
        "final_split": case.get("final_split"),
        "tokens_per_s_before": rnd(ctx.tokens_per_batch / step_before, 1) if step_before else None,
        "tokens_per_s_after": rnd(ctx.tokens_per_batch / step_after, 1) if step_after else None,
        "batches_before": [r["batch"] for r in before],
        "batches_after": [r["batch"] for r in after],
    }


# ---- suite: parity --------------------------------------------------------------------------------------


def suite_parity(ctx: Ctx) -> None:
    args = ctx.args
    fractions = pair(args.fractions)
    steps = args.parity_steps
    if args.parity_control:
        # Same run twice: how far two identical bf16 GPU runs drift apart (non-deterministic kernels).
        auto = run_case(ctx, f"control-fixed-{args.parity_control}", fractions=fractions, micro=args.parity_control,
                        batches=steps, text=True, losses=True, note="control: first of two identical runs")
        size = args.parity_control
    else:
        auto = run_case(ctx, "parity-auto", fractions=fractions, batches=steps, text=True, losses=True)
        split = ctx.decide(auto.get("final_split") if ctx.rank == 0 else None)
        size = int(max(split)) if split else args.per_rank_batch
    fixed = None
    if ctx.within_budget(f"parity-fixed-{size}"):
        fixed = run_case(ctx, f"parity-fixed-{size}", fractions=fractions, micro=size, batches=steps, text=True, losses=True,
                         note="plain Composer at the size auto settled on")
    if ctx.rank == 0:
        a = auto.get("losses") or []
        f = (fixed or {}).get("losses") or []
        diffs = [abs(x - y) for x, y in zip(a, f) if x is not None and y is not None]
        tail = 20
        ctx.extra["report"] = {
            "size": size,
            "losses": {"auto": a, "fixed": f},
            "max_abs_diff": rnd(max(diffs), 6) if diffs else None,
            "max_abs_diff_first_10": rnd(max(diffs[:10]), 6) if diffs else None,
            "mean_last20": {"auto": rnd(statistics.fmean([x for x in a[-tail:] if x is not None]), 5) if a else None,
                            "fixed": rnd(statistics.fmean([x for x in f[-tail:] if x is not None]), 5) if f else None},
            "first_loss": {"auto": a[0] if a else None, "fixed": f[0] if f else None},
        }
        print(f"[gpu_auto] parity: { {k: v for k, v in ctx.extra['report'].items() if k != 'losses'} }", flush=True)
    ctx.write(done=True)


def suite_hooks(ctx: Ctx) -> None:
    args = ctx.args
    fractions = pair(args.fractions)
    rows = []
    for sync_points in ("collectives", "all"):
        for transport in ("shm", "process_group"):
            name = f"hooks-{sync_points}-{transport}"
            if not ctx.within_budget(name):
                continue
            case = run_case(ctx, name, fractions=fractions, batches=args.batches,
                            auto_kwargs={"search": "halve", "start_size": args.hooks_size,
                                         "stable_batches": args.sweep_stable, "sync_points": sync_points,
                                         "consensus_transport": transport},
                            note="hooks on for the first batches, then off, same size")
            if ctx.rank == 0:
                s = case["summary"]
                rows.append([name, case["status"], s.get("final_size"), fmt(s.get("step_s_hooks_on"), ".4f"),
                             fmt(s.get("step_s_hooks_off"), ".4f"), fmt(s.get("hooks_on_overhead"), "+.2%"),
                             s.get("rounds_per_batch_hooks_on"), "yes" if s.get("stepped_down") else "no"])
    ctx.write(done=True)
    table(ctx, ["case", "status", "size", "step on", "step off", "overhead", "rounds on", "stepped"], rows)


# ---- main -----------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from automicro.engine import ensure_record_stream_free

    ensure_record_stream_free()  # before any process group exists
    import torch
    from composer.devices import DeviceCPU, DeviceGPU
    from composer.utils import dist as cdist

    if args.device == "gpu" and not torch.cuda.is_available():
        print("gpu_auto: --device gpu but CUDA is not available (use --device cpu --tiny)", file=sys.stderr)
        return 2
    device = DeviceGPU() if args.device == "gpu" else DeviceCPU()
    cdist.initialize_dist(device, timeout=args.dist_timeout)
    ctx = Ctx(args)
    ctx.say(f"suite {args.suite}: {ctx.world} ranks on {ctx.device_name}, model {args.model}, seq {args.seq_len}, "
            f"per-rank batch {args.per_rank_batch}; torch {torch.__version__}")
    ctx.write()
    {"nohang": suite_nohang, "throughput": suite_throughput, "thrash": suite_thrash, "parity": suite_parity,
     "hooks": suite_hooks}[args.suite](ctx)
    ctx.say(f"suite {args.suite} finished in {ctx.elapsed():.1f} s -> {ctx.out_path}")
    import torch.distributed as tdist

    tdist.barrier(group=ctx.ctl)
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
