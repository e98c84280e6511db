"""`budget="tokens"`: the search finds tokens per microbatch, and every batch is packed under it.

For variable-length data a microbatch's memory follows its tokens, not its samples. With
`AutoMicrobatching(budget="tokens")` the search policy (`automicro.core.policy`, unchanged)
searches a token budget instead of a sample count, and each batch is planned here:

1. Each rank packs its batch, longest samples first, into the fewest microbatches whose padded
   tokens (samples x the longest of them; each microbatch is re-padded to its own longest) stay
   within the budget (`automicro.core.token_packing`).
2. One consensus round (`Consensus.agree_max`) agrees the microbatch count K (the largest any
   rank needs) and the budget's domain (the largest batch in padded tokens seen so far). Every
   rank then splits into exactly K balanced microbatches: FSDP2's collectives pair up only when
   every rank runs the same number of forwards and backwards.
3. What the policy is told is what ran, so that a budget is never claimed beyond what a
   microbatch really held. A success: the largest microbatch over the ranks. A failure: the
   budget when it ran clean before (a one-off: the policy reruns it once); else the largest
   microbatch of the ranks that failed; and the smallest budget when every microbatch already is
   one sample (nothing is left to split: the floor). A budget that ran clean but that the batch
   did not fill is settled on (`PolicyConfig.unit`): below a bound that ran out, later batches
   pack more under it than the microbatch that ran (one H100 at a 0.45 cap, `benchmarks/RESULTS.md` 2026-11-28, token `auto` under a cap: settling
   on what ran kept 3,498 tokens where 4,664 had run clean, 0.66x the best hand-set budget); a
   later batch that fills it and runs out steps it down like any OOM.

With ``packing: true`` and a model that keeps attention within packed samples (`packed_input`),
a microbatch is one row of its samples end to end: it costs its real tokens, and the cuts are the
packed ones of `token_packing` (`split` packs, `token_split.select_packed`). A batch with a key that
cannot be packed (per-sample values) is padded as without packing, said once.

Budgets lie on a grid of `quantum` tokens (a sixty-fourth of the first batch), an eighth of that
below 8 quanta (a few quanta is a step of tens of percent); the search bisects tokens, so it
takes about as many attempts as a sample-count search, and three more where the budget is small; the memory prediction is not used (a
microbatch's tokens only approximate its memory). Loss normalisation is `loss_normalization`'s:
per loss token over the whole batch by default, so that training does not depend on the split; on
left-padded batches for a model that shifts its labels, `split` masks each padded row's first label.

Owns: the token plan of a batch and the budget's grid and domain. May not touch: the policy's
transitions (it feeds them), Composer privates, FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from automicro.core import policy as search
from automicro.core.consensus import Consensus
from automicro.core.token_packing import (
    pack_packed_under_budget,
    pack_under_budget,
    packed_tokens,
    padded_tokens,
    split_into,
    split_packed_into,
)
from automicro.batch import token_split
GRID_STEPS = 64  # the first batch's padded tokens / GRID_STEPS = the budget's quantum
FINE_QUANTA, FINE_STEPS = 8, 8  # below 8 quanta, budgets are an eighth of a quantum apart
_SAMPLES_CAP = 1 << 40  # agree_max carries the smallest batch as _SAMPLES_CAP - samples


def _arithmetic(packed: bool) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., int]]:
    """(the fewest microbatches under a budget, exactly `count` microbatches, a microbatch's cost):
    padded (samples x their longest) or packed (their real tokens)."""
    if packed:
        return pack_packed_under_budget, split_packed_into, packed_tokens
    return pack_under_budget, split_into, padded_tokens


class TokenBudgetError(ValueError):
    """The ranks' batches cannot run under one microbatch count (says what to change)."""


@dataclass(frozen=True)
class TokenPlan:
    """One attempt's split of this rank's batch."""

    budget: int
    groups: tuple[tuple[int, ...], ...]  # sample indices per microbatch
    lengths: tuple[int, ...]
    count: int  # microbatches on every rank
    own: int  # microbatches this rank's batch needed under the budget (<= count)
    largest: int  # this rank's largest microbatch, padded tokens
    one_sample_each: bool  # every microbatch on every rank is one sample
    most_real: int = 0  # the most real tokens any rank holds in this batch (agreed: the same on every rank)
    packed: bool = False  # each microbatch is one packed row (its cost: its real tokens)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(g) for g in self.groups)

    @property
    def padded(self) -> int:
        """Tokens the microbatches hold, padding included (packed: the real ones)."""
        _, _, cost = _arithmetic(self.packed)
        return sum(cost(self.lengths, g) for g in self.groups)

    @property
    def real(self) -> int:
        return sum(self.lengths)


class TokenBudget:
    """The token side of `AutoMicrobatching(budget="tokens")`, one per callback."""

    def __init__(self, fixed: Optional[int] = None) -> None:
        # `fixed`: a hand-set budget (no search: every batch is packed under it; an OOM there gets
        # its one rerun and then ends the run, as a fixed microbatch size does).
        if fixed is not None and (isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 1):
            raise ValueError(f"fixed_tokens={fixed!r}: must be null (search the budget) or an int >= 1")
        self.fixed = fixed
        self.quantum: Optional[int] = None
        self.plan: Optional[TokenPlan] = None
        self.padded_total = 0  # padded tokens of the microbatches trained (all batches, this rank)
        self.real_total = 0
        # This launch's batches trained and, summed over them, the most real tokens of any rank (not
        # checkpointed): the average batch the trials weigh a batch against (`batch_weight`).
        self.batches_trained = 0
        self.most_real_this_run = 0
        # The model shifts its labels (`loss_normalization`, set at check_trainer): on left-padded
        # batches the label of a padded row's first real token is masked (`token_split`), said once.
        self.model_shifts_labels = False
        # packing: true and the model takes packed rows (`packed_input`, set at check_trainer).
        self.packing = False
        self._packs = False  # this batch is packed (`agree_domain`)
        self.info: Callable[[str], None] = lambda message: None
        self._said_left_padding = False
        self._said_unpackable = False

    # ---- the policy's domain and grid ------------------------------------------------------

    def sizes_for(self, domain: int) -> tuple[int, ...]:
        if self.fixed is not None:
            return (min(self.fixed, domain),)
        assert self.quantum is not None
        # Below FINE_QUANTA quanta the steps are an eighth of a quantum: a budget a few quanta large
        # (a memory cap, a card shared with another process) is found within a few percent, not
        # within a whole quantum (one H100 at torch's fraction 0.45: 3 or 4 quanta of 1,166 tokens).
        # (k/8 of a quantum, rounded down: every quantum is on it.)
        low = {k * self.quantum // FINE_STEPS for k in range(1, FINE_QUANTA * FINE_STEPS + 1)}
        low = {b for b in low if 0 < b <= domain}
        grid = tuple(sorted(low | set(range(self.quantum, domain + 1, self.quantum))))
        return grid if grid and grid[-1] == domain else grid + (domain,)

    def policy_config(self, base: search.PolicyConfig) -> search.PolicyConfig:
        return replace(base, sizes_for=self.sizes_for, use_prediction=False, start_size=None, unit="tokens")

    def snap(self, domain: int, tokens: int) -> int:
        """The largest budget on the grid at or below `tokens` (the smallest budget if none)."""
        return max((s for s in self.sizes_for(domain) if s <= tokens), default=self.sizes_for(domain)[0])

    def state_dict(self) -> dict[str, Any]:
        return {"quantum": self.quantum, "padded_total": self.padded_total, "real_total": self.real_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.quantum = None if state.get("quantum") is None else int(state["quantum"])
        self.padded_total = int(state.get("padded_total", 0))
        self.real_total = int(state.get("real_total", 0))

    # ---- one batch ------------------------------------------------------------------------

    def agree_domain(self, consensus: Consensus, batch: Any) -> tuple[list[int], int]:
        """Collective (every rank, once per batch): this rank's lengths, and the largest batch
        of this batch over the ranks in padded tokens."""
        lengths = token_split.sample_lengths(batch)
        self._packs = self.packing and self._packable(batch)
        _, _, cost = _arithmetic(self._packs)
        (largest,) = consensus.agree_max((cost(lengths, range(len(lengths))),))
        largest = max(largest, 1)
        if self.quantum is None:
            self.quantum = max(1, largest // GRID_STEPS)
        return lengths, largest

    def plan_attempt(self, consensus: Consensus, lengths: list[int], budget: int) -> TokenPlan:
        """Collective (every rank, once per attempt): the split of this rank's batch under `budget`."""
        packed = self._packs
        pack, split, cost = _arithmetic(packed)
        own = len(pack(lengths, budget))
        count, most_samples, fewest_inverse, most_real = consensus.agree_max(
            (own, len(lengths), _SAMPLES_CAP - len(lengths), sum(lengths))
        )
        fewest = _SAMPLES_CAP - fewest_inverse
        if count > fewest:
            raise TokenBudgetError(
                f"automicro: budget='tokens': a rank needs {count} microbatches under {budget} tokens but another rank "
                f"holds only {fewest} samples; every rank must run the same number of microbatches. Give every rank "
                "the same number of samples per batch (drop_last=True)"
            )
        groups = split(lengths, count, cap=budget)
        plan = TokenPlan(
            budget=budget,
            groups=tuple(tuple(g) for g in groups),
            lengths=tuple(lengths),
            count=count,
            own=own,
            largest=max(cost(lengths, g) for g in groups),
            one_sample_each=count == most_samples,
            most_real=most_real,
            packed=packed,
        )
        self.plan = plan
        return plan

    def stop_packing(self) -> None:
        """Memory pressure: the rest of this batch's attempts and the later batches are padded."""
        self.packing = self._packs = False

    def _packable(self, batch: Any) -> bool:
        key = token_split.unpackable_key(batch)
        if key is not None and not self._said_unpackable:
            self._said_unpackable = True
            self.info(
                f"packing: batch key {key!r} is not a per-token tensor [samples, sequence] (per-sample values cannot "
                "be packed into one row): such batches are padded as without packing"
            )
        return key is None

    def split(self, batch: Any, plan: TokenPlan) -> list[Any]:
        if plan.packed:
            return token_split.pack_by_groups(batch, plan.groups, plan.lengths, mask_first_label=self.model_shifts_labels)
        mask = self.model_shifts_labels and token_split.left_padded_first_labels(batch, plan.lengths)
        if mask and not self._said_left_padding:
            self._said_left_padding = True
            self.info(
                "left-padded batches: the model shifts its labels, so it predicts each padded row's first real token "
                "from a padding position, whose output changes with the padding width (each microbatch is re-padded to "
                "its own longest); that token's label is masked (-100) so that training does not depend on the split"
            )
        return token_split.split_by_groups(batch, plan.groups, plan.lengths, mask_first_label=mask)

    def trained(self, plan: TokenPlan) -> None:
        self.padded_total += plan.padded
        self.real_total += plan.real
        self.batches_trained += 1
        self.most_real_this_run += plan.most_real

    # ---- what the policy is told -----------------------------------------------------------

    def success_size(self, plan: TokenPlan, domain: int, largest_over_ranks: int) -> int:
        """What ran: the largest microbatch over the ranks (on the grid), never above the budget."""
        return min(plan.budget, self.snap(domain, largest_over_ranks))

    def failure_size(
        self, plan: TokenPlan, domain: int, largest_failed: int, state: search.SearchState, ranks: tuple[int, ...] = ()
    ) -> int:
        """`largest_failed`: the largest microbatch of the ranks that failed (`ranks`), in padded tokens."""
        if search.is_one_off(state, plan.budget, ranks):
            # The budget ran clean before: a one-off until it repeats (the policy reruns it).
            return plan.budget
        if plan.one_sample_each:
            return self.sizes_for(domain)[0]  # nothing left to split: the floor
        return min(plan.budget, self.snap(domain, largest_failed))

    @property
    def padding_waste(self) -> float:
        """Share of the trained microbatches' padded tokens that were padding (this rank)."""
        return 0.0 if self.padded_total == 0 else 1.0 - self.real_total / self.padded_total


__all__ = ["GRID_STEPS", "TokenBudget", "TokenBudgetError", "TokenPlan"]
