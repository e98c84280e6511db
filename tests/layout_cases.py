"""Multi-rank cases for the layout search (`automicro.core.layout`, `automicro.batch.layout_trials`):
the tiny Llama sharded with FSDP2 on CPU ranks, under an emulated memory cap that makes the size
found split every batch into several microbatches.

Batch times on CPU say nothing about GPUs, so the cases replace the clock's reading with a fixed
time per layout (`LayoutTrials.timing`): a trade is kept or not by the rule, not by the machine.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import automicro
from automicro.core.layout import GRAD_SYNC_ONCE, NO_RECOMPUTE, NO_RESHARD, RECOMPUTE, RECOMPUTE_OP
from automicro.data import SyntheticTokens, build_dataloader
from automicro.engine._torch_internals import has_activation_checkpointing
from automicro.engine.layout import LayoutEngine
from automicro.engine.sharding import sharded_of
from automicro.testing import FaultInjector, MemoryCapCallback

SEQ = 128
PER_RANK_BATCH = 4
# Activations per sample well above the parameters: a cap between two sizes leaves room for the trades.
MODEL = dict(vocab_size=512, d_model=32, n_layers=2, n_heads=2, max_seq_len=SEQ)
UNLIMITED = 10**12


def seconds_where(faster: tuple[str, ...] = (), slower: tuple[str, ...] = ()):
    """A batch takes 2 s, 1 s less for each trade in `faster`, 1 s more for each in `slower`."""

    def timing(layout: tuple[str, ...], measured: float) -> float:
        return 2.0 - sum(t in layout for t in faster) + sum(t in layout for t in slower)

    return timing


def seconds_by_size(seconds: dict[int, float]):
    """A batch takes `seconds[n]` at largest microbatch n (the trades change nothing): the size
    trials' timing. The size is the trial's on its "with" batches, else the size found."""

    def bind(auto: Any):
        def timing(layout: tuple[str, ...], measured: float) -> float:
            search = auto.layout.search
            size = search.trial_size if search.trial_size is not None else auto.found_size
            return seconds[size]

        return timing

    bind.needs_callback = True  # type: ignore[attr-defined]
    return bind


def fit(
    microbatch: Any,
    batches: int,
    limit: int = UNLIMITED,
    layout: Any = "auto",
    timing: Any = None,
    faults: Optional[list[Any]] = None,
    fsdp2: Optional[dict[str, Any]] = None,
    trial_batches: int = 1,
    start_size: Any = None,
    cap_args: Optional[dict[str, Any]] = None,
    size_trials: bool = False,
    planned: Optional[int] = None,
    trials: bool = True,
    compile: Any = None,
) -> dict[str, Any]:
    """`cap_args`: more `MemoryCapCallback` arguments (`limit_at_batch`). `size_trials`: off but in
    `size_case` (the other cases' batch sequences are the trades'). `planned`: the trials priced against a run of
    that many batches (`max_duration`), stopped after `batches`; else unpriced (`bound_trials: false`). `trials`:
    the key. `compile`: the Trainer's (each block compiled)."""
    from automicro.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", **MODEL)
    world = torch.distributed.get_world_size()
    data = build_dataloader(
        SyntheticTokens(PER_RANK_BATCH * world * batches, SEQ, MODEL["vocab_size"], seed=2), PER_RANK_BATCH, shuffle=False
    )
    cap = MemoryCapCallback(limit_bytes=limit, retry_band=0.0, **(cap_args or {}))
    # The batch sequences below are the layout search's own: no batch profile, no price before its trials
    # (`bound_trials`; tests/test_trial_plan.py covers the prices), but in the priced cases (`planned`).
    auto = automicro.AutoMicrobatching(
        log_attempts=False, layout=None if not trials else layout, layout_trial_batches=trial_batches,
        start_size=start_size, layout_size_trials=size_trials, bound_trials=planned is not None, trials=trials,
    )
    stop = [_StopAfter(batches)] if planned else []
    trainer = automicro.Trainer(
        model=model, train_dataloader=data, max_duration=f"{planned or batches}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
        parallelism_config={"fsdp2": dict(fsdp2 or {})}, device_train_microbatch_size=microbatch,
        callbacks=[auto, cap, *(faults or []), *stop], loggers=[], progress_bar=False, log_to_console=False, seed=17,
        compile=compile,
    )
    lines: list[str] = []
    auto.runtime.info = lines.append  # type: ignore[method-assign]
    layouts: list[tuple[str, ...]] = []
    splits: list[list[int]] = []  # the split each batch trained with
    try:
        if timing is not None:
            assert auto.layout is not None
            auto.layout.timing = timing(auto) if getattr(timing, "needs_callback", False) else timing
        if microbatch == "auto":
            # The layout each batch started at.
            original = auto.batch_end

            def batch_end(state: Any, logger: Any) -> None:
                layouts.append(auto.layout.last_run if auto.layout else ())
                splits.append(list(auto.used_split or ()))
                original(state, logger)

            auto.batch_end = batch_end  # type: ignore[method-assign]
        trainer.fit()
        result = {
            "found": auto.found_size if microbatch == "auto" else microbatch,
            "settled": list(auto.layout.search.settled) if auto.layout else [],
            "rejected": dict(auto.layout.search.rejected) if auto.layout else {},
            "results": [[r.trade, r.kept] for r in auto.layout.search.results] if auto.layout else [],
            "layouts": [list(x) for x in layouts],
            "history": [(r.batch, r.size, r.outcome, r.note) for r in auto.history],
            "splits": splits,
            "trial_lines": [r.line() for r in auto.layout.search.results] if auto.layout else [],
            "summary": auto.summary_line(),
            "emptied": getattr(auto.runtime.memory, "emptied", None),  # the allocator's cache emptied (CapMemory's count)
            "state": auto.state_dict().get("layout"),
            "shared_said": bool(auto.layout.search.shared_said) if auto.layout else False,
            "peak": int(cap.cap.stats()["peak_bytes"]),
            # What the engine projects for each trade (a fixed size leaves the callback idle: its own engine).
            "extras": [LayoutEngine(sharded_of(model)).extra_bytes(t) for t in (GRAD_SYNC_ONCE, NO_RESHARD)],
            "params": {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()},
            # Blocks carrying activation checkpointing (on, or switched off for `recompute`).
            "checkpointed": sum(map(has_activation_checkpointing, model.modules())),
            "plan_lines": [line for line in lines if line.startswith(("trials:", "a batch profiled", "layout", "size trial"))],
            "final_at": None if auto.search.plan is None else auto.search.plan.final_at,
            "price": None if auto.search.plan is None else auto.search.plan.price,
            "batches": int(trainer.state.timestamp.batch),
            "compile_lines": [line for line in lines if line.startswith("compile")],
        }
        result["extra"] = sum(result["extras"])
        return result
    finally:
        trainer.close()


