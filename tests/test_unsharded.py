"""`device_train_microbatch_size: auto` without FSDP on one rank (issue 26 item 1)."""

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
def test_one_rank_with_fsdp2_trains_unsharded_where_the_layout_search_says_so(one_rank):
    kept = _ok(one_rank["fsdp2_kept_on_cpu"])
    assert kept["sharded"] and kept["fsdp_params"], kept
    assert kept["kept_fsdp2"] == "the layout search is for CUDA devices (layout: fixed on CPU)"
    dropped = _ok(one_rank["fsdp2_dropped"])
    assert not dropped["sharded"] and not dropped["fsdp_params"], dropped
    assert dropped["summary"] and "; layout: unsharded (one rank);" in dropped["summary"], dropped["summary"]
    unsharded = _ok(one_rank["auto"])
    assert [(r["size"], r["outcome"]) for r in dropped["history"]] == [(r["size"], r["outcome"]) for r in unsharded["history"]]
    assert dropped["error"] < 1e-5, dropped["error"]


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


def _decide(**changes):
    import torch

    from automicro.core.layout import LayoutConfig
    from automicro.engine.config import FSDP2Config
    from automicro.integration.one_rank import keep_fsdp2

    model = torch.nn.Linear(256, 256)  # 65,792 fp32 parameters: 263,168 bytes
    args = dict(
        layout=LayoutConfig.parse(None), device_type="cuda", world_size=1, fsdp2=FSDP2Config(), compile_config=None,
        checkpoint_format="full", load_path=None, auto_eval=False, model=model,
        optimizers=[torch.optim.AdamW(model.parameters())], autocast=True, capacity_bytes=2**30,
    )
    args.update(changes)
    return keep_fsdp2(**args)


def test_the_one_rank_choice_drops_fsdp2_only_where_nothing_the_user_asked_for_needs_it():
    import torch

    from automicro.core.layout import LayoutConfig
    from automicro.engine.config import FSDP2Config
    from automicro.integration.one_rank import static_bytes

    assert _decide() is None  # the default layout on one GPU: unsharded
    assert _decide(layout=LayoutConfig.parse("auto")) is None
    assert _decide(layout=LayoutConfig.parse("fixed")) == "layout: fixed"
    assert _decide(layout=LayoutConfig.parse(["no_reshard"])) == "the pinned layout's trades are FSDP2's"
    assert _decide(device_type="cpu") == "the layout search is for CUDA devices (layout: fixed on CPU)"
    assert _decide(device_type="cpu", layout=LayoutConfig.parse("auto")).startswith("not on a GPU")
    assert _decide(world_size=2) == "2 ranks"
    assert _decide(compile_config=object()) == "compile runs per sharded block"
    assert _decide(fsdp2=FSDP2Config(cpu_offload=True)).startswith("cpu_offload")
    assert _decide(fsdp2=FSDP2Config(activation_checkpointing=True)).startswith("activation_checkpointing")
    assert _decide(checkpoint_format="sharded").startswith("checkpoint_format: sharded")
    assert _decide(load_path="/ckpt/ep0.pt").startswith("load_path")
    assert _decide(auto_eval=True).startswith("device_eval_microbatch_size: auto")
    assert _decide(model=torch.nn.Linear(4, 4, device="meta")).startswith("init_device: meta")
    # Memory: fp32 parameters + gradients + AdamW's two moments (projected before the first step) +
    # autocast's 2-byte copies = 18 bytes a parameter; FSDP2 stays above 80% of the GPU.
    model = torch.nn.Linear(256, 256)
    need = static_bytes(model, [torch.optim.AdamW(model.parameters())], autocast=True)
    assert need == 18 * 65_792
    assert _decide(model=model, optimizers=[torch.optim.AdamW(model.parameters())], capacity_bytes=int(need / 0.8) + 1) is None
    too_big = _decide(model=model, optimizers=[torch.optim.AdamW(model.parameters())], capacity_bytes=int(need / 0.8) - 1)
    assert too_big.startswith("unsharded, its parameters, gradients, optimizer state and autocast copies would take")
    # SGD without momentum holds no state; an optimizer of a kind not known counts as Adam.
    assert static_bytes(model, [torch.optim.SGD(model.parameters(), lr=0.1)], autocast=False) == 8 * 65_792

    class Unknown(torch.optim.SGD):
        pass

    assert static_bytes(model, [Unknown(model.parameters(), lr=0.1)], autocast=False) == 16 * 65_792
