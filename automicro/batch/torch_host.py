"""A plain PyTorch loop as a `BatchHost`: the batch `automicro.AutoStep.step` was given, its split,
the microbatch loop (the user's loss function, backward, gradient accumulation weighted as one
batch), the optimizer step and the reset after a failed attempt.

The weighting is Composer's: every rank's microbatch loss (a mean over its samples, or over its
loss tokens with ``loss_normalization: tokens``) is scaled by its share of the global batch, after
one all-reduce of the batch's count; FSDP2 then averages gradients over the ranks, so the step sees
the mean over every sample (or loss token) of the global batch, whatever the split.

Owns: the microbatch loop of a plain loop. May not touch: the search, the fence, the sync hooks
(`BatchStep` and `TrainingSearch` run those around it); Composer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from automicro.batch import flattened
from automicro.batch.splitting import UnsplittableBatch, split_by_sizes

LossFn = Callable[[torch.nn.Module, Any], Any]


class StepInputError(ValueError):
    """A batch or a loss `AutoStep` cannot work with (the message says what to change)."""


def default_loss(model: torch.nn.Module, microbatch: Any) -> Any:
    """`model(**microbatch).loss`: a Hugging Face model given its batch mapping (labels included)."""
    if not isinstance(microbatch, Mapping):
        raise StepInputError(
            f"AutoStep: the batch is a {type(microbatch).__name__}, not a mapping; pass loss_fn=(model, microbatch) -> "
            "loss (the default calls model(**microbatch).loss, for Hugging Face models)"
        )
    return model(**microbatch)


def loss_tensor(output: Any) -> torch.Tensor:
    """The scalar loss of what a loss function returned: a tensor, or an output with `.loss` or ["loss"]."""
    loss = output
    if not isinstance(loss, torch.Tensor):
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise StepInputError(
            f"AutoStep: the loss function returned {type(output).__name__}"
            + ("" if not isinstance(loss, torch.Tensor) else f" with a loss of shape {tuple(loss.shape)}")
            + "; it must return the microbatch's mean loss as a one-element tensor (or an output with .loss)"
        )
    return loss.reshape(())


def count_samples(batch: Any) -> int:
    """The samples of a batch: the first dimension of its first tensor (or length of its first list);
    of a flattened batch (one row, `position_ids` restarting per sample), its samples in the row."""
    found = flattened.restarts(batch)
    if found is not None:
        return flattened.count(batch, found)
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = list(batch.values()) if isinstance(batch, Mapping) else list(batch) if isinstance(batch, (list, tuple)) else []
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    for value in values:
        if isinstance(value, (list, tuple)) and not isinstance(batch, (list, tuple)):
            return len(value)
        if isinstance(value, (Mapping, list, tuple)):
            return count_samples(value)
    raise StepInputError(
        f"AutoStep: cannot count the samples of a batch of type {type(batch).__name__}; pass a tensor, a mapping of "
        "tensors, or a tuple/list of them with the samples on the first dimension"
    )


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class TorchHost:
    """One batch of a plain loop. `count`: what a microbatch's loss is a mean over (samples, or loss
    tokens), the weight it gets; `after_loss`: called after each microbatch's loss (the `loss` site);
    `step_optimizer` False: the optimizer step is the caller's (`step_optimizers` does nothing);
    `backward`: how a weighted loss goes backward (default ``loss.backward()``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        loss_fn: LossFn,
        batch: Any,
        batch_index: int,
        device: torch.device,
        count: Callable[[Any], int],
        after_loss: Callable[[], None],
        folder: Optional[str] = None,
        before_step: Optional[Callable[[], None]] = None,
        step_optimizer: bool = True,
        backward: Optional[Callable[[torch.Tensor], None]] = None,
        own_backward: bool = False,
    ) -> None:
        self.model, self._optimizers, self.loss_fn = model, list(optimizers), loss_fn
        self.batch, self.batch_index = batch, batch_index
        self.device, self.count, self.after_loss, self.folder = device, count, after_loss, folder
        self.before_step = before_step
        self.step_optimizer = step_optimizer
        self.backward = backward
        self.own_backward = own_backward
        # Once a batch: it reads position_ids (a sync on a GPU); None where the batch is not flattened.
        self._restarts = flattened.restarts(batch)
        self.flattened = self._restarts is not None

    def num_samples(self) -> int:
        return flattened.count(self.batch, self._restarts) if self.flattened else count_samples(self.batch)

    def split(self, sizes: tuple[int, ...]) -> list[Any]:
        if self.flattened:
            try:
                return flattened.split(self.batch, sizes, self._restarts)
            except flattened.FlattenedBatchError as error:
                raise StepInputError(str(error)) from error
        try:
            return split_by_sizes(self.batch, sizes)
        except UnsplittableBatch as error:
            raise StepInputError(
                f"AutoStep: {error}; give step() a tensor, a mapping of tensors (or lists), or a tuple/list of them, "
                "with the samples on the first dimension"
            ) from error

    def begin_attempt(self, largest: int) -> dict[str, torch.Tensor]:
        return {"loss/train/total": torch.zeros(1, device=self.device)}

    def run_microbatches(
        self, microbatches: Sequence[Any], total_loss_dict: dict[str, torch.Tensor],
        before_microbatch: Callable[[int], None], end_of_attempt: Callable[[], None],
        all_reduce: Callable[[torch.Tensor], None],
    ) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.own_backward:
            self._run_own_backward(microbatches, total_loss_dict, before_microbatch)
            end_of_attempt()
            return
        counts = [self.count(mb) for mb in microbatches]
        total = torch.tensor([float(sum(counts))], dtype=torch.float64, device=self.device)
        all_reduce(total)
        world = dist.get_world_size() if dist.is_initialized() else 1
        per_rank = float(total.item()) / world
        if per_rank <= 0:
            raise StepInputError("AutoStep: the batch has nothing to learn from on any rank (no samples, or no loss tokens)")
        loss_sum = total_loss_dict["loss/train/total"]
        for index, (microbatch, count) in enumerate(zip(microbatches, counts)):
            before_microbatch(index)
            loss = loss_tensor(self.loss_fn(self.model, to_device(microbatch, self.device)))
            self.after_loss()
            # This rank's share of the global batch's mean: FSDP2 averages the gradients over ranks.
            scaled = loss * (count / per_rank)
            if self.backward is None:
                scaled.backward()
            else:
                self.backward(scaled)
            loss_sum += scaled.detach().float()
            del loss, scaled
        end_of_attempt()

    def _run_own_backward(
        self, microbatches: Sequence[Any], total_loss_dict: dict[str, torch.Tensor], before_microbatch: Callable[[int], None],
    ) -> None:
        """The loss function runs each microbatch's forward and backward itself, on the microbatch's
        share of the step's loss (torchtitan: its summed loss over the global batch's valid tokens),
        and returns that share: nothing to weigh or to backward here."""
        loss_sum = total_loss_dict["loss/train/total"]
        for index, microbatch in enumerate(microbatches):
            before_microbatch(index)
            share = loss_tensor(self.loss_fn(self.model, to_device(microbatch, self.device)))
            self.after_loss()
            loss_sum += share.detach().float()
            del share

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._optimizers)

    def step_optimizers(self) -> None:
        if not self.step_optimizer:
            return  # the caller clips and steps the gradients the agreed attempt left
        if self.before_step is not None:
            self.before_step()  # gradient clipping: every rank agreed the batch ran, so every rank comes here
        for optimizer in self._optimizers:
            optimizer.step()

    def reset_after_failure(self) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)

    def checkpoint_folder(self) -> Optional[str]:
        return self.folder


__all__ = ["StepInputError", "TorchHost", "count_samples", "default_loss", "loss_tensor"]
