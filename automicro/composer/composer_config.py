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

An FSDP1 ``fsdp_config`` as llm-foundry YAMLs write it (`fsdp2_from_fsdp1`) is mapped onto the
engine: ``sharding_strategy`` FULL_SHARD (reshard after forward), SHARD_GRAD_OP (no reshard),
HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (HSDP: replicate across nodes), NO_SHARD refused;
``mixed_precision`` as above; ``activation_checkpointing``; ``cpu_offload``;
``forward_prefetch`` / ``forward_prefetch_limit`` and ``backward_prefetch`` /
``backward_prefetch_limit`` (the engine's explicit prefetch depths; ``NONE`` = 0);
``data_parallel_replicate_degree`` / ``_shard_degree``; ``state_dict_type`` (the checkpoint
format). Every other key set away from its default gets one line saying it has no FSDP2 meaning.

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


def _mixed_precision(value: Any, precision: Any, device: Any, where: Optional[str] = None) -> str:
    where = where or f"{_WHERE}.fsdp2 (composer.utils.FSDP2Config).mixed_precision={value!r}"
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


def _rung(value: Any) -> Any:
    """A checkpointing value as the engine takes it: a rung by name or block count as given
    (`automicro.engine.recompute`), anything else true or false."""
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else bool(value)


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
        activation_checkpointing=_rung(config.activation_checkpointing),
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


# ---- FSDP1 `fsdp_config` (llm-foundry YAMLs) ------------------------------------------------------

#: Composer 0.32.1's `FSDPConfig` fields and their defaults (what a key left at its default means).
FSDP1_DEFAULTS: dict[str, Any] = {
    "activation_checkpointing": False, "activation_checkpointing_reentrant": True, "activation_cpu_offload": False,
    "auto_wrap": True, "te_checkpoint_wrapper": False, "te_shard_fp8_weight": False, "backward_prefetch": "BACKWARD_POST",
    "backward_prefetch_limit": 1, "cpu_offload": False, "data_parallel_shard_degree": -1,
    "data_parallel_replicate_degree": None, "forward_prefetch": False, "forward_prefetch_limit": 1,
    "ignored_modules": None, "keep_low_precision_grads": False, "limit_all_gathers": True,
    "load_monolith_rank0_only": False, "load_planner": None, "mixed_precision": "DEFAULT", "process_group": None,
    "save_planner": None, "sharded_ckpt_prefix_dir": "ep{epoch}-ba{batch}", "sharding_strategy": "FULL_SHARD",
    "state_dict_type": "full", "sync_module_states": False, "use_orig_params": True, "verbose": False,
}

#: Keys with no meaning for automicro's FSDP2 engine, and what happens instead (one line each when set).
FSDP1_WITHOUT_MEANING = {
    "activation_checkpointing_reentrant": "the engine's activation checkpointing is non-reentrant",
    "activation_cpu_offload": "the engine has no activation offload; activations stay on the GPU",
    "auto_wrap": "the engine wraps the blocks the model marks (_fsdp_wrap, fsdp_wrap_fn, _no_split_modules)",
    "te_checkpoint_wrapper": "no Transformer Engine checkpoint wrapper",
    "te_shard_fp8_weight": "no Transformer Engine fp8 weight sharding",
    "ignored_modules": "every parameter is sharded",
    "keep_low_precision_grads": "gradients are reduced in fp32 (mixed_precision DEFAULT) or bf16 (PURE)",
    "limit_all_gathers": "FSDP2 needs no rate limiter (its all-gather buffers are freed per block)",
    "load_monolith_rank0_only": "every rank loads its own copy of a full checkpoint",
    "load_planner": "DCP's default planner", "save_planner": "DCP's default planner",
    "process_group": "the engine shards over every rank (HSDP: sharding_strategy HYBRID_SHARD)",
    "sharded_ckpt_prefix_dir": "Composer's default sharded checkpoint folder",
    "sync_module_states": "every rank builds the same initial weights from the seed (init_device: mixed is not supported)",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "verbose": "automicro prints what it applies",
}

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")


def fsdp2_from_fsdp1(
    fsdp_config: Mapping[str, Any], precision: Any, device: Any, world_size: int, local_world_size: int,
) -> tuple[FSDP2Config, str, list[str]]:
    """An FSDP1 `fsdp_config` (Composer's `FSDPConfig` keys, as llm-foundry YAMLs write them) ->
    (automicro's `FSDP2Config`, the checkpoint format, one line for each set key without an FSDP2
    meaning). Unknown keys and values that cannot be honoured raise `FSDP2ConfigError`."""
    where = "fsdp_config"
    unknown = sorted(set(fsdp_config) - set(FSDP1_DEFAULTS))
    if unknown:
        raise FSDP2ConfigError(f"{where}.{unknown[0]}: not a key of Composer's FSDPConfig; allowed: {', '.join(FSDP1_DEFAULTS)}")
    cfg = {**FSDP1_DEFAULTS, **fsdp_config}
    strategy = str(cfg["sharding_strategy"]).upper()
    if strategy not in SHARDING_STRATEGIES:
        raise FSDP2ConfigError(f"{where}.sharding_strategy={cfg['sharding_strategy']!r}: must be one of {', '.join(SHARDING_STRATEGIES)}")
    if strategy == "NO_SHARD":
        raise FSDP2ConfigError(
            f"{where}.sharding_strategy=NO_SHARD: automicro's auto microbatching runs on its FSDP2 engine; set "
            "FULL_SHARD, or SHARD_GRAD_OP (no resharding after forward: on one GPU the cheapest)"
        )
    replicate = 1
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        # Composer's HSDP: shard within a node, replicate across nodes.
        replicate = max(1, world_size // max(1, local_world_size))
    if cfg["data_parallel_replicate_degree"] is not None:
        replicate = int(cfg["data_parallel_replicate_degree"])
    shard = cfg["data_parallel_shard_degree"]
    if shard not in (-1, None) and replicate * int(shard) != world_size:
        raise FSDP2ConfigError(
            f"{where}.data_parallel_shard_degree={shard} x replicate degree {replicate} != world size {world_size}: "
            "set data_parallel_shard_degree: -1 (every rank not replicating shards)"
        )
    mixed = cfg["mixed_precision"]
    if isinstance(mixed, Mapping):
        raise FSDP2ConfigError(
            f"{where}.mixed_precision={dict(mixed)!r}: automicro's engine takes FULL, DEFAULT (bf16 parameters, fp32 "
            "reduce) or PURE (bf16 both); set one of them"
        )
    state_dict_type = str(cfg["state_dict_type"]).lower()
    if state_dict_type not in ("full", "sharded"):
        raise FSDP2ConfigError(f"{where}.state_dict_type={cfg['state_dict_type']!r}: set full or sharded")
    backward = str(cfg["backward_prefetch"]).upper()
    if backward not in ("BACKWARD_PRE", "BACKWARD_POST", "NONE"):
        raise FSDP2ConfigError(f"{where}.backward_prefetch={cfg['backward_prefetch']!r}: BACKWARD_PRE, BACKWARD_POST or NONE")
    engine = FSDP2Config(
        reshard_after_forward=strategy in ("FULL_SHARD", "HYBRID_SHARD"),
        mixed_precision=_mixed_precision(mixed, precision, device, where=f"{where}.mixed_precision={mixed!r}"),
        activation_checkpointing=_rung(cfg["activation_checkpointing"]),
        replicate=replicate,
        cpu_offload=bool(cfg["cpu_offload"]),
        forward_prefetch=max(2, int(cfg["forward_prefetch_limit"])) if cfg["forward_prefetch"] else 2,
        backward_prefetch=0 if backward == "NONE" else max(1, int(cfg["backward_prefetch_limit"])),
    )
    lines = [
        f"fsdp_config.{key}={fsdp_config[key]!r}: no FSDP2 meaning, not applied ({why})"
        for key, why in FSDP1_WITHOUT_MEANING.items()
        if key in fsdp_config and fsdp_config[key] != FSDP1_DEFAULTS[key]
    ]
    return engine, state_dict_type, lines


__all__ = ["FSDP1_DEFAULTS", "from_composer_parallelism", "fsdp2_from_composer", "fsdp2_from_fsdp1"]
