"""Rank bodies for `tests/test_local_step.py`: FSDP2 models on CPU ranks (gloo), the optimizer
step on local shards (`automicro.engine.local_step`) against the same optimizer through DTensor."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from automicro.engine import FSDP2Config, local_step, shard

def _optimizers() -> dict[str, tuple[Callable[[Any], torch.optim.Optimizer], bool]]:
    """name -> (builder over the parameters, element-wise by the list). foreach=False: torch's
    default picks foreach by parameter type; the comparison is of the same kernels on the same numbers."""
    from composer.optim import DecoupledAdamW, DecoupledSGDW

    lion = {}
    try:  # llm-foundry's, where the venv has it (leg 1's has the foundry extra)
        from llmfoundry.optim import DecoupledLionW

        lion = {"decoupled_lionw": (lambda p: DecoupledLionW(p, lr=1e-3, weight_decay=1e-2), True)}
    except ImportError:
        pass
    return {
        **lion,
        "decoupled_adamw": (lambda p: DecoupledAdamW(p, lr=1e-2, weight_decay=1e-2), True),
        "decoupled_sgdw": (lambda p: DecoupledSGDW(p, lr=1e-2, momentum=0.9, weight_decay=1e-2), True),
        "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False), True),
        "adam_amsgrad": (lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=False), True),
        "sgd": (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True, foreach=False), True),
        # Not element-wise by the list (its own class): on several ranks it keeps the DTensor step.
        "adagrad": (lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=False), False),
    }


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 6 rows: sharded 3+3 on two ranks; 5 rows: uneven (3+2), a padded shard.
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 6), torch.nn.Linear(6, 5)])
        self.head = torch.nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _sharded() -> torch.nn.Module:
    torch.manual_seed(0)
    model = _Toy()
    shard(model, FSDP2Config(wrap=["Linear"]), device=torch.device("cpu"))
    return model


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: int, closure: bool = False) -> None:
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 8, generator=generator)

        def loss_fn() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            return loss

        if closure:
            returned = optimizer.step(loss_fn)
            assert returned is not None and torch.isfinite(returned)
        else:
            loss_fn()
            optimizer.step()


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def compare(rank: int, world_size: int) -> dict[str, Any]:
    """Each optimizer twice on the same sharded model and data: local step (installed where it
    gives the same numbers) and the DTensor step; 3 steps (the first creates the state), the third
    through a closure. What comes back: per optimizer, whether it was installed, the largest
    parameter and state difference, and the state's types."""
    out: dict[str, Any] = {}
    for name, (build, _) in _optimizers().items():
        local_model, dtensor_model = _sharded(), _sharded()
        local_opt, dtensor_opt = build(local_model.parameters()), build(dtensor_model.parameters())
        why = local_step.install(local_opt)
        _train(local_model, local_opt, rank, 2)
        _train(dtensor_model, dtensor_opt, rank, 2)
        _train(local_model, local_opt, rank, 1, closure=True)
        _train(dtensor_model, dtensor_opt, rank, 1, closure=True)
        a, b = _full(local_model), _full(dtensor_model)
        state_diff = 0.0
        kinds = set()
        for (pa, sa), (pb, sb) in zip(
            ((p, local_opt.state[p]) for p in local_model.parameters()),
            ((p, dtensor_opt.state[p]) for p in dtensor_model.parameters()),
        ):
            assert isinstance(pa, DTensor) and sorted(sa) == sorted(sb), (name, sorted(sa), sorted(sb))
            for key in sa:
                kinds.add((key, type(sa[key]).__name__, type(sb[key]).__name__))
                if isinstance(sa[key], torch.Tensor):
                    va = sa[key].full_tensor() if isinstance(sa[key], DTensor) else sa[key]
                    vb = sb[key].full_tensor() if isinstance(sb[key], DTensor) else sb[key]
                    state_diff = max(state_diff, (va.float() - vb.float()).abs().max().item())
        groups_are_dtensors = all(isinstance(p, DTensor) for g in local_opt.param_groups for p in g["params"])
        moved = max((a[n] - _full_initial(n)).abs().max().item() for n in a)
        out[name] = {
            "installed": why is None, "why": why,
            "param_diff": max((a[n] - b[n]).abs().max().item() for n in a),
            "state_diff": state_diff, "kinds": sorted(kinds), "groups_are_dtensors": groups_are_dtensors,
            "moved": moved, "state_dict_keys_equal": _state_dict_shape(local_opt) == _state_dict_shape(dtensor_opt),
        }
    return out


