"""Multi-rank cases for `automicro.lightning.AutoMicrobatch`: Lightning's `Trainer` with
`ModelParallelStrategy` (FSDP2 in the module's `configure_model`), manual optimization on
`AutoStep`, a tiny Llama built from a config, gloo ranks on CPU, padded variable-length samples.

Each worker runs every case and returns plain data for tests/test_lightning.py. The reference of
every case is a plain loop with no automicro and no Lightning over the batches each rank trained on
(recorded), split as the run split them, each microbatch's mean loss weighted by its samples' share
of the global batch, AdamW.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from automicro.data import VariableLengthTokens, pad_collate
from automicro.testing.faults import FaultInjector
from tests.hf_trainer_cases import llama
from tests.toy_models import full_state

BATCH, LR, STEPS = 8, 1e-2, 6


class Samples(torch.utils.data.Dataset):
    def __init__(self, count: int = 256, seed: int = 3) -> None:
        self.tokens = VariableLengthTokens(count, 96, median_len=10, max_len=24, seed=seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]["input_ids"]
        return {"input_ids": ids, "labels": ids.clone()}


def _module_class() -> Any:
    import pytorch_lightning as pl

    class LitLlama(pl.LightningModule):
        def __init__(self, injectors: tuple[FaultInjector, ...] = ()) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.model = llama()
            self.injectors = injectors
            self.seen: list[dict[str, torch.Tensor]] = []
            self.results: list[dict[str, Any]] = []

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=LR)

        def on_train_start(self) -> None:
            from automicro.engine import _torch_internals as internals

            # Every group the FSDP2 modules issue collectives on is one the ledger can replay on (a second fit
            # in a process builds a second mesh over the same ranks: torch 2.7 answered the first one's group).
            tracked = self.auto.runtime.ledger.groups
            self.groups_tracked = all(any(g is t for t in tracked)
                                      for g in internals.fsdp_process_groups(self.auto.sharded.fsdp_modules))
            for injector in self.injectors:
                injector.arm(self.auto.sites, self.model)

        def on_train_end(self) -> None:
            for injector in self.injectors:
                injector.close_hooks()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.seen.append({k: v.detach().clone() for k, v in batch.items()})
            result = self.auto.step(batch)
            self.results.append({"split": list(result.split), "attempts": result.attempts, "hooks": self.auto.hooks_active})
            self.history = [dataclasses.asdict(r) for r in self.auto.history]
            self.log("loss", result.loss)

    return LitLlama


def _fit(world: int, injectors: tuple[FaultInjector, ...] = (), steps: int = STEPS, ckpt: Optional[str] = None,
         save: Optional[str] = None) -> dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy

    from automicro.lightning import AutoMicrobatch

    module = _module_class()(injectors)
    callback = AutoMicrobatch(stable_batches=2, log_attempts=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            callbacks=[callback], max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=root,
        )
        loader = torch.utils.data.DataLoader(Samples(), batch_size=BATCH, collate_fn=pad_collate)
        trainer.fit(module, loader, ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
    return {"results": module.results, "seen": module.seen, "history": getattr(module, "history", []),
            "params": full_state(module.model), "global_step": trainer.global_step, "state": callback.state_dict(),
            "logged": sorted(k for k in trainer.callback_metrics if k.startswith("automicro/")),
            "groups_tracked": module.groups_tracked}


def reference(batches: list[dict[str, torch.Tensor]], splits: list[list[int]]) -> dict[str, torch.Tensor]:
    """A plain loop, no automicro, no Lightning: each batch at its split, weighted by samples."""
    model = llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    world = dist.get_world_size()
    for batch, split in zip(batches, splits):
        optimizer.zero_grad(set_to_none=True)
        total = torch.tensor([float(len(batch["input_ids"]))])
        dist.all_reduce(total)
        per_rank = float(total.item()) / world
        start = 0
        for size in split:
            microbatch = {k: v[start:start + size] for k, v in batch.items()}
            (model(**microbatch).loss * (size / per_rank)).backward()
            start += size
        optimizer.step()
    return full_state(model)


def _plain(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "seen"}


def run_cases(rank: int, world_size: int, one_rank: int, folder: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    # 1. A search where only `one_rank` runs out of memory (above 5 samples a microbatch).
    run = _fit(world_size, (FaultInjector("forward", ranks=[one_rank], above=5),))
    out["search"] = {**_plain(run), "reference": reference(run["seen"], [r["split"] for r in run["results"]])}

    # 2. A steady-state OOM with the hooks off: batch 5.
    run = _fit(world_size, (FaultInjector("forward", ranks=[one_rank], above=5),
                            FaultInjector("backward", ranks=[one_rank], batch=5, times=1)), steps=7)
    out["steady"] = {**_plain(run), "reference": reference(run["seen"], [r["split"] for r in run["results"]])}

    # 3. Resume from Lightning's own checkpoint (ModelParallelStrategy: a distributed checkpoint).
    path = os.path.join(folder, "three.ckpt")
    first = _fit(world_size, (FaultInjector("forward", above=5),), steps=3, save=path)
    second = _fit(world_size, (FaultInjector("forward", above=5),), steps=6, ckpt=path)
    out["resume"] = {
        "first": _plain(first), "second": _plain(second),
        "reference": reference(first["seen"] + second["seen"], [r["split"] for r in first["results"] + second["results"]]),
    }

    # 4. Automatic optimization is refused with the recipe.
    try:
        module = _module_class()()
        module.automatic_optimization = True
        import pytorch_lightning as pl
        from pytorch_lightning.strategies import ModelParallelStrategy

        from automicro.lightning import AutoMicrobatch

        with tempfile.TemporaryDirectory() as root:
            pl.Trainer(accelerator="cpu", devices=world_size,
                       strategy=ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
                       callbacks=[AutoMicrobatch()], max_steps=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                       ).fit(module, torch.utils.data.DataLoader(Samples(), batch_size=BATCH, collate_fn=pad_collate))
        out["automatic"] = None
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        out["automatic"] = {"type": type(error).__name__, "message": str(error)}
    return out
