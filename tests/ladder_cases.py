"""Cases for tests/test_ladder.py: the main job where one sample does not fit without activation checkpointing.

configs/tiny-cpu.yaml as `composer -n 2 -m automicro.train tiny-cpu data.seq_len=1024 model.overrides.max_seq_len=1024`
builds it (`automicro.composer.builders`), its own memory caps (rank 0 13 MB, rank 1 18 MB: at 1,024 tokens a sample
rank 0 runs out at microbatch 1 without checkpointing, rank 1 does not), a per-rank batch of 2: `auto` with no key
added against the hand-set run (``activation_checkpointing: true``, microbatch 1), a cap where size 1 does not fit
with checkpointing either, a resume after the ladder's step, and the blocks compiled (torch >= 2.8: torch 2.7 does not
compile under the memory cap). Every case returns plain data; one that breaks is {"crash": ...}.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import automicro
from automicro import AutoStep

from tests.case_runs import run_case

LONG = ["data.seq_len=1024", "model.overrides.max_seq_len=1024", "global_train_batch_size={world2}",
        "callbacks.auto_microbatching.log_attempts=false"]
BATCHES = 4
SAVE_AT = 2
LATER = 3  # the batch of the one-off OOM in ``auto``
PROJECTED_CAP = "callbacks.memory_cap.limit_bytes={0: 14000000, 1: 18000000}"
PROJECTED_BATCHES = 2
ONE_RANK_CAP = "callbacks.memory_cap.limit_bytes={0: 16000000}"  # one rank holds every parameter: a larger cap


def main_job(more: tuple[str, ...] = (), batches: int = BATCHES, microbatch: Any = "auto", save_folder: Optional[str] = None,
             load_path: Optional[str] = None, extra: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The main job (`LONG`, `more`) for `batches` batches; `microbatch`: "auto" or a fixed size (then no
    AutoMicrobatching); `extra`: more callbacks."""
    from composer.core import Callback

    from automicro.composer import builders
    from automicro.composer.callback import AutoMicrobatching
    from automicro.config import load_config
    from automicro.config.load import resolve_config
    from automicro.engine.compile import compiled_graphs

    world = torch.distributed.get_world_size()
    overrides = [o.replace("{world2}", str(2 * world)) for o in LONG] + [f"max_duration={batches}ba", *more]
    cfg = load_config(resolve_config("tiny-cpu"), overrides)
    callbacks = [c for c in builders.build_callbacks(cfg) if type(c).__name__ != "SpeedMonitor"] + list(extra)
    if microbatch != "auto":
        callbacks = [c for c in callbacks if not isinstance(c, AutoMicrobatching)]
    auto = next((c for c in callbacks if isinstance(c, AutoMicrobatching)), None)
    lines: list[str] = []
    if auto is not None:
        auto.runtime.info = lines.append  # type: ignore[method-assign]
    torch.manual_seed(cfg.seed)
    model = builders.build_model_from(cfg)
    dataset = builders.build_dataset(cfg, model.model.config.vocab_size)
    data = builders.train_data(cfg, builders.build_train_dataloader(cfg, dataset, cfg.per_rank_batch_size(world)))
    graphs_before = compiled_graphs()
    trainer = automicro.Trainer(
        model=model, train_dataloader=data, max_duration=cfg.max_duration, optimizers=builders.build_optimizer(cfg, model),
        schedulers=builders.build_scheduler(cfg), device="cpu", precision=cfg.precision, device_train_microbatch_size=microbatch,
        parallelism_config={"fsdp2": cfg.fsdp2}, callbacks=callbacks, loggers=[], progress_bar=False, log_to_console=False,
        seed=cfg.seed, compile=cfg.compile, save_folder=save_folder, save_interval=f"{SAVE_AT}ba",
        load_path=load_path,
    )
    losses: dict[int, float] = {}

    class Losses(Callback):
        def batch_end(self, state: Any, logger: Any) -> None:
            losses[int(state.timestamp.batch)] = float(state.total_loss_dict["loss/train/total"])

    trainer.state.callbacks.append(Losses())
    result: dict[str, Any] = {}
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - returned to the test
        result["exception"] = {"type": type(error).__name__, "message": str(error)}
    result.update(losses=losses, lines=lines, batches=int(trainer.state.timestamp.batch), graphs=compiled_graphs() - graphs_before)
    if auto is not None:
        result.update(
            found=auto.found_size, layout=None if auto.layout is None else auto.layout.describe(),
            history=[(r.batch, r.attempt, r.size, r.outcome, r.failed_ranks, r.note) for r in auto.history],
            metrics=None if auto.layout is None else auto.layout.metrics(), summary=auto.summary_line(2),
        )
    trainer.close()
    return result



