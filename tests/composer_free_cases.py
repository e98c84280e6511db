"""`automicro.AutoStep` in a process where Composer and every other training framework cannot be
imported: importing this module hides them from the import system first, so the
process that imports it, the forkserver that preloads it and every rank forked from that server
fail on any ``import composer`` (or transformers, Lightning, accelerate, llm-foundry).

Never import it into a process that has one of them already (a pytest worker): it refuses.
`tests/test_layers.py` runs it in a fresh interpreter.
"""

from __future__ import annotations

import sys

HIDDEN = ("composer", "transformers", "lightning", "pytorch_lightning", "accelerate", "llmfoundry")
_present = [name for name in HIDDEN if sys.modules.get(name) is not None]
if _present:
    raise ImportError(f"tests.composer_free_cases hides {_present}, which this process has imported: run it in a fresh one")
for _name in HIDDEN:
    sys.modules[_name] = None  # type: ignore[assignment]  # `import composer` now raises ImportError

from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from automicro import AutoStep  # noqa: E402

BATCH = 8
OOM_ABOVE = 3  # rank 1 runs out of memory above this many samples a microbatch; rank 0 never does
LR = 0.01


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator)) for _ in range(count)]


def loss_with_uneven_oom(model: nn.Module, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = microbatch
    if dist.get_rank() == 1 and x.shape[0] > OOM_ABOVE:
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {x.shape[0]} samples on rank 1)")
    return F.mse_loss(model(x), y)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in model.named_parameters()}


def reference(data: list[Any], splits: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A plain loop, no automicro: each batch at the split AutoStep chose, each microbatch's mean loss
    weighted by its share of the rank's batch, one AdamW step a batch."""
    model, optimizer = build()
    for (x, y), split in zip(data, splits):
        optimizer.zero_grad(set_to_none=True)
        start = 0
        for size in split:
            (F.mse_loss(model(x[start:start + size]), y[start:start + size]) * (size / x.shape[0])).backward()
            start += size
        optimizer.step()
    return full_params(model)


def run(rank: int, world_size: int) -> dict[str, Any]:
    """Six batches: the search (rank 1 runs out above 3 samples, rank 0 does not), then steady steps."""
    data = batches(rank, 6)
    model, optimizer = build()
    results = []
    with AutoStep(model, optimizer, loss_with_uneven_oom, log_attempts=False, stable_batches=2) as auto:
        for batch in data:
            result = auto.step(batch)
            results.append({"split": tuple(result.split), "attempts": result.attempts, "size": result.size})
    got, want = full_params(model), reference(data, [r["split"] for r in results])
    return {
        "results": results,
        "max_error": max(float((got[k] - want[k]).abs().max()) for k in want),
        "frameworks_loaded": sorted(n for n in sys.modules if n.split(".")[0] in HIDDEN and sys.modules[n] is not None),
        "composer_hidden": sys.modules.get("composer", "absent") is None,
    }
