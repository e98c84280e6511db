"""Multi-rank cases for `automicro.AutoStep` in a plain PyTorch loop (no Composer Trainer): the
model sharded by the user's own `fully_shard` (torchtitan's way), gloo ranks on CPU.

Each worker runs every case in order and returns plain data for tests/test_autostep.py. The
reference of every case is a plain loop written here, with no automicro at all: the same model
and data, each batch split as the AutoStep run split it, each microbatch's mean loss weighted by
its share of the global batch, one optimizer step per batch.
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from automicro import AutoStep
from automicro.core.memory import NoMemory
from automicro.engine import _torch_internals as internals
from automicro.testing.faults import FaultInjector
from automicro.testing.memory_cap import MemoryCap
from automicro.testing.callbacks import CapMemory
from tests.toy_models import Stack, full_state

BATCH = 8
LR = 0.01
CLIP = 0.05  # below every batch's gradient norm: clipping acts in every step


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Stack(16, 3) with every block and the root passed through `fully_shard`, and AdamW."""
    torch.manual_seed(seed)
    model = Stack(width=16, depth=3)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def data(rank: int, batches: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(batch, 8, generator=generator), torch.randn(batch, 4, generator=generator)) for _ in range(batches)]


def mse(model: nn.Module, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = microbatch
    return F.mse_loss(model(x), y)


def reference(batches: list[Any], splits: list[tuple[int, ...]], seed: int = 0, clip: Optional[float] = None) -> dict[str, torch.Tensor]:
    """A plain loop, no automicro: each batch at its split, weighted by samples, one step each
    (`clip`: torch's own `clip_grad_norm_` before it)."""
    model, optimizer = build(seed)
    world = dist.get_world_size()
    for (x, y), split in zip(batches, splits):
        optimizer.zero_grad(set_to_none=True)
        total = torch.tensor([float(x.shape[0])])
        dist.all_reduce(total)
        per_rank = float(total.item()) / world
        start = 0
        for size in split:
            loss = F.mse_loss(model(x[start:start + size]), y[start:start + size]) * (size / per_rank)
            loss.backward()
            start += size
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        optimizer.step()
    return full_state(model)


def _adam_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    return sorted({int(s["step"]) for s in optimizer.state.values() if "step" in s})


def _error(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}


def _run(
    batches: list[Any], injectors: tuple[FaultInjector, ...] = (), memory: Any = None, state: Optional[dict] = None,
    model_state: Optional[tuple[nn.Module, torch.optim.Optimizer]] = None, **settings: Any,
) -> dict[str, Any]:
    model, optimizer = model_state or build()
    results = []
    with AutoStep(model, optimizer, mse, memory=memory, log_attempts=False, **settings) as auto:
        for injector in injectors:
            injector.arm(auto.sites, model)
        if state is not None:
            auto.load_state_dict(state)
        for batch in batches:
            result = auto.step(batch)
            results.append({"split": result.split, "attempts": result.attempts, "hooks": auto.hooks_active,
                            "size": result.size, "loss": float(result.loss), "grad_norm": result.grad_norm})
        metrics = auto.metrics()
        saved = copy.deepcopy(auto.state_dict())
        history = [dataclasses.asdict(r) for r in auto.history]
    for injector in injectors:
        injector.close_hooks()
    return {
        "results": results, "history": history, "metrics": metrics, "state": saved, "params": full_state(model),
        "steps": _adam_steps(optimizer), "model": model, "optimizer": optimizer,
        "patched_after_close": internals.collectives_patched(),
    }


def _plain(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k not in ("model", "optimizer")}


def run_cases(rank: int, world_size: int, one_rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. A search where only `one_rank` runs out of memory: above 5 samples per microbatch.
    batches = data(rank, 6)
    run = _run(batches, (FaultInjector("forward", ranks=[one_rank], above=5),), stable_batches=2)
    splits = [r["split"] for r in run["results"]]
    out["search"] = {**_plain(run), "reference": reference(batches, splits), "whole": reference(batches, [(BATCH,)] * 6)}

    # 2. A steady-state OOM with the hooks off (batch 5: batch 0 converges, 1-2 stable, hooks off from 3),
    # gradients clipped to a norm every batch exceeds.
    batches = data(rank, 7)
    run = _run(batches, (FaultInjector("forward", ranks=[one_rank], above=5),
                         FaultInjector("backward", ranks=[one_rank], batch=5, times=1)), stable_batches=2, max_grad_norm=CLIP)
    out["steady"] = {**_plain(run), "reference": reference(batches, [r["split"] for r in run["results"]], clip=CLIP),
                     "unclipped": reference(batches, [r["split"] for r in run["results"]])}

    # 3. Resume: 3 batches, the AutoStep state and the model/optimizer kept, 3 more in a new AutoStep.
    batches = data(rank, 6)
    first = _run(batches[:3], (FaultInjector("forward", above=5),), stable_batches=2)
    model, optimizer = build()
    model.load_state_dict(first["model"].state_dict())
    optimizer.load_state_dict(first["optimizer"].state_dict())
    second = _run(batches[3:], (FaultInjector("forward", above=5),), state=first["state"], model_state=(model, optimizer),
                  stable_batches=2)
    splits = [r["split"] for r in first["results"] + second["results"]]
    out["resume"] = {"first": _plain(first), "second": _plain(second), "reference": reference(batches, splits)}

    # 4. Under an emulated memory limit (MemoryCap, CPU), one rank's limit lower than the others'.
    batches = data(rank, 4, batch=64)
    model, optimizer = build()
    probe = MemoryCap(None)
    with probe:
        probe.track_existing(model, check=False)
        for size in (8, 64):
            probe.reset_peak()
            mse(model, (batches[0][0][:size], batches[0][1][:size])).backward()
            model.zero_grad(set_to_none=True)
            out.setdefault("peaks", {})[size] = probe.peak_bytes
    limit = out["peaks"][8] + (out["peaks"][64] - out["peaks"][8]) // (4 if rank == one_rank else 1) + 4096
    cap = MemoryCap(limit)
    with cap:
        cap.track_existing(model, check=False)
        run = _run(batches, memory=CapMemory(cap), model_state=(model, optimizer), stable_batches=2)
    out["cap"] = {**_plain(run), "cap_ooms": cap.stats()["num_ooms"], "limit": limit}

    # 5. Padded variable-length rows (a padding collator's batches) under the token budget, loss per
    # loss token: the parameters of one whole-batch step per batch, whatever the budget cut.
    out["tokens"] = _token_budget_case(rank, one_rank)
    return out


def _llama() -> tuple[nn.Module, torch.optim.Optimizer]:
    from automicro.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_preset("tiny", max_seq_len=64))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # SGD, lr 1: a parameter moves by its gradient. (Adam's first steps move every parameter by about
    # lr whatever its gradient's size, and tiny gradients' rounding, a few 1e-9 here, by up to 5e-5.)
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def _cross_entropy_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")


def _token_budget_case(rank: int, one_rank: int, normalization: str = "tokens") -> dict[str, Any]:
    from automicro.data import VariableLengthTokens, pad_collate

    world = dist.get_world_size()
    data = VariableLengthTokens(4 * 8 * world, 256, median_len=20, max_len=64, seed=3)
    batches = [pad_collate([data[(b * world + rank) * 8 + i] for i in range(8)]) for b in range(4)]
    model, optimizer = _llama()

    def loss_fn(m: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return _cross_entropy_sum(m, mb) / (mb["labels"] != -100).sum()

    results = []
    injector = FaultInjector("forward", ranks=[one_rank], above=3)  # more than 3 rows in a microbatch: OOM
    with AutoStep(model, optimizer, loss_fn, budget="tokens", label_shift=0, log_attempts=False, stable_batches=2,
                  loss_normalization=normalization) as auto:
        injector.arm(auto.sites, model)
        for batch in batches:
            result = auto.step(batch)
            results.append({"split": result.split, "attempts": result.attempts})
        history = [dataclasses.asdict(r) for r in auto.history]
    injector.close_hooks()
    # The reference: each batch whole, its summed loss over the loss tokens of every rank's batch.
    ref_model, ref_optimizer = _llama()
    for batch in batches:
        ref_optimizer.zero_grad(set_to_none=True)
        tokens = (batch["labels"] != -100).sum().double().reshape(1)
        dist.all_reduce(tokens)
        (_cross_entropy_sum(ref_model, batch) / (float(tokens.item()) / world)).backward()
        ref_optimizer.step()
    moved = max(float((a - b).abs().max()) for a, b in zip(full_state(model).values(), full_state(_llama()[0]).values()))
    return {"results": results, "history": history, "params": full_state(model), "reference": full_state(ref_model),
            "moved": moved}


def run_errors(rank: int, world_size: int) -> dict[str, Any]:
    """What a user gets wrong, each refused with what to change."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    blocks_only = Stack(width=16, depth=2)
    for block in blocks_only.blocks:
        fully_shard(block)
    model, optimizer = build()
    attempts: dict[str, Callable[[], Any]] = {
        "root_not_sharded": lambda: AutoStep(blocks_only, torch.optim.SGD(blocks_only.parameters(), lr=0.1)),
        "unknown_setting": lambda: AutoStep(model, optimizer, mse, eval_oom="split"),
        "bad_optimizer": lambda: AutoStep(model, "adam", mse),
        "bad_budget": lambda: AutoStep(model, optimizer, mse, budget="bytes"),
        "bad_clip": lambda: AutoStep(model, optimizer, mse, max_grad_norm=0),
    }
    for name, make in attempts.items():
        try:
            made = make()
            made.close()
            out[name] = None
        except Exception as error:  # noqa: BLE001 - every case is reported to the test
            out[name] = _error(error)
    # A tuple batch with the default loss (model(**microbatch)), and a loss that is not a scalar.
    for name, loss_fn in (("default_loss_on_tuple", None), ("loss_not_scalar", lambda m, mb: m(mb[0]))):
        try:
            with AutoStep(model, optimizer, loss_fn, log_attempts=False) as auto:
                auto.step(data(rank, 1)[0])
            out[name] = None
        except Exception as error:  # noqa: BLE001
            out[name] = _error(error)
    out["patched_after_errors"] = internals.collectives_patched()
    return out


class TradeRetries(NoMemory):
    """No memory figures, but allocator retries that grow in every attempt run with a layout trade on,
    and in the attempt right after one (a pool a trade fragmented retries once more without it): what
    two H200s showed under a 0.3 memory fraction (docs/results/2026-11-28-autostep)."""

    def __init__(self) -> None:
        self.retries = 0
        self.auto: Any = None
        self._after_trade = False

    def attempt_ends(self, site: str, module: str, context: Any) -> None:
        traded = bool(self.auto.layout.layout)
        if traded or self._after_trade:
            self.retries += 1
        self._after_trade = traded

    def alloc_retries(self) -> int:
        return self.retries


def run_trial_retries(rank: int, world_size: int) -> dict[str, Any]:
    """Layout trials (layout: auto, forced on CPU) whose batches make the allocator retry: the
    search size (5, the FaultInjector's bound) must not shrink for a trade's retries, nor a trial end for them (its
    arms are timed with them). Each trade is timed slower (the layout's timing hook: not the machine's clock), so
    neither is kept. The size trials are off: they time a microbatch of 2 against 5 and keep the faster, which on a
    loaded CPU can be 2 (CI, stop 67) -- a measured choice, not what this case is about."""
    model, optimizer = build()
    memory = TradeRetries()
    results = []
    with AutoStep(model, optimizer, mse, memory=memory, log_attempts=False, stable_batches=2, layout="auto",
                  layout_trial_batches=2, layout_size_trials=False) as auto:
        memory.auto = auto
        auto.layout.timing = lambda layout, seconds: 2.0 if layout else 1.0
        auto.sites.add(memory.attempt_ends, 0, sites=("optimizer_step",))
        injector = FaultInjector("forward", above=5)
        injector.arm(auto.sites, model)
        for batch in data(rank, 16):
            result = auto.step(batch)
            results.append({"split": result.split, "layout": list(auto.layout.layout), "size": result.size})
        history = [dataclasses.asdict(r) for r in auto.history]
        rejected = dict(auto.layout.search.rejected)
        tried = [[r.trade, r.kept] for r in auto.layout.search.results]
    injector.close_hooks()
    return {"results": results, "history": history, "rejected": rejected, "retries": memory.retries, "tried": tried}


def run_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    """The edge of one rank: a search (OOM above 3 samples), then a batch of a single sample."""
    batches = data(rank, 4) + [data(rank, 1, batch=1)[0]]
    run = _run(batches, (FaultInjector("forward", above=3),), stable_batches=2)
    return {**_plain(run), "reference": reference(batches, [r["split"] for r in run["results"]])}
