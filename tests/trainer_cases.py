"""Eval-time auto microbatching on 2 ranks: one rank runs out of memory in an eval forward."""

from __future__ import annotations

import traceback
from typing import Any, Optional

import torch
from composer.algorithms import GradientClipping
from composer.core import Evaluator

import automicro
from automicro.data import SyntheticTokens, build_dataloader
from automicro.composer.callback import AutoMicrobatching
from automicro.models import build_model
from automicro.testing.faults import FaultInjector

PER_RANK_BATCH = 8
SEQ = 16
CLIP = 0.05  # gradient clipping threshold of the parity run: well below the tiny model's gradient norm


class _MetricOOM:
    """`model.update_metric` that runs out of memory over more than `above` samples on `ranks`
    (a vocabulary-wide softmax the forward fit), as the guard around it sees it."""

    def __init__(self, update_metric: Any, ranks: list[int], above: int) -> None:
        self.update_metric, self.ranks, self.above, self.fired = update_metric, ranks, above, 0
        self.armed: Any = lambda: True

    def __call__(self, batch: Any, outputs: Any, metric: Any) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.armed() and rank in self.ranks and batch["input_ids"].shape[0] > self.above:
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory. (test: eval metric update)")
        return self.update_metric(batch, outputs, metric)


def _eval_run(
    eval_microbatch: Any,
    injector: Optional[FaultInjector],
    eval_samples: int = 32,
    eval_oom: str = "split",
    metric_oom: Optional[tuple[list[int], int]] = None,
    counted: bool = False,
) -> dict[str, Any]:
    """`counted`: under a memory cap with no limit (live tensor bytes counted), so that what each
    failed attempt left allocated after its wipe is measured (`left_behind`)."""
    from automicro.testing import MemoryCapCallback

    torch.manual_seed(0)
    model = build_model("tiny", max_seq_len=SEQ)
    metric_fault = None
    if metric_oom is not None:
        metric_fault = model.update_metric = _MetricOOM(model.update_metric, *metric_oom)
    train = build_dataloader(SyntheticTokens(64, SEQ, 256, seed=1), PER_RANK_BATCH, shuffle=False)
    evaluator = Evaluator(
        label="eval",
        dataloader=build_dataloader(SyntheticTokens(eval_samples, SEQ, 256, seed=2), PER_RANK_BATCH, shuffle=False),
        device_eval_microbatch_size=eval_microbatch,
    )
    auto = AutoMicrobatching(log_attempts=False, eval_oom=eval_oom)
    if metric_fault is not None:
        metric_fault.armed = lambda: auto._eval.running  # eval only (training metrics run in the fence)
    callbacks = [auto] + ([injector] if injector is not None else [])
    if counted:
        callbacks.append(MemoryCapCallback(limit_bytes=10**12, retry_band=0.0))
    trainer = automicro.Trainer(
        model=model,
        train_dataloader=train,
        eval_dataloader=evaluator,
        eval_interval="2ba",
        max_duration="2ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu",
        parallelism_config={"fsdp2": {}},
        device_train_microbatch_size="auto",
        callbacks=callbacks,
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=17,
    )
    try:
        trainer.fit()
        metric = trainer.state.eval_metrics["eval"]["LanguageCrossEntropy"]
        return {
            "eval_loss": float(metric.compute()),
            "eval_microbatch": evaluator.device_eval_microbatch_size,
            "fired": None if injector is None else injector.fired,
            "ooms_total": auto.ooms_total,
            "clean_blocks": all(r["state"] == "IDLE" for r in trainer.sharded_model.states()),
            "eval_found": auto.eval_found_sizes.get("eval"),
            "eval_attempts": [
                (r.size, r.outcome) for r in (auto.eval_searches["eval"].history if "eval" in auto.eval_searches else [])
            ],
            "metric_fired": None if metric_fault is None else metric_fault.fired,
            "metric_pieces": auto._eval.metric_pieces,
            "searched": sorted(auto.eval_searches),
            "left_behind": auto.left_behind_bytes,
            "left_behind_exact": auto.left_behind_exact,
            "left_behind_checked": auto.left_behind_checked,
        }
    finally:
        trainer.close()


