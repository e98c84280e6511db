"""`device_train_microbatch_size: auto` without FSDP on one rank."""

from __future__ import annotations

import pytest

from automicro.testing.multiprocess import run_multiprocess
from tests import unsharded_cases as cases


@pytest.fixture(scope="module")
def one_rank():
    return run_multiprocess(cases.run_one_rank, world_size=1, timeout_s=240)[0]


def _ok(result):
    assert "crash" not in result, result.get("crash")
    return result


@pytest.mark.multiproc
def test_auto_without_fsdp_on_one_rank_searches_and_trains_like_the_fixed_size(one_rank):
    result = _ok(one_rank["auto"])
    assert not result["sharded"] and not result["fsdp_params"], result  # Composer's own, unsharded model
    outcomes = [(r["size"], r["outcome"]) for r in result["history"]]
    assert outcomes[:4] == [(8, "oom"), (4, "ok"), (6, "oom"), (5, "ok")], outcomes
    assert result["split"] == [4, 4]
    assert result["adam_steps"] == [cases.BATCHES]
    # Every failed attempt left nothing behind: the parameters equal a fixed run at the settled split
    # (the first batch ran at other splits: compare from the same start, same data, fp32).
    assert result["error"] < 1e-5, result["error"]


@pytest.mark.multiproc
def test_a_one_off_oom_after_the_search_is_rerun_at_the_same_size_without_fsdp(one_rank):
    result = _ok(one_rank["auto_one_off"])
    assert result["fired"] == 1
    rerun = [r for r in result["history"] if r["batch"] == cases.OOM_BATCH]
    assert [r["outcome"] for r in rerun] == ["oom", "ok"] and rerun[0]["size"] == rerun[1]["size"], rerun
    assert result["split"] == _ok(one_rank["auto"])["split"]
    assert result["error"] < 1e-5, result["error"]


@pytest.mark.multiproc
def test_one_rank_with_fsdp2_in_the_config_keeps_it(one_rank):
    kept = _ok(one_rank["fsdp2_kept"])
    assert kept["sharded"] and kept["fsdp_params"], kept
    assert kept["summary"] and "; layout: " in kept["summary"] and "unsharded" not in kept["summary"], kept["summary"]


@pytest.mark.multiproc
def test_on_one_rank_unshard_trains_one_rank_unsharded_with_the_whole_model_compiled(one_rank):
    assert not _ok(one_rank["auto"])["compiled"]
    pinned = _ok(one_rank["pinned_unshard"])
    assert not pinned["sharded"] and not pinned["fsdp_params"], pinned  # the config asked for FSDP2
    assert pinned["compiled"], pinned  # compile: each block asked, the whole model compiled
    assert pinned["split"] == _ok(one_rank["auto"])["split"]
    assert pinned["error"] < 1e-5, pinned["error"]  # equal to the fixed run at the kept size


@pytest.mark.multiproc
def test_on_one_rank_unshard_with_compile_trains_a_transformers_model_at_its_config_defaults(one_rank):
    """The pin with compile printed one failed attempt on a GPU and trained nothing."""
    pinned = _ok(one_rank["hf_pinned_compiled"])
    assert pinned["use_cache"] and pinned["compiled"] and not pinned["sharded"], pinned
    outcomes = [(r["size"], r["outcome"]) for r in pinned["history"]]
    assert outcomes[:4] == [(8, "oom"), (4, "ok"), (6, "oom"), (5, "ok")], outcomes  # the search as without compile
    assert pinned["batches"] == cases.HF_BATCHES and pinned["split"] == [4, 4], pinned
    # Compiled (aot_eager) with the search's failed attempts, equal to an eager run at the kept split.
    assert pinned["error"] < 1e-5, pinned["error"]


@pytest.mark.multiproc
def test_on_one_rank_unshard_keeps_fsdp2_on_two_ranks():
    for result in run_multiprocess(cases.run_two_ranks_pinned, world_size=2, timeout_s=180):
        result = _ok(result)
        assert result["sharded"] and result["fsdp_params"], result
        assert result["split"] == [4, 4], result  # the search as always (5 fits, 8 samples a rank)


@pytest.mark.multiproc
def test_auto_without_fsdp_on_two_ranks_is_refused_naming_the_fix():
    for result in run_multiprocess(cases.run_two_ranks, world_size=2, timeout_s=120):
        assert result["type"] == "FSDP2ConfigError", result
        assert "runs on one rank only (this job has 2)" in result["message"]
        assert "parallelism_config={'fsdp2': {}}" in result["message"]


def test_the_yaml_allows_auto_without_fsdp2_on_one_rank_and_refuses_it_on_several(monkeypatch):
    from automicro.config import ConfigError
    from automicro.config.load import load_config

    assert load_config("configs/tiny-cpu.yaml", ["parallelism_config=null"]).fsdp2 is None
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"auto runs on one rank only, and this job has 8 .*parallelism_config: \{fsdp2: \{\}\}"):
        load_config("configs/tiny-cpu.yaml", ["parallelism_config=null"])
