"""What a trial can win, bounded by one profiled batch: where the batch's time goes before anything is tried.

A trial `auto` runs costs the run its batches and, for some, a compile (the whole model compiled took 60-70 s
on a 1B model on one H200, and lost there on three families). Most trials change only *how* the same device
work is issued, so what they can win is bounded by what a batch already shows:

- the device idle: between the batch's first and last kernel, the time the device was not busy (the union
  of its kernels, copies and sets; on a CPU, the batch's wall time less the operators' time), less the gaps
  inside the optimizer's step (no trial changes the step). Host overhead, hooks, allocator retries and waits
  live there: no trial can win more than that and the device work it removes;
- FSDP2's own device work: what runs inside FSDP2's ``FSDP::`` ranges (the all-gather copy-in and
  copy-out, the casts, the reduce-scatter's copies): the model unsharded on one rank and the layout trades
  remove at most that, and the device's idle while the host runs FSDP2's own code (its ranges: a host-bound
  FSDP2, many small microbatches);
- collectives (NCCL kernels; gloo's operators on a CPU): what the layout trades can save between ranks;
- fusable eager work: kernels launched outside any compiled region that are not a matrix product,
  attention or a collective (the embedding, the loss, casts between blocks): what the whole model
  compiled can fuse beyond each block compiled;
- the vocabulary head (where the run put its switch on the model: `automicro.engine.head`): what its forward and
  backward launch inside their host ranges (``automicro::head``), all of it and its eager part (not a matrix
  product), and the bytes per sample its forward holds until its backward (the logits and what the loss keeps of
  them): the fused head's price reads them (`trial_price`). On its own line;
- matrix products and attention outside the head and the optimizer (`products_s`): what a block's forward run again
  under full recompute costs beyond the ``op`` rung (`automicro.engine.recompute`), which keeps their outputs and
  recomputes the rest: the ``recompute_op`` trade's price reads it.

So: the model unsharded can win at most idle + FSDP2's work; a layout trade idle + FSDP2's work +
collectives; the whole model compiled idle + fusable work; a smaller microbatch of fixed-length samples
(the same device work in more launches) idle alone. Work the profile could not attribute to a range
(`unattributed_s`) is added to every bound: a bound is never smaller than the truth. A trial whose bound does not clear
its own rule for keeping (``min_gain`` of the batch) cannot be kept and is not run; its line names the
bound. What changes the device work itself (the static recompile's kernels, packing's padding, checkpointing,
a token budget's size trials) is not bounded: those trials run.

`BatchProfiler` profiles one batch (torch's profiler, kineto: the host and, on a GPU, the device; no
device sync in any other batch); `figures` reads the events (`automicro.engine._torch_internals.
profiler_events`) into a `BatchProfile`; the wall time is a clocked batch's without the profiler (it adds
host time per launch). Each rank profiles its own batch; the figures are agreed (the max over ranks) so
every rank bounds alike.

Owns: the profile, its reading and the bounds. May not touch: which trial runs (`trial_plan`), torch
privates (the engine's `_torch_internals`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

# Host ranges the trials' bounds read: FSDP2's record_function ranges, and dynamo's compiled regions (the
# forward's "Torch-Compiled Region: i/j", the backward's "CompiledFunctionBackward").
FSDP_RANGE = re.compile(r"^FSDP::")
HEAD_RANGES = re.compile(r"^automicro::head")  # `automicro.engine.head.HEAD_RANGE`, forward and backward
COMPILED_RANGE = re.compile(r"^(Torch-Compiled Region|CompiledFunction)")
# The optimizer's step and zero_grad (torch's own ranges, and the batch step's around every optimizer step): eager
# work a model's compile does not touch.
OPTIMIZER_RANGE = re.compile(r"^(Optimizer\.|automicro::optimizer_step)")
# Device work a compile cannot fuse or speed up (cuBLAS/CUTLASS products, attention kernels) or that is a collective.
# A routed model's grouped expert products (``aten::_grouped_mm``, its scaled form, inductor's kernels of them, a
# CPU's per-expert fallbacks) are products too: one per expert group, not eager work a compile could fuse.
MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|cublas|matmul|grouped_?mm|sm\d+_|aten::(mm|addmm|bmm|baddbmm|linear|_?scaled_dot_product|"
                    r"_flash_attention|_efficient_attention|_scaled_mm|convolution|_convolution)\b|flash|fmha|attention", re.I)
COMM = re.compile(r"nccl|c10d::|_c10d_functional::|gloo", re.I)
# Host events that are operators (their union is a CPU's busy time).
OPERATOR = re.compile(r"^(aten|fsdp|c10d|_c10d_functional|inductor|triton)::")
# Host events that launch device work (the CUDA / HIP runtime and driver calls a kernel's correlation id names).
LAUNCH = re.compile(r"^(cuda|cu|hip)[A-Z]")

# The kinds of trial a bound is asked for (`BatchProfile.can_win`).
UNSHARDED, TRADE, SCOPE, SMALLER = "unsharded", "trade", "scope", "smaller"


@dataclass(frozen=True)
class BatchProfile:
    """One batch's time, in seconds, and where it went (agreed: each the max over ranks)."""

    wall_s: float
    idle_s: float  # wall less device busy
    fsdp_s: float  # device work inside FSDP2's ranges
    comm_s: float  # collectives
    fusable_s: float  # eager work outside compiled regions a compile could fuse
    unattributed_s: float = 0.0  # device work the profile could not place in a range (added to every bound)
    device: str = "cuda"
    unattributed_names: tuple[str, ...] = ()  # the costliest of it, by name (what the line names)
    fsdp_idle_s: float = 0.0  # of the idle: the device waiting while the host ran FSDP2's own code (its ranges)
    head_s: float = 0.0  # device work of the vocabulary head's forward and backward (0: not measured)
    head_eager_s: float = 0.0  # of it, what is not a matrix product (the upcast, the softmax, the loss, their backward)
    head_bytes: int = 0  # bytes per sample the head's forward holds until its backward (0: not measured)
    # device work in matrix products and attention outside the head (what the ``op`` rung of recompute keeps, not runs
    # again; 0: not measured)
    products_s: float = 0.0

    def can_win(self, kind: str) -> float:
        """The most a trial of `kind` can save from a batch, in seconds."""
        parts = {
            UNSHARDED: self.idle_s + self.fsdp_s,
            TRADE: self.idle_s + self.fsdp_s + self.comm_s,
            SCOPE: self.idle_s + self.fusable_s,
            SMALLER: self.idle_s,
        }
        return parts[kind] + self.unattributed_s

    def share(self, seconds: float) -> str:
        return f"{100.0 * seconds / self.wall_s:.2f}%" if self.wall_s > 0 else "0%"

    def parts(self, kind: str) -> str:
        where = "GPU" if self.device == "cuda" else self.device.upper()
        names = {"idle": f"the {where} idle {self.share(self.idle_s)}", "fsdp": f"FSDP2's own work {self.share(self.fsdp_s)}",
                 "comm": f"collectives {self.share(self.comm_s)}", "fusable": f"eager work a compile could fuse {self.share(self.fusable_s)}"}
        used = {UNSHARDED: ("idle", "fsdp"), TRADE: ("idle", "fsdp", "comm"), SCOPE: ("idle", "fusable"), SMALLER: ("idle",)}[kind]
        text = ", ".join(names[name] for name in used)
        return text + (f", unattributed {self.share(self.unattributed_s)}" if self.unattributed_s else "")

    def line(self) -> str:
        busy = self.wall_s - self.idle_s
        names = f" ({', '.join(self.unattributed_names)})" if self.unattributed_names else ""
        where = "GPU" if self.device == "cuda" else self.device.upper()
        host = f" (and the {where} idle under its host code {self.share(self.fsdp_idle_s)})" if self.fsdp_idle_s else ""
        return (f"a batch profiled: {self.wall_s:.4f} s, the {where} busy "
                f"{self.share(busy)} (idle {self.share(self.idle_s)}); FSDP2's own work {self.share(self.fsdp_s)}{host}, collectives "
                f"{self.share(self.comm_s)}, eager work a compile could fuse {self.share(self.fusable_s)}"
                + (f", unattributed {self.share(self.unattributed_s)}{names}" if self.unattributed_s else ""))

    def head_line(self, vocab: int = 0) -> Optional[str]:
        """The head's own line (None where it was not measured)."""
        if not self.head_s and not self.head_bytes:
            return None
        over = f" over a vocabulary of {vocab:,}" if vocab else ""
        return (f"the vocabulary head profiled: its projection and loss{over} {self.share(self.head_s)} of the batch "
                f"({self.share(self.head_eager_s)} outside matrix products), its forward holding "
                f"{self.head_bytes / 2**20:.2f} MiB a sample until its backward (the logits and what its loss keeps of them)")

    def to_micros(self) -> list[int]:
        """The figures as ints for their agreement (seconds in microseconds; the head's bytes as they are)."""
        return [int(round(v * 1e6)) for v in (self.wall_s, self.idle_s, self.fsdp_s, self.comm_s, self.fusable_s,
                                              self.unattributed_s, self.fsdp_idle_s, self.head_s, self.head_eager_s)] + [
            int(self.head_bytes), int(round(self.products_s * 1e6))]

    @classmethod
    def from_micros(cls, values: Sequence[int], device: str, names: tuple[str, ...] = ()) -> "BatchProfile":
        wall, idle, fsdp, comm, fusable, unattributed, fsdp_idle, head, head_eager = (v / 1e6 for v in values[:9])
        products = values[10] / 1e6 if len(values) > 10 else 0.0
        return cls(wall, idle, fsdp, comm, fusable, unattributed, device, names if unattributed else (), min(idle, fsdp_idle),
                   head, min(head, head_eager), int(values[9]), products)


