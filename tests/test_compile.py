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
def test_compiled_blocks_take_checkpointing_on_for_a_larger_microbatch_and_train_as_the_fixed_run(results):
    """`layout: auto` on compiled blocks, checkpointing not asked for: the cap fits 2 without it, not 3, and 4 with it.
    After the other trades (not faster), one batch measures checkpointing on, the upsize trial runs 4 with it against
    2 without, timed faster: kept, no OOM, no graph for the switch (it sits outside each compiled forward), the
    parameters of the fixed run at 2."""
    from automicro.core.layout import GRAD_SYNC_ONCE, NO_RESHARD, RECOMPUTE

    if "upsize/compiled" not in results[0]:
        pytest.skip("torch 2.7 does not compile under the memory cap (the newer torch legs run it)")
    for per_rank in results:
        run = _ok(per_rank["upsize/compiled"])
        without2, without3, with4, limit = run["limit"]
        assert without2 <= limit < without3 and with4 < limit, run["limit"]
        assert run["results"] == [[GRAD_SYNC_ONCE, False], [NO_RESHARD, False], [RECOMPUTE, True]], run["results"]
        assert run["state"]["fits_up_to"] == {RECOMPUTE: 4} and run["state"]["upsized_from"] == [2], run["state"]
        assert run["found"] == 4 and run["settled"] == [RECOMPUTE] and run["splits"][-1] == [4], run["splits"]
        assert "OOMs 0" in run["summary"] and run["diff"] < 1e-5, (run["summary"], run["diff"])
        # The fixed run at 2 compiles one graph (dynamic from the start); the auto run one more, for the probe's
        # microbatch of 1 (torch specializes a dimension of size 1), and none for the switch or for 4.
        assert run["fixed_graphs"] == 1 and run["graphs"] == 2, (run["graphs"], run["fixed_graphs"])


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
        # torch's automatic dynamic, from scratch: static at the settled size
        assert kept["state"] == "static" and kept["dynamic"] is None and not kept["batch_dynamic"], kept
        assert kept["compiled"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"], kept
        if rank == 0:
            assert len(kept["lines"]) == 1 and "compiled again at the settled microbatch 8 (split [8])" in kept["lines"][0], kept
            assert ": kept;" in kept["lines"][0] and "as the search compiled them" in kept["lines"][0], kept["lines"]
        # Nothing changes the numbers: equal to the run whose blocks stayed as compiled.
        assert kept["params_vs_pinned"] < 1e-6, kept["params_vs_pinned"]


@pytest.mark.multiproc
def test_where_the_search_graphs_beat_static_the_blocks_compile_dynamic_in_the_batch_and_are_timed(results):
    for rank, per_rank in enumerate(results):
        undone = _ok(per_rank["static/undone"])
        # Dynamic in the batch only (the search's kind of graph), not `dynamic: true` (every dimension).
        assert undone["state"] == "batch" and undone["dynamic"] is None and undone["batch_dynamic"], undone
        assert undone["compiled"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"], undone
        if rank == 0:
            assert len(undone["lines"]) == 2 and ": not kept," in undone["lines"][0], undone["lines"]
            assert "compiling them dynamic in the batch" in undone["lines"][0], undone["lines"]
            assert undone["lines"][1].startswith("compile: the blocks dynamic in the batch: kept; median batch"), undone["lines"]
        assert undone["params_vs_pinned"] < 1e-6, undone["params_vs_pinned"]


@pytest.mark.multiproc
def test_the_blocks_go_back_to_static_where_dynamic_in_the_batch_measures_slower_still(results):
    for rank, per_rank in enumerate(results):
        back = _ok(per_rank["static/back"])
        assert back["state"] == "static" and back["dynamic"] is None and not back["batch_dynamic"], back
        if rank == 0:
            assert len(back["lines"]) == 2, back["lines"]
            assert back["lines"][1].startswith("compile: the blocks dynamic in the batch: not kept, median batch"), back["lines"]
            assert back["lines"][1].endswith("compiled static again"), back["lines"]
        assert back["params_vs_pinned"] < 1e-6, back["params_vs_pinned"]


@pytest.mark.multiproc
def test_the_whole_model_is_timed_against_the_blocks_and_kept_where_faster(results):
    for rank, per_rank in enumerate(results):
        model = _ok(per_rank["scope/model"])
        assert model["scope_state"] == "model" and model["scope"] == "model", model
        assert model["root_compiled"] and model["compiled"] == [""], model  # the root's forward, no block's
        if rank == 0:
            lines = [line for line in model["lines"] if "whole model" in line]
            assert len(lines) == 2 and lines[0].startswith("compile: the whole model timed against each block"), lines
            assert lines[1].startswith("compile: the whole model: kept; median batch") and "compile batch" in lines[1], lines
        # Nothing changes the numbers: equal to the run whose blocks stayed compiled, and to one that
        # compiled the whole model from the start.
        assert model["params_vs_pinned"] < 1e-6, model["params_vs_pinned"]
        assert model["params_vs_started_whole"] < 1e-6, model["params_vs_started_whole"]


@pytest.mark.multiproc
def test_the_whole_model_is_undone_where_it_measures_slower_and_the_blocks_come_back_as_they_were(results):
    for rank, per_rank in enumerate(results):
        blocks = _ok(per_rank["scope/blocks"])
        assert blocks["scope_state"] == "blocks" and blocks["scope"] == "blocks" and not blocks["root_compiled"], blocks
        assert blocks["compiled"] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"], blocks
        assert blocks["dynamic"] is True, blocks  # as they were: the pinned `dynamic`
        if rank == 0:
            lines = [line for line in blocks["lines"] if "whole model" in line]
            assert len(lines) == 2 and lines[1].startswith("compile: the whole model: not kept, median batch"), lines
            assert lines[1].endswith("each block compiled as before (its graphs kept)"), lines
        assert blocks["params_vs_pinned"] < 1e-6, blocks["params_vs_pinned"]


@pytest.mark.multiproc
def test_a_transformers_model_trains_with_the_whole_model_compiled_mid_run(results):
    import math

    for rank, per_rank in enumerate(results):
        result = _ok(per_rank["hf/scope"])
        assert result["scope"] == "model" and result["batches"] == cases.HF_SCOPE_BATCHES, result
        assert math.isfinite(result["loss"]), result
        if rank == 0:
            assert len(result["lines"]) == 2 and "the whole model: kept" in result["lines"][1], result["lines"]


@pytest.mark.multiproc
def test_a_pinned_scope_is_not_timed(results):
    for per_rank in results:
        pinned = _ok(per_rank["static/pinned"])
        assert pinned["scope_state"] == "off" and not any("whole model" in line for line in pinned["lines"]), pinned


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
    from automicro.composer.callback import AutoMicrobatching
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
        (["compile.scope=layers"], "compile.scope='layers': must be null (measured) or one of blocks, model"),
        (["compile=3"], "compile=3: must be true, false, null or a mapping"),
        (["compile={scop: model}"], "unknown key (did you mean 'scope'?)"),
        (["compile.scope=blocks", "parallelism_config=null", "device_train_microbatch_size=4"], "compile.scope='blocks': compiles each block"),
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
        automicro.Trainer(**common, compile={"scope": "blocks"})
    with pytest.raises(ValueError, match="compile.mode='fast'"):
        automicro.Trainer(**common, compile={"mode": "fast"})


def test_blocks_compiled_dynamic_in_the_batch_take_any_batch_size_and_stay_static_elsewhere():
    """`CompiledBlocks.recompile(None, batch_dynamic=True)` (`_torch_internals.mark_batch_dynamic`):
    one graph for every batch size, a new one where another dimension changes; `recompile(None)`
    drops the marking (static at the next size, a second graph once a second size comes)."""
    import torch

    from automicro.engine.compile import CompiledBlocks, compiled_graphs

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.relu(self.linear(x))

    blocks = [Block() for _ in range(2)]
    compiled = CompiledBlocks(blocks, CompileConfig(backend="aot_eager"))

    def run(batch: int, seq: int = 5) -> int:
        before = compiled_graphs()
        x = torch.randn(batch, seq, 8, requires_grad=True)  # as a model's embeddings feed its blocks
        for block in blocks:
            x = block(x)
        return compiled_graphs() - before

    compiled.recompile(None, batch_dynamic=True)
    assert compiled.batch_dynamic and compiled.dynamic is None
    assert [run(4), run(6), run(9), run(4)] == [1, 0, 0, 0]  # one graph, shared by both blocks
    assert run(6, seq=7) == 1  # the sequence dimension stays static
    compiled.recompile(None)
    assert not compiled.batch_dynamic
    assert [run(4), run(4), run(6), run(9)] == [1, 0, 1, 0]  # static at 4, automatic dynamic from 6


def test_a_module_compiled_with_its_hooks_gets_its_forward_compiled_and_its_hooks_left_eager():
    """torchtitan compiles each block with `nn.Module.compile` (hooks traced, fullgraph); a sync hook that
    reads a value breaks that graph. `compile_forwards_not_hooks` compiles the same forward, hooks eager."""
    import torch

    from automicro.engine import _torch_internals as internals

    def build():
        torch.manual_seed(0)
        root = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        seen = []
        # Branching on a value, as a consensus round does on its result.
        root[0].register_forward_hook(lambda m, i, o: seen.append(1) if bool(o.sum() > -1e9) else None)
        for block in root:
            block.compile(backend="eager", fullgraph=True)
        return root, seen

    x = torch.randn(3, 4)
    traced, _ = build()
    with pytest.raises(Exception):
        traced(x)  # the hook's branch on a value cannot be traced into a full graph
    eager = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    root, seen = build()
    eager.load_state_dict(root.state_dict())
    assert internals.compile_forwards_not_hooks(root, backend="eager", fullgraph=True) == 2
    assert torch.allclose(root(x), eager(x)) and len(seen) == 1
