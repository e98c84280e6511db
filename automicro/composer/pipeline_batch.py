"""Composer batches through a pipeline: `automicro.engine.pipeline` under `automicro.Trainer`.

With ``parallelism_config: {pipeline: {stages: S, schedule: ...}, fsdp2: {...}}`` the Trainer
keeps this rank's stage of the model (`engine.pipeline.build_pipeline`) and runs every batch here
instead of Composer's microbatch loop: the batch is split into equal microbatches, the schedule
runs them across the stages, and the loss every rank logs is the last stage's, averaged over the
pipelines.

Under auto microbatching (`AutoMicrobatching`) each batch is one attempt of the attempt fence and
`automicro.batch.pipeline_hooks.AttemptHooks` connects the executor to the protocol: a consensus barrier at every time step
before the step's sends and receives while the sync hooks are on (after the size settled, with one
data-parallel rank per stage, only around the batch's set-up: a failed stage drains, see
`automicro.engine.pipeline`), the `backward_input` / `backward_weight` sites before each dI / dW,
`loss` after each microbatch's loss, and the attempt context's microbatch index.

Train metrics (`get_metrics(is_train=True)`) live on the stage's device on every rank and are
updated on the last stage, where the outputs are, from each microbatch's outputs. Composer's
`metric.compute()` then syncs them over every rank: the other stages hold their metric's empty
(zero) state, so a sum over all ranks is the sum over the last stages, and every rank logs the
same, whole-batch value. That needs every metric state reduced by sum (true of Composer's and
torchmetrics' counting metrics); any other reduction is refused with what to change.

Owns: the Composer side of a pipelined batch (splitting, the loss and train metrics to log, the
same-samples check).
May not touch: the schedule and stages (the engine), the consensus protocol (only `barrier()`),
Composer privates outside `_composer_internals`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from automicro.batch.splitting import split_by_sizes
from automicro.composer import _composer_internals as composer_internals
from automicro.engine.pipeline import NoHooks, Pipeline, PipelineHooks


class SamplesDifferError(RuntimeError):
    """The ranks of one pipeline got different batches."""


class PipelineMetricError(ValueError):
    """A train metric a pipeline cannot sync over its stages."""


class StageMetrics:
    """The train metrics of one stage: on the stage's device, updated on the last stage only."""

    def __init__(self, composer_model: Any, last_stage: bool) -> None:
        self.model = composer_model
        self.last_stage = last_stage
        self._checked = False
        if not last_stage:
            # By design a stage without outputs never updates its metrics (their zero state is its
            # share of the sum); torchmetrics warns about that on every batch. Pipelines do not
            # evaluate, so on these ranks the warning can only ever be this one.
            warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric .* before the ``update``")

    def prepare(self, state: Any) -> dict[str, Any]:
        """Before a batch (or a retry): the metrics moved to the stage's device and reset."""
        metrics = state.train_metrics or {}
        if not self._checked:
            self._checked = True
            _check_sum_reduced(metrics)
        for name, metric in metrics.items():
            metrics[name] = state.device.module_to_device(metric)
            metric.reset()
        return metrics

    def update(self, metrics: dict[str, Any], outputs: Any, microbatch: Any) -> None:
        """On the last stage, after a microbatch's loss: as Composer's `_eval_train_metrics` does."""
        if not metrics or not self.last_stage:
            return
        with torch.no_grad():
            detached = outputs.detach() if isinstance(outputs, torch.Tensor) else outputs
            eval_outputs = self.model.eval_forward(microbatch, detached)
            for metric in metrics.values():
                self.model.update_metric(microbatch, eval_outputs, metric)


def _check_sum_reduced(metrics: dict[str, Any]) -> None:
    from torchmetrics.utilities.data import dim_zero_sum

    for name, metric in metrics.items():
        reductions = getattr(metric, "_reductions", {})
        other = sorted(state for state, fx in reductions.items() if fx is not dim_zero_sum)
        if other:
            raise PipelineMetricError(
                f"automicro: train metric {name!r} ({type(metric).__name__}) has state(s) {other} not reduced by "
                "sum; a pipeline syncs train metrics over every stage and only the last stage has outputs, so "
                "only sum-reduced states give the right value. Return a sum-reduced metric, or none, from "
                "get_metrics(is_train=True) for pipeline training"
            )