def suite(rank: int, world: int, folder: str) -> dict[str, Any]:
    """``auto`` (no key added), ``handset`` (checkpointing on, microbatch 1), ``tight`` (rank 0's cap too small even
    with checkpointing at 1), ``projected`` (size 1 runs in batch 0 with selective recompute, but not with the
    optimizer state its step adds), ``saved`` / ``resumed`` (the first two batches with a checkpoint at 2, then a new trainer
    from it to 4), ``compiled`` (compile: true, aot_eager; torch >= 2.8 only)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"torch": torch.__version__}
    from automicro.testing.faults import FaultInjector

    # A one-off OOM on rank 1 in a later batch, checkpointing on: one rerun of that batch, the numbers as without it.
    run_case(out, "auto", lambda: main_job(extra=(FaultInjector("backward", ranks=[1], batch=LATER, times=1),)))
    run_case(out, "handset", lambda: main_job(("parallelism_config.fsdp2.activation_checkpointing=true",), microbatch=1))
    run_case(out, "tight", lambda: main_job(("callbacks.memory_cap.limit_bytes={0: 7000000, 1: 18000000}",), batches=1))
    # Rank 0's cap where size 1 runs with selective recompute in batch 0, but not with the optimizer state its step adds.
    run_case(out, "projected", lambda: main_job((PROJECTED_CAP,), batches=PROJECTED_BATCHES))
    saved = f"{folder}/saved"
    run_case(out, "saved", lambda: main_job(batches=SAVE_AT, save_folder=saved))
    run_case(out, "resumed", lambda: main_job(load_path=f"{saved}/ep0-ba{SAVE_AT}-rank0.pt"))
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8):
        run_case(out, "compiled", lambda: main_job(("compile=true", "compile.backend=aot_eager")))
    return out


def plain_loop(checkpointing: bool) -> dict[str, Any]:
    """`AutoStep` on the main job's Llama at 1,024 tokens a sample, sharded by `automicro.engine.shard` with the
    checkpointing switch (`checkpointing` False) or with ``activation_checkpointing`` on (True), under a 16 MB cap:
    3 batches of 2 samples."""
    import torch.nn.functional as F

    from automicro.composer import builders
    from automicro.config import load_config
    from automicro.config.load import resolve_config
    from automicro.engine import FSDP2Config, shard
    from automicro.testing.callbacks import CapMemory
    from automicro.testing.memory_cap import MemoryCap

    cfg = load_config(resolve_config("tiny-cpu"), ["data.seq_len=1024", "model.overrides.max_seq_len=1024"])
    torch.manual_seed(cfg.seed)
    model = builders.build_model_from(cfg).model
    shard(model, FSDP2Config(activation_checkpointing=checkpointing), checkpoint_switch=not checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(m: Any, tokens: torch.Tensor) -> torch.Tensor:
        logits = m(tokens)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))

    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 256, (2, 1024), generator=generator) for _ in range(3)]
    cap = MemoryCap(16_000_000)
    losses, splits = [], []
    with cap:
        cap.track_existing(model, check=False)
        with AutoStep(model, optimizer, loss_fn, memory=CapMemory(cap), log_attempts=False) as auto:
            for batch in batches:
                result = auto.step(batch)
                losses.append(float(result.loss))
                splits.append(list(result.split))
            summary = auto.search.summary_line(2)
    return {"losses": dict(enumerate(losses)), "splits": splits, "summary": summary}


def one_rank(rank: int, world: int) -> dict[str, Any]:
    """On one rank (FSDP2 over one, the whole model on it), a cap where size 1 does not fit without checkpointing:
    ``auto`` against ``handset``, 3 batches; the same in a plain loop (`AutoStep`, ``plain_loop`` against
    ``plain_loop_handset``)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    run_case(out, "auto", lambda: main_job((ONE_RANK_CAP,), batches=3))
    run_case(out, "handset", lambda: main_job((ONE_RANK_CAP, "parallelism_config.fsdp2.activation_checkpointing=true"), batches=3, microbatch=1))
    run_case(out, "plain_loop", lambda: plain_loop(False))
    run_case(out, "plain_loop_handset", lambda: plain_loop(True))
    return out
