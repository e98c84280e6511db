"""Eval-time auto microbatching with the training search's bisect, one search per evaluator.

`device_eval_microbatch_size: auto` used to follow Composer's eval loop, which halves the size on
every OOM and never grows it again (8 -> 4 -> 2 where 6 fits). Here each evaluator (by label)
has its own `SearchPolicy`: the largest size that fits on every rank, split into the fewest
microbatches of near-equal size, found across eval batches and kept for the rest of the fit.
Composer's retry loop still reruns a failed batch; only the size it reruns at is ours.

An evaluator with a pinned size (llm-foundry builds every evaluator with
``device_eval_microbatch_size = device_eval_batch_size``) is searched the same way under a training
`auto`, capped at its pinned size: it runs at that size until an eval batch runs out of memory on
some rank, then every rank splits it further together, and one line names the size that fit
(`AutoMicrobatching(eval_oom="stop")` keeps the old behaviour: the run ends).

`EvalFence` is the eval side of `AutoMicrobatching`: it fences every eval forward with the same
`AttemptFence` as training (consensus, wipe, verdict), rolls back the batch's metric updates and
FSDP2 state after a failed attempt, and then raises the OOM Composer's eval loop retries on.

Owns: the eval searches (policy, found size, attempt records per evaluator), the size an
evaluator's batch is split by, and the fence around eval forwards. May not touch: the training
search and the sync hooks (the callback turns them on for eval), Composer internals outside
`_composer_internals`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from automicro.core import policy as search
from automicro.core.attempt import AttemptFence, is_oom
from automicro.core.consensus import FailedOnOtherRank, OOMOnOtherRank, Verdict
from automicro.core.memory import MemorySource, NoMemory, left_after_wipe, mark_attempt
from automicro.core.metrics import AttemptRecord
from automicro.core.sites import SiteDispatcher
from automicro.composer import _composer_internals as composer_internals
def _chunk_for(batch_size: int, size: int, found: bool) -> int:
    """Composer splits an eval batch into chunks of one size. While searching, chunks of `size`
    itself (its first microbatch is the size under test, as in training); once found, the
    largest of the even split into the fewest microbatches of at most `size` (8 samples at 5:
    chunks of 4, not 5 + 3)."""
    size = max(1, min(size, batch_size))
    return max(search.even_split(batch_size, size)) if found else size


@dataclass(frozen=True)
class _SizesUpTo:
    """`PolicyConfig.sizes_for` of a pinned evaluator: every size up to its pinned one."""

    cap: int

    def __call__(self, batch_size: int) -> tuple[int, ...]:
        return tuple(range(1, min(self.cap, batch_size) + 1))


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
    # The evaluator's pinned microbatch size (None: `auto`): the search starts there and never
    # goes above it; it only splits further after an OOM.
    cap: Optional[int] = None
    policy: Optional[search.SearchPolicy] = None
    history: list[AttemptRecord] = field(default_factory=list)
    batches: int = 0
    _current: Optional[_EvalBatch] = None

    @property
    def found_size(self) -> Optional[int]:
        return None if self.policy is None else self.policy.found_size

    def batch_start(self, evaluator: Any, batch_size: int, resumed: Optional[dict[str, Any]] = None) -> int:
        """Set the size this batch is split by; returns it. `resumed`: this search as a checkpoint
        kept it (taken up, with a rearm, as the training search is)."""
        if self.policy is None:
            config = self.policy_config or search.PolicyConfig()
            if self.cap is not None:
                config = replace(config, start_size=self.cap, sizes_for=_SizesUpTo(self.cap))
            self.policy = search.SearchPolicy(config, batch_size)
            if resumed is not None:
                self.policy.state = search.SearchState.from_dict(resumed["policy"])
                self.batches = int(resumed.get("batches", 0))
                self.policy.observe(search.Rearm("checkpoint loaded"))
                if self.policy.state.batch_size != batch_size:
                    self.policy.observe(search.BatchSizeChanged(batch_size))
        size = max(self.policy.current_split())
        chunk = _chunk_for(batch_size, size, self.policy.found_size is not None)
        self._current = _EvalBatch(size=size, chunk=chunk, batch_size=batch_size)
        evaluator.device_eval_microbatch_size = chunk
        return chunk

    def failed(self, evaluator: Any, failed_ranks: list[int], sites: list[str]) -> AttemptRecord:
        """Every rank agreed the attempt ran out of memory: bisect down and have Composer's retry
        loop rerun the batch at the new size. Raises `CannotFitError` below the smallest size."""
        current = self._require_batch()
        decision = self.policy.observe(search.OOM(current.size, tuple(failed_ranks)))  # type: ignore[union-attr]
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


class EvalMetricMemoryError(RuntimeError):
    """An eval metric update that cannot fit even one sample at a time (not an OOM to Composer's
    eval loop, which would wait for the other ranks in a retry they never start)."""


def _restore(metric: Any, state: dict) -> None:
    for key, value in state.items():
        setattr(metric, key, copy.deepcopy(value))


def _pieces(split_batch: Callable[[Any, int], Any], batch: Any, size: int, total: int) -> list[tuple[int, int, Any]]:
    """(start, length, part) for `batch` split by the evaluator's own splitter into parts of `size`."""
    parts, start = [], 0
    for part in split_batch(batch, size):
        length = leading_size(part)
        parts.append((start, length, part))
        start += length
    if start != total:
        raise EvalMetricMemoryError(
            f"automicro: an eval metric ran out of memory and its batch of {total} samples could not be split "
            f"into pieces (they hold {start}); lower device_eval_batch_size"
        )
    return parts


