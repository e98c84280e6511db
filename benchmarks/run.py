"""The one benchmark runner: every suite through the shared harness, one record per run.

    python3 benchmarks/run.py --list
    python3 benchmarks/run.py SUITE [SUITE ...] [--out DIR] [--install] [--nproc N] [--timeout S] [--cpu] [-- ARGS]

On a GPU machine of the device tool, from the repo root with `.whl` carried
(`scripts/gpu_wheelhouse.sh` builds it): `--install` puts the wheels ahead of the image's packages
(`/tmp/site`, as `benchmarks/gpu_env.sh` does for a hand-written command). NVLink multicast stays
off in every launch (the device tool's KINDS.md). Each suite is one or more launches: the suite's
own file under `benchmarks/` (its flags: `python3 benchmarks/<file> --help`), under torchrun for
`--nproc` ranks of this host, under `scripts/multinode.py` for simulated nodes, or the main job
under Composer's launcher. ARGS after `--` go to every launch of the suite's file (the last value
of a flag wins). Per launch: its console in `OUT/<launch>.log`, its summary lines (`[suite] ...`)
printed, its rc and seconds; per run, `OUT/run.json`:

    {"suites": [...], "gpus": "...", "versions": "...", "launches": [
        {"suite", "launch", "argv", "env", "rc", "seconds", "timed_out", "log", "json": [files it wrote]}]}

Each suite's own JSON (`OUT/<name>.json` and its `_table.txt`, written by `harness`) sits beside it.
`--cpu` runs a suite's CPU check where it has one (gloo, the tiny model: the plumbing, no figures).
Results that RESULTS.md cites are copied to `docs/results/<session>/`, never into this folder.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SLOW_LINK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}  # NCCL's sockets stand in for an inter-node link


@dataclass
class Launch:
    name: str  # OUT/<name>.log
    argv: list[str]
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    expect_failure: bool = False  # a launch whose failure is the result (steady_oom's stray suite)


@dataclass(frozen=True)
class Suite:
    help: str
    launches: Callable[[argparse.Namespace], list[Launch]]
    cpu: bool = False  # has a CPU check (`--cpu`)
    report: Optional[Callable[[argparse.Namespace], None]] = None  # after its launches: lines from what they wrote


def _py(args: argparse.Namespace) -> str:
    return args.python


def _file(name: str) -> str:
    return os.path.join("benchmarks", name)


def _torchrun(args: argparse.Namespace, nproc: int, script: str, *rest: str, port: Optional[int] = None) -> list[str]:
    head = [_py(args), "-m", "torch.distributed.run"]
    head += ["--standalone"] if port is None else [f"--master-port={port}"]
    return [*head, "--nproc_per_node", str(nproc), _file(script), *rest]


def _nodes(args: argparse.Namespace, nodes: int, per_node: int, timeout: float, script: str, *rest: str,
           gpu: bool = True, slow_link: bool = True) -> list[str]:
    """`scripts/multinode.py`: `nodes` launchers with one rendezvous on this host (NCCL over sockets
    between them with `slow_link`)."""
    flags = ["--gpu"] * gpu + ["--slow-link"] * slow_link
    return [_py(args), "scripts/multinode.py", "--launcher", "torchrun", "--nodes", str(nodes), "--nproc-per-node",
            str(per_node), *flags, "--timeout", str(int(timeout - 10)), "--", _file(script), *rest]


def _cpu_flags(args: argparse.Namespace) -> list[str]:
    return ["--device", "cpu", "--tiny"] if args.cpu else []


# ---- the suites -------------------------------------------------------------------------------------

AUTO_CASE_TIMEOUT = {"nohang": 90, "throughput": 90, "thrash": 90, "hooks": 150, "vs_plain": 150, "parity": 400}
AUTO_TIMEOUT = {"nohang": 190, "throughput": 190, "thrash": 120, "hooks": 300, "vs_plain": 400, "parity": 560}


def _auto_suite(name: str) -> Callable[[argparse.Namespace], list[Launch]]:
    """The `auto` suites on `--nproc` GPUs (real CUDA OOMs): the driver stops starting new cases 40 s
    before the timeout, which is the hang watchdog."""

    def launches(args: argparse.Namespace) -> list[Launch]:
        timeout = args.timeout or AUTO_TIMEOUT[name]
        rest = ["--out", args.out, "--budget-s", str(int(timeout - 40)), "--case-timeout", str(AUTO_CASE_TIMEOUT[name])]
        if name == "nohang":
            rest += ["--runs", "12"]
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"} if name == "thrash" else {}
        return [Launch(name, _torchrun(args, args.nproc or 2, f"{name}.py", *rest, *_cpu_flags(args), *args.rest), timeout, env)]

    return launches


def _steady(args: argparse.Namespace) -> list[Launch]:
    """Steady-phase OOMs after the sync hooks came off (12 runs), the ledger's cost, and a collective
    outside the ledger (detected: that launch is expected to fail)."""
    out = []
    for offset, part in enumerate(("oom", "overhead", "stray")):
        argv = _torchrun(args, args.nproc or 2, "steady_oom.py", "--out", args.out, "--suite", part, *_cpu_flags(args),
                         *args.rest, port=29601 + offset)
        out.append(Launch(f"steady_{part}", argv, args.timeout or (120 if part == "stray" else 400), expect_failure=part == "stray"))
    return out


def _nodes2(args: argparse.Namespace) -> list[Launch]:
    """Two simulated nodes of one GPU each (NCCL over sockets between them): the consensus round,
    steady OOMs, the sync hooks on vs off and search-phase no-hang runs; the ledger's cost on one node."""
    return [
        Launch("nodes2_consensus", _nodes(args, 2, 1, 120, "consensus.py", "--nccl", "--rounds", "2000", "--out",
                                          os.path.join(args.out, "consensus_nccl_2x1.json")), 120),
        Launch("nodes2_oom", _nodes(args, 2, 1, 270, "steady_oom.py", "--out", os.path.join(args.out, "nodes2"), "--suite", "oom",
                                    "--runs", "1:forward,0:backward,both:forward", "--repeat", "2"), 270),
        Launch("overhead", _torchrun(args, 2, "steady_oom.py", "--out", os.path.join(args.out, "overhead"), "--suite", "overhead",
                                     port=29602), 240),
        Launch("nodes2_hooks", _nodes(args, 2, 1, 330, "hooks.py", "--out", os.path.join(args.out, "hooks_nodes2"), "--hooks-size", "4",
                                      "--per-rank-batch", "8", "--rounds", "3", "--window", "2", "--quiet"), 330),
        Launch("nodes2_nohang", _nodes(args, 2, 1, 330, "nohang.py", "--out", os.path.join(args.out, "nohang_nodes2"), "--runs", "6",
                                       "--nohang-batches", "5", "--per-rank-batch", "8", "--budget-s", "270", "--quiet"), 330),
    ]


