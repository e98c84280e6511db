"""Checks of a valid `TrainConfig` against the launch it runs in: the world size, the devices and
the file system this rank sees. Each raises `ConfigError` naming the key and what to change.

    cfg = load_config(path, overrides)
    check_environment(cfg, world_size)       # scripts/train.py, before anything is built

Owns: what only the launch can tell (``device: gpu`` without CUDA, folders that cannot be
created or written -- they are created here, as the run would --, ``reshard_after_forward``
against the world size). May not touch: the trainer, builders,
Composer, process groups; torch is imported inside the CUDA check only.
"""

from __future__ import annotations

import os
from typing import Optional

from automicro.config.convert import ConfigError
from automicro.config.schema import TrainConfig


def _unwritable(path: str) -> Optional[str]:
    """Why the folder ``path`` cannot be created (the run would create it anyway) or written, or None."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        return f"{type(error).__name__}: {error.strerror or error}"
    if not os.access(path, os.W_OK | os.X_OK):
        return "not writable"
    return None


def check_environment(cfg: TrainConfig, world_size: int) -> None:
    """Raise `ConfigError` if ``cfg`` cannot run here on ``world_size`` ranks."""
    if cfg.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "device='gpu': no CUDA device is visible to this process (torch.cuda.is_available() is false); "
                "set device: cpu, or run on a GPU machine"
            )
    for key in ("run_dir", "save_folder"):
        value = getattr(cfg, key)
        if value is None or "://" in value:
            continue
        problem = _unwritable(value)
        if problem:
            raise ConfigError(f"{key}={value!r}: cannot create or write it ({problem}); choose a writable folder")
    fsdp2 = cfg.fsdp2
    if fsdp2 is not None:
        # `replicate` itself is the engine's to check (it raises FSDP2ConfigError when sharding).
        shard = world_size // fsdp2.replicate if world_size % fsdp2.replicate == 0 else 0
        rab = fsdp2.reshard_after_forward
        if shard and not isinstance(rab, bool) and shard % rab:
            raise ConfigError(
                f"parallelism_config.fsdp2.reshard_after_forward={rab}: an int must divide the shard group size "
                f"{shard} (world size {world_size} / replicate {fsdp2.replicate}); use true, false or a divisor"
            )


__all__ = ["check_environment"]