def _split_outputs(outputs: Any, start: int, stop: int, total: int) -> Any:
    """Samples start..stop of a model's eval outputs: tensors (and lists) whose first dimension is
    the microbatch's samples are sliced, everything else is passed as is."""
    if isinstance(outputs, torch.Tensor):
        return outputs[start:stop] if outputs.dim() and outputs.shape[0] == total else outputs
    if isinstance(outputs, dict):  # also transformers' ModelOutput (a dict that keeps its class)
        piece = copy.copy(outputs)
        for key, value in outputs.items():
            piece[key] = _split_outputs(value, start, stop, total)
        return piece
    if isinstance(outputs, (list, tuple)):
        if any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in outputs):
            return type(outputs)(_split_outputs(v, start, stop, total) for v in outputs)
        return outputs[start:stop] if len(outputs) == total else outputs
    return outputs


def _merge_metric_outputs(results: list[Any]) -> Any:
    """What the pieces' updates returned, as one update would (dicts of lists joined)."""
    if results and all(isinstance(r, dict) for r in results):
        merged: dict[str, Any] = {}
        for result in results:
            for key, value in result.items():
                if isinstance(value, list) and isinstance(merged.get(key), list):
                    merged[key] = merged[key] + value
                else:
                    merged.setdefault(key, value)
        return merged
    return results[-1] if results else None


def leading_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        size = leading_size(value)
        if size:
            return size
    return 0


