"""A plain PyTorch loop (no Composer): `AutoStep` against the same loop at fixed microbatch sizes and
against accelerate's `find_executable_batch_size`, one GPU, same model and memory.

    python benchmarks/torch_loop.py --out $OUT [--variants auto,accelerate,fixed-8,fixed-16] [--batches 14]
    python benchmarks/torch_loop.py --out $OUT --memory-fraction 0.45 ...   # torch's per-process cap
    python benchmarks/torch_loop.py --out $OUT --cpu --tiny                  # the plumbing on CPU
    python benchmarks/torch_loop.py --out $OUT --ranks 2 --memory-fractions 0.6,0.3   # 2 GPUs, one tighter

The loop is torchtitan's: automicro's Llama in the 1B shape (hidden 2048, 16 layers, 32 heads, 8 KV
heads, MLP 8192, vocab 32000), each block and the root through torch's own `fully_shard` (bf16
parameters, fp32 reduce), fused AdamW, 32 rows of 2048 synthetic tokens per batch (`--varlen`:
log-normal lengths, median 660, padded to each batch's longest as a padding collator does), the loss
per token (cross entropy over the labels that are not -100). Each variant runs in its own process:

- `auto`: `AutoStep(model, optimizer, loss_fn)`, every batch handed whole (`auto-tokens`: with
  ``budget="tokens"``);
- `fixed-K`: the same loop, the batch cut into microbatches of K rows, gradients accumulated by hand;
- `accelerate`: accelerate's `find_executable_batch_size(starting_batch_size=32)` around the training
  function, the microbatch its batch size and the accumulation steps 32 / microbatch (the way its
  docs pair it with gradient accumulation): after an OOM it frees memory, halves, and starts the
  function again from the first batch.

With `--ranks N` each variant runs under torchrun on N GPUs (NCCL), each rank on its own data and
its own per-process memory fraction (`--memory-fractions`, in turn): accelerate's search then runs
on each rank alone, as it does for its users (no agreement between ranks).

Per variant: seconds from the start of training to the first full batch trained, OOMs, real
(non-padding) tokens/s over the batches after `--skip`, the microbatch in use, peak memory. Writes
`torch_loop.json` and a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

BATCH = 32
VOCAB = 32000
VARIANTS = ("auto", "accelerate", "fixed-4", "fixed-8", "fixed-16")


def _model(tiny: bool, device: Any) -> Any:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from automicro.models.llama import Llama, LlamaConfig

    shape = (dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128) if tiny else
             dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192))
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(LlamaConfig(vocab_size=VOCAB, max_seq_len=2048, tie_embeddings=False, **shape))
    precision = (MixedPrecisionPolicy() if device.type == "cpu" else
                 MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for block in model.blocks:
        fully_shard(block, mp_policy=precision)
    fully_shard(model, mp_policy=precision)
    return model


def _batches(args: argparse.Namespace, rank: int) -> list[dict[str, Any]]:
    import torch

    from automicro.data import VariableLengthTokens, pad_collate

    seq = 128 if args.tiny else 2048
    if args.varlen:
        data = VariableLengthTokens(BATCH * args.batches, VOCAB, median_len=args.median, sigma=0.8, min_len=64, max_len=seq, seed=5 + rank)
        return [pad_collate([data[b * BATCH + i] for i in range(BATCH)]) for b in range(args.batches)]
    generator = torch.Generator().manual_seed(5 + rank)
    out = []
    for _ in range(args.batches):
        tokens = torch.randint(0, VOCAB, (BATCH, seq + 1), generator=generator)
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "attention_mask": torch.ones(BATCH, seq, dtype=torch.long)})
    return out


def loss_fn(model: Any, microbatch: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    logits = model(microbatch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1).float(), microbatch["labels"].flatten(), ignore_index=-100)


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from automicro.engine import _torch_internals as torch_internals

    gpu = not args.cpu
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo")
    world = dist.get_world_size()
    fractions = [float(f) for f in args.memory_fractions.split(",")] if args.memory_fractions else [args.memory_fraction]
    if gpu:
        torch.cuda.set_device(device)
        if fractions[rank % len(fractions)]:
            torch.cuda.set_per_process_memory_fraction(fractions[rank % len(fractions)])
    ooms: list[float] = []
    if gpu:
        torch_internals.attach_oom_observer(lambda device_, alloc, allocated, free: ooms.append(alloc / 2**20))
    model = _model(args.tiny, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=gpu)
    batches = _batches(args, rank)
    rows: list[dict[str, Any]] = []
    error: Optional[str] = None
    first_full: Optional[float] = None
    caught = 0  # OOMs the variant itself saw (an allocator OOM raised out of a step)
    microbatch_in_use: Any = None

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def record(batch: dict[str, Any], started: float, split: Any, attempts: int) -> None:
        nonlocal first_full
        sync()
        now = time.perf_counter()
        if first_full is None:
            first_full = now - start
        rows.append({"seconds": now - started, "real": int(batch["attention_mask"].sum()), "split": list(split), "attempts": attempts})

    def accumulate(batch: dict[str, Any], size: int) -> list[int]:
        """One batch at microbatches of `size` rows, the loss weighted per token as one batch."""
        optimizer.zero_grad(set_to_none=True)
        # This rank's share of the global batch's loss tokens (FSDP2 averages the gradients over ranks).
        total = torch.tensor([float((batch["labels"] != -100).sum())], device=device)
        dist.all_reduce(total)
        tokens = float(total.item()) / world
        split = []
        for lo in range(0, BATCH, size):
            mb = {k: v[lo:lo + size].to(device, non_blocking=True) for k, v in batch.items()}
            share = float((mb["labels"] != -100).sum()) / tokens
            (loss_fn(model, mb) * share).backward()
            split.append(min(size, BATCH - lo))
        optimizer.step()
        return split

    if gpu:
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    try:
        if name in ("auto", "auto-tokens"):
            from automicro import AutoStep

            budget = "tokens" if name == "auto-tokens" else "samples"
            with AutoStep(model, optimizer, loss_fn, budget=budget, loss_normalization="tokens", label_shift=0) as auto:
                for batch in batches:
                    started = time.perf_counter()
                    result = auto.step(batch)
                    record(batch, started, result.split, result.attempts)
                caught = auto.search.ooms_total
                microbatch_in_use = auto.found_size
        elif name.startswith("fixed-"):
            size = int(name.split("-")[1])
            microbatch_in_use = size
            for batch in batches:
                started = time.perf_counter()
                record(batch, started, accumulate(batch, size), 1)
        elif name == "accelerate":
            from accelerate.utils import find_executable_batch_size

            tries: list[int] = []

            @find_executable_batch_size(starting_batch_size=BATCH)
            def train(size: int) -> None:
                nonlocal microbatch_in_use
                tries.append(size)
                microbatch_in_use = size
                rows.clear()  # the function starts again from the first batch
                for batch in batches:
                    started = time.perf_counter()
                    record(batch, started, accumulate(batch, size), len(tries))

            train()
            caught = len(tries) - 1
        else:
            raise SystemExit(f"torch_loop: unknown variant {name!r} (auto, auto-tokens, accelerate, fixed-K)")
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a row of the table
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    steady = rows[args.skip:]
    seconds = sum(r["seconds"] for r in steady)
    result = {
        "variant": name, "error": error, "batches": len(rows),
        "first_full_batch_s": first_full,
        "real_tokens_per_s": sum(r["real"] for r in steady) / seconds if seconds else None,
        "ooms": caught, "allocator_ooms": len(ooms),
        "microbatch": microbatch_in_use,
        "microbatches": sorted({len(r["split"]) for r in steady}),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "rows": rows,
    }
    dist.destroy_process_group()
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process
    p.add_argument("--batches", type=int, default=14)
    p.add_argument("--skip", type=int, default=6, help="batches left out of the throughput (the search's)")
    p.add_argument("--varlen", action="store_true", help="log-normal lengths padded per batch (default: full 2048-token rows)")
    p.add_argument("--median", type=int, default=660)
    p.add_argument("--memory-fraction", type=float, default=0.0, help="torch's per-process memory fraction (0: none)")
    p.add_argument("--memory-fractions", default="", help="one fraction per rank, comma-separated, in turn (--ranks)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per launch (torchrun): NCCL on GPUs, gloo with --cpu")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same as --cpu (run.py --cpu)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--timeout", type=float, default=150.0)
    args = p.parse_args(argv)
    args.cpu = args.cpu or args.device == "cpu"
    os.makedirs(args.out, exist_ok=True)
    if args.variant:
        return harness.run_variant_here(args.out, f"torch_loop_{args.variant}", lambda: run_variant(args.variant, args), args.timeout,
                                        args.ranks, args.cpu)
    passthrough = [f"--out={args.out}", f"--batches={args.batches}", f"--skip={args.skip}", f"--median={args.median}",
                   f"--memory-fraction={args.memory_fraction}", f"--memory-fractions={args.memory_fractions}",
                   f"--ranks={args.ranks}", f"--timeout={args.timeout}"]
    passthrough += ["--cpu"] * args.cpu + ["--tiny"] * args.tiny + ["--varlen"] * args.varlen
    argv = ([sys.executable, os.path.abspath(__file__)] if args.ranks == 1 else harness.torchrun(args.ranks, os.path.basename(__file__)))
    return harness.compare_variants("torch_loop", args.variants.split(","), passthrough, args.out, args.ranks, args.skip,
                                    args.timeout, argv, vars(args))


if __name__ == "__main__":
    sys.exit(main())
