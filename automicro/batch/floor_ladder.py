"""Below the floor: where microbatch size 1 runs out of memory again (the repeat that used to end the run), `auto`
steps a ladder of trades that change memory and not the numbers, and searches the size again in the same batch
(DESIGN.md, "What the search searches": its floor).

The rungs, the cheapest first (`automicro.core.layout.LayoutSearch.recompute_floor`): the fused head, where ``head:
auto`` made it the trials' and it is not on yet (the plain head's logits, their fp32 copy and gradient gone: at long
sequences on a large vocabulary they are what does not fit, and the fused head was faster on each of the five families
timed, `automicro.batch.trial_price`'s HEAD_EAGER_SAVED; one H100, Llama-3.2 1B's shape at 65,536 tokens a sample: size
1 ran out with full recompute and the plain head, `benchmarks/RESULTS.md`); then a kept ``no_recompute`` undone (back
to the checkpointing asked for); then, where the blocks recompute nothing, the selective rung (``recompute_op``: each
block keeps its matrix products' and attention's outputs and recomputes the rest, `automicro.engine.recompute`'s
``op``); then every block's forward recomputed (``recompute``: full). Each rung is taken
only where size 1 ran out on the one before, or where size 1 ran in the first batch but its peak with the optimizer
state that batch's step added does not fit (`TrainingSearch._ladder_on_projection`: the rung between batches, no OOM
spent; the host offload too, switched on before the next batch once the step's gradients are dropped). The blocks
carry the engine's recompute dial switched off from the start under `auto` (`automicro.engine.sharding.shard`'s ``checkpoint_switch``, which `automicro.Trainer` sets), so the
switch costs nothing until the ladder turns it, between two attempts (after the wipe), on every rank alike: the
decision is taken from the agreed verdict. With the blocks compiled, the switch sits in each block's hooks, outside its
compiled forward: nothing compiles again, and the backward runs each block's compiled forward once more. The whole
model compiled (`compile.scope: model` or Composer's `compile_config`) carries no switch: checkpointing switched on
inside a whole-model graph recomputes other values than its forward saved (torch 2.11 and 2.15), so where the compile
scope trial had kept the whole model, the blocks are compiled again first, and the trial is not run after the step.
The one-rank trial of the model unsharded (no blocks to checkpoint) is not run after it either.

After the step the size policy starts again (`automicro.core.policy.SearchPolicy`, a fresh state: the memory of a
batch is another one now) from the probe where the search can take it (two microbatch sizes in one attempt, the size
the memory line predicts next), else from where the run's search starts. Only where size 1 runs out again with the
blocks checkpointing does the run end, its message naming what was tried.

The last rung, only where the run asked for it (``offload: auto``, `automicro.batch.host_offload`): where size 1 still
runs out with every block recomputing, FSDP2's CPU offload of the parameters, gradients and optimizer state, switched on
between two attempts (`automicro.engine.offload`), and the size searched again; where size 1 ran with every block
recomputing but will not fit with the optimizer state the step added, before the next batch. Without it, the message
that ends the run says it was not asked for.

Not on the ladder: a pipeline stage (its stages are built with their checkpointing: set
``parallelism_config.fsdp2.activation_checkpointing: true``), a model without FSDP2 blocks, a model sharded without
the switch (a plain loop's own `fully_shard`: ``automicro.engine.shard(..., checkpoint_switch=True)`` gives it one);
the host offload where the layout's rungs cannot be taken (it is the last).

Owns: whether a rung is left, stepping it (the layout's floor, the scope and one-rank trials held off), its line,
the words of the message that ends a run with nothing left. May not touch: the size policy (the training search starts
it again), torch, Composer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from automicro.core.consensus import Verdict
from automicro.core.layout import FUSED_HEAD, NO_RECOMPUTE, RECOMPUTE, RECOMPUTE_OP
from automicro.batch.host_offload import RUNG as OFFLOAD_RUNG
from automicro.batch.host_offload import HostOffload
from automicro.batch.layout_trials import LayoutTrials

# What each rung is called in lines, the summary and the run-ending message.
RUNG = "activation checkpointing on"
RUNGS = {FUSED_HEAD: "the fused head on", NO_RECOMPUTE: "the checkpointing asked for back on", RECOMPUTE_OP: "selective recompute on", RECOMPUTE: RUNG}
WHY_OFF = "the blocks checkpoint their activations (the ladder below size 1 switched it on)"


def _rows(verdict: Verdict) -> str:
    return "; ".join(
        f"rank {r.rank} at {r.site}: peak {r.peak_bytes / 2**20:.1f} MiB of {r.capacity_bytes / 2**20:.1f} MiB"
        for r in verdict.reports if r.failed
    )


def _short(verdict: Verdict, projected: str, without: str) -> str:
    """How size 1 fell short: an OOM (the failed ranks' figures), or a peak that does not fit with the optimizer
    state the first step added (`projected`: the ranks' figures)."""
    if projected:
        return f"ran {without}, but its peak with the optimizer state the first step added does not fit ({projected})"
    return f"did not fit {without} ({_rows(verdict)})"


class FloorLadder:
    """One run's ladder. `layout`: the run's layout trials (None or without an engine: nothing to switch);
    `pipeline`: the run is a pipeline stage; `offload`: the host offload's rung (the last), where the run has one."""

    def __init__(self, layout: Optional[LayoutTrials], info: Callable[[str], None], pipeline: bool = False,
                 offload: Optional[HostOffload] = None) -> None:
        self.layout, self.info, self.pipeline, self.offload = layout, info, pipeline, offload
        self.stepped_at: Optional[int] = None  # the batch the rung was stepped in (this launch)
        self.last = ""  # the last rung stepped, in words (`RUNGS`)

    @property
    def stepped(self) -> bool:
        """The rung is on (this launch, or the checkpoint this run resumed from)."""
        return (self.layout is not None and bool(self.layout.search.floor)) or self._offloaded

    @property
    def _offloaded(self) -> bool:
        return self.offload is not None and self.offload.taken

    def why_not(self) -> Optional[str]:
        """Why no rung is left (None: one is)."""
        why = self._layout_why_not()
        if why is not None and self.offload is not None and self.offload.left:
            return None
        return why

    def _layout_why_not(self) -> Optional[str]:
        """Why no rung of the layout's is left (None: one is)."""
        if self.pipeline:
            return ("a pipeline stage's checkpointing is set when it is built: set "
                    "parallelism_config.fsdp2.activation_checkpointing: true")
        layout = self.layout
        if layout is None or layout.engine is None:
            return "the model has no FSDP2 blocks to checkpoint"
        if layout.search.head_rung_left:
            return None
        if NO_RECOMPUTE in layout.search.kept or (layout.engine.can_recompute and RECOMPUTE not in layout.search.kept):
            return None
        if layout.engine.recomputes:
            return "every block recomputes its forward already"
        return ("the blocks carry no checkpointing switch (the whole model is compiled, or the model was sharded "
                "without automicro.engine.shard(..., checkpoint_switch=True))")

    def step(self, batch_index: int, verdict: Verdict, scope: Any = None, sharding: Any = None,
             optimizers: Sequence[Any] = (), projected: str = "") -> Optional[str]:
        """Size 1 ran out again in batch `batch_index` (`verdict`: the agreed failure): the next rung, on every rank
        alike, and its line; None where none is left (`why_not`). `scope`, `sharding`: the run's compile scope and
        one-rank trials (held off after the step); `optimizers`: the run's (their state follows the host offload).
        `projected`: size 1 ran in that batch, but its peak with the optimizer state the first step added does not fit
        (the ranks' figures, for the line): the rung between batches, no OOM spent, the size searched again from the
        next batch (the host offload switched on before it: `HostOffload.schedule`)."""
        if self.why_not() is not None:
            return None
        if self._layout_why_not() is not None:
            return self._step_offload(batch_index, verdict, scope, sharding, optimizers, projected)
        assert self.layout is not None
        head = self.layout.search.head_rung_left
        if scope is not None and not head:
            scope.blocks_only(WHY_OFF)
        changed = self.layout.recompute_floor()
        if changed is None:
            return None
        self.stepped_at, self.last = batch_index, RUNGS[changed]
        again = f"from batch {batch_index + 1}" if projected else f"in batch {batch_index}"
        if changed == FUSED_HEAD:
            return (f"head: fused below size 1: size 1 {_short(verdict, projected, 'with the plain head')}; the loss from "
                    f"the hidden states in chunks, the whole logits never held (recompute is the next rung), the size "
                    f"searched again {again} (the same loss, the head's eager work less)")
        if sharding is not None and sharding.pending:
            sharding.rule_out(WHY_OFF)
        how = {NO_RECOMPUTE: "kept activation checkpointing off undone",
               RECOMPUTE_OP: "each block's selective recompute switched on (its matrix products' and attention's outputs kept, "
                             "the rest recomputed in backward; full recompute is the next rung)",
               RECOMPUTE: "every block's activation checkpointing switched on"}[changed]
        cost = "the cheap work of each block again in backward" if changed == RECOMPUTE_OP else "a forward per block again in backward"
        return (f"recompute on: size 1 {_short(verdict, projected, 'without it')}; {how}, the size searched again "
                f"{again} (the same numbers, {cost})")

    def _step_offload(self, batch_index: int, verdict: Verdict, scope: Any, sharding: Any, optimizers: Sequence[Any],
                      projected: str = "") -> str:
        assert self.offload is not None
        why = "the parameters, gradients and optimizer state live on the host (the ladder's last rung switched it on)"
        if scope is not None:
            scope.blocks_only(why)
        if sharding is not None and sharding.state not in ("off", "sharded"):
            sharding.rule_out(why)  # the twin shares the parameters' old storage: let go of it, never run it
        if projected:  # the step's gradients are still held: switched on before the next batch
            self.offload.schedule()
            when, again = f"before batch {batch_index + 1}", f"from batch {batch_index + 1}"
        else:
            self.offload.step(optimizers)
            when, again = f"(offload: auto){self.offload.said()}", f"in batch {batch_index}"
        self.stepped_at, self.last = batch_index, OFFLOAD_RUNG
        short = _short(verdict, projected, f"with {self._layout_rungs() or 'what the blocks recompute'}")
        return (f"host offload on: size 1 {short}; FSDP2's CPU offload of the sharded parameters, their gradients and "
                f"the optimizer state switched on {when}, the size searched again {again} (the same numbers; each "
                "block's parameters copied to the device for its all-gather, the optimizer stepping on the host)")

    def _layout_rungs(self) -> str:
        if self.layout is None:
            return ""
        return ", then ".join(RUNGS[t] for t in self.layout.search.floor if t in RUNGS)

    def _rungs(self) -> str:
        rungs = [r for r in (self._layout_rungs(), OFFLOAD_RUNG if self._offloaded else "") if r]
        return ", then ".join(rungs)

    def tried(self) -> str:
        """What the run-ending message says was tried below size 1."""
        if self.stepped:
            at = f" by auto at batch {self.stepped_at}" if self.stepped_at is not None else " by auto before the checkpoint this run resumed from"
            return f" with {self._rungs()} (switched on{at}: size 1 did not fit without it)"
        why = self.why_not()
        return f" ({RUNG} not tried: {why})" if why else ""

    def unasked(self) -> str:
        """Where the run ends with no rung left and the host offload was not asked for: what would have been tried."""
        if self.offload is None or self.offload.mode is not None or self.pipeline or self._offloaded:
            return ""
        sharded = self.offload.sharded
        if sharded is None or sharded.device.type != "cuda" or sharded.config.cpu_offload:
            return ""
        return ("; offload: auto would have tried FSDP2's CPU offload of the parameters, gradients and optimizer state "
                "as the last rung")

    def summary(self) -> str:
        """The summary line's part ("" where the ladder did not step)."""
        return f"ladder: {self._rungs()} (size 1 did not fit without it)" if self.stepped else ""


__all__ = ["FloorLadder", "RUNG"]
