"""Multi-rank cases for `AutoMicrobatching(budget="tokens", packing=True)` (tests/test_packing.py).

Each rank reads variable-length data of its own length law (tests/token_cases.py's loaders);
`TokenLimit` is the memory model (a microbatch of more tokens than the limit runs out of memory in
its forward). A packed microbatch is one row, so its tokens are its real tokens. Every case returns
plain data; a case that breaks is returned as {"crash": ...}.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from composer.core import Callback, DataSpec, State
from composer.loggers import Logger

from automicro.data import TokenCounter
from automicro.composer.callback import AutoMicrobatching
from tests import token_cases as cases
from tests.automicro_cases import max_error
from tests.case_runs import run_case
from tests.timings import arm_seconds

BATCHES = 5


class MicrobatchShapes(Callback):
    """What each training microbatch looked like on this rank: (rows, tokens, has position_ids,
    has attention_mask, real tokens by the labels' count)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, bool, bool]] = []

    def before_forward(self, state: State, logger: Logger) -> None:
        batch = state.batch
        self.rows.append((int(batch["input_ids"].shape[0]), int(batch["input_ids"].numel()), "position_ids" in batch,
                          "attention_mask" in batch))


def _said(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("packing:", "packing trial:"))]


def _llama(world: int) -> dict[str, Any]:
    """automicro's Llama (it says it takes packed rows), packing under a token limit, against the
    unsplit padded batches weighted per loss token (labels come shifted: label_shift 0)."""
    auto = AutoMicrobatching(log_attempts=False, budget="tokens", packing=True)
    lines: list[str] = []
    auto.runtime.info = lines.append
    shapes = MicrobatchShapes()
    # on_tokens: the loss per loss token with automicro.data.count_tokens (labels != -100), as the reference.
    packed = cases.fit("auto", [auto, cases.TokenLimit(cases.limits(world)), shapes], batches=BATCHES, on_tokens=True, sgd=True)
    padded = cases.fit(cases.PER_RANK_BATCH, [], batches=BATCHES, on_tokens=True, sgd=True)
    return {**{k: v for k, v in packed.items() if k != "params"}, "lines": _said(lines), "shapes": shapes.rows,
            "error_vs_unsplit": None if packed["params"] is None else max_error(packed["params"], padded["params"])}


def _hf(world: int, layout: str) -> dict[str, Any]:
    """A transformers Llama (sdpa, fp32, SGD), batches from transformers' padding collator on
    `layout`'s side, packing under a token limit, against the unsplit padded batches weighted per
    loss token (labels[:, 1:] != -100; left: each padded row's first label masked, as automicro does)."""
    rank = dist.get_rank()
    auto = AutoMicrobatching(log_attempts=False, budget="tokens", packing=True)
    lines: list[str] = []
    auto.runtime.info = lines.append
    shapes = MicrobatchShapes()
    model_config: dict[str, Any] = {}

    def use_cache_after(trainer: Any) -> None:
        model_config["use_cache"] = trainer.state.model.model.config.use_cache

    packed = cases._hf_fit(rank, world, layout, "auto", BATCHES, auto, extra_callbacks=[shapes], after_fit=use_cache_after)
    reference = cases._hf_fit(
        rank, world, layout, cases.PER_RANK_BATCH, BATCHES, None, accumulate_train_batch_on_tokens=True,
        train=DataSpec(cases._hf_loader(rank, layout, BATCHES, reference=True), get_num_tokens_in_batch=TokenCounter(1)),
    )
    return {"splits": packed["splits"], "batches": packed["batches"], "lines": _said(lines), "shapes": shapes.rows,
            "use_cache": model_config.get("use_cache"), "padding_waste": auto.tokens.padding_waste,
            "error_vs_unsplit": max_error(packed["params"], reference["params"])}


MEASURED_BATCHES = 22  # the budget settles by batch ~10 (a later, longer batch steps it down), 6 trial batches, a few after


class MicrobatchesPerBatch(Callback):
    """Per batch: whether its microbatches were packed rows (position ids, one row each)."""

    def __init__(self) -> None:
        self.packed: dict[int, set[bool]] = {}

    def before_forward(self, state: State, logger: Logger) -> None:
        batch = state.batch
        packed = "position_ids" in batch and int(batch["input_ids"].shape[0]) == 1
        self.packed.setdefault(int(state.timestamp.batch), set()).add(packed)


