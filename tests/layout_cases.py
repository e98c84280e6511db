"""Multi-rank cases for the layout search (`automicro.core.layout`, `automicro.integration.layout_trials`):
the tiny Llama sharded with FSDP2 on CPU ranks, under an emulated memory cap that makes the size
found split every batch into several microbatches.

Batch times on CPU say nothing about GPUs, so the cases replace the clock's reading with a fixed
time per layout (`LayoutTrials.timing`): a trade is kept or not by the rule, not by the machine.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import automicro
from automicro.core.layout import GRAD_SYNC_ONCE, NO_RESHARD
from automicro.data import SyntheticTokens, build_dataloader
from automicro.testing import FaultInjector, MemoryCapCallback

SEQ = 128
PER_RANK_BATCH = 8
# Activations per sample well above the parameters: a cap between two sizes leaves room for the trades.
MODEL = dict(vocab_size=512, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ)
UNLIMITED = 10**12


def seconds_where(faster: tuple[str, ...] = (), slower: tuple[str, ...] = ()):
    """A batch takes 2 s, 1 s less for each trade in `faster`, 1 s more for each in `slower`."""

    def timing(layout: tuple[str, ...], measured: float) -> float:
        return 2.0 - sum(t in layout for t in faster) + sum(t in layout for t in slower)

    return timing


def fit(
    microbatch: Any,
    batches: int,
    limit: int = UNLIMITED,
    layout: Any = "auto",
    timing: Any = None,
    faults: Optional[list[Any]] = None,
    fsdp2: Optional[dict[str, Any]] = None,
    trial_batches: int = 1,
) -> dict[str, Any]:
    from automicro.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", **MODEL)
    world = torch.distributed.get_world_size()
    data = build_dataloader(
        SyntheticTokens(PER_RANK_BATCH * world * batches, SEQ, MODEL["vocab_size"], seed=2), PER_RANK_BATCH, shuffle=False
    )
    cap = MemoryCapCallback(limit_bytes=limit, retry_band=0.0)
    auto = automicro.AutoMicrobatching(log_attempts=False, layout=layout, layout_trial_batches=trial_batches)
    trainer = automicro.Trainer(
        model=model, train_dataloader=data, max_duration=f"{batches}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
        parallelism_config={"fsdp2": dict(fsdp2 or {})}, device_train_microbatch_size=microbatch,
        callbacks=[auto, cap, *(faults or [])], loggers=[], progress_bar=False, log_to_console=False, seed=17,
    )
    layouts: list[tuple[str, ...]] = []
    try:
        if timing is not None:
            assert auto.layout is not None
            auto.layout.timing = timing
        if microbatch == "auto":
            # The layout each batch started at.
            original = auto.batch_end

            def batch_end(state: Any, logger: Any) -> None:
                layouts.append(auto.layout.last_run if auto.layout else ())
                original(state, logger)

            auto.batch_end = batch_end  # type: ignore[method-assign]
        trainer.fit()
        return {
            "found": auto.found_size if microbatch == "auto" else microbatch,
            "settled": list(auto.layout.search.settled) if auto.layout else [],
            "rejected": dict(auto.layout.search.rejected) if auto.layout else {},
            "results": [[r.trade, r.kept] for r in auto.layout.search.results] if auto.layout else [],
            "layouts": [list(x) for x in layouts],
            "history": [(r.batch, r.size, r.outcome, r.note) for r in auto.history],
            "summary": auto.summary_line(),
            "state": auto.state_dict().get("layout"),
            "peak": int(cap.cap.stats()["peak_bytes"]),
            "extra": sum(auto.layout.engine.extra_bytes(t) for t in (GRAD_SYNC_ONCE, NO_RESHARD))
            if auto.layout and auto.layout.engine else 0,
            "params": {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()},
        }
    finally:
        trainer.close()


def _limit_for(size: int, room: bool) -> int:
    """A cap below the peak of `size + 1` and above that of `size`; with `room`, above it by both
    trades' projected bytes too (every rank the same: rank 0's)."""
    low, high = fit(size, 2, layout="fixed"), fit(size + 1, 2, layout="fixed")
    floor = low["peak"] + (low["extra"] if room else 0)
    assert floor < high["peak"], (low["peak"], low["extra"], high["peak"])
    limit = torch.tensor([(floor + high["peak"]) // 2], dtype=torch.int64)
    torch.distributed.broadcast(limit, 0)
    return int(limit)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def trades(rank: int, world: int) -> dict[str, Any]:
    """Size found 2 of 8 under a cap with room for both trades' projections; grad_sync_once
    faster, no_reshard slower: the first is kept, the second not. On 2 ranks also both trades
    pinned (`layout: [...]`) under the same cap. Every run against a fixed run at size 2."""
    batches = 9  # settled after batch 3, then one batch with and one without each trade
    limit = _limit_for(2, room=True)
    timing = seconds_where(faster=(GRAD_SYNC_ONCE,), slower=(NO_RESHARD,))
    auto = fit("auto", batches, limit=limit, timing=timing)
    fixed = fit(2, batches, layout="fixed")
    pinned = {}
    if world == 2:
        layout = [GRAD_SYNC_ONCE, NO_RESHARD]
        pinned["+".join(layout)] = fit("auto", batches, limit=limit, layout=layout)
    return {
        "auto": {k: v for k, v in auto.items() if k != "params"},
        "diff_auto": _diff(auto["params"], fixed["params"]),
        "pinned": {
            k: {"found": v["found"], "layouts": v["layouts"], "diff": _diff(v["params"], fixed["params"])}
            for k, v in pinned.items()
        },
    }


def pressure(rank: int, world: int) -> dict[str, Any]:
    """grad_sync_once kept, then an OOM at the settled size (rank 0 only, late in the run): the
    trade is undone and the batch reruns at the same size; the size never shrinks."""
    batches = 10
    timing = seconds_where(faster=(GRAD_SYNC_ONCE, NO_RESHARD))
    limit = _limit_for(2, room=True)
    fault = FaultInjector(site="backward_pre", ranks=[0], batch=batches - 2, times=1)
    auto = fit("auto", batches, limit=limit, timing=timing, faults=[fault])
    fixed = fit(auto["found"], batches, layout="fixed")
    return {
        "auto": {k: v for k, v in auto.items() if k != "params"},
        "diff": _diff(auto["params"], fixed["params"]),
    }


def no_room(rank: int, world: int) -> dict[str, Any]:
    """A cap just above the size found: neither trade's projected bytes fit, and neither is tried."""
    batches = 6
    auto = fit("auto", batches, limit=_limit_for(2, room=False), timing=seconds_where(faster=(GRAD_SYNC_ONCE, NO_RESHARD)))
    return {k: v for k, v in auto.items() if k != "params"}
