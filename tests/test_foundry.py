"""llm-foundry's own train path under automicro (`python -m automicro.foundry`), 2 gloo ranks.

Runs where llm-foundry 0.22 is installed: the default environment (`make test` installs it,
requirements/foundry.txt). llm-foundry 0.22 pins torch < 2.7.1, so on the torch 2.11 / 2.15 legs
these tests are skipped (not counted there; README 'llm-foundry')."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from tests.launch import COMPOSER, run

if torch.__version__.startswith("2.7."):
    import llmfoundry  # noqa: F401 - the default leg must have it (`make test` installs it): never a silent skip
else:
    pytest.importorskip("llmfoundry", reason="llm-foundry 0.22 pins torch<2.7.1: installed only in the default (torch 2.7) leg")

CONFIG = "configs/foundry-tiny-cpu.yaml"


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"Train loss/train/total: ([0-9.]+)", stdout)]


@pytest.mark.multiproc
def test_a_foundry_yaml_searches_under_asymmetric_caps_and_trains_like_the_fixed_size_run():
    auto = run([str(COMPOSER), "-n", "2", "-m", "automicro.foundry", CONFIG], timeout_s=300)
    assert auto.returncode == 0, auto.stdout[-4000:]
    out = auto.stdout
    # Rank 0's 3 MB cap fits 5 samples a microbatch (rank 1's fits more): bisect 8 oom, 4 ok, 6 oom,
    # 5 ok; then the per-rank batch of 8 runs as the fewest even microbatches.
    assert "size 8 split [8] -> oom on rank(s) [0] at ['forward']" in out, out[-4000:]
    assert "size 6 split [6, 2] -> oom on rank(s) [0]" in out, out[-4000:]
    assert "[automicro] microbatch size found: 5; split in use [4, 4]; attempts 7, OOMs 2; sync hooks off; 12 batches" in out
    # llm-foundry's own path built the model, tokenizer, loader and callbacks from its registries.
    assert "llmfoundry" in out and "Building trainer" in out
    fixed = run(
        [str(COMPOSER), "-n", "2", "-m", "automicro.foundry", CONFIG, "device_train_microbatch_size=4",
         "callbacks.auto_microbatching=null"],
        timeout_s=300,
    )
    assert fixed.returncode == 0, fixed.stdout[-4000:]
    assert "[automicro] fixed microbatch size 4" in fixed.stdout
    auto_losses, fixed_losses = _losses(out), _losses(fixed.stdout)
    assert len(auto_losses) == len(fixed_losses) >= 3, (auto_losses, fixed_losses)
    # The failed attempts left no trace: the losses match the fixed-size run (batch 1 ran at [5, 3]).
    assert all(abs(a - b) < 1e-3 for a, b in zip(auto_losses, fixed_losses)), (auto_losses, fixed_losses)


# llm-foundry's own fsdp_config block, as its pretrain YAMLs write it (scripts/train/yamls/pretrain/*.yaml).
FOUNDRY_FSDP_CONFIG = [
    "parallelism_config=null",
    "fsdp_config.sharding_strategy=FULL_SHARD",
    "fsdp_config.mixed_precision=PURE",
    "fsdp_config.activation_checkpointing=false",
    "fsdp_config.activation_checkpointing_reentrant=false",
    "fsdp_config.activation_cpu_offload=false",
    "fsdp_config.limit_all_gathers=true",
    "fsdp_config.sync_module_states=true",
]


@pytest.mark.multiproc
def test_a_foundry_yaml_with_its_own_fsdp_config_block_trains_under_auto_with_one_line_per_key_without_meaning():
    result = run([str(COMPOSER), "-n", "2", "-m", "automicro.foundry", CONFIG, *FOUNDRY_FSDP_CONFIG], timeout_s=300)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert out.count("[automicro] fsdp_config mapped onto the FSDP2 engine") == 1, out[-4000:]
    # fp32 training (the YAML's precision): PURE keeps fp32 parameters, as Composer would.
    assert "mixed_precision='FULL'" in out and "reshard_after_forward=True" in out
    without = [line for line in out.splitlines() if "no FSDP2 meaning" in line]
    assert len(without) == 2 and any("activation_checkpointing_reentrant" in x for x in without), without
    assert any("sync_module_states" in x for x in without)
    assert "[automicro] microbatch size found:" in out


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["fsdp_config.sharding_strategy=FULL_SHARD"], "fsdp_config and parallelism_config are both set"),
        (["parallelism_config=null", "fsdp_config.sharding_strategy=NO_SHARD"], "fsdp_config.sharding_strategy=NO_SHARD"),
        (["parallelism_config=null", "fsdp_config.sharding_strateg=FULL_SHARD"], "fsdp_config.sharding_strateg: not a key"),
        (["tp_config.tensor_parallel_degree=2"], "tp_config: tensor parallelism"),
        (["parallelism_config.fsdp2.prefetch=3"], "parallelism_config.fsdp2.prefetch=3: unknown key"),
        (["device_train_microbatch_size"], "overrides must be key=value"),
    ],
)
def test_a_bad_foundry_config_is_one_config_error_line(overrides, expected, capsys):
    from automicro import foundry

    assert foundry.main([CONFIG, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and expected in err, err


def test_a_missing_yaml_is_named():
    result = run([sys.executable, "-m", "automicro.foundry", "configs/no-such.yaml"], timeout_s=120)
    assert result.returncode == 2 and "configs/no-such.yaml: no such file" in result.stdout, result.stdout
