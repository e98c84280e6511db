"""Multi-rank cases for the optimizer-state projection (`automicro.core.optimizer_memory`): the
tiny Llama on CPU ranks under an emulated memory cap, AdamW."""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer.core import Callback

import automicro
from automicro.data import SyntheticTokens, build_dataloader
from automicro.testing import MemoryCapCallback

SEQ = 32
PER_RANK_BATCH = 16
# A model whose AdamW state (2x its parameters, sharded) is large next to one microbatch's activations.
MODEL = dict(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, max_seq_len=SEQ)


class PeakPerBatch(Callback):
    """The emulated peak of each batch (the cap's peak is reset when the batch starts)."""

    def __init__(self, cap: MemoryCapCallback) -> None:
        self.cap = cap
        self.peaks: list[int] = []

    def batch_start(self, state: Any, logger: Any) -> None:
        self.cap.cap.reset_peak()

    def batch_end(self, state: Any, logger: Any) -> None:
        self.peaks.append(int(self.cap.cap.stats()["peak_bytes"]))


class SplitPerBatch(Callback):
    """The split each batch trained at (the auto-microbatching callback's, after the batch)."""

    def __init__(self, auto: Any) -> None:
        self.auto = auto
        self.splits: list[list[int]] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.splits.append(list(self.auto.used_split))


class CyclicGarbage(Callback):
    """Every batch leaves `nbytes` of tensor in a reference cycle, with Python's cyclic collector off
    for the fit: llm-foundry's `scheduled_gc` turns it off between its collections, and every
    `torch.save` (a checkpoint) leaves its storages in a cycle."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._was_enabled = True

    def fit_start(self, state: Any, logger: Any) -> None:
        import gc

        self._was_enabled = gc.isenabled()
        gc.disable()

    def batch_end(self, state: Any, logger: Any) -> None:
        cycle: list[Any] = [torch.zeros(self.nbytes, dtype=torch.uint8)]
        cycle.append(cycle)

    def fit_end(self, state: Any, logger: Any) -> None:
        import gc

        if self._was_enabled:
            gc.enable()


def fit(
    microbatch: Any, limit: int, batches: int, use_prediction: bool = True, start_size: Any = None,
    cap: Optional[dict[str, Any]] = None, more: Optional[list[Any]] = None,
) -> dict[str, Any]:
    """`cap`: more `MemoryCapCallback` arguments (`capacity_reads`, `limit_at_batch`); `more`: more
    callbacks."""
    from automicro.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", **MODEL)
    world = torch.distributed.get_world_size()
    data = build_dataloader(SyntheticTokens(PER_RANK_BATCH * world * batches, SEQ, MODEL["vocab_size"], seed=2), PER_RANK_BATCH, shuffle=False)
    cap_callback = MemoryCapCallback(limit_bytes=limit, retry_band=0.0, **(cap or {}))
    peaks = PeakPerBatch(cap_callback)
    auto: Optional[automicro.AutoMicrobatching] = None
    callbacks: list[Any] = [cap_callback, peaks] + list(more or [])
    splits: Optional[SplitPerBatch] = None
    if microbatch == "auto":
        auto = automicro.AutoMicrobatching(log_attempts=False, use_prediction=use_prediction, start_size=start_size)
        splits = SplitPerBatch(auto)
        callbacks.insert(0, auto)
        callbacks.append(splits)
    trainer = automicro.Trainer(
        model=model, train_dataloader=data, max_duration=f"{batches}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
        parallelism_config={"fsdp2": {}}, device_train_microbatch_size=microbatch,
        callbacks=callbacks, loggers=[], progress_bar=False, log_to_console=False, seed=17,
    )
    try:
        trainer.fit()
        return {
            "peaks": peaks.peaks,
            "history": [(r.batch, r.size, r.outcome, r.note) for r in auto.history] if auto else [],
            "splits": [list(r.split) for r in auto.history] if auto else [],
            "found": auto.found_size if auto else microbatch,
            "ooms": auto.ooms_total if auto else 0,
            "used": splits.splits if splits else [],
            "params": {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()},
        }
    finally:
        trainer.close()


def projection(rank: int, world: int) -> dict[str, Any]:
    """Peaks of fixed sizes with no limit (batch 0 without the optimizer state, batch 1 with it),
    a limit between them for size 8 (fits batch 0, not batch 1), then `auto` under that limit with
    the projection and without it, and a fixed run at the size found."""
    unlimited = 10**12
    peaks = {8: fit(8, unlimited, 2)["peaks"]}
    # Every rank uses rank 0's limit (the same program on every rank: the same peaks to a few bytes).
    limit = torch.tensor([(peaks[8][0] + peaks[8][1]) // 2], dtype=torch.int64)
    torch.distributed.broadcast(limit, 0)
    limit = int(limit)
    with_projection = fit("auto", limit, 5)
    without = fit("auto", limit, 5, use_prediction=False)
    fixed = fit(with_projection["found"], limit, 5)
    diff = max(float((with_projection["params"][k] - fixed["params"][k]).abs().max()) for k in fixed["params"])
    return {
        "peaks": peaks, "limit": limit,
        "with": {k: v for k, v in with_projection.items() if k != "params"},
        "without": {k: v for k, v in without.items() if k != "params"},
        "fixed_peaks": fixed["peaks"], "diff": diff,
    }


def _agreed(value: int) -> int:
    """Rank 0's value on every rank (the same program on every rank: the same peaks to a few bytes)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    torch.distributed.broadcast(tensor, 0)
    return int(tensor)


