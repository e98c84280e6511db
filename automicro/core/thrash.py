"""Thrash detection: allocator retries in consecutive batches count as an OOM.

Near the memory limit the CUDA caching allocator frees its cache and retries (`num_alloc_retries`
grows): the batch succeeds but runs slowly and is one step from an OOM. New retries on any rank
in `thrash_batches` consecutive batches are treated like an OOM at the current size (Composer's
FSDP1 rule, which uses 2). The training search feeds it no layout trial's batch: a trial times its
retries in its arms (`automicro.batch.training_search`); nor a batch at a size whose retries were
timed faster than the size below (`automicro.batch.thrash_timing`).

Owns: the consecutive-retry counter. May not touch: the allocator (the figures come through
the consensus verdict), the policy (the adapter turns a detection into `policy.Thrash`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ThrashDetector:
    thrash_batches: int = 2
    consecutive: int = 0
    events: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.thrash_batches, bool) or not isinstance(self.thrash_batches, int) or self.thrash_batches < 1:
            raise ValueError(f"thrash_batches={self.thrash_batches!r}: must be an int >= 1")

    def observe(self, new_retries_on_any_rank: bool) -> bool:
        """Feed one successful batch; True when it completes a thrash (and resets the count)."""
        if not new_retries_on_any_rank:
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.consecutive >= self.thrash_batches:
            self.consecutive = 0
            self.events += 1
            return True
        return False
