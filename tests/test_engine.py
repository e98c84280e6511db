"""The FSDP2 engine: same numbers as one process, recovery from every failure point, config."""

from __future__ import annotations

import os

import pytest
import torch

from automicro.engine import FSDP2Config, FSDP2ConfigError
from automicro.engine import _torch_internals as internals
from automicro.engine.sharding import plan_wrapping
from automicro.testing.multiprocess import run_multiprocess
from tests import engine_cases
from tests.toy_models import Stack, TiedStack

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two_rank_results():
    return run_multiprocess(engine_cases.run_engine_cases, world_size=2, timeout_s=420)


def _ok(result):
    assert "exception" not in result, result.get("exception")
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(engine_cases.NUMERICS_CONFIGS))
def test_two_ranks_match_single_process_after_three_steps(two_rank_results, name):
    for rank_result in two_rank_results:
        result = _ok(rank_result[f"numerics/{name}"])
        assert result["error"] < TOLERANCE, f"{name}: max parameter difference {result['error']}"
        assert result["clean"]


@pytest.mark.multiproc
@pytest.mark.parametrize("config_name", ["defaults", "async_unshard_prefetch2_ac"])
@pytest.mark.parametrize("point", engine_cases.FAIL_POINTS)
def test_recover_after_failure_trains_as_if_it_never_failed(two_rank_results, point, config_name):
    for rank_result in two_rank_results:
        result = _ok(rank_result[f"recover/{point}/{config_name}"])
        assert result["failed"], "the injected failure did not fire"
        assert result["clean"], "an FSDP2 state is not IDLE/sharded after recover()"
        assert result["unsharded_bytes"] == 0, "recover() left unsharded storage"
        assert result["grads"] == 0, "recover() left gradients of the failed attempt"
        assert result["error"] < TOLERANCE, f"parameters differ from a run that never failed by {result['error']}"


@pytest.mark.multiproc
def test_prefetch_plan_chains_follow_forward_order(two_rank_results):
    plan = two_rank_results[0]["plan"]
    assert "blocks.0: forward -> ['blocks.1', 'blocks.2'], backward -> []" in plan
    assert "blocks.2: forward -> [], backward -> ['blocks.1', 'blocks.0']" in plan


@pytest.mark.multiproc
def test_hsdp_2x2_on_four_ranks_matches_single_process_or_is_refused_on_torch_27_cpu():
    results = run_multiprocess(engine_cases.run_hsdp_case, world_size=4, timeout_s=300)
    for result in results:
        if internals.TORCH_VERSION < (2, 8):
            # torch 2.7's FSDP2 cannot run the HSDP all-reduce on CPU streams: refused up front.
            assert result["refused"] and "HSDP on CPU needs torch >= 2.8" in result["refused"]
        else:
            assert result["error"] < TOLERANCE
            assert result["clean"]


def test_gloo_gradient_average_fix_applies_only_where_gloo_sums():
    applied = internals.install_gloo_gradient_average_fix()
    assert applied == (internals.TORCH_VERSION < (2, 8))


def test_record_stream_env_is_set_before_a_group_exists_on_torch_27(monkeypatch):
    from automicro.engine.sharding import AVOID_RECORD_STREAMS_ENV, ensure_record_stream_free

    monkeypatch.delenv(AVOID_RECORD_STREAMS_ENV, raising=False)
    assert not torch.distributed.is_initialized()
    assert ensure_record_stream_free()
    if internals.NEEDS_AVOID_RECORD_STREAMS_ENV:
        assert os.environ.get(AVOID_RECORD_STREAMS_ENV) == "1"
    else:
        assert AVOID_RECORD_STREAMS_ENV not in os.environ


@pytest.mark.parametrize(
    "values, message",
    [
        ({"reshard_after_forward": 0}, "reshard_after_forward=0"),
        ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
        ({"forward_prefetch": -1}, "forward_prefetch=-1"),
        ({"backward_prefetch": True}, "backward_prefetch=True"),
        ({"replicate": 0}, "replicate=0"),
        ({"wrap": "Block"}, "wrap='Block'"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing='yes'"),
        ({"bogus": 1}, "unknown key(s) ['bogus']"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_fsdp2_config_values_are_refused_with_the_key(values, message):
    with pytest.raises(FSDP2ConfigError) as info:
        FSDP2Config.from_dict(values)
    assert message in str(info.value)


def test_wrap_policy_follows_fsdp_wrap_attribute_children_first():
    wrapped, notes = plan_wrapping(Stack(), FSDP2Config())
    assert sorted(wrapped) == ["blocks.0", "blocks.1", "blocks.2"]
    assert notes == []


def test_tied_blocks_are_wrapped_at_their_common_parent():
    wrapped, notes = plan_wrapping(TiedStack(), FSDP2Config())
    assert wrapped == ["blocks.1"]
    assert any("blocks.0" in note and "blocks.2" in note for note in notes)


def test_tied_modules_both_listed_for_wrapping_are_refused_naming_them():
    with pytest.raises(FSDP2ConfigError, match=r"blocks\.0.*blocks\.2"):
        plan_wrapping(TiedStack(), FSDP2Config(wrap=["Linear"]))


@pytest.mark.multiproc
def test_tiny_llama_on_two_ranks_matches_one_process_in_loss_and_parameters_after_three_steps():
    for result in run_multiprocess(engine_cases.run_llama_case, world_size=2, timeout_s=300):
        assert result["loss_error"] < 1e-5
        assert result["param_error"] < TOLERANCE
