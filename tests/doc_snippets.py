"""The Python examples of the README and the guides, run as written on 2 CPU ranks.

A ```python block in the docs is preceded by ``<!-- runs: NAME -->``: NAME is a harness here, which
builds what the example takes as given (a model, a loader, ...: the names it uses but does not
define), runs the example's code unchanged with them, and checks what it did. One launch runs every
example (`run_examples`, called by tests/test_docs.py); ``<!-- runs: gpu -->`` marks an example that
needs a GPU (its settings name one), which tests/test_docs.py compiles and ties to the CPU example
that runs its path.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, BATCH, BATCHES = 64, 16, 4, 3


def _tokens(batches: int = BATCHES, batch: int = BATCH) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7 + dist.get_rank())
    out = []
    for _ in range(batches):
        ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


class TinyDecoder(nn.Module):
    """A decoder-shaped model with ``layers`` (as transformers' and torchtitan's models name them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def loss_fn(model: nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(microbatch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), microbatch["labels"].flatten())


class Recorder:
    """Stands in for a logger or a scheduler the example calls (``wandb.log``, ``scheduler.step``)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def log(self, values: dict) -> None:
        self.calls.append(values)

    def step(self) -> None:
        self.calls.append("step")


# ---- the harnesses: NAME -> (namespace before, check after) -------------------------------------


def _autostep() -> tuple[dict, Callable[[dict], None]]:
    """The README's: a model already sharded with `fully_shard`, an optimizer, a loss and a loader."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyDecoder()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    namespace = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "loss_fn": loss_fn,
                 "loader": _tokens()}

    def check(ns: dict) -> None:
        assert ns["result"].split and ns["auto"].found_size is not None, "AutoStep did not step"

    return namespace, check


def _plain_loop() -> tuple[dict, Callable[[dict], None]]:
    """The plain-loop guide's: it shards the model itself, logs and saves each batch."""
    saved: list[dict] = []
    torch.manual_seed(0)
    namespace = {"torch": torch, "model": TinyDecoder(), "loss_fn": loss_fn, "loader": _tokens(), "scheduler": Recorder(),
                 "wandb": Recorder(), "want_checkpoint": True, "save": saved.append}

    def check(ns: dict) -> None:
        assert ns["scheduler"].calls == ["step"] * BATCHES
        assert len(ns["wandb"].calls) == BATCHES and "automicro/microbatch_size" in ns["wandb"].calls[-1]
        assert len(saved) == BATCHES and "automicro" in saved[-1]

    return namespace, check


def _composer_trainer() -> tuple[dict, Callable[[dict], None]]:
    """The README's and the many-hosts guide's: Composer's model and dataloader, as a user has them."""
    import automicro
    from automicro.data import SyntheticTokens, build_dataloader
    from automicro.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", n_layers=2)
    loader = build_dataloader(SyntheticTokens(2 * BATCH * dist.get_world_size(), SEQ, VOCAB), BATCH, shuffle=False)
    namespace = {"automicro": automicro, "model": model, "composer_model": model, "loader": loader, "dl": loader}

    def check(ns: dict) -> None:
        trainer = ns["trainer"]
        assert trainer.auto_microbatching.found_size is not None
        assert int(trainer.state.timestamp.batch) >= 2

    return namespace, check


def _engine() -> tuple[dict, Callable[[dict], None]]:
    """How it works: the engine shards a model it is given."""
    from automicro.models import Llama, LlamaConfig

    torch.manual_seed(0)
    namespace = {"model": Llama(LlamaConfig.from_preset("tiny", n_layers=2))}

    def check(ns: dict) -> None:
        assert ns["sharded"].prefetch_plan()

    return namespace, check


def _projection() -> tuple[dict, Callable[[dict], None]]:
    """Many hosts: the control plane projected (`automicro.core.control_sim`), nothing given."""

    def check(ns: dict) -> None:
        assert ns["row"]["world"] == 16384 and ns["row"]["round_ms"] > 0

    return {}, check


HARNESSES: dict[str, Callable[[], tuple[dict, Callable[[dict], None]]]] = {
    "autostep": _autostep,
    "plain-loop": _plain_loop,
    "composer-trainer": _composer_trainer,
    "engine": _engine,
    "projection": _projection,
}


def run_examples(rank: int, world_size: int, examples: list[tuple[str, str, str]]) -> dict[str, str]:
    """Each (where, harness, code) on this rank, in order: ``{where: "ok" | the traceback}``."""
    out = {}
    for where, harness, code in examples:
        namespace: dict = {}
        try:
            namespace, check = HARNESSES[harness]()
            namespace.setdefault("__name__", "__doc_example__")
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 (the docs' own example)
            check(namespace)
            out[where] = "ok"
        except BaseException:  # noqa: BLE001 (reported per example)
            out[where] = traceback.format_exc()
        finally:
            trainer = namespace.get("trainer")
            if trainer is not None and hasattr(trainer, "close"):
                trainer.close()
        dist.barrier()
    return out
