"""Pipeline parallelism on 2 GPUs (2 stages): the cases, a per-rank memory probe around
scripts/train.py, and the parser that turns the runs into JSON and tables.

  # every part's cases (what `python3 benchmarks/run.py pipeline` launches); --help for the parts' knobs
  python benchmarks/gpu_pipeline.py run --out OUT [--parts nohang,throughput,memory] [--cpu-dry]

  # one rank of a training run, with its peak GPU memory written to $PROBE_DIR/rank<R>.json at exit
  python -m composer.cli.launcher -n 2 benchmarks/gpu_pipeline.py probe CONFIG key=value ...
  # the runs under OUT/<part>/<case>/ (console.log, rc, metrics.jsonl, probe/rank*.json) -> JSON + table
  python benchmarks/gpu_pipeline.py parse OUT PART

PROBE_FRACTION="r:f" limits rank r's GPU to fraction f (as memory_fraction does in auto runs).
Peak memory (MiB) is torch.cuda.max_memory_allocated / max_memory_reserved at exit. AutoMicrobatching
resets the peak at every attempt (also at a fixed size), so the figure is the last batch's peak:
the steady-state peak of a fixed-size run. With PROBE_CPU_CAP=1 (CPU_DRY runs) it is the peak of the
memory_cap callback's MemoryCap (live tensor storages on CPU; never reset at a fixed size).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import statistics
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

MIB = 1024**2
# Per-batch figures leave out the first batches (the search and the batches with the sync hooks on).
STEADY_FROM = 4
ATTEMPT = re.compile(r"\[automicro\] batch (\d+) attempt (\d+): size (\d+) split \[([^\]]*)\] -> (\w+)(?: on rank\(s\) \[([^\]]*)\] at \[([^\]]*)\])?; next size (\d+)")
FOUND = re.compile(r"microbatch size found: (\w+) .*split in use \[([^\]]*)\](?:; layout: [^;]*)?; attempts (\d+), OOMs (\d+)")
DONE = re.compile(r"done: (\d+) batches, final loss (\S+), ([\d,]+) tokens/s over the whole fit \(([\d.]+) s")


def probe(argv: list[str]) -> None:
    out = os.environ.get("PROBE_DIR")

    caps: list = []
    if os.environ.get("PROBE_CPU_CAP"):  # CPU stand-in: the peak of the memory_cap callback's MemoryCap
        from automicro.testing import memory_cap

        init = memory_cap.MemoryCap.__init__

        def record(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            caps.append(self)

        memory_cap.MemoryCap.__init__ = record

    def dump() -> None:
        import torch

        if not out:
            return
        rank = int(os.environ.get("RANK", "0"))
        os.makedirs(out, exist_ok=True)
        if not torch.cuda.is_available():
            if caps:
                stats = caps[-1].stats()
                with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
                    json.dump({"rank": rank, "source": "memory_cap (CPU)", "peak_allocated_mib": stats["peak_bytes"] / MIB,
                               "peak_reserved_mib": None, "num_ooms": stats.get("num_ooms")}, handle)
            return
        doc = {
            "source": "torch.cuda",
            "rank": rank,
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
            "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries"),
            "num_ooms": torch.cuda.memory_stats().get("num_ooms"),
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
            json.dump(doc, handle)

    atexit.register(dump)
    # PROBE_FRACTION="rank:fraction": the same per-process memory limit that AutoMicrobatching's
    # memory_fraction sets, for fixed-size runs (where the callback stays idle).
    spec = os.environ.get("PROBE_FRACTION")
    if spec:
        import torch

        rank, fraction = spec.split(":")
        if torch.cuda.is_available() and int(rank) == int(os.environ.get("RANK", "0")):
            torch.cuda.set_per_process_memory_fraction(float(fraction), device=int(os.environ.get("LOCAL_RANK", "0")))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "scripts"))
    sys.argv = [os.path.join(root, "scripts", "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def read_case(folder: str) -> dict:
    case = {"case": os.path.basename(folder)}
    meta_path = os.path.join(folder, "meta.json")
    if os.path.exists(meta_path):
        case.update(json.load(open(meta_path)))
    rc_path = os.path.join(folder, "rc")
    case["rc"] = int(open(rc_path).read().strip() or -1) if os.path.exists(rc_path) else None
    case["hang"] = case["rc"] in (124, 137)
    log = open(os.path.join(folder, "console.log"), errors="replace").read() if os.path.exists(os.path.join(folder, "console.log")) else ""
    attempts = []
    for m in ATTEMPT.finditer(log):
        attempts.append({
            "batch": int(m[1]), "attempt": int(m[2]), "size": int(m[3]), "split": m[4], "outcome": m[5],
            "ranks": m[6], "sites": m[7], "next_size": int(m[8]),
        })
    case["attempts"] = attempts
    case["oom_attempts"] = [a for a in attempts if a["outcome"] != "ok"]
    found = FOUND.search(log)
    if found:
        case["found_size"] = int(found[1]) if found[1].isdigit() else None
        case["size_in_use"] = int(found[2].split(",")[0]) if found[2].strip() else None
        case["attempts_total"], case["ooms_total"] = int(found[3]), int(found[4])
    done = DONE.search(log)
    case["finished"] = bool(done) and case["rc"] == 0
    if done:
        case["batches"], case["final_loss"] = int(done[1]), float(done[2])
        case["fit_tokens_per_s"], case["fit_s"] = float(done[3].replace(",", "")), float(done[4])
    errors = [line for line in log.splitlines() if re.search(r"Error|Traceback|error:", line) and "Warning" not in line]
    case["errors"] = errors[:20]
    metrics = os.path.join(folder, "run", "metrics.jsonl")
    if os.path.exists(metrics):
        rows = []
        for line in open(metrics):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
        tps = [r["throughput/tokens_per_sec"] for r in rows if "throughput/tokens_per_sec" in r]
        case["tokens_per_s_last"] = tps[-1] if tps else None
        case["tokens_per_s_series"] = tps
        # Composer logs time/train (hours) and time/token at every batch: per-batch seconds and tokens.
        hours = {r["step"]: r["time/train"] for r in rows if "time/train" in r}
        tokens = {r["step"]: r["time/token"] for r in rows if "time/token" in r}
        steps = sorted(set(hours) & set(tokens))
        case["batch_seconds"] = [round((hours[b] - hours[a]) * 3600, 4) for a, b in zip(steps, steps[1:])]
        case["batch_tokens"] = [tokens[b] - tokens[a] for a, b in zip(steps, steps[1:])]
        steady = case["batch_seconds"][STEADY_FROM:]
        if steady:
            case["steady_median_s"] = statistics.median(steady)
            case["steady_tokens_per_s"] = case["batch_tokens"][-1] / case["steady_median_s"]
        peaks = [r["memory/peak_allocated_mem"] for r in rows if "memory/peak_allocated_mem" in r]
        case["monitor_peak_allocated_gb_last"] = peaks[-1] if peaks else None
    probe_dir = os.path.join(folder, "probe")
    case["peak"] = {}
    if os.path.isdir(probe_dir):
        for name in sorted(os.listdir(probe_dir)):
            doc = json.load(open(os.path.join(probe_dir, name)))
            case["peak"][str(doc["rank"])] = doc
    return case


def sites(case: dict) -> str:
    return "; ".join(f"b{a['batch']}a{a['attempt']} s{a['size']} {a['outcome']} r[{a['ranks']}] {a['sites']}" for a in case["oom_attempts"]) or "-"


def table(part: str, cases: list[dict]) -> list[str]:
    f = harness.fmt
    if part == "nohang":
        header = ["case", "schedule", "fractions", "attempts", "OOMs", "failed attempts: batch/attempt size ranks sites", "found (in use)", "batches", "finished", "hang", "s"]
        rows = [[c["case"], c.get("schedule"), c.get("fractions"), c.get("attempts_total", len(c["attempts"])),
                 c.get("ooms_total", len(c["oom_attempts"])), sites(c), f"{c.get('found_size')} ({c.get('size_in_use')})", c.get("batches"),
                 c["finished"], c["hang"], c.get("wall_s")] for c in cases]
    elif part == "throughput":
        header = ["case", "schedule", "override", "fractions", "microbatch", "finished", "OOMs", "tokens/s (last window)",
                  f"tokens/s (median batch from {STEADY_FROM + 1})", "tokens/s whole fit", "peak alloc r0/r1 MiB"]
        rows = [[c["case"], c.get("schedule"), (c.get("extra") or "-").split(".")[-1], c.get("fractions"),
                 c.get("found_size") if c.get("mb") == "auto" and c.get("found_size") else c.get("mb"),
                 c["finished"], c.get("ooms_total", len(c["oom_attempts"])), f(c.get("tokens_per_s_last"), ",.0f"),
                 f(c.get("steady_tokens_per_s"), ",.0f"), f(c.get("fit_tokens_per_s"), ",.0f"),
                 "/".join(f(c["peak"].get(r, {}).get("peak_allocated_mib"), ".0f") for r in ("0", "1"))] for c in cases]
    else:
        header = ["case", "schedule", "keep_graph", "act_ckpt", "microbatch", "finished", "peak alloc r0 MiB", "peak alloc r1 MiB", "peak reserved r0/r1 MiB", "tokens/s (last window)"]
        rows = [[c["case"], c.get("schedule"), c.get("keep_graph"), c.get("ac"), c.get("mb"), c["finished"],
                 f(c["peak"].get("0", {}).get("peak_allocated_mib"), ".1f"), f(c["peak"].get("1", {}).get("peak_allocated_mib"), ".1f"),
                 "/".join(f(c["peak"].get(r, {}).get("peak_reserved_mib"), ".0f") for r in ("0", "1")),
                 f(c.get("tokens_per_s_last"), ",.0f")] for c in cases]
    return harness.table_lines(header, rows)


def parse(out: str, part: str) -> None:
    root = os.path.join(out, part)
    cases = [read_case(os.path.join(root, d)) for d in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, d))]
    cases.sort(key=lambda c: c.get("order", 0))
    lines = table(part, cases)
    harness.write_json(os.path.join(out, f"pipeline_{part}.json"), {"part": part, "cases": cases, "table": lines})
    with open(os.path.join(out, f"pipeline_{part}_table.txt"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---- the cases (`run`) -------------------------------------------------------------------------------

NOHANG_SPECS = ("zb-r0-015 ZeroBubble 0:0.15,1f1b-r1-020 1F1B 1:0.20,zb-r1-025 ZeroBubble 1:0.25,"
                "1f1b-r0-030 1F1B 0:0.30,zb-r0-035 ZeroBubble 0:0.35,1f1b-r0-017 1F1B 0:0.17")


def _specs(text: str) -> list[list[str]]:
    """Comma-separated specs of space-separated fields (';' between specs when an override holds commas)."""
    return [spec.split() for spec in text.split(";" if ";" in text else ",") if spec.strip()]


def run(argv: list[str]) -> int:
    """Each case: one `composer -n 2` launch of scripts/train.py under the probe, its console, rc,
    metrics and per-rank peaks under WORK/<part>/<case>/; then each part's JSON and table in OUT."""
    import argparse
    import subprocess
    import time

    p = argparse.ArgumentParser(prog="gpu_pipeline.py run")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/gpu_pipeline", help="the runs' folders (logs, metrics, probes)")
    p.add_argument("--parts", default="nohang,throughput,memory")
    p.add_argument("--run-s", type=float, default=170.0, help="each case's timeout (the hang watchdog)")
    p.add_argument("--cpu-dry", action="store_true", help="CPU stand-in: configs/tiny-cpu-pp.yaml under memory caps")
    p.add_argument("--gbs", type=int, default=0, help="global batch (32 on GPUs, 12 on the CPU stand-in)")
    p.add_argument("--nohang-specs", default=NOHANG_SPECS, help="'name schedule rank:fraction[ override]', ...")
    p.add_argument("--nohang-dur", default="8ba")
    p.add_argument("--tp-specs", default="", help="'name schedule microbatch[ override]', ... (microbatch: auto, N, found, half, double)")
    p.add_argument("--tp-sched", default="1F1B")
    p.add_argument("--tp-frac", default="0:0.20")
    p.add_argument("--tp-dur", default="14ba")
    p.add_argument("--mem-mb", default="4")
    p.add_argument("--mem-dur", default="4ba")
    args = p.parse_args(argv)
    dry = args.cpu_dry
    gbs = args.gbs or (12 if dry else 32)
    if dry:
        config, mp = "configs/tiny-cpu-pp.yaml", "FULL"
        base = [f"global_train_batch_size={gbs}", "loggers.console=false", "eval_interval=null", "save_folder=null", "load_path=null"]
    else:
        config, mp = "configs/tiny-gpu.yaml", "DEFAULT"
        base = ["model.preset=1b", "model.init_device=meta", "model.tie_embeddings=false", "data.kind=synthetic", "data.seq_len=2048",
                "data.num_samples=4096", f"global_train_batch_size={gbs}", "loggers.console=false", "eval_interval=null",
                "save_folder=null", "load_path=null", "precision=amp_bf16"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"PROBE_CPU_CAP": "1"} if dry else {})}
    order = 0

    def case_run(part: str, name: str, sched: str, keep: str, ac: str, mb: str, frac: str, dur: str, extra: str = "") -> str:
        nonlocal order
        folder = os.path.join(args.work, part, name)
        subprocess.run(["rm", "-rf", folder], check=False)
        os.makedirs(folder)
        order += 1
        fsdp2 = f"fsdp2: {{mixed_precision: {mp}, activation_checkpointing: {ac}}}"
        pc = (f"parallelism_config={{{fsdp2}}}" if sched == "FSDP2" else
              f"parallelism_config={{{fsdp2}, pipeline: {{stages: 2, schedule: {sched}, keep_graph_after_input_grad: {keep}}}}}")
        cb = f"callbacks.auto_microbatching.memory_fraction={{{frac}}}" if frac != "none" and not dry else "callbacks.auto_microbatching.log_attempts=true"
        # The CPU stand-in's memory caps stay tight for the searches, roomy for fixed sizes.
        more = ["callbacks.memory_cap.limit_bytes={0: 2000000000, 1: 2000000000}"] if dry and frac == "none" else []
        argv_ = [sys.executable, "-m", "composer.cli.launcher", "-n", "2", os.path.abspath(__file__), "probe", config,
                 f"run_name=pp-{name}", f"run_dir={os.path.join(folder, 'run')}", *base, f"max_duration={dur}",
                 f"device_train_microbatch_size={mb}", pc, cb, *more, *([extra] if extra else [])]
        # A fixed size leaves AutoMicrobatching idle (no memory_fraction): the probe sets the same fraction.
        case_env = {**env, "PROBE_FRACTION": "" if frac == "none" else frac, "PROBE_DIR": os.path.join(folder, "probe")}
        started = time.time()
        done = harness.run_launch(argv_, args.run_s, env=case_env)
        with open(os.path.join(folder, "console.log"), "w", encoding="utf-8") as handle:
            handle.write((done.stdout or "") + (done.stderr or ""))
        with open(os.path.join(folder, "rc"), "w", encoding="utf-8") as handle:
            handle.write(str(done.returncode))
        wall = int(time.time() - started)
        with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as handle:
            json.dump({"order": order, "schedule": sched, "keep_graph": keep == "true", "ac": ac == "true", "mb": mb,
                       "fractions": frac, "duration": dur, "extra": extra, "wall_s": wall}, handle)
        lines = [line for line in (done.stdout or "").splitlines() if re.search(r"\[automicro\] (done|microbatch size found|fixed)", line)]
        print(f"[pipeline] {part}/{name}: rc {done.returncode} in {wall} s; {' '.join(lines)[:300]}", flush=True)
        if done.returncode != 0:
            print("\n".join(line for line in (done.stdout or "").splitlines()[-40:] if "Warning" not in line), flush=True)
        return folder

    started = time.time()
    for part in filter(None, args.parts.split(",")):
        if part == "nohang":  # one tight stage per case
            for name, sched, frac, *extra in _specs(args.nohang_specs):
                case_run("nohang", name, sched, "false", "false", "auto", frac, args.nohang_dur, " ".join(extra))
        elif part == "throughput":  # in this order; "found" = the size the first auto case found
            specs = _specs(args.tp_specs or f"auto {args.tp_sched} auto,fixed-half {args.tp_sched} half,"
                           f"fixed-found {args.tp_sched} found,fixed-double {args.tp_sched} double")
            found: Optional[int] = None
            for name, sched, mb, *extra in specs:
                if mb != "auto" and not mb.isdigit():
                    if found is None:
                        print(f"[pipeline] skip {name}: no size found yet", flush=True)
                        continue
                    size = {"found": found, "half": found // 2, "double": found * 2}[mb]
                    if size < 1 or size > gbs // 2:
                        print(f"[pipeline] skip {name}: size {size}", flush=True)
                        continue
                    mb = str(size)
                folder = case_run("throughput", name, sched, "false", "false", mb, args.tp_frac, args.tp_dur, " ".join(extra))
                if found is None and mb == "auto" and sched != "FSDP2":
                    case = read_case(folder)
                    found = case.get("found_size") or case.get("size_in_use")
                    print(f"[pipeline] found size: {found}", flush=True)
        elif part == "memory":
            for sched in ("1F1B", "ZeroBubble"):
                for keep in ("false", "true"):
                    for ac in ("false", "true"):
                        case_run("memory", f"{sched}-keep_{keep}-ac_{ac}", sched, keep, ac, args.mem_mb, "none", args.mem_dur)
        else:
            raise SystemExit(f"gpu_pipeline.py run: unknown part {part!r} (nohang, throughput, memory)")
        parse(args.work, part)
        os.makedirs(args.out, exist_ok=True)
        for suffix in (".json", "_table.txt"):
            subprocess.run(["cp", os.path.join(args.work, f"pipeline_{part}{suffix}"), args.out], check=False)
        print(f"[pipeline] {part} done at {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "run":
        raise SystemExit(run(sys.argv[2:]))
    if sys.argv[1] == "probe":
        probe(sys.argv[2:])
    elif sys.argv[1] == "parse":
        parse(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