def _consensus(args: argparse.Namespace) -> list[Launch]:
    """One consensus round's cost: 8 CPU ranks as 1x8, 2x4, 4x2 and 8x1 simulated nodes (gloo), and
    2 simulated nodes of one GPU each on NCCL where the host has 2 GPUs."""
    out = []
    for layout in ("1x8", "2x4", "4x2", "8x1"):
        nodes, per = (int(x) for x in layout.split("x"))
        out.append(Launch(f"consensus_cpu_{layout}", _nodes(args, nodes, per, 240, "consensus.py", "--rounds", "3000", "--out",
                                                            os.path.join(args.out, f"consensus_cpu_{layout}.json"),
                                                            gpu=False, slow_link=False), 240))
    if not args.cpu and _gpus() >= 2:
        out.append(Launch("consensus_nccl_2x1", _nodes(args, 2, 1, 240, "consensus.py", "--nccl", "--rounds", "3000", "--out",
                                                       os.path.join(args.out, "consensus_nccl_2x1.json")), 240))
    return out


def _engine(args: argparse.Namespace) -> list[Launch]:
    """The FSDP2 engine against plain `fully_shard` (benchmarks/engine.py): the seed model's variants
    and Llama 1B at microbatch 4; other variants through ARGS (`-- --suite llama --microbatch 8 --compile`)."""
    if args.rest:
        return [Launch("engine", _torchrun(args, args.nproc or 2, "engine.py", "--out", args.out, *args.rest), args.timeout or 480)]
    return [
        Launch("engine_seed", _torchrun(args, args.nproc or 2, "engine.py", "--suite", "seed", "--rounds", "3", "--iters", "20",
                                        "--out", os.path.join(args.out, "seed")), args.timeout or 240),
        Launch("engine_llama_mb4", _torchrun(args, args.nproc or 2, "engine.py", "--suite", "llama", "--microbatch", "4", "--rounds", "2",
                                             "--out", os.path.join(args.out, "llama_mb4")), args.timeout or 300),
    ]


