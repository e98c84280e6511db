"""Small models for multi-rank tests: fast on 2 CPU cores, deterministic, shaped like a decoder."""

from __future__ import annotations

import torch
import torch.nn as nn
from composer.models import ComposerModel


class Block(nn.Module):
    _fsdp_wrap = True

    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(x))))


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, inputs: int = 8, outputs: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.out = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class TiedStack(Stack):
    """Blocks 0 and 2 share their `up` layer: a tie across two wrap candidates."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[2].up = self.blocks[0].up


class ComposerStack(ComposerModel):
    """Regression on (x, y) batches; loss = mean squared error."""

    def __init__(self, width: int = 16, depth: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.model = Stack(width, depth, dropout=dropout)

    def forward(self, batch):
        x, _ = batch
        return self.model(x)

    def loss(self, outputs, batch, *args, **kwargs):
        _, y = batch
        return ((outputs - y) ** 2).mean()

    def get_metrics(self, is_train: bool = False):
        return {}

    def eval_forward(self, batch, outputs=None):
        return outputs if outputs is not None else self.forward(batch)

    def update_metric(self, batch, outputs, metric) -> None:
        return None


def make_data(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=generator), torch.randn(batch, 4, generator=generator)) for _ in range(steps)]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, gathered on every rank."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().clone()
    return out


def max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference between two `full_state`s of the same model."""
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)