_INITIAL: dict[str, torch.Tensor] = {}


def _full_initial(name: str) -> torch.Tensor:
    if not _INITIAL:
        _INITIAL.update(_full(_sharded()))
    return _INITIAL[name]


def _state_dict_shape(optimizer: torch.optim.Optimizer) -> list[Any]:
    state = optimizer.state_dict()["state"]
    return [(k, sorted(v), [tuple(t.shape) for t in v.values() if isinstance(t, torch.Tensor)]) for k, v in sorted(state.items())]


class _Fails(Exception):
    pass


def failing_step(rank: int, world_size: int) -> dict[str, Any]:
    """A step that raises halfway (after the first parameter's update): the parameters in the
    groups and the state's keys are the DTensor ones again, and the next step runs."""
    from composer.optim import DecoupledAdamW

    model = _sharded()
    optimizer = DecoupledAdamW(model.parameters(), lr=1e-2)
    assert local_step.install(optimizer) is None
    _train(model, optimizer, rank, 1)
    inner = local_step._BEFORE
    real = getattr(optimizer, inner)

    def boom() -> None:
        raise _Fails("an error inside the step")

    setattr(optimizer, inner, boom)
    _train_loss(model, rank)
    raised = False
    try:
        optimizer.step()
    except _Fails:
        raised = True
    params = [p for g in optimizer.param_groups for p in g["params"]]
    restored = all(isinstance(p, DTensor) for p in params) and set(map(id, optimizer.state)) == set(map(id, model.parameters()))
    states_dtensor = all(isinstance(s["exp_avg"], DTensor) for s in optimizer.state.values())
    setattr(optimizer, inner, real)
    _train(model, optimizer, rank, 1)
    return {"raised": raised, "restored": restored, "states_dtensor": states_dtensor,
            "grads_dropped": all(p.to_local().grad is None for p in params)}


def _train_loss(model: torch.nn.Module, rank: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()


def required(rank: int, world_size: int) -> str:
    """``local_optimizer_step: true`` with a non-element-wise optimizer: the error, or 'installed'."""
    model = _sharded()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    try:
        local_step.install(optimizer, True)
    except local_step.LocalStepError as error:
        return str(error)
    return "installed"


def everything(rank: int, world_size: int) -> dict[str, Any]:
    """One launch for the whole file (each launch costs ~10 s of start-up on CI's cores): the
    comparison, the failing step, the required setting and the trainer with the local step on and off."""
    return {
        "compare": compare(rank, world_size), "failing": failing_step(rank, world_size), "required": required(rank, world_size),
        "trainer_on": trainer(rank, world_size, "default"), "trainer_off": trainer(rank, world_size, False),
    }


def trainer(rank: int, world_size: int, setting: Any) -> dict[str, Any]:
    """automicro.Trainer with FSDP2 and `local_optimizer_step: setting`, `auto`: whether its
    optimizer got the local step, and its parameters after 3 batches."""
    from automicro import Trainer
    from automicro.data import SyntheticTokens, build_dataloader
    from automicro.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    from composer.optim import DecoupledAdamW

    optimizer = DecoupledAdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    data = build_dataloader(SyntheticTokens(num_samples=64, seq_len=16, vocab_size=256, seed=1), batch_size=8)
    fsdp2 = {"mixed_precision": "FULL"} if setting == "default" else {"mixed_precision": "FULL", "local_optimizer_step": setting}
    trainer = Trainer(
        model=model, train_dataloader=data, optimizers=optimizer, max_duration="3ba", device="cpu", precision="fp32",
        device_train_microbatch_size="auto", parallelism_config={"fsdp2": fsdp2}, progress_bar=False, seed=0,
    )
    trainer.fit()
    params = {n: p.full_tensor().detach().clone() for n, p in trainer.state.model.named_parameters()}
    installed = local_step.installed(trainer.state.optimizers[0])
    trainer.close()
    return {"installed": installed, "params": params}
