"""Rank functions for tests/test_checkpoint.py: sharded (DCP) checkpoints through `automicro.Trainer`,
and checkpoints as commits (both formats).

Every case runs on every rank in the same order (collectives stay matched) and returns plain data;
a case that breaks is caught on every rank and returned as {"crash": ...}.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.optim import LinearWithWarmupScheduler
from composer.utils import dist as composer_dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

import automicro
from automicro.composer.callback import AutoMicrobatching
from automicro.composer.checkpoint_commit import CommittedCheckpoints
from automicro.testing.checkpoint_faults import CheckpointFault
from automicro.testing.faults import FaultInjector
from tests.automicro_cases import ABOVE, SEED, make_loader
from tests.toy_models import ComposerStack

CHECKPOINT_AT = 3  # the search (injector: OOM above 5 per microbatch) has settled on 5 by then
TOTAL = 6
FIXED_MICROBATCH = 4
SITE = "backward_pre"


class LossLog(Callback):
    """The all-reduced training loss of every batch, by batch index."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def batch_end(self, state: State, logger: Logger) -> None:
        self.losses[int(state.timestamp.batch) - 1] = float(state.total_loss_dict["loss/train/total"])


def _trainer(world: int, batches: int, microbatch: Any, callbacks: list, **kwargs: Any) -> automicro.Trainer:
    torch.manual_seed(0)  # the same initial parameters in every run
    model = ComposerStack(width=16)
    return automicro.Trainer(
        model=model,
        train_dataloader=make_loader(world, TOTAL),
        max_duration=f"{batches}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        # The learning rate depends on the batch count: a resume that lost the timestamp or the
        # scheduler's state trains differently.
        schedulers=LinearWithWarmupScheduler(t_warmup="2ba", alpha_f=0.1),
        device="cpu",
        parallelism_config={"fsdp2": {}},
        device_train_microbatch_size=microbatch,
        callbacks=callbacks,
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=SEED,
        **kwargs,
    )


def _callbacks(auto: bool) -> list:
    if not auto:
        return []
    return [AutoMicrobatching(log_attempts=False), FaultInjector(SITE, above=ABOVE)]


