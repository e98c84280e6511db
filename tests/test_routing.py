"""Routed (mixture-of-experts) models from transformers, built from a config: `automicro.batch.routing` finds their
routers and watches the busiest expert's share; `automicro.testing.RoutingSkew` biases them; what the skew does to a
forward and backward's peak under the CPU emulation. One process, no launch (the families of tests/moe_cases.py)."""

from __future__ import annotations

import pytest
import torch

from automicro.batch.routing import MOVED, RoutingWatch, find_routers, grouped_experts
from automicro.testing.memory_cap import MemoryCap
from automicro.testing.routing import RoutingSkew
from tests import moe_cases


def _model(family: str) -> torch.nn.Module:
    import warnings

    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(moe_cases.config(family))


def _tokens(size: int) -> torch.Tensor:
    return torch.randint(0, moe_cases.VOCAB, (size, moe_cases.SEQ), generator=torch.Generator().manual_seed(1))


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """One forward and backward under an unbounded cap: its peak bytes."""
    cap = MemoryCap(1 << 40)
    with cap:
        model(input_ids=tokens, labels=tokens).loss.backward()
    model.zero_grad(set_to_none=True)
    return int(cap.stats()["peak_bytes"])


@pytest.mark.parametrize("family", moe_cases.FAMILIES)
def test_the_routers_of_each_family_are_found_with_their_experts_and_top_k_and_a_dense_model_has_none(family):
    routers = find_routers(_model(family))
    assert len(routers) == 2 and all((r.num_experts, r.top_k) == (16, 2) for r in routers), routers
    assert all(r.name.endswith(".gate") and ".layers.0." in routers[0].name for r in routers[:1]), routers
    import transformers

    dense = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    assert find_routers(dense) == [] and RoutingWatch.of(dense) is None
    assert grouped_experts(dense) == []


@pytest.mark.parametrize("family", moe_cases.FAMILIES)
def test_grouped_experts_keep_the_model_unsharded_untimed_where_fsdp2_computes_them_in_bf16(family, capsys):
    """transformers 5's experts are 3-d weights, which autocast does not cast: the twin would compute them in fp32 where
    FSDP2 (mixed_precision DEFAULT) computes on bf16 copies. 4.x's experts are linear layers, cast as any: timed."""
    import transformers

    from automicro import Trainer
    from automicro.engine.config import FSDP2Config
    from automicro.engine.twin import UnshardedTwin

    model = _model(family)
    grouped = any(p.dim() >= 3 for n, p in model.named_parameters() if ".experts." in n)
    assert grouped == (int(transformers.__version__.split(".")[0]) >= 5)
    names = grouped_experts(model)
    assert names == ([f"model.layers.{i}.{_mlp(model, i)}experts" for i in range(2)] if grouped else []), names

    def twin(mixed_precision):
        return Trainer._unsharded_twin(model, FSDP2Config(mixed_precision=mixed_precision), object(), torch.device("cuda"),
                                       None, {"precision": "amp_bf16"})

    bf16 = twin("DEFAULT")
    lines = capsys.readouterr().out
    if grouped:
        assert bf16 is None and f"FSDP2 kept (the experts' weights ({names[0]} and 1 more) are 3-d" in lines, lines
        assert "mixed_precision=DEFAULT computes them in bf16" in lines, lines
    else:
        assert isinstance(bf16, UnshardedTwin) and lines == "", lines
    assert isinstance(twin("FULL"), UnshardedTwin)  # fp32 both ways: the same computation, timed
    assert capsys.readouterr().out == ""


def _mlp(model: torch.nn.Module, layer: int) -> str:
    """The routed block's name under a decoder layer ("mlp." or Mixtral's "block_sparse_moe.", as the version has it)."""
    decoder = model.model.layers[layer]
    return next(f"{name}." for name, child in decoder.named_children() if hasattr(child, "experts"))


@pytest.mark.parametrize("family", moe_cases.FAMILIES)
def test_the_watch_reads_the_busiest_share_and_says_routing_moved_only_past_the_clean_maximum(family, capsys):
    model = _model(family)
    skew = RoutingSkew([1], expert=3, share=0.9)
    skew.install(model)  # before the watch, as a callback's fit_start comes before auto's first batch: it sees the skew
    watch = RoutingWatch.of(model)
    tokens = _tokens(2)
    watch.begin_attempt()
    _step(model, tokens)  # batch None: routed as the model routes
    even = float(watch._shares().max())
    watch.after_clean()
    # One round of agree_max over one rank is the identity.
    assert watch.moved(lambda values: tuple(values)) is None  # the same routing again: nothing moved
    watch.begin_attempt()
    skew.set_batch(1)
    _step(model, tokens)
    skewed = float(watch._shares().max())
    assert even < 0.5 and skewed >= 0.9, (even, skewed)  # 2 of 16 experts a token: 1/8 when even
    line = watch.moved(lambda values: tuple(values))
    assert line is not None and line.startswith("routing moved the memory: the busiest expert took ") and \
        f"at most {round(even * 100)}% in the batches that ran" in line and ".gate)" in line, line
    assert skewed >= MOVED * even and skew.skewed_calls == 2
    skew.batch_end(None, None)  # the skewed batch says so in the run's log (a GPU run's proof that it fired)
    assert "[automicro] routing skew: batch 1, 1 forward pass(es) sent 90% of their tokens to expert 3" in capsys.readouterr().out
    skew.set_batch(2)
    skew.batch_end(None, None)  # a batch not skewed says nothing
    assert "routing skew" not in capsys.readouterr().out
    # Nothing of the watch's enters the checkpoint.
    assert not [k for k in model.state_dict() if "automicro" in k]
    watch.close()
    skew.remove()


