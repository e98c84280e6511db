"""An FSDP1 `fsdp_config` (Composer's `FSDPConfig` keys, as llm-foundry YAMLs write them) mapped
onto automicro's FSDP2 engine (`automicro.composer.composer_config.fsdp2_from_fsdp1`)."""

from __future__ import annotations

import pytest

from automicro.engine.config import FSDP2ConfigError
from automicro.composer.composer_config import FSDP1_DEFAULTS, fsdp2_from_fsdp1


def _map(precision: str = "amp_bf16", world: int = 8, local: int = 8, **fsdp_config):
    return fsdp2_from_fsdp1(fsdp_config, precision, "gpu", world, local)


@pytest.mark.parametrize(
    "strategy, reshard, replicate",
    [("FULL_SHARD", True, 1), ("SHARD_GRAD_OP", False, 1), ("HYBRID_SHARD", True, 2), ("_HYBRID_SHARD_ZERO2", False, 2)],
)
def test_each_sharding_strategy_has_its_fsdp2_meaning(strategy, reshard, replicate):
    engine, _, lines = _map(world=16, local=8, sharding_strategy=strategy)
    assert (engine.reshard_after_forward, engine.replicate) == (reshard, replicate)
    assert lines == []


def test_no_shard_is_refused_with_what_to_set():
    with pytest.raises(FSDP2ConfigError, match="NO_SHARD.*FULL_SHARD.*SHARD_GRAD_OP"):
        _map(sharding_strategy="NO_SHARD")


def test_llm_foundrys_pretrain_block_maps_with_one_line_per_key_without_meaning():
    engine, checkpoint_format, lines = _map(
        sharding_strategy="FULL_SHARD", mixed_precision="PURE", activation_checkpointing=True,
        activation_checkpointing_reentrant=False, activation_cpu_offload=False, limit_all_gathers=True,
        sync_module_states=True, state_dict_type="sharded",
    )
    assert (engine.mixed_precision, engine.activation_checkpointing, checkpoint_format) == ("PURE", True, "sharded")
    assert [line.split("=")[0] for line in lines] == ["fsdp_config.activation_checkpointing_reentrant", "fsdp_config.sync_module_states"]
    assert all("no FSDP2 meaning" in line for line in lines)


def test_prefetch_keys_set_the_engines_explicit_prefetch_depths():
    assert (_map()[0].forward_prefetch, _map()[0].backward_prefetch) == (2, 1)
    engine = _map(forward_prefetch=True, forward_prefetch_limit=3, backward_prefetch="BACKWARD_PRE", backward_prefetch_limit=2)[0]
    assert (engine.forward_prefetch, engine.backward_prefetch) == (3, 2)
    assert _map(backward_prefetch="NONE")[0].backward_prefetch == 0


def test_fp32_training_keeps_fp32_parameters_whatever_the_mixed_precision_says():
    assert _map(precision="fp32", mixed_precision="PURE")[0].mixed_precision == "FULL"


@pytest.mark.parametrize(
    "fsdp_config, message",
    [
        ({"sharding_strateg": "FULL_SHARD"}, "sharding_strateg: not a key"),
        ({"mixed_precision": {"param_dtype": "bf16"}}, "FULL, DEFAULT .* or PURE"),
        ({"state_dict_type": "local"}, "state_dict_type='local'"),
        ({"data_parallel_shard_degree": 3}, "data_parallel_shard_degree=3"),
        ({"backward_prefetch": "SOMETIMES"}, "BACKWARD_PRE, BACKWARD_POST or NONE"),
        ({"mixed_precision": "DEFAULT"}, None),
    ],
)
def test_bad_values_name_the_key(fsdp_config, message):
    if message is None:
        _map(**fsdp_config)
        return
    with pytest.raises(FSDP2ConfigError, match=message):
        _map(**fsdp_config)


def test_every_key_of_composers_fsdp_config_is_known():
    from composer.utils.parallelism import FSDPConfig

    fields = {name for name in FSDPConfig.__dataclass_fields__ if not name.startswith("_")}
    assert fields == set(FSDP1_DEFAULTS)
    assert all(getattr(FSDPConfig(), name) == FSDP1_DEFAULTS[name] for name in fields)