# ---- intervals ------------------------------------------------------------------------------------

Interval = tuple[int, int]


def _merged(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals: Iterable[Interval]) -> int:
    return sum(b - a for a, b in _merged(intervals))


def _minus(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """`intervals`' union less `holes`' union."""
    out, cut = [], _merged(holes)
    for start, end in _merged(intervals):
        for a, b in cut:
            if b <= start or a >= end:
                continue
            if a > start:
                out.append((start, a))
            start = max(start, b)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def _within(intervals: Iterable[Interval], ranges: Iterable[Interval]) -> list[Interval]:
    """The parts of `intervals`' union inside `ranges`' union."""
    out, inside = [], _merged(ranges)
    for start, end in _merged(intervals):
        for a, b in inside:
            lo, hi = max(start, a), min(end, b)
            if lo < hi:
                out.append((lo, hi))
    return out


class _Ranges:
    """Host ranges by thread, for the question "was this launched inside one?"."""

    def __init__(self, events: Iterable[Any]) -> None:
        self.by_thread: dict[int, list[Interval]] = {}
        for e in events:
            self.by_thread.setdefault(e.thread, []).append((e.start_ns, e.end_ns))
        self.by_thread = {t: _merged(r) for t, r in self.by_thread.items()}

    def holds(self, thread: int, at: int) -> bool:
        for a, b in self.by_thread.get(thread, ()):
            if a <= at < b:
                return True
            if a > at:
                return False
        return False

    def all(self) -> list[Interval]:
        return [r for ranges in self.by_thread.values() for r in ranges]


def figures(events: Sequence[Any], wall_s: float, device: str) -> BatchProfile:
    """A batch's profile from its events (`ProfiledEvent`s: name, on_device, start_ns, end_ns, correlation,
    linked, thread) and its wall time measured without the profiler.

    A kernel is placed by what launched it on the host: the runtime call of the same (CUPTI) correlation id, else
    the operator its linked id names; its launch inside a range is what the range did. Collectives by name first;
    then FSDP2's ranges, the optimizer's (not fusable: no model compile touches it), compiled regions, matrix
    products and attention by name; what is left is fusable eager work."""
    host = [e for e in events if not e.on_device]
    fsdp = _Ranges(e for e in host if FSDP_RANGE.match(e.name))
    compiled = _Ranges(e for e in host if COMPILED_RANGE.match(e.name))
    optimizer = _Ranges(e for e in host if OPTIMIZER_RANGE.match(e.name))
    head = _Ranges(e for e in host if HEAD_RANGES.match(e.name))
    # A host range shows on the device too (kineto's GPU user annotations: "FSDP::pre_forward", "Optimizer.step#..."),
    # spanning its kernels and the gaps between them: not work.
    ranges = {e.name for e in host if not OPERATOR.match(e.name) and not LAUNCH.match(e.name)}
    kernels = [e for e in events if e.on_device and e.name not in ranges]
    if kernels:
        launches: dict[int, Any] = {}
        operators: dict[int, Any] = {}
        for e in host:
            if LAUNCH.match(e.name):
                launches.setdefault(e.correlation, e)
            elif e.correlation:
                operators.setdefault(e.correlation, e)
        busy = _length((k.start_ns, k.end_ns) for k in kernels)
        # The device's idle between its first and last kernel of the batch: a clocked batch starts and ends with the
        # device synchronized (the gaps at its ends are the clock's, which no trial can win, and no run without the
        # clock pays).
        extent = max(k.end_ns for k in kernels) - min(k.start_ns for k in kernels)
        parts: dict[str, list[Interval]] = {"fsdp": [], "comm": [], "fusable": [], "unattributed": [], "optimizer": [],
                                            "head": [], "head_eager": [], "products": []}
        lost: dict[str, int] = {}
        for k in kernels:
            span = (k.start_ns, k.end_ns)
            if COMM.search(k.name):
                parts["comm"].append(span)
                continue
            anchor = launches.get(k.correlation) or operators.get(k.linked)
            if anchor is not None and head.holds(anchor.thread, anchor.start_ns):
                parts["head"].append(span)
                if not MATMUL.search(k.name):
                    parts["head_eager"].append(span)
            elif MATMUL.search(k.name) and (anchor is None or not optimizer.holds(anchor.thread, anchor.start_ns)):
                parts["products"].append(span)
            if anchor is None:
                parts["unattributed"].append(span)
                lost[k.name] = lost.get(k.name, 0) + k.end_ns - k.start_ns
            elif fsdp.holds(anchor.thread, anchor.start_ns):
                parts["fsdp"].append(span)
            elif optimizer.holds(anchor.thread, anchor.start_ns):
                parts["optimizer"].append(span)
            elif not compiled.holds(anchor.thread, anchor.start_ns) and not MATMUL.search(k.name):
                parts["fusable"].append(span)
        seconds = {name: _length(spans) / 1e9 for name, spans in parts.items()}
        names = tuple(name[:60] for name, _ in sorted(lost.items(), key=lambda item: -item[1])[:3])
        # The optimizer step's own gaps (its many small kernels, launched from the host one after another) are not
        # a trial's to win: the model unsharded, the layout trades, the scope and the size leave the step as it is.
        steps = parts["optimizer"]
        stepping = 0
        if steps:
            window = (min(a for a, _ in steps), max(b for _, b in steps))
            stepping = window[1] - window[0] - _length(_within(((k.start_ns, k.end_ns) for k in kernels), [window]))
        idle = max(0.0, (extent - busy - stepping) / 1e9)
        # The device idle while the host ran FSDP2's own code: the gaps between kernels inside FSDP2's host ranges.
        first, last = min(k.start_ns for k in kernels), max(k.end_ns for k in kernels)
        gaps = _minus([(first, last)], [(k.start_ns, k.end_ns) for k in kernels] + ([window] if steps else []))
        fsdp_idle = _length(_within(gaps, fsdp.all())) / 1e9
    else:  # a CPU: the operators are the device work
        ops = [e for e in host if OPERATOR.match(e.name)]
        spans = [(e.start_ns, e.end_ns) for e in ops]
        busy = _length(spans)
        products = [(e.start_ns, e.end_ns) for e in ops if MATMUL.search(e.name)]
        comm = [(e.start_ns, e.end_ns) for e in ops if COMM.search(e.name)]
        outside = _minus(_minus(spans, products + comm), fsdp.all() + compiled.all() + optimizer.all())
        heads = _within(spans, head.all())
        seconds = {
            "fsdp": _length(_within(spans, fsdp.all())) / 1e9,
            "comm": _length(comm) / 1e9,
            "fusable": _length(outside) / 1e9,
            "unattributed": 0.0,
            "head": _length(heads) / 1e9,
            "head_eager": _length(_minus(heads, products)) / 1e9,
            "products": _length(_minus(products, head.all() + optimizer.all())) / 1e9,
        }
        names = ()
        # FSDP2's host code with no operator running: its own host time, as this batch shows it (a sleep or a lock
        # in FSDP2's path is seen whole here). The batch's idle is the clocked batch's wall less these operators
        # (which the profiler slows), and at least that: two batches' figures must not hide what one of them shows.
        fsdp_idle = _length(_minus(fsdp.all(), spans)) / 1e9
        idle = max(0.0, wall_s - busy / 1e9, fsdp_idle)
    return BatchProfile(wall_s, idle, seconds["fsdp"], seconds["comm"], seconds["fusable"], seconds["unattributed"], device, names,
                        fsdp_idle, seconds["head"], seconds["head_eager"], products_s=seconds["products"])


class BatchProfiler:
    """`start()` before a batch, `stop(wall_s)` after it: the batch's `BatchProfile` (None where the profiler could
    not run: another profiler is on, say; `why` says so)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: Any = None
        self.why = ""
        # The vocabulary head's switch where the run has one (`automicro.engine.head.HeadSwitch`): its meter is on
        # for the profiled batch only.
        self.head: Any = None

    def start(self) -> bool:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._profile = profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False)
            self._profile.start()
            if self.head is not None:
                self.head.meter.reset()
                self.head.meter.on = True
        except Exception as error:  # noqa: BLE001 - a profiler already on (the user's, Composer's): no bound
            self._profile, self.why = None, f"the profiler could not start ({type(error).__name__}: {str(error)[:120]})"
            return False
        return True

    def stop(self, wall_s: float) -> Optional[BatchProfile]:
        from automicro.engine import _torch_internals as internals

        if self._profile is None:
            return None
        profile, self._profile = self._profile, None
        head_bytes = 0
        if self.head is not None:
            self.head.meter.on = False
            head_bytes = self.head.meter.per_sample()
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            profile.stop()
            events = internals.profiler_events(profile)
        except Exception as error:  # noqa: BLE001 - a profile that cannot be read bounds nothing
            self.why = f"the profile could not be read ({type(error).__name__}: {str(error)[:120]})"
            return None
        if not events:
            self.why = "the profile held no events"
            return None
        return dataclasses.replace(figures(events, wall_s, self.device.type), head_bytes=head_bytes)


__all__ = ["BatchProfile", "BatchProfiler", "SCOPE", "SMALLER", "TRADE", "UNSHARDED", "figures"]
