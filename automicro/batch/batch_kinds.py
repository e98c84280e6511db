"""What a batch is counted in, for the training search: samples or tokens.

`AutoMicrobatching(budget="samples")` searches samples per microbatch (`SampleBatches`);
`budget="tokens"` searches tokens per microbatch and packs each variable-length batch under the
budget (`TokenBatches`, over `automicro.batch.token_budget.TokenBudget`). The callback asks its
batch kind whatever differs between the two (the policy's domain, the next attempt, what the policy
is told an attempt ran at, the console and dashboard figures, the checkpoint's part) and never
branches on the budget itself.

Owns: the per-kind answers and (tokens) the `TokenBudget`. May not touch: the policy's state (it
reads it and passes it events it builds), Composer, the attempt fence.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from automicro.core import policy as search
from automicro.core.consensus import Verdict
from automicro.core.layout import SIZE_FRACTIONS
from automicro.batch import packed_input
from automicro.batch.token_budget import TokenBudget


class SampleBatches:
    """budget="samples": a batch's size is its samples; the split is the policy's."""

    tokens: Optional[TokenBudget] = None
    # The size trials' microbatches, as shares of the largest one at the size found (`core.layout`).
    size_fractions: tuple[float, ...] = SIZE_FRACTIONS

    def policy_config(self, base: search.PolicyConfig) -> search.PolicyConfig:
        return base

    def check_trainer(self, trainer: Any) -> None:
        pass

    def label_shift(self, shift: int, info: Callable[[str], None]) -> None:
        """Where the model's loss tokens start (`loss_normalization`): only a token budget cuts rows."""

    # Packed rows measured against padded batches once the budget settles (`packing_choice`).
    measures_packing = False

    def check_packing(self, model: Any, info: Callable[[str], None], normalization: Optional[str], device_type: str = "cpu") -> None:
        """Whether batches are packed into rows (`packed_input`): only a token budget packs.
        `normalization`: the loss normalisation resolved (`loss_normalization`)."""

    def check_pipeline(self) -> None:
        pass

    # ---- the policy's domain -------------------------------------------------------------------

    def domain(self, batch_size: int) -> int:
        return batch_size

    def resumed(self, policy: search.SearchPolicy, batch_size: int) -> None:
        """A policy restored from a checkpoint meets this run's first batch."""
        if policy.state.batch_size != batch_size:
            policy.observe(search.BatchSizeChanged(batch_size))

    def changed(self, policy: search.SearchPolicy, batch_size: int) -> Optional[tuple[search.Decision, str]]:
        """A later batch: the decision its size brings (and the console detail), or None."""
        if policy.state.batch_size == batch_size:
            return None
        return policy.observe(search.BatchSizeChanged(batch_size)), f"to {batch_size}"

    # ---- one attempt ---------------------------------------------------------------------------

    def next_attempt(self, policy: search.SearchPolicy, layout: Any, probes: bool) -> tuple[Optional[tuple[int, ...]], Optional[int], bool]:
        """(split, token budget, track per-microbatch peaks) of the next attempt."""
        track = probes and policy.phase == search.Phase.SEARCHING
        downsized = layout.trial_size
        split = policy.current_split() if downsized is None else policy.split_for(downsized)
        if layout.measure_split_next:
            # A layout trade's bytes, measured at the probe's split, the fused head's near the size found
            # (`automicro.core.layout`); with gradients reduced once per batch, two sizes before the last microbatch.
            near = policy.near_split(layout.measure_near, layout.reduces_once) if layout.measure_near else None
            split, track = near or policy.probe_split() or split, True
        return tuple(split), None, track

    def layout_figures(self, policy: search.SearchPolicy, peak_at: Callable[[int], Any], probes: bool) -> tuple[Any, ...]:
        """What the layout trials size their trades by (`LayoutTrials.before_batch`); nothing for tokens."""
        return (
            max(policy.current_split()), policy.found_size, peak_at, policy.probe_split() if probes else None,
            lambda n: max(policy.split_for(n)),
        )

    def microbatch_tokens(self) -> int:
        """This rank's largest microbatch in padded tokens (the consensus report's figure)."""
        return 0

    def batch_weight(self) -> float:
        """The batch just trained against an average one, for the layout and size trials' timing (a
        batch of samples: 1)."""
        return 1.0

    def outcome_size(self, policy: search.SearchPolicy, sizes: tuple[int, ...], verdict: Verdict, failed: bool) -> int:
        """What the policy is told the attempt ran at."""
        return max(sizes)

    def trained(self) -> None:
        """An attempt succeeded: its microbatches were trained."""

    # ---- records, console, dashboards ----------------------------------------------------------

    def record_size(self, sizes: tuple[int, ...]) -> int:
        return max(sizes)

    def record_next(self, policy: Optional[search.SearchPolicy], next_size: int) -> int:
        return next_size

    def found_line(self, policy: search.SearchPolicy, phase_before: search.Phase, sizes: tuple[int, ...]) -> Optional[str]:
        return None

    def stable_at(self, policy: search.SearchPolicy) -> str:
        return f"split {list(policy.current_split())}"

    def cannot_fit(self) -> str:
        return "out of memory even with device_train_microbatch_size=1"

    def summary(self, policy: search.SearchPolicy, per_rank_batch: Optional[int], layout: str, used: tuple[int, ...], tail: str) -> str:
        """The end-of-fit line (`AutoMicrobatching.summary_line`)."""
        batch = "" if per_rank_batch is None else f" (per-rank batch {per_rank_batch})"
        return f"[automicro] microbatch size found: {policy.found_size}{batch}; split in use {list(policy.current_split())}{layout}; {tail}"

    def metric_figures(self) -> tuple[int, Optional[float]]:
        """(`automicro/budget_tokens`, `automicro/padding_waste`)."""
        return 0, None

    def padding_share(self) -> float:
        """The share of the trained tokens that were padding (what packed rows or a smaller budget can save)."""
        return self.metric_figures()[1] or 0.0

    def state_dict(self) -> Optional[dict[str, Any]]:
        return None

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        pass


