"""`compile` with `auto` on 2 gloo ranks (backend aot_eager, tests/compile_cases.py), and the
`compile` keys of the YAML and of `automicro.Trainer`."""

from __future__ import annotations

import pytest

from automicro.config.convert import ConfigError
from automicro.config.load import load_config
from automicro.engine.compile import CompileConfig
from automicro.testing.multiprocess import run_multiprocess
from tests import compile_cases as cases


@pytest.fixture(scope="module")
def results():
    return run_multiprocess(cases.run_compile_cases, world_size=2, timeout_s=300)


def _ok(result):
    assert "crash" not in result, result.get("crash")
    return result


@pytest.mark.multiproc
def test_ooms_inside_compiled_forward_and_backward_are_searched_past_and_train_like_eager(results):
    for rank, per_rank in enumerate(results):
        result = _ok(per_rank["gated/auto"])
        assert result["compiled"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"], result
        # 8: rank 0 ran out inside a compiled forward; 6: rank 1 inside a compiled backward.
        assert result["gates_fired"] == ({"forward": 1, "backward": 0} if rank == 0 else {"forward": 0, "backward": 1})
        outcomes = [(r["size"], r["outcome"]) for r in result["history"]]
        assert outcomes[:4] == [(8, "oom"), (4, "ok"), (6, "oom"), (5, "ok")], outcomes
        assert result["found_size"] == 5 and result["split"] == [4, 4]
        assert result["clean"] and result["adam_steps"] == [cases.GATE_BATCHES]
        # The failed attempts left nothing: the parameters equal an eager run at the settled split.
        assert result["params_error"] < 1e-5, result["params_error"]


@pytest.mark.multiproc
def test_the_search_recompiles_each_block_once_whatever_sizes_it_visits(results):
    for per_rank in results:
        result = _ok(per_rank["gated/auto"])
        sizes = {r["size"] for r in result["history"]}
        assert len(sizes) >= 4, sizes
        # One graph for all three blocks (they share their code), static at the first size, then
        # dynamic in the batch dimension from the second: 2 graphs over sizes 8, 4, 6, 5 (and 4).
        assert result["graphs"] == 2, result["graphs"]
        assert _ok(per_rank["gated/eager_fixed"])["graphs"] == 0


@pytest.mark.multiproc
def test_a_token_budget_under_compile_keeps_a_few_graphs_over_a_long_run(results):
    for per_rank in results:
        result = _ok(per_rank["tokens/compiled"])
        assert "exception" not in result, result.get("exception")
        assert result["batches"] == cases.TOKEN_BATCHES
        # Many microbatch shapes (rows x padded length) ...
        assert len(result["shapes"]) >= 10, result["shapes"]
        # ... and a few graphs (static at the first shape, dynamic from the second), none added in the
        # second half of the run.
        graphs = result["graphs"]
        assert graphs[16] == graphs[cases.TOKEN_BATCHES] <= 4, graphs


@pytest.mark.multiproc
def test_the_blocks_are_compiled_again_at_the_settled_size_and_kept_where_faster(results):
    for rank, per_rank in enumerate(results):
        kept = _ok(per_rank["static/kept"])
        assert kept["state"] == "static" and kept["dynamic"] is None, kept  # torch's automatic dynamic, from scratch
        assert kept["compiled"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"], kept
        if rank == 0:
            assert len(kept["lines"]) == 1 and "compiled again at the settled microbatch 8 (split [8])" in kept["lines"][0], kept
            assert ": kept;" in kept["lines"][0] and "as the search compiled them" in kept["lines"][0], kept["lines"]
        # Nothing changes the numbers: equal to the run whose blocks stayed as compiled.
        assert kept["params_vs_pinned"] < 1e-6, kept["params_vs_pinned"]


@pytest.mark.multiproc
def test_the_static_recompile_is_undone_where_it_measures_slower(results):
    for rank, per_rank in enumerate(results):
        undone = _ok(per_rank["static/undone"])
        assert undone["state"] == "dynamic" and undone["dynamic"] is True, undone
        if rank == 0:
            assert len(undone["lines"]) == 1 and ": not kept," in undone["lines"][0], undone["lines"]
            assert "compiled with dynamic shapes" in undone["lines"][0], undone["lines"]
        assert undone["params_vs_pinned"] < 1e-6, undone["params_vs_pinned"]


@pytest.mark.multiproc
def test_a_pinned_dynamic_leaves_the_compiled_blocks_alone(results):
    for rank, per_rank in enumerate(results):
        pinned = _ok(per_rank["static/pinned"])
        assert pinned["state"] == "off" and pinned["dynamic"] is True, pinned
        if rank == 0:
            assert pinned["lines"] == [
                "compile: the blocks stay as compiled (compile.dynamic=true is set); no static recompile at the settled size"
            ], pinned["lines"]


@pytest.mark.multiproc
def test_a_transformers_model_at_its_config_defaults_compiles_every_block(results):
    """With use_cache: true (the default) a training forward made a KV cache whose per-layer slot gave
    each compiled block a guard of its own: one graph per layer up to the recompile limit (8), the
    other layers uncompiled. automicro passes use_cache=False to its training forwards."""
    for per_rank in results:
        result = _ok(per_rank["hf/blocks"])
        # 10 layers: without the hook 8 graphs (one per layer to the limit) and 2 layers uncompiled.
        assert result["all_layers_compiled"] and result["graphs"] <= 3, result  # first size, second size, the recompile
        assert result["config_use_cache"] and result["no_cache_hook"], result  # the config left as it is


def test_static_compile_under_a_token_budget_is_refused_naming_the_fix():
    import torch

    import automicro
    from automicro.integration.callback import AutoMicrobatching
    from tests.toy_models import ComposerStack

    model = ComposerStack()
    with pytest.raises(ValueError, match=r"compile dynamic=false with AutoMicrobatching\(budget='tokens'\).*set compile.dynamic: null"):
        automicro.Trainer(
            model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", max_duration="1ba",
            parallelism_config={"fsdp2": {}}, device_train_microbatch_size="auto",
            callbacks=[AutoMicrobatching(budget="tokens")], compile={"backend": "aot_eager", "dynamic": False},
        )


@pytest.mark.multiproc
@pytest.mark.parametrize("site", cases.FAULT_SITES)
def test_fault_sites_around_compiled_blocks_recover_like_eager(results, site):
    for rank, per_rank in enumerate(results):
        result = _ok(per_rank[f"fault/{site}"])
        assert "exception" not in result, result.get("exception")
        assert (result["fired"] >= 1) == (rank == len(results) - 1), result  # armed on the last rank
        assert result["found_size"] == 5 and result["clean"], result
        assert result["error"] < 1e-5, result["error"]


@pytest.mark.parametrize(
    "override,expected",
    [
        ("compile=true", CompileConfig()),
        ("compile={}", CompileConfig()),
        ("compile=null", None),
        ("compile=false", None),
        ("compile.scope=model", CompileConfig(scope="model")),
        ("compile={mode: max-autotune, dynamic: true, backend: aot_eager}", CompileConfig(mode="max-autotune", dynamic=True, backend="aot_eager")),
    ],
)
def test_the_yaml_compile_section(override, expected):
    assert load_config("configs/tiny-cpu.yaml", [override]).compile == expected


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["compile.mode=fast"], "compile.mode='fast': must be null or one of default, reduce-overhead"),
        (["compile.dynamic=maybe"], "compile.dynamic='maybe': must be null, true or false"),
        (["compile.scope=layers"], "compile.scope='layers': must be one of blocks, model"),
        (["compile=3"], "compile=3: must be true, false, null or a mapping"),
        (["compile={scop: model}"], "unknown key (did you mean 'scope'?)"),
        (["compile=true", "parallelism_config=null", "device_train_microbatch_size=4"], "compile.scope='blocks': compiles each block"),
    ],
)
def test_a_bad_compile_section_is_one_config_error(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config("configs/tiny-cpu.yaml", overrides)
    assert message in str(error.value)


def test_the_trainer_refuses_compile_it_cannot_honour():
    import torch

    import automicro
    from tests.toy_models import ComposerStack

    model = ComposerStack()
    common = dict(model=model, train_dataloader=[], max_duration="1ba", device="cpu",
                  optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="compile and compile_config are both set"):
        automicro.Trainer(**common, compile=True, compile_config={}, parallelism_config={"fsdp2": {}})
    with pytest.raises(ValueError, match="needs parallelism_config=\\{'fsdp2'"):
        automicro.Trainer(**common, compile=True)
    with pytest.raises(ValueError, match="compile.mode='fast'"):
        automicro.Trainer(**common, compile={"mode": "fast"})
