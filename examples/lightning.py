"""Lightning with automicro's `auto` microbatching: manual optimization on `AutoStep`.

A Llama built from a config, sharded with FSDP2 in `configure_model` (`ModelParallelStrategy`),
variable-length samples padded by the collator; the loader's batch (16 samples per rank) is the batch
of one optimizer step, and automicro splits it into the largest microbatches that fit on every rank.
After an out-of-memory error on any rank every rank retries smaller (never a hang).

    torchrun --standalone --nproc-per-node 2 examples/lightning.py --cpu   # 2 gloo ranks, emulated memory
    python examples/lightning.py --devices 8                               # 8 GPUs (Lightning launches them)

On a machine without a GPU the example runs as `--cpu` does and says so in one line. `--cpu` puts an emulated per-rank memory limit on every rank (`automicro.testing.MemoryCap`, lower on
rank 0), so that the search runs out of memory on CPU as it would on a full GPU.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from automicro.data import VariableLengthTokens, pad_collate
from automicro.lightning import AutoMicrobatch


class Samples(torch.utils.data.Dataset):
    """Token sequences of log-normal length, as a tokenizer gives them (the model shifts the labels)."""

    def __init__(self, count: int, median: int, longest: int) -> None:
        self.tokens = VariableLengthTokens(count, 32000, median_len=median, max_len=longest)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]["input_ids"]
        return {"input_ids": ids, "labels": ids.clone()}


class LitLlama(pl.LightningModule):
    def __init__(self, shape: dict[str, int], cap_fraction: float = 0.0) -> None:
        super().__init__()
        self.automatic_optimization = False  # the step is automicro's
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **shape))
        self.cap_fraction = cap_fraction

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        cpu = self.device_mesh.device_type == "cpu"
        precision = MixedPrecisionPolicy() if cpu else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=precision)
        fully_shard(self.model, mesh=mesh, mp_policy=precision)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-4)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        result = self.auto.step(batch)  # split, run, agree, retry after an OOM, optimizer.step()
        self.log("loss", result.loss, prog_bar=True)
        if self.global_rank == 0:
            print(f"step {batch_idx}: split {list(result.split)}, attempts {result.attempts}, OOMs so far {result.ooms_total}",
                  flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on CPU under an emulated memory limit")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():  # no GPU here: what --cpu runs, said once
        args.cpu = True
        if os.environ.get("RANK", "0") == "0":
            print("no GPU on this machine: running on CPU ranks (gloo) under an emulated memory limit, as --cpu does", flush=True)

    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  max_position_embeddings=256) if args.cpu else
             dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, max_position_embeddings=2048))
    longest = shape["max_position_embeddings"]
    data = Samples(16 * args.devices * args.steps, median=longest // 4, longest=longest)
    loader = torch.utils.data.DataLoader(data, batch_size=16, collate_fn=pad_collate)
    settings: dict[str, Any] = {"budget": "tokens"}
    cap = None
    if args.cpu:
        from automicro.testing import CapMemory, MemoryCap

        cap = MemoryCap(None)
        cap.__enter__()
        settings["memory"] = CapMemory(cap)
    callbacks: list[Any] = [AutoMicrobatch(**settings)]
    if cap is not None:
        callbacks.append(_CapAfterSharding(cap, data))
    trainer = pl.Trainer(
        accelerator="cpu" if args.cpu else "gpu", devices=args.devices, max_steps=args.steps, logger=False,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1), callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = LitLlama(shape)
    trainer.fit(module, loader)
    if cap is not None:
        cap.__exit__(None, None, None)
    if trainer.global_rank == 0:
        print(f"trained {trainer.global_step} steps", flush=True)
    return {"steps": trainer.global_step}


class _CapAfterSharding(pl.Callback):
    """--cpu: the emulated limit, set once the model is sharded: what the model, its optimizer state and
    a third of a step's activations need (half again more on the other ranks)."""

    def __init__(self, cap: Any, data: Samples) -> None:
        self.cap, self.data = cap, data

    def on_fit_start(self, trainer: pl.Trainer, pl_module: LitLlama) -> None:
        model = pl_module.model
        self.cap.track_existing(model)
        model(**pad_collate([self.data[i] for i in range(16)])).loss.backward()
        model.zero_grad(set_to_none=True)
        limit = self.cap.live_bytes + 2 * sum(p.to_local().numel() * 4 for p in model.parameters()) + self.cap.peak_bytes / 3
        self.cap.set_limit(limit * (1.0 if trainer.global_rank == 0 else 1.5))


if __name__ == "__main__":
    main()
