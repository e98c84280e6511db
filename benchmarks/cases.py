"""One trainer case and one interleaved comparison of trainers: what the suites build on.

Owns: the flags every suite shares (`common_parser`), the suite context `Ctx` (a
`harness.Session` plus the model and batch settings, the case list and the JSON layout),
`build_trainer` / `release_trainer` (an `automicro.Trainer` on every rank, and its teardown so
that nothing of a case stays on the device), `run_case` (build, fit, record, summarize),
`interleaved` (several trainers built once, timed windows alternated A B A B … through
`harness.interleave`), and `main` (the launch every suite file's CLI calls). Memory limits: on
GPU `torch.cuda.set_per_process_memory_fraction`; on CPU `automicro.testing.MemoryCapCallback` with
`fraction * --cpu-total-mb` bytes. It reads automicro only through public names (`automicro.Trainer.release()`
frees a closed trainer, which Composer would keep alive until exit).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import time
import traceback
import weakref
from dataclasses import asdict
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
from harness import Session, fmt, median  # noqa: E402


# ---- flags every suite shares ------------------------------------------------------------------------


def interleaved_args(p: Any) -> None:
    """The flags of an interleaved comparison (`interleaved()`), shared by the suites that run one."""
    p.add_argument("--rounds", type=int, default=3, help="timed windows per variant, interleaved A B A B")
    p.add_argument("--window", type=int, default=3, help="batches per timed window")
    p.add_argument("--warmup-windows", type=int, default=1)
    p.add_argument("--no-counterbalance", action="store_true",
                   help="one build order only (default: the pair again with the order reversed, rounds pooled)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled window (GPU busy fraction)")


def common_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="output folder (rank 0 writes <suite>.json and <suite>_table.txt)")
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
    p.add_argument("--fractions", default="0.22,0.32", help="per-rank memory fractions r0,r1[,...]; 'none' for no limit")
    p.add_argument("--quiet", action="store_true", help="no [automicro] attempt lines")
    p.add_argument("--cpu-total-mb", type=float, default=60.0,
                   help="CPU only: the emulated device size; a fraction f limits a rank to f * this")
    p.add_argument("--cpu-retry-band", type=float, default=0.03,
                   help="CPU only: MemoryCap retry band (allocations this close to the limit count as retries)")
    return p


def finish_args(p: argparse.ArgumentParser, argv: Optional[list[str]]) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny (a 1B model on CPU is not a check, it is a wait)")
    args.model = args.model or ("tiny" if args.tiny else "1b")
    args.seq_len = args.seq_len or (128 if args.tiny else 2048)
    args.lr = args.lr or (3e-3 if args.tiny else 3e-4)
    return args


# ---- small helpers -----------------------------------------------------------------------------------


def rnd(value: Any, digits: int = 4) -> Any:
    return None if value is None else round(float(value), digits)


def fractions_arg(text: str) -> Optional[tuple[float, ...]]:
    """"0.22,0.32" -> (0.22, 0.32); "none" -> None (no memory limit)."""
    if text.strip().lower() == "none":
        return None
    return tuple(float(x) for x in text.split(","))


def fraction_map(fractions: Optional[tuple[float, ...]]) -> Optional[dict[int, float]]:
    return None if fractions is None else {i: float(f) for i, f in enumerate(fractions)}


class Ctx(Session):
    """One suite launch: the session plus model / batch settings, the cases and the JSON layout."""

    def __init__(self, suite: str, args: argparse.Namespace) -> None:
        import torch

        super().__init__(suite, args.out, gpu=args.device == "gpu", prefix="bench")
        self.suite = suite
        self.args = args
        if self.gpu:
            self.total_bytes = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
            self.device_name = torch.cuda.get_device_name()
        else:
            self.total_bytes = int(args.cpu_total_mb * 2**20)
            self.device_name = "cpu (emulated %.0f MB per rank)" % args.cpu_total_mb
        self.global_batch = args.per_rank_batch * self.world
        self.tokens_per_batch = self.global_batch * args.seq_len
        self.cases: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.case_lines_on_console = suite != "nohang"  # nohang's table repeats them

    def within_budget(self, name: str) -> bool:
        go = self.decide(self.elapsed() < self.args.budget_s)
        if not go:
            self.say(f"skip {name}: suite budget {self.args.budget_s:.0f} s used ({self.elapsed():.0f} s)")
            self.extra.setdefault("skipped_for_budget", []).append(name)
        return go

    def write(self, in_progress: Optional[str] = None, done: bool = False) -> None:
        if self.rank != 0:
            return
        import composer
        import torch

        self.write_json({
            "suite": self.suite,
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
        })


# ---- one trainer ---------------------------------------------------------------------------------------


def build_trainer(ctx: Ctx, *, fractions: Optional[tuple[float, ...]], micro: Any, auto_kwargs: Optional[dict[str, Any]],
                  batches: int, text: bool = False, callbacks: Optional[list[Any]] = None,
                  loggers: Optional[list[Any]] = None, dataset_batches: Optional[int] = None) -> dict[str, Any]:
    """An `automicro.Trainer` on every rank. `micro="auto"` adds `AutoMicrobatching(**auto_kwargs)`;
    an int is plain Composer at that size (automicro only shards). `dataset_batches`: batches per
    epoch (default `batches`). Returns the trainer and what the caller needs to read or free."""
    import torch
    from composer.utils import reproducibility

    import automicro
    from automicro.data import ByteTextCorpus, SyntheticTokens, build_dataloader
    from automicro.testing import MemoryCapCallback
    from automicro.composer.callback import AutoMicrobatching
    from automicro.models import build_model
    from recorders import Mem

    args = ctx.args
    gc.collect()
    own_fraction = None if fractions is None else float(fractions[ctx.rank])
    if ctx.gpu:
        torch.cuda.empty_cache()
        # Persists in the process: set on every case, 1.0 when this case has no limit.
        torch.cuda.set_per_process_memory_fraction(own_fraction if own_fraction is not None else 1.0)
        torch.cuda.reset_peak_memory_stats()
    reproducibility.seed_all(args.seed)
    model = build_model(args.model, init_device="meta", max_seq_len=args.seq_len)
    vocab = model.model.config.vocab_size
    if text:
        dataset = ByteTextCorpus(None, seq_len=args.seq_len)
    else:
        dataset = SyntheticTokens(ctx.global_batch * (dataset_batches or batches), args.seq_len, vocab, seed=args.seed)
    loader = build_dataloader(dataset, args.per_rank_batch, shuffle=text, seed=args.seed, drop_last=True)
    from composer.optim import DecoupledAdamW

    optimizer = DecoupledAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    mem = Mem(ctx.gpu)
    callbacks = list(callbacks or [])
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
        loggers=list(loggers or []),
        progress_bar=False,
        log_to_console=False,
        seed=args.seed,
        dist_timeout=args.dist_timeout,
    )
    return {"trainer": trainer, "auto": auto, "mem": mem, "cap_cb": cap_cb, "model_ref": weakref.ref(model),
            "own_fraction": own_fraction}


def release_trainer(trainer: Any, gpu: bool) -> None:
    """Close a trainer so that nothing of it stays alive (or on the device) in this process."""
    import torch

    trainer.release()  # close(), and Composer's exit-time reference to the state dropped
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()


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

    from automicro.composer.callback import MicrobatchSizeError
    from recorders import MetricsLog, Recorder

    args = ctx.args
    ctx.write(in_progress=name)
    ctx.say(f"case {name}: fractions {fractions} microbatch {micro} {auto_kwargs or ''} {note}".rstrip(), detail=True)
    # Per-case hang watchdog (build, fit, teardown, gather): dump every thread's stack and end the
    # process; the launcher then stops the other rank and the JSON keeps this case as in_progress.
    faulthandler.dump_traceback_later(args.case_timeout, exit=True)
    allocated_before = int(torch.cuda.memory_allocated()) if ctx.gpu else 0
    recorder = Recorder(None, probe=probe)
    recorder.stop_on_step_down = stop_on_step_down
    metrics = MetricsLog(recorder)
    built = build_trainer(ctx, fractions=fractions, micro=micro, auto_kwargs=auto_kwargs, batches=batches, text=text,
                          callbacks=[recorder, SpeedMonitor(window_size=args.speed_window)], loggers=[metrics])
    trainer, auto, cap_cb = built["trainer"], built["auto"], built["cap_cb"]
    recorder.mem = built["mem"]

    status, error_text = "ok", None
    started = time.perf_counter()
    try:
        trainer.fit()
    except MicrobatchSizeError as error:  # raised on every rank at the same attempt: safe to go on
        status, error_text = "cannot_fit", str(error)[:500]
    except BaseException as error:  # noqa: BLE001 - anything else ends this launch, loudly
        faulthandler.cancel_dump_traceback_later()
        message = f"{type(error).__name__}: {error}"
        sys.stderr.write(f"[bench] rank {ctx.rank} case {name} failed: {message}\n{traceback.format_exc()}")
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
        "fraction": built["own_fraction"],
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
    model_ref = built["model_ref"]
    del auto, cap_cb, built, recorder, metrics
    release_trainer(trainer, ctx.gpu)
    del trainer
    gc.collect()
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


def splitfmt(split: Optional[list[int]]) -> str:
    if not split:
        return "-"
    return ",".join(map(str, split)) if len(split) <= 4 else f"{max(split)}x{len(split)}" + ("" if len(set(split)) == 1 else "~")


# ---- interleaved comparison of trainers ---------------------------------------------------------------


def interleaved(ctx: Ctx, label: str, variants: dict[str, dict[str, Any]], *, rounds: int, window: int,
                warmup_windows: int = 1, profile: bool = True, fractions: Optional[tuple[float, ...]] = None,
                counterbalance: bool = True) -> dict[str, Any]:
    """Builds every variant's trainer once (`variants[name]` = `micro` and `auto_kwargs` of
    `build_trainer`), runs `warmup_windows` untimed windows of each, then `rounds` rounds of one
    timed window of `window` batches per variant, A B A B … (`harness.interleave`); on GPU one
    more, profiled window per variant for the GPU busy fraction. The first variant is the base
    of the ratios. One epoch is one window, so every `fit(duration=window)` starts an epoch
    (no dataloader skipping). Per round the slowest rank's window counts.

    `counterbalance` (default): everything again with the build and window order reversed
    (B A B A, B built first), and the rounds of both orders pooled. Two trainers in one process
    are not equal: on an H200 (2026-11-23) the one built second ran ~3% faster whichever it was,
    and one order alone "claimed" an effect that the reversed order turned around; pooled, such a
    bias shows as spread instead. Returns the report (`harness.report` plus per-window facts),
    also stored in `ctx.extra["comparisons"][label]`."""
    names = list(variants)
    orders = [names, names[::-1]] if counterbalance and len(names) > 1 else [names]
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    windows: list[dict[str, Any]] = []
    profiles: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    freed = []
    for k, order in enumerate(orders):
        got = _interleaved_once(ctx, f"{label} order {k}", {n: variants[n] for n in order}, rounds=rounds,
                                window=window, warmup_windows=warmup_windows, profile=profile, fractions=fractions)
        for n in names:
            samples[n] += [dict(s, order=k) for s in got["samples"][n]]
            profiles[n] += got["profiles"][n]
        windows += [dict(w, order=k) for w in got["windows"]]
        freed.append(got["models_freed"])
    rep = harness.report(samples, base=names[0])
    for name in names:
        entry = rep["variants"][name]
        entry["hooks_on_in_timed_windows"] = sorted({h for s in samples[name] for h in (s.get("hooks_on") or [])})
        entry["rounds_per_batch"] = median([s.get("rounds_per_batch") for s in samples[name]])
        entry["transport"] = samples[name][0].get("transport") if samples[name] else None
        entry["ooms_in_timed_windows"] = sum(s.get("ooms") or 0 for s in samples[name])
        entry["tokens_per_s"] = ctx.tokens_per_batch / entry["median"] if entry["median"] else None
        if profiles[name]:
            per_order = [harness.busy_vs_timed(p.get("gpu_busy_s"), window, entry["median"]) for p in profiles[name]]
            entry["gpu_busy"] = min((b for b in per_order if b is not None), default=None)
            entry["host_bound"] = harness.host_bound(entry["gpu_busy"])
            entry["profile_rank0"] = profiles[name][0]
            entry["profiles_rank0"] = profiles[name]
    if len(orders) > 1:
        # each order alone: a bias of the order shows as the two disagreeing
        rep["per_order"] = [harness.report({n: [s for s in samples[n] if s["order"] == k] for n in names}, base=names[0])["vs_base"]
                            for k in range(len(orders))]
    rep.update(label=label, rounds=rounds, window=window, warmup_windows=warmup_windows, orders=orders,
               variants_spec=variants, windows=windows, models_freed=all(freed))
    ctx.extra.setdefault("comparisons", {})[label] = rep
    ctx.write()
    return rep


def _interleaved_once(ctx: Ctx, label: str, variants: dict[str, dict[str, Any]], *, rounds: int, window: int,
                      warmup_windows: int, profile: bool, fractions: Optional[tuple[float, ...]]) -> dict[str, Any]:
    """One build order: build in `variants` order, warm up, interleave, profile, free."""
    import torch

    from recorders import WindowClock

    faulthandler.dump_traceback_later(ctx.args.case_timeout, exit=True)

    def build(spec: dict[str, Any]) -> dict[str, Any]:  # a function: no loop variable outlives the teardown
        clock = WindowClock(ctx.gpu)
        b = build_trainer(ctx, fractions=fractions, micro=spec.get("micro", "auto"), auto_kwargs=spec.get("auto_kwargs"),
                          batches=window, callbacks=[clock], dataset_batches=window)
        b["clock"] = clock
        return b

    built: dict[str, dict[str, Any]] = {name: build(spec) for name, spec in variants.items()}
    faulthandler.cancel_dump_traceback_later()
    windows: list[dict[str, Any]] = []

    def run_window(name: str, kind: str, round_index: int) -> dict[str, Any]:
        b = built[name]
        trainer, auto, clock = b["trainer"], b["auto"], b["clock"]
        rounds0 = auto.consensus_rounds if auto is not None else 0
        ooms0 = auto.ooms_total if auto is not None else 0
        faulthandler.dump_traceback_later(ctx.args.case_timeout, exit=True)
        clock.arm(window)
        trainer.fit(duration=f"{window}ba")
        faulthandler.cancel_dump_traceback_later()
        mine = dict(clock.result or {"step_s": None, "wall_s": None})
        if auto is not None:
            mine.update(transport=auto.transport_name, split=list(auto.used_split),
                        rounds_per_batch=(auto.consensus_rounds - rounds0) / window, ooms=auto.ooms_total - ooms0)
        per_rank = ctx.gather(mine)
        slowest = max(per_rank, key=lambda r: r["step_s"] or 0.0)
        sample = {k: slowest.get(k) for k in ("step_s", "wall_s", "cpu_per_wall", "hooks_on", "split", "transport",
                                               "rounds_per_batch", "ooms")}
        sample["step_s_per_rank"] = [r["step_s"] for r in per_rank]
        windows.append({"variant": name, "kind": kind, "round": round_index, **sample,
                        "host_batch_s": mine.get("host_batch_s")})
        return sample

    for w in range(warmup_windows):
        for name in variants:
            run_window(name, "warmup", w)

    def announce(round_index: int, name: str, sample: dict[str, Any]) -> None:
        ctx.say(f"{label} round {round_index} {name}: {fmt(sample['step_s'] and sample['step_s'] * 1e3, '.1f')} ms/step "
                f"cpu/wall {fmt(sample.get('cpu_per_wall'), '.2f')} hooks {sample.get('hooks_on')} "
                f"rounds/batch {fmt(sample.get('rounds_per_batch'), '.0f')}", detail=True)

    samples = harness.interleave({n: (lambda r, n=n: run_window(n, "timed", r)) for n in variants}, rounds,
                                 on_sample=announce)
    profiles: dict[str, list[dict[str, Any]]] = {n: [] for n in variants}
    if profile and ctx.gpu:
        for name in variants:
            try:
                prof = harness.profiled_gpu_busy(lambda n=name: run_window(n, "profiled", -1)["wall_s"])
            except Exception as error:  # noqa: BLE001 - the timing stands without it
                prof = {"error": f"{type(error).__name__}: {error}"[:300]}
            # the least busy rank's GPU time counts
            busy_s = [b for b in ctx.gather(prof.get("gpu_busy_s")) if b is not None]
            prof["gpu_busy_s_rank0"] = prof.get("gpu_busy_s")
            prof["gpu_busy_s"] = min(busy_s) if busy_s else None
            profiles[name].append(prof)
    # teardown: every trainer of this order
    refs = [b["model_ref"] for b in built.values()]
    trainers = [b.pop("trainer") for b in built.values()]
    built.clear()  # the callbacks (AutoMicrobatching holds the sharded model) go with it
    while trainers:
        release_trainer(trainers.pop(), ctx.gpu)
    gc.collect()
    if ctx.gpu:
        torch.cuda.empty_cache()
    return {"samples": samples, "windows": windows, "profiles": profiles, "models_freed": all(r() is None for r in refs)}


# ---- the launch every suite file's CLI calls -----------------------------------------------------------


def main(suite: str, args: argparse.Namespace, body: Callable[[Ctx], None]) -> int:
    os.makedirs(args.out, exist_ok=True)
    harness.single_rank_env()
    from automicro.engine import ensure_record_stream_free

    ensure_record_stream_free()  # before any process group exists
    import torch
    from composer.devices import DeviceCPU, DeviceGPU
    from composer.utils import dist as cdist

    if args.device == "gpu" and not torch.cuda.is_available():
        print(f"{suite}: --device gpu but CUDA is not available (use --device cpu --tiny)", file=sys.stderr)
        return 2
    device = DeviceGPU() if args.device == "gpu" else DeviceCPU()
    cdist.initialize_dist(device, timeout=args.dist_timeout)
    ctx = Ctx(suite, args)
    ctx.say(f"suite {suite}: {ctx.world} ranks on {ctx.device_name}, model {args.model}, seq {args.seq_len}, "
            f"per-rank batch {args.per_rank_batch}; torch {torch.__version__}")
    ctx.write()
    body(ctx)
    ctx.say(f"suite {suite} finished in {ctx.elapsed():.1f} s -> {ctx.json_path}")
    ctx.close()
    return 0
