"""The attempt fence: one attempt of a batch (or of an eval forward), run on every rank, ending
in one verdict every rank agrees on. Training and eval both run through `AttemptFence.run`.

Owns: the attempt context flag, catching every failure, the order of the failure path (stop
issuing collectives, wipe, bring the collective sequence back in step, agree), and the
end-of-attempt agreement. May not touch: Composer (the caller passes the body and the wipe as
callables), the search policy, FSDP2 internals (the wipe is the caller's `recover()`).

The failure path, the same with the sync hooks on or off:
1. the rank stops: it tells the collective ledger it issues nothing more in this attempt (and,
   when it failed itself, raises the flag the other ranks check before their next collective);
2. it wipes what the attempt left (outputs, grads, FSDP2 state, allocator cache) and drops the
   failed attempt's stack frames, so the memory the attempt held is free before anything else;
3. with the hooks off, it replays what the others issued and it did not (`CollectiveLedger.
   catch_up`): afterwards every rank's collective sequence is in step. With the hooks on there is
   nothing to replay: no rank issued a collective the others had not agreed to;
4. it joins the consensus, which every rank can now reach.
Where the ranks share no board (several nodes), step 3 comes after step 4: the verdict carries how
many collectives each rank issued and the ranks behind replay the record of the rank ahead
(`CollectiveLedger.align`). That needs every rank to reach the consensus, which NCCL's
asynchronous collectives allow and gloo's blocking ones do not (there, the consensus times out
and the job stops naming the rank, site and batch).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Optional, TypeVar

import torch

from automicro.core.consensus import (
    KIND_ERROR,
    KIND_OOM,
    Consensus,
    FailedOnOtherRank,
    LocalFigures,
    OOMOnOtherRank,
    Verdict,
)
from automicro.core.ledger import CollectiveLedger, FatalRecoveryError
from automicro.core.sites import AttemptContext

T = TypeVar("T")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and the errors it was raised from (torch's pipeline stages re-raise a failed forward
    or backward as a RuntimeError ``from`` the original)."""
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__


def is_oom(error: BaseException) -> bool:
    """An out-of-memory error, also one re-raised under another type."""
    for each in _chain(error):
        if isinstance(each, (torch.OutOfMemoryError, OOMOnOtherRank)):
            return True
        text = str(each)
        if "CUDA out of memory" in text or "CUDA error: out of memory" in text:
            return True
    return False


@dataclass
class RandomState:
    """torch's CPU and device random states at the start of a batch. Every retry restores them, so
    dropout and other random ops draw what the first attempt drew: a retry at the same split is
    the attempt that would have run without the failure, bit for bit."""

    cpu: torch.Tensor
    device: Optional[torch.device] = None
    device_state: Optional[torch.Tensor] = None

    @classmethod
    def capture(cls, device: torch.device) -> "RandomState":
        if device.type == "cuda":
            return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
        return cls(torch.get_rng_state())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_state is not None:
            torch.cuda.set_rng_state(self.device_state, self.device)


@dataclass
class AttemptResult(Generic[T]):
    """What one attempt came to on this rank.

    verdict: what every rank agreed. value: the body's return value (success only).
    own_error: this rank's own non-OOM error, to re-raise once the failure is recorded.
    unreported: an exception this rank raised although no rank reported a failure (never a
    success; the caller re-raises it). replayed: collectives replayed to get back in step.
    """

    verdict: Verdict
    value: Optional[T]
    own_error: Optional[BaseException]
    unreported: Optional[BaseException]
    seconds: float
    replayed: int = 0