class _RetriesWithTrades:
    """Allocator retries in every batch from `from_batch` on whose layout holds a trade: a card near its limit where
    each kept trade's bytes leave the pool retrying (Qwen3-MoE's blocks on one H100, `benchmarks/RESULTS.md`
    2026-12-06, the fused head on Qwen3-MoE: no_reshard kept at microbatch 3, the peak at 96% of the card)."""

    def __new__(cls, from_batch: int) -> Any:
        from composer.core import Callback

        class RetriesWithTrades(Callback):
            def __init__(self) -> None:
                self.cap: Any = None
                self.auto: Any = None
                self.counted = 0

            def fit_start(self, state: Any, logger: Any) -> None:
                for callback in state.callbacks:
                    if isinstance(callback, MemoryCapCallback):
                        self.cap = callback.cap
                    elif isinstance(callback, automicro.AutoMicrobatching):
                        self.auto = callback

            def before_forward(self, state: Any, logger: Any) -> None:
                if int(state.timestamp.batch) >= from_batch and self.auto.layout.layout:
                    self.cap.count_retries()
                    self.counted += 1

        return RetriesWithTrades()


class _RetriesAt:
    """Allocator retries in the batches given (their indices): a trade's batch near the card's limit and the batches
    after it, whose pool it left fragmented (Mixtral's blocks on one H100, `benchmarks/RESULTS.md` 2026-12-07, the
    thrash after a trial: no_reshard's last batch and the plain batch after it retried)."""

    def __new__(cls, batches: tuple[int, ...]) -> Any:
        from composer.core import Callback

        class RetriesAt(Callback):
            def __init__(self) -> None:
                self.cap: Any = None

            def fit_start(self, state: Any, logger: Any) -> None:
                self.cap = next(c.cap for c in state.callbacks if isinstance(c, MemoryCapCallback))

            def before_forward(self, state: Any, logger: Any) -> None:
                if int(state.timestamp.batch) in batches:
                    self.cap.count_retries()

        return RetriesAt()


