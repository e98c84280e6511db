"""One GPU, what a user would run: eager vs compile, FSDP2 vs unsharded vs Composer's own `auto`.

    python benchmarks/one_gpu.py --out $OUT [--variants eager-auto,blocks-auto,model-auto] [--batches 30]

Each variant is one `scripts/train.py configs/tiny-gpu.yaml` run (its own process, one rank) on the
1B preset of `automicro.models` (seq 2048, per-rank batch 32, amp_bf16, AdamW, synthetic tokens),
with the YAML overrides the variant names (`-auto` or `-fixed-N` for the microbatch size; `-fixed-found`
and `-fixed-half`: the largest microbatch the same kind's `-auto` run (earlier in `--variants`) ran at
most over its steady batches, and half of it, so the best hand-set sizes are timed in one command; `-fixed-found+K`:
K above it, whether the size found is the largest that fits):
  eager-*        FSDP2 (the default config), no compile
  blocks-*       compile: true (each sharded block's forward, the default scope)
  model-*        compile: {scope: model} (Composer's whole-model compile)
  noshard-*      parallelism_config: null (no FSDP; Composer's autocast; `auto` on one rank)
  noshardmodel-* the same with compile: {scope: model} (Composer's whole-model compile, automicro's `auto`)
  unshardpin-*   the default config (FSDP2) with `parallelism_config.fsdp2.on_one_rank: unshard` and
                 compile: true: on one rank what noshardmodel-* runs, from the YAML a multi-GPU job uses
  keeppin-*      compile: true with `on_one_rank: keep`: FSDP2 pinned, not timed against the model
                 unsharded (blocks-* times both under `auto` by default: its JSON's "one_rank" lines)
  notrials-*     compile: true with `callbacks.auto_microbatching.trials: false`: the size search and nothing
                 else (blocks-* prices and runs the trials that pay: the end-to-end ratio of the two is what
                 the trials won)
  plain-*        compile: true with `callbacks.auto_microbatching.head: plain` (the model's own head)
  fused-*        compile: true with `head: fused` (the loss from the hidden states in chunks: `automicro.engine.head`;
                 blocks-* runs `head: auto`, the default on a GPU: the fused head priced, measured and timed)
  layout-*       FSDP2 with `callbacks.auto_microbatching.layout: auto` (the layout search)
  pinned-*       FSDP2 with both layout trades pinned (`layout: [grad_sync_once, no_reshard]`)
  gso-*          FSDP2 with `layout: [grad_sync_once]` pinned (no search, no checkpointing)
  wholebatch-*   the default config with `start_size: batch`: the search starts at the whole batch
                 and halves down, as before the probe
  ac-*           the default config with `activation_checkpointing: true` (the layout search may
                 switch it off: the `no_recompute` trade)
  acfixed-*      `activation_checkpointing: true` with `layout: fixed` (checkpointing stays on)
  acblocks-*     the same with compile: true (each block compiled with its checkpointing: what a user sets by hand
                 where one sample does not fit without it; blocks-* under `auto` switches it on itself, the ladder
                 below size 1: `automicro.batch.floor_ladder`)
  composer-*     the stock `composer.Trainer` on the same model, data and optimizer (no FSDP, its
                 own `auto`: halving), built from the same YAML
  composercompile-*  the same with Composer's own `compile_config={}` (torch.compile of the whole model)
`--memory-fraction` caps the process's GPU memory in every variant, told to automicro
(`AutoMicrobatching(memory_fraction=...)`; 0: not set). A card that is not all ours:
`--torch-fraction F` sets `torch.cuda.set_per_process_memory_fraction(F)` first thing in each
variant's process, as a user's own script would, telling automicro nothing (`--memory-fraction` is
then not passed, so Composer's stock run does not raise the cap to it either); `--hog-gib G` starts
another process that holds G GiB of the same GPU for the whole variant (a notebook, a server). `--model NAME` swaps the model for a
transformers model built from its config, no weights downloaded (`FAMILIES`): `hf` the same 1B Llama
shape (`use_cache=False`); `tinyllama`, `llama32` (Llama 3.2 1B), `qwen25` (Qwen2.5 0.5B) and `gpt2l`
(GPT-2 large: `--seq 1024 --batch 64`) public shapes with every other config value at its default, in
Composer's `HuggingFaceModel`: the same YAML, data and variants, the model builder replaced in the
variant's process (`--hf=NAME` ahead of its arguments).
Per variant, from the run's metrics.jsonl and console: steady tokens/s and MFU (the batches after
`--skip`, from the wall clock Composer logs per batch; MFU from the model's flops per batch over the
H100's dense bf16 peak), the first batch's seconds (search and compile), graphs compiled, OOMs,
the size found, peak reserved memory. Writes `compile.json` and a table. `--profile START:COUNT`
runs torch.profiler over those batches of every variant (automicro's trainer or Composer's own) and
writes `VARIANT.profile.txt`: wall and GPU seconds, the top ops by GPU time and by CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

VARIANTS = ("eager-auto", "blocks-auto", "model-auto")
SEQ, PER_RANK_BATCH = 2048, 32  # per-rank batch = global batch on one GPU
# The automicro variant with the same compile setting as a stock Composer one (the table's ratios).
COUNTERPART = {"composer": "eager", "composercompile": "blocks", "unshardpin": "blocks", "notrials": "blocks",
               "fused": "plain", "acblocks": "blocks"}
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, SXM


def short(variant: str) -> bool:
    """A variant with nothing to search past its first batch (a fixed size; Composer's own `auto`
    halves within the first batch): `--fixed-batches` applies."""
    return "-fixed-" in variant or variant.startswith(("composer-", "composercompile-"))


def batches_and_skip(variant: str, args: argparse.Namespace) -> tuple[int, int]:
    if args.fixed_batches and short(variant):
        return args.fixed_batches, args.fixed_skip
    return args.batches, args.skip


def overrides(variant: str, args: argparse.Namespace, run_dir: str) -> list[str]:
    kind, _, mode = variant.partition("-")
    common = [
        f"model.preset={args.preset}", "data.kind=synthetic", f"data.seq_len={args.seq}",
        f"global_train_batch_size={args.batch * args.nproc}",
        f"max_duration={getattr(args, 'planned', 0) or batches_and_skip(variant, args)[0]}ba", f"run_dir={run_dir}",
        "loggers.console=false", "loggers.jsonl=true", "callbacks.speed_monitor.window_size=5",
    ]
    if args.dry_run:  # CPU: the suite's plumbing only
        common += ["device=cpu", "precision=fp32", "parallelism_config.fsdp2.mixed_precision=FULL", "callbacks.memory_monitor=null"]
    elif args.memory_fraction and not args.torch_fraction:  # --torch-fraction: automicro is told nothing
        common.append(f"callbacks.auto_microbatching.memory_fraction={args.memory_fraction}")
    backend = ["compile.backend=aot_eager"] if args.dry_run else []
    if kind == "blocks":
        common += ["compile=true"] + backend
    elif kind == "model":
        common += ["compile.scope=model"] + backend
    elif kind in ("noshard", "composer"):
        common += ["parallelism_config=null"]
    elif kind == "noshardmodel":  # automicro unsharded, Composer's whole-model compile
        common += ["parallelism_config=null", "compile.scope=model"] + backend
    elif kind == "unshardpin":  # FSDP2 in the config, pinned unsharded on one rank; each-block compile asked
        common += ["parallelism_config.fsdp2.on_one_rank=unshard", "compile=true"] + backend
    elif kind == "keeppin":  # FSDP2 pinned on one rank (not timed against the model unsharded); each-block compile asked
        common += ["parallelism_config.fsdp2.on_one_rank=keep", "compile=true"] + backend
    elif kind == "notrials":  # each block compiled, no trial at all: the size search and nothing else
        common += ["compile=true", "callbacks.auto_microbatching.trials=false"] + backend
    elif kind in ("plain", "fused"):  # each block compiled, the head pinned
        common += ["compile=true", f"callbacks.auto_microbatching.head={kind}"] + backend
    elif kind == "composercompile":  # Composer's own compile: the whole model, its `compile_config`
        common += ["parallelism_config=null", "compile.scope=model"] + backend
    elif kind == "layout":
        common.append("callbacks.auto_microbatching.layout=auto")
    elif kind == "pinned":
        common.append("callbacks.auto_microbatching.layout=[grad_sync_once,no_reshard]")
    elif kind == "gso":
        common.append("callbacks.auto_microbatching.layout=[grad_sync_once]")
    elif kind == "wholebatch":
        common.append("callbacks.auto_microbatching.start_size=batch")
    elif kind in ("ac", "acfixed", "acblocks"):
        common.append("parallelism_config.fsdp2.activation_checkpointing=true")
        if kind in ("acfixed", "acblocks"):
            common.append("callbacks.auto_microbatching.layout=fixed")
        if kind == "acblocks":
            common += ["compile=true"] + backend
    elif kind != "eager":
        raise SystemExit(f"unknown variant {variant!r}")
    common += [o for o in args.extra.split(",") if o]
    if mode == "auto" and not kind.startswith("composer"):
        common += [o for o in getattr(args, "auto_extra", "").split(",") if o]
    if mode.startswith("fixed-"):
        size = mode.split("-")[1]
        if not size.isdigit():
            raise SystemExit(f"variant {variant!r}: resolve_fixed() turns fixed-found/fixed-half into a size first")
        common.append(f"device_train_microbatch_size={int(size)}")
    elif mode != "auto":
        raise SystemExit(f"unknown variant {variant!r}")
    return common


def resolve_fixed(variant: str, results: list[dict[str, Any]], tag: str = "") -> Optional[str]:
    """`KIND-fixed-found` / `KIND-fixed-half` as `KIND-fixed-N`: N the largest microbatch `KIND-auto`
    (run earlier in this command; `...@OTHER`: `OTHER-auto`) ran most over its steady batches, or half of it (`+K`: K
    more); None where that
    run left no steady size (it failed). Other variants come back as they are."""
    kind, _, mode = variant.partition("-")
    mode, _, source = mode.partition("@")  # `KIND-fixed-found@OTHER`: the size OTHER-auto ran at
    mode, plus, more = mode.partition("+")  # `KIND-fixed-found+K`: K above it (is the size found the largest that fits?)
    if mode not in ("fixed-found", "fixed-half") or (plus and not more.isdigit()):
        return variant
    auto = next((r for r in results if r.get("variant") == f"{source or kind}-auto{tag}"), None)
    if auto is None:
        raise SystemExit(f"variant {variant!r} needs {source or kind}-auto earlier in --variants")
    steady = auto.get("steady_sizes") or []
    if not steady:
        return None
    found = statistics.mode(steady)  # the size trials' batches run smaller: the most common one is the size kept
    return f"{kind}-fixed-{(found if mode == 'fixed-found' else max(1, found // 2)) + int(more or 0)}"


def read_metrics(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if not row.get("trace"):
                rows.append(row)
    return rows


def _spread_mib(peaks: list[int]) -> Optional[float]:
    return round((max(peaks) - min(peaks)) / 2**20, 1) if peaks else None


def summarize(variant: str, rows: list[dict[str, Any]], console: list[str], skip: int, gpu: str, seq: int,
              nproc: int = 1, batch: int = PER_RANK_BATCH) -> dict[str, Any]:
    train_h: dict[int, float] = {}
    flops: dict[int, float] = {}
    peak = 0.0
    found = None
    ooms = 0
    allocated: dict[int, float] = {}  # GiB allocated after each batch (Composer's MemoryMonitor)
    capacity: dict[int, int] = {}
    sizes: dict[int, int] = {}  # the microbatch size each batch ran at (its last attempt)
    losses: dict[int, float] = {}
    batch_peaks: dict[int, int] = {}  # each batch's peak, the most over ranks (automicro's `auto` runs only)
    for row in rows:
        step = int(row.get("step", 0))
        if "time/train" in row:
            train_h[step] = float(row["time/train"])
        for key, value in row.items():
            if key.startswith("memory/peak_reserved_mem"):
                peak = max(peak, float(value))
            if key == "automicro/found_size" and value:
                found = int(value)
            if key == "automicro/ooms_total":
                ooms = max(ooms, int(value))
            if key == "throughput/device/flops_per_sec":
                flops[step] = float(value)
            if key == "memory/current_allocated_mem":
                allocated[step] = float(value)
            if key == "automicro/capacity_bytes" and value:
                capacity[step] = int(value)
            if key == "automicro/microbatch_size" and value:
                sizes[step] = int(value)
            if key == "loss/train/total":
                losses[step] = float(value)
            if key == "automicro/peak_bytes" and value:
                batch_peaks[step] = int(value)
    steps = sorted(train_h)
    seconds = {s: (train_h[s] - train_h.get(s - 1, 0.0)) * 3600 for s in steps}
    steady = [seconds[s] for s in steps if s > skip]
    step_s = statistics.median(steady) if steady else None
    tokens_per_s = seq * batch * nproc / step_s if step_s else None
    flops_steady = [flops[s] for s in flops if s > skip]
    mfu = statistics.median(flops_steady) / PEAK_FLOPS[gpu] if flops_steady and gpu in PEAK_FLOPS else None
    graphs = next((int(m.group(1)) for line in console if (m := re.search(r"(\d+) graph\(s\) compiled", line))), 0)
    stock = next((int(m.group(1)) for line in console if (m := re.search(r"stock composer: device_train_microbatch_size (\d+)", line))), None)
    found = found if stock is None else stock
    fixed = re.search(r"-fixed-(\d+)$", variant)
    # The batch whose attempt ended the search ("... -> converged on N"), and the attempts spent.
    found_at = next((int(m.group(1)) for line in console if "converged on" in line
                     and (m := re.search(r"\] batch (\d+) attempt", line))), None)
    attempts = next((int(m.group(1)) for line in console if (m := re.search(r"attempts (\d+), OOMs", line))), None)
    return {
        "variant": variant, "tokens_per_s": tokens_per_s, "step_s": step_s, "mfu": mfu,
        "first_batch_s": seconds.get(steps[0]) if steps else None, "graphs": graphs, "ooms": ooms,
        "found": found if not fixed else int(fixed.group(1)), "peak_reserved_gib": peak or None,
        # The steady batches' peaks (automicro's own, per batch): how far they spread from batch to batch.
        "peak_spread_mib": _spread_mib([batch_peaks[s] for s in sorted(batch_peaks) if s > skip]),
        "steady_batches": len(steady), "found_at_batch": found_at, "search_attempts": attempts,
        # Memory no batch uses shows as allocated bytes that grow between batches at the same split.
        "allocated_gib_by_batch": [allocated[s] for s in sorted(allocated)],
        "capacity_mib_by_batch": sorted({round(c / 2**20) for c in capacity.values()}),
        "size_by_batch": [sizes[s] for s in sorted(sizes)],
        "steady_sizes": [sizes[s] for s in sorted(sizes) if s > skip],
        "capacity_mib_each_batch": [round(capacity[s] / 2**20) for s in sorted(capacity)],
        # Every batch's wall seconds (Composer's clock), for the run projected end to end (`project`).
        "batch_seconds": [round(seconds[s], 4) for s in steps],
        # The trial plan (`automicro.batch.trial_plan`): the profile, what it ruled out, the price line.
        "trial_lines": [line.split("] ", 1)[-1] for line in console
                        if "a batch profiled" in line or "not timed:" in line or "not tried:" in line or "] trials:" in line
                        or "not run:" in line or "no trade nor smaller" in line or "not compiled again" in line
                        or "not timed against" in line],
        # Each trial that ended: its real cost against the batch before it and its predicted cost (`trial_plan`).
        "trials": [{"trial": m.group(1), "outcome": m.group(2), "cost_s": float(m.group(3)), "batches": int(m.group(4)),
                    "predicted_s": float(m.group(5)) if m.group(5) else None}
                   for line in console if (m := re.search(r"\] trials: (.+?) ended \((.*?)\): cost (-?[0-9.]+) s over (\d+) "
                                                          r"batch\(es\)[^,]*(?:, predicted ([0-9.]+) s)?", line))],
        # The ladder below size 1 (`floor_ladder`): its step's line, where it stepped.
        "ladder": [line.split("] ", 1)[-1] for line in console if "] recompute on: " in line],
        # FSDP2 against the model unsharded on one rank: what was timed and kept (`sharding_choice`).
        "one_rank": [line.split("] ", 1)[-1] for line in console if "] one rank: " in line],
        # The vocabulary head: its decisions and its profile (`automicro.batch.head_choice`, the layout's fused_head).
        "head": [line.split("] ", 1)[-1] for line in console if "] head: " in line or "vocabulary head profiled" in line],
        # The training loss of every batch (Composer's `loss/train/total`): the heads compared over the same batches.
        "loss_by_batch": [round(losses[s], 5) for s in sorted(losses)],
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--skip", type=int, default=10, help="batches left out of the steady figures (search, compile)")
    p.add_argument("--fixed-batches", type=int, default=0,
                   help="batches of the variants with nothing to search after the first batch (-fixed-*, composer*); 0: --batches")
    p.add_argument("--fixed-skip", type=int, default=0, help="their --skip (with --fixed-batches)")
    p.add_argument("--memory-fraction", type=float, default=0.95, help="told to automicro (0: not set)")
    p.add_argument("--torch-fraction", type=float, default=0.0,
                   help="torch.cuda.set_per_process_memory_fraction in each variant's process, automicro not told (0: none)")
    p.add_argument("--hog-gib", type=float, default=0.0,
                   help="another process holds this many GiB of the GPU (negative: all but that many GiB of what is free)")
    p.add_argument("--hog-later", default="",
                   help="more processes that take memory mid-run: 'T:G:D,...' takes G GiB T s after the launch and gives "
                        "it back D s later (D 0: holds it to the end); 'bN:G:bM' takes them once the run has logged "
                        "batch N and gives them back once it has logged batch M (bM omitted or 0: holds them)")
    p.add_argument("--hog-device", type=int, default=0, help="the GPU the other processes take memory on (--nproc 2: 1 shares only rank 1's)")
    p.add_argument("--tag", default="", help="appended to each variant's name in the results (several settings in one file)")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds for the whole command: no variant starts after it, each one's timeout ends there (0: none)")
    p.add_argument("--preset", default="1b")
    p.add_argument("--extra", default="", help="more YAML overrides for every variant, comma-separated")
    p.add_argument("--auto-extra", default="",
                   help="more YAML overrides for automicro's `auto` variants only (a RoutingSkew Composer's own `auto` is not given)")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--batch", type=int, default=PER_RANK_BATCH, help="per-rank batch (samples)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) of this host per variant; per-rank batch stays 32")
    p.add_argument("--dry-run", action="store_true", help="CPU, aot_eager: check the suite, measure nothing")
    p.add_argument("--profile", default="",
                   help="START:COUNT: torch.profiler over batches START..START+COUNT-1 of every variant; "
                        "its top kernels and ops as VARIANT.profile.txt (GPU time, wall time, the gap between)")
    p.add_argument("--planned", type=int, default=0,
                   help="each run's max_duration in batches (a run that long as far as automicro and Composer know), "
                        "stopped after --batches (0: max_duration is --batches)")
    p.add_argument("--layers", type=int, default=0,
                   help="a --model family's blocks cut to this many (0: as FAMILIES has it; a routed shape on an H100)")
    p.add_argument("--model", choices=("automicro", *FAMILIES), default="automicro",
                   help="automicro.models' Llama (the preset), or a transformers model built from its config (FAMILIES)")
    if argv is None and sys.argv[1:2] == ["--hog"]:
        return hog(*sys.argv[2:6])
    if argv is None and sys.argv[1].startswith("--stop-after="):
        _stop_after(sys.argv[1].split("=", 1)[1])
        sys.argv = sys.argv[:1] + sys.argv[2:]
    if argv is None and sys.argv[1].startswith("--profile="):
        _profile_batches(*sys.argv[1].split("=", 1)[1].split(":", 2))
        sys.argv = sys.argv[:1] + sys.argv[2:]
    if argv is None and sys.argv[1].startswith("--torch-fraction="):
        import torch

        torch.cuda.set_per_process_memory_fraction(float(sys.argv[1].split("=", 1)[1]))
        sys.argv = sys.argv[:1] + sys.argv[2:]
    if argv is None and sys.argv[1:2] == ["--train"]:
        sys.path.insert(0, os.path.join(harness.REPO_ROOT, "scripts"))
        import train  # noqa: E402 - scripts/train.py

        return train.main(sys.argv[2:])
    if argv is None and sys.argv[1].startswith("--hf="):
        _use_hf(sys.argv[1].split("=", 1)[1], "--tiny-hf" in sys.argv)
        sys.argv = [a for a in sys.argv if not a.startswith("--hf=") and a != "--tiny-hf"]
        if sys.argv[1:2] != ["--stock"]:
            sys.path.insert(0, os.path.join(harness.REPO_ROOT, "scripts"))
            import train  # noqa: E402 - scripts/train.py, with the model builder replaced

            return train.main(sys.argv[1:])
    if argv is None and sys.argv[1:2] == ["--stock"]:
        return stock_composer(sys.argv[2:])
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    gpu = "H200" if "H200" in _gpu_name() else "H100" if "H100" in _gpu_name() else "other"
    results: list[dict[str, Any]] = []
    began = time.perf_counter()
    for asked in args.variants.split(","):
        left = args.deadline - (time.perf_counter() - began) if args.deadline else args.timeout
        resolved = resolve_fixed(asked, results, args.tag)
        if resolved is None or left < 30:
            why = "its auto run left no steady size" if resolved is None else f"not started: the {args.deadline:.0f} s deadline"
            results.append({"variant": asked + args.tag, "error": why})
            print(f"[one_gpu:detail] {asked}: {why}", flush=True)
            continue
        variant = resolved
        run_dir = os.path.join("/tmp", f"compile-bench-{variant}{args.tag}")
        shutil.rmtree(run_dir, ignore_errors=True)
        stock = variant.startswith(("composer-", "composercompile-"))
        script = os.path.abspath(__file__) if stock else os.path.join(harness.REPO_ROOT, "scripts", "train.py")
        rest = [*(["--stock"] if stock else []), "configs/tiny-gpu.yaml", *overrides(variant, args, run_dir)]
        if args.model != "automicro":
            family = args.model + (f":{args.layers}" if args.layers else "")
            script, rest = os.path.abspath(__file__), [f"--hf={family}", *rest, *(["--tiny-hf"] if args.dry_run else [])]
        if (args.torch_fraction or args.profile or args.planned) and script != os.path.abspath(__file__):
            script, rest = os.path.abspath(__file__), ["--train", *rest]  # scripts/train.py, run from this file's process
        if args.torch_fraction:
            rest = [f"--torch-fraction={args.torch_fraction}", *rest]
        if args.planned:
            rest = [f"--stop-after={batches_and_skip(variant, args)[0]}", *rest]
        if args.profile:
            rest = [f"--profile={args.profile}:{os.path.join(args.out, variant + args.tag + '.profile.txt')}", *rest]
        if args.nproc == 1:
            argv_, env = [sys.executable, script, *rest], {**os.environ, **_single_rank()}
        else:  # one process per GPU of this host (torchrun's standalone rendezvous)
            argv_ = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc), script, *rest]
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        started = time.perf_counter()
        holders: list[Any] = []
        try:
            if args.hog_gib:
                holders.append(start_hog(args.hog_gib, device=args.hog_device))
            for item in filter(None, args.hog_later.split(",")):
                after, gib, hold = (item.split(":") + ["0"])[:3]
                holders.append(start_hog(float(gib), after, hold, device=args.hog_device, metrics=os.path.join(run_dir, "metrics.jsonl")))
            done = harness.run_launch(argv_, min(args.timeout, left), env=env)
        finally:
            for holder in holders:
                holder.kill()
                holder.wait()
        console = [line for line in (done.stdout or "").splitlines() if line.startswith("[automicro]")]
        metrics = os.path.join(run_dir, "metrics.jsonl")
        with open(os.path.join(args.out, f"{variant}{args.tag}.log"), "w", encoding="utf-8") as log:
            log.write((done.stdout or "") + "\n--- stderr ---\n" + (done.stderr or "")[-20000:])
        if os.path.exists(metrics):
            shutil.copy(metrics, os.path.join(args.out, f"{variant}{args.tag}.metrics.jsonl"))
        if done.returncode == 0 and os.path.exists(metrics):
            result = summarize(variant, read_metrics(metrics), console, batches_and_skip(variant, args)[1], gpu, args.seq, args.nproc, args.batch)
            result["layout_lines"] = [line for line in console if "layout" in line][:40]
        else:
            result = {"variant": variant, "error": f"rc {done.returncode}: {(done.stderr or done.stdout or '')[-800:]}"}
        result["launch_s"] = round(time.perf_counter() - started, 1)
        result.update(project(result))
        result["variant"] = variant + args.tag
        result["setting"] = {"torch_fraction": args.torch_fraction, "hog_gib": args.hog_gib, "model": args.model,
                             "memory_fraction": args.memory_fraction}
        result["console"] = console[-12:]
        result["memory_lines"] = [line for line in console if "per sample" in line or " -> oom" in line or "thrash" in line][:20]
        result["search_lines"] = [line for line in console if "] batch " in line and " attempt " in line][:12]
        print(f"[one_gpu:detail] {variant}: " + " / ".join(result.get("layout_lines", [])[-3:] + console[-2:]), flush=True)
        results.append(result)
    base = {r["variant"]: r for r in results if r.get("tokens_per_s")}
    rows = []
    for r in results:
        # automicro's `auto` in the same compile setting over this row: auto ÷ a fixed size, ÷ Composer's own.
        kind = r["variant"].split("-", 1)[0]
        auto = base.get(f"{COUNTERPART.get(kind, kind)}-auto{args.tag}")
        rows.append([
            r["variant"], harness.fmt(r.get("tokens_per_s"), ",.0f"), harness.fmt(r.get("mfu"), ".3f"),
            harness.fmt(auto["tokens_per_s"] / r["tokens_per_s"], ".3f") if r.get("tokens_per_s") and auto else "–",
            r.get("found", "–"), r.get("ooms", "–"), r.get("found_at_batch", "–"), harness.fmt(r.get("first_batch_s"), ".1f"), r.get("graphs", "–"),
            harness.fmt(r.get("peak_reserved_gib"), ".1f"), harness.fmt(r.get("peak_spread_mib"), ",.0f"),
            harness.fmt(r["e2e_1000_s"] / auto["e2e_1000_s"], ".3f") if r.get("e2e_1000_s") and auto and auto.get("e2e_1000_s") else "–",
            harness.fmt(r.get("trials_s"), ".1f"),
            f"{harness.fmt(r.get('trials_share_1000'), '.1%')} / {harness.fmt(r.get('trials_share_10000'), '.2%')}" if r.get("trials_s") is not None else "–",
            r.get("final_at", "–"), (r.get("error") or "")[:80],
        ])
    header = ["variant", "tokens/s", "MFU", "auto ÷ this", "size", "OOMs", "found at batch", "first batch s", "graphs", "peak GiB",
              "peak spread MiB", "auto ÷ this, 1,000 batches end to end", "trials s", "trials % of 1,000 / 10,000", "final at", "error"]
    for line in harness.table_lines(header, rows):
        print(f"[one_gpu] | {line}", flush=True)
    harness.write_json(os.path.join(args.out, f"one_gpu{args.tag}.json"), {"args": vars(args), "gpu": gpu, "results": results})
    return 0


SETTLED_TAIL = 5  # the last batches of a run whose median projects the rest of it


def project(result: dict[str, Any]) -> dict[str, Any]:
    """The run projected end to end: its launch (start-up, compile, search, trials, every batch it ran, exit) plus
    the batches it did not run at the median of its last `SETTLED_TAIL`, to 1,000 and to 10,000 batches; and the
    trial plan's price line (the configuration final at batch N, the trials' seconds) as shares of those runs."""
    seconds = result.get("batch_seconds") or []
    if len(seconds) < SETTLED_TAIL or not result.get("launch_s"):
        return {}
    settled = statistics.median(seconds[-SETTLED_TAIL:])
    out: dict[str, Any] = {"settled_s": round(settled, 4)}
    for total in (1000, 10000):
        out[f"e2e_{total}_s"] = round(result["launch_s"] + (total - len(seconds)) * settled, 1)
    price = next((m for line in result.get("trial_lines", [])
                  if (m := re.search(r"final at batch (\d+); the trials cost ([0-9.]+) s", line))), None)
    if price is not None:
        out["final_at"], out["trials_s"] = int(price.group(1)), float(price.group(2))
        out["trials_share_1000"] = out["trials_s"] / (1000 * settled)
        out["trials_share_10000"] = out["trials_s"] / (10000 * settled)
    return out


def start_hog(gib: float, after: Any = 0.0, hold: Any = 0.0, device: int = 0, metrics: str = "") -> Any:
    """Another process that takes `gib` GiB of the GPU and holds it (a notebook, an inference server);
    returns once it holds them. `after` > 0: it takes them that many seconds from now (and returns at
    once), gives them back `hold` seconds later (0: never). `after` "bN": once the run's `metrics`
    file has batch N; `hold` "bM": gives them back once it has batch M."""
    import subprocess

    argv = [sys.executable, os.path.abspath(__file__), "--hog", str(gib), str(after), str(hold), metrics]
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    physical = visible[device] if device < len(visible) else str(device)  # this process's device `device`
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": physical})
    if str(after) not in ("0", "0.0"):
        when = f"once batch {after[1:]} is logged" if str(after).startswith("b") else f"{float(after):.0f} s from now"
        until = f"until batch {hold[1:]}" if str(hold).startswith("b") else f"for {float(hold):.0f} s" if float(hold) else "to the end"
        print(f"[one_gpu:detail] another process takes {gib} GiB {when}, {until}", flush=True)
        return holder
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if not line.startswith("holding"):
        holder.kill()
        raise SystemExit(f"the memory hog did not start: {line!r}")
    print(f"[one_gpu:detail] another process is {line.strip()}", flush=True)
    return holder


def _reached(when: str, metrics: str) -> bool:
    """Whether the run's metrics file has logged batch N (`when` "bN"; False for seconds)."""
    if not when.startswith("b"):
        return False
    try:
        with open(metrics, encoding="utf-8") as handle:
            return any(int(json.loads(line).get("step", 0)) >= int(when[1:]) for line in handle if line.strip())
    except (OSError, ValueError):
        return False


