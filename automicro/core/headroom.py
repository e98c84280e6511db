"""Headroom that knows the world size: the settled microbatch keeps a job-level rerun rate under a target.

A batch reruns when any rank runs out of memory. If one rank's chance per batch is p, the job's is
1 - (1 - p)^N over N ranks: at 4,096 ranks a p of 1e-5 reruns 4% of the batches. So the size that is
safe on one GPU is not safe on thousands: the headroom below the capacity has to grow with N.

What the size found leaves: the settling batches (`PolicyConfig.stable_batches` clean batches at the
size found, sync hooks on) report every rank's peak (`Verdict.reports`). Their spread, over ranks and
batches, is what moves a peak from one batch to the next (variable-length samples, fragmentation,
what a rank's data does). Taken as normal with the pooled mean and standard deviation sigma, a rank
runs out when its peak passes the usable memory: p = 1 - Phi((usable - mean) / sigma). The job's rate
stays under `target` when p <= 1 - (1 - target)^(1/N), so the mean peak must sit z(N) sigma below the
usable memory, z(N) = Phi^-1((1 - target)^(1/N)). Where it does not, the size steps down by as many
samples as the shortfall takes (the memory model's bytes per sample); the steps are the headroom.

    target 1%:  N = 1: z 2.33   N = 8: z 3.02   N = 512: z 3.89   N = 4,096: z 4.57   N = 16,384: z 4.85

Assumed, named: the spread at the size found is the spread at the size below (a shorter microbatch
spreads less with variable lengths: the step is conservative there); the peaks are independent across
ranks and batches; a normal tail (a heavier one needs more headroom than this gives). With no spread
measured (fixed-length data on a quiet card: every rank's peak the same each batch), or fewer than
`MIN_PEAKS` peaks to measure it from (a job of 5 ranks or fewer settles over 3 batches), the size stays.

Owns: the target, the per-rank rate it allows, the steps down and the line that says them. May not
touch: the policy (it is told a size to adopt), torch, Composer.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

DEFAULT_RERUN_TARGET = 0.01  # at most 1% of the batches rerun for a steady-state OOM, over the whole job
# The fewest peaks (ranks x settling batches) whose spread may move the size: a standard deviation from fewer is
# too uncertain (from 16 it is within ~18%), and a small job has the one-off rule for a rare OOM (an OOM at a size
# that ran clean reruns the batch; only a repeat shrinks it: `automicro.core.policy`).
MIN_PEAKS = 16
_MIB = 1 << 20


def per_rank_rate(target: float, world: int) -> float:
    """The most one rank may run out per batch for the job to rerun at most `target` of the batches."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"rerun target {target!r}: must be between 0 and 1 (a fraction of the batches)")
    return 1.0 - (1.0 - target) ** (1.0 / max(1, world))


def z_for(target: float, world: int) -> float:
    """How many standard deviations the mean peak keeps below the usable memory."""
    p = per_rank_rate(target, world)
    return statistics.NormalDist().inv_cdf(1.0 - p) if p > 0 else math.inf


def job_rerun_rate(per_rank: float, world: int) -> float:
    """The share of the batches that rerun when each of `world` ranks runs out with `per_rank` per batch."""
    return 1.0 - (1.0 - per_rank) ** max(1, world)


@dataclass(frozen=True)
class Headroom:
    """What the spread asks for: `size` to settle on (the size found, or fewer samples), and the line."""

    size: int
    steps: int
    mean_bytes: float
    sigma_bytes: float
    z: float
    line: str


def decide(found: int, peaks: Sequence[Sequence[int]], usable: int, per_sample: Optional[int], world: int,
           target: float = DEFAULT_RERUN_TARGET, floor: int = 1) -> Headroom:
    """The size to settle on from the settling batches' per-rank `peaks` at `found` (one row per batch;
    0s are ranks that did not report), the `usable` bytes, the memory model's bytes per sample (None:
    unknown, so one sample a step), over `world` ranks."""
    values = [int(p) for row in peaks for p in row if p and p > 0]
    z = z_for(target, world)
    where = f"over {world} rank(s), a rerun rate of at most {100 * target:g}% of the batches"
    if len(values) < MIN_PEAKS or usable <= 0:
        return Headroom(found, 0, 0.0, 0.0, z, (
            f"headroom: not measured ({len(values)} peak(s) over the settling batches, fewer than {MIN_PEAKS}); "
            f"size {found} stays"
        ))
    mean, sigma = statistics.fmean(values), statistics.pstdev(values)
    need = mean + z * sigma
    spread = f"peak {mean / _MIB:.0f} MiB mean, {sigma / _MIB:.1f} MiB spread over {len(peaks)} batch(es) x ranks"
    if sigma <= 0 or need <= usable:
        room = (usable - mean) / sigma if sigma > 0 else math.inf
        return Headroom(found, 0, mean, sigma, z, (
            f"headroom: size {found} keeps {(usable - mean) / _MIB:.0f} MiB below the usable {usable / _MIB:.0f} MiB "
            f"({'no spread' if sigma <= 0 else f'{room:.1f} spreads'}; {where} needs {z:.2f}); {spread}"
        ))
    per = per_sample if per_sample and per_sample > 0 else None
    steps = max(1, math.ceil((need - usable) / per)) if per else 1
    size = max(floor, found - steps)
    return Headroom(size, found - size, mean, sigma, z, (
        f"headroom: size {found} -> {size}: {where} needs the mean peak {z:.2f} spreads ({z * sigma / _MIB:.0f} MiB) below "
        f"the usable {usable / _MIB:.0f} MiB, and at {found} it sits {(usable - mean) / _MIB:.0f} MiB below; {spread}"
        + ("" if per else "; bytes per sample unknown: one step")
    ))


__all__ = ["DEFAULT_RERUN_TARGET", "MIN_PEAKS", "Headroom", "decide", "job_rerun_rate", "per_rank_rate", "z_for"]