class _StopAfter:
    """Ends the run after `batches` batches of a longer `max_duration` (the run its trials are priced against)."""

    def __new__(cls, batches: int) -> Any:
        from composer.core import Callback

        class StopAfter(Callback):
            def batch_end(self, state: Any, logger: Any) -> None:
                if int(state.timestamp.batch) >= batches:
                    state.stop_training()

        return StopAfter()


def _peaks() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two short fixed runs, at sizes 2 and 3 (the caps below are set between their peaks)."""
    return fit(2, 2, layout="fixed"), fit(3, 2, layout="fixed")


def _limits(low: dict[str, Any], high: dict[str, Any]) -> tuple[int, int]:
    """Two caps below the peak of size 3 and above that of size 2: one with room for both trades'
    projected bytes, one with room for neither (every rank uses rank 0's)."""
    room = low["peak"] + low["extra"]
    assert room < high["peak"], (low, high["peak"])
    tight = low["peak"] + min(low["extras"]) * 3 // 4
    limits = torch.tensor([(room + high["peak"]) // 2, tight], dtype=torch.int64)
    torch.distributed.broadcast(limits, 0)
    return int(limits[0]), int(limits[1])


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _strip(result: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in result.items() if k != "params"}
    out["diff"] = _diff(result["params"], fixed["params"])
    return out


BATCHES = 9  # settled after batch 3, a trial of each trade in batches 4-7, one batch after
THRASH_BATCHES = 14  # then retries with a trade on in batches 8-11, none in 12-13


def suite(rank: int, world: int) -> dict[str, Any]:
    """Size found 2 of 4 (two microbatches) under a cap with room for both trades.

    - ``trades``: grad_sync_once timed faster, no_reshard slower: the first is kept, the second not.
    - 2 ranks also: ``pinned`` (both trades pinned in YAML's ``layout: [...]``); ``pressure`` (both
      kept, then an OOM on rank 0 at the settled size in batch 8: a trade is undone, the size
      stays); ``no_room`` (a cap with room for neither trade: neither is tried).
    Each run's parameters (but no_room's) against a fixed run at size 2 with the engine's own layout."""
    out: dict[str, Any] = {}
    low, high = _peaks()
    if world <= 2:  # 4 ranks: `grad_sync_once` kept in the upsize case (below), to spare CI's time
        room, tight = _limits(low, high)
        fixed = fit(2, BATCHES, layout="fixed")
        out["trades"] = _strip(fit("auto", BATCHES, limit=room, timing=seconds_where((GRAD_SYNC_ONCE,), (NO_RESHARD,))), fixed)
    if world == 2:
        # The same, with allocator retries in each trial's batches (4-7) and the batch after them (8): no thrash.
        out["dropped_retries"] = _strip(fit("auto", BATCHES, limit=room, timing=seconds_where((GRAD_SYNC_ONCE,), (NO_RESHARD,)),
                                            faults=[_RetriesAt((4, 5, 6, 7, 8))]), fixed)
    if world == 2:
        out["pinned"] = _strip(fit("auto", BATCHES, limit=room, layout=[GRAD_SYNC_ONCE, NO_RESHARD]), fixed)
        fault = FaultInjector(site="backward_pre", ranks=[0], batch=8, times=1)
        faster = seconds_where(faster=(GRAD_SYNC_ONCE, NO_RESHARD))
        out["pressure"] = _strip(fit("auto", BATCHES, limit=room, timing=faster, faults=[fault]), fixed)
        # Both kept, then allocator retries in every batch with a trade on from batch 8: each thrash undoes a trade
        # (the second in the settling the first one's rearm began), the size stays.
        out["thrash_pressure"] = _strip(fit("auto", THRASH_BATCHES, limit=room, timing=faster,
                                            faults=[_RetriesWithTrades(BATCHES - 1)]), fit(2, THRASH_BATCHES, layout="fixed"))
        no_room = fit("auto", 5, limit=tight, timing=faster)  # settled after batch 3: batch 4 would try one
        out["no_room"] = {k: v for k, v in no_room.items() if k != "params"}
        # Checkpointing is carried (switched off) under auto, where the layout is pinned too (the ladder below size 1).
        out["pinned_checkpointed"] = out["pinned"]["checkpointed"]
        # Priced against a run of 1,000 batches (stopped after PRICED_BATCHES): the trades that pay run, the size
        # trials' estimate rules them out; and `trials: false` (no trial, the engine's layout).
        # Each the other's reference: the trades change no number, and `trials: false` is the search alone.
        priced = fit("auto", PRICED_BATCHES, limit=room, planned=1000, size_trials=True)
        no_trials = fit("auto", PRICED_BATCHES, limit=room, planned=1000, trials=False)
        out["priced"], out["no_trials"] = _strip(priced, no_trials), _strip(no_trials, priced)
    if world <= 2:
        out["sized"] = _strip(size_case(), fit(2, SIZE_BATCHES, layout="fixed"))
    if world <= 2:
        out.update(recompute_cases())
    else:
        out.update(recompute_cases(oom=False))
    out.update(upsize_cases(low["peak"], high["peak"]))
    return out


SIZE_BATCHES = 16
PRICED_BATCHES = 30


def size_case() -> dict[str, Any]:
    """Size trials: no cap, so the whole batch (4) is found; the trades change no time
    (not kept); then 2 (split 2, 2) is timed faster than 4 and kept (the size policy adopts it), and
    from 2, 1 slower than 2 (not kept)."""
    return fit("auto", SIZE_BATCHES, timing=seconds_by_size({4: 2.0, 2: 1.0, 1: 1.5}), size_trials=True)


def upsize_cases(without2: int, without3: int) -> dict[str, Any]:
    """The user did not ask for checkpointing: the engine carries it switched off, ``recompute`` is a
    candidate. The probe, and a cap where size 2 fits without checkpointing but 3 does not, while 4
    (the whole batch) fits with it, with room for the projection's margin. ``grad_sync_once`` and
    checkpointing on are timed faster: the first is kept at 2 (``no_reshard`` not), then one batch
    measures checkpointing (on, at the probe's split), then the upsize trial runs 4 with it against 2
    without: kept, the size policy settles on 4 (``upsize``); an OOM on rank 0 in the last batch then
    undoes ``grad_sync_once`` and reruns the batch at 4 with checkpointing still on. Not kept:
    `downsize_case`'s runs.
    Parameters against a fixed run at size 2 without checkpointing (recomputation changes no number)."""
    with4 = fit(4, 2, layout="fixed", fsdp2=AC)["peak"]
    cap = torch.tensor([(without3 + max(without2, int(with4 / 0.9))) // 2], dtype=torch.int64)
    torch.distributed.broadcast(cap, 0)
    limit = int(cap[0])
    batches = 14
    fixed = fit(2, batches, layout="fixed")
    out: dict[str, Any] = {"upsize_limit": [without2, without3, with4, limit]}
    faster = seconds_where(faster=(GRAD_SYNC_ONCE, RECOMPUTE))
    # Pressure at the adopted size in the last batch: an OOM on rank 0 undoes grad_sync_once, never checkpointing.
    fault = FaultInjector(site="backward_pre", ranks=[0], batch=batches - 1, times=1)
    out["upsize"] = _strip(fit("auto", batches, limit=limit, timing=faster, start_size="probe", faults=[fault]), fixed)
    if torch.distributed.get_world_size() > 2:
        return out  # the two runs below run on 1 and 2 ranks (4 ranks on CI's 2 cores: ~2 min more)
    # A card not all ours: the rerun at the size found, the trade undone, runs out too (a second fault):
    # an error-level line says the trade was not what held the memory; the size policy goes on.
    import logging

    class Errors(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    errors, truth = Errors(), logging.getLogger("automicro.batch.memory_truth")
    truth.addHandler(errors)
    try:
        twice = FaultInjector(site="backward_pre", ranks=[0], batch=batches - 1, times=2)
        again = fit("auto", batches, limit=limit, timing=faster, start_size="probe", faults=[twice])
    finally:
        truth.removeHandler(errors)
    out["rerun_out"] = {**_strip(again, fixed), "errors": errors.lines}
    # A card not all ours: the memory comes back (another process gave it up) after checkpointing was kept at 4:
    # undone, the size searched again from 2 without it, 4 fits now; checkpointing is not tried again
    # (4 is the whole batch).
    returned = fit("auto", batches + 6, limit=limit, timing=faster, start_size="probe", cap_args={"limit_at_batch": {13: 4 * limit}})
    out["returned"] = _strip(returned, fit(2, batches + 6, layout="fixed"))
    # A card not all ours (an H200, 2026-11-27, memory that moves): another process holds memory on the last rank's card only: no
    # rank measures or tries checkpointing at a larger microbatch (the other process could take what
    # the reshaped allocations free); the rest of the search as in `upsize`.
    last = torch.distributed.get_world_size() - 1
    shared = fit("auto", batches, limit=limit, timing=faster, start_size="probe", cap_args={"held_outside": {last: 5 * 2**30}})
    out["shared"] = _strip(shared, fixed)
    return out


AC = {"activation_checkpointing": True}


def upsize_compiled_case() -> dict[str, Any]:
    """`upsize_cases`' run with each block compiled (aot_eager, its shapes dynamic: no static nor scope trial; torch >=
    2.8 compiles under the memory cap), its cap set the same way from compiled runs' peaks, checkpointing alone timed
    faster: measured, then kept at 4 against 2 without (the switch's hooks outside each compiled forward). Parameters
    against a compiled fixed run at 2 without checkpointing; the graphs each compiled (``graphs``, the fixed run's
    ``fixed_graphs``) and the cap's figures (``limit``)."""
    from automicro.engine.compile import compiled_graphs

    backend = {"backend": "aot_eager", "scope": "blocks", "dynamic": True}
    batches = 12
    torch.compiler.reset()  # each counted run's graphs its own (not a run's before, cached)
    before = compiled_graphs()
    fixed = fit(2, batches, layout="fixed", compile=backend)
    fixed_graphs = compiled_graphs() - before
    without2, without3 = fixed["peak"], fit(3, 2, layout="fixed", compile=backend)["peak"]
    with4 = fit(4, 2, layout="fixed", fsdp2=AC, compile=backend)["peak"]
    cap = torch.tensor([(without3 + max(without2, int(with4 / 0.9))) // 2], dtype=torch.int64)
    torch.distributed.broadcast(cap, 0)
    limit = int(cap[0])
    torch.compiler.reset()
    before = compiled_graphs()
    auto = fit("auto", batches, limit=limit, timing=seconds_where(faster=(RECOMPUTE,)), start_size="probe", compile=backend)
    graphs = compiled_graphs() - before
    return {**_strip(auto, fixed), "graphs": graphs, "fixed_graphs": fixed_graphs, "limit": [without2, without3, with4, limit]}


def recompute_cases(oom: bool = True) -> dict[str, Any]:
    """The blocks checkpoint their activations (``activation_checkpointing: true``), so
    ``no_recompute`` is a candidate; only it is timed faster.

    - ``recompute_kept``: no cap: the whole batch in one microbatch, the trade kept.
    - ``recompute_oom``: the probe (two sizes for the memory model) and a cap between the whole
      batch's peak with checkpointing and without: the size settles at 4 with it, the trial's first
      batch runs out of memory, the trade is undone and the batch reruns at 4; never tried again at
      4. The full recompute asked for is then tried down to ``op`` at 4 (checkpointing off did not fit
      there): out of memory too, undone the same way. Then one batch at size 1 without checkpointing
      measures its bytes per sample, one more ``op``'s, and a downsize trial runs the largest smaller
      size they fit at without checkpointing against 4 with it: timed faster, that size is adopted.
    Parameters against a fixed run with checkpointing at size 4 (recomputation changes no number).
    `oom=False` (4 ranks, to spare CI's time): ``recompute_kept`` only."""
    batches = BATCHES + 2  # settled after batch 3; the three trials in batches 4-9, one batch after
    fixed = fit(4, batches, layout="fixed", fsdp2=AC)
    faster = seconds_where(faster=(NO_RECOMPUTE,))
    kept = _strip(fit("auto", batches, timing=faster, fsdp2=AC), fixed)
    if not oom:
        return {"recompute_kept": kept}
    with_ac, without = fit(4, 2, layout="fixed", fsdp2=AC), fit(4, 2, layout="fixed")
    assert with_ac["peak"] < without["peak"], (with_ac["peak"], without["peak"])
    limit = torch.tensor([(with_ac["peak"] + without["peak"]) // 2], dtype=torch.int64)
    torch.distributed.broadcast(limit, 0)
    reference = fit(4, batches + 9, layout="fixed", fsdp2=AC)
    return {
        "recompute_kept": kept,
        "recompute_oom": _strip(
            fit("auto", batches + 9, limit=int(limit[0]), timing=faster, fsdp2=AC, start_size="probe"), reference,
        ),
        "limit": int(limit[0]),
        **op_kept_case(without["peak"], batches + 9, reference),
    }


def op_kept_case(without4: int, batches: int, reference: dict[str, Any]) -> dict[str, Any]:
    """``recompute_op_kept``: full recompute asked for, the probe, and a cap between the whole batch's peak with
    ``op`` and without checkpointing: the size settles at 4 with full, checkpointing off runs out at 4 (undone),
    ``op`` fits at 4 and is timed faster than full (kept: the size policy's samples now mix full's and ``op``'s
    peaks); then one batch at the probe's split measures checkpointing off on top of ``op`` (its own line, not the
    policy's) and the downsize trial runs off at the largest smaller size that line fits at, timed faster: adopted,
    with no other OOM. `without4`: the peak at 4 without checkpointing."""
    with_op = fit(4, 2, layout="fixed", fsdp2={"activation_checkpointing": "op"})
    assert with_op["peak"] < without4, (with_op["peak"], without4)
    limit = torch.tensor([(with_op["peak"] + without4) // 2], dtype=torch.int64)
    torch.distributed.broadcast(limit, 0)
    faster = seconds_where(faster=(NO_RECOMPUTE, RECOMPUTE_OP))
    run = fit("auto", batches, limit=int(limit[0]), timing=faster, fsdp2=AC, start_size="probe")
    # What a sample adds without checkpointing, from two fixed runs at the probe's sizes (1 and 2).
    slope = fit(2, 2, layout="fixed")["peak"] - fit(1, 2, layout="fixed")["peak"]
    return {"recompute_op_kept": _strip(run, reference), "op_limit": int(limit[0]), "off_per_sample": slope}


def downsize_case(rank: int, world: int) -> dict[str, Any]:
    """The probe (two sizes for the memory model) under a cap where size 2 fits but neither trade
    fits on top of it, while both fit at size 1: after the trades are passed over at 2, a downsize
    trial runs size 1 with both against size 2 without; timed faster, size 1 is adopted."""
    one, two = fit(1, 2, layout="fixed"), fit(2, 2, layout="fixed")
    both = one["peak"] + one["extra"]
    cap = torch.tensor([two["peak"] + min(two["extras"]) // 2], dtype=torch.int64)
    torch.distributed.broadcast(cap, 0)
    limit = int(cap[0])
    report: dict[str, Any] = {"fits_at_1": both <= limit, "fits_at_2": two["peak"] <= limit}
    faster = seconds_where(faster=(GRAD_SYNC_ONCE,))
    batches = 14
    fixed = fit(2, batches, layout="fixed")
    report["auto"] = _strip(fit("auto", batches, limit=limit, timing=faster, start_size="probe"), fixed)
    slower = seconds_where(slower=(GRAD_SYNC_ONCE,))
    report["slower"] = _strip(fit("auto", batches, limit=limit, timing=slower, start_size="probe"), fixed)
    return report
