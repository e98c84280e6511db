"""What dynamo did to the compiled model while the run trains: where it broke a graph, and graphs compiled after the
configuration was final.

A graph break leaves the code between the broken graphs eager. A routed model's experts are where they are found
today (CPU, each decoder block compiled with ``aot_eager``: transformers 4.51's expert loop on torch 2.7, "Dynamic
shape operator"; transformers 5.17's grouped products on torch 2.11, "Backend compiler exception:
aten._local_scalar_dense.default"; none on torch 2.15 with transformers 5.24). One line says each new reason once,
with how many times it was traced, and where to look (``TORCH_LOGS=graph_breaks``). Nothing is decided from the line:
the eager work between the breaks is what the batch profile counts as work a compile could fuse, the whole-model
compile trial's bound (`automicro.batch.batch_profile`), and that trial's own line says the breaks its compile traced
(`automicro.batch.compile_scope`).

A graph compiled after the configuration's final batch (the trial plan's first batch with nothing left to try) is a
compile the run did not plan for: a new shape, or a guard that failed (on a routed model, one on what the router sent where). The first
`SAID_LATE` such batches are said, with the graphs and the batch; later ones are counted (`late_graphs`).

Owns: these lines and their counts. May not touch: the compile, the trials, the search.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from automicro.engine.compile import compiled_graphs, graph_breaks

SAID_LATE = 3  # batches with graphs compiled after the configuration was final that are said (the rest counted)
REASON_CHARS = 160


class CompileWatch:
    """Asked after each clean training batch (`after_batch`). What dynamo broke or compiled before the watch was made
    (another model's compile in the process) is not this run's."""

    def __init__(self, info: Callable[[str], None], breaks: Callable[[], dict[str, int]] = graph_breaks,
                 graphs: Callable[[], int] = compiled_graphs) -> None:
        self.info, self._breaks, self._graphs = info, breaks, graphs
        self._before = dict(breaks())
        self._graphs_at = graphs()
        self.said: set[str] = set()  # the reasons said
        self.late: list[tuple[int, int]] = []  # (batch, graphs compiled in it) after the configuration was final

    @property
    def late_graphs(self) -> int:
        return sum(graphs for _, graphs in self.late)

    def traced(self) -> dict[str, int]:
        """This run's breaks by reason: how many times each was traced."""
        return {reason: count - self._before.get(reason, 0) for reason, count in self._breaks().items()
                if count > self._before.get(reason, 0)}

    def after_batch(self, batch: int, final_at: Optional[int]) -> None:
        """Batch `batch` ran clean; `final_at`: the first batch of the final configuration, or None while trials run."""
        graphs = self._graphs()
        compiled, self._graphs_at = graphs - self._graphs_at, graphs
        traced = self.traced()
        new = [reason for reason in traced if reason not in self.said]
        if new:
            self.said.update(new)
            reasons = "; ".join(f'"{_short(reason)}" ({traced[reason]}x)' for reason in sorted(new, key=lambda r: -traced[r]))
            self.info(f"compile: dynamo broke the compiled graphs ({reasons}); the code between the breaks runs eager "
                      "(TORCH_LOGS=graph_breaks says where)")
        # The final configuration's first batch may compile what the last trial undid (the static recompile's
        # dynamic graph again): from the batch after it on, nothing should compile.
        if final_at is not None and batch > final_at and compiled > 0:
            self.late.append((batch, compiled))
            if len(self.late) <= SAID_LATE:
                more = "" if len(self.late) < SAID_LATE else "; later ones are counted, not said"
                self.info(f"compile: {compiled} graph{'s' if compiled != 1 else ''} compiled in batch {batch}, after the "
                          f"configuration was final at batch {final_at} (a new shape or a guard that failed: "
                          f"TORCH_LOGS=recompiles says which){more}")


def _short(reason: str) -> str:
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."


__all__ = ["CompileWatch", "SAID_LATE"]
