"""Multi-rank cases for a card that is not all ours (issue 39): the tiny Llama on CPU ranks under an
emulated memory cap whose capacity reading says more than there is, or whose limit moves mid-run."""

from __future__ import annotations

from typing import Any

import torch

from tests.optimizer_cases import fit


def _agreed(value: int) -> int:
    """Rank 0's value on every rank (the same program on every rank: the same peaks to a few bytes)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    torch.distributed.broadcast(tensor, 0)
    return int(tensor)


def shared_card(rank: int, world: int) -> dict[str, Any]:
    """`auto` (the probe first) under a limit between the peaks of sizes 4 and 8 while the capacity
    reads 3x that limit, a fixed run at the size it found; then a run whose limit drops below
    size 4's peak at batch 5 and comes back at batch 10."""
    unlimited = 10**12
    peaks = {m: fit(m, unlimited, 2)["peaks"] for m in (2, 4, 8)}
    limit = _agreed((peaks[4][1] + peaks[8][1]) // 2)
    small = _agreed((peaks[2][1] + peaks[4][1]) // 2)
    told = fit("auto", limit, 6, start_size="probe", cap={"capacity_reads": 3 * limit})
    fixed = fit(told["found"], limit, 6)
    moving = fit("auto", limit, 14, start_size="probe", cap={"limit_at_batch": {5: small, 10: limit}})
    diff = max(float((told["params"][k] - fixed["params"][k]).abs().max()) for k in fixed["params"])
    return {
        "peaks": peaks, "limit": limit, "small": small, "diff": diff,
        "told": {k: v for k, v in told.items() if k != "params"},
        "moving": {k: v for k, v in moving.items() if k != "params"},
    }
