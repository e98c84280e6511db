"""Steady-phase OOMs on real hardware: no hang, one batch retry, and what the ledger costs.

Two suites, one launch (every rank runs this file):

    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/steady_oom.py --out OUT --suite oom
    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/steady_oom.py --out OUT --suite overhead

- `oom`: Llama (default 1b, seq 2048), `device_train_microbatch_size: auto`; the search settles and
  the sync hooks come off; in batch `--fault-batch` the chosen ranks run out of CUDA memory in
  the first attempt, and not in the retry: a real CUDA OOM from the caching allocator after the
  hooks are off. Forward: a memory limit (`torch.cuda.set_per_process_memory_fraction`) halfway
  between the memory at the batch start and the forward's peak (measured in the previous batch),
  lifted for the retry. Backward: a gradient hook on the loss asks the allocator for more than
  the device has left (a memory limit cannot single out the backward: the caching allocator's
  reserved memory already reaches the limit in the forward). Per run: finished or
  not, where it ran out (the last Composer event before the OOM on that rank), the retry, the
  seconds the failure cost (the fault batch's time minus the median steady batch), replayed
  collectives. A per-run hang watchdog ends the launch with every stack.
- `stray`: no model. Rank 0 issues, between two recorded collectives, an all-reduce of its own
  (outside the ledger, as a model's own code would) and goes on (NCCL: its host does not block);
  rank 1 stops after the first and catches up. It must stop with `FatalRecoveryError` naming the
  collective outside the ledger instead of replaying one that would pair with it, and rank 0's
  watcher must end rank 0 (exit 3). The launch is expected to fail; the log shows both lines.
- `overhead`: what the collective ledger costs when nothing fails. One steady run; from batch
  `--overhead-warmup` on, the ledger is taken off FSDP2's collectives on every other batch
  (`AutoMicrobatching.observe_collectives`), in pairs whose order alternates (on off, off on, ...),
  so host drift cancels inside each pair. Per pair: tokens/s on / off (= off time / on time);
  the median over pairs with its distribution-free 95% interval (`harness.median_interval`).
  The ledger's watcher thread and its per-attempt bookkeeping run in both halves of a pair (they
  are built with the callback); their cost is bounded separately (`benchmarks/ledger_cost.py`,
  one wake-up per 0.2 s). Separate runs per variant were tried first (2026-11-23): the
  run-to-run spread of a shared host (up to 13.7%) and a Trainer that stays alive after `close()`
  (memory grows run by run) buried the effect.

`--device cpu --tiny` runs both on CPU/gloo (the OOM is raised by a callback at the same event,
no memory limit): the logic check, not a measurement. Rank 0 writes steady_oom_<suite>.json.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", required=True, choices=("oom", "overhead", "stray"))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny Llama, seq 64 (the CPU check)")
    p.add_argument("--per-rank-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=9)
    p.add_argument("--fault-batch", type=int, default=6)
    p.add_argument("--runs", default="1:forward,1:backward,0:forward,0:backward,both:forward,both:backward",
                   help="oom: comma list of ranks:phase (ranks 0, 1 or both), each run --repeat times")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--overhead-batches", type=int, default=88, help="overhead: batches in the run")
    p.add_argument("--overhead-warmup", type=int, default=8, help="overhead: batches before the first pair")
    p.add_argument("--case-timeout", type=float, default=240.0)
    return p.parse_args()


class Clock:
    """Per-batch wall time (device-synchronized at the batch end) and the memory of the batch."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.batch_s: dict[int, float] = {}
        self.base: dict[int, int] = {}
        self.forward_peak: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self._started = 0.0

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()


