"""What a failed attempt wrote into the model's buffers, undone before the batch runs again.

Some models keep state that a training forward writes in place: torchtitan's mixture-of-experts layers count the
tokens each expert got (``tokens_per_expert_E``, summed over the batch's microbatches; the optimizer step's pre-hook
moves the expert bias by them, then zeroes them), batch norm its running statistics. An attempt that ran out of
memory wrote its microbatches' share before it failed, and the rerun writes it again: without the undo the batch
counts its first microbatches twice (on torchtitan's DeepSeek-V3 debug model, a rerun after an OOM in the first
backward left 768 extra tokens in every routed layer's count; the bias moves by the sign of each count against the
mean, so where an expert sits near the mean its bias steps the wrong way) and batch norm's statistics take a step
no run without the OOM takes. Nothing of a failed attempt may reach the model (`BatchStep._wipe`).

How: the buffers are found by what writes them. Until an attempt has run clean (the first batch's search), every
buffer is copied at the start of the batch (to the host: the device keeps its memory for the search), and the first
clean attempt's writes are the written ones: those whose in-place write counter moved (`Tensor._version`, read on
the host) or whose value changed (batch norm's kernels write its running statistics without bumping the counter;
compared once). From then on only the written ones are copied, on the device, at the start of each batch (a few
numbers a layer), and the wipe of a failed attempt copies back those that changed. A buffer a failed attempt wrote that was not
copied (a module that writes only sometimes) cannot be undone: one line names it, and it is copied from the next
batch on.

Owns: the copies and their undo. May not touch: the model's parameters and optimizer (the host's and the engine's
wipe), the search.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from automicro.engine import _torch_internals as internals

OWN = "_automicro"  # automicro's own buffers (`automicro.batch.routing`): not undone


class ForwardState:
    """The buffers of `module` an attempt writes: `begin_batch` before a batch's first attempt, `undo` in the wipe of a
    failed one, `after_attempt` after each attempt."""

    def __init__(self, module: torch.nn.Module, info: Callable[[str], None] = lambda line: None) -> None:
        self.module, self.info = module, info
        self.written: Optional[set[str]] = None  # None until an attempt ran clean: every buffer is copied
        self._saved: dict[str, torch.Tensor] = {}
        self._versions: dict[str, tuple[int, int]] = {}  # {name: (where its data lives, its write counter)}
        self.undone = 0  # buffers copied back over the run
        self._said_undone = False
        self._lost: set[str] = set()  # written by a failed attempt, not copied: said once each

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers; a DTensor's (tensor parallel) as this rank's local tensor, which it writes. automicro's
        own (``_automicro_*``: the routing watch's count of the failed attempt, read after the wipe) are not the
        model's; nor is a buffer not yet materialized (on the meta device)."""
        return {name: buffer.to_local() if hasattr(buffer, "to_local") else buffer
                for name, buffer in self.module.named_buffers()
                if not name.rsplit(".", 1)[-1].startswith(OWN) and buffer.device.type != "meta"}

    def begin_batch(self) -> None:
        buffers = self._buffers()
        if self.written is None:
            self._saved = {name: buffer.detach().to("cpu", copy=True) for name, buffer in buffers.items()}
        else:
            self._saved = {name: buffers[name].detach().clone() for name in self.written if name in buffers}
        self._versions = _versions(buffers)

    def _moved(self, buffers: dict[str, torch.Tensor]) -> set[str]:
        """The buffers written in place since the versions were read, by their write counters. A buffer the module
        replaced with another tensor (a cache computed again for a longer input) is not one: the rerun computes it
        again from its inputs."""
        now = _versions(buffers)
        return {name for name, (ident, version) in now.items()
                if name in self._versions and self._versions[name][0] == ident and self._versions[name][1] != version}

    def _changed(self, buffers: dict[str, torch.Tensor], moved: Optional[set[str]] = None) -> set[str]:
        """The copied buffers that hold something else now: by their write counters, else by value (batch norm's
        kernels write its running statistics without bumping the counter; comparing reads the device: only after a
        failure, and once after the first clean attempt)."""
        moved = self._moved(buffers) if moved is None else moved
        out = set()
        for name, saved in self._saved.items():
            buffer = buffers.get(name)
            if buffer is None or name not in self._versions or self._versions[name][0] != buffer.data_ptr():
                continue
            if name in moved or saved.shape != buffer.shape or not torch.equal(buffer.detach().to(saved.device), saved):
                out.add(name)
        return out

    def undo(self) -> None:
        """In the wipe of a failed attempt: every buffer it wrote back to what it held when the batch began."""
        buffers = self._buffers()
        moved = self._moved(buffers)
        changed = self._changed(buffers, moved)
        restored: list[str] = []
        with torch.no_grad():
            for name in sorted(changed):
                saved = self._saved[name]
                if saved.shape != buffers[name].shape:
                    continue
                buffers[name].copy_(saved)
                restored.append(name)
        lost = sorted((moved | changed) - set(restored) - self._lost)
        if self.written is not None:
            self.written |= set(restored)
        if restored:
            self.undone += len(restored)
            if not self._said_undone:
                self._said_undone = True
                self.info(f"the failed attempt's writes to {len(restored)} buffer(s) of the model undone "
                          f"({_names(restored)}): a training forward writes them, and the rerun writes them again")
        if lost:
            self._lost.update(lost)
            if self.written is not None:
                self.written |= set(lost)
            self.info(f"a failed attempt wrote {len(lost)} buffer(s) not copied before it ({_names(lost)}): what it "
                      "wrote stays; copied before every batch from now on")
        self._versions = _versions(buffers)

    def after_attempt(self, failed: bool) -> None:
        """After an attempt (its wipe already ran where it failed): a clean one tells which buffers an attempt writes."""
        if failed:
            return
        buffers = self._buffers()
        if self.written is None:
            # The first clean attempt: every buffer was copied (to the host); those it changed are the written ones.
            self.written = self._changed(buffers) | self._lost
        else:
            self.written |= self._moved(buffers)


def _versions(buffers: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Each buffer's data address (a buffer the module replaced lives elsewhere; a DTensor's local tensor is a new
    object each time it is asked for, at the same address) and write counter (a view shares its base's)."""
    return {name: (buffer.data_ptr(), internals.tensor_version(buffer)) for name, buffer in buffers.items()}


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


__all__ = ["ForwardState"]
