"""The recompute dial (`automicro.engine.recompute`): each rung computes what no checkpointing computes, recomputes
what it says in backward (``op``: the cheap work and not the matrix products; ``k`` blocks: the first k; ``full``:
every block's forward), and switches between batches with no recompile under compiled blocks. No processes: the
blocks on their own; under FSDP2 on two ranks: tests/test_engine.py (``recompute_op``, ``recompute_first_block``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from automicro.engine import FSDP2Config, FSDP2ConfigError
from automicro.engine import _torch_internals as internals
from automicro.engine.compile import CompileConfig, CompiledBlocks
from automicro.engine.recompute import BLOCKS, FULL, OFF, OP, SAVED_OPS, BlockDial, RecomputeConfigError, Rung, parse
from tests.toy_models import Stack

DEPTH = 4


class _Ops(TorchDispatchMode):
    """How often each operator ran (what reached the dispatcher: an operator served from the selective cache did not)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _model(compiled: bool = False):
    torch.manual_seed(0)
    model = Stack(width=32, depth=DEPTH, inputs=32, outputs=32)
    blocks = list(model.blocks)
    compiled_blocks = CompiledBlocks(blocks, CompileConfig(backend="aot_eager")) if compiled else None
    return model, BlockDial.install(blocks, compiled_blocks)


def _step(model, count: bool = False):
    """One forward and backward of a fixed batch: the gradients, and the operators the backward ran (eager only)."""
    torch.manual_seed(1)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    model.zero_grad(set_to_none=True)
    loss = ((model(x) - y) ** 2).mean()
    ops = _Ops()
    if count:
        with ops:
            loss.backward()
    else:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], ops.counts


def test_the_rungs_are_set_by_the_key_and_a_value_that_is_none_says_what_to_set():
    assert parse(False) == Rung(OFF) and parse(True) == parse("full") == Rung(FULL)
    assert parse("op") == Rung(OP) and parse(3) == Rung(BLOCKS, 3)
    assert Rung(BLOCKS, 2).modes(4) == [FULL, FULL, OFF, OFF] and Rung(BLOCKS, 9).modes(4) == [FULL] * 4
    assert Rung(OP).modes(2) == [OP, OP] and parse(3).value() == 3 and parse("op").value() == "op"
    for bad in (0, -2, "selective", 1.5):
        with pytest.raises(RecomputeConfigError, match="must be|at least 1"):
            parse(bad)
    assert FSDP2Config(activation_checkpointing="op").rung == Rung(OP)
    with pytest.raises(FSDP2ConfigError, match=r"parallelism_config.fsdp2.activation_checkpointing='selective': must be true"):
        FSDP2Config(activation_checkpointing="selective")
    # What ``op`` saves: the matrix products and attention, on every supported torch.
    assert {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default} <= SAVED_OPS
    assert any("scaled_dot_product" in str(op) for op in SAVED_OPS)
    assert torch.ops.aten.tanh.default not in SAVED_OPS


@pytest.mark.parametrize("rung", [Rung(OP), Rung(BLOCKS, 1), Rung(BLOCKS, 3), Rung(FULL)], ids=str)
def test_each_rung_gives_the_gradients_of_no_recompute_and_recomputes_what_it_says(rung):
    model, dial = _model()
    reference, plain = _step(model, count=True)
    assert plain.get("tanh", 0) == 0 and plain.get("addmm", 0) == 0  # nothing of the forward runs again
    dial.set(rung)
    grads, ops = _step(model, count=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))
    recomputed = {OP: DEPTH, FULL: DEPTH}.get(rung.kind, rung.blocks)
    assert ops.get("tanh", 0) == recomputed  # each recomputed block's activation, once
    # ``op`` serves the matrix products from what it saved; full and ``k`` blocks run the block's forward again up to
    # the last value backward needs (torch's non-reentrant checkpoint stops there): its first product, not the last.
    assert ops.get("addmm", 0) == (0 if rung.kind == OP else recomputed)
    assert dial.modes() == rung.modes(DEPTH)
    dial.set(Rung(OFF))  # and back, between batches
    grads, ops = _step(model, count=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference)) and ops.get("tanh", 0) == 0


def test_k_blocks_are_the_first_k_whose_activations_live_longest():
    model, dial = _model()
    dial.set(Rung(BLOCKS, 2))
    assert [internals.checkpoint_enabled(block) for block in model.blocks] == [True, True, False, False]


