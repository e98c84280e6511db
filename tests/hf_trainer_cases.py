"""Multi-rank cases for `automicro.hf.AutoMicrobatchTrainer`: the Hugging Face `Trainer` on a tiny
Llama built from a config, sharded by the user's `fully_shard` (accelerate's own FSDP2 needs a GPU;
that path ran on GPUs: benchmarks/hf_trainer.py), gloo ranks on CPU, variable-length samples padded
by the data collator, `gradient_accumulation_steps` > 1.

Each worker runs every case and returns plain data for tests/test_hf_trainer.py. The reference of
every case is a plain loop written here with no automicro and no Trainer: the batches the Trainer
handed each rank (recorded), split as the run split them, each microbatch's mean loss weighted by
its share of the global batch's loss tokens, torch's clip_grad_norm_ at the Trainer's bound, AdamW
at a constant learning rate.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

from automicro.core.sites import SiteDispatcher
from automicro.engine import adopt
from automicro.testing.faults import FaultInjector
from tests.toy_models import full_state

PER_DEVICE, ACCUMULATION = 4, 2  # 8 samples per rank a step
LR, CLIP = 1e-2, 1.0
MAX_STEPS = 6


class Texts(Dataset):
    """Token sequences of 6-15 tokens (as a tokenizer without padding gives them)."""

    def __init__(self, size: int = 256, offset: int = 0) -> None:
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index += self.offset
        generator = torch.Generator().manual_seed(1000 + index)
        ids = torch.randint(0, 96, (6 + index % 10,), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sample (DataCollatorForSeq2Seq's output, without a tokenizer)."""
    longest = max(len(s["input_ids"]) for s in samples)
    out = {
        "input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
        "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long),
        "labels": torch.full((len(samples), longest), -100, dtype=torch.long),
    }
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        out["input_ids"][row, :n] = sample["input_ids"]
        out["attention_mask"][row, :n] = 1
        out["labels"][row, :n] = sample["labels"]
    return out