class PipelineBatch:
    """Runs Composer batches through this rank's pipeline stage."""

    def __init__(self, pipeline: Pipeline, composer_model: Any) -> None:
        self.pipeline = pipeline
        self.model = composer_model
        self._checked = False
        layout = pipeline.layout
        self.metrics = StageMetrics(composer_model, last_stage=layout.stage_index == layout.num_stages - 1)

    @property
    def dp_size(self) -> int:
        return self.pipeline.layout.dp_size

    @property
    def stage_index(self) -> int:
        return self.pipeline.layout.stage_index

    def microbatch_sizes(self, batch_size: int) -> tuple[int, ...]:
        return self.pipeline.runner.microbatch_sizes(batch_size)

    def check_fixed_size(self, batch_size: int, microbatch_size: int) -> None:
        sizes = self.microbatch_sizes(batch_size)
        if microbatch_size not in sizes:
            raise ValueError(
                f"device_train_microbatch_size={microbatch_size}: a pipeline runs equal microbatches, at least "
                f"{self.pipeline.layout.num_stages} per batch ({self.pipeline.config.schedule}); with {batch_size} "
                f"samples per pipeline the sizes that can run are {list(sizes)} (or use 'auto')"
            )

    def split(self, batch: Any, sizes: Sequence[int]) -> list[Any]:
        return split_by_sizes(batch, tuple(sizes))

    def check_same_samples(self, batch: Any) -> None:
        """Once: every rank of a pipeline must hold the same batch (the first stage's inputs are
        the last stage's labels). A sampler over the world instead of over the data-parallel
        copies breaks that silently; this stops it at the first batch."""
        if self._checked:
            return
        self._checked = True
        inputs = self.model.pipeline_inputs(batch)
        fingerprint = torch.tensor(
            [float(t.double().sum()) + float(t.numel()) for t in inputs],
            dtype=torch.float64,
            device=self.pipeline.sharded.device,
        )
        low, high = fingerprint.clone(), fingerprint.clone()
        group = self.pipeline.layout.pp_group
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(low, high):
            raise SamplesDifferError(
                "automicro: the ranks of one pipeline got different batches; shard the train dataloader over the "
                "data-parallel copies, not the world: DistributedSampler(num_replicas=world/stages, rank=rank % "
                "(world/stages)) (automicro.data.build_dataloader(..., replicas=(dp, rank % dp)))"
            )

    def run(
        self,
        trainer: Any,
        microbatches: Sequence[Any],
        total_loss_dict: dict[str, torch.Tensor],
        end_of_attempt: Callable[[], None],
        hooks: Optional[PipelineHooks] = None,
    ) -> None:
        """One batch: Composer's batch events, the schedule, `end_of_attempt()` (the attempt's
        agreement) and then the loss to log, summed over the last stages and averaged over the
        pipelines (a collective every rank reaches only after the agreement)."""
        state = trainer.state
        batch_size = sum(composer_internals.num_samples(trainer, mb) for mb in microbatches)
        total: list[Optional[torch.Tensor]] = [None]
        metrics = self.metrics.prepare(state)

        def run_schedule() -> None:
            def loss_fn(outputs: Any, microbatch: Any) -> torch.Tensor:
                share = composer_internals.num_samples(trainer, microbatch) / batch_size
                loss = self.model.loss(outputs, microbatch) * share
                self.metrics.update(metrics, outputs, microbatch)
                return loss

            device_mbs = [state.device.batch_to_device(mb) for mb in microbatches]
            total[0] = self.pipeline.runner.run(device_mbs, self.model.pipeline_inputs, loss_fn, hooks or NoHooks())

        def after_agreement() -> None:
            end_of_attempt()
            loss = torch.zeros(1, dtype=torch.float32, device=self.pipeline.sharded.device)
            if total[0] is not None:
                loss += total[0].float()
            composer_internals.all_reduce_sum(loss)
            total_loss_dict["loss/train/total"] = loss / self.dp_size

        composer_internals.run_pipeline_batch(trainer, run_schedule, after_agreement)

    def release(self) -> None:
        """After a failed attempt: drop the stage's caches and receive buffers."""
        self.pipeline.runner.release()


__all__ = ["PipelineBatch", "PipelineMetricError", "SamplesDifferError", "StageMetrics"]
