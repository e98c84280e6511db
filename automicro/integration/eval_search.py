"""Eval-time auto microbatching with the training search's bisect, one search per evaluator.

`device_eval_microbatch_size: auto` used to follow Composer's eval loop, which halves the size on
every OOM and never grows it again (8 -> 4 -> 2 where 6 fits). Here each evaluator (by label)
has its own `SearchPolicy`: the largest size that fits on every rank, split into the fewest
microbatches of near-equal size, found across eval batches and kept for the rest of the fit.
Composer's retry loop still reruns a failed batch; only the size it reruns at is ours.

Owns: the eval searches (policy, found size, attempt records per evaluator) and the size an
evaluator's batch is split by. May not touch: the training search, the consensus (the callback's
eval fence decides what failed), Composer internals outside `_composer_internals`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from automicro.core import policy as search
from automicro.core.metrics import AttemptRecord
from automicro.integration import _composer_internals as composer_internals


def _chunk_for(batch_size: int, size: int, found: bool) -> int:
    """Composer splits an eval batch into chunks of one size. While searching, chunks of `size`
    itself (its first microbatch is the size under test, as in training); once found, the
    largest of the even split into the fewest microbatches of at most `size` (8 samples at 5:
    chunks of 4, not 5 + 3)."""
    size = max(1, min(size, batch_size))
    return max(search.even_split(batch_size, size)) if found else size


@dataclass
class _EvalBatch:
    size: int
    chunk: int
    batch_size: int
    attempt: int = 1


@dataclass
class EvalSearch:
    """The bisect search of one evaluator's microbatch size, fed by its eval batches' outcomes."""

    label: str
    policy_config: Optional[search.PolicyConfig] = None
    policy: Optional[search.SearchPolicy] = None
    history: list[AttemptRecord] = field(default_factory=list)
    batches: int = 0
    _current: Optional[_EvalBatch] = None

    @property
    def found_size(self) -> Optional[int]:
        return None if self.policy is None else self.policy.found_size

    def batch_start(self, evaluator: Any, batch_size: int) -> int:
        """Set the size this batch is split by; returns it."""
        if self.policy is None:
            self.policy = search.SearchPolicy(self.policy_config, batch_size)
        size = max(self.policy.current_split())
        chunk = _chunk_for(batch_size, size, self.policy.found_size is not None)
        self._current = _EvalBatch(size=size, chunk=chunk, batch_size=batch_size)
        evaluator.device_eval_microbatch_size = chunk
        return chunk

    def failed(self, evaluator: Any, failed_ranks: list[int], sites: list[str]) -> AttemptRecord:
        """Every rank agreed the attempt ran out of memory: bisect down and have Composer's retry
        loop rerun the batch at the new size. Raises `CannotFitError` below the smallest size."""
        current = self._require_batch()
        decision = self.policy.observe(search.OOM(current.size))  # type: ignore[union-attr]
        record = self._record(current, "oom", decision, failed_ranks, sites)
        current.size, current.attempt = decision.next_size, current.attempt + 1
        current.chunk = _chunk_for(current.batch_size, decision.next_size, self.policy.found_size is not None)  # type: ignore[union-attr]
        composer_internals.set_eval_retry_size(evaluator, current.chunk)
        return record

    def batch_end(self) -> Optional[AttemptRecord]:
        """The batch finished on every rank at the current size."""
        current = self._current
        if current is None or self.policy is None:
            return None
        decision = self.policy.observe(search.Success(current.size))
        record = self._record(current, "ok", decision, [], [])
        self.batches += 1
        self._current = None
        return record

    def _record(
        self, current: _EvalBatch, outcome: str, decision: search.Decision, failed_ranks: list[int], sites: list[str]
    ) -> AttemptRecord:
        record = AttemptRecord(
            batch=self.batches,
            attempt=current.attempt,
            size=current.size,
            split=search.chunk_split(current.batch_size, current.chunk),
            outcome=outcome,
            failed_ranks=list(failed_ranks),
            sites=list(sites),
            next_size=decision.next_size,
            note=decision.event,
        )
        self.history.append(record)
        return record

    def _require_batch(self) -> _EvalBatch:
        if self._current is None or self.policy is None:
            raise RuntimeError(f"automicro: eval search '{self.label}': an eval attempt failed outside an eval batch")
        return self._current
