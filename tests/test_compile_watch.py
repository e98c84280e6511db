"""What dynamo did to a compiled model, said while the run trains (`automicro.batch.compile_watch`): each graph break's
reason once, graphs compiled after the configuration was final, and the breaks the whole-model compile trial's own
compile traced (`automicro.batch.compile_scope`). One process, real compiles with ``aot_eager`` (no launch): a block
that breaks its graph on purpose, and the tiny routed model of tests/moe_cases.py compiled block by block."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from automicro.batch.compile_scope import ScopeChoice
from automicro.batch.compile_watch import SAID_LATE, CompileWatch
from automicro.engine.compile import CompileConfig, compile_blocks, compiled_graphs, graph_breaks
from tests import moe_cases


class _ItemBlock(torch.nn.Module):
    """A block whose forward reads a tensor's value on the host: dynamo breaks its graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positive = int((x > 0).sum().item())
        return self.linear(x) * (1.0 + positive / x.numel())


def _batch(blocks: list[torch.nn.Module], rows: int) -> None:
    x = torch.randn(rows, 8)
    for block in blocks:
        x = block(x)
    x.sum().backward()


def test_a_graph_break_is_said_once_with_its_reason_and_graphs_compiled_after_the_final_batch_are_said():
    torch._dynamo.reset()
    lines: list[str] = []
    blocks = [_ItemBlock(), _ItemBlock()]
    watch = CompileWatch(lines.append)  # before anything compiles: what the process broke before is not this run's
    compile_blocks(blocks, CompileConfig(backend="aot_eager"))
    _batch(blocks, 4)
    watch.after_batch(0, None)
    assert len(lines) == 1 and lines[0].startswith("compile: dynamo broke the compiled graphs") and "item" in lines[0], lines
    assert "TORCH_LOGS=graph_breaks" in lines[0]
    _batch(blocks, 4)  # the same shape: nothing compiles, the break is not said again
    watch.after_batch(1, None)
    _batch(blocks, 6)  # a new size while trials run (final_at None): compiled, not said
    watch.after_batch(2, None)
    assert len(lines) == 1, lines
    _batch(blocks, 5)  # automatic dynamic now: the third size compiles nothing
    watch.after_batch(3, 2)
    assert len(lines) == 1 and watch.late == [], lines
    torch._dynamo.reset()  # every graph dropped: the next batch compiles again, after the final batch
    _batch(blocks, 5)
    watch.after_batch(4, 2)
    assert len(lines) == 2 and watch.late and watch.late[0][0] == 4, lines
    assert lines[1].startswith(f"compile: {watch.late[0][1]} graph") and "in batch 4, after the configuration was final at batch 2" in lines[1]


def test_graphs_compiled_in_the_final_batch_are_the_last_trials_and_late_ones_past_three_are_counted_not_said():
    lines: list[str] = []
    graphs = iter(range(0, 100, 2))  # two graphs compiled in every batch
    watch = CompileWatch(lines.append, breaks=dict, graphs=lambda: next(graphs))
    watch.after_batch(7, 7)  # the final configuration's first batch may compile what the last trial undid
    assert lines == [] and watch.late == []
    for batch in range(8, 8 + SAID_LATE + 2):
        watch.after_batch(batch, 7)
    assert len(lines) == SAID_LATE and "later ones are counted, not said" in lines[-1], lines
    assert len(watch.late) == SAID_LATE + 2 and watch.late_graphs == 2 * (SAID_LATE + 2)


def test_each_new_reason_is_said_with_how_often_it_was_traced_and_reasons_from_before_the_watch_are_not():
    counts = {"a reason from another model": 3}
    lines: list[str] = []
    watch = CompileWatch(lines.append, breaks=lambda: dict(counts), graphs=lambda: 0)
    counts["Dynamic shape operator"] = 2
    watch.after_batch(0, None)
    counts["Dynamic shape operator"] = 4
    counts["a reason from another model"] = 5  # traced again by this run: said now
    watch.after_batch(1, None)
    assert lines == ['compile: dynamo broke the compiled graphs ("Dynamic shape operator" (2x)); the code between the '
                     "breaks runs eager (TORCH_LOGS=graph_breaks says where)",
                     'compile: dynamo broke the compiled graphs ("a reason from another model" (2x)); the code between the '
                     "breaks runs eager (TORCH_LOGS=graph_breaks says where)"]
    assert watch.traced() == {"Dynamic shape operator": 4, "a reason from another model": 2}


