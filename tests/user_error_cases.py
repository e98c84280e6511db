"""Rank functions for tests/test_user_errors.py (each case on every rank, in the same order)."""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
from composer.utils import dist as composer_dist

import automicro
from automicro.composer.callback import AutoMicrobatching
from tests.automicro_cases import SEED, make_loader
from tests.checkpoint_cases import differences, full_snapshot
from tests.toy_models import ComposerStack

SAVE_AT = 2
TOTAL = 4


def _sgd_trainer(world: int, batches: int, **kwargs: Any) -> automicro.Trainer:
    torch.manual_seed(0)
    model = ComposerStack(width=16)
    return automicro.Trainer(
        model=model,
        train_dataloader=make_loader(world, TOTAL),
        max_duration=f"{batches}ba",
        # No momentum: the optimizer keeps no per-parameter state at all.
        optimizers=torch.optim.SGD(model.parameters(), lr=1e-2),
        device="cpu",
        parallelism_config={"fsdp2": {}},
        device_train_microbatch_size="auto",
        callbacks=[AutoMicrobatching(log_attempts=False)],
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=SEED,
        **kwargs,
    )


def stateless_optimizer_resume(world: int, folder: str, checkpoint_format: str) -> dict[str, Any]:
    """Save a checkpoint of a plain-SGD run, resume it, train on; compare with an uninterrupted run."""
    first = _sgd_trainer(world, SAVE_AT, save_folder=folder, save_interval=f"{SAVE_AT}ba", checkpoint_format=checkpoint_format)
    first.fit()
    saved = full_snapshot(first)
    first.close()
    composer_dist.barrier()
    # Composer's default names: rank 0's one .pt file (full), the folder of every rank's shards (sharded).
    name = f"ep0-ba{SAVE_AT}" if checkpoint_format == "sharded" else f"ep0-ba{SAVE_AT}-rank0.pt"
    load_path = os.path.join(folder, name)
    resumed = _sgd_trainer(world, TOTAL, load_path=load_path, checkpoint_format=checkpoint_format)
    result: dict[str, Any] = {
        "load_differences": differences(saved, full_snapshot(resumed)),
        "resumed_at_batch": int(resumed.state.timestamp.batch),
    }
    resumed.fit()
    final = full_snapshot(resumed)
    resumed.close()
    reference_trainer = _sgd_trainer(world, TOTAL)
    reference_trainer.fit()
    reference = full_snapshot(reference_trainer)
    reference_trainer.close()
    result["final_differences"] = [k for k in differences(final, reference) if not torch.allclose(final[k], reference[k], atol=1e-6)]
    return result


def composer_config_run(world: int, parallelism_config: Any) -> dict[str, Any]:
    """`automicro.Trainer` given Composer's own parallelism config: sharded by the engine, searched."""
    from automicro.testing.faults import FaultInjector
    from tests.steady_cases import ABOVE

    auto = AutoMicrobatching(log_attempts=False)
    torch.manual_seed(0)
    model = ComposerStack(width=16)
    trainer = automicro.Trainer(
        model=model, train_dataloader=make_loader(world, 3), max_duration="3ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu",
        parallelism_config=parallelism_config,  # Composer's own config object
        device_train_microbatch_size="auto", callbacks=[auto, FaultInjector("forward", above=ABOVE)],
        loggers=[], progress_bar=False, log_to_console=False, seed=SEED,
    )
    try:
        trainer.fit()
        return {
            "sharded_blocks": [name for name, _ in trainer.sharded_model.named_fsdp_modules],
            "checkpoint_format": trainer.checkpoint_format,
            "found_size": auto.found_size,
            "batches": int(trainer.state.timestamp.batch),
        }
    finally:
        trainer.close()


def run_trainer_cases(rank: int, world: int, folder: str) -> dict[str, Any]:
    import warnings

    from composer.utils import FSDP2Config as ComposerFSDP2Config
    from composer.utils import ParallelismConfig as ComposerParallelismConfig

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "FSDP2 Config/APIs are experimental")
    out: dict[str, Any] = {}

    def case(name: str, fn: Any) -> None:
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - the test reports which case broke
            out[name] = {"crash": traceback.format_exc()}

    for checkpoint_format in ("full", "sharded"):
        case(f"resume/{checkpoint_format}",
             lambda: stateless_optimizer_resume(world, os.path.join(folder, checkpoint_format), checkpoint_format))
    case("composer/fsdp2_default", lambda: composer_config_run(world, {"fsdp2": ComposerFSDP2Config()}))
    case("composer/parallelism_full", lambda: composer_config_run(
        world, ComposerParallelismConfig(fsdp2=ComposerFSDP2Config(state_dict_type="full", mixed_precision="FULL"))))
    return out


def _error_run(world: int, steady_recovery: bool, site: str) -> dict[str, Any]:
    """A non-OOM error on the last rank after the sync hooks came off (batch 7 of 9); what each
    rank raised. Nothing runs a collective after `fit()` raised (the job is lost)."""
    from automicro.testing.faults import FaultInjector
    from tests.steady_cases import ABOVE, BATCHES, FAULT_BATCH
    from tests.automicro_cases import build_trainer

    torch.set_num_threads(1)
    auto = AutoMicrobatching(log_attempts=False, steady_recovery=steady_recovery, unguarded_timeout_s=5.0)
    if site == "between_batches":
        fault = FaultInjector(site, ranks=[world - 1], batch=FAULT_BATCH, exception="error")
    else:
        fault = FaultInjector(site, ranks=[world - 1], microbatch_index=0, batch=FAULT_BATCH, times=1, exception="error")
    trainer = build_trainer(world, BATCHES, callbacks=(auto, FaultInjector("forward", above=ABOVE), fault))
    result: dict[str, Any] = {"exception": None}
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - returned to the test
        result["exception"] = {"type": type(error).__name__, "message": str(error)}
    result["hooks_at_fault"] = [r.hooks for r in auto.history if r.batch == FAULT_BATCH]
    return result


def run_error_without_ledger(rank: int, world: int) -> dict[str, Any]:
    return _error_run(world, steady_recovery=False, site="backward")


def run_error_between_batches(rank: int, world: int) -> dict[str, Any]:
    return _error_run(world, steady_recovery=True, site="between_batches")