class AttemptFence:
    """Runs attempts under the consensus protocol; Composer-free, testable with a fake consensus."""

    def __init__(
        self,
        consensus: Consensus,
        context: AttemptContext,
        figures: Callable[[], LocalFigures],
        ledger: Optional[CollectiveLedger] = None,
        recovery_timeout_s: float = 120.0,
        alarm: Any = None,
    ) -> None:
        self.consensus = consensus
        self.context = context
        self.figures = figures
        self.ledger = ledger
        self.recovery_timeout_s = recovery_timeout_s
        # Without a ledger (steady_recovery off): the job-lost alarm (`automicro.core.alarm`) tells
        # the ranks left in a collective which rank failed first, so each names it on its last line.
        self.alarm = alarm

    def run(
        self,
        body: Callable[[Callable[[], None]], T],
        wipe: Callable[[], None],
        hooks_active: bool,
    ) -> AttemptResult[T]:
        """Run `body(finish)` as one attempt.

        `body` must call `finish()` once its forward/backward work is done and before anything
        that cannot be undone (the optimizer step, AFTER_TRAIN_BATCH collectives); when it
        returns without calling it, the fence does. `finish()` raises `OOMOnOtherRank` when
        another rank failed. `wipe()` undoes the attempt on this rank; it runs on every rank of a
        failed attempt, before the consensus.
        """
        context = self.context
        batch = context.batch_index
        verdict: Optional[Verdict] = None

        def finish() -> None:
            nonlocal verdict
            context.in_attempt = False
            if self.ledger is not None:
                self.ledger.stop(failed_here=False, site=context.last_site)
            verdict = self.consensus.finish(self._report())
            self._align(verdict, context.last_site, batch)
            if verdict.failed:
                raise OOMOnOtherRank("automicro: another rank failed this attempt")

        self.consensus.begin_attempt()
        if self.ledger is not None:
            self.ledger.begin_attempt(stop_early=not hooks_active)
        started = time.perf_counter()
        context.in_attempt = True
        try:
            value = body(finish)
            if verdict is None:
                finish()
        except FatalRecoveryError:
            raise  # the job is lost: nothing to agree on any more
        except BaseException as error:  # noqa: BLE001 - every failure must reach the consensus
            context.in_attempt = False
            if verdict is not None:
                if verdict.failed:  # agreed at finish(): only the wipe is left
                    _drop_frames(error)
                    wipe()
                    return AttemptResult(verdict, None, None, None, time.perf_counter() - started)
                # Raised after every rank agreed the attempt succeeded: not a failure to agree on.
                return AttemptResult(verdict, None, None, error, time.perf_counter() - started)
            return self._failed(error, wipe, hooks_active, batch, started)
        finally:
            context.in_attempt = False
        assert verdict is not None
        return AttemptResult(verdict, value, None, None, time.perf_counter() - started)

    def _failed(
        self, error: BaseException, wipe: Callable[[], None], hooks_active: bool, batch: int, started: float
    ) -> AttemptResult:
        site = self.context.last_site
        # Also when re-raised under another type (torch's pipeline stages wrap errors `from` them).
        followed = _caused_by(error, (OOMOnOtherRank, FailedOnOtherRank))
        oom = is_oom(error)
        own_error = None if followed or oom else error
        if self.ledger is not None:
            self.ledger.stop(failed_here=not followed, site=site)
        agreed: Optional[Verdict] = getattr(error, "agreed", None)
        if own_error is None:
            _drop_frames(error)
        wipe()
        if agreed is not None:
            # A pipeline barrier's round was already the agreement (`Consensus.barrier`).
            return AttemptResult(agreed, None, None, None, time.perf_counter() - started)
        heard = self._heard(hooks_active)
        if heard is not None and own_error is not None:
            # This rank's error is the collective a rank that failed first left (gloo: "Connection
            # closed by peer"): name that rank, not this one.
            lost = FatalRecoveryError(heard)
            lost.oom = False  # type: ignore[attr-defined] # not this size's fault: no failure note
            raise lost from error
        replayed = 0
        if not hooks_active and self.ledger is not None and self.ledger.live:
            replayed = self.ledger.catch_up(self.recovery_timeout_s, site, batch)
        kind = KIND_OOM if own_error is None else KIND_ERROR
        timeout = None if hooks_active else self.recovery_timeout_s
        try:
            verdict = self.consensus.fail(kind, site, self._report().reached(), own_code_zero=followed, timeout_s=timeout)
        except RuntimeError as timeout_error:
            why = (
                f"the other ranks did not reach the consensus within {timeout} s ({timeout_error}); a rank blocked "
                "in a collective it waits for this rank to issue cannot be reached without a shared board"
            )
            if not hooks_active and self.ledger is not None:
                raise self.ledger.lost(site, batch, why) from timeout_error
            heard = self._heard(hooks_active)
            if heard is not None:
                raise FatalRecoveryError(heard) from timeout_error
            message = (
                f"automicro: rank {self.consensus.rank} failed at {site} in batch {batch}: {why}. Stopping this rank; "
                "the launcher stops the rest."
            )
            if not hooks_active and self.alarm is not None:
                self.alarm.ring(message)
                raise FatalRecoveryError(message) from timeout_error
            raise RuntimeError(message) from timeout_error
        replayed += self._align(verdict, site, batch)
        unreported = None if verdict.failed else error
        return AttemptResult(verdict, None, own_error, unreported, time.perf_counter() - started, replayed)

    def _heard(self, hooks_active: bool) -> Optional[str]:
        """What another rank rang the job-lost alarm with (hooks off, no ledger), as this rank's line."""
        if hooks_active or self.ledger is not None or self.alarm is None or not self.alarm.heard:
            return None
        return f"automicro: rank {self.consensus.rank} stops: {self.alarm.heard}"

    def _report(self) -> LocalFigures:
        """This rank's figures, with the collectives it issued in the attempt (the consensus
        compares them where no ledger board lets a rank catch up)."""
        figures = self.figures()
        if self.ledger is not None:
            figures.collectives = self.ledger.issued
        return figures

    def _align(self, verdict: Verdict, site: str, batch: int) -> int:
        """Where no board let a rank catch up before the consensus (several nodes): bring every
        rank's collective sequence in step now, from the counts the verdict carries."""
        if self.ledger is None or self.ledger.live or not verdict.failed:
            return 0
        return self.ledger.align([r.collectives for r in verdict.reports], site, batch)


def _caused_by(error: BaseException, types: tuple[type, ...]) -> bool:
    return any(isinstance(each, types) for each in _chain(error))


def _drop_frames(error: BaseException) -> None:
    """Release the locals (activations) of the failed attempt's frames; the traceback stays printable."""
    for each in _chain(error):  # also the errors it was raised from
        if each.__traceback__ is not None:
            traceback.clear_frames(each.__traceback__)


__all__ = ["AttemptFence", "AttemptResult", "RandomState", "is_oom"]
