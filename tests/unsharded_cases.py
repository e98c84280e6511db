"""`auto` without FSDP on one rank (`automicro.engine.unsharded`): cases for tests/test_unsharded.py."""

from __future__ import annotations

from typing import Any, Optional

import torch

import automicro
from automicro.composer.callback import AutoMicrobatching
from composer.core import Callback, State
from composer.loggers import Logger
from tests.automicro_cases import SEED, OOMAtBatch, adam_steps, history, make_loader, max_error, record_case
from tests.toy_models import ComposerStack

BATCHES = 8
LIMIT = 5  # a microbatch above 5 samples runs out of memory in its forward (the search finds 5)
OOM_BATCH = 6  # the hooks are off by then: a one-off OOM there is rerun at the same size
UNSHARD_PIN = {"fsdp2": {"on_one_rank": "unshard"}}


class OOMAbove(Callback):
    """Runs out of memory after the forward of a microbatch of more than `limit` samples (without
    FSDP there are no sync hooks, so the fault kit's module sites do not fire: an event does)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def after_forward(self, state: State, logger: Logger) -> None:
        x, _ = state.batch
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. (test: a microbatch above the limit)")


def _run(microbatch: Any, limit: Optional[int], fault: Any = None, parallelism: Any = None, compile: Any = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ComposerStack(width=32)
    auto = AutoMicrobatching(log_attempts=False) if microbatch == "auto" else None
    callbacks = [c for c in (auto, OOMAbove(limit) if limit else None, fault) if c is not None]
    trainer = automicro.Trainer(
        model=model,
        train_dataloader=make_loader(1, BATCHES),
        max_duration=f"{BATCHES}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        parallelism_config=parallelism,
        device_train_microbatch_size=microbatch,
        compile=compile,
        callbacks=callbacks,
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=SEED,
    )
    try:
        trainer.fit()
        return {
            "history": history(auto) if auto else [],
            "split": list(auto.policy.current_split()) if auto else None,
            "sharded": trainer.sharded_model is not None,
            "fsdp_params": any(hasattr(p, "full_tensor") for p in model.parameters()),
            "adam_steps": adam_steps(trainer),
            "fired": None if fault is None else fault.fired,
            "summary": None if auto is None else auto.summary_line(),
            # Composer's whole-model compile sets the compiled forward on the model itself.
            "compiled": "forward" in vars(trainer.state.model),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        }
    finally:
        trainer.close()


class OOMAboveTokens(OOMAbove):
    """`OOMAbove` for dict batches (`input_ids` [samples, sequence])."""

    def after_forward(self, state: State, logger: Logger) -> None:
        if state.batch["input_ids"].shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. (test: a microbatch above the limit)")


def _hf_llama_run(microbatch: Any, limit: Optional[int], compile: Any) -> dict[str, Any]:
    """A transformers `LlamaForCausalLM` whose config keeps every default but its size (`use_cache`
    included) in Composer's `HuggingFaceModel`, with `on_one_rank: unshard` (the pin with
    compile trained no batch on a GPU)."""
    import warnings

    from composer.models import HuggingFaceModel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the tokenizer was not provided"
        model = HuggingFaceModel(LlamaForCausalLM(config), tokenizer=None, use_logits=True)
    generator = torch.Generator().manual_seed(3)
    rows = [{"input_ids": t, "labels": t.clone()} for t in torch.randint(0, 128, (8 * HF_BATCHES, 16), generator=generator)]
    loader = torch.utils.data.DataLoader(rows, batch_size=8, collate_fn=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]})
    auto = AutoMicrobatching(log_attempts=False) if microbatch == "auto" else None
    trainer = automicro.Trainer(
        model=model, train_dataloader=loader, max_duration=f"{HF_BATCHES}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
        parallelism_config={"fsdp2": {"on_one_rank": "unshard", "mixed_precision": "FULL"}},
        device_train_microbatch_size=microbatch, compile=compile,
        callbacks=[c for c in (auto, OOMAboveTokens(limit) if limit else None) if c is not None],
        loggers=[], progress_bar=False, log_to_console=False, seed=SEED,
    )
    try:
        trainer.fit()
        return {
            "history": history(auto) if auto else [],
            "split": list(auto.policy.current_split()) if auto else None,
            "batches": int(trainer.state.timestamp.batch),
            "sharded": trainer.sharded_model is not None,
            "compiled": "forward" in vars(trainer.state.model),
            "use_cache": config.use_cache,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        }
    finally:
        trainer.close()


HF_BATCHES = 5


def run_one_rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def case(name: str, fn: Any) -> None:
        record_case(out, name, fn)

    case("auto", lambda: _run("auto", LIMIT))
    split = out["auto"].get("split")
    if split:
        case("fixed", lambda: _run(max(split), None))
        case("auto_one_off", lambda: _run("auto", LIMIT, OOMAtBatch(OOM_BATCH)))
        # One rank with FSDP2 in the config keeps it (the layout's trades make it cheap on a GPU).
        case("fsdp2_kept", lambda: _run("auto", LIMIT, parallelism={"fsdp2": {}}))
        # `on_one_rank: unshard`: the same config trains unsharded on one rank; `compile: true`
        # (each block) becomes the whole model's compile.
        case("pinned_unshard", lambda: _run("auto", LIMIT, parallelism=UNSHARD_PIN, compile={"backend": "aot_eager"}))
        # The same pin on a transformers Llama at its config defaults, compiled (aot_eager on CPU).
        case("hf_pinned_compiled", lambda: _hf_llama_run("auto", LIMIT, {"backend": "aot_eager"}))
        hf_split = out["hf_pinned_compiled"].get("split")
        if hf_split:
            case("hf_fixed_eager", lambda: _hf_llama_run(max(hf_split), None, None))
            if "params" in out.get("hf_fixed_eager", {}):
                out["hf_pinned_compiled"]["error"] = max_error(out["hf_pinned_compiled"]["params"], out["hf_fixed_eager"]["params"])
    for name in ("auto", "auto_one_off", "pinned_unshard"):
        if name in out and "params" in out[name] and "fixed" in out:
            out[name]["error"] = max_error(out[name]["params"], out["fixed"]["params"])
    for result in out.values():
        result.pop("params", None)
    return out


def run_two_ranks_pinned(rank: int, world: int) -> dict[str, Any]:
    """`on_one_rank: unshard` on two ranks: FSDP2 as configured, the search as always."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    record_case(out, "pinned", lambda: _run("auto", LIMIT, parallelism=UNSHARD_PIN))
    out["pinned"].pop("params", None)
    return out["pinned"]


def run_two_ranks(rank: int, world: int) -> dict[str, Any]:
    try:
        _run("auto", None)
    except Exception as error:  # noqa: BLE001 - the test reads the refusal
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": ""}
