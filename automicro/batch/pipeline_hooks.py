"""What the batch step needs from a pipelined batch (`StagedBatch`: Composer's is
`automicro.composer.pipeline_batch.PipelineBatch`), and the executor's hooks inside an attempt
(`AttemptHooks`): the consensus barrier at every time step, the fault sites, the microbatch index.

Owns: the seam between the attempt fence and a pipeline schedule. May not touch: the schedule and
stages (`automicro.engine.pipeline`), the consensus protocol (only `barrier()`), any training
framework.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch

from automicro.core.consensus import Consensus
from automicro.core.sites import SiteDispatcher
from automicro.engine.pipeline import Action, Pipeline, PipelineHooks


class StagedBatch(Protocol):
    """This rank's stage of a pipeline, running whole batches (the loop's host runs the schedule)."""

    pipeline: Pipeline

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks of each stage."""

    @property
    def stage_index(self) -> int:
        """This rank's stage."""

    def microbatch_sizes(self, batch_size: int) -> tuple[int, ...]:
        """The equal microbatches a batch of `batch_size` samples runs as at a given size."""

    def split(self, batch: Any, sizes: Sequence[int]) -> list[Any]:
        """`batch` cut into microbatches of `sizes` samples."""

    def check_same_samples(self, batch: Any) -> None:
        """Raises where the ranks of one pipeline got different batches."""

    def run(
        self, trainer: Any, microbatches: Sequence[Any], total_loss_dict: dict[str, torch.Tensor],
        end_of_attempt: Callable[[], None], hooks: Optional[PipelineHooks] = None,
    ) -> None:
        """One batch through the schedule, `end_of_attempt()` at the attempt's agreement."""

    def release(self) -> None:
        """After a failed attempt: drop the stage's caches and receive buffers."""


class AttemptHooks:
    """The executor's hooks inside an attempt of the attempt fence. `every_step`: a consensus
    barrier before every time step's exchange (while searching, and always where a stage has
    several data-parallel ranks); otherwise only around the set-up, and a failed rank drains."""

    def __init__(self, consensus: Consensus, dispatcher: SiteDispatcher, stage_index: int, every_step: bool = True) -> None:
        self.consensus = consensus
        self.dispatcher = dispatcher
        self.stage_name = f"stage{stage_index}"
        self.every_step = every_step
        self.drains = not every_step

    def before_action(self, action: Action) -> None:
        context = self.dispatcher.context
        context.microbatch_index = action.microbatch
        if action.kind in ("B", "I"):
            self.dispatcher.fire("backward_input", self.stage_name)
        elif action.kind == "W":
            self.dispatcher.fire("backward_weight", self.stage_name)

    def after_loss(self, microbatch: int) -> None:
        if self.dispatcher.listens("loss"):
            self.dispatcher.fire("loss", self.stage_name)

    def barrier(self) -> None:
        self.consensus.barrier()


__all__ = ["AttemptHooks", "StagedBatch"]
