"""What a failed attempt leaves allocated on a GPU after its wipe, eager and compiled.

    python3 benchmarks/left_behind.py --out $OUT [--preset 125m] [--cases all]

One process, one GPU, `automicro.Trainer` with FSDP2 (amp_bf16, AdamW) on `automicro.models`'
Llama (`--preset`, seq 2048, per-rank batch `--batch`), with `device_train_microbatch_size: auto`.
Each case is its own short fit:
  <site>/searching   an injected OOM at that fault site at every microbatch above 2 (sync hooks on)
  <site>/steady      one injected OOM at that site in batch 4, after the hooks came off (the ledger's recovery)
  eval/forward       an injected OOM inside the model's forward at eval microbatches above 2
                     (`device_eval_microbatch_size: auto`; training runs into it too)
  real/allocator     no injection: `AutoMicrobatching(memory_fraction=...)` caps the process at
                     `--cap-gib` and the search starts at the whole batch, so the first sizes really run out in the
                     caching allocator
each eager and with `compile: true` (each sharded block's forward compiled). Per case: the most
allocated bytes a failed attempt left after its wipe (`torch.cuda.memory_allocated` before the
attempt and after the wipe: the callback's own check, `AutoMicrobatching.left_behind_exact`), how
many failed attempts were checked, by kind, and the callback's line if one was printed. Writes
`left_behind.json` and a table. `--device cpu --tiny` checks the suite on CPU (aot_eager), no figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402

SITES_SEARCHING = ("forward", "backward", "loss", "optimizer_step")  # one rank: no all-gather, no reduce-scatter to fail
SITES_STEADY = ("forward", "backward")


def cases(selection: str) -> list[tuple[str, str, bool]]:
    """(site, when, compiled) of every case; `selection` 'all' or a comma list of 'site/when[/compiled]'."""
    every = [(site, "searching", False) for site in SITES_SEARCHING]
    every += [(site, "steady", False) for site in SITES_STEADY]
    every += [("eval", "forward", False), ("real", "allocator", False)]
    every += [("forward", "searching", True), ("backward", "searching", True), ("backward", "steady", True),
              ("eval", "forward", True), ("real", "allocator", True)]
    if selection == "all":
        return every
    wanted = set(selection.split(","))
    return [c for c in every if f"{c[0]}/{c[1]}{'/compiled' if c[2] else ''}" in wanted]


def run_case(site: str, when: str, compiled: bool, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from composer.core import Evaluator
    from composer.optim import DecoupledAdamW

    import automicro
    from automicro.data import SyntheticTokens, build_dataloader
    from automicro.models import build_model
    from automicro.testing import FaultInjector

    gpu = args.device == "gpu"
    torch.manual_seed(0)
    model = build_model(args.preset, max_seq_len=args.seq)
    batches = 6 if when == "steady" else 3
    train = build_dataloader(SyntheticTokens(args.batch * batches, args.seq, model.model.config.vocab_size, seed=1),
                             args.batch, shuffle=False, drop_last=True)
    callbacks: list[Any] = []
    auto_kwargs: dict[str, Any] = {"stable_batches": 1} if when == "steady" else {}
    injector = None
    if site == "real":  # from the whole batch down, so that the first sizes really run out
        auto_kwargs["memory_fraction"] = min(1.0, args.cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory) if gpu else None
        auto_kwargs["start_size"] = "batch"
    elif site == "eval":
        injector = FaultInjector("forward", above=2)
    elif when == "steady":
        injector = FaultInjector(site, batch=4, times=1)
    else:
        injector = FaultInjector(site, above=2)
    auto = automicro.AutoMicrobatching(**auto_kwargs)
    callbacks = [auto] + ([injector] if injector is not None else [])
    evaluator = None
    if site == "eval":
        evaluator = Evaluator(
            label="eval", device_eval_microbatch_size="auto",
            dataloader=build_dataloader(SyntheticTokens(args.batch, args.seq, model.model.config.vocab_size, seed=2),
                                        args.batch, shuffle=False),
        )
    compile_cfg: Any = None
    if compiled:
        compile_cfg = {"backend": "inductor" if gpu else "aot_eager"}
    trainer = automicro.Trainer(
        model=model, train_dataloader=train, max_duration=f"{batches}ba",
        eval_dataloader=evaluator, eval_interval="2ba" if evaluator is not None else 1,
        optimizers=DecoupledAdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
        device="gpu" if gpu else "cpu", precision="amp_bf16" if gpu else "fp32",
        parallelism_config={"fsdp2": {"mixed_precision": "DEFAULT" if gpu else "FULL"}},
        compile=compile_cfg, device_train_microbatch_size="auto", callbacks=callbacks,
        loggers=[], progress_bar=False, log_to_console=False, seed=17,
    )
    console = io.StringIO()
    started = time.perf_counter()
    result: dict[str, Any] = {"case": f"{site}/{when}", "compiled": compiled}
    try:
        with contextlib.redirect_stdout(console):
            trainer.fit()
        result.update({
            "ooms": auto.ooms_total, "fired": None if injector is None else injector.fired,
            "checked": auto.left_behind_checked, "left_behind_bytes": auto.left_behind_bytes,
            "left_behind_exact": auto.left_behind_exact, "found": auto.found_size,
            "hooks_at_failures": sorted({r.hooks for r in auto.history if r.outcome == "oom"}),
        })
    except Exception as error:  # noqa: BLE001 - the table says which case broke
        result["error"] = f"{type(error).__name__}: {error}"[:600]
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        trainer.release()  # the next case starts from this one's memory freed, not Composer's kept state
    if gpu:  # what the fit kept after release: the next case's "before" (should not grow case by case)
        import gc

        gc.collect()
        result["allocated_after_fit_mib"] = round(torch.cuda.memory_allocated() / 2**20, 1)
    result["lines"] = [line for line in console.getvalue().splitlines() if "left" in line and "after its wipe" in line][:4]
    result["seconds"] = round(time.perf_counter() - started, 1)
    del trainer, model, train, callbacks, auto, injector, evaluator
    if gpu:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--tiny", action="store_true", help="the tiny preset, short sequences (the CPU check)")
    p.add_argument("--preset", default="125m")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="per-rank batch (samples)")
    p.add_argument("--cap-gib", type=float, default=8.0, help="real/allocator: the process's memory cap")
    p.add_argument("--cases", default="all")
    args = p.parse_args()
    if args.tiny:
        args.preset, args.seq = "tiny", 64
    harness.single_rank_env()
    import torch
    import torch.distributed as dist

    if args.device == "gpu":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "gpu" else "gloo")  # Composer takes only these

    session = harness.Session("left_behind", args.out, args.device == "gpu", prefix="left_behind")
    results = []
    for site, when, compiled in cases(args.cases):
        result = run_case(site, when, compiled, args)
        results.append(result)
        session.say(f"{result['case']} {'compiled' if compiled else 'eager'}: {result.get('error') or ''} "
                    f"{result.get('checked')} exact {result.get('left_behind_exact')} {result['lines']}", detail=True)
        session.write_json({"args": vars(args), "torch": torch.__version__, "results": results})
    rows = [[r["case"], "compile" if r["compiled"] else "eager", r.get("ooms", "-"), r.get("checked", "-"),
             harness.fmt(r["left_behind_exact"] / 2**20 if "left_behind_exact" in r else None, ".2f"),
             r.get("found", "-"), r.get("allocated_after_fit_mib", "-"), r["seconds"], (r.get("error") or "")[:60]]
            for r in results]
    session.table(["case", "mode", "OOMs", "checked", "left MiB (most)", "size", "MiB after fit", "s", "error"], rows)
    session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
