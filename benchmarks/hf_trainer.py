"""The Hugging Face `Trainer` with FSDP2 as accelerate configures it: automicro's
`AutoMicrobatchTrainer` against the plain `Trainer` at fixed microbatch sizes (its own gradient
accumulation) and against the Trainer's own `auto_find_batch_size`, same model, data and memory.

    python benchmarks/hf_trainer.py --out $OUT [--variants auto,hf-auto,fixed-8,fixed-16] [--steps 14]
    python benchmarks/hf_trainer.py --out $OUT --memory-fraction 0.45      # torch's per-process cap
    python benchmarks/hf_trainer.py --out $OUT --variants auto-resume       # a checkpoint, then train(resume_from_checkpoint=True)

The model is transformers' `LlamaForCausalLM` in the 1B shape (hidden 2048, 16 layers, 32 heads, 8
KV heads, MLP 8192, vocab 32000) built from a config, sharded by accelerate's FSDP2
(``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``, decoder layers wrapped), bf16, sdpa;
each rank's step takes 32 samples of log-normal length (median 660, at most 2048 tokens) padded by
the collator to the batch's longest. Every variant runs under torchrun in its own process:

- `auto`: `AutoMicrobatchTrainer`, ``per_device_train_batch_size=32`` (the Trainer hands the whole
  step's batch; automicro splits it); `auto-tokens`: with ``budget="tokens"``;
- `fixed-K`: the plain `Trainer`, ``per_device_train_batch_size=K``, ``gradient_accumulation_steps=32/K``;
- `hf-auto`: the plain `Trainer` with ``auto_find_batch_size=True`` from 32 (it halves the per-device
  batch after an OOM and restarts training; the accumulation stays 1, so its batch shrinks);
- `auto-resume`: `auto` for half the steps with a checkpoint at the end, a new model and
  `AutoMicrobatchTrainer` in the same process, ``train(resume_from_checkpoint=True)`` for the rest.

Per variant: seconds from `train()` to the end of the first full step, OOMs, real (non-padding)
tokens/s over the steps after `--skip`, the microbatch in use, peak memory. Writes `hf_trainer.json`
and a table.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

BATCH = 32
VOCAB = 32000
VARIANTS = ("auto", "hf-auto", "fixed-4", "fixed-8", "fixed-16")


def _model(tiny: bool, device: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
             if tiny else dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               intermediate_size=8192))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=False, attn_implementation="sdpa", **shape)
    with torch.device(device):
        return LlamaForCausalLM(config)


class _Samples:
    """Log-normal lengths, the samples a tokenizer gives without padding (a map-style dataset)."""

    def __init__(self, count: int, median: int, longest: int, seed: int) -> None:
        from automicro.data import VariableLengthTokens

        self.data = VariableLengthTokens(count, VOCAB, median_len=median, sigma=0.8, min_len=64, max_len=longest, seed=seed)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = self.data[index]["input_ids"]
        return {"input_ids": ids, "labels": ids.clone()}  # the model shifts the labels


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    out = {"input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
           "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long),
           "labels": torch.full((len(samples), longest), -100, dtype=torch.long)}
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        out["input_ids"][row, :n], out["attention_mask"][row, :n], out["labels"][row, :n] = sample["input_ids"], 1, sample["labels"]
    return out


def _recording(base: Any) -> Any:
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            self.trainer.step_started = time.perf_counter()
            self.trainer.step_tokens = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            now = time.perf_counter()
            trainer = self.trainer
            if trainer.first_full is None:
                trainer.first_full = now - trainer.train_started
            last = getattr(trainer, "last_step", None)
            trainer.rows.append({"seconds": now - trainer.step_started, "real": trainer.step_tokens,
                                 "per_device": trainer._train_batch_size,
                                 "split": list(last.split) if last is not None else None,
                                 "attempts": last.attempts if last is not None else None})

    class Recording(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rows: list[dict[str, Any]] = []
            self.first_full: Optional[float] = None
            self.step_tokens = 0
            self.add_callback(Clock(self))

        def train(self, *args: Any, **kwargs: Any) -> Any:
            torch.cuda.synchronize()
            self.train_started = time.perf_counter()
            return super().train(*args, **kwargs)

        def training_step(self, model: Any, inputs: Any, *args: Any) -> Any:
            self.step_tokens += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args)

    return Recording


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainingArguments

    from automicro.engine import _torch_internals as torch_internals
    from automicro.hf import AutoMicrobatchTrainer

    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    fractions = [float(f) for f in args.memory_fractions.split(",")] if args.memory_fractions else [args.memory_fraction]
    if fractions[rank % len(fractions)]:
        torch.cuda.set_per_process_memory_fraction(fractions[rank % len(fractions)])
    ooms: list[float] = []
    torch_internals.attach_oom_observer(lambda device_, alloc, allocated, free: ooms.append(alloc / 2**20))
    seq = 128 if args.tiny else 2048
    folder = tempfile.mkdtemp(prefix=f"hf_{name}_")
    auto = name.startswith("auto")
    size = int(name.split("-")[1]) if name.startswith("fixed-") else BATCH

    def trainer_for(steps: int, **extra: Any) -> Any:
        training = TrainingArguments(
            output_dir=folder, per_device_train_batch_size=size, gradient_accumulation_steps=BATCH // size,
            max_steps=steps, bf16=True, learning_rate=1e-5, lr_scheduler_type="constant", report_to=[], logging_steps=1,
            disable_tqdm=True, dataloader_num_workers=2, seed=5, optim="adamw_torch_fused",
            auto_find_batch_size=name == "hf-auto", fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True},
            **extra,
        )
        dataset = _Samples(BATCH * int(os.environ.get("WORLD_SIZE", "1")) * (args.steps + 2), args.median, seq, seed=5)
        kwargs: dict[str, Any] = dict(model=_model(args.tiny, device), args=training, train_dataset=dataset, data_collator=collate)
        if auto:
            kwargs["automicro"] = {"budget": "tokens" if name == "auto-tokens" else "samples"}
        return _recording(AutoMicrobatchTrainer if auto else Trainer)(**kwargs)

    torch.cuda.reset_peak_memory_stats()
    error: Optional[str] = None
    trainer: Any = None
    resumed: dict[str, Any] = {}
    try:
        if name == "auto-resume":
            half = args.steps // 2
            trainer = trainer_for(half, save_strategy="steps", save_steps=half)
            trainer.train()
            first_rows, first_full = trainer.rows, trainer.first_full
            saved = trainer.search_state()
            del trainer
            gc.collect()
            torch.cuda.empty_cache()
            trainer = trainer_for(args.steps, save_strategy="no")
            trainer.train(resume_from_checkpoint=True)
            resumed = {"saved_split": saved["search"].get("policy", {}).get("split") if saved else None,
                       "first_rows": first_rows, "resumed_rows": trainer.rows,
                       "state_file": os.path.exists(os.path.join(folder, f"checkpoint-{half}", "automicro_state.json"))}
            trainer.rows, trainer.first_full = first_rows + trainer.rows, first_full
        else:
            trainer = trainer_for(args.steps, save_strategy="no")
            trainer.train()
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a row of the table
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    rows = trainer.rows if trainer is not None else []
    steady = rows[args.skip:]
    seconds = sum(r["seconds"] for r in steady)
    last = getattr(trainer, "last_step", None)
    return {
        "variant": name, "error": error, "batches": len(rows),
        "first_full_batch_s": getattr(trainer, "first_full", None),
        "real_tokens_per_s": sum(r["real"] for r in steady) / seconds if seconds else None,
        "ooms": last.ooms_total if last is not None else len(ooms), "allocator_ooms": len(ooms),
        "microbatch": (last.size if last is not None else rows[-1]["per_device"] if rows else None),
        "microbatches": sorted({len(r["split"]) if r.get("split") else BATCH // max(1, r["per_device"]) for r in steady}),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "rows": rows, "resume": resumed,
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--skip", type=int, default=6, help="steps left out of the throughput (the search's)")
    p.add_argument("--median", type=int, default=660)
    p.add_argument("--memory-fraction", type=float, default=0.0, help="torch's per-process memory fraction (0: none)")
    p.add_argument("--memory-fractions", default="", help="one fraction per rank, comma-separated, in turn (--ranks)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per launch (torchrun, NCCL)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--timeout", type=float, default=200.0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.variant:
        return harness.run_variant_here(args.out, f"hf_trainer_{args.variant}", lambda: run_variant(args.variant, args),
                                        args.timeout, args.ranks, False)
    passthrough = [f"--out={args.out}", f"--steps={args.steps}", f"--skip={args.skip}", f"--median={args.median}",
                   f"--memory-fraction={args.memory_fraction}", f"--memory-fractions={args.memory_fractions}",
                   f"--ranks={args.ranks}", f"--timeout={args.timeout}"] + ["--tiny"] * args.tiny
    return harness.compare_variants("hf_trainer", args.variants.split(","), passthrough, args.out, args.ranks, args.skip,
                                    args.timeout, harness.torchrun(args.ranks, os.path.basename(__file__)), vars(args),
                                    first="first full step s")


if __name__ == "__main__":
    sys.exit(main())
