"""Cases for tests/test_offload.py: the host offload switched on between batches (`automicro.engine.offload`) and as
the ladder's last rung (`automicro.batch.floor_ladder`, `automicro.batch.host_offload`), on CPU ranks (gloo).

A model of three residual MLP blocks and a head, sharded by the engine (`automicro.engine.shard`, each block wrapped),
trained STEPS steps of two microbatches each: without the offload; built with FSDP2's own ``CPUOffloadPolicy`` (torch's
`fully_shard`, as ``cpu_offload: true`` builds it; pinning off: a CPU has no pinned memory); and switched on after
AT steps. On a CPU device the switch moves no byte (the host is the device): what it checks is that FSDP2's offload
path, the rebuilt parameters and the moved optimizer state give every number of the run built with it. The GPU run in
benchmarks/RESULTS.md (2026-12-07, the host offload) measures the move on CUDA. Every case returns plain data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

STEPS = 6
AT = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 40), nn.Linear(40, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "decoupled_adamw":
        from composer.optim import DecoupledAdamW

        return DecoupledAdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)


def _build(mode: str) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from automicro.engine import FSDP2Config, shard

    torch.manual_seed(0)
    model = Net()
    if mode == "built":
        policy = CPUOffloadPolicy(pin_memory=False)
        for block in model.blocks:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
        return model, None
    return model, shard(model, FSDP2Config(wrap=["Block"]), device=torch.device("cpu"))


def _train(mode: str, optimizer_name: str) -> dict[str, Any]:
    from automicro.engine import local_step
    from automicro.engine.offload import is_offloaded, offload_to_host

    model, sharded = _build(mode)
    optimizer = _optimizer(optimizer_name, model)
    ids = [id(p) for p in model.parameters()]
    out: dict[str, Any] = {"local_step": "not asked", "start": [p.full_tensor().detach().clone() for p in model.parameters()]}
    if optimizer_name == "decoupled_adamw" and sharded is not None:
        out["local_step"] = local_step.install(optimizer, sharded.config.local_optimizer_step)
    for step in range(STEPS):
        if mode == "projected" and step == AT:
            out["projected"] = _taken_after_a_batch(sharded, optimizer, step)
        if mode == "switched" and step == AT:
            before = is_offloaded(sharded)
            moved = offload_to_host(sharded, [optimizer])
            again = offload_to_host(sharded, [optimizer])
            states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
            out["switch"] = {
                "before": before, "after": is_offloaded(sharded), "again_params": again.param_bytes,
                "moved_params": moved.param_bytes,
                "param_bytes": sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters()),
                "states_dtensor": bool(states) and all(type(v).__name__ == "DTensor" for v in states),
                "config_offload": sharded.config.cpu_offload, "compute_stream_buffers": sharded.compute_stream_buffers,
            }
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        x = torch.randn(4, 16)
        y = torch.randint(0, 7, (4,))
        for half in (slice(0, 2), slice(2, 4)):
            torch.nn.functional.cross_entropy(model(x[half]), y[half]).div(2).backward()
        optimizer.step()
        if not (mode == "projected" and step == AT - 1):  # the step's gradients held into the next batch, as a host's
            optimizer.zero_grad(set_to_none=True)
    out["same_objects"] = ids == [id(p) for p in model.parameters()]
    out["params"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out


def _taken_after_a_batch(sharded: Any, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """The rung taken after batch `step - 1` trained (size 1 ran; its peak with the optimizer state its step added
    does not fit: `TrainingSearch._ladder_on_projection`), with that step's gradients still held: nothing moves until
    the next batch starts (what runs at a batch's end reads the gradients), then the gradients are dropped and the
    offload switched on."""
    from automicro.batch.floor_ladder import FloorLadder
    from automicro.batch.host_offload import HostOffload
    from automicro.core.consensus import RankReport, Verdict
    from automicro.engine.offload import is_offloaded

    lines: list[str] = []
    offload = HostOffload("auto", lines.append)
    offload.sharded = sharded  # `check` refuses a CPU job; the rung's logic is the same on a GPU
    ladder = FloorLadder(None, lines.append, offload=offload)
    verdict = Verdict(reports=(RankReport(0, 0, "ok", 0, 2**20, 2**20, 2**19),), rounds=1)
    line = ladder.step(step - 1, verdict, optimizers=[optimizer], projected="rank 0: peak 1.5 MiB with it, capacity 1.0 MiB")
    held = sum(p.grad is not None for p in sharded.module.parameters())
    out = {"line": line, "last": ladder.last, "on_at_step": offload.on, "offloaded_at_step": is_offloaded(sharded),
           "grads_held_at_step": held, "state": offload.state_dict(), "summary": ladder.summary(),
           "tried": ladder.tried(), "left": ladder.why_not()}
    offload.before_batch(step, [optimizer])
    out.update(on=offload.on, offloaded=is_offloaded(sharded),
               grads_after=sum(p.grad is not None for p in sharded.module.parameters()), lines=lines)
    return out


def _max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _dtensor_like() -> dict[str, Any]:
    """The local step's state made over a parameter (`_torch_internals.dtensor_like`): the local tensor kept as it is
    (on the host under the offload; `DTensor.from_local` would copy it to the mesh's device)."""
    from automicro.engine import _torch_internals as internals

    model, _ = _build("engine")
    param = next(model.parameters())
    local = torch.zeros_like(param.to_local(), dtype=torch.float64)
    made = internals.dtensor_like(local, param)
    return {"same_local": made.to_local().data_ptr() == local.data_ptr() and made.to_local().device == local.device, "placements": made.placements == param.placements,
            "shape": tuple(made.shape) == tuple(param.shape), "dtype": made.dtype == torch.float64}


def _mid_step_refused() -> dict[str, Any]:
    """A forward without its backward leaves the root unsharded: the switch refuses it, and runs after `recover()`."""
    from automicro.engine.offload import offload_to_host

    model, sharded = _build("engine")
    optimizer = _optimizer("adamw", model)
    model(torch.randn(2, 16))
    try:
        offload_to_host(sharded, [optimizer])
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    sharded.recover()
    moved = offload_to_host(sharded, [optimizer])
    return {"refused": refused, "after_recover": moved.param_bytes > 0}


def _ladder() -> dict[str, Any]:
    """The ladder's last rung: no layout rung left (no layout trials), ``offload: auto``: the step switches the host
    offload on and says so; then nothing is left, and the run-ending words name it."""
    from automicro.batch.floor_ladder import FloorLadder
    from automicro.batch.host_offload import HostOffload
    from automicro.core.consensus import RankReport, Verdict

    model, sharded = _build("engine")
    optimizer = _optimizer("adamw", model)
    lines: list[str] = []
    offload = HostOffload("auto", lines.append)
    offload.sharded = sharded  # `check` refuses a CPU job; the rung's logic is the same on a GPU
    unasked = FloorLadder(None, lines.append, offload=HostOffload(None, lines.append))
    unasked.offload.sharded = sharded
    ladder = FloorLadder(None, lines.append, offload=offload)
    left_before = ladder.why_not()
    verdict = Verdict(reports=(RankReport(0, 1, "forward", 0, 2**20, 2**20, 2**19),), rounds=1)
    line = ladder.step(0, verdict, optimizers=[optimizer])
    out = {
        "left_before": left_before, "line": line, "last": ladder.last, "stepped": ladder.stepped,
        "left_after": ladder.why_not(), "again": ladder.step(1, verdict, optimizers=[optimizer]),
        "tried": ladder.tried(), "summary": ladder.summary(), "state": offload.state_dict(),
        "metrics": offload.metrics(), "unasked_why": unasked.why_not(), "unasked_words": unasked.unasked(),
    }
    # A resumed run: the checkpoint's state switches a fresh model's offload on before its first batch.
    model2, sharded2 = _build("engine")
    optimizer2 = _optimizer("adamw", model2)
    resumed = HostOffload("auto", lines.append)
    resumed.sharded = sharded2
    resumed.load_state_dict(offload.state_dict())
    resumed.resume([optimizer2])
    from automicro.engine.offload import is_offloaded

    out["resumed"] = {"on": resumed.on, "offloaded": is_offloaded(sharded2)}
    out["lines"] = lines
    return out


def _config_errors() -> dict[str, str]:
    from automicro.batch.host_offload import HostOffload, check_mode

    errors = {}
    for name, call in (
        ("cpu", lambda: HostOffload("auto", print).check("cpu", False, None)),
        ("pipeline", lambda: HostOffload("auto", print).check("cuda", True, None)),
        ("value", lambda: check_mode("on")),
    ):
        try:
            call()
            errors[name] = ""
        except ValueError as error:
            errors[name] = str(error)
    return errors


def everything(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for optimizer_name in ("adamw", "decoupled_adamw"):
        runs = {mode: _train(mode, optimizer_name) for mode in ("engine", "built", "switched", "projected")}
        out[optimizer_name] = {
            "switched_vs_built": _max_gap(runs["switched"]["params"], runs["built"]["params"]),
            "projected_vs_built": _max_gap(runs["projected"]["params"], runs["built"]["params"]),
            "projected": runs["projected"]["projected"],
            "switched_vs_engine": _max_gap(runs["switched"]["params"], runs["engine"]["params"]),
            "trained": _max_gap(runs["switched"]["params"], runs["switched"]["start"]),
            "switch": runs["switched"]["switch"], "same_objects": runs["switched"]["same_objects"],
            "local_step": runs["switched"]["local_step"],
        }
    out["dtensor_like"] = _dtensor_like()
    out["mid_step"] = _mid_step_refused()
    out["ladder"] = _ladder()
    out["errors"] = _config_errors()
    return out
