"""Multi-rank `automicro.Trainer` cases, run many per process group (start-up dominates on CPU).

Every worker loops over its cases in the same order on every rank, so collectives stay matched,
and returns plain data (numbers, strings, lists, dicts); the tests in test_automicro.py assert on
it. A case that raises is caught on every rank and returned as that case's result.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any, Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist as composer_dist
from torch.utils.data import DataLoader, TensorDataset

import automicro
from automicro.core.hooks import count_module_hooks
from automicro.core.sites import DISPATCHER
from automicro.engine import _torch_internals as internals
from automicro.integration.callback import AutoMicrobatching
from automicro.testing.faults import FaultInjector
from tests.toy_models import ComposerStack, full_state

B = 8  # per-rank batch size
SEED = 17


# ---- pieces ------------------------------------------------------------------------------------


def make_loader(world: int, batches: int, seed: int = 1) -> DataLoader:
    """`batches` per-rank batches of B samples (x[., 8], y[., 4]), identical on every call."""
    generator = torch.Generator().manual_seed(seed)
    n = B * world * batches
    dataset = TensorDataset(torch.randn(n, 8, generator=generator), torch.randn(n, 4, generator=generator))
    return DataLoader(dataset, batch_size=B, sampler=composer_dist.get_sampler(dataset, shuffle=False), drop_last=True)


class Probe(Callback):
    """Records, at every `after_forward` (every microbatch of every attempt), what the hooks are."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.auto: Optional[AutoMicrobatching] = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self.auto = next((c for c in state.callbacks if isinstance(c, AutoMicrobatching)), None)

    def after_forward(self, state: State, logger: Logger) -> None:
        context = DISPATCHER.context
        self.rows.append(
            {
                "batch": int(state.timestamp.batch),
                "attempt": context.attempt,
                "microbatch": context.microbatch_index,
                "microbatch_size": int(state.batch[0].shape[0]),
                "hooks_active": bool(self.auto is not None and self.auto.hooks_active),
                "module_hooks": count_module_hooks(state.model),
                "collective_patch": internals.pre_collective_hook_installed(),
                "listeners": len(DISPATCHER),
            }
        )


class OOMAtBatch(Callback):
    """Raises a CUDA-style OOM at `after_loss` on every rank while `timestamp.batch == batch`,
    at most `times` times (the FaultInjector has no batch filter)."""

    def __init__(self, batch: int, times: int = 1) -> None:
        self.batch = batch
        self.times = times
        self.fired = 0

    def after_loss(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) == self.batch and self.fired < self.times:
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory (test)")


def build_trainer(
    world: int,
    batches: int,
    microbatch: Any = "auto",
    callbacks: tuple = (),
    loader_batches: Optional[int] = None,
    **kwargs: Any,
) -> automicro.Trainer:
    torch.manual_seed(0)  # the same initial parameters in every case
    model = ComposerStack()
    return automicro.Trainer(
        model=model,
        train_dataloader=make_loader(world, loader_batches or batches),
        max_duration=f"{batches}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        parallelism_config={"fsdp2": {}},
        device_train_microbatch_size=microbatch,
        callbacks=list(callbacks),
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=SEED,
        **kwargs,
    )


def adam_steps(trainer: automicro.Trainer) -> list[int]:
    """Distinct optimizer step counts over all parameters (one value when every step ran once)."""
    steps = set()
    for optimizer in trainer.state.optimizers:
        for group_state in optimizer.state.values():
            if "step" in group_state:
                steps.add(int(group_state["step"]))
    return sorted(steps)


def max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def cleanup_report(trainer: automicro.Trainer) -> dict[str, Any]:
    """Close the trainer and report what automicro left installed in this process."""
    model = trainer.state.model
    trainer.close()
    return {
        "listeners_after_close": len(DISPATCHER),
        "collective_patch_after_close": internals.pre_collective_hook_installed(),
        "module_hooks_after_close": count_module_hooks(model),
    }


def history(auto: AutoMicrobatching) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) for r in auto.history]


def _error_text(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}


# ---- 1. the fault matrix -----------------------------------------------------------------------

MATRIX_SITES = ("forward_pre", "forward", "backward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc", "loss", "optimizer_step")
MICROBATCH = {"first": 0, "middle": 1, "last": -1}
ABOVE = 5
MATRIX_BATCHES = 5


def reference_params(world: int, batches: int, microbatch: int = 4) -> dict[str, torch.Tensor]:
    trainer = build_trainer(world, batches, microbatch=microbatch)
    trainer.fit()
    params = full_state(trainer.state.model)
    trainer.close()
    return params


def fault_case(world: int, site: str, ranks: Optional[list[int]], index: int, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    auto = AutoMicrobatching(log_attempts=False)
    injector = FaultInjector(site, ranks=ranks, above=ABOVE, microbatch_index=index)
    trainer = build_trainer(world, MATRIX_BATCHES, callbacks=(auto, injector))
    started = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - returned to the test
        result["exception"] = _error_text(error)
    sharded = trainer.sharded_model
    assert sharded is not None
    result.update(
        seconds=round(time.perf_counter() - started, 3),
        found_size=auto.found_size,
        split=list(auto.policy.current_split()) if auto.policy else None,
        history=history(auto),
        fired=injector.fired,
        injector_hooks_after_fit=injector._site_hooks is not None,
        clean=sharded.is_clean(),
        states=sharded.states(),
        unsharded_bytes=sharded.unsharded_bytes(),
        adam_steps=adam_steps(trainer),
        batches=int(trainer.state.timestamp.batch),
        error=max_error(full_state(trainer.state.model), reference),
    )
    result.update(cleanup_report(trainer))
    return result


def run_fault_matrix(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict[str, Any]:
    """cases: (site, who, where) with who in {"one", "every"} and where in MICROBATCH."""
    out: dict[str, Any] = {"torch": torch.__version__}
    started = time.perf_counter()
    reference = reference_params(world, MATRIX_BATCHES)
    out["reference_seconds"] = time.perf_counter() - started
    for site, who, where in cases:
        ranks = [1] if who == "one" else None
        try:
            out[f"{site}/{who}/{where}"] = fault_case(world, site, ranks, MICROBATCH[where], reference)
        except Exception as error:  # noqa: BLE001 - report which case broke
            out[f"{site}/{who}/{where}"] = {"exception": _error_text(error)}
    return out
