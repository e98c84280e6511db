"""After a run-ending error the process exits within `exit_timeout_s` (`automicro.core.exit_watch`):
a hang at exit (a thread, an atexit handler) is ended with one line and every thread's stack; a
program that catches the error is left alone. Never a silent hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from automicro.batch.settings import Settings
from tests.launch import REPO, python_path, run

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from automicro.core import exit_watch
    mode = sys.argv[1]
    def exit_that_waits(seconds):
        time.sleep(seconds)
    if mode == "thread":
        threading.Thread(target=exit_that_waits, args=(600,)).start()  # a non-daemon thread that never ends
    else:
        atexit.register(exit_that_waits, 600 if mode in ("atexit", "raised_from", "unmarked", "finished") else 3)
    if mode == "finished":  # a run that trained to its end, whose exit waits (inductor's compile workers)
        exit_watch.arm_finished(timeout_s=1.0, rank=0)
        print("done", flush=True)
        sys.exit(0)
    error = RuntimeError("the run's error")
    if mode != "unmarked":
        exit_watch.arm(error, timeout_s=1.0, rank=1)
    if mode == "caught_then_slow_exit":
        try:
            raise error
        except RuntimeError:
            print("caught, going on", flush=True)
        sys.exit(0)
    if mode == "raised_from":
        raise ValueError("raised while handling it") from error
    raise error
""")


# A process here takes 1-5 s (its imports, then 1 s of grace); the exits it would otherwise wait for take 600 s. The
# bounds sit between: ten times what the process took on CI's loaded 2 cores still passes, a hang does not.
ENDED_WITHIN_S = 150.0
HANG_S = 300.0


def _python(mode: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return done, time.perf_counter() - started


@pytest.mark.parametrize("mode", ["thread", "atexit", "raised_from"])
def test_a_hang_at_exit_after_the_run_ended_with_an_error_is_ended_with_what_held_it(mode):
    done, seconds = _python(mode, timeout_s=HANG_S)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert seconds < ENDED_WITHIN_S, seconds  # 1 s of grace, not the 600 s the exit would have taken
    printed = [x for x in done.stderr.splitlines() if x.strip() == "RuntimeError: the run's error"]
    assert len(printed) == 1, done.stderr  # the error and its traceback, printed once (by the interpreter)
    line = [x for x in done.stderr.splitlines() if x.startswith("[automicro] rank 1: the process is still exiting 1 s")]
    uncaught = "ValueError: raised while handling it" if mode == "raised_from" else "RuntimeError: the run's error"
    assert len(line) == 1 and f"ended with {uncaught};" in line[0] and "exit_timeout_s" in line[0], done.stderr[-2000:]
    stacks = done.stderr.split(line[0], 1)[1]  # every thread's stack shows what the exit waited on
    assert "most recent call first" in stacks and "exit_that_waits" in stacks, done.stderr[-2000:]


def test_a_program_that_catches_the_error_is_left_to_exit_in_its_own_time():
    done, seconds = _python("caught_then_slow_exit", timeout_s=HANG_S)
    assert done.returncode == 0 and "caught, going on" in done.stdout, done.stderr[-2000:]
    assert seconds >= 3 and "[automicro]" not in done.stderr  # its 3 s atexit ran to the end


def test_an_error_automicro_did_not_end_the_run_with_is_not_watched():
    """Its exit waits 600 s: still running after 5 s, however fast or slow the machine."""
    with pytest.raises(subprocess.TimeoutExpired):
        _python("unmarked", timeout_s=5)


@pytest.mark.parametrize("value", [0, -1, True, "30"])
def test_exit_timeout_s_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match=r"exit_timeout_s=.*must be a positive number of seconds"):
        Settings.parse(exit_timeout_s=value)


@pytest.mark.multiproc
def test_every_rank_of_a_run_ended_by_a_non_oom_error_exits_though_its_exit_hangs():
    """2 ranks under torchrun, rank 1 raises at its backward in batch 1, each process's exit then waits
    for ever (an atexit handler, as inductor's compile-worker shutdown can): torchrun returns with the
    error on rank 1, the other rank naming it, and rank 0's exit ended by its watch after its 10 s, not a hang; rank 1
    (its watch at 600 s) is then ended by torchrun, which stops every worker once one exits with an error. Each rank
    printed its error long before: rank 1's as it raised, rank 0's at least 10 s before its exit ended."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "tests/exit_watch_run.py", "backward"]
    started = time.perf_counter()
    done = run(command, timeout_s=HANG_S, env={"PYTHONPATH": python_path(), "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
                                                **{k: v for k, v in __import__("os").environ.items() if k == "PATH"}})
    seconds = time.perf_counter() - started
    out = done.stdout
    assert done.returncode != 0, out[-3000:]
    assert "[test] rank 0 starts" in out and "[test] rank 1 starts" in out and "trained on" not in out, out[-3000:]
    assert "InjectedFault: injected error at backward on rank 1" in out, out[-3000:]
    assert "FailedOnOtherRank" in out and "rank(s) [1] failed with a non-OOM error at ['backward']" in out, out[-3000:]
    assert "[automicro] rank 0: the process is still exiting 10 s after the run ended with" in out, out[-3000:]
    assert "[automicro] rank 1: the process is still exiting" not in out, out[-3000:]
    assert seconds < ENDED_WITHIN_S, seconds  # about 25 s on CI; the exits would wait for ever


def test_a_finished_run_whose_exit_hangs_is_ended_with_exit_code_0_and_what_held_it():
    """`automicro.train` (and `automicro.bound_exit()`) bound the exit of a run that finished: torch inductor's
    compile-worker shutdown after a cold start held a finished run on an H200 past its launcher's limit."""
    done, seconds = _python("finished", timeout_s=HANG_S)
    assert done.returncode == 0 and done.stdout.strip() == "done" and seconds < ENDED_WITHIN_S, (done.returncode, seconds, done.stderr[-2000:])
    [line] = [x for x in done.stderr.splitlines() if x.startswith("[automicro] rank 0: the process is still exiting 1 s")]
    assert "after its run finished;" in line and "exit code 0" in line, line
    assert "exit_that_waits" in done.stderr.split(line, 1)[1], done.stderr[-2000:]
