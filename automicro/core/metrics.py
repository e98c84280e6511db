"""What auto microbatching tells the dashboards: attempt records, per-batch metrics, event traces.

Owns: `AttemptRecord` (one attempt as every rank agreed on it), the `automicro/*` metric keys and
the `automicro/event` trace rows, and the console line of a record. May not touch: Composer (the
adapter hands the dicts to Composer's `Logger`), torch, the consensus.

Metrics logged each batch (rank 0, through Composer's loggers):

| key | meaning |
| --- | --- |
| `automicro/microbatch_size` | largest microbatch of the split in use |
| `automicro/num_microbatches` | microbatches per batch |
| `automicro/attempts` | attempts of this batch (1 = no retry) |
| `automicro/ooms_total` | failed attempts so far |
| `automicro/searching` | 1 while the size is not settled |
| `automicro/hooks_active` | 1 while sync hooks are installed |
| `automicro/thrash_events` | thrash detections so far |
| `automicro/search_time_s` | seconds spent in failed attempts so far |
| `automicro/alloc_retries` | allocator retries seen this batch (any rank) |
| `automicro/found_size` | largest microbatch size that fit on every rank (0 while searching) |
| `automicro/capacity_bytes` | memory this process can still get, the least over ranks, read at the batch's last attempt (0: unknown; `automicro.core.memory`) |
| `automicro/last_oom_rank` | lowest failed rank of the latest OOM (-1: none yet) |
| `automicro/last_oom_site` | its site as an index into `automicro.core.sites.ALL_SITES` (-1: none) |
| `automicro/budget_tokens` | budget="tokens" only: tokens per microbatch of the split in use (`found_size` is then in tokens too) |
| `automicro/padding_waste` | budget="tokens" only: share of the trained microbatches' tokens that were padding (rank 0) |

Each failed attempt (OOM or thrash) is also one `automicro/event` trace (`Logger.log_traces`,
never a training step): batch, attempt, size, split, outcome, failed ranks, site name and index,
next size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from automicro.core.sites import site_index

#: How many records a checkpoint keeps.
HISTORY_IN_CHECKPOINT = 1000


@dataclass
class AttemptRecord:
    """One attempt of one batch, as every rank agreed on it."""

    batch: int
    attempt: int
    size: int
    split: tuple[int, ...]
    outcome: str  # "ok", "oom", "thrash", "error"
    failed_ranks: list[int] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    next_size: int = 0
    hooks: bool = True
    seconds: float = 0.0
    note: str = ""

    def console_line(self) -> str:
        where = f" on rank(s) {self.failed_ranks} at {self.sites}" if self.failed_ranks else ""
        return (
            f"batch {self.batch} attempt {self.attempt}: size {self.size} split {list(self.split)} -> "
            f"{self.outcome}{where}; next size {self.next_size}" + (f" ({self.note})" if self.note else "")
        )


@dataclass(frozen=True)
class BatchFigures:
    """The callback's counters at the end of a batch (the inputs of `batch_metrics`)."""

    split: tuple[int, ...]
    attempts: int
    ooms_total: int
    searching: bool
    hooks_active: bool
    thrash_events: int
    search_time_s: float
    alloc_retries: bool
    found_size: int
    budget_tokens: int = 0  # budget="tokens": the token budget of the split in use (0: samples)
    padding_waste: Optional[float] = None  # budget="tokens": padding share of the tokens trained
    capacity_bytes: int = 0  # the agreed capacity (min over ranks) of the batch's last attempt (0: unknown)
    peak_bytes: int = 0  # the batch's peak (the most over ranks) in its last attempt (0: unknown)


def batch_metrics(figures: BatchFigures, history: Sequence[AttemptRecord]) -> dict[str, Any]:
    """The `automicro/*` metrics of one batch."""
    return {
        "automicro/microbatch_size": max(figures.split),
        "automicro/num_microbatches": len(figures.split),
        "automicro/attempts": figures.attempts,
        "automicro/ooms_total": figures.ooms_total,
        "automicro/searching": int(figures.searching),
        "automicro/hooks_active": int(figures.hooks_active),
        "automicro/thrash_events": figures.thrash_events,
        "automicro/search_time_s": figures.search_time_s,
        "automicro/alloc_retries": int(figures.alloc_retries),
        "automicro/found_size": figures.found_size,
        "automicro/capacity_bytes": figures.capacity_bytes,
        "automicro/peak_bytes": figures.peak_bytes,
        **last_oom_metrics(history),
        **token_metrics(figures),
    }


def token_metrics(figures: BatchFigures) -> dict[str, Any]:
    """`automicro/budget_tokens` and `automicro/padding_waste`, with budget="tokens" only."""
    if not figures.budget_tokens:
        return {}
    return {"automicro/budget_tokens": figures.budget_tokens, "automicro/padding_waste": figures.padding_waste or 0.0}


def last_oom_metrics(history: Sequence[AttemptRecord]) -> dict[str, int]:
    """`automicro/last_oom_rank` and `automicro/last_oom_site` (an index into `ALL_SITES`)."""
    last = next((r for r in reversed(history) if r.outcome == "oom" and r.failed_ranks), None)
    if last is None:
        return {"automicro/last_oom_rank": -1, "automicro/last_oom_site": -1}
    site = last.sites[0] if last.sites else "other"
    return {"automicro/last_oom_rank": int(last.failed_ranks[0]), "automicro/last_oom_site": site_index(site)}


def event_traces(history: Sequence[AttemptRecord], batch_index: int) -> list[dict[str, Any]]:
    """One `automicro/event` trace per failed attempt of batch `batch_index`, the latest batch in
    `history` (called at the batch's end), oldest first."""
    failed = []
    for record in reversed(history):
        if record.batch != batch_index:
            break
        if record.outcome != "ok":
            failed.append(record)
    traces = []
    for record in reversed(failed):
        site = record.sites[0] if record.sites else ""
        traces.append(
            {
                "automicro/event": {
                    "batch": record.batch,
                    "attempt": record.attempt,
                    "size": record.size,
                    "split": list(record.split),
                    "outcome": record.outcome,
                    "ranks": list(record.failed_ranks),
                    "site": site,
                    "site_index": site_index(site) if site else -1,
                    "sites": list(record.sites),
                    "next_size": record.next_size,
                    "seconds": record.seconds,
                }
            }
        )
    return traces


def history_to_state(history: Sequence[AttemptRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in history[-HISTORY_IN_CHECKPOINT:]]


def history_from_state(rows: Sequence[dict[str, Any]]) -> list[AttemptRecord]:
    return [AttemptRecord(**{**r, "split": tuple(r["split"])}) for r in rows]


__all__ = [
    "AttemptRecord",
    "BatchFigures",
    "batch_metrics",
    "event_traces",
    "history_from_state",
    "history_to_state",
    "last_oom_metrics",
]