def _slowlink(args: argparse.Namespace) -> list[Launch]:
    """The engine where the link is slow: the link probe on NVLink and on NCCL's sockets, then Llama
    1B at microbatch 4, plain `fully_shard` against the engine's variants, on sockets."""
    variants = "baseline,engine,engine_implicit,engine_implicit_fsdpbufs,zero2,zero2_pure,hsdp,hsdp_pure"
    return [
        Launch("probe_nvlink", _torchrun(args, 2, "link_probe.py", "--out", os.path.join(args.out, "probe_nvlink")), 90),
        Launch("probe_socket", _torchrun(args, 2, "link_probe.py", "--out", os.path.join(args.out, "probe_socket")), 90, dict(SLOW_LINK)),
        Launch("socket_mb4", _torchrun(args, 2, "engine.py", "--suite", "llama", "--microbatch", "4", "--rounds", "1", "--variants",
                                       variants, "--out", os.path.join(args.out, "socket_mb4"), *args.rest), args.timeout or 330, dict(SLOW_LINK)),
    ]


def _interleaved(args: argparse.Namespace) -> list[Launch]:
    """automicro with the hooks off against plain Composer at fixed sizes, then the sync hooks on vs
    off at one size: interleaved A B A B (harness.py's comparison rule), `--nproc` ranks (1 default)."""
    nproc = args.nproc or 1
    common = ["--out", args.out, "--rounds", "4", "--window", "3", "--per-rank-batch", "24", "--quiet", "--case-timeout", "200"]

    def argv(script: str, *rest: str) -> list[str]:
        return [_py(args), _file(script), *rest] if nproc == 1 else _torchrun(args, nproc, script, *rest)

    return [
        Launch("vs_plain", argv("vs_plain.py", *common, "--sizes", "2,3,4,8", "--budget-s", "260", *args.rest), 330),
        Launch("hooks", argv("hooks.py", *common, "--hooks-size", "4", "--combos", "all:auto,collectives:auto",
                             "--budget-s", "120", *args.rest), 200),
    ]


def _smoke(args: argparse.Namespace) -> list[Launch]:
    """The main job (`configs/tiny-gpu.yaml`) on 2 GPUs, then Llama 1B with per-rank memory fractions
    0.22 / 0.32: a search through real CUDA OOMs."""
    composer = [_py(args), "-m", "composer.cli.launcher", "-n", str(args.nproc or 2), "scripts/train.py", "configs/tiny-gpu.yaml",
                "loggers.console=false"]
    return [
        Launch("smoke_tiny", [*composer, f"run_dir={os.path.join(args.out, 'tiny')}", *args.rest], args.timeout or 300),
        Launch("smoke_l1b", [*composer, "run_name=llama1b-auto", f"run_dir={os.path.join(args.out, 'l1b')}", "model.preset=1b",
                             "model.init_device=meta", "data.kind=synthetic", "data.seq_len=2048", "data.num_samples=4096",
                             "global_train_batch_size=48", "max_duration=16ba",
                             "callbacks.auto_microbatching={memory_fraction: {0: 0.22, 1: 0.32}}", *args.rest], args.timeout or 400),
    ]


def _metric_series(path: str, key: str) -> dict[int, float]:
    series: dict[int, float] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                row = json.loads(line)
                metrics = row.get("metrics", row)
                if key in metrics:
                    series[int(row.get("step", len(series)))] = metrics[key]
    return series


