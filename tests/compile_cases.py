"""Multi-rank cases for `compile` with `auto` (CPU, gloo, backend `aot_eager`).

`aot_eager` is the backend CI can run: dynamo traces each block's forward and AOTAutograd its
backward, and the traced ATen graph runs op by op (no generated kernels, no C++ compiler). The
emulated memory cap cannot stand in for the allocator here: dynamo does not compile while a
`TorchDispatchMode` is active (it runs the block eager). So an opaque custom op inside each
compiled block raises the OOM, in the compiled forward or in the compiled backward, as the CUDA
allocator would under inductor. Each case returns plain data for tests/test_compile.py; a case that breaks
is {"crash": ...}.
"""

from __future__ import annotations

from typing import Any

import torch

import automicro
from automicro.engine.compile import compiled_graphs
from automicro.composer.callback import AutoMicrobatching
from tests.automicro_cases import (
    MATRIX_BATCHES,
    SEED,
    adam_steps,
    fault_case,
    history,
    make_loader,
    record_case,
    max_error,
    reference_params,
)
from tests.timings import arm_seconds
from tests.toy_models import Block, ComposerStack, full_state

COMPILE = {"backend": "aot_eager"}
# Inside each compiled block an opaque op (a torch custom op dynamo keeps in the graph) runs out of
# memory when its microbatch is above the rank's limit: rank 0 in forward above 6 samples, rank 1
# in backward above 5. The search meets both inside compiled code on the way to size 5 (8: rank 0's
# forward; 6: rank 1's backward).
GATE_FORWARD = {0: 6}
GATE_BACKWARD = {1: 5}
FIRED = {"forward": 0, "backward": 0}
GATE_BATCHES = 4
# One site per phase of an attempt, each on one rank during the search.
FAULT_SITES = ("forward_pre", "backward", "reduce_scatter_alloc")


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _check_gate(x: torch.Tensor, limits: dict[int, int], where: str) -> None:
    limit = limits.get(_rank())
    if limit is not None and x.shape[0] > limit:
        FIRED[where] += 1
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate (test: {where} of a compiled block)")


@torch.library.custom_op("automicro_test::oom_gate", mutates_args=())
def oom_gate(x: torch.Tensor) -> torch.Tensor:
    _check_gate(x, GATE_FORWARD, "forward")
    return x.clone()


@oom_gate.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("automicro_test::oom_gate_backward", mutates_args=())
def oom_gate_backward(grad: torch.Tensor) -> torch.Tensor:
    _check_gate(grad, GATE_BACKWARD, "backward")
    return grad.clone()


@oom_gate_backward.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


oom_gate.register_autograd(lambda ctx, grad: oom_gate_backward(grad))


class GatedBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(oom_gate(x))


def _gated_trainer(world: int, microbatch: Any, auto: Any, compile: Any, gate: bool) -> automicro.Trainer:
    torch.manual_seed(0)
    model = ComposerStack()
    if gate:
        for index, block in enumerate(model.model.blocks):
            gated = GatedBlock(block.up.in_features)
            gated.load_state_dict(block.state_dict())
            model.model.blocks[index] = gated
    return automicro.Trainer(
        model=model,
        train_dataloader=make_loader(world, GATE_BATCHES),
        max_duration=f"{GATE_BATCHES}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        parallelism_config={"fsdp2": {}},
        device_train_microbatch_size=microbatch,
        callbacks=[auto] if auto else [],
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=SEED,
        compile=compile,
    )


def _gated(world: int, microbatch: Any, compile: Any, gate: bool = True) -> dict[str, Any]:
    auto = AutoMicrobatching(log_attempts=False) if microbatch == "auto" else None
    torch.compiler.reset()
    FIRED.update(forward=0, backward=0)
    graphs_before = compiled_graphs()
    trainer = _gated_trainer(world, microbatch, auto, compile, gate)
    try:
        trainer.fit()
        return {
            "history": history(auto) if auto else [],
            "found_size": auto.found_size if auto else microbatch,
            "split": list(auto.policy.current_split()) if auto else None,
            "graphs": compiled_graphs() - graphs_before,
            "gates_fired": dict(FIRED),
            "compiled": [name for name, m in trainer.state.model.named_modules() if _is_compiled(m)],
            "clean": trainer.sharded_model.is_clean(),
            "adam_steps": adam_steps(trainer),
            "params": full_state(trainer.state.model),
        }
    finally:
        trainer.close()


