"""One batch's attempts on this rank: split -> run -> wipe, and the optimizer step once agreed.

`AutoMicrobatching.train_batch` dispatches: it asks the search policy what to try, hands the
split (sample counts) or the token budget to `BatchStep.attempt`, and turns the agreed verdict
into the policy's next decision. Everything one attempt does to Composer's state lives here, in
order: the split (Composer's or ours, by samples, by token budget, or a pipeline's), the attempt
context, the layout's per-microbatch switch (`automicro.engine.layout`), the attempt fence around the host's microbatch loop (or the pipeline schedule), the wipe
of a failed attempt (the model's buffers it wrote included: `automicro.batch.forward_state`), the failure note when the job is lost, and the optimizer step. What the loop
that owns the batch does (its split, microbatch loop, optimizer step, reset) is asked of its host
(`batch_host`: Composer's trainer today); a pipeline's schedule runs on Composer's host only.

Owns: one batch's attempts (split, run, wipe, step). May not touch: the search policy, the sync
hooks, the attempt records (the callback's); torch or Composer privates outside the two
`_internals` modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from automicro.core import failure_note
from automicro.core.attempt import AttemptFence, AttemptResult, RandomState
from automicro.core.consensus import Consensus
from automicro.core.ledger import FatalRecoveryError
from automicro.core.memory import MemorySource, MicrobatchPeaks, left_after_wipe, mark_attempt, release_after_failure
from automicro.core.sites import SiteDispatcher
from automicro.engine.layout import LayoutEngine
from automicro.engine.sharding import ShardedModel
from automicro.engine.twin import UnshardedTwin
from automicro.batch.batch_host import BatchHost
from automicro.batch.forward_state import ForwardState
from automicro.batch.pipeline_hooks import AttemptHooks, StagedBatch
from automicro.batch.token_budget import TokenBudget


@dataclass
class Attempt:
    """One attempt as this rank ran it: its split (samples per microbatch), the fence's result,
    and the host's loss dict (meaningful only when the verdict is a success)."""

    sizes: tuple[int, ...]
    result: AttemptResult
    total_loss_dict: dict[str, torch.Tensor]