def test_the_watch_counts_on_the_device_it_is_given_not_where_the_routers_parameters_are():
    """The host offload leaves the routers' parameters on the host while the GPU computes (OLMoE's blocks on one H100:
    the counts made beside them, on the host, failed the compiled block's first forward)."""
    model = _model(moe_cases.FAMILIES[0])
    watch = RoutingWatch.of(model, torch.device("meta"))
    assert watch is not None and {getattr(r.module, "_automicro_busiest").device.type for r in watch.routers} == {"meta"}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    watch.close()


@pytest.mark.parametrize("family", moe_cases.FAMILIES)
def test_a_skewed_batch_holds_more_at_its_peak_where_the_expert_loop_keeps_the_busiest_experts_temporaries(family):
    """transformers 4.x's expert loop: the skewed batch's peak above the even one's (the busiest expert's temporaries
    in backward); 5.x's experts: the same peak (what they hold does not depend on the routing)."""
    model = _model(family)
    skew = RoutingSkew([1], expert=0, share=0.9)
    skew.install(model)
    tokens = _tokens(4)
    even = _step(model, tokens)
    assert _step(model, tokens) == even  # the emulation is exact run to run
    skew.set_batch(1)
    skewed = _step(model, tokens)
    if moe_cases.moves_with_routing():
        assert skewed > 1.04 * even, (skewed, even)
    else:
        assert abs(skewed - even) < 0.001 * even, (skewed, even)


def test_the_skew_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="share"):
        RoutingSkew([1], share=0.0)
    with pytest.raises(ValueError, match="has 16 experts"):
        RoutingSkew([1], expert=16).install(_model("mixtral"))
    import transformers

    dense = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="no routed block"):
        RoutingSkew([1]).install(dense)


def test_the_batch_profile_counts_each_familys_expert_products_as_products():
    """The operators a routed model's forward and backward run on this torch (transformers 5 on torch >= 2.9:
    `aten::_grouped_mm`; 4.x: a product per expert) are products in the batch profile, never eager work a compile
    could fuse (which would raise the whole-model compile trial's bound by the experts' time)."""
    import transformers

    from automicro.batch.batch_profile import MATMUL, OPERATOR
    from automicro.engine._torch_internals import profiler_events

    model = _model("qwen3moe")
    tokens = _tokens(2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(input_ids=tokens, labels=tokens).loss.backward()
    names = {e.name for e in profiler_events(profile) if OPERATOR.match(e.name) and e.name.endswith("mm")}
    assert names and all(MATMUL.search(name) for name in names), sorted(n for n in names if not MATMUL.search(n))
    grouped = int(transformers.__version__.split(".")[0]) >= 5 and hasattr(torch, "_grouped_mm") and \
        tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 9)
    assert ("aten::_grouped_mm" in names) == grouped, sorted(names)


class _RoutedBlock(torch.nn.Module):
    """A routed block whose shapes do not depend on the routing (every expert runs on every token, weighted by the
    router's top-k): what compiles in it is the router's hooks and nothing of the tokens' routes."""

    num_experts, top_k = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, self.num_experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, chosen = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        mask = torch.zeros_like(logits).scatter(-1, chosen, weights)
        return sum(mask[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


def test_a_skewed_batch_compiles_nothing_again_in_a_compiled_block():
    """The skew's batch, rank and forward passes are counted outside the compiled blocks; the routers' hooks read one
    switch (a tensor): each block compiles once, the skewed batch routes to the expert and the next one does not."""
    from automicro.engine.compile import compiled_graphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_RoutedBlock(), _RoutedBlock())
    skew = RoutingSkew([2], expert=3, share=1.0)
    skew.install(model)
    watch = RoutingWatch.of(model)
    for block in model:
        block.compile(backend="eager")
    graphs, busiest = [], []
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for batch in range(5):
        skew.set_batch(batch)
        before = compiled_graphs()
        watch.begin_attempt()
        model(x).sum().backward()
        graphs.append(compiled_graphs() - before)
        busiest.append(float(watch._shares().max()))
    assert graphs[0] > 0 and graphs[1:] == [0, 0, 0, 0], graphs
    assert busiest[2] == 1.0 and busiest[1] < 1.0 and busiest[3] == busiest[1], busiest  # every token to expert 3
    watch.close()
    skew.remove()
    torch._dynamo.reset()


def test_a_config_names_the_skew_as_a_callback():
    """`callbacks.routing_skew` in a run's YAML (the GPU benchmarks' `--extra`): the same callback."""
    from automicro.composer import builders
    from automicro.config import load_config

    cfg = load_config("configs/tiny-cpu.yaml", ["callbacks.routing_skew={batches: [30], share: 0.9, forwards: 1}"])
    skew = next(c for c in builders.build_callbacks(cfg) if isinstance(c, RoutingSkew))
    assert skew.batches == frozenset({30}) and skew.share == 0.9 and skew.forwards == 1


def test_watch_routing_takes_a_bool_and_says_what_each_means():
    import automicro

    with pytest.raises(ValueError, match="watch_routing='no': must be true .* or false"):
        automicro.AutoMicrobatching(watch_routing="no")
    assert automicro.AutoMicrobatching(watch_routing=False).settings.watch_routing is False
