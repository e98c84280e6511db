"""Pipelines under automicro.Trainer on CPU ranks: fixed sizes, the search, faults on one stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from composer.core import Callback
from torchmetrics import Metric

import automicro
from automicro.data import SyntheticTokens, build_dataloader
from automicro.composer.callback import AutoMicrobatching
from automicro.models import build_model
from automicro.testing import MemoryCapCallback
from automicro.testing.faults import FaultInjector

SEQ = 16
PER_PIPELINE_BATCH = 8  # 2 stages: microbatch sizes 4, 2, 1 (at least 2 microbatches)


def fit(
    schedule: str,
    microbatch: Any,
    stages: int = 2,
    callbacks: Optional[list[Any]] = None,
    batches: int = 3,
    fsdp2: Optional[dict[str, Any]] = None,
    train_metrics: Optional[Callable[[], dict[str, Any]]] = None,
    keep_trainer: bool = False,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Train the 4-block tiny Llama for `batches` batches; this rank's stage parameters after it.
    `train_metrics`: makes the model's train metrics (its own by default)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = build_model("tiny", n_layers=4, max_seq_len=SEQ)
    if train_metrics is not None:
        own = model.get_metrics
        model.get_metrics = lambda is_train=False: train_metrics() if is_train else own(is_train)
    dp = dist.get_world_size() // stages
    train = build_dataloader(
        SyntheticTokens(64, SEQ, 256, seed=1), PER_PIPELINE_BATCH, shuffle=False, replicas=(dp, dist.get_rank() % dp)
    )
    auto = next((c for c in callbacks or [] if isinstance(c, AutoMicrobatching)), None)
    trainer = automicro.Trainer(
        model=model,
        train_dataloader=train,
        max_duration=f"{batches}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        parallelism_config={"fsdp2": fsdp2 or {}, "pipeline": {"stages": stages, "schedule": schedule}},
        device_train_microbatch_size=microbatch,
        callbacks=callbacks or [],
        loggers=trainer_kwargs.pop("loggers", []),
        progress_bar=False,
        log_to_console=False,
        seed=17,
        **trainer_kwargs,
    )
    try:
        trainer.fit()
        params = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        return {
            "params": params,
            "stage": trainer.pipeline.stage_index,
            "loss": float(trainer.state.total_loss_dict["loss/train/total"]),
            "history": [(r.batch, r.size, r.outcome, r.failed_ranks, r.sites, r.note) for r in auto.history] if auto else [],
            "found": None if auto is None else auto.found_size,
            "clean": trainer.sharded_model.is_clean(),
            "samples": int(trainer.state.timestamp.sample),
            "transport": None if auto is None else auto.transport_name,
            "flops_per_batch": model.flops_per_batch(trainer.state.batch),
            "left_behind": None if auto is None else (auto.left_behind_exact, auto.left_behind_checked),
            **({"trainer": trainer} if keep_trainer else {}),
        }
    finally:
        if not keep_trainer:
            trainer.close()


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def fault_matrix(rank: int, world: int, schedule: str, cases: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Per case (site, failing rank, microbatch index of the fault): the search's history and the
    largest parameter difference to a fixed-size run, without any fault, at the size it settled on."""
    references: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {"cases": []}
    for site, failing, microbatch in cases:
        injector = FaultInjector(site, ranks=[failing], microbatch_index=microbatch, batch=0, times=1)
        # Live tensor bytes counted (no limit): what the failed attempt left after its wipe. Without
        # the prediction: an injected OOM's bytes reached would cap the search like a real one's.
        counted = MemoryCapCallback(limit_bytes=10**12, retry_band=0.0)
        auto = AutoMicrobatching(log_attempts=False, use_prediction=False)
        result = fit(schedule, "auto", callbacks=[auto, injector, counted])
        if result["found"] not in references:  # every rank agreed on it: the same runs on all
            references[result["found"]] = fit(schedule, result["found"])
        out["cases"].append(
            {
                "case": (site, failing, microbatch),
                "fired": injector.fired,
                "history": result["history"],
                "found": result["found"],
                "clean": result["clean"],
                "left_behind": result["left_behind"],
                "diff": max_difference(result["params"], references[result["found"]]["params"]),
            }
        )
    return out


