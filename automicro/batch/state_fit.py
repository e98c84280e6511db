"""Whether the model's training state fits at all: parameters, gradients and the optimizer state the first step makes,
checked once before the first batch's first attempt.

A model whose parameters fit can still leave no room for its training state: the gradients come in the first backward
and Adam's moments in the first `step()`, each as large as the parameters (in fp32: 4 + 4 + 8 bytes a parameter). Where
those alone pass the device's capacity, no microbatch size trains the model: the search would spend its attempts
and the ladder its rungs on activations that are not the problem, and the first optimizer step would run out of memory
outside any attempt (measured: OLMoE-1B-7B's blocks, 5.2B parameters, on one H100: batch 0 trained at size 2 and the
step then ran out allocating `exp_avg_sq`, a raw OOM from inside the optimizer, with half the parameters' state made).

The check: on every rank, what the device holds now (the parameters) plus the gradients not yet allocated plus the
state the first step will make (`automicro.core.optimizer_memory.pending_state_bytes`), against the capacity. One
`agree_max` round, on every rank at the first batch of a launch (whatever a rank's shard holds, so that the rounds
match). Where it does not fit on some rank: with ``offload: auto`` the host offload is switched on before the first
attempt (`automicro.batch.host_offload`: the parameters and the state are the host's, the device keeps what a
microbatch needs); otherwise the run ends on every rank with what the state needs and what to change. Nothing is
projected for an optimizer `optimizer_memory` does not know (its state is then 0 here) or a device with no capacity
to read.

Owns: the bytes, the round, the line and the message. May not touch: the offload itself (`host_offload`), Composer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from automicro.core.optimizer_memory import pending_grad_bytes, pending_state_bytes

GIB = 2**30
RANKS = 1 << 20  # a rank index below it, the MiB over above it, in one int


@dataclass(frozen=True)
class StateNeed:
    """This rank's bytes: held now, gradients and optimizer state to come, and the capacity (0: none read)."""

    held: int
    grads: int
    state: int
    capacity: int
    device_type: Optional[str] = None  # where the model computes (None: not known)

    @property
    def total(self) -> int:
        return self.held + self.grads + self.state

    @property
    def over(self) -> bool:
        return self.capacity > 0 and self.total > self.capacity

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB ({self.held / GIB:.1f} GiB held now, mostly the parameters, "
                f"{self.grads / GIB:.1f} GiB of gradients and {self.state / GIB:.1f} GiB of optimizer state the first "
                f"step makes) of a capacity of {self.capacity / GIB:.1f} GiB")


def measure(optimizers: Sequence[Any], allocated: int, capacity: int, device_type: Optional[str]) -> StateNeed:
    """This rank's need: `allocated` held now, the gradients and state of the optimizers' parameters to come."""
    state = pending_state_bytes(optimizers, device_type) or 0
    params = {id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}
    return StateNeed(allocated, pending_grad_bytes(params.values(), device_type), state, capacity, device_type)


class StateFit:
    """Checked once a launch, before its first attempt (`before_first_attempt`)."""

    def __init__(self, info: Callable[[str], None]) -> None:
        self.info = info
        self.checked = False

    def before_first_attempt(self, need: StateNeed, agree_max: Callable[[Sequence[int]], tuple[int, ...]],
                             rank: int, offload: Any, optimizers: Sequence[Any]) -> Optional[str]:
        """On every rank at a launch's first batch: None where the state fits on every rank (or the offload was
        switched on: its line said so); else the message the run ends with (every rank alike)."""
        if self.checked:
            return None
        self.checked = True
        # The rank that is most over names itself: (its excess, its rank) in one int, as the consensus carries ints.
        excess_mib = (need.total - need.capacity) // (1 << 20) + 1 if need.over else 0
        worst, = agree_max([excess_mib * RANKS + rank if need.over else 0])
        if worst == 0:
            return None
        over_mib, who = divmod(worst, RANKS)
        where = f"rank {who} ({over_mib - 1} MiB over)"
        if offload.left:
            offload.step(optimizers)
            self.info(f"host offload on before the first batch: the training state does not fit on {where}; this rank "
                      f"needs {need.describe()}{offload.said()}")
            return None
        hint = ("set offload: auto (the parameters, gradients and optimizer state kept on the host while the GPU "
                "computes)" if offload.mode is None and need.device_type == "cuda" else "")
        return (f"automicro: the model's training state does not fit on {where}, whatever the microbatch size: this rank "
                f"needs {need.describe()}. Shard over more ranks, use a smaller model or an optimizer with less state"
                + (f", or {hint}" if hint else "") + ".")


__all__ = ["StateFit", "StateNeed", "measure"]