class EvalFence:
    """Every eval forward fenced like a training attempt, and one `EvalSearch` per evaluator label.

    Composer's eval loop reruns a batch when the forward raises "CUDA out of memory" on any rank,
    at the size the evaluator's search chose. Under FSDP2 that alone would deadlock (a rank that
    failed skips all-gathers the others wait in); here every rank agrees through the consensus
    first, the FSDP2 state is recovered, the batch's metric updates are rolled back, and only then
    does every rank raise the OOM that Composer's retry expects.

    `info` prints a console line; `count_oom` counts a failed attempt (the callback's
    `ooms_total`); `make_config` the search config of a new evaluator's search."""

    def __init__(
        self,
        info: Callable[[str], None],
        count_oom: Callable[[], None],
        make_config: Callable[[], search.PolicyConfig],
    ) -> None:
        self._info, self._count_oom, self._make_config = info, count_oom, make_config
        self.searches: dict[str, EvalSearch] = {}
        self.pinned: dict[str, int] = {}  # label -> pinned size, for evaluators not set to `auto`
        self._resumed: dict[str, Any] = {}  # label -> a checkpoint's search, taken up at its first batch
        self.guarded = False  # guard() installed: eval forwards are fenced
        self.running = False  # between EVAL_START and EVAL_END
        self._fence: Optional[AttemptFence] = None
        self._sites: Optional[SiteDispatcher] = None
        self._recover: Callable[[], None] = lambda: None
        self._hooks_active: Callable[[], bool] = lambda: False
        self._metrics: dict[str, Any] = {}
        self._snapshot: dict[str, Any] = {}
        self._search: Optional[EvalSearch] = None
        self._evaluator: Any = None
        self._split_batch: Callable[[Any, int], Any] = lambda batch, size: [batch]
        self._empty_cache: Callable[[], None] = lambda: None
        self._memory: Callable[[], MemorySource] = NoMemory
        self._after_failure: Callable[[tuple[int, int], str], None] = lambda left_behind, what: None
        self._where = "eval"  # the eval batch in progress, for the line about memory left behind
        self.metric_pieces = 0  # metric updates run in pieces after an OOM (see `guard_metric`)
        self._pieces_said: set[str] = set()

    def attach(
        self,
        fence: AttemptFence,
        sites: SiteDispatcher,
        recover: Callable[[], None],
        hooks_active: Callable[[], bool],
        empty_cache: Callable[[], None] = lambda: None,
        memory: Callable[[], MemorySource] = NoMemory,
        after_failure: Callable[[tuple[int, int], str], None] = lambda left_behind, what: None,
    ) -> None:
        """The training attempt's fence and sites; `recover` brings the model back after a failure,
        `empty_cache` returns the allocator's free blocks; `memory` is this rank's memory source,
        and `after_failure` gets (before a failed eval attempt, after its wipe) and the eval
        batch it was, as a training attempt's are checked (`MemoryTruth.after_failure`)."""
        self._fence, self._sites, self._recover, self._hooks_active = fence, sites, recover, hooks_active
        self._empty_cache, self._memory, self._after_failure = empty_cache, memory, after_failure

    def state_dict(self) -> dict[str, Any]:
        """Each evaluator's search, for checkpoints: a resumed run does not search its eval sizes again."""
        return {
            label: {"policy": s.policy.state.to_dict(), "batches": s.batches}
            for label, s in self.searches.items()
            if s.policy is not None
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = dict(state or {})

    def pin(self, label: str, size: int) -> None:
        """Evaluator `label` runs at its pinned `size`, split further only after an eval OOM."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"evaluator '{label}': device_eval_microbatch_size={size!r} must be an int >= 1")
        self.pinned[label] = size

    @property
    def found_sizes(self) -> dict[str, Optional[int]]:
        return {label: s.found_size for label, s in self.searches.items()}

    # ---- Composer's eval events ------------------------------------------------------------------

    def batch_start(self, state: Any) -> None:
        """EVAL_BATCH_START: snapshot the metrics, and split the batch by its evaluator's search."""
        metrics = state.eval_metrics.get(state.dataloader_label, {}) if state.dataloader_label else {}
        self._metrics = metrics
        self._snapshot = {name: copy.deepcopy(m.metric_state) for name, m in metrics.items()}
        label = state.dataloader_label or ""
        timestamp = getattr(state, "eval_timestamp", None)
        self._where = f"eval '{label}' batch {int(timestamp.batch) if timestamp is not None else '?'}"
        evaluator = next((e for e in state.evaluators if e.label == label), None)
        self._evaluator, self._search = evaluator, None
        split = getattr(getattr(evaluator, "dataloader", None), "split_batch", None)  # the evaluator's DataSpec
        self._split_batch = split if callable(split) else (lambda batch, size: [batch])
        if evaluator is not None and evaluator.auto_microbatching:
            if label not in self.searches:
                self.searches[label] = EvalSearch(label, self._make_config(), cap=self.pinned.get(label))
            self._search = self.searches[label]
            self._search.batch_start(evaluator, leading_size(state.batch), self._resumed.pop(label, None))

    def batch_end(self) -> None:
        search_ = self._search
        if search_ is None:
            return
        found_before = search_.found_size
        record = search_.batch_end()
        found = search_.found_size
        if record is not None and found is not None and found != found_before:
            if search_.cap is None and found_before is None:
                self._info(
                    f"eval '{search_.label}': microbatch size found: {found} "
                    f"(per-rank eval batch {sum(record.split)}); split in use {list(record.split)}"
                )
            elif search_.cap is not None and any(r.outcome == "oom" for r in search_.history):
                # One line each time a pinned evaluator settles below what it was running at.
                batch_size = sum(record.split)
                split = search.chunk_split(batch_size, _chunk_for(batch_size, found, True))
                self._info(
                    f"eval '{search_.label}': out of memory at device_eval_microbatch_size={search_.cap}; "
                    f"{found} fit on every rank, so its batches of {batch_size} now run as {list(split)}"
                )
        self._search = None

    # ---- the fence -------------------------------------------------------------------------------

    def guard(self, eval_forward: Callable[..., Any]) -> Callable[..., Any]:
        """`eval_forward` fenced during eval (Composer also calls it for training metrics, inside a
        training attempt that is already fenced: then it runs as is)."""
        self.guarded = True

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if not self.running:
                return eval_forward(*args, **kwargs)
            assert self._fence is not None and self._sites is not None, "attach() first"
            context = self._sites.context
            context.microbatch_size = leading_size(args[0] if args else None)
            context.num_microbatches, context.microbatch_index = 1, 0
            context.last_site, context.last_module = "eval_forward", ""
            sites = self._sites

            def body(finish: Callable[[], None]) -> Any:
                sites.fire("eval_forward", "")
                return eval_forward(*args, **kwargs)

            mark = mark_attempt(self._memory())
            result = self._fence.run(body, self._wipe_failed, self._hooks_active())
            if result.unreported is not None:
                raise result.unreported
            if result.verdict.failed:  # what the failed attempt left allocated after its wipe: nothing
                self._after_failure(left_after_wipe(self._memory(), mark), self._where)
            if result.own_error is not None:
                self._count_oom()
                raise result.own_error
            if result.verdict.failed:
                self._raise_failure(result.verdict)
            return result.value

        return guarded

    def guard_metric(self, model: Any) -> Callable[..., Any]:
        """`update_metric` made safe during eval: Composer calls it after the fenced forward, outside
        any attempt, once per metric and rank (a rank may skip it on a padded last batch, so it
        cannot hold a consensus round). An OOM in it (a vocabulary-wide softmax over the logits, at
        a microbatch the forward fit) is kept on this rank: the metric's state is put back and the
        update runs again over pieces of the microbatch, halved until they fit (the metric's result
        does not depend on how its samples are grouped, as for Composer's own eval split). Even one
        sample at a time running out is a plain error, which stops the run on every rank. Returns
        the guarded `model.update_metric`."""
        update_metric = model.update_metric

        def guarded(batch: Any, outputs: Any, metric: Any) -> Any:
            if not self.running:
                return update_metric(batch, outputs, metric)
            before = copy.deepcopy(metric.metric_state)
            try:
                return update_metric(batch, outputs, metric)
            except Exception as error:  # noqa: BLE001 - only an OOM is handled, below
                if not is_oom(error):
                    raise
            # Outside the except block: the error and its frames (the update's tensors) are gone.
            return self._update_in_pieces(model, update_metric, batch, outputs, metric, before)

        return guarded

    def _update_in_pieces(
        self, model: Any, update_metric: Callable[..., Any], batch: Any, outputs: Any, metric: Any, before: dict
    ) -> Any:
        total = leading_size(batch)
        size = max(1, total // 2)
        while True:
            _restore(metric, before)
            self._empty_cache()
            try:
                results = []
                for start, length, part in _pieces(self._split_batch, batch, size, total):
                    with composer_internals.eval_labels_of_samples(model, start, start + length, total):
                        results.append(update_metric(part, _split_outputs(outputs, start, start + length, total), metric))
            except Exception as error:  # noqa: BLE001
                if not is_oom(error):
                    raise
                if size == 1:
                    _restore(metric, before)
                    raise EvalMetricMemoryError(
                        f"automicro: the eval metric {type(metric).__name__} ran out of memory even one sample at a "
                        "time (the forward fit): lower device_eval_batch_size, or compute the metric on fewer logits"
                    ) from None
                size = max(1, size // 2)
                continue
            self.metric_pieces += 1
            name = type(metric).__name__
            if name not in self._pieces_said:  # one line per metric
                self._pieces_said.add(name)
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                print(  # on the rank it happened on (the others may not know of it)
                    f"[automicro] rank {rank}: eval metric {name} ran out of memory over a microbatch of {total} "
                    f"samples; updated in pieces of {size} (the forward was not rerun)",
                    flush=True,
                )
            return _merge_metric_outputs(results)

    def _wipe_failed(self) -> None:
        for name, metric in self._metrics.items():
            for key, value in self._snapshot.get(name, {}).items():
                setattr(metric, key, copy.deepcopy(value))
        self._recover()

    def _raise_failure(self, verdict: Verdict) -> None:
        self._count_oom()
        if verdict.error_ranks:
            raise FailedOnOtherRank(
                f"automicro: rank(s) {verdict.error_ranks} failed with a non-OOM error during eval; "
                "see that rank's traceback for the cause"
            )
        if self._search is not None and self._evaluator is not None:
            # Raises CannotFitError (not an OOM to Composer's eval loop) below the smallest size.
            record = self._search.failed(self._evaluator, verdict.failed_ranks, verdict.sites)
            self._info(f"eval '{self._search.label}': {record.console_line()}")
        else:
            self._info(f"eval: out of memory on rank(s) {verdict.failed_ranks} at {verdict.sites}; Composer retries")
        # The message is the one Composer's eval loop recognises as an OOM to retry.
        raise OOMOnOtherRank(
            f"CUDA out of memory encountered on rank(s) {verdict.failed_ranks} at {verdict.sites} during eval (automicro)"
        )
