"""`FaultInjector`: raise an exception at an exact site, rank, microbatch and size.

A Composer callback, usable from YAML::

    callbacks:
      fault_injector:
        site: backward_pre
        module: blocks.1
        ranks: [1]
        above: 5

Raises at `site` of the FSDP2 module named `module` (names as in `model.named_modules()` of the
model given to the Trainer; None = every FSDP module) on `ranks` (None = all), only while the
microbatch size is > `above`, at microbatch `microbatch_index` (None = any; -1 = the last), only
in batch `batch` (Composer's `timestamp.batch`, counted from 0; None = any), at most `times`
times. With `batch` late enough the fault hits after the sync hooks came off (the steady phase). The default exception is a `torch.OutOfMemoryError` whose message contains
"CUDA out of memory" and "injected".

`site: between_batches` raises outside any attempt, at Event.BATCH_END once `timestamp.batch`
equals `batch` (a callback or checkpoint save running out of memory).

Owns: the injector's conditions and its own site hooks. May not touch: the consensus (a fault
is an exception; the attempt fence does the rest); it is handed the trainer's sites at attach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from composer.core import Callback, State
from composer.loggers import Logger

from automicro.engine.hooks import SiteHooks
from automicro.core.sites import INJECTABLE_SITES, PRIORITY_FAULT, AttemptContext, SiteDispatcher

BETWEEN_BATCHES = "between_batches"

MODULE_SITES = frozenset({"forward_pre", "forward", "backward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc"})


class InjectedFault(RuntimeError):
    """The default non-OOM exception when `exception="error"` is asked for."""


def _default_oom(site: str, module: str, rank: int, size: int) -> BaseException:
    return torch.OutOfMemoryError(
        f"CUDA out of memory (injected by automicro.testing.FaultInjector at {site}"
        f"{':' + module if module else ''} on rank {rank}, microbatch size {size})"
    )


class FaultInjector(Callback):
    """Raise at a fault site (see `automicro.core.sites.SITES`) under exact conditions.

    Args:
        site: Where: ``forward_pre``, ``forward``, ``backward_pre``, ``backward``, ``unshard_alloc``,
            ``reduce_scatter_alloc``, ``loss``, ``optimizer_step``, or ``between_batches`` (with ``batch``).
        module: At the module sites, only in modules of this name (null: any).
        ranks: Only on these ranks (null: every rank).
        above: Only in microbatches of more than this many samples (null: any size).
        microbatch_index: Only in this microbatch of an attempt (-1: the last; null: any).
        times: Raise this many times in all (null: every time the conditions hold).
        exception: ``oom`` (default: a CUDA-style out-of-memory error), ``error`` (another error) or a
            callable that returns the exception to raise.
        batch: Only in this batch (the trainer's batch count; null: any).
    """

    def __init__(
        self,
        site: str,
        module: Optional[str] = None,
        ranks: Optional[list[int]] = None,
        above: Optional[int] = None,
        microbatch_index: Optional[int] = None,
        times: Optional[int] = None,
        exception: Any = None,
        batch: Optional[int] = None,
    ) -> None:
        if site not in INJECTABLE_SITES and site != BETWEEN_BATCHES:
            raise ValueError(f"FaultInjector: site={site!r}: must be one of {list(INJECTABLE_SITES) + [BETWEEN_BATCHES]}")
        if site == BETWEEN_BATCHES and batch is None:
            raise ValueError("FaultInjector: site='between_batches' needs batch (the timestamp.batch at Event.BATCH_END)")
        if module is not None and site not in MODULE_SITES:
            raise ValueError(f"FaultInjector: module={module!r} only applies to the module sites {sorted(MODULE_SITES)}")
        if ranks is not None and (not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) and r >= 0 for r in ranks)):
            raise ValueError(f"FaultInjector: ranks={ranks!r}: must be a list of ranks (ints >= 0) or null for all")
        for name, value, low in (("above", above, 0), ("times", times, 1), ("batch", batch, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"FaultInjector: {name}={value!r}: must be an int >= {low} or null")
        if microbatch_index is not None and (isinstance(microbatch_index, bool) or not isinstance(microbatch_index, int) or microbatch_index < -1):
            raise ValueError(f"FaultInjector: microbatch_index={microbatch_index!r}: must be an int >= -1 (-1 = last) or null")
        if exception not in (None, "oom", "error") and not callable(exception):
            raise ValueError("FaultInjector: exception must be 'oom' (default), 'error', or a callable returning one")
        self.site = site
        self.module = module
        self.ranks = None if ranks is None else set(ranks)
        self.above = above
        self.microbatch_index = microbatch_index
        self.times = times
        self.batch = batch
        self.exception = exception
        self.fired = 0
        self._dispatcher: Optional[SiteDispatcher] = None  # the trainer's, from attach_sites()
        self._site_hooks: Optional[SiteHooks] = None
        self._remove_listener: Optional[Callable[[], None]] = None
        self._rank = 0
        self._armed_between_batches = False

    def attach_sites(self, sites: SiteDispatcher) -> None:
        """Called by `automicro.Trainer` before fit: the trainer's dispatcher and attempt context."""
        self._dispatcher = sites

    # ---- conditions --------------------------------------------------------------------------

    def _matches(self, site: str, module: str, context: AttemptContext) -> bool:
        if site != self.site or not context.in_attempt and site != "eval_forward":
            return False
        if self.module is not None and module != self.module:
            return False
        if self.ranks is not None and self._rank not in self.ranks:
            return False
        if self.above is not None and context.microbatch_size <= self.above:
            return False
        if self.batch is not None and context.batch_index != self.batch:
            return False
        if self.microbatch_index is not None:
            wanted = context.num_microbatches - 1 if self.microbatch_index == -1 else self.microbatch_index
            if context.microbatch_index != wanted:
                return False
        if self.times is not None and self.fired >= self.times:
            return False
        return True

    def _make(self, site: str, module: str, context: AttemptContext) -> BaseException:
        if self.exception in (None, "oom"):
            return _default_oom(site, module, self._rank, context.microbatch_size)
        if self.exception == "error":
            return InjectedFault(f"injected error at {site} on rank {self._rank}")
        return self.exception()

    def _listener(self, site: str, module: str, context: AttemptContext) -> None:
        if self._matches(site, module, context):
            self.fired += 1
            context.last_site, context.last_module = site, module
            raise self._make(site, module, context)

    def _fire_own(self, site: str, module: str) -> None:
        # The injector's own module hooks call only the injector (the sync hooks fire the
        # dispatcher themselves), so no site runs its consensus twice.
        if site == self.site:
            assert self._dispatcher is not None
            self._listener(site, module, self._dispatcher.context)

    # ---- Composer events ---------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.site == BETWEEN_BATCHES:
            self._rank = dist.get_rank() if dist.is_initialized() else 0
            self._armed_between_batches = True
            return
        if self._dispatcher is None:
            raise ValueError(
                f"FaultInjector(site={self.site!r}) needs automicro.Trainer, which hands it the attempt context "
                "(`from automicro import Trainer`); with composer.Trainer it would never fire"
            )
        self.arm(self._dispatcher, state.model)

    def arm(self, sites: SiteDispatcher, model: Any = None) -> None:
        """Listen at `sites` (an `AutoStep`'s `sites`, outside Composer); `model`, sharded by automicro's
        engine or adopted by `AutoStep`, for the module sites. `close_hooks()` takes it off."""
        self._dispatcher = sites
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        if self.site == BETWEEN_BATCHES:
            raise ValueError("FaultInjector: site='between_batches' is a Composer event; outside Composer raise it yourself")
        if self._remove_listener is None and self.site not in MODULE_SITES:
            self._remove_listener = self._dispatcher.add(self._listener, PRIORITY_FAULT, sites=(self.site,))
        if self.site in MODULE_SITES and self._site_hooks is None:
            from automicro.engine import sharded_of

            sharded = sharded_of(model)
            if sharded is None:
                raise ValueError("FaultInjector: module sites need a model sharded by automicro's engine")
            if self.module is not None and self.module not in dict(sharded.named_fsdp_modules):
                names = [n for n, _ in sharded.named_fsdp_modules]
                raise ValueError(f"FaultInjector: module={self.module!r} is not an FSDP2 module; choose one of {names}")
            self._site_hooks = SiteHooks(sharded, self._fire_own)
            self._site_hooks.install()

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self._armed_between_batches or int(state.timestamp.batch) != self.batch:
            return
        if (self.ranks is not None and self._rank not in self.ranks) or (self.times is not None and self.fired >= self.times):
            return
        self.fired += 1
        if self.exception == "error":
            raise InjectedFault(f"injected error between batches on rank {self._rank}")
        if callable(self.exception):
            raise self.exception()
        raise torch.OutOfMemoryError(
            f"CUDA out of memory (injected by automicro.testing.FaultInjector between batches on rank {self._rank}, "
            f"after batch {self.batch})"
        )

    def fit_end(self, state: State, logger: Logger) -> None:
        self.close_hooks()

    def close(self, state: State, logger: Logger) -> None:
        # `trainer.close()` after a fit that raised: fit_end did not run.
        self.close_hooks()

    def close_hooks(self) -> None:
        if self._site_hooks is not None:
            self._site_hooks.remove()
            self._site_hooks = None
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
