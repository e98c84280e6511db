"""A run that stops making progress says where it is stuck and ends; SIGTERM ends it within seconds
(`automicro.core.watchdog`). On 2 CPU ranks (gloo, tests/stall_cases.py): a stall injected on rank 1 in a forward,
before a collective, inside a consensus round, inside a compile, inside a checkpoint save and inside an
evaluation is reported on every rank (the phase, what the main thread waits in, every thread's stack) and ends
every rank with the stall's exit code; a SIGTERM while the main thread is blocked in a collective ends the process
within ``signal_exit_s``; a long but legitimate first compile is not ended. The limits themselves, without
processes, below."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest

from automicro.core import watchdog as wd
from automicro.testing.multiprocess import MultiprocessFailure, run_multiprocess
from tests import stall_cases as cases

REPO = Path(__file__).resolve().parent.parent


def _stalled(where, tmp_path, **kwargs):
    """Runs the case; every rank must end: the stalled one (1) by its watchdog, the other by its own, or by the
    error its collective raises once rank 1 ended (gloo notices a closed peer on torch >= 2.8; whichever limit
    comes first is a race). Returns each rank's stderr, the seconds it took and rank 0's exit code."""
    began = time.monotonic()
    with pytest.raises(MultiprocessFailure) as failed:
        run_multiprocess(cases.run, world_size=2, args=(where, str(tmp_path)), kwargs=kwargs, timeout_s=120)
    took = time.monotonic() - began
    codes = failed.value.exitcodes
    assert codes.get(1) == wd.STALL_EXIT_CODE and codes.get(0) in (wd.STALL_EXIT_CODE, 1), (codes, failed.value.errors)
    if codes[0] == 1:
        assert "Connection closed by peer" in failed.value.errors.get(0, ""), failed.value.errors
    return [(tmp_path / f"rank{rank}.err").read_text() for rank in (0, 1)], took, codes[0]


def _lines(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


@pytest.mark.multiproc
@pytest.mark.parametrize("where, rank0_in, rank1_in", [
    ("collective", ["a collective"], ["a collective"]),  # rank 1 sleeps before its all-gather, rank 0 waits in it
    ("consensus", ["a consensus round"], ["stall_cases.py"]),
    ("compile", ["a consensus round"], ["a compile (torch.compile)"]),
    ("checkpoint", ["a checkpoint save"], ["a checkpoint save"]),
    ("evaluation", ["a collective", "an evaluation"], ["an evaluation"]),
])
def test_a_stall_is_named_on_every_rank_with_its_stacks_and_ends_the_run(where, rank0_in, rank1_in, tmp_path):
    (rank0, rank1), took, code0 = _stalled(where, tmp_path)
    for rank, text, places in ((0, rank0, rank0_in), (1, rank1, rank1_in)):
        [report] = _lines(text, f"[automicro] rank {rank}: no progress for ")
        ends = _lines(text, f"[automicro] rank {rank}: ending the run: no progress for ")
        assert len(ends) == (1 if rank == 1 or code0 == wd.STALL_EXIT_CODE else 0), ends
        for line in [report, *ends]:
            waits = line.split("the main thread is ", 1)[1]
            assert all(place in waits for place in places), (places, line)
            assert "exit code" not in line or line.endswith(f"exit code {wd.STALL_EXIT_CODE}"), line
        assert "--- Thread MainThread (main) ---" in text and "--- Thread automicro-watchdog ---" in text, text[-3000:]
    assert "stall_cases.py" in rank1  # the stalled rank's own stack shows where it sleeps
    assert took < 90, took


@pytest.mark.multiproc
def test_by_default_a_settled_batch_that_stops_is_ended_after_what_batches_take(tmp_path, monkeypatch):
    """No limit set: a settled batch is bounded by the settled batches' median (the floors lowered for the test)."""
    (rank0, rank1), _, _ = _stalled("forward", tmp_path, report_s=None, end_s=None, floors=(0.5, 10.0, 2.0, 50.0))
    for rank, text in ((0, rank0), (1, rank1)):
        [report] = _lines(text, f"[automicro] rank {rank}: no progress for ")
        assert "a settled batch takes " in report and "stalled in training batch" in report and "(settled)" in report, report


@pytest.mark.multiproc
def test_a_long_legitimate_first_compile_is_not_ended(tmp_path):
    """The first batch's compile takes 8 s on rank 1 (the other rank waits): with the default limits a batch that
    compiles gets the generous bound, even with the settled floors far below 8 s."""
    [done, _] = run_multiprocess(cases.run, world_size=2, args=("compile", str(tmp_path)),
                                 kwargs=dict(report_s=None, end_s=None, seconds=8.0, floors=(0.5, 10.0, 2.0, 50.0)),
                                 timeout_s=120)
    assert done == {"finished": cases.BATCHES}
    assert "no progress" not in (tmp_path / "rank0.err").read_text() + (tmp_path / "rank1.err").read_text()


