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
from automicro.integration.callback import AutoMicrobatching
from tests import token_cases as cases
from tests.automicro_cases import max_error

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
    return [line for line in lines if line.startswith("packing:")]


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


def run_packing(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    cases._case(out, "llama", lambda: _llama(world))
    cases._case(out, "per_sample", lambda: _per_sample(world))
    for layout in ("right", "left"):
        cases._case(out, f"hf/{layout}", lambda layout=layout: _hf(world, layout))
    return out


def _per_sample(world: int) -> dict[str, Any]:
    """packing with the Trainer's accumulate_train_batch_on_tokens=False: refused at build."""
    auto = AutoMicrobatching(log_attempts=False, budget="tokens", packing=True)
    try:
        cases.fit("auto", [auto], batches=1, on_tokens=False)
    except ValueError as error:
        return {"refused": str(error)}
    return {"refused": None}