def make_callbacks(args: argparse.Namespace, clock: Clock, fault_ranks: list[int], phase: str):
    from composer.core import Callback

    rank = dist.get_rank()

    class Timing(Callback):
        sites: Any = None

        def attach_sites(self, sites) -> None:  # automicro.Trainer hands over its attempt context
            Timing.sites = sites

        def batch_start(self, state, logger) -> None:
            clock.sync()
            clock._started = time.perf_counter()

        def before_train_batch(self, state, logger) -> None:
            if clock.gpu and Timing.sites.context.attempt == 1:
                torch.cuda.reset_peak_memory_stats()
                clock.base[int(state.timestamp.batch)] = torch.cuda.memory_allocated()

        def after_forward(self, state, logger) -> None:
            if clock.gpu:
                batch = int(state.timestamp.batch)
                clock.forward_peak[batch] = max(clock.forward_peak.get(batch, 0), torch.cuda.max_memory_allocated())

        def batch_end(self, state, logger) -> None:
            clock.sync()
            batch = int(state.timestamp.batch) - 1
            clock.batch_s[batch] = time.perf_counter() - clock._started
            if clock.gpu:
                clock.peak[batch] = torch.cuda.max_memory_allocated()

    class Provoke(Callback):
        """A real CUDA OOM in attempt 1 of the fault batch on `fault_ranks` (CPU: a raised one)."""

        def __init__(self) -> None:
            self.last_event = ""
            self.limit_bytes = 0
            self.fired_at = ""
            self._armed = False

        def _in_fault(self, state) -> bool:
            return int(state.timestamp.batch) == args.fault_batch and rank in fault_ranks

        def before_train_batch(self, state, logger) -> None:
            if not self._in_fault(state):
                return
            context = Timing.sites.context
            if context.attempt == 1:
                self._armed = True
                if clock.gpu and phase == "forward":
                    prev = args.fault_batch - 1
                    base, fwd = clock.base[prev], clock.forward_peak[prev]
                    limit = base + (fwd - base) // 2
                    total = torch.cuda.get_device_properties(0).total_memory
                    torch.cuda.empty_cache()
                    torch.cuda.set_per_process_memory_fraction(limit / total)
                    self.limit_bytes = limit
            elif self._armed:
                self._armed = False
                if clock.gpu:
                    torch.cuda.set_per_process_memory_fraction(1.0)

        def before_forward(self, state, logger) -> None:
            self.last_event = "forward" if self._armed else self.last_event

        def after_forward(self, state, logger) -> None:
            if self._armed and not clock.gpu and phase == "forward":
                self.fired_at = "forward"
                raise torch.OutOfMemoryError("CUDA out of memory (steady_oom CPU check)")

        def before_backward(self, state, logger) -> None:
            self.last_event = "backward" if self._armed else self.last_event
            if self._armed and phase == "backward":
                def hook(grad):
                    self.fired_at = "backward"
                    if not clock.gpu:
                        raise torch.OutOfMemoryError("CUDA out of memory (steady_oom CPU check)")
                    # More than the device holds: the caching allocator frees its cache, retries
                    # and raises torch.OutOfMemoryError (free memory alone is not enough: the
                    # allocator's cached blocks would satisfy a request of free + a little).
                    total = torch.cuda.get_device_properties(grad.device).total_memory
                    torch.empty(total + 2**30, dtype=torch.uint8, device=grad.device)

                state.loss.register_hook(hook) if torch.is_tensor(state.loss) else None

        def fit_end(self, state, logger) -> None:
            if clock.gpu:
                torch.cuda.set_per_process_memory_fraction(1.0)

    return Timing(), Provoke()


def build_trainer(args: argparse.Namespace, callbacks: list[Any], steady_recovery: bool, batches: int):
    from composer.callbacks import SpeedMonitor
    from composer.optim import DecoupledAdamW
    from composer.utils import reproducibility

    import automicro
    from automicro.data import SyntheticTokens, build_dataloader
    from automicro.composer.callback import AutoMicrobatching
    from automicro.models import build_model

    gpu = args.device == "gpu"
    seq = 64 if args.tiny else 2048
    reproducibility.seed_all(17)
    model = build_model("tiny" if args.tiny else "1b", init_device="meta", max_seq_len=seq)
    world = dist.get_world_size()
    dataset = SyntheticTokens(args.per_rank_batch * world * batches, seq, model.model.config.vocab_size, seed=17)
    loader = build_dataloader(dataset, args.per_rank_batch, shuffle=False, drop_last=True)
    auto = AutoMicrobatching(log_attempts=dist.get_rank() == 0, steady_recovery=steady_recovery, unguarded_timeout_s=60)
    trainer = automicro.Trainer(
        model=model,
        parallelism_config={"fsdp2": {"mixed_precision": "DEFAULT" if gpu else "FULL"}},
        precision="amp_bf16" if gpu else "fp32",
        device=args.device,
        train_dataloader=loader,
        optimizers=DecoupledAdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0),
        max_duration=f"{batches}ba",
        device_train_microbatch_size="auto",
        callbacks=[auto, SpeedMonitor(window_size=1), *callbacks],
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=17,
        dist_timeout=120.0,
    )
    return trainer, auto


def release(trainer: Any) -> None:
    from cases import release_trainer

    release_trainer(trainer, torch.cuda.is_available())