def _ckpt_report(args: argparse.Namespace) -> None:
    full = _metric_series(os.path.join(args.out, "full8", "metrics.jsonl"), "loss/train/total")
    resumed = _metric_series(os.path.join(args.out, "resumed", "metrics.jsonl"), "loss/train/total")
    print(f"[ckpt] uninterrupted: {{{', '.join(f'{k}: {v:.5f}' for k, v in sorted(full.items()))}}}", flush=True)
    print(f"[ckpt] resumed      : {{{', '.join(f'{k}: {v:.5f}' for k, v in sorted(resumed.items()))}}}", flush=True)
    same = [k for k in resumed if k in full]
    if same:
        print(f"[ckpt] largest loss difference over batches {min(same)}-{max(same)}: "
              f"{max(abs(full[k] - resumed[k]) for k in same):.2e}", flush=True)


def _smoke_report(args: argparse.Namespace) -> None:
    for run_ in ("tiny", "l1b"):
        metrics = os.path.join(args.out, run_, "metrics.jsonl")
        tokens = _metric_series(metrics, "throughput/tokens_per_sec")
        sizes = _metric_series(metrics, "automicro/microbatch_size")
        print(f"[smoke] {run_}: last tokens/s {[round(v) for _, v in sorted(tokens.items())][-3:]}, "
              f"microbatch sizes {[int(v) for _, v in sorted(sizes.items())]}", flush=True)


def _ckpt(args: argparse.Namespace) -> list[Launch]:
    """Sharded checkpoints on 2 GPUs: 8 batches straight, 4 then a save, the resume to 8; both loss
    series and their largest difference are printed."""
    composer = [_py(args), "-m", "composer.cli.launcher", "-n", "2", "scripts/train.py", "configs/tiny-gpu.yaml", "loggers.console=false"]
    ck = os.path.join(args.out, "ck")
    return [
        Launch("ckpt_full8", [*composer, f"run_dir={os.path.join(args.out, 'full8')}", "max_duration=8ba", *args.rest], 300),
        Launch("ckpt_first4", [*composer, f"run_dir={os.path.join(args.out, 'first4')}", "max_duration=4ba", f"save_folder={ck}",
                               "save_interval=4ba", "checkpoint_format=sharded", *args.rest], 300),
        Launch("ckpt_resumed", [*composer, f"run_dir={os.path.join(args.out, 'resumed')}", "max_duration=8ba",
                                f"load_path={os.path.join(ck, 'ep0-ba4')}", "checkpoint_format=sharded", *args.rest], 300),
    ]


def _one_process(script: str, default_timeout: float) -> Callable[[argparse.Namespace], list[Launch]]:
    """A suite that starts its own processes (one_gpu: one launch per variant) or runs as one."""

    def launches(args: argparse.Namespace) -> list[Launch]:
        name = script[:-3]
        extra = ["--dry-run"] if args.cpu and name == "one_gpu" else (["--device", "cpu", "--tiny"] if args.cpu else [])
        return [Launch(name, [_py(args), _file(script), "--out", args.out, *extra, *args.rest], args.timeout or default_timeout)]

    return launches


def _torchrun_suite(script: str, default_timeout: float, nproc: int = 2) -> Callable[[argparse.Namespace], list[Launch]]:
    def launches(args: argparse.Namespace) -> list[Launch]:
        return [Launch(script[:-3], _torchrun(args, args.nproc or nproc, script, "--out", args.out, *_cpu_flags(args), *args.rest),
                       args.timeout or default_timeout)]

    return launches


def _pipeline(args: argparse.Namespace) -> list[Launch]:
    """Pipeline stages on 2 GPUs: no-hang searches with one tight stage, auto against fixed sizes,
    stage memory per schedule (benchmarks/gpu_pipeline.py `run`; its parts and cases through ARGS)."""
    rest = ["--cpu-dry"] if args.cpu else []
    return [Launch("pipeline", [_py(args), _file("gpu_pipeline.py"), "run", "--out", args.out, *rest, *args.rest], args.timeout or 590)]


