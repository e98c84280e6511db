"""What one batch's attempts need from the loop that owns the batch (`BatchHost`).

`BatchStep` splits, runs, wipes and steps through a host, never through a trainer: the search,
the fence, the consensus and the wipe are the same whoever owns the loop. The hosts: a plain
PyTorch loop's (`automicro.batch.torch_host`, under `AutoStep` and the HF Trainer and Lightning
adapters) and Composer's (`automicro.composer.composer_host`).

Owns: the seam between a batch's attempts and the training loop. May not touch: the search policy,
the fence, the sync hooks (`BatchStep` and the search use them); any training framework.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch


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


__all__ = ["BatchHost"]
