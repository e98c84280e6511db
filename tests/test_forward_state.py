"""What a failed attempt wrote into the model's buffers is undone before the batch runs again
(`automicro.batch.forward_state`): a count a training forward keeps (as torchtitan's mixture-of-experts layers keep
the tokens each expert got) and batch norm's running statistics. The unit tests run in this process; one launch of
2 gloo ranks trains a plain loop (`AutoStep`) through a search and a late OOM in backward and compares every buffer
and parameter with a plain loop at the same splits. torchtitan's own routed model: tests/test_torchtitan.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from automicro.batch.forward_state import ForwardState
from automicro.testing.multiprocess import run_multiprocess

BATCH, BATCHES = 8, 6


class Counting(nn.Module):
    """Counts the rows it saw in a training forward, as torchtitan's MoE counts each expert's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen.add_(x.shape[0])
        return x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.count = Counting()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.count(self.norm(self.inp(x)))))


def _attempt(model: nn.Module, rows: int, fail: bool) -> None:
    model(torch.randn(rows, 8)).sum().backward()
    if fail:
        raise RuntimeError("out of memory (test)")


def test_a_failed_attempts_writes_are_undone_and_later_batches_copy_only_what_attempts_write():
    torch.manual_seed(0)
    model = Model()
    lines: list[str] = []
    state = ForwardState(model, lines.append)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    state.begin_batch()
    with pytest.raises(RuntimeError):
        _attempt(model, 4, fail=True)
    state.undo()
    state.after_attempt(failed=True)
    assert all(torch.equal(buffer, before[name]) for name, buffer in model.named_buffers())
    assert len(lines) == 1 and "undone" in lines[0] and "count.seen" in lines[0], lines
    assert state.written is None  # no attempt ran clean yet: every buffer is still copied
    _attempt(model, 4, fail=False)
    state.after_attempt(failed=False)
    assert state.written == {"count.seen", "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    # A later batch: a failed attempt after one microbatch that ran clean is undone to the batch's start.
    start = {name: buffer.clone() for name, buffer in model.named_buffers()}
    state.begin_batch()
    _attempt(model, 2, fail=False)
    with pytest.raises(RuntimeError):
        _attempt(model, 2, fail=True)
    state.undo()
    assert all(torch.equal(buffer, start[name]) for name, buffer in model.named_buffers())
    assert state.undone == 8 and len(lines) == 1  # said once


def test_a_buffer_written_for_the_first_time_by_a_failed_attempt_is_named_and_copied_from_then_on():
    model = Model()
    model.register_buffer("late", torch.zeros(3))
    lines: list[str] = []
    state = ForwardState(model, lines.append)
    state.begin_batch()
    _attempt(model, 4, fail=False)
    state.after_attempt(failed=False)
    assert "late" not in (state.written or set())
    state.begin_batch()
    model.late.add_(1.0)  # written only now, by a failed attempt: nothing to copy back
    state.undo()
    assert torch.equal(model.late, torch.ones(3))
    assert any("wrote 1 buffer(s) not copied before it (late)" in line for line in lines), lines
    state.begin_batch()
    model.late.add_(1.0)
    state.undo()
    assert torch.equal(model.late, torch.ones(3))  # copied at this batch's start: undone


def test_a_buffer_the_module_replaced_is_not_written_and_a_model_without_buffers_costs_nothing():
    model = Model()
    state = ForwardState(model)
    state.begin_batch()
    model.count.seen = torch.full((), 5.0)  # replaced, not written in place: computed again by the rerun
    state.undo()
    assert float(model.count.seen) == 5.0 and state.undone == 0
    bare = nn.Linear(4, 4)
    empty = ForwardState(bare)
    empty.begin_batch()
    empty.undo()
    empty.after_attempt(failed=False)
    assert empty.written == set()


# ---- two ranks, a plain loop ---------------------------------------------------------------------------


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model()
    fully_shard(model.inp)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator)) for _ in range(BATCHES)]


def _mse(model: nn.Module, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = microbatch
    return F.mse_loss(model(x), y)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in model.state_dict().items()}


def _plain_loop(rank: int, world: int) -> dict[str, Any]:
    """Only rank 1 runs out above 4 samples while searching; after the hooks came off, an OOM in backward at batch 3
    on rank 1 (after its first microbatch's forward wrote the count and batch norm's statistics, on both ranks)."""
    from automicro import AutoStep
    from automicro.testing.faults import FaultInjector

    model, optimizer = _build()
    batches = _data(rank)
    injectors = (FaultInjector("forward", ranks=[1], above=4), FaultInjector("backward", ranks=[1], batch=3, times=1))
    splits, attempts = [], []
    with AutoStep(model, optimizer, _mse, log_attempts=False, stable_batches=2) as auto:
        for injector in injectors:
            injector.arm(auto.sites, model)
        for batch in batches:
            result = auto.step(batch)
            splits.append(tuple(result.split))
            attempts.append(result.attempts)
    for injector in injectors:
        injector.close_hooks()
    auto_state = _state(model)
    # The plain loop at the same splits, no automicro.
    model, optimizer = _build()
    for (x, y), split in zip(batches, splits):
        optimizer.zero_grad(set_to_none=True)
        start = 0
        for size in split:
            (F.mse_loss(model(x[start:start + size]), y[start:start + size]) * (size / x.shape[0])).backward()
            start += size
        optimizer.step()
    dist.barrier()
    return {"splits": splits, "attempts": attempts, "auto": auto_state, "plain": _state(model)}


@pytest.mark.multiproc
def test_a_plain_loop_rerun_after_an_oom_in_backward_leaves_every_buffer_as_the_run_without_it():
    for rank, out in enumerate(run_multiprocess(_plain_loop, world_size=2, timeout_s=200)):
        assert all(split == (4, 4) for split in out["splits"]), out["splits"]
        assert out["attempts"][3] == 2 and out["attempts"][0] > 1, out["attempts"]
        auto, plain = out["auto"], out["plain"]
        assert float(auto["count.seen"]) == float(plain["count.seen"]) == BATCHES * BATCH, (rank, auto["count.seen"])
        assert int(auto["norm.num_batches_tracked"]) == int(plain["norm.num_batches_tracked"]) == 2 * BATCHES
        for name in plain:
            assert torch.allclose(auto[name].float(), plain[name].float(), atol=1e-6, rtol=0), (rank, name)


def test_automicros_own_buffers_are_left_as_the_failed_attempt_wrote_them():
    """The routing watch's count (`automicro.batch.routing`) is what the failed attempt saw: read after the wipe."""
    model = Model()
    model.count.register_buffer("_automicro_busiest", torch.zeros(1), persistent=False)
    state = ForwardState(model)
    state.begin_batch()
    model.count._automicro_busiest.fill_(0.9)
    with pytest.raises(RuntimeError):
        _attempt(model, 4, fail=True)
    state.undo()
    assert float(model.count._automicro_busiest) == pytest.approx(0.9) and float(model.count.seen) == 0.0
