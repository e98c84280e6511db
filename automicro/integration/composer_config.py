"""Composer's own parallelism configs in `automicro.Trainer(parallelism_config=...)`.

A Composer user may pass what they already have: `composer.utils.ParallelismConfig(fsdp2=...)`,
or `{'fsdp2': composer.utils.FSDP2Config(...)}`. Each field of Composer's `FSDP2Config` either
means the same thing in automicro's engine and is carried over, or is refused with a message
naming the field and the value to set:

- ``reshard_after_forward``: the same (True / False / an int);
- ``mixed_precision``: Composer's dtypes come from the Trainer's ``precision``: ``FULL`` (or any
  value with ``precision='fp32'``) is the engine's ``FULL``; ``DEFAULT`` / ``PURE`` with
  ``precision='amp_bf16'`` are the engine's ``DEFAULT`` / ``PURE``; fp16 / fp8 parameters are
  refused (the engine casts to bf16);
- ``activation_checkpointing``: the engine recomputes each FSDP2-wrapped block (the Composer
  convention: the blocks marked ``_fsdp_wrap`` are the ones ``activation_checkpointing_fn`` picks);
- ``state_dict_type``: the checkpoint format (``automicro.Trainer(checkpoint_format=...)``); a
  different explicit ``checkpoint_format`` is refused;
- ``device_mesh``: None, a 1-D mesh of every rank, or a 2-D ``(replicate, shard)`` mesh in rank
  order (the engine's ``replicate``); any other mesh is refused;
- ``activation_cpu_offload=True`` and ``load_monolith_rank0_only=True`` are refused (no such
  path in the engine); ``verbose`` is Composer's logging only.
``ParallelismConfig.fsdp`` (FSDP1) and ``.tp`` are refused: automicro shards with FSDP2 only.

Owns: the translation and its messages. May not touch: the engine's own checks (the translated
values go through `automicro.engine.config` like any other).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from composer.utils import FSDP2Config as ComposerFSDP2Config
from composer.utils import ParallelismConfig as ComposerParallelismConfig

from automicro.engine.config import FSDP2Config, FSDP2ConfigError

_WHERE = "automicro.Trainer: parallelism_config"


def _precision_name(precision: Any) -> str:
    if precision is None:
        return "default"
    return str(getattr(precision, "value", precision)).lower()


def _mixed_precision(value: Any, precision: Any, device: Any) -> str:
    where = f"{_WHERE}.fsdp2 (composer.utils.FSDP2Config).mixed_precision={value!r}"
    if not isinstance(value, str) or value.upper() not in ("FULL", "DEFAULT", "PURE"):
        raise FSDP2ConfigError(f"{where}: automicro's engine takes 'FULL', 'DEFAULT' or 'PURE'; set one of them")
    value = value.upper()
    if value == "FULL":
        return "FULL"
    name = _precision_name(precision)
    if name == "default":
        # Composer's default precision: amp_fp16 on GPU, fp32 on CPU.
        gpu = device == "gpu" or type(device).__name__ == "DeviceGPU"
        name = "amp_fp16" if gpu else "fp32"
    if name == "fp32":
        return "FULL"  # Composer casts parameters to the Trainer's precision: fp32 is no cast at all
    if name == "amp_bf16":
        return value
    raise FSDP2ConfigError(
        f"{where} with precision={name!r}: Composer would keep {name[4:]} parameters, automicro's engine casts to "
        "bf16; set precision='amp_bf16' (or mixed_precision='FULL')"
    )


def _replicate(mesh: Any) -> int:
    if mesh is None:
        return 1
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    shape = tuple(mesh.mesh.shape)
    in_order = mesh.mesh.numel() == world and torch.equal(mesh.mesh.flatten().cpu(), torch.arange(world))
    if in_order and len(shape) == 1:
        return 1
    if in_order and len(shape) == 2:
        return int(shape[0])
    raise FSDP2ConfigError(
        f"{_WHERE}.fsdp2 (composer.utils.FSDP2Config).device_mesh={mesh!r}: automicro's engine builds its own "
        "mesh of every rank in order; set device_mesh=None (for HSDP: automicro.engine.FSDP2Config(replicate=R), "
        "or a (R, world/R) mesh of every rank in order)"
    )


def fsdp2_from_composer(config: ComposerFSDP2Config, precision: Any, device: Any) -> tuple[FSDP2Config, str]:
    """Composer's `FSDP2Config` -> (automicro's `FSDP2Config`, the checkpoint format it asks for)."""
    where = f"{_WHERE}.fsdp2 (composer.utils.FSDP2Config)"
    for name in ("activation_cpu_offload", "load_monolith_rank0_only"):
        if getattr(config, name):
            raise FSDP2ConfigError(
                f"{where}.{name}=True: automicro's engine has no such path; set {name}=False"
            )
    if config.state_dict_type not in ("full", "sharded"):
        raise FSDP2ConfigError(f"{where}.state_dict_type={config.state_dict_type!r}: set 'full' or 'sharded'")
    engine = FSDP2Config(
        reshard_after_forward=config.reshard_after_forward,
        mixed_precision=_mixed_precision(config.mixed_precision, precision, device),
        activation_checkpointing=bool(config.activation_checkpointing),
        replicate=_replicate(config.device_mesh),
    )
    return engine, config.state_dict_type


def from_composer_parallelism(
    parallelism_config: Any, checkpoint_format: Optional[str], precision: Any = None, device: Any = None
) -> tuple[Any, Optional[str]]:
    """`automicro.Trainer`'s ``parallelism_config`` with Composer's configs translated:
    (``{'fsdp2': automicro FSDP2Config}`` / the input unchanged / None, the checkpoint format).
    ``checkpoint_format`` is the one the caller passed (None: not given)."""
    if isinstance(parallelism_config, ComposerParallelismConfig):
        for name, what in (("fsdp", "FSDP1"), ("tp", "tensor parallelism")):
            if getattr(parallelism_config, name) is not None:
                raise FSDP2ConfigError(
                    f"{_WHERE} (composer.utils.ParallelismConfig).{name}: automicro shards with FSDP2 only, not "
                    f"{what}; set {name}=None and fsdp2=composer.utils.FSDP2Config(...) (or pass "
                    "parallelism_config={'fsdp2': {...}})"
                )
        if parallelism_config.fsdp2 is None:
            return None, checkpoint_format
        parallelism_config = {"fsdp2": parallelism_config.fsdp2}
    if not isinstance(parallelism_config, Mapping) or not isinstance(parallelism_config.get("fsdp2"), ComposerFSDP2Config):
        return parallelism_config, checkpoint_format
    engine, wanted = fsdp2_from_composer(parallelism_config["fsdp2"], precision, device)
    if checkpoint_format is not None and checkpoint_format != wanted:
        raise FSDP2ConfigError(
            f"{_WHERE}.fsdp2 (composer.utils.FSDP2Config).state_dict_type={wanted!r} and "
            f"checkpoint_format={checkpoint_format!r} disagree: set state_dict_type={checkpoint_format!r} "
            "(or leave checkpoint_format out)"
        )
    return {**parallelism_config, "fsdp2": engine}, wanted


__all__ = ["from_composer_parallelism", "fsdp2_from_composer"]
