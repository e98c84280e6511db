"""The ladder's last rung below size 1: the host offload (``offload: auto``, off unless asked for).

Where microbatch size 1 still runs out with every block recomputing its forward (and the fused head on, where
``head: auto``), the ladder (`automicro.batch.floor_ladder`) would end the run. With ``offload: auto`` it takes one
rung more: FSDP2's CPU offload of the sharded parameters, their gradients and the optimizer's state, switched on
between two attempts on every rank alike (`automicro.engine.offload.offload_to_host`: the same numbers as a run built
with ``parallelism_config.fsdp2.cpu_offload: true``), and the size is searched again in the same batch. The device
then holds what a forward and backward need; each block's parameters cross to the device for its all-gather, each
reduced gradient back, and the optimizer steps on the host: slower, what it cost said in the line of the first batch
that trains with it (its seconds, and the optimizer step's on the host), and the rung in the summary.

Off unless asked for: it moves the run's bottleneck to the host's memory and the link, which a user should choose.
Refused, with what to set (`check`): a job with no CUDA device (nothing to offload to), a pipeline stage, a model
built with ``cpu_offload: true`` already (on from the start: drop one). Kept across a resume: a run resumed from a
checkpoint taken with the offload on switches it on before its first batch (`resume`), without the OOMs that led to it.

Owns: whether the rung is the run's and left, stepping it, its lines, its checkpoint state, its dashboard key. May not
touch: the size policy, the layout search, torch (the engine's switch does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from automicro.engine.offload import Offloaded, is_offloaded, offload_to_host

RUNG = "the host offload on"


class OffloadConfigError(ValueError):
    """``offload: auto`` where it cannot run."""


def check_mode(value: Any) -> Optional[str]:
    """The ``offload`` setting checked: None (off) or "auto"."""
    if value is None or value is False or value == "off":
        return None
    if value == "auto":
        return "auto"
    raise OffloadConfigError(
        f"offload={value!r}: must be left out or 'off' (the run ends where size 1 does not fit with every block "
        "recomputing) or 'auto' (the host offload of parameters, gradients and optimizer state is the last rung there); "
        "to offload from the start, set parallelism_config.fsdp2.cpu_offload: true"
    )


class HostOffload:
    """One run's host-offload rung. `mode`: the checked setting (None: off)."""

    def __init__(self, mode: Optional[str], info: Callable[[str], None]) -> None:
        self.mode, self.info = mode, info
        self.sharded: Any = None  # the engine's model, given at `check`
        self.on = False
        self.moved: Optional[Offloaded] = None
        self._pending = False  # a checkpoint's: switched on before the first batch (`before_batch`)
        self.scheduled = False  # taken between batches (`schedule`): switched on before the next one
        self._said_cost = False

    def check(self, device_type: str, pipeline: bool, sharded: Any) -> None:
        """At attach: where ``offload: auto`` cannot run, an error that says what to set."""
        self.sharded = sharded
        if self.mode is None:
            return
        if device_type != "cuda":
            raise OffloadConfigError(
                f"offload: auto keeps parameters, gradients and optimizer state on the host while a GPU computes; this "
                f"job runs on {device_type}, where there is nothing to offload: drop offload (or set it to off)"
            )
        if pipeline:
            raise OffloadConfigError(
                "offload: auto is not switched on in a pipeline stage (its stages are built with their own layout): drop "
                "offload, or set parallelism_config.fsdp2.cpu_offload: true"
            )
        if sharded is None or not sharded.fsdp_modules:
            raise OffloadConfigError("offload: auto needs a model sharded by FSDP2 (automicro's engine): drop offload")
        if sharded.config.cpu_offload:
            raise OffloadConfigError(
                "offload: auto with parallelism_config.fsdp2.cpu_offload: true: the host offload is on from the start "
                "already; drop one of them"
            )

    @property
    def left(self) -> bool:
        """The rung can still be stepped."""
        return self.mode == "auto" and not self.taken and self.sharded is not None

    @property
    def taken(self) -> bool:
        """The rung is the run's: on, or to be switched on before the next batch (`schedule`)."""
        return self.on or self.scheduled

    def step(self, optimizers: Sequence[Any]) -> None:
        """Switch it on now (between attempts, after the failed one's wipe; every rank alike: the agreed verdict)."""
        self.moved = offload_to_host(self.sharded, optimizers)
        self.on = True

    def schedule(self) -> None:
        """Take the rung after a batch that trained (size 1 ran, but its peak with the optimizer state the first step
        added does not fit): switched on before the next batch (`before_batch`), once what runs at the batch's end
        (Composer's BATCH_END, a loop's own code: a gradient norm logged, a checkpoint) has seen the step's gradients.
        Every rank alike: the agreed verdict."""
        self.scheduled = True

    def said(self) -> str:
        """What the step moved, for its line."""
        return "" if self.moved is None else f"; {self.moved.describe()} moved to the host on this rank"

    def batch_trained(self, batch_index: int, seconds: float, step_seconds: float) -> None:
        """A batch's forward and backward took `seconds`, its optimizer step `step_seconds`: the first batch with the
        offload on says what it cost (the step runs on the host; the parameters' copies to the device and the
        gradients' back run inside the forward and backward)."""
        if not self.on or self._said_cost:
            return
        self._said_cost = True
        self.info(f"host offload: batch {batch_index}'s forward and backward took {seconds:.2f} s with the parameters "
                  f"copied in and the gradients out, its optimizer step on the host {step_seconds:.2f} s")

    def before_batch(self, batch_index: int, optimizers: Sequence[Any]) -> None:
        """Before a batch's first attempt: a rung taken after the last batch (`schedule`) is switched on, the last
        step's gradients dropped first (the step used them, and every host drops them before the batch's first
        microbatch anyway; FSDP2's offload moves no gradient a rank still holds); a checkpoint's (`resume`)."""
        if self.scheduled and not self.on:
            self.scheduled = False
            for param in self.sharded.module.parameters():
                param.grad = None
            self.step(optimizers)
            self.info(f"host offload: switched on before batch {batch_index}{self.said()} (the last batch's gradients, "
                      "stepped already, dropped first)")
            return
        self.resume(optimizers)

    def resume(self, optimizers: Sequence[Any]) -> None:
        """A checkpoint taken with the offload on: switched on before this launch's first batch."""
        if not self._pending:
            return
        self._pending = False
        if self.on or self.sharded is None:
            return
        if is_offloaded(self.sharded):
            self.on = True
            return
        moved = offload_to_host(self.sharded, optimizers)
        self.on, self.moved = True, moved
        self.info(f"resumed with the host offload on (switched on by auto before the checkpoint: size 1 did not fit "
                  f"without it); {moved.describe()} moved to the host on this rank")

    def summary(self) -> str:
        return RUNG if self.taken else ""

    def metrics(self) -> dict[str, int]:
        return {"automicro/host_offload": int(self.on)}

    def state_dict(self) -> dict[str, Any]:
        return {"on": self.taken}  # taken after a batch, not yet on: a run resumed from here switches it on first

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        if state and state.get("on") and self.mode is not None:
            self._pending = True
        elif state and state.get("on"):
            self.info("the checkpoint was taken with the host offload on (offload: auto) and this run does not set "
                      "offload: auto: the run goes on without it (set offload: auto to have it back)")


__all__ = ["HostOffload", "OffloadConfigError", "RUNG", "check_mode"]