def _is_compiled(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return forward is not None and hasattr(forward, "_torchdynamo_orig_callable")


TOKEN_BATCHES = 32


def _token_budget_compiled(world: int) -> dict[str, Any]:
    """`budget: tokens` under compile (aot_eager, dynamic: null) for TOKEN_BATCHES variable-length
    batches, under a token limit that forces splits: the graphs compiled by batch 8, 16 and the
    end, and the microbatch shapes the blocks saw."""
    from composer.core import Callback

    from automicro.engine.compile import compiled_graphs
    from tests import token_cases

    class Shapes(Callback):
        def __init__(self) -> None:
            self.shapes: set[tuple[int, ...]] = set()
            self.graphs: dict[int, int] = {}
            self.start = compiled_graphs()

        def before_forward(self, state: Any, logger: Any) -> None:
            self.shapes.add(tuple(state.batch["input_ids"].shape))

        def batch_end(self, state: Any, logger: Any) -> None:
            self.graphs[int(state.timestamp.batch)] = compiled_graphs() - self.start

    shapes = Shapes()
    auto = AutoMicrobatching(budget="tokens", log_attempts=False)
    result = token_cases.fit(
        "auto", [auto, token_cases.TokenLimit(token_cases.limits(world)), shapes], batches=TOKEN_BATCHES, compile=COMPILE,
    )
    result.pop("params", None)
    result.update(shapes=sorted(shapes.shapes), graphs={k: shapes.graphs[k] for k in (8, 16, TOKEN_BATCHES)})
    return result


# Settled at batch 0, hooks off after 3; 3 timed as the search compiled them, 1 compiling, 3 static:
# decided at batch 10; where the search's graphs won, 1 compiling and 3 dynamic in the batch: decided
# at batch 14; one more batch compiles the kept graphs.
STATIC_BATCHES = 16


class SlowArm:
    """A Composer callback that makes arms of the static recompile and of the scope trial slower
    (`StaticShapes.timing`, `ScopeChoice.timing`): `slow` maps an arm ("search", "static", "batch";
    "blocks", "model") to a factor; every batch of an arm takes 1 s times it, whatever was measured
    (`tests/timings.py`)."""

    def __init__(self, auto: AutoMicrobatching, slow: dict[str, float]) -> None:
        self.auto, self.slow = auto, slow

    def run_event(self, event: Any, state: Any, logger: Any) -> None:
        timing = arm_seconds(self.slow)
        for trial in (self.auto.search.static_shapes, self.auto.search.compile_scope):
            if trial is not None:
                trial.timing = timing


def _static(world: int, slow: dict[str, float], compile: Any = COMPILE) -> dict[str, Any]:
    """`auto` under compile (aot_eager) for STATIC_BATCHES batches; `slow`: the arms made to look slower
    and by what factor ("search": the blocks as the search compiled them; "static": compiled again at
    the settled size; "batch": compiled again dynamic in the batch only)."""
    from composer.core import Callback

    lines: list[str] = []
    auto = AutoMicrobatching(log_attempts=False, bound_trials=False)  # the trial's logic, unpriced (`trial_plan`)
    slow_arm = type("SlowArmCallback", (SlowArm, Callback), {})(auto, slow)
    torch.compiler.reset()
    torch.manual_seed(0)
    model = ComposerStack()
    trainer = automicro.Trainer(
        model=model, train_dataloader=make_loader(world, STATIC_BATCHES), max_duration=f"{STATIC_BATCHES}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu", parallelism_config={"fsdp2": {}},
        device_train_microbatch_size="auto", callbacks=[auto, slow_arm], loggers=[], progress_bar=False,
        log_to_console=False, seed=SEED, compile=compile,
    )
    auto.runtime.info = lambda message: lines.append(message)  # type: ignore[method-assign]
    try:
        trainer.fit()
        static = auto.search.static_shapes
        scope = auto.search.compile_scope
        root_forward = trainer.state.model.__dict__.get("forward")
        return {
            "state": None if static is None else static.state,
            "scope_state": None if scope is None else scope.state,
            "scope": None if trainer.sharded_model.compiled is None else trainer.sharded_model.compiled.scope,
            "root_compiled": root_forward is not None and hasattr(root_forward, "_torchdynamo_orig_callable"),
            "dynamic": None if trainer.sharded_model.compiled is None else trainer.sharded_model.compiled.dynamic,
            "batch_dynamic": None if trainer.sharded_model.compiled is None else trainer.sharded_model.compiled.batch_dynamic,
            "compiled": [name for name, m in trainer.state.model.named_modules() if _is_compiled(m)],
            "lines": [line for line in lines if line.startswith("compile:")],
            "split": list(auto.policy.current_split()),
            "params": full_state(trainer.state.model),
        }
    finally:
        trainer.close()


def _hf_llama_blocks(world: int) -> dict[str, Any]:
    """A transformers Llama at its config defaults (use_cache: true), each block compiled under FSDP2:
    the graphs compiled (dynamo's recompile limit is 8: one graph per layer stops there)."""
    import warnings

    from composer.models import HuggingFaceModel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.compiler.reset()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=10, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HuggingFaceModel(LlamaForCausalLM(config), tokenizer=None, use_logits=True)
    rank_seed = 5
    generator = torch.Generator().manual_seed(rank_seed)
    rows = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 128, (8 * 4 * world, 16), generator=generator)]
    from composer.utils import dist as composer_dist

    loader = torch.utils.data.DataLoader(rows, batch_size=8, sampler=composer_dist.get_sampler(rows, shuffle=False),
                                         collate_fn=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]})
    before = compiled_graphs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = automicro.Trainer(
            model=model, train_dataloader=loader, max_duration="4ba", optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
            device="cpu", parallelism_config={"fsdp2": {}}, device_train_microbatch_size="auto",
            callbacks=[AutoMicrobatching(log_attempts=False, start_size=4)], loggers=[], progress_bar=False,
            log_to_console=False, seed=SEED + rank_seed, compile=COMPILE,
        )
        try:
            trainer.fit()
            layers = [f"model.model.layers.{i}" for i in range(config.num_hidden_layers)]
            compiled = {name for name, m in trainer.state.model.named_modules() if _is_compiled(m)}
            return {
                "graphs": compiled_graphs() - before,
                "all_layers_compiled": all(layer in compiled for layer in layers),
                "no_cache_hook": bool(getattr(model.model, "_automicro_training_no_cache", False)),
                "config_use_cache": config.use_cache,
            }
        finally:
            trainer.close()


