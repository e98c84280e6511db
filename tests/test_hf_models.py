"""Hugging Face models on automicro's engine: GPT-2 from `transformers` (built from a config) in
Composer's `HuggingFaceModel`, 2 CPU ranks, gloo."""

from __future__ import annotations

from typing import Any

import pytest

from automicro.testing import run_multiprocess
from tests import hf_cases



@pytest.fixture(scope="module")
def hf() -> list[dict[str, Any]]:
    return run_multiprocess(hf_cases.run_all, world_size=2, timeout_s=540)


def _ok(result: dict[str, Any]) -> dict[str, Any]:
    assert "crash" not in result, result.get("crash")
    return result


@pytest.mark.multiproc
def test_the_blocks_a_hugging_face_model_names_in_no_split_modules_are_its_fsdp_units(hf):
    for per_rank in hf:
        sites = _ok(per_rank["sites"])
        assert sites["wrapped"] == [f"model.transformer.h.{i}" for i in range(4)]
        # Each block's all-gather and reduce-scatter is attributed to that block.
        for i in range(4):
            block = f"model.transformer.h.{i}"
            assert ("unshard_alloc", block) in sites["fired"] and ("reduce_scatter_alloc", block) in sites["fired"]


@pytest.mark.multiproc
def test_the_roots_backward_sites_fire_once_when_its_output_is_a_model_output(hf):
    for per_rank in hf:
        sites = _ok(per_rank["sites"])
        root = [site for site, name in sites["fired"] if name == ""]
        assert root.count("backward_pre") == 1 and root.count("backward") == 1, root
        # Before any block's backward: the root's gradient arrives first.
        first_block_backward = next(i for i, (s, n) in enumerate(sites["fired"]) if s == "backward_pre" and n)
        assert sites["fired"].index(("backward", "")) < first_block_backward
        # torch warns on every forward when a full-backward hook sits on a module whose output is
        # not a tensor; the engine no longer puts one there.
        assert not [w for w in sites["warnings"] if "backward hooks" in w], sites["warnings"]


@pytest.mark.multiproc
def test_sharding_the_blocks_lowers_each_ranks_peak_memory_against_the_root_alone(hf):
    for per_rank in hf:
        sites = _ok(per_rank["sites"])
        # Measured with the CPU memory-cap accounting, one forward/backward of the same batch:
        # root alone gathers the whole model (and its gradients) at once on every rank.
        assert sites["peak_blocks"] < 0.85 * sites["peak_root_only"], sites


@pytest.mark.multiproc
def test_a_model_with_no_wrap_marks_warns_that_only_the_root_is_sharded_naming_the_fix(hf):
    warn = _ok(hf[0]["warn"])
    assert warn["unmarked"]["wrapped"] == []
    (message,) = warn["unmarked"]["warnings"]
    assert "parallelism_config.fsdp2.wrap" in message and "Block (x3)" in message and "_fsdp_wrap" in message
    assert warn["explicit_root_only"] == {"wrapped": [], "warnings": []}
    assert warn["named"] == {"wrapped": ["0", "1", "2"], "warnings": []}


@pytest.mark.multiproc
def test_auto_on_gpt2_finds_a_size_under_asymmetric_memory_and_matches_a_fixed_size_run(hf):
    found = set()
    for per_rank in hf:
        search = _ok(per_rank["search"])
        assert search["wrapped"] == [f"model.transformer.h.{i}" for i in range(4)]
        assert search["ooms_total"] >= 1 and 1 <= search["found_size"] < hf_cases.PER_RANK_BATCH, search
        assert search["max_param_diff"] < 5e-5, search
        found.add(search["found_size"])
    assert len(found) == 1  # every rank agreed on one size


def test_composer_marks_and_an_explicit_wrap_list_win_over_no_split_modules():
    from automicro.engine import FSDP2Config
    from automicro.engine.sharding import no_split_classes, plan_wrapping

    model = hf_cases.gpt2()
    assert no_split_classes(model) == {"GPT2Block"}
    assert plan_wrapping(model, FSDP2Config())[0] == [f"model.transformer.h.{i}" for i in range(4)]
    assert plan_wrapping(model, FSDP2Config(wrap=["GPT2MLP"]))[0] == [f"model.transformer.h.{i}.mlp" for i in range(4)]
    model.model.transformer.h[2]._fsdp_wrap = True  # Composer's convention: the user's marks decide
    assert plan_wrapping(model, FSDP2Config())[0] == ["model.transformer.h.2"]


def test_a_wrap_list_that_matches_no_module_is_a_config_error_naming_the_block_classes():
    from automicro.engine import FSDP2Config, FSDP2ConfigError
    from automicro.engine.sharding import plan_wrapping

    model = hf_cases.gpt2()
    with pytest.raises(FSDP2ConfigError, match=r"wrap=\['LlamaBlock'\].*GPT2Block \(x4\)"):
        plan_wrapping(model, FSDP2Config(wrap=["LlamaBlock"]))
    # One real class among them is enough (a YAML shared between models).
    assert plan_wrapping(model, FSDP2Config(wrap=["LlamaBlock", "GPT2Block"]))[0][0] == "model.transformer.h.0"