def search_under_limit(
    rank: int, world: int, schedule: str, failing: int, stages: int = 2, other_size: bool = True
) -> dict[str, Any]:
    """The search when rank `failing` runs out of memory in every forward above microbatch size 2
    (a memory limit, exact), and fixed-size runs at the size it found and (`other_size`) at another."""
    limit = FaultInjector("forward", ranks=[failing], above=2)
    auto = fit(schedule, "auto", stages=stages, callbacks=[AutoMicrobatching(log_attempts=False), limit], batches=5)
    fixed = fit(schedule, auto["found"], stages=stages, batches=5)
    other = fit(schedule, 1 if auto["found"] != 1 else 2, stages=stages, batches=5) if other_size else fixed
    return {
        "history": auto["history"],
        "found": auto["found"],
        "diff_fixed": max_difference(auto["params"], fixed["params"]),
        "diff_other_size": max_difference(auto["params"], other["params"]),
        "loss": auto["loss"],
        "fixed_loss": fixed["loss"],
        "samples": auto["samples"],
        "stage": auto["stage"],
    }


def steady_fault(rank: int, world: int, schedule: str, site: str, failing: int) -> dict[str, Any]:
    """An OOM on one stage after the size settled and the sync hooks came off (batch 4; stable
    after 2 clean batches), and a fixed-size run at the same size without it."""
    injector = FaultInjector(site, ranks=[failing], batch=4, times=1)
    auto = fit(schedule, "auto", callbacks=[AutoMicrobatching(stable_batches=2, log_attempts=False), injector], batches=6)
    fixed = fit(schedule, auto["found"], batches=6)
    return {"history": auto["history"], "found": auto["found"], "fired": injector.fired,
            "diff": max_difference(auto["params"], fixed["params"]), "clean": auto["clean"],
            "transport": auto["transport"]}


def data_parallel_stages(rank: int, world: int) -> dict[str, Any]:
    """Two stages of two data-parallel ranks each, in one launch: the search under rank 3's limit,
    then an OOM on rank 3 after the size settled (ZeroBubble, an input gradient)."""
    return {
        "search": search_under_limit(rank, world, "ZeroBubble", 3, other_size=False),
        "steady": steady_fault(rank, world, "ZeroBubble", "backward_input", 3),
    }


def checkpoint_resume(rank: int, world: int, schedule: str, folder: str) -> dict[str, Any]:
    """4 batches in one go, and 2 batches saved as a sharded checkpoint then resumed to 4."""
    whole = fit(schedule, "auto", callbacks=[AutoMicrobatching(log_attempts=False)], batches=4)
    fit(
        schedule, "auto", callbacks=[AutoMicrobatching(log_attempts=False)], batches=2,
        save_folder=folder, save_interval="2ba", checkpoint_format="sharded",
    )
    resumed_auto = AutoMicrobatching(log_attempts=False)
    resumed = fit(
        schedule, "auto", callbacks=[resumed_auto], batches=4,
        load_path=f"{folder}/ep0-ba2", checkpoint_format="sharded",
    )
    return {
        "diff": max_difference(whole["params"], resumed["params"]),
        "resumed_history": resumed["history"],
        "found": resumed["found"],
    }


def fixed_bad_size(rank: int, world: int) -> str:
    try:
        fit("1F1B", 3, batches=1)
    except ValueError as error:
        return str(error)
    return "no error"