def _wait(when: str, metrics: str) -> None:
    """Sleep `when` seconds, or ("bN") until the run's metrics file has logged batch N."""
    if not when.startswith("b"):
        time.sleep(float(when))
        return
    while not _reached(when, metrics):
        time.sleep(0.2)


def hog(gib_: str, after_: str = "0", hold_: str = "0", metrics: str = "") -> int:
    import torch

    gib, after = float(gib_), after_ if after_.startswith("b") else float(after_)
    hold = hold_ if hold_.startswith("b") else float(hold_)
    _wait(str(after), metrics)
    if gib < 0:  # leave -gib GiB free, whatever the card
        gib = torch.cuda.mem_get_info()[0] / 2**30 + gib
    if after:
        # Later in the run: a GiB at a time, as the training process leaves it free (its cached
        # blocks stay its own), for up to a minute, or until the give-back batch.
        chunks: list[Any] = []
        deadline = time.time() + (1e9 if str(hold).startswith("b") else 60)
        while len(chunks) < int(gib) and time.time() < deadline and not _reached(str(hold), metrics):
            try:
                chunks.append(torch.empty(2**30, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                time.sleep(0.2)
        print(f"[one_gpu:detail] the later process holds {len(chunks)} GiB", file=sys.stderr, flush=True)
        _wait(str(hold or 3600), metrics)
        print(f"[one_gpu:detail] the later process gives its {len(chunks)} GiB back", file=sys.stderr, flush=True)
        chunks.clear()
        torch.cuda.empty_cache()
        time.sleep(3600)
        return 0
    held = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    free, total = torch.cuda.mem_get_info()
    print(f"holding {held.numel() / 2**30:.1f} GiB ({free / 2**30:.1f} of {total / 2**30:.1f} GiB left free)", flush=True)
    _wait(str(hold or 3600), metrics)
    print(f"[one_gpu:detail] the process holding {held.numel() / 2**30:.1f} GiB gives them back", file=sys.stderr, flush=True)
    del held
    torch.cuda.empty_cache()
    time.sleep(3600)
    return 0


def stock_composer(argv: list[str]) -> int:
    """The `composer-*` variants: the YAML's model, data and optimizer (automicro's builders) in a
    stock `composer.Trainer`, without FSDP, with Composer's own `auto`; metrics to the same JSONL."""
    import torch
    from composer import Trainer
    from composer.callbacks import MemoryMonitor, SpeedMonitor
    from composer.utils import reproducibility

    from automicro.config import load_config, parse_cli
    from automicro.composer import builders
    from automicro.composer.loggers import build_loggers

    path, overrides_ = parse_cli(argv)
    # automicro's schema refuses `auto` without FSDP2 on several ranks (DDP); Composer's own takes it.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    auto = not any(o.startswith("device_train_microbatch_size=") for o in overrides_)
    if world > 1 and auto:
        overrides_ = [*overrides_, "device_train_microbatch_size=1"]
    fraction = next((float(o.split("=", 1)[1]) for o in overrides_ if o.startswith("callbacks.auto_microbatching.memory_fraction=")), None)
    cfg = load_config(path, overrides_)
    if fraction is not None and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)
    reproducibility.seed_all(cfg.seed)
    model = builders.build_model_from(cfg)
    dataset = builders.build_dataset(cfg, model.model.config.vocab_size)
    train_dl = builders.train_data(cfg, builders.build_train_dataloader(cfg, dataset, cfg.per_rank_batch_size(1)))
    trainer = Trainer(
        model=model, train_dataloader=train_dl, max_duration=cfg.max_duration,
        optimizers=builders.build_optimizer(cfg, model), schedulers=builders.build_scheduler(cfg), device=cfg.device,
        precision=cfg.precision, device_train_microbatch_size="auto" if world > 1 and auto else cfg.device_train_microbatch_size,
        compile_config=None if cfg.compile is None else {k: v for k, v in (("backend", cfg.compile.backend),) if v},
        callbacks=[SpeedMonitor(window_size=5)] + ([MemoryMonitor()] if torch.cuda.is_available() else []), loggers=build_loggers(cfg), seed=cfg.seed,
        progress_bar=False,
    )
    trainer.fit()
    print(f"[automicro] stock composer: device_train_microbatch_size {trainer.state.device_train_microbatch_size}", flush=True)
    trainer.close()
    return 0


# `--model NAME`: transformers models built from their configs (no weights downloaded). `hf` is the
# 1B Llama shape of `automicro.models` with `use_cache=False` (the runs of 2026-11-25 to 2026-11-28); the others are public
# models' shapes with every other config value at transformers' default (`use_cache` included), as a
# user who builds one from its config gets it.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("LlamaConfig", dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, intermediate_size=8192, use_cache=False)),
    "tinyllama": ("LlamaConfig", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)),
    "llama32": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                    rope_theta=500000.0, tie_word_embeddings=True)),
    # Llama-3.2 3B's shape: 3.2B parameters, whose fp32 weights, gradients and AdamW state (51 GB) leave an H100 too
    # little for one sample of 131,072 tokens with every block recomputing (the host offload's case).
    "llama32-3b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                       num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                                       rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen25": ("Qwen2Config", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1000000.0, tie_word_embeddings=True)),
    # GPT-2 large: 1024 positions (run it with --seq 1024 --batch 64: the same tokens a batch).
    "gpt2l": ("GPT2Config", dict(n_embd=1280, n_layer=36, n_head=20)),
    # OLMo-2 1B's shape.
    "olmo2": ("Olmo2Config", dict(vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)),
    # Gemma-3 1B's shape (a vocabulary of 262k, tied embeddings, head_dim 256).
    "gemma3": ("Gemma3TextConfig", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        max_position_embeddings=32768, sliding_window=512, rope_theta=1000000.0,
                                        query_pre_attn_scalar=256, tie_word_embeddings=True)),
    # Gemma-2 2B's shape (256k, final-logit soft-capping).
    "gemma2": ("Gemma2Config", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    # Routed (mixture-of-experts) shapes, each cut to fewer blocks so that it trains on one H200 with AdamW's state
    # (every other value at its config's default; parameters counted from the shapes):
    # Qwen3-30B-A3B's blocks (128 experts, 8 a token), 6 of its 48: about 4.4B parameters.
    "qwen3moe": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        num_experts=128, num_experts_per_tok=8, max_position_embeddings=32768)),
    # OLMoE-1B-7B's blocks (64 experts, 8 a token), 12 of its 16: about 5.2B parameters.
    "olmoe": ("OlmoeConfig", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=12,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                                  max_position_embeddings=4096)),
    # Mixtral-8x7B's blocks (8 experts, 2 a token), 3 of its 32: about 4.6B parameters.
    "mixtral": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=3,
                                      num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                                      max_position_embeddings=32768, rope_theta=1000000.0)),
}
_TINY = {"LlamaConfig": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
         "Qwen2Config": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
         "GPT2Config": dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=4),
         "Olmo2Config": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128),
         "Gemma3TextConfig": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                  intermediate_size=128, head_dim=16),
         "Gemma2Config": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, head_dim=16),
         "Qwen3MoeConfig": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, moe_intermediate_size=64, head_dim=16, num_experts=8),
         "OlmoeConfig": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             intermediate_size=64, num_experts=8),
         "MixtralConfig": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128)}