@pytest.mark.multiproc
def test_sigterm_ends_a_process_whose_main_thread_is_blocked_in_a_collective(tmp_path):
    """Rank 1 sleeps before its all-gather, rank 0 waits in it (in C: Composer's Python handler for SIGTERM cannot run
    there). SIGTERM to both: rank 1 ends at once through that handler; rank 0 within signal_exit_s, its stacks
    written, with the signal's exit code."""
    def kill_when_stalled():
        marker = tmp_path / "rank1.sleeping"
        deadline = time.monotonic() + 100
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # rank 0 is in the collective by now
        for rank in (0, 1):
            os.kill(int((tmp_path / f"rank{rank}.pid").read_text()), signal.SIGTERM)
        killed.append(time.monotonic())

    killed: list[float] = []
    sender = threading.Thread(target=kill_when_stalled, daemon=True)
    sender.start()
    with pytest.raises(MultiprocessFailure) as failed:
        run_multiprocess(cases.run, world_size=2, args=("collective", str(tmp_path)),
                         kwargs=dict(report_s=300.0, end_s=600.0, signal_exit_s=3.0), timeout_s=120)
    ended = time.monotonic()
    assert killed and ended - killed[0] < 3.0 + 15.0, ended - killed[0]
    assert failed.value.exitcodes.get(0) == 128 + signal.SIGTERM, (failed.value.exitcodes, failed.value.errors)
    rank0 = (tmp_path / "rank0.err").read_text()
    assert "[automicro] rank 0: SIGTERM received; the process ends within 3 s" in rank0, rank0[-2000:]
    [still] = _lines(rank0, "[automicro] rank 0: still running 3 s after SIGTERM: the main thread is in a collective")  # noqa: E501
    assert still.endswith(f"exit code {128 + signal.SIGTERM}") and "--- Thread MainThread (main) ---" in rank0, still


# ---- the limits, without processes -----------------------------------------------------------------


def test_a_settled_batch_is_bounded_by_the_median_and_anything_else_generously():
    dog = wd.Watchdog(0)
    assert dog.limits()[:2] == (wd.GENEROUS_REPORT_S, wd.GENEROUS_END_S)  # nothing measured yet
    for index in range(4):
        dog.batch(index, True, "settled")
        dog._batch_started -= 2.0  # each took 2 s
    assert dog.median() == pytest.approx(2.0, abs=0.01)
    report, end, why = dog.limits()
    assert report == pytest.approx(max(wd.SETTLED_REPORT_MIN_S, wd.SETTLED_REPORT_X * 2.0), abs=0.2)
    assert end == pytest.approx(max(wd.SETTLED_END_MIN_S, wd.SETTLED_END_X * 2.0), abs=1.0) and "a settled batch takes" in why
    dog.enter("an evaluation")
    assert dog.limits()[:2] == (wd.GENEROUS_REPORT_S, wd.GENEROUS_END_S)
    # A value the user sets applies to every batch, compiling ones included.
    user = wd.Watchdog(0, report_s=5.0, end_s=9.0)
    user.enter("a compile")
    assert user.limits() == (5.0, 9.0, "stall_report_s and stall_end_s")


def test_the_watchdog_reports_once_per_stall_then_ends_and_a_beat_resets_it():
    ended: list[int] = []
    dog = wd.Watchdog(3, report_s=0.3, end_s=0.9, poll_s=0.05, exit=ended.append, context=lambda: "batch 7, attempt 1")
    dog.arm()
    for _ in range(10):  # beats keep it quiet
        time.sleep(0.05)
        dog.beat()
    assert dog.reports == 0
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended == [wd.STALL_EXIT_CODE] and dog.reports == 1
    dog.close()


def test_where_the_main_thread_waits_is_read_from_its_stack():
    frames = [
        traceback.FrameSummary("/x/composer/trainer/trainer.py", 1, "fit"),
        traceback.FrameSummary("/x/automicro/composer/checkpoint_commit.py", 2, "_save"),
        traceback.FrameSummary("/x/torch/_dynamo/eval_frame.py", 3, "_fn"),  # a disabled call, not a compile
        traceback.FrameSummary("/x/torch/distributed/distributed_c10d.py", 4, "all_gather_into_tensor"),
    ]
    assert wd.where_waiting(frames) == ("in a collective (all_gather_into_tensor) in a checkpoint save, at "
                                        "/x/torch/distributed/distributed_c10d.py:4 in all_gather_into_tensor")
    assert wd.where_waiting(frames[:1]) == "at /x/composer/trainer/trainer.py:1 in fit"


def test_sigterm_to_a_process_whose_main_thread_is_blocked_in_c_ends_it_with_the_signals_code():
    """One process, no ranks: the main thread waits in C for a key nobody sets (a TCP store's wait, as a collective's
    holds the thread; Python's handler cannot run there); SIGTERM ends it within signal_exit_s, its stacks written."""
    script = textwrap.dedent("""
        import datetime
        import torch.distributed as dist
        from automicro.core.watchdog import SignalExit
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(hours=1))
        SignalExit.install(1.0, rank=0)
        print("blocked", flush=True)
        store.wait(["never"], datetime.timedelta(hours=1))
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "blocked"
    time.sleep(0.5)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM and time.monotonic() - sent < 10, (process.returncode, err)
    assert "SIGTERM received; the process ends within 1 s" in err and "still running 1 s after SIGTERM" in err, err
    assert "--- Thread MainThread (main) ---" in err and "the main thread is at <string>:8 in <module>" in err, err