class TokenBatches(SampleBatches):
    """budget="tokens": a batch's size is the largest batch of any rank in padded tokens; each
    attempt packs this rank's samples under the budget under test (`TokenBudget`)."""

    def __init__(self, fixed: Optional[int] = None, packing: Union[bool, str, None] = None) -> None:
        self.tokens = TokenBudget(fixed)
        self.packing = packing  # True / False: pinned; None: measured on a GPU; "auto": measured anywhere
        self.measures_packing = False
        # Finer than samples' (the fastest hand-set budget measured was 0.56x the largest that fits);
        # none for a hand-set budget (`fixed_tokens`): the user's budget is not traded.
        self.size_fractions: tuple[float, ...] = () if fixed is not None else (0.75, 0.5)

    def policy_config(self, base: search.PolicyConfig) -> search.PolicyConfig:
        return self.tokens.policy_config(base)

    def label_shift(self, shift: int, info: Callable[[str], None]) -> None:
        self.tokens.model_shifts_labels, self.tokens.info = shift == 1, info

    def check_packing(self, model: Any, info: Callable[[str], None], normalization: Optional[str], device_type: str = "cpu") -> None:
        if self.packing is True and normalization == "samples":
            raise ValueError(
                "AutoMicrobatching(packing=True) with accumulate_train_batch_on_tokens=False: a packed microbatch is one "
                "row whatever its samples, so a per-sample weight means nothing; leave the Trainer argument out (per "
                "loss token, the default with budget: tokens) or drop packing"
            )
        if isinstance(self.packing, bool):
            self.tokens.packing = self.packing and packed_input.check(model, info)
            return
        self.tokens.packing = False
        if normalization == "samples":
            info("packing: batches are padded (the loss is normalised per sample, which a packed row cannot keep)")
        elif self.packing is None and device_type != "cuda":
            # As the layout: a CPU batch's time says nothing of a GPU's (packing: auto measures it all the same).
            info("packing: batches are padded on CPU (measured against packed rows on a GPU; packing: true pins packing)")
        else:
            self.measures_packing = packed_input.measurable(model, info)

    def check_pipeline(self) -> None:
        raise ValueError(
            "AutoMicrobatching(budget='tokens') cannot run pipeline stages (a pipeline runs equal microbatches); "
            "use budget='samples' with parallelism_config.pipeline"
        )

    def domain(self, batch_size: int) -> int:
        # A hand-set budget: its domain is fixed too.
        return batch_size if self.tokens.fixed is None else max(batch_size, self.tokens.fixed)

    def resumed(self, policy: search.SearchPolicy, batch_size: int) -> None:
        policy.observe(search.DomainGrew(batch_size))

    def changed(self, policy: search.SearchPolicy, batch_size: int) -> Optional[tuple[search.Decision, str]]:
        # The domain (the largest batch seen, in tokens) only grows.
        if batch_size <= policy.state.batch_size:
            return None
        return policy.observe(search.DomainGrew(batch_size)), f"largest batch now {batch_size} tokens"

    def budget(self, policy: search.SearchPolicy) -> int:
        """The token budget of the next attempt: the settled one, or the one under test."""
        state = policy.state
        return state.found if state.found is not None else state.size

    def next_attempt(self, policy: search.SearchPolicy, layout: Any, probes: bool) -> tuple[Optional[tuple[int, ...]], Optional[int], bool]:
        trial = layout.trial_size  # a size trial's "with" batch: the smaller budget under test
        return None, self.budget(policy) if trial is None else trial, False

    def layout_figures(self, policy: search.SearchPolicy, peak_at: Callable[[int], Any], probes: bool) -> tuple[Any, ...]:
        """The budget in use and the one found: the trades are tried in tokens, and the size trials
        time smaller budgets (no memory model per budget: no downsize or upsize trial)."""
        if policy.found_size is None:
            return ()
        return self.budget(policy), policy.found_size, None, None, lambda n: n

    def microbatch_tokens(self) -> int:
        return 0 if self.tokens.plan is None else self.tokens.plan.largest

    def batch_weight(self) -> float:
        """The batch just trained's work over this launch's average batch: variable-length batches
        differ in work, so the trials judge each batch's seconds per average batch. The work: the
        most real tokens any rank held (the ranks wait for the one with the most; agreed, so every
        rank weighs the batch alike and the trials' verdicts agree)."""
        plan, batches, most = self.tokens.plan, self.tokens.batches_trained, self.tokens.most_real_this_run
        if plan is None or not batches or not most or not plan.most_real:
            return 1.0
        return plan.most_real / (most / batches)

    def outcome_size(self, policy: search.SearchPolicy, sizes: tuple[int, ...], verdict: Verdict, failed: bool) -> int:
        plan = self.tokens.plan
        if plan is None:
            return max(sizes)
        domain = policy.state.batch_size
        if failed:
            return self.tokens.failure_size(plan, domain, verdict.failed_microbatch_tokens, policy.state, tuple(verdict.failed_ranks))
        return self.tokens.success_size(plan, domain, verdict.microbatch_tokens)

    def trained(self) -> None:
        if self.tokens.plan is not None:
            self.tokens.trained(self.tokens.plan)

    def record_size(self, sizes: tuple[int, ...]) -> int:
        # The token budget the attempt was planned under.
        return max(sizes) if self.tokens.plan is None else self.tokens.plan.budget

    def record_next(self, policy: Optional[search.SearchPolicy], next_size: int) -> int:
        if policy is None or not next_size:
            return next_size
        return self.budget(policy)

    def found_line(self, policy: search.SearchPolicy, phase_before: search.Phase, sizes: tuple[int, ...]) -> Optional[str]:
        if phase_before != search.Phase.SEARCHING or policy.found_size is None:
            return None
        return (
            f"microbatch budget found: {policy.found_size} tokens ({len(sizes)} microbatches for this batch; "
            f"padding {100 * self.tokens.padding_waste:.1f}% of the tokens trained so far)"
        )

    def stable_at(self, policy: search.SearchPolicy) -> str:
        return f"budget {policy.found_size} tokens"

    def cannot_fit(self) -> str:
        if self.tokens.fixed is not None:
            return f"out of memory at the hand-set token budget fixed_tokens={self.tokens.fixed}"
        return "out of memory even with one sample per microbatch (budget='tokens')"

    def summary(self, policy: search.SearchPolicy, per_rank_batch: Optional[int], layout: str, used: tuple[int, ...], tail: str) -> str:
        batch = "" if per_rank_batch is None else f" (per-rank batch {per_rank_batch} samples)"
        return (
            f"[automicro] microbatch budget found: {policy.found_size} tokens{batch}; last split {list(used)}; "
            f"padding {100 * self.tokens.padding_waste:.1f}% of the tokens trained; {tail}"
        )

    def metric_figures(self) -> tuple[int, Optional[float]]:
        return 0 if self.tokens.plan is None else self.tokens.plan.budget, self.tokens.padding_waste

    def state_dict(self) -> Optional[dict[str, Any]]:
        return self.tokens.state_dict()

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if state is not None:
            self.tokens.load_state_dict(state)


BatchKind = Union[SampleBatches, TokenBatches]


def batch_kind(budget: str, fixed_tokens: Optional[int], packing: Union[bool, str, None] = None) -> BatchKind:
    """The batch kind of `AutoMicrobatching(budget=..., fixed_tokens=..., packing=...)` (checked there)."""
    return TokenBatches(fixed_tokens, packing) if budget == "tokens" else SampleBatches()


__all__ = ["BatchKind", "SampleBatches", "TokenBatches", "batch_kind"]