def test_a_routed_models_blocks_compiled_say_where_its_expert_path_breaks_the_graph_and_what_routing_recompiles():
    """The tiny Qwen3-MoE of tests/moe_cases.py, each decoder block compiled (``aot_eager``), six batches of other tokens
    (other routing), the configuration final from batch 0 on. Seen on CPU: transformers 4.51's expert loop on torch
    2.7 breaks at its data-dependent token selection ("Dynamic shape operator"), and each expert's MLP is a frame of
    its own whose row count is the tokens the expert got: an expert that gets none is a new graph (dynamo specializes
    sizes 0 and 1), compiled late (batch 3 of 6). transformers 5.17's grouped products on torch 2.11 make aot_eager fail
    on a host read (``aten._local_scalar_dense``: the frame runs eager); torch 2.15 with transformers 5.24 traces each
    block whole. On 5.x nothing compiles after the first batch however the tokens are routed. Whatever this torch does,
    the break line is said exactly where dynamo counted a break, once, and each late graph is said with its batch."""
    import transformers

    torch._dynamo.reset()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(moe_cases.config("qwen3moe"))
    lines: list[str] = []
    watch = CompileWatch(lines.append)
    compile_blocks(model.model.layers, CompileConfig(backend="aot_eager"), root=model)
    per_batch = []
    for batch in range(6):
        graphs = compiled_graphs()
        tokens = torch.randint(0, moe_cases.VOCAB, (2, moe_cases.SEQ), generator=torch.Generator().manual_seed(batch))
        model(input_ids=tokens, labels=tokens).loss.backward()
        per_batch.append(compiled_graphs() - graphs)
        watch.after_batch(batch, 0)
    assert per_batch[0] > 0  # the blocks did compile
    traced = watch.traced()
    said = [line for line in lines if line.startswith("compile: dynamo broke")]
    assert len(said) == (1 if traced else 0) and all(f'"{reason[:100]}' in said[0] for reason in traced), (traced, lines)
    late = [(batch, graphs) for batch, graphs in enumerate(per_batch) if batch > 0 and graphs]
    assert watch.late == late, (watch.late, per_batch)
    late_lines = [line for line in lines if "after the configuration was final at batch 0" in line]
    assert len(late_lines) == min(len(late), SAID_LATE), lines
    assert all(f" compiled in batch {batch}," in line for (batch, _), line in zip(late, late_lines)), (late, late_lines)
    torch_minor = tuple(int(p) for p in torch.__version__.split(".")[:2])
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        assert late == [], per_batch
    if torch_minor == (2, 7) and major == 4:
        assert any("Dynamic shape operator" in reason for reason in traced), traced
    elif torch_minor == (2, 11) and major == 5:
        assert any("_local_scalar_dense" in reason for reason in traced), traced
    torch._dynamo.reset()


class _Target:
    """The scope trial's target: compiling the whole model "traces" `breaks` graph breaks in its first batch."""

    def __init__(self, counter: list[int], breaks: int) -> None:
        self.counter, self.breaks, self.calls = counter, breaks, []

    def compile_model(self) -> None:
        self.calls.append("model")

    def back_to_blocks(self) -> None:
        self.calls.append("blocks")


class _Consensus:
    def agree_max(self, values):
        return list(values)


@pytest.mark.parametrize("breaks", [0, 3])
def test_the_scope_trials_line_says_the_graph_breaks_its_whole_model_compile_traced(breaks):
    counter = [5]  # breaks traced before the trial (the blocks'): not the whole model's
    lines: list[str] = []
    compiled = SimpleNamespace(config=CompileConfig(backend="aot_eager"), has_other_scope=True)
    target = _Target(counter, breaks)
    scope = ScopeChoice(compiled, _Consensus(), lines.append, torch.device("cpu"), batches=2)  # type: ignore[arg-type]
    scope.target = lambda: ("FSDP2", target)
    scope.breaks = lambda: counter[0]
    scope.timing = lambda arm, seconds: {"blocks": 1.0, "model": 2.0}[arm]
    split = (4, 4)
    for batch in range(8):
        scope.before_batch(True, split)
        if scope.state == "compiling":
            counter[0] += breaks
        scope.after_batch(1, split)
        if scope.state == "blocks":
            break
    assert target.calls == ["model", "blocks"] and scope.model_breaks == breaks, (target.calls, lines)
    verdict = lines[-1]
    assert verdict.startswith("compile: the whole model: not kept") and "its compile batch" in verdict, lines
    assert (f"dynamo broke its graph {breaks} times" in verdict) == bool(breaks), verdict