# Hooks off after batch 3; 2 batches profiled (`trial_plan`); 1 untimed, up to 3 with the blocks, 1 compiling, up to 3
# whole: decided by batch 13.
HF_SCOPE_BATCHES = 16


def _hf_llama_scope(world: int) -> dict[str, Any]:
    """The scope trial on a transformers Llama at its config defaults under FSDP2 (aot_eager,
    `dynamic` pinned so the static recompile stays off), the blocks made to look slower: the whole
    model compiled mid-run, with FSDP2's hooks and the `use_cache=False` pre-hook inside it, trains."""
    import warnings

    from composer.core import Callback
    from composer.models import HuggingFaceModel
    from composer.utils import dist as composer_dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.compiler.reset()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HuggingFaceModel(LlamaForCausalLM(config), tokenizer=None, use_logits=True)
    generator = torch.Generator().manual_seed(7)
    rows = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 128, (8 * HF_SCOPE_BATCHES * world, 16), generator=generator)]
    loader = torch.utils.data.DataLoader(rows, batch_size=8, sampler=composer_dist.get_sampler(rows, shuffle=False),
                                         collate_fn=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]})
    auto = AutoMicrobatching(log_attempts=False, start_size=4, bound_trials=False)  # the scope trial's logic, unpriced
    slow = type("SlowArmCallback", (SlowArm, Callback), {})(auto, {"blocks": 3.0})
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = automicro.Trainer(
            model=model, train_dataloader=loader, max_duration=f"{HF_SCOPE_BATCHES}ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu", parallelism_config={"fsdp2": {}},
            device_train_microbatch_size="auto", callbacks=[auto, slow], loggers=[], progress_bar=False,
            log_to_console=False, seed=SEED, compile={**COMPILE, "dynamic": True},
        )
        auto.runtime.info = lambda message: lines.append(message)  # type: ignore[method-assign]
        try:
            trainer.fit()
            return {
                "scope": trainer.sharded_model.compiled.scope,
                "batches": int(trainer.state.timestamp.batch),
                "loss": float(trainer.state.loss),
                "lines": [line for line in lines if line.startswith("compile:") and "whole model" in line],
            }
        finally:
            trainer.close()


