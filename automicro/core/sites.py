"""Fault/sync sites and the per-attempt context every site sees.

The site names are a public contract (`automicro.testing.FaultInjector` takes them):
`forward_pre`, `forward`, `backward_pre`, `backward`, `unshard_alloc`, `reduce_scatter_alloc`,
`loss`, `optimizer_step`, `eval_forward`; with a pipeline also `backward_input`, `backward_weight`.

Owns: the site names, `AttemptContext` and `SiteDispatcher`. There is no process-wide dispatcher:
`automicro.Trainer` creates one per trainer and hands it, at attach time, to `AutoMicrobatching`
(which fires the sites and runs the sync hooks on it) and to every callback that listens at sites
(a callback with an `attach_sites(dispatcher)` method, such as `FaultInjector`). Two trainers in
one process therefore never see each other's attempts. May not touch: torch, Composer.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

SITES = (
    "forward_pre",
    "forward",
    "backward_pre",
    "backward",
    "unshard_alloc",
    "reduce_scatter_alloc",
    "loss",
    "optimizer_step",
    "eval_forward",
)
# A pipeline stage's input-gradient (dI; the whole backward under 1F1B) and weight-gradient (dW,
# zero-bubble schedules) steps, fired by the pipeline executor before each (`engine.pipeline`).
PIPELINE_SITES = ("backward_input", "backward_weight")
# Extra places a real failure can be attributed to; not accepted by the fault injector.
# "between_batches": outside any attempt (a callback, a checkpoint save, a fixed-size eval).
INTERNAL_SITES = ("all_reduce_alloc", "other", "between_batches")
# Appended after the older names: the indices dashboards log (`automicro/last_oom_site`) stay put.
ALL_SITES = SITES + INTERNAL_SITES + PIPELINE_SITES
# What `automicro.testing.FaultInjector` accepts.
INJECTABLE_SITES = SITES + PIPELINE_SITES


def site_index(site: str) -> int:
    return ALL_SITES.index(site) if site in ALL_SITES else ALL_SITES.index("other")


@dataclass
class AttemptContext:
    """Where the current attempt is: read by fault injectors and failure reports."""

    batch_index: int = 0
    attempt: int = 0
    microbatch_size: int = 0
    num_microbatches: int = 0
    microbatch_index: int = -1
    last_site: str = "other"
    last_module: str = ""
    in_attempt: bool = False


Listener = Callable[[str, str, AttemptContext], None]


@dataclass
class SiteDispatcher:
    """Calls listeners (fault injectors, sync hooks) at a site, lowest priority first."""

    context: AttemptContext = field(default_factory=AttemptContext)
    _listeners: list[tuple[int, int, Listener]] = field(default_factory=list)
    _wanted: dict[int, frozenset[str]] = field(default_factory=dict)
    _counter: int = 0

    def add(self, listener: Listener, priority: int, sites: Iterable[str] = ALL_SITES) -> Callable[[], None]:
        """Call `listener` at every fired site; `sites` says which ones it acts on (see `listens`)."""
        self._counter += 1
        entry = (priority, self._counter, listener)
        bisect.insort(self._listeners, entry, key=lambda e: (e[0], e[1]))
        self._wanted[self._counter] = frozenset(sites)

        def remove() -> None:
            if entry in self._listeners:
                self._listeners.remove(entry)
                self._wanted.pop(entry[1], None)

        return remove

    def fire(self, site: str, module: str = "") -> None:
        self.context.last_site = site
        self.context.last_module = module
        for _, _, listener in list(self._listeners):
            listener(site, module, self.context)

    def listens(self, site: str) -> bool:
        """Whether a listener acts on `site`: sites that exist only for listeners (`loss`) are
        fired only then, so they never overwrite `context.last_site` for nothing."""
        return any(site in wanted for wanted in self._wanted.values())

    def __len__(self) -> int:
        return len(self._listeners)


# Priorities: fault injection runs before the consensus sync at the same site, as a real
# allocation failure happens before the rank could reach the sync point.
PRIORITY_FAULT = 0
PRIORITY_SYNC = 100
