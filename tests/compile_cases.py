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
from automicro.integration.callback import AutoMicrobatching
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
