"""Hugging Face models (GPT-2 from `transformers`, built from a config, no downloaded weights) in
Composer's `HuggingFaceModel`, on 2 ranks: block wrapping from `_no_split_modules`, the root's
backward sites, memory per rank, and a real search with parity against a fixed size."""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import torch
from composer.models import HuggingFaceModel

SEQ = 16
VOCAB = 128
PER_RANK_BATCH = 8


def gpt2(n_layer: int = 4, n_embd: int = 64) -> HuggingFaceModel:
    """A small GPT-2 without dropout (a retried batch must compute the same numbers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the tokenizer was not provided"
        return HuggingFaceModel(GPT2LMHeadModel(config), tokenizer=None, use_logits=True)


def _batch(seed: int, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return {"input_ids": tokens, "labels": tokens.clone()}


def run_sites_and_memory(rank: int, world: int) -> dict[str, Any]:
    """Which modules are wrapped, which sites fire (and torch's warnings) in one step, and the
    peak bytes per rank of one forward/backward with the blocks wrapped vs the root alone."""
    from automicro.engine.hooks import SiteHooks
    from automicro.engine import FSDP2Config, shard
    from automicro.testing.memory_cap import MemoryCap

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    model = gpt2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = shard(model)
        fired: list[tuple[str, str]] = []
        hooks = SiteHooks(sharded, lambda site, name: fired.append((site, name)))
        hooks.install()
        batch = _batch(1, 2)
        model.loss(model(batch), batch).backward()
        hooks.remove()
    out["wrapped"] = sharded.wrapped_names
    out["fired"] = fired
    out["warnings"] = [str(w.message) for w in caught]

    for name, wrap in (("blocks", None), ("root_only", [])):
        torch.manual_seed(0)
        model = gpt2(n_layer=4, n_embd=128)
        sharded = shard(model, FSDP2Config(wrap=wrap))
        cap = MemoryCap(None)
        cap.track_existing(model, check=False)
        batch = _batch(2, 2)
        with cap:
            model.loss(model(batch), batch).backward()
        out[f"peak_{name}"] = int(cap.peak_bytes)
        out[f"params_{name}"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def run_root_only_warning(rank: int, world: int) -> dict[str, Any]:
    """A model whose blocks carry no mark of any kind: the engine says so, with the fix."""
    from automicro.engine import FSDP2Config, shard

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    out = {}
    for name, wrap in (("unmarked", None), ("explicit_root_only", []), ("named", ["Block"])):
        model = torch.nn.Sequential(Block(), Block(), Block())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded = shard(model, FSDP2Config(wrap=wrap))
        out[name] = {
            "wrapped": sharded.wrapped_names,
            "warnings": [str(w.message) for w in caught if "only the root" in str(w.message)],
        }
    return out


def run_search_and_parity(rank: int, world: int, limit_bytes: int, steps: int = 3) -> dict[str, Any]:
    """automicro.Trainer with GPT-2 in HuggingFaceModel: `auto` under an emulated memory cap, then
    a fixed-size run at the size found; both from the same seed and batches."""
    import automicro
    from automicro.data import SyntheticTokens, build_dataloader
    from automicro.testing import MemoryCapCallback

    from tests.toy_models import full_state

    dataset = SyntheticTokens(PER_RANK_BATCH * world * steps, SEQ, VOCAB, seed=3)
    results: dict[str, Any] = {}
    found = None
    for name in ("auto", "fixed"):
        torch.manual_seed(0)
        model = gpt2()
        callbacks: list[Any] = []
        if name == "auto":
            auto = automicro.AutoMicrobatching(log_attempts=False)
            callbacks = [auto, MemoryCapCallback(limit_bytes=limit_bytes)]
        trainer = automicro.Trainer(
            model=model,
            train_dataloader=build_dataloader(dataset, PER_RANK_BATCH, shuffle=False),
            max_duration=f"{steps}ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
            device="cpu",
            parallelism_config={"fsdp2": {}},
            device_train_microbatch_size="auto" if name == "auto" else found,
            callbacks=callbacks,
            loggers=[],
            progress_bar=False,
            log_to_console=False,
            seed=17,
        )
        try:
            trainer.fit()
            if name == "auto":
                found = auto.found_size
                results["found_size"] = found
                results["ooms_total"] = auto.ooms_total
                results["wrapped"] = trainer.sharded_model.wrapped_names
            results[name] = full_state(model)
        except Exception:  # noqa: BLE001 - the test reports which run broke
            results[name] = {"crash": traceback.format_exc()}
            return results
        finally:
            trainer.close()
    auto_state, fixed_state = results.pop("auto"), results.pop("fixed")
    results["max_param_diff"] = max(float((auto_state[k] - fixed_state[k]).abs().max()) for k in fixed_state)
    return results


# Emulated per-rank memory: rank 0 fits a smaller microbatch than rank 1 (asymmetric OOMs).
SEARCH_LIMITS = {0: 3_800_000, 1: 5_000_000}


def run_all(rank: int, world: int) -> dict[str, Any]:
    """Every case above in one set of processes (importing transformers is the slow part)."""
    out: dict[str, Any] = {}
    for name, case, args in (
        ("sites", run_sites_and_memory, ()),
        ("warn", run_root_only_warning, ()),
        ("search", run_search_and_parity, (SEARCH_LIMITS,)),
    ):
        try:
            out[name] = case(rank, world, *args)
        except Exception:  # noqa: BLE001 - the test reports which case broke
            out[name] = {"crash": traceback.format_exc()}
    return out