def llama(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama built from a config (no download), not sharded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`llama()` with every decoder layer and the root passed through `fully_shard`, and AdamW."""
    model = llama(seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def arguments(folder: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    values = dict(
        output_dir=folder, per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=ACCUMULATION,
        max_steps=MAX_STEPS, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", ddp_backend="gloo",
        lr_scheduler_type="constant", max_grad_norm=CLIP, seed=7, disable_tqdm=True, dataloader_num_workers=0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def _trainer_class() -> Any:
    from automicro.hf import AutoMicrobatchTrainer

    class Recording(AutoMicrobatchTrainer):
        """Keeps what each step saw and chose (the reference replays it) and every log line."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.seen: list[dict[str, torch.Tensor]] = []
            self.results: list[dict[str, Any]] = []
            self.logged: list[dict[str, Any]] = []

        def training_step(self, model: Any, inputs: Any, *args: Any) -> torch.Tensor:
            self.seen.append({k: v.detach().clone() for k, v in inputs.items()})
            loss = super().training_step(model, inputs, *args)
            step = self.last_step
            self.results.append({"split": step.split, "attempts": step.attempts, "size": step.size,
                                 "hooks": self.auto.hooks_active, "loss": float(loss)})
            self.history = self.auto.history
            return loss

        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            super().log(logs, *args, **kwargs)
            self.logged.append(dict(self.state.log_history[-1]))

    return Recording


def flatten(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers' own `DataCollatorWithFlattening`: every sample end to end in one row."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening()([{k: v.tolist() for k, v in s.items()} for s in samples])


def _train(
    injectors: tuple[FaultInjector, ...] = (), state: Optional[dict[str, Any]] = None,
    model_state: Optional[tuple[torch.nn.Module, torch.optim.Optimizer]] = None, dataset: Optional[Dataset] = None,
    collator: Any = collate, **overrides: Any,
) -> dict[str, Any]:
    model, optimizer = model_state or build()
    adopt(model)
    sites = SiteDispatcher()
    for injector in injectors:
        injector.arm(sites, model)
    with tempfile.TemporaryDirectory() as folder:
        eval_dataset = overrides.pop("eval_dataset", None)
        trainer = _trainer_class()(
            model=model, args=arguments(folder, **overrides), train_dataset=dataset or Texts(), data_collator=collator,
            eval_dataset=eval_dataset,
            optimizers=(optimizer, None), automicro={"stable_batches": 2, "log_attempts": False, "sites": sites},
        )
        if state is not None:
            trainer.load_search_state(state)
        trainer.train()
    for injector in injectors:
        injector.close_hooks()
    history = [dataclasses.asdict(r) for r in getattr(trainer, "history", [])]
    return {
        "results": trainer.results, "seen": trainer.seen, "logged": trainer.logged, "state": trainer.search_state(),
        "params": full_state(model), "model": model, "optimizer": optimizer, "history": history,
        "args": (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps),
        "steps": sorted({int(s["step"]) for s in optimizer.state.values() if "step" in s}),
    }


def reference(batches: list[dict[str, torch.Tensor]], splits: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A plain loop, no automicro, no Trainer: each batch at its split, weighted by loss tokens."""
    model, optimizer = build()
    world = dist.get_world_size()
    for batch, split in zip(batches, splits):
        optimizer.zero_grad(set_to_none=True)
        tokens = (batch["labels"][:, 1:] != -100).sum(dim=1).double()
        total = tokens.sum().reshape(1)
        dist.all_reduce(total)
        per_rank = float(total.item()) / world
        start = 0
        for size in split:
            microbatch = {k: v[start:start + size] for k, v in batch.items()}
            share = float(tokens[start:start + size].sum()) / per_rank
            (model(**microbatch).loss * share).backward()
            start += size
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
    return full_state(model)


def reference_flattened(batches: list[dict[str, torch.Tensor]], splits: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """`reference` for flattened rows: each microbatch the row's columns from one sample's start
    (position_ids 0) to the start of the sample `size` later."""
    model, optimizer = build()
    world = dist.get_world_size()
    for batch, split in zip(batches, splits):
        optimizer.zero_grad(set_to_none=True)
        starts = [i for i, p in enumerate(batch["position_ids"][0].tolist()) if p == 0] + [batch["input_ids"].shape[1]]
        total = (batch["labels"][:, 1:] != -100).sum().double().reshape(1)
        dist.all_reduce(total)
        per_rank = float(total.item()) / world
        first = 0
        for size in split:
            lo, hi = starts[first], starts[first + size]
            microbatch = {k: v[:, lo:hi] for k, v in batch.items()}
            share = float((microbatch["labels"][:, 1:] != -100).sum()) / per_rank
            # No KV cache in training, as the Trainer sets it (transformers 5: use_cache=False): the model then
            # keeps attention within each sample of the row from position_ids (with a cache it does not).
            (model(**microbatch, use_cache=False).loss * share).backward()
            first += size
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
    return full_state(model)


def _plain(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k not in ("model", "optimizer", "seen")}


def _error(call: Any) -> Optional[dict[str, str]]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        return {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    return None


def run_cases(rank: int, world_size: int, one_rank: int) -> dict[str, Any]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    # 1. A search where only `one_rank` runs out of memory: above 5 samples per microbatch.
    # An evaluation after step 3 (the Trainer's own, at per_device_eval_batch_size): the search re-arms after it.
    run = _train((FaultInjector("forward", ranks=[one_rank], above=5),), eval_strategy="steps", eval_steps=3,
                 per_device_eval_batch_size=4, eval_dataset=Texts(16))
    splits = [tuple(r["split"]) for r in run["results"]]
    out["search"] = {**_plain(run), "reference": reference(run["seen"], splits),
                     "whole": reference(run["seen"], [(len(b["input_ids"]),) for b in run["seen"]])}

    # 2. A steady-state OOM with the hooks off: batch 5 (batch 0 converges, 1-2 stable, hooks off from 3).
    run = _train((FaultInjector("forward", ranks=[one_rank], above=5),
                  FaultInjector("backward", ranks=[one_rank], batch=5, times=1)), max_steps=7)
    out["steady"] = {**_plain(run), "reference": reference(run["seen"], [tuple(r["split"]) for r in run["results"]])}

    # 3. Resume: 3 steps, the search state, model and optimizer kept; 3 more steps on the data after them.
    first = _train((FaultInjector("forward", above=5),), max_steps=3)
    model, optimizer = build()
    model.load_state_dict(first["model"].state_dict())
    optimizer.load_state_dict(first["optimizer"].state_dict())
    second = _train((FaultInjector("forward", above=5),), state=first["state"], model_state=(model, optimizer),
                    max_steps=3, dataset=Texts(offset=64))
    out["resume"] = {
        "first": _plain(first), "second": _plain(second),
        "reference": reference(first["seen"] + second["seen"], [tuple(r["split"]) for r in first["results"] + second["results"]]),
    }

    # 4. Flattened batches (transformers' DataCollatorWithFlattening: one row, no padding), cut at sample starts.
    run = _train((FaultInjector("forward", ranks=[one_rank], above=5),), collator=flatten, max_steps=4)
    out["flattened"] = {**_plain(run), "rows": [tuple(b["input_ids"].shape) for b in run["seen"]],
                        "reference": reference_flattened(run["seen"], [tuple(r["split"]) for r in run["results"]])}

    # 5. What is refused, with what to change.
    from automicro.hf import AutoMicrobatchTrainer

    with tempfile.TemporaryDirectory() as folder:
        model, optimizer = build()
        out["errors"] = {
            "checkpoints": _error(lambda: AutoMicrobatchTrainer(
                model=model, args=arguments(folder, save_strategy="steps", save_steps=2), train_dataset=Texts(),
                data_collator=collate, optimizers=(optimizer, None))),
            "ddp": _error(lambda: _trainer_class()(
                model=llama(), args=arguments(folder, max_steps=1), train_dataset=Texts(),
                data_collator=collate).train()),
        }
    return out
