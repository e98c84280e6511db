"""A torchtitan-style training loop with automicro's `auto` microbatching: no Composer.

The model is sharded with torch's own `fully_shard` (each block, then the root); each rank's batch
is handed whole to `AutoStep.step`, which splits it into the largest microbatches that fit on every
rank, retries smaller after an out-of-memory error on any rank (never a hang), and steps the
optimizer once. Batches are padded variable-length token rows, as a Hugging Face padding collator
makes them; the token budget (`budget="tokens"`) packs them under the tokens that fit.

    torchrun --standalone --nproc-per-node 2 examples/torch_loop.py --cpu   # 2 gloo ranks, emulated memory
    torchrun --standalone --nproc-per-node 8 examples/torch_loop.py         # 8 GPUs, as it is

On a machine without a GPU the example runs as `--cpu` does and says so in one line. `--cpu` puts an emulated per-rank memory limit on every rank (`automicro.testing.MemoryCap`, lower on
rank 0), so that the search runs out of memory on CPU as it would on a full GPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from automicro import AutoStep
from automicro.data import VariableLengthTokens, pad_collate
from automicro.models.llama import Llama, LlamaConfig


def loss_fn(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean loss over the microbatch's loss tokens (labels come shifted, -100 on padding)."""
    logits = model(microbatch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1).float(), microbatch["labels"].flatten(), ignore_index=-100)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on CPU under an emulated memory limit")
    parser.add_argument("--model", default=None, help="a LlamaConfig preset (default: tiny on CPU, 1b on GPUs)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per batch")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--median-len", type=int, default=None, help="median sample length (tokens)")
    parser.add_argument("--budget", choices=("tokens", "samples"), default="tokens")
    parser.add_argument("--cap-mib", type=float, default=None,
                        help="--cpu: the emulated limit of rank 0 in MiB (default: what a third of a batch needs)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():  # no GPU here: what --cpu runs, said once
        args.cpu = True
        if os.environ.get("RANK", "0") == "0":
            print("no GPU on this machine: running on CPU ranks (gloo) under an emulated memory limit, as --cpu does", flush=True)

    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank = dist.get_rank()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    config = LlamaConfig.from_preset(args.model or ("tiny" if args.cpu else "1b"))
    with torch.device(device):
        model = Llama(config)
    precision = MixedPrecisionPolicy() if args.cpu else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=precision)
    fully_shard(model, mp_policy=precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    median = args.median_len or (48 if args.cpu else config.max_seq_len // 4)
    data = VariableLengthTokens(args.batch * args.batches * dist.get_world_size(), config.vocab_size,
                                median_len=median, max_len=config.max_seq_len)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=False),
                        collate_fn=pad_collate, drop_last=True)

    memory, cap = None, None
    if args.cpu:
        from automicro.testing import CapMemory, MemoryCap

        cap = MemoryCap(None)
        cap.__enter__()
        cap.track_existing(model)
        if args.cap_mib is not None:
            limit = args.cap_mib * 2**20
        else:  # what the model, its optimizer state and a third of the first batch's activations need
            first = next(iter(loader))
            loss_fn(model, first).backward()
            model.zero_grad(set_to_none=True)
            limit = cap.live_bytes + 2 * sum(p.to_local().numel() * 4 for p in model.parameters()) + cap.peak_bytes / 3
        cap.set_limit(limit * (1.0 if rank == 0 else 1.5))
        memory = CapMemory(cap)

    real_tokens, seconds = 0, 0.0
    with AutoStep(model, optimizer, loss_fn, budget=args.budget, label_shift=0, memory=memory) as auto:
        for index, batch in enumerate(loader):
            if index == args.batches:
                break
            start = time.perf_counter()
            result = auto.step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            tokens = batch["attention_mask"].sum().to(device)
            dist.all_reduce(tokens)
            losses = result.loss.reshape(1).clone()
            dist.all_reduce(losses)
            losses /= dist.get_world_size()  # the global batch's mean loss
            if index > 0:  # the first batch compiles, warms up and searches
                real_tokens, seconds = real_tokens + int(tokens), seconds + time.perf_counter() - start
            if rank == 0:
                print(f"batch {index}: loss {float(losses):.4f}, split {list(result.split)}, attempts {result.attempts}, "
                      f"OOMs so far {result.ooms_total}, {int(tokens)} real tokens", flush=True)
        summary = {"ooms_total": float(auto.search.ooms_total), "batches": float(auto.batches),
                   "real_tokens_per_s": real_tokens / seconds if seconds else 0.0}
    if rank == 0:
        print(f"real (non-padding) tokens/s after the first batch: {summary['real_tokens_per_s']:.0f}", flush=True)
    if cap is not None:
        cap.__exit__(None, None, None)
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