SUITES: dict[str, Suite] = {
    "nohang": Suite("search-phase no-hang runs under random per-rank memory fractions (real CUDA OOMs)", _auto_suite("nohang"), cpu=True),
    "throughput": Suite("auto against a fixed-size sweep and halving, with the search's cost", _auto_suite("throughput"), cpu=True),
    "thrash": Suite("allocator retries (thrash) at a size that fits", _auto_suite("thrash"), cpu=True),
    "hooks": Suite("the sync hooks on vs off at one size, interleaved", _auto_suite("hooks"), cpu=True),
    "vs_plain": Suite("automicro, hooks off, against plain Composer at fixed sizes, interleaved", _auto_suite("vs_plain"), cpu=True),
    "parity": Suite("300-step loss parity against plain Composer (run it alone: ~9 min on 1B)", _auto_suite("parity"), cpu=True),
    "interleaved": Suite(_interleaved.__doc__ or "", _interleaved),
    "steady": Suite(_steady.__doc__ or "", _steady, cpu=True),
    "nodes2": Suite(_nodes2.__doc__ or "", _nodes2),
    "consensus": Suite(_consensus.__doc__ or "", _consensus, cpu=True),
    "engine": Suite(_engine.__doc__ or "", _engine),
    "slowlink": Suite(_slowlink.__doc__ or "", _slowlink),
    "smoke": Suite(_smoke.__doc__ or "", _smoke, report=_smoke_report),
    "ckpt": Suite(_ckpt.__doc__ or "", _ckpt, report=_ckpt_report),
    "pipeline": Suite(_pipeline.__doc__ or "", _pipeline, cpu=True),
    "one_gpu": Suite("one GPU as a user runs it: eager, compile, unsharded, Composer's own auto; shared cards (benchmarks/one_gpu.py)",
                     _one_process("one_gpu.py", 590), cpu=True),
    "left_behind": Suite("what a failed attempt leaves allocated after its wipe, eager and compiled (one GPU)",
                         _one_process("left_behind.py", 420), cpu=True),
    "varlen": Suite("variable-length data: the token budget against sample-count auto (one GPU)", _one_process("varlen.py", 590)),
    "torch_loop": Suite("a plain PyTorch loop: AutoStep against fixed sizes and accelerate's find_executable_batch_size (one GPU)",
                        _one_process("torch_loop.py", 590), cpu=True),
    "hf_trainer": Suite("the Hugging Face Trainer with accelerate's FSDP2: AutoMicrobatchTrainer against fixed sizes and auto_find_batch_size",
                        _one_process("hf_trainer.py", 590)),
    "ledger_cost": Suite("the collective ledger's watcher thread and bookkeeping, nothing failing", _torchrun_suite("ledger_cost.py", 240)),
    "link_probe": Suite("the engine's link probe (the bandwidth it plans with)", _torchrun_suite("link_probe.py", 90)),
}


# ---- running ---------------------------------------------------------------------------------------


def _gpus() -> int:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False, timeout=30)
        return len([line for line in done.stdout.splitlines() if line.startswith("GPU")])
    except (OSError, subprocess.TimeoutExpired):
        return 0


