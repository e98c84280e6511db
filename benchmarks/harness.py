"""The benchmark harness every suite shares: launch, timing, JSON, table, interleaved comparison.

Owns: starting a suite's process group (under torchrun, or as one rank in-process when no
launcher set the rank variables), the rank-0 JSON file and console table, the A B A B … schedule
of compared variants and its statistics (median and spread per variant, paired ratio with its
spread, "claimed" or "within noise"), CUDA-synchronised window timing, and the host-boundness
figure (GPU busy fraction of a profiled window; host thread CPU time per step). Composer and
automicro are not imported here (the trainer-side pieces live in `recorders.py` / `cases.py`),
so the statistics can be tested without torch.

The comparison rule: variants run in alternation, A B A B …, for `rounds` rounds; each round
gives one number per variant (its mean step time over a window of steps). The ratio of B to A is
taken per round (adjacent windows, so slow drift of the host cancels), its median is the effect,
and it is **claimed** only when the range of the per-round ratios (max − min) is smaller than
|median − 1| (which also puts every round on the same side of 1); otherwise **within noise**.

Host-boundness: `gpu_busy` is the union of GPU kernel / copy / memset intervals in a profiled
window (torch.profiler, CUDA activity only; a separate window, never a timed one), per step,
over the median timed step (`busy_vs_timed`; the profiled window's own wall time is longer,
since the profiler slows the host). A step whose GPU is idle more than `HOST_BOUND_IDLE` of the time is reported
host-bound: its time measures the host (Python, launches, consensus rounds), not the model.
`cpu_per_wall` (the training thread's CPU time over wall time in the timed windows) is recorded
beside it; it includes time spent spinning in device synchronisations, so alone it proves nothing.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_BOUND_IDLE = 0.10  # GPU idle more than 10% of the step: host-bound


# ---- statistics (pure) ------------------------------------------------------------------------------


def finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def median(values: Iterable[Any]) -> Optional[float]:
    vals = finite(values)
    return statistics.median(vals) if vals else None


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """First and third quartile (linear interpolation between order statistics; n >= 1)."""
    vals = sorted(values)
    if len(vals) == 1:
        return vals[0], vals[0]
    q = statistics.quantiles(vals, n=4, method="inclusive")
    return q[0], q[2]


def spread(values: Iterable[Any]) -> dict[str, Any]:
    """Median, min, max, IQR and the relative range (max − min) / median of one variant's rounds."""
    vals = finite(values)
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None, "range_rel": None}
    mid = statistics.median(vals)
    q1, q3 = quartiles(vals)
    return {
        "n": len(vals),
        "median": mid,
        "min": min(vals),
        "max": max(vals),
        "q1": q1,
        "q3": q3,
        "range_rel": (max(vals) - min(vals)) / mid if mid else None,
    }


def verdict(ratios: Sequence[float]) -> str:
    """"claimed" when the per-round ratios' range is smaller than the effect |median − 1|."""
    vals = finite(ratios)
    if len(vals) < 2:
        return "within noise"  # one round has no spread to compare with
    effect = abs(statistics.median(vals) - 1.0)
    return "claimed" if max(vals) - min(vals) < effect else "within noise"


def paired_ratios(base: Sequence[float], other: Sequence[float]) -> list[float]:
    """Per-round other / base (rounds where either is missing are skipped)."""
    return [o / b for b, o in zip(base, other) if b and o is not None and math.isfinite(b) and math.isfinite(o)]


