"""Composer's `Trainer` as the batch step's host (`automicro.batch.batch_host.BatchHost`): its
state's batch, microbatch loop and optimizers, every call through `_composer_internals`.

Owns: Composer's side of the seam between a batch's attempts and the loop. May not touch: the
search, the fence, the sync hooks; Composer privates outside `_composer_internals`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from automicro.batch.splitting import UnsplittableBatch, split_by_sizes
from automicro.composer import _composer_internals as composer_internals


class ComposerHost:
    """Composer's `Trainer` as a `BatchHost` (its state's batch, microbatch loop and optimizers)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.batch = trainer.state.batch
        self.batch_index = int(trainer.state.timestamp.batch)

    def num_samples(self) -> int:
        return composer_internals.num_samples(self.trainer, self.batch)

    def planned_batches(self) -> Optional[int]:
        """The run's batches (``max_duration`` in batches, or in epochs of a dataloader of known length; None
        where Composer cannot tell: tokens, samples, an iterable of unknown length)."""
        from composer.core import TimeUnit

        state = self.trainer.state
        duration = state.max_duration
        if duration is None:
            return None
        if duration.unit == TimeUnit.BATCH:
            return int(duration.value)
        length = state.dataloader_len
        if duration.unit == TimeUnit.EPOCH and length is not None:
            return int(duration.value) * int(length.value if hasattr(length, "value") else length)
        return None

    def split(self, sizes: tuple[int, ...]) -> list[Any]:
        if composer_internals.uses_default_split(self.trainer):
            try:
                return split_by_sizes(self.batch, sizes)
            except UnsplittableBatch:
                pass
        return composer_internals.split_batch_default(self.trainer, self.batch, max(sizes))

    def begin_attempt(self, largest: int) -> dict[str, torch.Tensor]:
        state = self.trainer.state
        state.device_train_microbatch_size = largest
        if state.train_metrics is not None:
            for metric in state.train_metrics.values():
                metric.reset()
        return {"loss/train/total": state.device.tensor_to_device(torch.zeros(size=(1,)))}

    def run_microbatches(
        self, microbatches: Sequence[Any], total_loss_dict: dict[str, torch.Tensor],
        before_microbatch: Callable[[int], None], end_of_attempt: Callable[[], None],
        all_reduce: Callable[[torch.Tensor], None],
    ) -> None:
        composer_internals.run_microbatches(
            self.trainer, microbatches, total_loss_dict, before_microbatch, end_of_attempt, all_reduce
        )

    def swap_model(self, module: Any) -> Any:
        """Run the next microbatches through `module` in the model's place (the unsharded twin,
        `automicro.engine.twin`); returns what it replaced, to swap back."""
        return composer_internals.swap_model(self.trainer, module)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.trainer.state.optimizers or [])

    def step_optimizers(self) -> None:
        composer_internals.step_optimizers(self.trainer)

    def reset_after_failure(self) -> None:
        composer_internals.reset_after_failure(self.trainer, self.batch)

    def checkpoint_folder(self) -> Optional[str]:
        return composer_internals.checkpoint_folder(self.trainer.state)


__all__ = ["ComposerHost"]