def test_compiled_blocks_take_every_rung_with_the_same_gradients_and_compile_each_form_once():
    model, dial = _model(compiled=True)
    reference, _ = _step(model)
    graphs = internals.compiled_graph_count()
    forms = []
    for rung in (Rung(OP), Rung(BLOCKS, 2), Rung(FULL), Rung(OP), Rung(OFF), Rung(OP)):
        dial.set(rung)
        grads, _ = _step(model)
        assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(grads, reference)), rung
        forms.append(internals.compiled_graph_count() - graphs)
    # ``op`` compiles its form once for every block of the class (one graph), the others reuse the plain one; switching
    # back compiles nothing.
    assert forms == [1, 1, 1, 1, 1, 1], forms
    # Under ``op`` a compiled block checkpoints inside its graph: its hooks are off.
    dial.set(Rung(OP))
    assert not any(internals.checkpoint_enabled(block) for block in model.blocks)


def test_a_full_recompute_asked_for_can_be_tried_down_to_op_and_off_wins_over_op_where_both_are_in_a_layout():
    """`LayoutEngine`'s side of the ``recompute_op`` trade (the search's: tests/test_layout.py; under FSDP2 on two
    ranks: tests/test_engine.py's ``full_op``): a candidate only where full recompute was asked for and the blocks
    carry the dial; the rung each layout puts on the blocks, and the gradients unchanged."""
    from types import SimpleNamespace

    from automicro.engine.layout import LayoutEngine

    def engine_for(asked):
        model, dial = _model()
        named = [("", model)] + [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
        config = FSDP2Config(activation_checkpointing=asked, reshard_after_forward=False)
        sharded = SimpleNamespace(named_fsdp_modules=named, fsdp_modules=[], config=config, recompute=dial, compiled=None)
        dial.set(config.rung)
        return model, dial, LayoutEngine(sharded)

    model, dial, engine = engine_for(True)
    assert engine.candidates() == ["no_recompute", "recompute_op"]
    reference, _ = _step(engine_for(False)[0])
    for layout, kind in (((), FULL), (("recompute_op",), OP), (("no_recompute",), OFF), (("no_recompute", "recompute_op"), OFF)):
        engine.apply(layout)
        assert engine.rung_of(layout).kind == kind and dial.rung.kind == kind, layout
        grads, _ = _step(model)
        assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(grads, reference)), layout
    for asked in ("op", 2):  # a rung below full asked for: nothing to try down from, nor up
        assert "recompute_op" not in engine_for(asked)[2].candidates(), asked
    # None asked for: ``op`` is tried up (at a larger microbatch) beside full.
    assert engine_for(False)[2].candidates() == ["recompute", "recompute_op"]


def test_compiled_blocks_carrying_the_dial_take_recompute_as_a_trade_but_never_inside_a_whole_model_graph():
    """With no checkpointing asked for, blocks that carry the engine's dial offer ``recompute`` (the upsize trial's
    trade) compiled as well as eager: switched on it gives the same gradients, its hooks outside each compiled
    forward. While the whole model is compiled (the compile scope's trial, or kept) it is held
    (`LayoutEngine.recompute_held`) and switching it on is refused, not run with other values."""
    from types import SimpleNamespace

    from automicro.engine.layout import LayoutEngine

    reference, _ = _step(_model()[0])
    for compiled in (False, True):
        model, dial = _model(compiled=compiled)
        named = [("", model)] + [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
        config = FSDP2Config(activation_checkpointing=False, reshard_after_forward=False)
        scope = SimpleNamespace(scope="blocks")
        sharded = SimpleNamespace(named_fsdp_modules=named, fsdp_modules=[], config=config, recompute=dial,
                                  compiled=scope if compiled else None)
        engine = LayoutEngine(sharded)
        assert engine.candidates() == ["recompute", "recompute_op"] and engine.recompute_held is None, compiled
        engine.apply(("recompute",))
        assert dial.rung.kind == FULL and all(internals.checkpoint_enabled(block) for block in model.blocks)
        grads, _ = _step(model)
        assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(grads, reference)), compiled
        engine.apply(("recompute_op",))  # ``op`` tried up from none: the selective rung, the same gradients
        assert dial.rung.kind == OP
        grads, _ = _step(model)
        assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(grads, reference)), compiled
        engine.apply(())
        if compiled:
            scope.scope = "model"
            assert "whole model" in engine.recompute_held
            for rung in (("recompute",), ("recompute_op",)):
                with pytest.raises(RuntimeError, match="whole model is compiled"):
                    engine.apply(rung)
            assert dial.rung.kind == OFF
            engine.apply(())  # off is always allowed
