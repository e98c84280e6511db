"""`AutoStep`: automicro's `auto` microbatching for any PyTorch training loop, no Composer.

::

    from torch.distributed.fsdp import fully_shard
    from automicro import AutoStep

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)                      # or automicro.engine.shard(model, FSDP2Config(...))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    with AutoStep(model, optimizer, loss_fn=lambda m, mb: m(**mb).loss) as auto:
        for batch in loader:                # this rank's whole batch, every step
            result = auto.step(batch)       # split, run, agree, retry after an OOM, optimizer.step()
            scheduler.step()
            wandb.log({"loss": result.loss.item(), **auto.metrics()})
            if step % 1000 == 0:
                save({"model": ..., "optim": ..., "auto": auto.state_dict()})

Each `step(batch)` does what a Composer batch under `device_train_microbatch_size: auto` does,
with the same code (`TrainingSearch`, `BatchStep`): the batch is split into microbatches (samples,
or tokens with ``budget="tokens"``), every attempt runs under the attempt fence with the sync hooks
on while searching, every rank agrees on its outcome, a failed attempt is wiped and rerun smaller
on every rank, and the optimizer steps once per batch. Gradients are those of one batch: each
microbatch's loss is weighted by its share of the global batch (its samples; its loss tokens with
``loss_normalization="tokens"``, the default with ``budget="tokens"``), so the parameters equal a
fixed split's. Once the size holds for `stable_batches` batches the hooks come off; an OOM after
that costs one rerun of the batch (the collective ledger), never the run.

The keywords are `AutoMicrobatching`'s (docs/reference/configuration.md), less the eval ones. The loop stays the
user's: the data, the learning-rate schedule, evaluation, logging and checkpoints.

Owns: the lifecycle a plain loop gives the search (open, step, close, checkpoint state, metrics).
May not touch: Composer; the search and the batch's attempts (`TrainingSearch`, `BatchStep`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from automicro.core.ledger import FatalRecoveryError
from automicro.core.memory import MemorySource
from automicro.core.metrics import batch_metrics
from automicro.core.policy import HookReason, Phase
from automicro.core.sites import SiteDispatcher
from automicro.data.varlen import TokenCounter
from automicro.engine import local_step
from automicro.engine.sharding import ShardedModel, adopt, sharded_of
from automicro.batch.head_choice import attach_head
from automicro.batch.layout_trials import LayoutTrials
from automicro.batch.runtime import Runtime
from automicro.batch.settings import Settings
from automicro.batch.torch_host import LossFn, StepInputError, TorchHost, count_samples, default_loss
from automicro.batch.training_search import MicrobatchSizeError, TrainingSearch

# AutoMicrobatching's keywords that mean something to a plain loop (eval_oom: the loop's evaluation is its own).
SETTINGS = (
    "stable_batches", "thrash_batches", "search", "use_prediction", "start_size", "cpu_sync_group", "memory_fraction",
    "log_attempts", "unguarded_timeout_s", "sync_points", "consensus_transport", "steady_recovery", "budget",
    "fixed_tokens", "layout", "layout_trial_batches", "layout_min_gain", "layout_size_trials", "loss_normalization",
    "label_shift", "exit_timeout_s", "rerun_target", "bound_trials", "stall_report_s", "stall_end_s", "signal_exit_s",
    "trials", "head", "offload", "watch_routing",
)


@dataclass(frozen=True)
class StepResult:
    """What one `step` did. `loss`: this rank's weighted loss (detached; its mean over the ranks is the
    global batch's mean loss, as Composer's logged loss is); `split`: the microbatches it trained with (samples each);
    `size`: the size the search has found (None while searching); `attempts`: attempts of this batch
    (1: no OOM); `ooms_total`: OOMs of the run so far; `searching`: still searching; `grad_norm`: the
    gradients' global norm before clipping (with `max_grad_norm`; else None)."""

    loss: torch.Tensor
    split: tuple[int, ...]
    size: Optional[int]
    attempts: int
    ooms_total: int
    searching: bool
    grad_norm: Optional[float] = None


