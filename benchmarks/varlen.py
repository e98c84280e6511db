"""Variable-length data: token budget `auto` vs sample-count `auto` vs hand-set token budgets.

    python benchmarks/varlen.py --out $OUT [--variants auto-tokens,auto-samples,fixed-16384] [--batches 14]
    python benchmarks/varlen.py --out $OUT --ranks 2 --medians 400,1000   # 2 GPUs, a length law per rank
    python benchmarks/varlen.py --out $OUT --variants auto-tokens,auto-tokens:compile   # `:compile`: compiled (each block)
    python benchmarks/varlen.py --out $OUT --variants auto-tokens:packed,fixed-16384:packed:flex   # packing (flex attention)
    python benchmarks/varlen.py --out $OUT --memory-fraction 0.35 ...   # torch's per-process cap on the GPU

One GPU (or CPU with --cpu --tiny for a dry run), or `--ranks N` under torchrun (NCCL; gloo
with --cpu), each rank reading its own samples (`--medians`: one median length per rank, in turn).
Each variant runs in its own launch (the shared harness's): a transformers `LlamaForCausalLM` (1B shape: hidden 2048, 16 layers,
32 heads, 8 KV heads, MLP 8192, vocab 32000; built from its config) in Composer's
`HuggingFaceModel`, under `automicro.Trainer` (FSDP2, amp_bf16, AdamW), on batches of 32 samples of
log-normal lengths (median 660 tokens, sigma 0.8, clipped to 64..4096) padded to each batch's
longest (`automicro.data.pad_collate`). Real tokens are the attention mask's ones. Variant options
after `:`: `compile`; `packed` (`packing: true`: each microbatch one row of its samples, no
padding); `flex` / `flash` (attn_implementation flex_attention / flash_attention_2; default sdpa);
`hooks` (the sync hooks on for the whole run, as while searching). Every allocator OOM is recorded
with the pool at that moment (`allocator_ooms`: asked, allocated, reserved, inactive split MiB).
The engine turns the allocator's expandable segments on for every variant (its default).
`--model automicro`: automicro's own Llama in the same 1B shape instead (packed rows by varlen flash
attention on CUDA with torch >= 2.10).

Per variant: real tokens/s over the batches after `--skip` (the search's; every rank's real tokens
over rank 0's seconds), padding waste of the trained microbatches, OOMs, the budget or size found,
peak memory. Writes `varlen.json` and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

VARIANTS = ("auto-tokens", "auto-samples", "fixed-8192", "fixed-16384", "fixed-32768")
PER_RANK_BATCH = 32
VOCAB = 32000


def _automicro_model(tiny: bool) -> Any:
    from automicro.models import build_model

    shape = (dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128) if tiny else
             dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192))
    return build_model("tiny", vocab_size=VOCAB, max_seq_len=4096, tie_embeddings=False, **shape)


def _model(tiny: bool, attn: str = "sdpa") -> Any:
    import warnings

    from composer.models import HuggingFaceModel
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
        if tiny else
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192)
    )
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, use_cache=False, attn_implementation=attn, **shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HuggingFaceModel(LlamaForCausalLM(config), tokenizer=None, use_logits=True)


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    from automicro.data import pad_collate

    # Hugging Face causal LMs shift the labels themselves: labels are the inputs, -100 on padding.
    return pad_collate([{"input_ids": s["input_ids"], "labels": s["input_ids"]} for s in samples])


def _collate_shifted(samples: list[dict[str, Any]]) -> dict[str, Any]:
    from automicro.data import pad_collate

    return pad_collate(samples)  # automicro's Llama: labels come shifted (the dataset's)


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from composer.core import Callback, DataSpec
    from composer.utils import dist as composer_dist
    from torch.utils.data import DataLoader

    import automicro
    from automicro.data import VariableLengthTokens, count_tokens
    from automicro.engine import _torch_internals as torch_internals

    gpu = not args.cpu
    full_name = name
    name, *options = name.split(":")  # `auto-tokens:packed:compile`: this variant packed and compiled
    unknown = set(options) - {"compile", "packed", "flex", "flash", "hooks"}
    if unknown:
        raise SystemExit(f"varlen: unknown variant option(s) {sorted(unknown)} in {full_name!r}")
    compiled = args.compile or "compile" in options
    packed = "packed" in options
    attn = "flex_attention" if "flex" in options else "flash_attention_2" if "flash" in options else "sdpa"
    rank = int(os.environ.get("RANK", "0"))
    medians = [int(m) for m in args.medians.split(",")] if args.medians else [args.median]
    if gpu and args.memory_fraction:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    ooms: list[dict[str, Any]] = []
    if gpu:
        # Every OOM the allocator raises (the search's included): what it asked for, and the pool then.
        def _on_oom(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
            stats = torch.cuda.memory_stats()
            ooms.append({"asked_mib": alloc / 2**20, "allocated_mib": stats.get("allocated_bytes.all.current", 0) / 2**20,
                         "reserved_mib": stats.get("reserved_bytes.all.current", 0) / 2**20,
                         "inactive_split_mib": stats.get("inactive_split_bytes.all.current", 0) / 2**20,
                         "segments": stats.get("segment.all.current", 0)})

        torch_internals.attach_oom_observer(_on_oom)
    torch.manual_seed(0)
    model = _automicro_model(args.tiny) if args.model == "automicro" else _model(args.tiny, attn)
    dataset = VariableLengthTokens(
        PER_RANK_BATCH * args.batches, VOCAB, median_len=medians[rank % len(medians)], sigma=0.8, min_len=64,
        max_len=args.max_len, seed=5 + rank,
    )
    # Each rank reads its own samples (its own length law): a sampler over one replica.
    sampler = composer_dist.get_sampler(dataset, shuffle=False, num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_size=PER_RANK_BATCH, sampler=sampler, drop_last=True, collate_fn=_collate_shifted if args.model == "automicro" else _collate)
    # `:hooks`: the sync hooks stay on for the whole run (as while searching), to compare memory.
    kwargs: dict[str, Any] = {"stable_batches": 10**6} if "hooks" in options else {}
    if name == "auto-samples":
        auto = automicro.AutoMicrobatching(log_attempts=True, **kwargs)
    elif name == "auto-tokens":
        auto = automicro.AutoMicrobatching(log_attempts=True, budget="tokens", packing=packed, **kwargs)
    else:
        auto = automicro.AutoMicrobatching(log_attempts=True, budget="tokens", fixed_tokens=int(name.split("-")[1]),
                                           packing=packed, **kwargs)

    rows: list[dict[str, Any]] = []

    class Clock(Callback):
        def batch_start(self, state: Any, logger: Any) -> None:
            if gpu:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            mask = state.batch.get("attention_mask")
            self.real = int(mask.sum()) if mask is not None else int(state.batch["input_ids"].numel())
            self.padded = int(state.batch["input_ids"].numel())
            self.held = ((torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20) if gpu
                         else (None, None))

        def batch_end(self, state: Any, logger: Any) -> None:
            if gpu:
                torch.cuda.synchronize()
            rows.append({"seconds": time.perf_counter() - self.t0, "real": self.real, "batch_padded": self.padded,
                         "split": list(auto.used_split), "attempts": auto.batch_attempts,
                         # The caching allocator's cudaMalloc retries so far (a fragmented pool frees and retries).
                         "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if gpu else None,
                         "start_allocated_mib": self.held[0], "start_reserved_mib": self.held[1],
                         "ooms_so_far": len(ooms)})

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=gpu)
    trainer = automicro.Trainer(
        model=model, train_dataloader=DataSpec(loader, get_num_tokens_in_batch=count_tokens),
        max_duration=f"{args.batches}ba", optimizers=optimizer, device="gpu" if gpu else "cpu",
        precision="amp_bf16" if gpu else "fp32", parallelism_config={"fsdp2": {}},
        device_train_microbatch_size="auto", callbacks=[auto, Clock()], loggers=[], progress_bar=False,
        log_to_console=False, compile=({"backend": "inductor" if gpu else "aot_eager"} if compiled else None),
    )
    from automicro.engine.compile import compiled_graphs

    graphs_before = compiled_graphs()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    error: Optional[str] = None
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a row of the table
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    steady = rows[args.skip:]
    seconds = sum(r["seconds"] for r in steady)
    result = {
        "variant": full_name,
        "packed": bool(auto.tokens is not None and auto.tokens.packing),
        "attn": attn,
        "error": error,
        "batches": len(rows),
        "real_tokens_per_s": (sum(r["real"] for r in steady) / seconds) if seconds else None,
        "ooms": auto.ooms_total,
        "found": auto.found_size,
        "padding_waste": None if auto.tokens is None else auto.tokens.padding_waste,
        "microbatches": sorted({len(r["split"]) for r in steady}),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "graphs": compiled_graphs() - graphs_before,
        "compile": compiled,
        "rows": rows,
        "allocator_ooms": ooms,
    }
    if auto.tokens is None and rows:
        # Sample-count splits keep each microbatch padded to the batch's longest sample.
        padded = sum(r["batch_padded"] for r in rows)
        result["padding_waste"] = 1 - sum(r["real"] for r in rows) / padded
    trainer.close()
    return result


def _gather(out: str, name: str, nproc: int, skip: int) -> Optional[dict[str, Any]]:
    """Rank 0's result, with every rank's real tokens over rank 0's seconds (None: rank 0 wrote none)."""
    result = harness.gather_ranks(out, f"varlen_{name}", nproc, skip,
                                  ("found", "ooms", "padding_waste", "microbatches", "peak_gib", "error", "rows"))
    if result is not None and nproc > 1:
        for rank in result["per_rank"]:
            rank["alloc_retries"] = [row.get("alloc_retries") for row in rank.pop("rows") or []]
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    p.add_argument("--variants", default=",".join(VARIANTS[:4]))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process
    p.add_argument("--batches", type=int, default=14)
    p.add_argument("--skip", type=int, default=6, help="batches left out of the throughput (the search's)")
    p.add_argument("--median", type=int, default=660)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--compile", action="store_true", help="compile: each block (inductor; aot_eager with --cpu), dynamic: null")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (dry run of the suite)")
    p.add_argument("--memory-fraction", type=float, default=0.0, help="torch's per-process memory fraction (0: none)")
    p.add_argument("--model", choices=("hf", "automicro"), default="hf", help="transformers' Llama or automicro's (1B shape)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--ranks", dest="nproc", type=int, default=1, help="ranks per launch (torchrun); NCCL on GPUs, gloo with --cpu")
    p.add_argument("--medians", default="", help="median sample length per rank, comma-separated, in turn (default: --median)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.variant:
        # A launch that stalls (`benchmarks/RESULTS.md` 2026-11-28, packing: a hand-set budget packed with flex attention trained no
        # batch) prints every thread's stack shortly before the runner's timeout ends it.
        return harness.run_variant_here(args.out, f"varlen_{args.variant}", lambda: run_variant(args.variant, args), args.timeout,
                                        args.nproc, args.cpu)
    passthrough = [f"--out={args.out}", f"--batches={args.batches}", f"--skip={args.skip}", f"--median={args.median}",
                   f"--max-len={args.max_len}", f"--ranks={args.nproc}", f"--medians={args.medians}",
                   f"--memory-fraction={args.memory_fraction}", f"--model={args.model}", f"--timeout={args.timeout}"]
    passthrough += (["--cpu"] if args.cpu else []) + (["--tiny"] if args.tiny else []) + (["--compile"] if args.compile else [])
    results = []
    for name in args.variants.split(","):
        started = time.perf_counter()
        argv = ([sys.executable, os.path.abspath(__file__)] if args.nproc == 1 else
                harness.torchrun(args.nproc, os.path.basename(__file__)))
        done = harness.run_launch([*argv, f"--variant={name}", *passthrough], args.timeout)
        result = _gather(args.out, name, args.nproc, args.skip)
        if result is None:
            result = {"variant": name, "error": f"no result (rc {done.returncode}): {done.stderr[-600:]}",
                      "stderr_tail": (done.stderr or "")[-12000:]}  # a stalled launch's stack dump
        result["launch_s"] = round(time.perf_counter() - started, 1)
        lines = [line for line in (done.stdout or "").splitlines() if line.startswith("[automicro]")]
        result["console"] = lines[-40:]
        print(f"[varlen:detail] {name}: " + " / ".join(lines[-6:]), flush=True)
        results.append(result)
    base = next((r for r in results if r["variant"] == "auto-samples" and r.get("real_tokens_per_s")), None)
    # The best hand-set padded budget of this call (same compile setting as the row it is set against).
    def best_fixed(compiled: bool) -> Optional[float]:
        rates = [r["real_tokens_per_s"] for r in results if r["variant"].startswith("fixed-") and not r.get("packed")
                 and r.get("real_tokens_per_s") and bool(r.get("compile")) == compiled]
        return max(rates, default=None)

    rows = []
    for r in results:
        tps = r.get("real_tokens_per_s")
        best = best_fixed(bool(r.get("compile")))
        r["vs_best_fixed_padded"] = tps / best if tps and best else None
        rows.append([
            r["variant"], harness.fmt(tps, ",.0f") if tps else "–",
            harness.fmt(tps / base["real_tokens_per_s"], ".2f") if tps and base else "–",
            harness.fmt(r["vs_best_fixed_padded"], ".2f") if r["vs_best_fixed_padded"] else "–",
            r.get("found", "–"), r.get("microbatches", "–"), harness.fmt(r.get("padding_waste"), ".2f"),
            r.get("ooms", "–"), harness.fmt(r.get("peak_gib"), ".1f"), r.get("graphs", "–"), (r.get("error") or "")[:60],
        ])
    header = ["variant", "real tokens/s", "vs auto-samples", "vs best fixed padded", "found", "microbatches", "padding", "OOMs", "peak GiB", "graphs", "error"]
    for line in harness.table_lines(header, rows):
        print(f"[varlen] | {line}", flush=True)
    harness.write_json(os.path.join(args.out, "varlen.json"), {"args": vars(args), "results": results})
    with open(os.path.join(args.out, "varlen_table.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(harness.table_lines(header, rows)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