class TokensSeen(Metric):
    """A sum-reduced train metric that checks devices as NCCL does. NCCL cannot gather a CPU
    tensor ("No backend type associated with device type cpu"); gloo can, so on CPU a stage that
    never moves its train metrics to its own device would pass unnoticed. This metric refuses to
    update or sync until it has been moved to the stage's device (`module_to_device`, `.to()`)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("tokens", default=torch.zeros(()), dist_reduce_fx="sum")
        self.on_stage_device = False

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        result = super()._apply(fn, *args, **kwargs)
        self.on_stage_device = True
        return result

    def _check_device(self) -> None:
        if not self.on_stage_device:
            raise RuntimeError("No backend type associated with device type cpu (TokensSeen: never moved to the stage's device)")

    def update(self, outputs: torch.Tensor, labels: torch.Tensor) -> None:
        self._check_device()
        self.tokens += labels.numel()

    def _sync_dist(self, *args: Any, **kwargs: Any) -> None:
        self._check_device()
        super()._sync_dist(*args, **kwargs)

    def compute(self) -> torch.Tensor:
        return self.tokens


def train_metrics_on_stages(rank: int, world: int, schedule: str, microbatch: Any) -> dict[str, Any]:
    """The model's own train metrics plus `TokensSeen`, logged by every rank: the values each rank
    logged per batch, and the loss it logged."""
    from composer.loggers import InMemoryLogger

    from automicro.models import build_model

    def metrics() -> dict[str, Any]:
        return {**build_model("tiny", n_layers=4, max_seq_len=SEQ).get_metrics(is_train=True), "TokensSeen": TokensSeen()}

    memory = InMemoryLogger()
    callbacks = [AutoMicrobatching(log_attempts=False, stable_batches=1)] if microbatch == "auto" else []
    result = fit(schedule, microbatch, callbacks=callbacks, batches=3, train_metrics=metrics, loggers=[memory])
    series = {key: [float(v) for _, v in values] for key, values in memory.data.items() if key.startswith(("metrics/train", "loss/train"))}
    return {"series": series, "stage": result["stage"], "world": world, "flops_per_batch": result["flops_per_batch"]}


def sum_free_metric(rank: int, world: int) -> str:
    """A train metric with a max-reduced state: refused on every rank, naming it."""
    from torchmetrics import MaxMetric

    try:
        fit("1F1B", 2, batches=1, train_metrics=lambda: {"Max": MaxMetric()})
    except Exception as error:  # noqa: BLE001 - returned to the test
        return f"{type(error).__name__}: {error}"
    return "no error"


class RoundsPerBatch(Callback):
    """Consensus rounds each batch took on this rank (`AutoMicrobatching.consensus_rounds`)."""

    def __init__(self, auto: AutoMicrobatching) -> None:
        self.auto = auto
        self.rounds: list[int] = []
        self.hooks_at_start: list[bool] = []  # the sync hooks each batch's first attempt ran with
        self._seen = 0

    def batch_start(self, state: Any, logger: Any) -> None:
        self.hooks_at_start.append(self.auto.hooks_active)

    def batch_end(self, state: Any, logger: Any) -> None:
        total = self.auto.consensus_rounds
        self.rounds.append(total - self._seen)
        self._seen = total


def steady_faults(rank: int, world: int, schedule: str, faults: list[tuple[str, int, int]], stages: int = 2) -> dict[str, Any]:
    """Per fault (site, failing rank, microbatch index): one OOM on one stage in batch 4, after the
    size settled and the sync hooks came off (stable after 2 clean batches); the consensus rounds
    of every batch, the drains, and the parameters against a fixed-size run without the fault."""
    out: dict[str, Any] = {"cases": []}
    reference: Optional[dict[str, Any]] = None
    for site, failing, microbatch in faults:
        auto = AutoMicrobatching(stable_batches=2, log_attempts=False)
        injector = FaultInjector(site, ranks=[failing], batch=4, times=1, microbatch_index=microbatch)
        rounds = RoundsPerBatch(auto)
        counted = MemoryCapCallback(limit_bytes=10**12, retry_band=0.0)  # live tensor bytes, no limit
        result = fit(schedule, "auto", stages=stages, callbacks=[auto, injector, rounds, counted], batches=6, keep_trainer=True)
        runner = result["trainer"].pipeline.pipeline.runner
        if reference is None:
            reference = fit(schedule, result["found"], stages=stages, batches=6)
        out["cases"].append({
            "case": (site, failing, microbatch),
            "history": result["history"],
            "hooks": [r.hooks for r in auto.history],
            "found": result["found"],
            "fired": injector.fired,
            "clean": result["clean"],
            "rounds": rounds.rounds,
            "hooks_at_start": rounds.hooks_at_start,
            "time_steps": runner.stats.time_steps,
            "drains": runner.drains,
            "drained_steps": runner.drained_steps,
            "left_behind": result["left_behind"],
            "diff": max_difference(result["params"], reference["params"]),
        })
        result["trainer"].close()
    return out