def run_compile_cases(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def case(name: str, fn: Any) -> None:
        record_case(out, name, fn)

    case("gated/auto", lambda: _gated(world, "auto", COMPILE))
    found = out["gated/auto"].get("split") if "crash" not in out["gated/auto"] else None
    if found:
        # The split it settled on, fixed and eager, without the gates: the compiled search and its
        # failed attempts left nothing behind.
        case("gated/eager_fixed", lambda: _gated(world, max(found), None, gate=False))
    case("tokens/compiled", lambda: _token_budget_compiled(world))
    # The static recompile once the size settles: kept where the search's graphs measure slower,
    # undone where the new ones do; a pinned `dynamic` leaves the blocks alone (the reference).
    # The scope pinned to blocks there; the scope trial on its own with `dynamic` pinned (the static
    # recompile off): the whole model kept where the blocks measure slower, undone where it does.
    blocks = {**COMPILE, "scope": "blocks"}
    case("static/kept", lambda: _static(world, slow={"search": 3.0}, compile=blocks))
    case("static/undone", lambda: _static(world, slow={"static": 3.0}, compile=blocks))
    case("static/back", lambda: _static(world, slow={"static": 3.0, "batch": 9.0}, compile=blocks))
    case("static/pinned", lambda: _static(world, slow={"search": 3.0}, compile={**blocks, "dynamic": True}))
    case("scope/model", lambda: _static(world, slow={"blocks": 3.0}, compile={**COMPILE, "dynamic": True}))
    case("scope/blocks", lambda: _static(world, slow={"model": 3.0}, compile={**COMPILE, "dynamic": True}))
    # A run that started with the whole model compiled (Composer's compile_config): the reference of
    # the run that switched to it mid-run.
    case("scope/pinned_model", lambda: _static(world, slow={}, compile={**COMPILE, "dynamic": True, "scope": "model"}))
    if "params" in out["scope/model"] and "params" in out["scope/pinned_model"]:
        out["scope/model"]["params_vs_started_whole"] = max_error(out["scope/model"]["params"], out["scope/pinned_model"]["params"])
    for name in ("static/kept", "static/undone", "static/back", "scope/model", "scope/blocks"):
        if "params" in out[name] and "params" in out["static/pinned"]:
            out[name]["params_vs_pinned"] = max_error(out[name]["params"], out["static/pinned"]["params"])
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8):
        # Checkpointing switched on for a larger microbatch (the layout's upsize trade) on compiled blocks, under the
        # memory cap (torch 2.7 runs a block eager under the cap's dispatch mode: not there).
        from tests.layout_cases import upsize_compiled_case

        case("upsize/compiled", upsize_compiled_case)
    case("hf/blocks", lambda: _hf_llama_blocks(world))
    case("hf/scope", lambda: _hf_llama_scope(world))
    reference = reference_params(world, MATRIX_BATCHES)
    for site in FAULT_SITES:
        case(f"fault/{site}", lambda s=site: _fault(world, s, reference))
    for name, result in out.items():
        if isinstance(result, dict) and "params" in result:
            result["params_error"] = None if name == "gated/eager_fixed" or "gated/eager_fixed" not in out else (
                max_error(result["params"], out["gated/eager_fixed"]["params"])
            )
    for result in out.values():
        result.pop("params", None)
    return out


def _fault(world: int, site: str, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    result = fault_case(world, site, [world - 1], 0, reference, compile=COMPILE)
    result.pop("states", None)
    return result


__all__ = ["COMPILE", "FAULT_SITES", "GATE_BACKWARD", "GATE_FORWARD", "run_compile_cases"]
