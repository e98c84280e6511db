"""The ranks' side of `scripts/launch_costs.py` (where a test launch's seconds go): functions of a module
that imports nothing beyond the standard library, so that unpickling them costs no imports."""

from __future__ import annotations

import importlib
import time
from typing import Any


def noop(rank: int, world: int) -> dict[str, float]:
    now = time.time()
    return {"entered": now, "left": time.time()}


def noop_importing(rank: int, world: int, module: str) -> dict[str, float]:
    """What a rank pays for a test-case module it has to import after the fork."""
    entered = time.time()
    importlib.import_module(module)
    return {"entered": entered, "left": time.time(), "import_s": time.time() - entered}


def trainer_phases(rank: int, world: int) -> dict[str, float]:
    """`automicro.Trainer` on the tiny model with FSDP2 (the tests' common shape): its construction,
    then `fit` for 1 batch and, on a second trainer, for 5."""
    entered = time.time()
    import torch

    import automicro
    from automicro.data import SyntheticTokens, build_dataloader
    from automicro.models import build_model

    imported = time.time()
    out: dict[str, float] = {"entered": entered, "import_s": imported - entered}
    for batches in (1, 5):
        torch.manual_seed(0)
        started = time.time()
        model = build_model("tiny", vocab_size=1024, d_model=128, n_layers=2, n_heads=4, max_seq_len=32)
        data = build_dataloader(SyntheticTokens(16 * world * batches, 32, 1024, seed=2), 16, shuffle=False)
        trainer = automicro.Trainer(
            model=model, train_dataloader=data, max_duration=f"{batches}ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
            parallelism_config={"fsdp2": {}}, device_train_microbatch_size="auto",
            loggers=[], progress_bar=False, log_to_console=False, seed=17,
        )
        built = time.time()
        trainer.fit()
        fitted = time.time()
        trainer.close()
        out[f"build_{batches}_s"] = built - started
        out[f"fit{batches}ba_s"] = fitted - built
    out["per_batch_s"] = (out["fit5ba_s"] - out["fit1ba_s"]) / 4
    out["left"] = time.time()
    return out
