"""The Hugging Face `Trainer` with automicro's `auto` microbatching: `AutoMicrobatchTrainer`.

A Llama built from a config, variable-length samples padded by the collator, 16 samples per rank a
step (``per_device_train_batch_size=4`` x ``gradient_accumulation_steps=4``): automicro hands the
16 to each step whole and finds the largest microbatches that fit on every rank; after an
out-of-memory error on any rank every rank retries smaller (never a hang); the global batch stays
what the arguments say.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --cpu   # 2 gloo ranks, emulated memory
    torchrun --standalone --nproc-per-node 8 examples/hf_trainer.py         # 8 GPUs, accelerate's FSDP2
    accelerate launch --num-processes 8 examples/hf_trainer.py              # the same

On a machine without a GPU the example runs as `--cpu` does and says so in one line. On GPUs accelerate shards the model with FSDP2 (``fsdp_config={"fsdp_version": 2}``). On CPU (`--cpu`)
accelerate's FSDP is not available: the script shards the model itself with torch's `fully_shard` and
puts an emulated per-rank memory limit on every rank (`automicro.testing.MemoryCap`, lower on rank 0),
so that the search runs out of memory on CPU as it would on a full GPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from automicro.data import VariableLengthTokens, pad_collate
from automicro.hf import AutoMicrobatchTrainer


class Samples(torch.utils.data.Dataset):
    """Token sequences of log-normal length, as a tokenizer gives them (the model shifts the labels)."""

    def __init__(self, count: int, vocab: int, median: int, longest: int) -> None:
        self.tokens = VariableLengthTokens(count, vocab, median_len=median, max_len=longest)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]["input_ids"]
        return {"input_ids": ids, "labels": ids.clone()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on CPU under an emulated memory limit")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", choices=("tokens", "samples"), default="tokens")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():  # no GPU here: what --cpu runs, said once
        args.cpu = True
        if os.environ.get("RANK", "0") == "0":
            print("no GPU on this machine: running on CPU ranks (gloo) under an emulated memory limit, as --cpu does", flush=True)

    if args.cpu:
        dist.init_process_group("gloo")
    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  max_position_embeddings=256) if args.cpu else
             dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, max_position_embeddings=2048))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **shape))
    longest = shape["max_position_embeddings"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Samples(16 * world * args.steps, 32000, median=longest // 4, longest=longest)

    common = dict(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="automicro_hf_"), per_device_train_batch_size=4,
        gradient_accumulation_steps=4, max_steps=args.steps, learning_rate=3e-4, logging_steps=1, report_to=[],
        disable_tqdm=True, seed=0,
    )
    settings: dict = {"budget": args.budget}
    if args.cpu:
        from torch.distributed.fsdp import fully_shard

        from automicro.testing import CapMemory, MemoryCap

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        cap = MemoryCap(None)
        cap.__enter__()
        cap.track_existing(model)
        # What the model, its optimizer state and a third of a step's activations need (more on rank 1).
        probe = pad_collate([data[i] for i in range(16)])
        model(**probe).loss.backward()
        model.zero_grad(set_to_none=True)
        limit = cap.live_bytes + 2 * sum(p.to_local().numel() * 4 for p in model.parameters()) + cap.peak_bytes / 3
        cap.set_limit(limit * (1.0 if dist.get_rank() == 0 else 1.5))
        settings["memory"] = CapMemory(cap)
        training = TrainingArguments(**common, use_cpu=True, ddp_backend="gloo", save_strategy="no")
    else:
        training = TrainingArguments(
            **common, bf16=True, save_strategy="steps", save_steps=args.steps, fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        )

    trainer = AutoMicrobatchTrainer(model=model, args=training, train_dataset=data, data_collator=pad_collate,
                                    automicro=settings)
    trainer.train()
    last = trainer.last_step
    summary = {"steps": float(trainer.state.global_step), "ooms_total": float(last.ooms_total),
               "microbatch": float(max(last.split))}
    if trainer.is_world_process_zero():
        print(f"trained {trainer.state.global_step} steps; split in use {list(last.split)}, OOMs {last.ooms_total}", flush=True)
    if args.cpu:
        cap.__exit__(None, None, None)
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