class SlowArm(Callback):
    """Makes one arm of the packing trial slower (`PackingChoice.timing`): its batches take 3 s, the other's 1 s,
    whatever was measured (`tests/timings.py`)."""

    def __init__(self, auto: AutoMicrobatching, arm: str) -> None:
        self.auto, self.arm = auto, arm

    def batch_start(self, state: State, logger: Logger) -> None:
        choice = self.auto.search.packing_choice
        if choice is not None:
            choice.timing = arm_seconds({self.arm: 3.0})


class OOMWhenPacked(Callback):
    """An OOM in the forward of a packed microbatch (one row with position ids) of batch `batch`, on rank 1."""

    def __init__(self, batch: int) -> None:
        self.batch, self.fired = batch, 0

    def before_forward(self, state: State, logger: Logger) -> None:
        batch = state.batch
        if (int(state.timestamp.batch) == self.batch and dist.get_rank() == 1 and "position_ids" in batch
                and int(batch["input_ids"].shape[0]) == 1):
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory (test: a packed microbatch)")


def _measured(world: int, packing: Any, slow: Any = None, oom_at: Any = None) -> dict[str, Any]:
    """automicro's Llama (it says it takes packed rows) under a token limit, `packing` as given
    ("auto": measured on CPU too); `slow`: the trial arm made to look slower; `oom_at`: a batch whose
    packed microbatches run out of memory on rank 1. The trial's logic, unpriced (`bound_trials`: its price is
    tests/test_trial_plan.py's)."""
    auto = AutoMicrobatching(log_attempts=False, budget="tokens", packing=packing, bound_trials=False)
    lines: list[str] = []
    auto.runtime.info = lines.append
    per_batch = MicrobatchesPerBatch()
    extra = [SlowArm(auto, slow)] if slow else []
    oom = OOMWhenPacked(oom_at) if oom_at is not None else None
    result = cases.fit("auto", [auto, cases.TokenLimit(cases.limits(world)), per_batch, *extra, *([oom] if oom else [])],
                       batches=MEASURED_BATCHES, on_tokens=True, sgd=True)
    choice = auto.search.packing_choice
    return {**result, "lines": _said(lines), "state": None if choice is None else choice.state,
            "packed_by_batch": {b: sorted(v) for b, v in per_batch.packed.items()}, "oom_fired": None if oom is None else oom.fired}


def run_packing(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    run_case(out, "llama", lambda: _llama(world))
    # `packing` left to the measurement ("auto": on CPU too): kept packed where padding measures
    # slower, padded where packing does; each against a run pinned that way from the start.
    run_case(out, "measured/packed", lambda: _measured(world, "auto", slow="padded"))
    run_case(out, "measured/padded", lambda: _measured(world, "auto", slow="packed"))
    run_case(out, "pinned/packed", lambda: _measured(world, True))
    run_case(out, "pinned/padded", lambda: _measured(world, False))
    run_case(out, "measured/oom", lambda: _measured(world, "auto", slow="padded", oom_at=MEASURED_BATCHES - 1))
    run_case(out, "default_on_cpu", lambda: _measured(world, None))
    for arm in ("packed", "padded"):
        measured, pinned = out[f"measured/{arm}"], out[f"pinned/{arm}"]
        if measured.get("params") is not None and pinned.get("params") is not None:
            measured["error_vs_pinned"] = max_error(measured["params"], pinned["params"])
    for name in list(out):
        if name.startswith(("measured/", "pinned/", "default_on_cpu")):
            out[name].pop("params", None)
    run_case(out, "per_sample", lambda: _per_sample(world))
    for layout in ("right", "left"):
        run_case(out, f"hf/{layout}", lambda layout=layout: _hf(world, layout))
    return out


def _per_sample(world: int) -> dict[str, Any]:
    """packing with the Trainer's accumulate_train_batch_on_tokens=False: refused at build."""
    auto = AutoMicrobatching(log_attempts=False, budget="tokens", packing=True)
    try:
        cases.fit("auto", [auto], batches=1, on_tokens=False)
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}