class AutoStep:
    """One OOM-safe, deadlock-free training step with `auto` microbatching, for a plain PyTorch loop.

    Args:
        model: the model, sharded with torch's `fully_shard` (root included; blocks first, as
            torchtitan does) or by `automicro.engine.shard`; or that `ShardedModel`.
        optimizer: an optimizer, or a list of them (each steps once per batch).
        loss_fn: ``(model, microbatch) -> loss``, the microbatch's mean loss (a tensor, or an output
            with ``.loss``); the microbatch is on the model's device. Default: ``model(**microbatch)``
            and its ``.loss`` (Hugging Face models given batch mappings with labels).
        memory: where memory figures come from (default: the CUDA allocator on a GPU, none on CPU;
            `automicro.testing.CapMemory` over a `MemoryCap` to emulate a GPU's limit on CPU).
        max_grad_norm: clip the gradients' global norm (over every rank's shards) to this before each
            optimizer step, as `torch.nn.utils.clip_grad_norm_` does (None: no clipping); the norm
            before clipping is `StepResult.grad_norm`.
        checkpoint_folder: where the failure note of a run that could not recover goes (read back
            on resume to start below the size that failed); None: no note.
        sites: a `SiteDispatcher` shared with fault injectors (tests); a new one if None.
        step_optimizer: False leaves the gradients of the agreed attempt to the caller, who clips,
            steps and zeroes them (a loop that owns its optimizer step: the Hugging Face `Trainer`
            adapter, `automicro.hf`); `max_grad_norm` then must be None. True: each optimizer's
            step runs on the local shards where that gives the same numbers
            (`automicro.engine.local_step`; the model's ``local_optimizer_step`` setting).
        backward: ``backward(loss)`` for each microbatch's weighted loss (default ``loss.backward()``;
            a loop with a grad scaler passes its own, e.g. accelerate's ``accelerator.backward``).
        own_backward: True where `loss_fn` runs the microbatch's backward itself on the microbatch's share
            of the step's loss and returns that share (torchtitan's ``forward_backward_step``: summed over
            the microbatch's tokens, divided by the global batch's valid tokens); AutoStep then neither
            weights nor backwards it, and the loop's own reduction (torchtitan sums gradients over the
            ranks) makes the step's gradients. `backward` must then be None.
        **settings: `AutoMicrobatching`'s keywords (`stable_batches`, `search`, `budget`,
            `start_size`, `layout`, `loss_normalization`, ...).

    Collective: build it on every rank at the same point, call `step` on every rank for every
    batch, and `close()` (or leave the ``with`` block) on every rank.
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, ShardedModel],
        optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
        loss_fn: Optional[LossFn] = None,
        *,
        memory: Optional[MemorySource] = None,
        max_grad_norm: Optional[float] = None,
        checkpoint_folder: Optional[str] = None,
        sites: Optional[SiteDispatcher] = None,
        step_optimizer: bool = True,
        backward: Optional[Callable[[torch.Tensor], None]] = None,
        own_backward: bool = False,
        **settings: Any,
    ) -> None:
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            hint = " (evaluation is the loop's own: AutoStep trains)" if "eval_oom" in unknown else ""
            raise TypeError(f"AutoStep: unknown setting(s) {unknown}{hint}; the settings are {list(SETTINGS)}")
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(f"AutoStep: optimizer={optimizer!r}: must be a torch.optim.Optimizer or a list of them")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not max_grad_norm > 0):
            raise ValueError(f"AutoStep: max_grad_norm={max_grad_norm!r}: must be a number > 0, or None for no clipping")
        if not step_optimizer and max_grad_norm is not None:
            raise ValueError("AutoStep: max_grad_norm clips before AutoStep's optimizer step; with step_optimizer=False "
                             "the caller steps the optimizer and clips (leave max_grad_norm=None)")
        if backward is not None and not callable(backward):
            raise TypeError(f"AutoStep: backward={backward!r}: must be a callable backward(loss), or None for loss.backward()")
        if own_backward and backward is not None:
            raise ValueError("AutoStep: own_backward=True: the loss function runs the backward; leave backward=None")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"AutoStep: loss_fn={loss_fn!r}: must be a callable (model, microbatch) -> loss")
        self.settings = Settings.parse(**settings)
        if isinstance(model, ShardedModel):
            self.sharded = model
        else:
            self.sharded = sharded_of(model) or adopt(model)
        self.model = self.sharded.module
        self.optimizers = optimizers
        self.loss_fn: LossFn = loss_fn or default_loss
        self.checkpoint_folder = checkpoint_folder
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._grad_norm: Optional[float] = None
        self.step_optimizer = bool(step_optimizer)
        if self.step_optimizer:  # AutoStep steps them: on local shards where the numbers are the same
            for one in optimizers:
                local_step.install(one, self.sharded.config.local_optimizer_step)
        self.backward = backward
        self.own_backward = bool(own_backward)
        self.runtime = Runtime(self.settings)
        self.search = TrainingSearch(self.settings, self.runtime)
        rt = self.runtime
        rt.attach(self.sharded, self.search.figures, memory, sites, None)
        self.search.configure(self.sharded.device.type, None)
        # The head before the layout trials: its switch is one of their trades under head: auto.
        attach_head(self.settings, self.sharded, rt.info, allocated=lambda: rt.memory.allocated_bytes())
        self.layout = self.search.layout = LayoutTrials(
            self.settings.layout_config, self.sharded, rt.consensus, rt.info, recoverable=rt.ledger is not None,
            pipeline=False,
        )
        normalization = self.settings.loss_normalization
        normalization.resolved = normalization.per or "samples"
        normalization.shift = normalization.resolve_shift(self.model)
        if normalization.resolved == "tokens":
            tokens = TokenCounter(normalization.shift)
            self._count = lambda microbatch: tokens(microbatch)["loss_generating"]
            rt.info(
                f"loss per loss token over the whole batch (loss_normalization: tokens, label_shift {normalization.shift}): "
                "training does not depend on the split"
            )
        else:
            self._count = count_samples
        self.batches = 0  # the batches trained (restored by `load_state_dict`)
        self._open = False
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> "AutoStep":
        self.open()
        return self

    def __exit__(self, exc_type: Any, error: Optional[BaseException], tb: Any) -> None:
        try:
            if error is not None:
                lost = self.search.lost(error, "between steps", self.batches, self.checkpoint_folder)
                if lost is not None:
                    raise lost from error
        finally:
            self.close()

    def open(self) -> None:
        """Put the collective ledger on FSDP2's collectives and the sync hooks back where the search
        wants them (`step` opens on first use; the ``with`` block opens and closes)."""
        if self._closed:
            raise RuntimeError("AutoStep: closed; build a new one")
        if self._open:
            return
        self._open = True
        if self.search.policy is not None:
            self.search.apply_hooks(self.search.policy.hooks, HookReason.FIT_START)
        self.runtime.observe_collectives(True)

    def close(self) -> None:
        """Take the sync hooks and the ledger off and close the consensus (every rank). The hooks and
        the collective patch are process-wide: close before another AutoStep or Trainer runs."""
        if self._closed:
            return
        self._closed = True
        self.search.apply_hooks(False, HookReason.CLOSED)
        self.runtime.close()
        line = self.search.summary_line()
        if line is not None:
            self.runtime.info(line.removeprefix("[automicro] "))

    # ---- the step ----------------------------------------------------------------------------------

    def step(self, batch: Any) -> StepResult:
        """Train on `batch` (this rank's whole batch): every microbatch's forward and backward, the
        optimizer step once. Retries smaller after an OOM on any rank; raises `MicrobatchSizeError`
        on every rank when even the smallest microbatch does not fit."""
        self.open()
        dispatcher = self.runtime.dispatcher

        def after_loss() -> None:
            if dispatcher.listens("loss"):
                dispatcher.fire("loss", "")

        self._grad_norm = None
        host = TorchHost(
            self.model, self.optimizers, self.loss_fn, batch, self.batches, self.sharded.device, self._count,
            after_loss, self.checkpoint_folder, before_step=None if self.max_grad_norm is None else self._clip,
            step_optimizer=self.step_optimizer, backward=self.backward, own_backward=self.own_backward,
        )
        if host.flattened and self.settings.kind.tokens is not None:
            raise StepInputError(
                "AutoStep: a flattened batch (one row, position_ids restarting per sample) takes budget='samples': "
                "its microbatches are cut at sample starts and carry no padding; budget='tokens' plans padded rows "
                "(use a padding collator for it)"
            )
        # The watchdog watches the step (`core.watchdog`), not the loop's own code between steps.
        watchdog = self.runtime.watchdog
        if watchdog is not None:
            watchdog.arm()
        try:
            total = self.search.train_batch(host)
        finally:
            if watchdog is not None:
                watchdog.disarm()
        self.batches += 1
        policy = self.search.policy
        assert policy is not None
        return StepResult(
            loss=total["loss/train/total"].detach().reshape(()),
            split=self.search.used_split,
            size=policy.found_size,
            attempts=self.search.batch_attempts,
            ooms_total=self.search.ooms_total,
            searching=policy.phase == Phase.SEARCHING,
            grad_norm=self._grad_norm,
        )

    def _clip(self) -> None:
        assert self.max_grad_norm is not None
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.grad is not None], self.max_grad_norm, foreach=True
        )
        # The norm of FSDP2's DTensor gradients is a DTensor: its value is the global norm.
        self._grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # ---- what a logger and a checkpoint take ---------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """The `automicro/*` figures of the last batch (docs/guides/dashboards.md), for any logger;
        empty before the first step."""
        figures = self.search.batch_figures()
        if figures is None:
            return {}
        return {**batch_metrics(figures, self.search.history), **self.layout.metrics(), **self.search.trial_metrics()}

    @property
    def found_size(self) -> Optional[int]:
        return None if self.search.policy is None else self.search.policy.found_size

    @property
    def history(self) -> list[Any]:
        """Every attempt that failed or changed the size (`AttemptRecord`s)."""
        return self.search.history

    @property
    def hooks_active(self) -> bool:
        return self.runtime.hooks_active

    @property
    def sites(self) -> SiteDispatcher:
        return self.runtime.dispatcher

    def state_dict(self) -> dict[str, Any]:
        """The search's state (plain Python values: `torch.save` or DCP carries it as it is)."""
        return {"search": self.search.state_dict(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before the first `step` after a resume: the search resumes at its split with the sync
        hooks on until the size is stable again."""
        if not isinstance(state, dict) or "search" not in state:
            raise ValueError("AutoStep.load_state_dict: expected what AutoStep.state_dict() returned")
        if self.search.policy is not None:
            raise RuntimeError("AutoStep.load_state_dict: call it before the first step")
        self.search.load_state_dict(state["search"])
        self.batches = int(state.get("batches", 0))


__all__ = ["AutoStep", "FatalRecoveryError", "MicrobatchSizeError", "StepInputError", "StepResult"]
