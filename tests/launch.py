"""Run a command (the Composer launcher, a script) from the repo root under a hang timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
# The composer launcher of this interpreter's environment; else the one on PATH (packages installed with
# `pip --target` and PYTHONPATH, as scripts/full_suite.sh does on a GPU machine, keep it in <target>/bin).
COMPOSER = Path(sys.executable).parent / "composer"
if not COMPOSER.exists() and shutil.which("composer"):
    COMPOSER = Path(shutil.which("composer"))


def python_path(*first: str) -> str:
    """PYTHONPATH for a child process: `first` (the repo, by default), then the caller's own entries
    (packages the environment puts there stay importable)."""
    entries = list(first or (str(REPO),)) + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(entries))


def run(
    args: list[str], timeout_s: int, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None
) -> subprocess.CompletedProcess:
    """stdout+stderr together; a command still running after `timeout_s` is killed with its
    process group and fails the test as a hang."""
    if env is None:
        env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    # One intra-op thread per rank, as torchrun sets it (the Composer launcher leaves each rank every
    # core: 2 ranks on CI's 2 cores ran ~3x slower). A caller's own OMP_NUM_THREADS is kept.
    env = {"OMP_NUM_THREADS": "1", **env}
    proc = subprocess.Popen(
        args, cwd=cwd or REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"hang: {' '.join(args)} did not finish within {timeout_s} s\n{out[-4000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, None)


NO_GPU_LINE = "no GPU on this machine: running on CPU ranks (gloo) under an emulated memory limit, as --cpu does"


def run_example(script: str, *args: str, timeout_s: int = 240) -> str:
    """`examples/<script>` as a user runs it (torchrun, 2 ranks, the repo on PYTHONPATH) on a machine
    without a GPU (none visible, no `--cpu`: the example says once that it runs as `--cpu` does) under
    the hang timeout; its output. A non-zero exit fails the test."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", f"examples/{script}", *args]
    done = run(command, timeout_s, env={**os.environ, "PYTHONPATH": python_path(), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-4000:]
    assert done.stdout.count(NO_GPU_LINE) == 1, done.stdout[-4000:]
    return done.stdout