def _model_freed(release: bool) -> bool:
    """Whether a fitted trainer's model is garbage once the trainer is closed (`release=False`:
    `close()` alone) or released, and no name refers to either."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = build_model("tiny", max_seq_len=SEQ)
    trainer = automicro.Trainer(
        model=model,
        train_dataloader=build_dataloader(SyntheticTokens(32, SEQ, 256, seed=1), PER_RANK_BATCH, shuffle=False),
        max_duration="1ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu",
        parallelism_config={"fsdp2": {}},
        device_train_microbatch_size="auto",
        callbacks=[AutoMicrobatching(log_attempts=False)],
        loggers=[],
        progress_bar=False,
        log_to_console=False,
        seed=17,
    )
    trainer.fit()
    alive = weakref.ref(model)
    del model
    if release:
        trainer.release()
    else:
        trainer.close()
    del trainer
    gc.collect()
    return alive() is None


def run_eval_cases(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, microbatch, injector, samples in (
        ("fixed_4", 4, None, 32),
        ("auto_rank1_ooms_above_4", "auto", FaultInjector("eval_forward", ranks=[1], above=4), 32),
        # Inside the model, after a block's forward (training's search runs into it too).
        ("auto_rank1_ooms_in_forward_above_4", "auto", FaultInjector("forward", ranks=[1], above=4), 32),
        ("auto_every_rank_ooms_above_2", "auto", FaultInjector("eval_forward", above=2), 32),
        # 4 eval batches per rank: enough for the bisect to climb back up to 6 (halving stops at 4).
        ("fixed_4_long", 4, None, 64),
        ("auto_rank0_ooms_above_6_long", "auto", FaultInjector("eval_forward", ranks=[0], above=6), 64),
        # A pinned evaluator (llm-foundry's default) under a training `auto`: split after an OOM.
        ("pinned_8_rank1_ooms_above_4", 8, FaultInjector("eval_forward", ranks=[1], above=4), 32),
        ("pinned_3", 3, FaultInjector("eval_forward", ranks=[0], above=4), 32),
    ):
        try:
            results[name] = _eval_run(microbatch, injector, samples, counted=injector is not None)
        except Exception:  # noqa: BLE001 - the test reports which case broke
            results[name] = {"crash": traceback.format_exc()}
    for name, kwargs in (
        ("pinned_8_stop", {"eval_oom": "stop"}),
        ("pinned_8_metric_ooms_above_2_on_rank0", {"metric_oom": ([0], 2)}),
    ):
        try:
            results[name] = _eval_run(8, None, 32, **kwargs)
        except Exception:  # noqa: BLE001 - the test reports which case broke
            results[name] = {"crash": traceback.format_exc()}
    try:  # close() alone first: release() then drops that trainer's exit-time reference too
        results["freed"] = {"closed": _model_freed(False), "released": _model_freed(True)}
    except Exception:  # noqa: BLE001
        results["freed"] = {"crash": traceback.format_exc()}
    return results


def run_parity(rank: int, world: int) -> dict[str, Any]:
    """automicro.Trainer on `world` ranks vs a plain single-process loop over the same global
    batches: tiny Llama with training metrics on (Composer then calls eval_forward after every
    backward), fixed microbatch 4 and auto, 3 AdamW steps."""
    from automicro.data.datasets import SyntheticTokens as Tokens

    from tests.toy_models import full_state

    steps, per_rank = 3, PER_RANK_BATCH
    dataset = Tokens(per_rank * world * steps, SEQ, 256, seed=5)

    def reference_run(clip: Optional[float]) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        reference = build_model("tiny", max_seq_len=SEQ)
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        for step in range(steps):
            # DistributedSampler without shuffle deals sample i to rank i % world.
            idx = range(step * per_rank * world, (step + 1) * per_rank * world)
            batch = {k: torch.stack([dataset[i][k] for i in idx]) for k in ("input_ids", "labels")}
            opt.zero_grad(set_to_none=True)
            reference.loss(reference(batch), batch).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            opt.step()
        return {k: v.detach().clone() for k, v in reference.state_dict().items()}

    expected = reference_run(None)
    clipped = reference_run(CLIP)
    results: dict[str, Any] = {"clipping_mattered": max(float((clipped[k] - expected[k]).abs().max()) for k in expected)}
    for name, microbatch in (("fixed_4", 4), ("auto", "auto"), ("auto_clipped", "auto")):
        # auto_clipped: Composer's GradientClipping algorithm (llm-foundry's `algorithms:
        # gradient_clipping`) over the engine's sharded gradients: the global norm, as one process.
        algorithms = [GradientClipping(clipping_type="norm", clipping_threshold=CLIP)] if name == "auto_clipped" else []
        target = clipped if name == "auto_clipped" else expected
        torch.manual_seed(0)
        model = build_model("tiny", max_seq_len=SEQ)
        trainer = automicro.Trainer(
            model=model,
            train_dataloader=build_dataloader(dataset, per_rank, shuffle=False),
            max_duration=f"{steps}ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
            device="cpu",
            parallelism_config={"fsdp2": {}},
            device_train_microbatch_size=microbatch,
            algorithms=algorithms,
            loggers=[],
            progress_bar=False,
            log_to_console=False,
            seed=17,
        )
        try:
            trainer.fit()
            got = full_state(model)
            results[name] = max(float((got[k] - target[k]).abs().max()) for k in target)
        except Exception:  # noqa: BLE001
            results[name] = {"crash": traceback.format_exc()}
        finally:
            trainer.close()
    return results