def compare(base: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """other vs base, round by round: the ratio's median, its range and the verdict."""
    ratios = paired_ratios(base, other)
    s = spread(ratios)
    return {
        "ratios": ratios,
        "median": s["median"],
        "min": s["min"],
        "max": s["max"],
        "range": (s["max"] - s["min"]) if ratios else None,
        "effect": abs(s["median"] - 1.0) if ratios else None,
        "verdict": verdict(ratios),
    }


def median_interval(values: Iterable[Any], confidence: float = 0.95) -> Optional[tuple[float, float]]:
    """Distribution-free interval for the median of independent samples: the order statistics
    k and n + 1 − k (1-based) with P(k ≤ B ≤ n − k) ≥ `confidence`, B ~ Binomial(n, 1/2).
    None when n is too small for that confidence (n < 6 at 95%)."""
    vals = sorted(finite(values))
    n = len(vals)
    tail = 0.0
    k = 0
    while True:  # the largest k with 2 * P(B < k) <= 1 - confidence
        nxt = tail + math.comb(n, k) / 2**n
        if 2 * nxt > 1 - confidence:
            break
        tail, k = nxt, k + 1
    if k == 0:
        return None
    return vals[k - 1], vals[n - k]


def schedule(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The interleaved order: round 0 A B …, round 1 A B …, … (A B A B for two variants)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1")
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique: {list(names)}")
    return [(r, name) for r in range(rounds) for name in names]


def interleave(measure: dict[str, Callable[[int], dict[str, Any]]], rounds: int,
               on_sample: Optional[Callable[[int, str, dict[str, Any]], None]] = None) -> dict[str, list[dict[str, Any]]]:
    """Runs `measure[name](round)` in `schedule` order; returns each variant's samples in round order.

    Each measure returns a dict with at least `step_s` (seconds per step in that window)."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in measure}
    for round_index, name in schedule(list(measure), rounds):
        sample = dict(measure[name](round_index))
        sample.setdefault("round", round_index)
        samples[name].append(sample)
        if on_sample is not None:
            on_sample(round_index, name, sample)
    return samples


def report(samples: dict[str, list[dict[str, Any]]], base: str, key: str = "step_s") -> dict[str, Any]:
    """Per variant: the spread of `key` over rounds (and of the host figures where present); per
    non-base variant: the comparison with `base` (ratio of `key`, other / base)."""
    out: dict[str, Any] = {"base": base, "key": key, "variants": {}, "vs_base": {}}
    for name, rows in samples.items():
        entry = spread([r.get(key) for r in rows])
        entry["rounds"] = [r.get(key) for r in rows]
        for extra in ("cpu_per_wall", "gpu_busy"):
            vals = finite(r.get(extra) for r in rows)
            if vals:
                entry[extra] = statistics.median(vals)
        out["variants"][name] = entry
    base_rounds = [r.get(key) for r in samples.get(base, [])]
    for name, rows in samples.items():
        if name != base:
            out["vs_base"][name] = compare(base_rounds, [r.get(key) for r in rows])
    return out


def busy_vs_timed(gpu_busy_s: Optional[float], window: int, step_s: Optional[float]) -> Optional[float]:
    """GPU time per step (from the profiled window) over the median *timed* step: the profiler
    slows the host (host-bound steps the most) but hardly the kernels, so this is the busy
    fraction of an unprofiled step; the profiled window's own fraction is a lower bound."""
    if not gpu_busy_s or not step_s or window < 1:
        return None
    return min(1.0, gpu_busy_s / window / step_s)


def host_bound(gpu_busy: Optional[float]) -> Optional[bool]:
    return None if gpu_busy is None else gpu_busy < 1.0 - HOST_BOUND_IDLE


# ---- GPU busy fraction from a profiled window -------------------------------------------------------

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (same unit in, seconds if given seconds)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def gpu_busy_from_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """GPU activity of a chrome trace (torch.profiler's export): union of device intervals (s)."""
    spans = [(float(e["ts"]) * 1e-6, (float(e["ts"]) + float(e.get("dur", 0))) * 1e-6)
             for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "ts" in e]
    if not spans:
        return {"gpu_events": 0, "gpu_busy_s": 0.0, "gpu_span_s": 0.0}
    return {"gpu_events": len(spans), "gpu_busy_s": union_seconds(spans),
            "gpu_span_s": max(e for _, e in spans) - min(s for s, _ in spans)}


def profiled_gpu_busy(run_window: Callable[[], float]) -> dict[str, Any]:
    """Runs `run_window()` (returns its wall seconds, synchronised at both ends) under the
    profiler, CUDA activity only; returns the busy fraction = GPU union time / wall."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = run_window()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as handle:
            trace = json.load(handle)
    out = gpu_busy_from_trace(trace)
    out["wall_s"] = wall
    out["gpu_busy"] = min(1.0, out["gpu_busy_s"] / wall) if wall > 0 else None
    out["torch"] = torch.__version__
    return out


# ---- timing ------------------------------------------------------------------------------------------


class WindowTimer:
    """Wall and training-thread CPU time of a window; CUDA-synchronised at both ends on GPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.t0 = self.c0 = 0.0

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def start(self) -> None:
        self.sync()
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def stop(self, steps: int) -> dict[str, Any]:
        self.sync()
        wall, cpu = time.perf_counter() - self.t0, time.thread_time() - self.c0
        return {"steps": steps, "wall_s": wall, "step_s": wall / max(steps, 1), "cpu_s": cpu,
                "cpu_per_wall": cpu / wall if wall > 0 else None}


# ---- launch ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def single_rank_env() -> None:
    """Lets a suite run as one rank without a launcher (torchrun sets these otherwise)."""
    if "WORLD_SIZE" in os.environ:
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("NODE_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(key, value)


def torchrun(nproc: int, script: str, *args: str, python: str = sys.executable) -> list[str]:
    """The argv of one launch of a suite file under torchrun (standalone rendezvous)."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            os.path.join(REPO_ROOT, "benchmarks", script), *args]


def run_launch(argv: list[str], timeout: float, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """One launch; past `timeout` it is killed and reported as rc 124 with what it printed (the suite
    goes on to its next variant)."""
    # Its own process group: past the timeout every process of the launch goes (torchrun's ranks too; a
    # hung rank left behind holds its GPU's memory and spins NCCL kernels under the next launch).
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(argv, 124, stdout or "", (stderr or "") + f"\ntimed out after {timeout:.0f} s")


def interleave_launches(launches: dict[str, Callable[[int], list[str]]], rounds: int,
                        read: Callable[[str, int], dict[str, Any]], timeout: float = 600.0,
                        launcher: Callable[..., Any] = run_launch) -> dict[str, list[dict[str, Any]]]:
    """When one process cannot hold both variants: one launch per (round, variant), A B A B …;
    `launches[name](round)` gives the argv, `read(name, round)` the sample the launch wrote."""

    def measure(name: str) -> Callable[[int], dict[str, Any]]:
        def one(round_index: int) -> dict[str, Any]:
            done = launcher(launches[name](round_index), timeout)
            sample = read(name, round_index)
            sample.setdefault("returncode", getattr(done, "returncode", None))
            return sample

        return one

    return interleave({name: measure(name) for name in launches}, rounds)


class Session:
    """One suite launch: ranks, a gloo control group, rank-0 output (console, JSON, table)."""

    def __init__(self, name: str, out_dir: str, gpu: bool, prefix: str = "bench") -> None:
        import torch.distributed as tdist

        self.name = name
        self.out_dir = out_dir
        self.gpu = gpu
        self.prefix = prefix
        self.rank = tdist.get_rank()
        self.world = tdist.get_world_size()
        self.ctl = tdist.new_group(backend="gloo")  # decisions and gathers, off the training group
        self.t0 = time.perf_counter()
        self.json_path = os.path.join(out_dir, f"{name}.json")
        os.makedirs(out_dir, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def decide(self, value: Any) -> Any:
        """Rank 0 decides, every rank follows (keeps the ranks' collectives matched)."""
        import torch.distributed as tdist

        box = [value if self.rank == 0 else None]
        tdist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as tdist

        out: list[Any] = [None] * self.world
        tdist.all_gather_object(out, obj, group=self.ctl)
        return out

    def say(self, message: str, detail: bool = False) -> None:
        """`[prefix]` lines are the console summary; `[prefix:detail]` lines are for the log."""
        if self.rank == 0:
            print(f"[{self.prefix}{':detail' if detail else ''}] {message}", flush=True)

    def write_json(self, doc: dict[str, Any]) -> None:
        if self.rank == 0:
            write_json(self.json_path, doc)

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        if self.rank == 0:
            lines = table_lines(header, rows)
            for line in lines:
                print(f"[{self.prefix}] | {line}", flush=True)
            with open(os.path.join(self.out_dir, f"{self.name}_table.txt"), "w", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")

    def close(self) -> None:
        import torch.distributed as tdist

        tdist.barrier(group=self.ctl)
        tdist.destroy_process_group()


# ---- output ----------------------------------------------------------------------------------------


def run_variant_here(out: str, stem: str, run: Callable[[], dict[str, Any]], timeout: float, ranks: int, cpu: bool) -> int:
    """One variant of a suite in this process (the launch the suite started): every thread's stack
    dumped 15 s before the runner's timeout (a stalled launch says where), the rank variables for a
    single rank, one CPU thread per rank on CPU, and this rank's result in `OUT/<stem>_rank<r>.json`
    (what `gather_ranks` reads)."""
    import faulthandler

    faulthandler.dump_traceback_later(max(5.0, timeout - 15.0), exit=False)
    if ranks == 1:
        single_rank_env()
    elif cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"{stem}_rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return 0


def gather_ranks(out: str, stem: str, ranks: int, skip: int, keys: Sequence[str]) -> Optional[dict[str, Any]]:
    """The per-rank JSON files `OUT/<stem>_rank<r>.json` of one launch (read, then removed): rank 0's
    result, with `real_tokens_per_s` over every rank's real tokens of its `rows` after `skip` in rank
    0's seconds, and each rank's `keys` in `per_rank` (None: rank 0 wrote none)."""
    found = []
    for rank in range(ranks):
        path = os.path.join(out, f"{stem}_rank{rank}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                found.append(json.load(handle))
            os.remove(path)
        elif rank == 0:
            return None
    result = found[0]
    if ranks > 1:
        seconds = sum(r["seconds"] for r in result["rows"][skip:])
        real = sum(row["real"] for r in found for row in r["rows"][skip:])
        result["real_tokens_per_s"] = real / seconds if seconds else None
        result["per_rank"] = [{key: r.get(key) for key in keys} for r in found]
        result["ranks_reported"] = len(found)
    return result


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Atomic rewrite (a crash leaves the previous version, never half a file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1, default=str)
    os.replace(tmp, path)


def fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def table_lines(header: list[str], rows: list[list[Any]]) -> list[str]:
    text = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(header))]
    lines = []
    for n, row in enumerate(text):
        lines.append(" ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append(" ".join("-" * w for w in widths))
    return lines


def comparison_rows(rep: dict[str, Any], label: str = "") -> list[list[Any]]:
    """Table rows of one `report()`: variant, median step, spread, ratio vs base, verdict, host figures."""
    rows = []
    for name, v in rep["variants"].items():
        c = rep["vs_base"].get(name)
        busy = v.get("gpu_busy")
        rows.append([
            label, name, fmt(v["median"] and v["median"] * 1e3, ".1f"),
            f"{fmt(v['min'] and v['min'] * 1e3, '.1f')}–{fmt(v['max'] and v['max'] * 1e3, '.1f')}",
            fmt(v["range_rel"], ".1%"),
            "base" if c is None else f"{fmt(c['median'], '.4f')} [{fmt(c['min'], '.4f')}–{fmt(c['max'], '.4f')}]",
            "-" if c is None else c["verdict"],
            fmt(busy, ".1%"), {True: "HOST-BOUND", False: "no", None: "-"}[host_bound(busy)],
            fmt(v.get("cpu_per_wall"), ".2f"),
        ])
    return rows


COMPARISON_HEADER = ["case", "variant", "step ms (median)", "min–max ms", "range", "ratio vs base [min–max]",
                     "verdict", "GPU busy", "host-bound", "cpu/wall"]


# ---- reading a suite's JSON again ------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    """`python benchmarks/harness.py OUT/vs_plain.json [OUT/hooks.json ...]`: the comparison table
    of every interleaved comparison in those files (GPU busy re-derived from the stored profile)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("json", nargs="+")
    args = p.parse_args(argv)
    rows = []
    for path in args.json:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
        for label, rep in (doc.get("comparisons") or {}).items():
            for v in rep["variants"].values():
                prof = v.get("profile_rank0") or {}
                if prof.get("gpu_busy_s") is not None:
                    v["gpu_busy"] = busy_vs_timed(prof["gpu_busy_s"], rep["window"], v["median"])
            rows += comparison_rows(rep, label)
    for line in table_lines(COMPARISON_HEADER, rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def compare_variants(suite: str, variants: list[str], passthrough: list[str], out: str, ranks: int, skip: int,
                     timeout: float, argv: list[str], settings: dict[str, Any], first: str = "first full batch s") -> int:
    """Each variant of a suite in its own launch (`argv` + ``--variant=name`` + `passthrough`),
    its ranks' results gathered (`gather_ranks`), throughput against the best `fixed-*` variant; prints
    the table (``[suite] | ...`` lines) and writes `OUT/<suite>.json` and `OUT/<suite>_table.txt`."""
    results = []
    for name in variants:
        started = time.perf_counter()
        done = run_launch([*argv, f"--variant={name}", *passthrough], timeout)
        result = gather_ranks(out, f"{suite}_{name}", ranks, skip, ("ooms", "allocator_ooms", "microbatch", "peak_gib", "error", "batches"))
        if result is None:
            result = {"variant": name, "error": f"no result (rc {done.returncode}): {(done.stderr or '')[-600:]}",
                      "stderr_tail": (done.stderr or "")[-12000:]}
        result["launch_s"] = round(time.perf_counter() - started, 1)
        lines = [line for line in (done.stdout or "").splitlines() if line.startswith("[automicro]")]
        result["console"] = lines[-40:]
        if lines:
            print(f"[{suite}:detail] {name}: " + " / ".join(lines[-5:]), flush=True)
        results.append(result)
    best = max((r["real_tokens_per_s"] for r in results if r["variant"].startswith("fixed-") and r.get("real_tokens_per_s")
                and not r.get("error")), default=None)
    rows = []
    for r in results:
        tps = r.get("real_tokens_per_s") if not r.get("error") else None
        r["vs_best_fixed"] = tps / best if tps and best else None
        rows.append([
            r["variant"], fmt(tps, ",.0f") if tps else "–", fmt(r["vs_best_fixed"], ".3f") if r["vs_best_fixed"] else "–",
            fmt(r.get("first_full_batch_s"), ".1f"), r.get("ooms", "–"), r.get("microbatch", "–"),
            r.get("microbatches", "–"), fmt(r.get("peak_gib"), ".1f"), (r.get("error") or "")[:70],
        ])
    header = ["variant", "real tokens/s", "vs best fixed", first, "OOMs", "microbatch", "microbatches", "peak GiB", "error"]
    for line in table_lines(header, rows):
        print(f"[{suite}] | {line}", flush=True)
    write_json(os.path.join(out, f"{suite}.json"), {"args": settings, "results": results})
    with open(os.path.join(out, f"{suite}_table.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(table_lines(header, rows)) + "\n")
    return 0