class BatchStep:
    """The attempts of one batch (`begin`, then `attempt` until the callback is done with it)."""

    def __init__(
        self,
        host: BatchHost,
        fence: AttemptFence,
        dispatcher: SiteDispatcher,
        memory: MemorySource,
        consensus: Consensus,
        sharded: ShardedModel,
        rank: int,
        all_reduce: Callable[[torch.Tensor], None],
        pipeline: Optional[StagedBatch] = None,
        tokens: Optional[TokenBudget] = None,
        layout: Optional[LayoutEngine] = None,
        forward_state: Optional[ForwardState] = None,
    ) -> None:
        self.host = host
        self.forward_state = forward_state  # the model's buffers a failed attempt wrote, undone in the wipe
        self.fence, self.dispatcher, self.memory = fence, dispatcher, memory
        self.consensus, self.sharded, self.rank = consensus, sharded, rank
        self.pipeline, self.tokens, self.layout = pipeline, tokens, layout
        self.all_reduce = all_reduce
        self.batch = host.batch
        self.batch_index = host.batch_index
        self.attempts = 0
        self.retries_before = 0  # the allocator's retry count when this attempt began
        self._lengths: list[int] = []
        self._random_state: Optional[RandomState] = None
        self.peaks: Optional[MicrobatchPeaks] = None  # per-microbatch peaks of the attempt, if asked
        # (allocated before the last attempt, allocated after its wipe) where it failed, else None.
        self.left_behind: Optional[tuple[int, int]] = None
        # The model's unsharded twin where the next attempt runs through it (`sharding_choice`), else None.
        self.twin: Optional[UnshardedTwin] = None

    def begin(self) -> int:
        """What the policy sizes this batch by: its samples, or (budget="tokens") the largest batch
        of any rank in padded tokens (a collective round then). Checks a pipeline's samples once."""
        if self.tokens is not None:
            self._lengths, size = self.tokens.agree_domain(self.consensus, self.batch)
        else:
            size = self.host.num_samples()
        if self.pipeline is not None:
            self.pipeline.check_same_samples(self.batch)
        self._random_state = RandomState.capture(self.sharded.device)
        if self.forward_state is not None:
            self.forward_state.begin_batch()
        return size

    # ---- split ---------------------------------------------------------------------------------

    def _split(self, sizes: tuple[int, ...]) -> list[Any]:
        if self.pipeline is not None:
            return self.pipeline.split(self.batch, sizes)
        return self.host.split(sizes)

    def _microbatches(self, split: Optional[tuple[int, ...]], budget: Optional[int]) -> tuple[tuple[int, ...], list[Any]]:
        if self.tokens is not None:
            assert budget is not None
            plan = self.tokens.plan_attempt(self.consensus, self._lengths, budget)
            return plan.sizes, self.tokens.split(self.batch, plan)
        assert split is not None
        return split, self._split(split)

    # ---- run -------------------------------------------------------------------------------------

    def attempt(
        self, split: Optional[tuple[int, ...]], budget: Optional[int], hooks_on: bool, track_peaks: bool = False,
        last_apart: bool = False,
    ) -> Attempt:
        """One attempt at `split` (samples per microbatch) or, with a token budget, at `budget`.
        Every retry starts from the random state the batch started with, so a retry at the same
        split computes exactly what the first attempt would have. `track_peaks`: measure each
        microbatch's peak (`self.peaks`; Composer's microbatch loop only, not a pipeline's); `last_apart`: the last
        microbatch's peak apart (gradients reduced once per batch: `MicrobatchPeaks`)."""
        assert self._random_state is not None, "begin() first"
        self.attempts += 1
        if self.attempts > 1:
            self._random_state.restore()
        sizes, microbatches = self._microbatches(split, budget)
        total_loss_dict = self.host.begin_attempt(max(sizes))
        context = self.dispatcher.context
        context.batch_index, context.attempt = self.batch_index, self.attempts
        context.microbatch_size, context.num_microbatches = max(sizes), len(sizes)
        context.microbatch_index = -1
        # A site of an earlier attempt must not be blamed for a failure before any site fires.
        context.last_site, context.last_module = "other", ""
        self.memory.reset_peak()
        self.peaks = MicrobatchPeaks(self.memory, sizes, last_apart) if track_peaks and self.pipeline is None else None
        # Retries are counted per attempt: a failed attempt's retries say nothing about thrashing.
        self.retries_before = self.memory.alloc_retries()

        def body(finish: Callable[[], None]) -> None:
            def before_microbatch(index: int) -> None:
                context.microbatch_index = index
                if self.peaks is not None:
                    self.peaks.start(index)
                if self.layout is not None:
                    self.layout.before_microbatch(index, len(sizes))

            def end_of_attempt() -> None:
                context.microbatch_index = len(sizes) - 1
                if self.peaks is not None:
                    self.peaks.end()
                self.dispatcher.fire("optimizer_step", "")
                finish()

            if self.pipeline is not None:
                hooks = AttemptHooks(self.consensus, self.dispatcher, self.pipeline.stage_index, every_step=hooks_on)
                # A pipeline's schedule drives Composer's trainer (`ComposerHost.trainer`): no other host has one.
                self.pipeline.run(self.host.trainer, microbatches, total_loss_dict, end_of_attempt, hooks)  # type: ignore[attr-defined]
                return
            if self.twin is None:
                self.host.run_microbatches(microbatches, total_loss_dict, before_microbatch, end_of_attempt, self.all_reduce)
                return
            self._through_twin(self.twin, microbatches, total_loss_dict, before_microbatch, end_of_attempt)

        mark = mark_attempt(self.memory)
        try:
            result = self.fence.run(body, self._wipe, hooks_on)
        except FatalRecoveryError as lost:
            if getattr(lost, "oom", True):
                failure_note.write(self.host.checkpoint_folder(), self.rank, self.batch_index, sizes)
            raise
        if self.forward_state is not None:
            self.forward_state.after_attempt(result.verdict.failed)
        # What a failed attempt left allocated after its wipe (DESIGN.md, "Memory truth": nothing).
        self.left_behind = left_after_wipe(self.memory, mark) if result.verdict.failed else None
        return Attempt(sizes, result, total_loss_dict)

    def _through_twin(
        self, twin: UnshardedTwin, microbatches: list[Any], total_loss_dict: dict[str, torch.Tensor],
        before_microbatch: Callable[[int], None], end_of_attempt: Callable[[], None],
    ) -> None:
        """The attempt's microbatches through the model's unsharded twin: the host calls it in the
        model's place until the last backward, then its gradients become the model's, before the batch's
        end events see them."""
        swap = getattr(self.host, "swap_model", None)
        if swap is None:
            raise TypeError(f"automicro: {type(self.host).__name__} cannot run a batch through the unsharded twin")
        twin.rebind(self.sharded.module)
        previous = swap(twin.module)
        restored = False

        def end() -> None:
            nonlocal restored
            twin.move_grads()
            swap(previous)
            restored = True
            end_of_attempt()

        try:
            self.host.run_microbatches(microbatches, total_loss_dict, before_microbatch, end, self.all_reduce)
        finally:
            if not restored:
                swap(previous)

    def peak_bytes(self) -> int:
        """The peak of the attempt so far (the memory source's, across the per-microbatch resets)."""
        return self.memory.peak_bytes() if self.peaks is None else self.peaks.peak_bytes()

    def step_optimizers(self) -> None:
        """After an attempt every rank agreed succeeded. The range names the step in a batch profile
        (`automicro.batch.batch_profile`: the optimizer's work is not a model compile's to fuse)."""
        with torch.profiler.record_function("automicro::optimizer_step"):
            self.host.step_optimizers()

    # ---- wipe ------------------------------------------------------------------------------------

    def _wipe(self) -> None:
        """Nothing of a failed attempt may reach the model, optimizer, metrics or data order."""
        self.host.reset_after_failure()
        if self.layout is not None:
            self.layout.reset()
        if self.pipeline is not None:
            self.pipeline.release()
        self.sharded.recover()
        if self.forward_state is not None:
            self.forward_state.undo()  # the buffers its forwards wrote (expert token counts, batch norm statistics)
        twin = getattr(self.sharded, "twin", None)
        if twin is not None:
            twin.drop_grads()
        # Reference cycles first; the cache not on a card another process shares (`CudaMemory.empty_cache`).
        release_after_failure(self.memory)


__all__ = ["Attempt", "BatchStep"]