def probe(rank: int, world: int, compare: bool = True) -> dict[str, Any]:
    """`start_size='probe'` under a limit halfway between the peaks of sizes 4 and 8 once Adam's
    state exists, and a fixed run at the size the probe found; with `compare`, also the whole
    batch first ('batch', the CPU default) and the peak of the next size up. Then, in the same
    process group, a card that is not all ours (`shared_card`)."""
    unlimited = 10**12
    peaks = {m: fit(m, unlimited, 2)["peaks"] for m in (2, 4, 8)}
    limit = _agreed((peaks[4][1] + peaks[8][1]) // 2)
    probed = fit("auto", limit, 6, start_size="probe")
    whole = fit("auto", limit, 6, start_size="batch") if compare else {}
    fixed = fit(probed["found"], limit, 6)
    bigger = fit(probed["found"] + 1, unlimited, 2) if compare and probed["found"] < PER_RANK_BATCH else None
    diff = max(float((probed["params"][k] - fixed["params"][k]).abs().max()) for k in fixed["params"])
    return {
        "peaks": peaks, "limit": limit, "diff": diff,
        "probe": {k: v for k, v in probed.items() if k != "params"},
        "batch": {k: v for k, v in whole.items() if k != "params"},
        "next_size_peak": None if bigger is None else max(bigger["peaks"]),
        "shared": shared_card(peaks, limit),
    }


def shared_card(peaks: dict[int, list[int]], limit: int) -> dict[str, Any]:
    """A card not all ours: `auto` (the probe first) under `limit` while the capacity reads 3x that limit, a
    fixed run at the size it found; then a run whose limit drops below size 4's peak at batch 4 and
    comes back at batch 8 (the capacity read follows it); then one where every batch leaves an
    eighth of the gap between sizes 4 and 8 in a reference cycle, the cyclic collector off."""
    small = _agreed((peaks[2][1] + peaks[4][1]) // 2)
    told = fit("auto", limit, 6, start_size="probe", cap={"capacity_reads": 3 * limit})
    fixed = fit(told["found"], limit, 6)
    moving = fit("auto", limit, 12, start_size="probe", cap={"limit_at_batch": {4: small, 8: limit}})
    garbage = _agreed((peaks[8][1] - peaks[4][1]) // 8)
    held = fit("auto", limit, 10, start_size="probe", more=[CyclicGarbage(garbage)])
    diff = max(float((told["params"][k] - fixed["params"][k]).abs().max()) for k in fixed["params"])
    return {
        "small": small, "diff": diff, "garbage": garbage,
        "told": {k: v for k, v in told.items() if k != "params"},
        "moving": {k: v for k, v in moving.items() if k != "params"},
        "held": {k: v for k, v in held.items() if k != "params"},
    }


def state_over(rank: int, world: int) -> dict[str, Any]:
    """A cap on rank 1 only that holds the parameters and a microbatch's activations but not the gradients and AdamW's
    state beside them (3.5x this rank's parameter bytes: 1 + 1 + 2 copies pass it): both ranks end before any
    attempt with the same cause, and rank 0 (no limit) does not wait for rank 1 in a collective."""
    from automicro.models import build_model
    from automicro.batch.training_search import MicrobatchSizeError

    local = sum(p.numel() * p.element_size() for p in build_model("tiny", **MODEL).parameters()) // world
    limit = {0: 10**12, 1: int(3.5 * local)}
    try:
        fit("auto", limit, 3)
    except MicrobatchSizeError as error:
        return {"error": str(error), "kind": "MicrobatchSizeError", "local": local}
    except Exception as error:  # noqa: BLE001 - the test says what else ended the run
        return {"error": f"{type(error).__name__}: {error}"[:2000], "kind": type(error).__name__, "local": local}
    return {"error": None, "kind": None, "local": local}
