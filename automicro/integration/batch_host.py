"""What one batch's attempts need from the loop that owns the batch (`BatchHost`), and Composer's
answer to it (`ComposerHost`).

`BatchStep` splits, runs, wipes and steps through a host, never through a trainer: the search,
the fence, the consensus and the wipe are the same whoever owns the loop (docs/autostep-plan.md:
a plain PyTorch loop's host is the next one). Composer's host makes every call through
`_composer_internals`, as `BatchStep` did before.

Owns: the seam between a batch's attempts and the training loop. May not touch: the search policy,
the fence, the sync hooks (`BatchStep` and the search use them); Composer privates outside
`_composer_internals`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch

from automicro.integration import _composer_internals as composer_internals
from automicro.integration.splitting import UnsplittableBatch, split_by_sizes


class BatchHost(Protocol):
    """One batch of the loop that owns it. `batch`: the whole batch of this rank, as it came;
    `batch_index`: the batches trained before it (what failure notes and attempt records name)."""

    batch: Any
    batch_index: int

    def num_samples(self) -> int:
        """The samples of `batch` (what a sample-count split divides)."""

    def split(self, sizes: tuple[int, ...]) -> list[Any]:
        """`batch` cut into microbatches of `sizes` samples, in order."""

    def begin_attempt(self, largest: int) -> dict[str, torch.Tensor]:
        """Before an attempt whose largest microbatch holds `largest` (samples or tokens): reset what
        an earlier attempt accumulated outside the model (metrics); the attempt's loss dict."""

    def run_microbatches(
        self, microbatches: Sequence[Any], total_loss_dict: dict[str, torch.Tensor],
        before_microbatch: Callable[[int], None], end_of_attempt: Callable[[], None],
        all_reduce: Callable[[torch.Tensor], None],
    ) -> None:
        """Forward and backward of every microbatch, gradients accumulated as the whole batch's;
        `before_microbatch(i)` before each, `end_of_attempt()` after the last backward;
        `all_reduce(t)` sums over every rank (the only collective the host may issue itself)."""

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers the step steps (the search projects the state their first step adds)."""

    def step_optimizers(self) -> None:
        """The optimizer step (every rank agreed the attempt succeeded)."""

    def reset_after_failure(self) -> None:
        """Drop what a failed attempt left in the loop's own state (outputs, loss, gradients, the
        grad scaler); the model's sharding state is the engine's to recover."""

    def checkpoint_folder(self) -> Optional[str]:
        """Where a failure note goes (None: nowhere)."""


class ComposerHost:
    """Composer's `Trainer` as a `BatchHost` (its state's batch, microbatch loop and optimizers)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.batch = trainer.state.batch
        self.batch_index = int(trainer.state.timestamp.batch)

    def num_samples(self) -> int:
        return composer_internals.num_samples(self.trainer, self.batch)

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

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.trainer.state.optimizers or [])

    def step_optimizers(self) -> None:
        composer_internals.step_optimizers(self.trainer)

    def reset_after_failure(self) -> None:
        composer_internals.reset_after_failure(self.trainer, self.batch)

    def checkpoint_folder(self) -> Optional[str]:
        return composer_internals.checkpoint_folder(self.trainer.state)


__all__ = ["BatchHost", "ComposerHost"]