def run_oom(args: argparse.Namespace, ranks_text: str, phase: str) -> dict[str, Any]:
    fault_ranks = [0, 1] if ranks_text == "both" else [int(ranks_text)]
    clock = Clock(args.device == "gpu")
    timing, provoke = make_callbacks(args, clock, fault_ranks, phase)
    trainer, auto = build_trainer(args, [timing, provoke], True, args.batches)
    faulthandler.dump_traceback_later(args.case_timeout, exit=True)
    started = time.perf_counter()
    error = None
    try:
        trainer.fit()
    except Exception as e:  # noqa: BLE001 - recorded, and the launch goes on only if every rank got here
        error = f"{type(e).__name__}: {e}"[:500]
        if type(e).__name__ == "FatalRecoveryError":
            # The job is lost by design (docs/guides/checkpoints.md: 'When a run cannot recover in-process'): the
            # ranks' collective sequences are out of step, so this process may issue no other
            # collective (a `gather` here would pair with the other rank's queued all-gathers).
            print(f"[steady_oom] rank {dist.get_rank()}: job lost after {time.perf_counter() - started:.1f} s: {error}", flush=True)
            os._exit(3)
    faulthandler.cancel_dump_traceback_later()
    steady = [s for b, s in clock.batch_s.items() if b >= 4 and b != args.fault_batch]
    fault_s = clock.batch_s.get(args.fault_batch)
    record = {
        "ranks": ranks_text,
        "phase_asked": phase,
        "phase_seen": provoke.last_event if rank_in(fault_ranks) else "",
        "limit_gib": round(provoke.limit_bytes / 2**30, 2),
        "finished": error is None and int(trainer.state.timestamp.batch) == args.batches,
        "error": error,
        "batches": int(trainer.state.timestamp.batch),
        "fault_batch_history": [
            {k: r[k] for k in ("attempt", "size", "outcome", "hooks", "failed_ranks", "seconds", "note")}
            for r in map(vars, auto.history) if r["batch"] == args.fault_batch
        ],
        "found_size": auto.found_size,
        "steady_batch_s": round(statistics.median(steady), 4) if steady else None,
        "fault_batch_s": round(fault_s, 4) if fault_s is not None else None,
        "lost_s": round(fault_s - statistics.median(steady), 3) if fault_s is not None and steady else None,
        "replayed": auto.collectives_replayed,
        "fit_s": round(time.perf_counter() - started, 2),
    }
    if error is None:
        release(trainer)
    return record


def rank_in(ranks: list[int]) -> bool:
    return dist.get_rank() in ranks


