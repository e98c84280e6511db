"""llm-foundry's own train path under automicro (`python -m automicro.foundry`), 2 gloo ranks.

Runs where llm-foundry 0.22 is installed: the default environment (`make test` installs it,
requirements/foundry.txt). llm-foundry 0.22 pins torch < 2.7.1, so on the torch 2.11 / 2.15 legs
these tests are skipped (not counted there; docs/guides/composer.md, llm-foundry)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.launch import COMPOSER, REPO, run

if torch.__version__.startswith("2.7."):
    import llmfoundry  # noqa: F401 - the default leg must have it (`make test` installs it): never a silent skip
else:
    pytest.importorskip("llmfoundry", reason="llm-foundry 0.22 pins torch<2.7.1: installed only in the default (torch 2.7) leg")

CONFIG = "configs/foundry-tiny-cpu.yaml"


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"Train loss/train/total: ([0-9.]+)", stdout)]


@pytest.mark.multiproc
def test_a_foundry_yaml_searches_under_asymmetric_caps_and_trains_like_the_fixed_size_run():
    # 6 of the YAML's 12 batches: the search ends in batch 1, the sync hooks come off after batch 4.
    auto = run([str(COMPOSER), "-n", "2", "-m", "automicro.foundry", CONFIG, "max_duration=6ba"], timeout_s=300)
    assert auto.returncode == 0, auto.stdout[-4000:]
    out = auto.stdout
    # Rank 0's 3 MB cap fits 5 samples a microbatch (rank 1's fits more): bisect 8 oom, 4 ok, 6 oom,
    # 5 ok; then the per-rank batch of 8 runs as the fewest even microbatches.
    assert "size 8 split [8] -> oom on rank(s) [0] at ['forward']" in out, out[-4000:]
    assert "size 6 split [6, 2] -> oom on rank(s) [0]" in out, out[-4000:]
    assert "[automicro] microbatch size found: 5; split in use [4, 4]; layout: default; attempts 7, OOMs 2; sync hooks off; 6 batches" in out
    # llm-foundry's own path built the model, tokenizer, loader and callbacks from its registries.
    assert "llmfoundry" in out and "Building trainer" in out
    fixed = run(
        [str(COMPOSER), "-n", "2", "-m", "automicro.foundry", CONFIG, "max_duration=6ba", "device_train_microbatch_size=4",
         "callbacks.auto_microbatching=null"],
        timeout_s=300,
    )
    assert fixed.returncode == 0, fixed.stdout[-4000:]
    assert "[automicro] fixed microbatch size 4" in fixed.stdout
    auto_losses, fixed_losses = _losses(out), _losses(fixed.stdout)
    assert len(auto_losses) == len(fixed_losses) >= 3, (auto_losses, fixed_losses)
    # The failed attempts left no trace: the losses match the fixed-size run (batch 1 ran at [5, 3]).
    assert all(abs(a - b) < 1e-3 for a, b in zip(auto_losses, fixed_losses)), (auto_losses, fixed_losses)


PRETRAIN = "configs/foundry-mpt-small-cpu.yaml"  # llm-foundry's mpt-small-cpu.yaml, fsdp_config block included
SFT = "configs/foundry-sft-cpu.yaml"  # llm-foundry's local-data finetuning YAML (finetuning loader, JSONL)
OFFLINE = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _pretrain_yaml(tmp_path) -> str:
    """The pretrain YAML plus an ICL task (llm-foundry's `icl_tasks`, a local language-modeling
    JSONL) and eval_first: every kind of evaluator a foundry YAML builds, pinned at 16."""
    from omegaconf import OmegaConf

    data = tmp_path / "lm.jsonl"
    data.write_text("".join(
        json.dumps({"context": f"sample {i}: the quick brown fox jumps over", "continuation": " the lazy dog"}) + "\n"
        for i in range(96)
    ))
    cfg = OmegaConf.load(REPO / PRETRAIN)
    cfg.icl_tasks = [{"label": "lm", "dataset_uri": str(data), "num_fewshot": [0], "icl_task_type": "language_modeling"}]
    path = tmp_path / "pretrain.yaml"
    OmegaConf.save(cfg, path)
    return str(path)


@pytest.mark.multiproc
def test_llm_foundrys_pretrain_yaml_trains_evaluates_checkpoints_and_resumes_under_auto(tmp_path):
    config = _pretrain_yaml(tmp_path)
    keys = [
        "global_train_batch_size=32", "eval_interval=2ba", "eval_first=true", "eval_subset_num_batches=2",
        f"save_folder={tmp_path}/ckpt", "save_interval=2ba", "autoresume=true", "run_name=pretrain",
        f"callbacks.hf_checkpointer.save_folder={tmp_path}/hf", "callbacks.hf_checkpointer.save_interval=4ba",
    ]
    # From tmp_path: llm-foundry copies each ICL dataset into the working directory.
    result = run([str(COMPOSER), "-n", "2", "-m", "automicro.foundry", config, "max_duration=4ba", *keys], 400, OFFLINE, tmp_path)
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    # Its fsdp_config block, mapped: one line, and one per key without an FSDP2 meaning.
    assert out.count("[automicro] fsdp_config mapped onto the FSDP2 engine") == 1, out[-4000:]
    assert "mixed_precision='FULL'" in out and "reshard_after_forward=True" in out
    without = [line for line in out.splitlines() if "no FSDP2 meaning" in line]
    assert len(without) == 1 and "activation_checkpointing_reentrant" in without[0], without
    # eval_first ran at the pinned 16 before Adam's state existed; once it did, 16 ran out on rank 0
    # only (rank 1's cap is larger), and every rank split the eval batches together, the ICL
    # evaluator too, with one line each naming the size that fit.
    for label in ("eval", "lm/0-shot"):
        assert re.search(rf"eval '{re.escape(label)}': batch \d+ attempt \d+: size 16 split \[16\] -> oom on rank\(s\) \[0\]", out), out[-6000:]
        assert len(re.findall(rf"eval '{re.escape(label)}': out of memory at device_eval_microbatch_size=16; \d+ fit on every rank", out)) == 1
    assert len(re.findall(r"Eval metrics/eval/LanguageCrossEntropy: ([0-9.]+)", out)) == 3  # evals at 0, 2 and 4
    assert "Eval metrics/lm/0-shot/InContextLearningLMAccuracy" in out
    # algorithms.gradient_clipping, speed_monitor, lr_monitor and runtime_estimator ran.
    # (speed_monitor's throughput needs its 10-batch window; its wall-clock keys come every batch.)
    assert "Train time/train:" in out and "lr-DecoupledAdamW/group0" in out
    assert "time/remaining_estimate" in out
    # hf_checkpointer wrote the trained parameters (gathered from the FSDP2 shards), as Composer's checkpoint holds them.
    from safetensors.torch import load_file

    hf = load_file(str(tmp_path / "hf" / "huggingface" / "ba4" / "model.safetensors"))
    # Written under hf/.partial-hf and renamed into place by rank 0 (atomic); nothing staged is left.
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["huggingface"], list((tmp_path / "hf").iterdir())
    model = torch.load(tmp_path / "ckpt" / "ep0-ba4-rank0.pt", weights_only=False)["state"]["model"]
    assert len(hf) == len(model) > 0
    assert all(torch.equal(value, model[f"model.{name}"]) for name, value in hf.items())
    # autoresume: the same command, longer, goes on from batch 4 with the split it had found, and
    # its evaluators with the sizes they had found (the eval at batch 6 runs out nowhere).
    for copied in tmp_path.glob("lm-*.jsonl"):  # llm-foundry 0.22's ranks race to replace an existing copy
        copied.unlink()
    again = run([str(COMPOSER), "-n", "2", "-m", "automicro.foundry", config, "max_duration=6ba", *keys], 400, OFFLINE, tmp_path)
    assert again.returncode == 0, again.stdout[-6000:]
    assert "[automicro] resumed with microbatch split" in again.stdout
    assert "[automicro] batch 4 attempt 1:" in again.stdout and "[automicro] batch 0 attempt" not in again.stdout
    assert len(re.findall(r"Eval metrics/eval/LanguageCrossEntropy", again.stdout)) == 1
    assert "-> oom" not in "\n".join(line for line in again.stdout.splitlines() if "[automicro] eval" in line), again.stdout[-6000:]
    assert (tmp_path / "ckpt" / "ep0-ba6-rank0.pt").exists()


@pytest.mark.multiproc
def test_llm_foundrys_finetuning_path_trains_under_auto_with_a_token_budget():
    result = run([str(COMPOSER), "-n", "2", "-m", "automicro.foundry", SFT], 400, OFFLINE)
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    # llm-foundry's finetuning loader padded every batch to max_seq_len (512); the budget split
    # them by their real lengths, re-padded to each microbatch's longest.
    assert "Building finetuning dataloader" in out or "finetuning" in out
    found = re.findall(r"\[automicro\] microbatch budget found: (\d+) tokens; last split \[([0-9, ]+)\]; padding ([0-9.]+)%", out)
    assert len(found) == 1, out[-6000:]
    budget, split, padding = int(found[0][0]), [int(x) for x in found[0][1].split(",")], float(found[0][2])
    assert 0 < budget < 16 * 512 and sum(split) == 16 and len(split) > 1, found
    assert padding < 50.0, found  # the collated batches, padded to 512, are mostly padding
    losses = _losses(out)
    assert len(losses) == 8 and all(0 < x < 10 for x in losses), losses


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


def test_a_missing_yaml_is_named(capsys):
    # In this process (the entry point's own launch costs 18 s of imports; the other tests launch it).
    from automicro import foundry

    assert foundry.main(["configs/no-such.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and "configs/no-such.yaml: no such file" in err, err