def full_snapshot(trainer: automicro.Trainer) -> dict[str, torch.Tensor]:
    """Model and optimizer state as full tensors (gathered on every rank), flat keys."""
    model = trainer.state.model
    options = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, trainer.state.optimizers[0], options=options)
    for param, values in optim["state"].items():
        for key, value in values.items():
            out[f"optim/{param}/{key}"] = torch.as_tensor(value).detach().clone()
    for index, group in enumerate(optim["param_groups"]):
        for key, value in group.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"group{index}/{key}"] = torch.tensor(float(value))
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose values are not exactly equal (or that only one side has)."""
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k])]


def max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "model/") -> float:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys and set(keys) == {k for k in b if k.startswith(prefix)}
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


def _auto_of(trainer: automicro.Trainer) -> Optional[AutoMicrobatching]:
    return trainer.auto_microbatching


def resume_case(world: int, folder: str, auto: bool) -> dict[str, Any]:
    """Save a sharded checkpoint at batch CHECKPOINT_AT, load it in a new Trainer (full model and
    optimizer state compared before training on), train on to TOTAL; and an uninterrupted run."""
    microbatch = "auto" if auto else FIXED_MICROBATCH
    result: dict[str, Any] = {}

    losses = LossLog()
    first = _trainer(
        world,
        CHECKPOINT_AT,
        microbatch,
        _callbacks(auto) + [losses],
        checkpoint_format="sharded",
        save_folder=folder,
        save_interval=f"{CHECKPOINT_AT}ba",
    )
    first.fit()
    saved = full_snapshot(first)
    result["first_checkpoint_format"] = first.checkpoint_format
    result["first_is_ddp"] = isinstance(first.state.model, DistributedDataParallel) or first.state.is_model_ddp
    result["saved_checkpoints"] = [os.path.relpath(p, folder) for p in first.saved_checkpoints]
    result["saved_losses"] = losses.losses
    if auto:
        result["saved_found_size"] = _auto_of(first).found_size
    first.close()
    composer_dist.barrier()

    losses = LossLog()
    resumed = _trainer(
        world,
        TOTAL,
        microbatch,
        _callbacks(auto) + [losses],
        checkpoint_format="sharded",
        load_path=os.path.join(folder, f"ep0-ba{CHECKPOINT_AT}"),
    )
    loaded = full_snapshot(resumed)
    result["loaded_keys"] = len(loaded)
    result["load_differences"] = differences(saved, loaded)
    result["resumed_at_batch"] = int(resumed.state.timestamp.batch)
    result["resumed_is_ddp"] = isinstance(resumed.state.model, DistributedDataParallel) or resumed.state.is_model_ddp
    resumed.fit()
    final = full_snapshot(resumed)
    result["resumed_losses"] = losses.losses
    if auto:
        resumed_auto = _auto_of(resumed)
        result["resumed_found_size"] = resumed_auto.found_size
        result["resumed_history"] = [
            {"batch": r.batch, "attempt": r.attempt, "split": list(r.split), "outcome": r.outcome}
            for r in resumed_auto.history
        ]
        result["resumed_ooms_total"] = resumed_auto.ooms_total
    resumed.close()

    losses = LossLog()
    uninterrupted = _trainer(world, TOTAL, microbatch, _callbacks(auto) + [losses])
    uninterrupted.fit()
    reference = full_snapshot(uninterrupted)
    result["uninterrupted_losses"] = losses.losses
    uninterrupted.close()
    result["param_error_vs_uninterrupted"] = max_error(final, reference, "model/")
    result["optim_error_vs_uninterrupted"] = max_error(final, reference, "optim/")
    return result


def _commits(trainer: automicro.Trainer) -> CommittedCheckpoints:
    return next(c for c in trainer.state.callbacks if isinstance(c, CommittedCheckpoints))


def commit_case(world: int, folder: str, checkpoint_format: str, policies: tuple[str, ...] = ("continue", "stop")) -> dict[str, Any]:
    """Checkpoints as commits, `checkpoint_format` full or sharded: a save broken after it
    committed (full: the .pt cut to half; sharded: the last rank's shard deleted), then autoresume from
    the newest complete one against a run loaded from it by path; a full disk on one rank with
    save_failure continue, then stop."""
    sharded = checkpoint_format == "sharded"
    result: dict[str, Any] = {}
    saves = os.path.join(folder, "saves")
    common = dict(checkpoint_format=checkpoint_format, save_folder=saves, save_interval="2ba", run_name="commit")
    last = world - 1  # sharded: the last rank (on two nodes, a rank of the second node that checks nothing)
    broken = CheckpointFault("delete_shard" if sharded else "truncate", batch=4, ranks=[last] if sharded else [0])
    first = _trainer(world, 4, FIXED_MICROBATCH, [broken], **common)
    first.fit()
    result["fault_fired"] = broken.fired
    first.close()
    composer_dist.barrier()

    resumed = _trainer(world, TOTAL, FIXED_MICROBATCH, [], autoresume=True, **common)
    commits = _commits(resumed)
    result["resumed_from"] = os.path.relpath(commits.resumed_from or "", saves)
    result["skipped"] = sorted(commits.skipped)
    result["skip_reasons"] = sorted(commits.skipped.values())
    result["resumed_at_batch"] = int(resumed.state.timestamp.batch)
    resumed.fit()
    final = full_snapshot(resumed)
    resumed.close()
    composer_dist.barrier()
    result["folder_after"] = sorted(os.listdir(saves))
    result["latest_after"] = os.readlink(os.path.join(saves, "latest-rank0.pt"))

    good = os.path.join(saves, "ep0-ba2" if sharded else "ep0-ba2-rank0.pt")
    reference = _trainer(world, TOTAL, FIXED_MICROBATCH, [], checkpoint_format=checkpoint_format, load_path=good)
    reference.fit()
    result["param_error_vs_loaded"] = max_error(final, full_snapshot(reference), "model/")
    result["optim_error_vs_loaded"] = max_error(final, full_snapshot(reference), "optim/")
    reference.close()

    for policy in policies:
        where = os.path.join(folder, f"full_disk_{policy}")
        full = CheckpointFault("disk_full", batch=2, ranks=[last] if sharded else [0])
        trainer = _trainer(
            world, 3, FIXED_MICROBATCH, [full], checkpoint_format=checkpoint_format, save_folder=where,
            save_interval="1ba", run_name=f"disk_{policy}", save_failure=policy,
            save_num_checkpoints_to_keep=1,  # the failed save must not make it delete the last good one
        )
        try:
            trainer.fit()
            result[f"{policy}_error"] = None
        except Exception as error:  # noqa: BLE001 - stop: every rank raises
            result[f"{policy}_error"] = str(error)
        result[f"{policy}_failed_saves"] = _commits(trainer).failed_saves
        result[f"{policy}_batches"] = int(trainer.state.timestamp.batch)
        trainer.close()
        composer_dist.barrier()
        result[f"{policy}_folder"] = sorted(os.listdir(where))
        result[f"{policy}_latest"] = os.readlink(os.path.join(where, "latest-rank0.pt"))
    return result


def run_checkpoint_cases(rank: int, world: int, folder: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, auto in (("auto", True), ("fixed", False)):
        try:
            out[name] = resume_case(world, os.path.join(folder, name), auto)
        except Exception:  # noqa: BLE001 - the test reports which case broke
            out[name] = {"crash": traceback.format_exc()}
    for checkpoint_format in ("full", "sharded"):
        try:
            out[f"commit_{checkpoint_format}"] = commit_case(world, os.path.join(folder, f"commit_{checkpoint_format}"), checkpoint_format)
        except Exception:  # noqa: BLE001
            out[f"commit_{checkpoint_format}"] = {"crash": traceback.format_exc()}
    return out


def run_commit_on_two_nodes(rank: int, world: int, folder: str) -> dict[str, Any]:
    """`commit_case` for sharded checkpoints on 2 simulated nodes of 2 ranks (each node's local
    rank 0 checks the folder; every rank takes the same choice)."""
    torch.set_num_threads(1)
    try:
        return commit_case(world, folder, "sharded", policies=("stop",))  # continue: the same agreement, on 2 ranks
    except Exception:  # noqa: BLE001
        return {"crash": traceback.format_exc()}


def run_killed_save(rank: int, world: int, folder: str) -> dict[str, Any]:
    """2 ranks, full checkpoints every 2 batches; rank 0 is SIGKILLed in the middle of writing the
    save at batch 4 (`CheckpointFault('mid_write')`): this launch never returns."""
    torch.set_num_threads(1)
    fault = CheckpointFault("mid_write", batch=4, ranks=[0])
    _trainer(world, TOTAL, FIXED_MICROBATCH, [fault], save_folder=folder, save_interval="2ba", run_name="killed").fit()
    return {"not": "reached"}


def run_resume_after_kill(rank: int, world: int, folder: str) -> dict[str, Any]:
    """The relaunch: autoresume, then a run loaded from the checkpoint it resumed from."""
    torch.set_num_threads(1)
    try:
        left = sorted(os.listdir(folder))
        resumed = _trainer(world, TOTAL, FIXED_MICROBATCH, [], save_folder=folder, save_interval="2ba", run_name="killed",
                           autoresume=True)
        commits = _commits(resumed)
        out = {"left": left, "resumed_from": os.path.basename(commits.resumed_from or ""), "skipped": commits.skipped,
               "resumed_at_batch": int(resumed.state.timestamp.batch)}
        resumed.fit()
        final = full_snapshot(resumed)
        resumed.close()
        composer_dist.barrier()
        reference = _trainer(world, TOTAL, FIXED_MICROBATCH, [], load_path=os.path.join(folder, "ep0-ba2-rank0.pt"))
        reference.fit()
        out["param_error_vs_loaded"] = max_error(final, full_snapshot(reference), "model/")
        reference.close()
        out["after"] = sorted(os.listdir(folder))
        return out
    except Exception:  # noqa: BLE001
        return {"crash": traceback.format_exc()}