def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    import harness
    from composer.core import Callback

    clock = Clock(args.device == "gpu")
    timing, _ = make_callbacks(args, clock, [], "forward")
    ledger_on: dict[int, bool] = {}

    class Alternate(Callback):
        """Ledger on or off for the coming batch: pairs from the warm-up on, order alternating."""

        def batch_start(self, state, logger) -> None:
            batch = int(state.timestamp.batch)
            offset = batch - args.overhead_warmup
            on = True if offset < 0 else (offset % 2 == 0) == ((offset // 2) % 2 == 0)
            auto.observe_collectives(on)
            ledger_on[batch] = on

    trainer, auto = build_trainer(args, [Alternate(), timing], True, args.overhead_batches)
    faulthandler.dump_traceback_later(args.case_timeout, exit=True)
    trainer.fit()
    faulthandler.cancel_dump_traceback_later()
    hooks_off_from = next((r.batch for r in auto.history if "stable" in r.note), None)
    pairs = []
    for first in range(args.overhead_warmup, args.overhead_batches - 1, 2):
        if first in clock.batch_s and first + 1 in clock.batch_s:
            times = {ledger_on[b]: clock.batch_s[b] for b in (first, first + 1)}
            pairs.append({"batches": [first, first + 1], "on_s": times[True], "off_s": times[False],
                          "on_over_off": times[False] / times[True]})  # tokens/s on / off
    ratios = [p["on_over_off"] for p in pairs]
    interval = harness.median_interval(ratios)
    tokens = args.per_rank_batch * (64 if args.tiny else 2048) * dist.get_world_size()
    record = {
        "hooks_off_from": hooks_off_from,
        "hooks_on_in_pairs": hooks_off_from is None or hooks_off_from > args.overhead_warmup,
        "pairs": len(pairs),
        "median_on_over_off": harness.median(ratios),
        "interval_95": interval,
        "target_met": interval is not None and interval[0] >= 0.995,
        "median_on_s": harness.median(p["on_s"] for p in pairs),
        "median_off_s": harness.median(p["off_s"] for p in pairs),
        "tokens_per_s_on": tokens / harness.median(p["on_s"] for p in pairs) if pairs else None,
        "pair_rows": pairs,
    }
    release(trainer)
    return record


def run_stray(args: argparse.Namespace) -> int:
    from automicro.core.ledger import Board, CollectiveLedger, FatalRecoveryError

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "gpu" else torch.device("cpu")
    group = dist.new_group(backend="gloo") if args.device == "gpu" else None
    ledger = CollectiveLedger(Board.create(group), [dist.group.WORLD], device, rank=rank)
    for _ in range(3):  # a few clean attempts first: the sequence numbers agree
        ledger.begin_attempt(stop_early=True)
        ledger.all_reduce(torch.ones(4, device=device))
        ledger.stop(failed_here=False, site="other")
    ledger.begin_attempt(stop_early=rank == 1)
    ledger.all_reduce(torch.ones(4, device=device))
    started = time.perf_counter()
    if rank == 0:
        dist.all_reduce(torch.ones(3, device=device), async_op=True)  # the model's own collective
        ledger.before("all_reduce", torch.ones(5, device=device), None, dist.ReduceOp.SUM)
        dist.all_reduce(torch.ones(5, device=device), async_op=True)
        ledger.after()
        ledger.stop(failed_here=False, site="other")
        print(f"[steady_oom] rank 0 went on past its own collective; waiting for the verdict", flush=True)
        time.sleep(60)
        print("[steady_oom] rank 0 was not stopped within 60 s", flush=True)
        return 1
    ledger.stop(failed_here=True, site="backward")
    try:
        ledger.catch_up(30.0, "backward", 7)
        print("[steady_oom] rank 1 replayed: the collective outside the ledger went unnoticed", flush=True)
        return 1
    except FatalRecoveryError as error:
        print(f"[steady_oom] rank 1 after {time.perf_counter() - started:.2f} s: {error}", flush=True)
        os._exit(2)


def gather(record: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, record)
    return rows


def main() -> int:
    args = parse_args()
    if args.device == "gpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from automicro.engine import ensure_record_stream_free

    ensure_record_stream_free()
    dist.init_process_group("nccl" if args.device == "gpu" else "gloo")
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"steady_oom_{args.suite}.json")
    results: list[Any] = []

    def write() -> None:
        if rank == 0:
            with open(path, "w") as f:
                json.dump({"torch": torch.__version__, "args": vars(args), "results": results}, f, indent=1)

    if args.suite == "stray":
        return run_stray(args)
    if args.suite == "oom":
        for repeat in range(args.repeat):
            for spec in args.runs.split(","):
                ranks_text, phase = spec.split(":")
                per_rank = gather(run_oom(args, ranks_text, phase))
                results.append({"repeat": repeat, "per_rank": per_rank})
                write()
                r0 = per_rank[0]
                seen = ",".join(p["phase_seen"] for p in per_rank if p["phase_seen"])
                hist = " ".join(f"{h['attempt']}:{h['size']}:{h['outcome']}{'' if h['hooks'] else '(off)'}" for h in r0["fault_batch_history"])
                if rank == 0:
                    print(f"[steady_oom] ranks {ranks_text:4s} {phase:8s} seen {seen:17s} finished {all(p['finished'] for p in per_rank)} "
                          f"batch {r0['fault_batch_s']} s vs {r0['steady_batch_s']} s lost {r0['lost_s']} s "
                          f"replayed {[p['replayed'] for p in per_rank]} history {hist} found {r0['found_size']}", flush=True)
                if not all(p["finished"] for p in per_rank):
                    write()
                    dist.destroy_process_group()
                    return 1
    else:
        per_rank = gather(run_overhead(args))
        results.append({"per_rank": [{k: v for k, v in r.items() if k != "pair_rows" or i == 0} for i, r in enumerate(per_rank)]})
        write()
        if rank == 0:
            for i, r in enumerate(per_rank):
                low, high = r["interval_95"] or (None, None)
                print(f"[steady_oom] rank {i}: ledger on / off tokens/s over {r['pairs']} pairs of adjacent batches: "
                      f"median {r['median_on_over_off']:.4f}, 95% interval [{low:.4f}, {high:.4f}], target >= 0.995 "
                      f"{'met' if r['target_met'] else 'NOT met'} (batch on {r['median_on_s']:.4f} s, off {r['median_off_s']:.4f} s; "
                      f"hooks off from batch {r['hooks_off_from']})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