def _install(python: str) -> dict[str, str]:
    """The carried wheels ahead of the image's packages (the device tool's machines start bare)."""
    wheels = sorted(glob.glob(os.path.join(harness.REPO_ROOT, ".whl", "*.whl")))
    if not wheels:
        raise SystemExit("run.py --install: no wheels in .whl/ (build them here: bash scripts/gpu_wheelhouse.sh, then carry .whl)")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                    "--target", "/tmp/site", *wheels], check=True)
    return {"PYTHONPATH": os.pathsep.join(["/tmp/site", harness.REPO_ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def _summary_lines(text: str) -> list[str]:
    """A suite's console summary: its `[prefix] ...` lines, not `[prefix:detail]` ones or the trainer's."""
    keep = []
    for line in text.splitlines():
        if line.startswith("[") and "]" in line:
            tag = line[1:line.index("]")]
            if tag and ":" not in tag and tag not in ("automicro",) and not tag.startswith("rank"):
                keep.append(line)
    return keep


def run(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="suites: " + ", ".join(SUITES))
    p.add_argument("suites", nargs="*")
    p.add_argument("--list", action="store_true", help="the suites and what each measures")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/bench"), help="where logs and JSON go (never the code tree)")
    p.add_argument("--install", action="store_true", help="install the carried wheels (.whl) first (a bare GPU machine)")
    p.add_argument("--nproc", type=int, default=0, help="ranks of this host for the suites that take it (their default otherwise)")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds per launch (the suite's default otherwise): the hang watchdog")
    p.add_argument("--cpu", action="store_true", help="the suite's CPU check (gloo, tiny model): plumbing, no figures")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--dry-run", action="store_true", help="print the launches, run nothing")
    args = p.parse_args(argv)
    args.rest = rest
    if args.list or not args.suites:
        for name, suite in SUITES.items():
            print(f"{name:12s} {' '.join(suite.help.split())}{'  [--cpu]' if suite.cpu else ''}")
        return 0
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        raise SystemExit(f"run.py: unknown suite(s) {unknown}; choose from {list(SUITES)}")
    no_cpu = [s for s in args.suites if args.cpu and not SUITES[s].cpu]
    if no_cpu:
        raise SystemExit(f"run.py: suite(s) {no_cpu} have no CPU check; run them on a GPU machine, without --cpu")
    os.makedirs(args.out, exist_ok=True)
    env = {**MULTICAST_OFF, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.setdefault("PYTHONPATH", os.pathsep.join([harness.REPO_ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.install:
        env.update(_install(args.python))
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False).stdout.strip() if _gpus() else "no GPU"
    versions = subprocess.run([args.python, "-c", "import torch, composer; print('torch', torch.__version__, 'composer', composer.__version__)"],
                              capture_output=True, text=True, check=False, env={**os.environ, **env}).stdout.strip()
    print(f"[run] {gpus.replace(chr(10), '; ')}; {versions}", flush=True)
    record: dict[str, Any] = {"suites": args.suites, "gpus": gpus, "versions": versions, "args": {**vars(args)}, "launches": []}
    failed = False
    for name in args.suites:
        for launch in SUITES[name].launches(args):
            if args.dry_run:
                print(f"[run] {launch.name}: {' '.join(launch.argv)} (timeout {launch.timeout:.0f} s, env {launch.env})")
                continue
            before = set(glob.glob(os.path.join(args.out, "**", "*.json"), recursive=True))
            started = time.perf_counter()
            done = harness.run_launch(launch.argv, launch.timeout, env={**env, **launch.env})
            seconds = time.perf_counter() - started
            log = os.path.join(args.out, f"{launch.name}.log")
            with open(log, "w", encoding="utf-8") as handle:
                handle.write((done.stdout or "") + "\n--- stderr ---\n" + (done.stderr or ""))
            for line in _summary_lines(done.stdout or ""):
                print(line, flush=True)
            made = sorted(set(glob.glob(os.path.join(args.out, "**", "*.json"), recursive=True)) - before)
            ok = (done.returncode != 0) if launch.expect_failure else (done.returncode == 0)
            failed |= not ok
            word = "ok" if ok else ("TIMEOUT" if done.returncode == 124 else "FAILED")
            print(f"[run] {name}/{launch.name}: rc {done.returncode} ({word}{', failure expected' if launch.expect_failure else ''}) "
                  f"in {seconds:.0f} s; log {log}", flush=True)
            if not ok:
                tail = [line for line in (done.stderr or done.stdout or "").splitlines() if "Error" in line or "Traceback" in line]
                for line in tail[-6:]:
                    print(f"[run]   {line[:240]}", flush=True)
            record["launches"].append({
                "suite": name, "launch": launch.name, "argv": launch.argv, "env": launch.env, "rc": done.returncode,
                "seconds": round(seconds, 1), "timed_out": done.returncode == 124, "log": log, "json": made,
            })
            harness.write_json(os.path.join(args.out, "run.json"), record)
        if SUITES[name].report is not None and not args.dry_run:
            SUITES[name].report(args)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(run())