def _use_hf(family: str, tiny: bool) -> None:
    """Replace the YAML's model builder, in this process, with the transformers model `family` of
    `FAMILIES` (`NAME:LAYERS`: its blocks cut to LAYERS; `tiny`: 2 layers, for the CPU dry run)."""
    name, _, layers = family.partition(":")
    from automicro.composer import builders
    def build(cfg: Any) -> Any:
        import warnings

        import transformers
        from composer.models import HuggingFaceModel

        config_name, shape = FAMILIES[name]
        shape = {**shape, **(_TINY[config_name] if tiny else {})}
        if layers and not tiny:
            shape[next(k for k in ("num_hidden_layers", "n_layer") if k in shape)] = int(layers)
        if name == "hf":
            shape["max_position_embeddings"] = max(cfg.data.seq_len, 128)
        config = getattr(transformers, config_name)(**shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(config)
            return HuggingFaceModel(model, tokenizer=None, use_logits=True)

    builders.build_model_from = build


def _profile_batches(start_: str, count_: str, path: str) -> None:
    """`--profile START:COUNT`: every Trainer built in this process (automicro's or Composer's own)
    gets a callback that runs `torch.profiler` over batches START..START+COUNT-1 and writes, to
    `path`, the wall seconds, the GPU's busy seconds (kernels and copies summed) and the top ops by
    GPU time and by CPU time."""
    import composer
    import torch
    from composer.core import Callback

    start, count = int(start_), int(count_)
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])

    class Profile(Callback):
        def __init__(self) -> None:
            self.profiler: Any = None
            self.began = 0.0

        def batch_start(self, state: Any, logger: Any) -> None:
            if int(state.timestamp.batch) == start and self.profiler is None:
                sync()
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
                self.began = time.perf_counter()

        def batch_end(self, state: Any, logger: Any) -> None:
            if self.profiler is None or int(state.timestamp.batch) != start + count:  # batch counts after the batch
                return
            sync()
            wall = time.perf_counter() - self.began
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            device = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
            busy = sum(getattr(e, device) for e in averages) / 1e6
            with open(path, "w", encoding="utf-8") as out:
                out.write(f"batches {start}..{start + count - 1}: wall {wall:.3f} s, GPU busy {busy:.3f} s (summed over ops)\n\n")
                out.write(averages.table(sort_by=device, row_limit=45, max_name_column_width=70) + "\n\n")
                out.write(averages.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70) + "\n")
            print(f"[automicro] profile: wall {wall:.3f} s, GPU busy {busy:.3f} s over {count} batches", flush=True)
            self.profiler = None

    original = composer.Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), Profile()]
        original(self, *args, **kwargs)

    composer.Trainer.__init__ = init


def _stop_after(batches_: str) -> None:
    """`--planned N`: every Trainer built in this process (automicro's or Composer's own) runs with ``max_duration``
    N batches, as a user's run of N batches would (automicro weighs a trial's cost against the batches left), and
    stops after `batches_` of them (Composer's `state.stop_training`)."""
    import composer
    from composer.core import Callback

    batches = int(batches_)

    class StopAfter(Callback):
        def batch_end(self, state: Any, logger: Any) -> None:
            if int(state.timestamp.batch) >= batches:
                state.stop_training()

    original = composer.Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), StopAfter()]
        original(self, *args, **kwargs)

    composer.Trainer.__init__ = init


def _single_rank() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(harness.free_port()), "NODE_RANK": "0"}


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
