"""A run that stops making progress says where it is stuck and ends; SIGTERM ends it within seconds
(`automicro.core.watchdog`). On 2 CPU ranks (gloo, tests/stall_cases.py): a stall injected on rank 1 in a forward,
before a collective, inside a consensus round, inside a compile, inside a checkpoint save and inside an
evaluation is reported on every rank (the phase, what the main thread waits in, every thread's stack) and ends
every rank with the stall's exit code; a SIGTERM while the main thread is blocked in a collective ends the process
within ``signal_exit_s``; a long but legitimate first compile is not ended. The limits themselves, without
processes, below.

No outcome depends on how long something took: the ranks' watchdogs read a virtual clock (a second a batch) that the
test moves past each limit once both ranks are where the stall leaves them (`stall_cases.Arrival` reads their stacks),
rank 0 first, so the order in which the ranks end is the test's. The waits below are bounds on a hang."""

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
HANG_S = 100.0  # a bound on a wait that only a hang reaches (each is a second or two on CI's loaded 2 cores)
REPORT_S, END_S = 2.0, 6.0  # the limits set, in the virtual clock's seconds (a batch is one)


def _wait_for(what, done, deadline_s=HANG_S):
    deadline = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {deadline_s:.0f} s: a hang"
        time.sleep(0.05)


def _text(folder, rank, suffix="err"):
    path = folder / f"rank{rank}.{suffix}"
    return path.read_text() if path.exists() else ""


def _gone(folder, rank):
    """The rank's process has ended (its pid no longer runs, or only as a zombie its parent has not reaped yet)."""
    pid = _text(folder, rank, "pid").strip()
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _drive(folder, report_s, end_s, errors):
    """Once both ranks arrived, moves rank 0's clock past its report limit, then rank 1's, then rank 0's past its
    end and, once rank 0 ended, rank 1's: each rank reports, then ends, in that order."""
    try:
        for rank in (0, 1):
            _wait_for(f"rank {rank} where the stall leaves it", lambda r=rank: (folder / f"rank{r}.arrived").exists())
        for rank in (0, 1):
            cases.jump(str(folder), rank, report_s + 1.0)
            _wait_for(f"report on rank {rank}", lambda r=rank: f"[automicro] rank {r}: no progress for " in _text(folder, r))
        for rank in (0, 1):
            cases.jump(str(folder), rank, end_s + 1.0)
            _wait_for(f"end of rank {rank}", lambda r=rank: _gone(folder, r))
    except BaseException as error:  # noqa: BLE001 - said by the test
        errors.append(error)


def _stalled(where, tmp_path, places, report_s=REPORT_S, end_s=END_S, limits=(REPORT_S, END_S), **kwargs):
    """Runs the case, the test driving the ranks' clocks past `limits` (`_drive`): every rank must be ended by its
    watchdog. `report_s`, `end_s`: the settings (None: the defaults). Returns each rank's stderr."""
    errors: list[BaseException] = []
    driver = threading.Thread(target=_drive, args=(tmp_path, *limits, errors), daemon=True)
    driver.start()
    with pytest.raises(MultiprocessFailure) as failed:
        run_multiprocess(cases.run, world_size=2, args=(where, str(tmp_path)),
                         kwargs=dict(report_s=report_s, end_s=end_s, places=places, **kwargs), timeout_s=4 * HANG_S,
                         failure_grace_s=HANG_S)
    driver.join(HANG_S)
    assert not errors, (errors, failed.value.errors)
    codes = failed.value.exitcodes
    assert codes == {0: wd.STALL_EXIT_CODE, 1: wd.STALL_EXIT_CODE}, (codes, failed.value.errors)
    return [_text(tmp_path, rank) for rank in (0, 1)]


def _lines(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


@pytest.mark.multiproc
@pytest.mark.parametrize("where, rank0_in, rank1_in", [
    ("collective", ["a collective"], ["a collective"]),  # rank 1 stops before its all-gather, rank 0 waits in it
    ("consensus", ["a consensus round"], ["stall_cases.py"]),
    ("compile", ["a consensus round"], ["a compile (torch.compile)"]),
    ("checkpoint", ["a checkpoint save"], ["a checkpoint save"]),
    ("evaluation", ["a collective", "an evaluation"], ["an evaluation"]),
])
def test_a_stall_is_named_on_every_rank_with_its_stacks_and_ends_the_run(where, rank0_in, rank1_in, tmp_path):
    rank0, rank1 = _stalled(where, tmp_path, {0: rank0_in, 1: rank1_in})
    for rank, text, places in ((0, rank0, rank0_in), (1, rank1, rank1_in)):
        [report] = _lines(text, f"[automicro] rank {rank}: no progress for ")
        [end] = _lines(text, f"[automicro] rank {rank}: ending the run: no progress for ")
        assert f"(the limit {REPORT_S:.1f} s: stall_report_s and stall_end_s)" in report, report
        assert f"(the limit {END_S:.1f} s: stall_report_s and stall_end_s)" in end, end
        for line in (report, end):
            waits = line.split("the main thread is ", 1)[1]
            assert all(place in waits for place in places), (places, line)
        assert end.endswith(f"exit code {wd.STALL_EXIT_CODE}"), end
        assert "--- Thread MainThread (main) ---" in text and "--- Thread automicro-watchdog ---" in text, text[-3000:]
    assert "stall_cases.py" in rank1  # the stalled rank's own stack shows where it sleeps


@pytest.mark.multiproc
def test_by_default_a_settled_batch_that_stops_is_ended_after_what_batches_take(tmp_path):
    """No limit set: a settled batch is bounded by the settled batches' median (each takes one second of the virtual
    clock: the report after 10 x 1 s, the end after 50 x 1 s, with the floors lowered for the test)."""
    rank0, rank1 = _stalled("forward", tmp_path, {0: ["a collective"], 1: ["stall_cases.py"]}, report_s=None, end_s=None,
                            limits=(10.0, 50.0), floors=(0.5, 10.0, 2.0, 50.0))
    for rank, text in ((0, rank0), (1, rank1)):
        [report] = _lines(text, f"[automicro] rank {rank}: no progress for ")
        assert "(the limit 10.0 s: a settled batch takes 1.000 s)" in report, report
        assert "stalled in training batch" in report and "(settled)" in report, report
        [end] = _lines(text, f"[automicro] rank {rank}: ending the run: no progress for ")
        assert "(the limit 50.0 s: a settled batch takes 1.000 s)" in end, end


@pytest.mark.multiproc
def test_a_long_legitimate_first_compile_is_not_ended(tmp_path):
    """The first batch's compile takes 8 s on rank 1 (the other rank waits): with the default limits a batch that
    compiles gets the generous bound (600 s: 75 times the compile), even with the settled floors far below 8 s.
    The real clock here: the compile's seconds are what the bound must allow."""
    [done, _] = run_multiprocess(cases.run, world_size=2, args=("compile", str(tmp_path)),
                                 kwargs=dict(report_s=None, end_s=None, seconds=8.0, floors=(0.5, 10.0, 2.0, 50.0),
                                             virtual=False),
                                 timeout_s=4 * HANG_S)
    assert done == {"finished": cases.BATCHES}
    assert "no progress" not in _text(tmp_path, 0) + _text(tmp_path, 1)


@pytest.mark.multiproc
def test_sigterm_ends_a_process_whose_main_thread_is_blocked_in_a_collective(tmp_path):
    """Rank 1 stops before its all-gather, rank 0 waits in it (in C: Composer's Python handler for SIGTERM cannot run
    there). SIGTERM to rank 0 once it waits there: it ends within signal_exit_s, its stacks written, with the signal's
    exit code; then to rank 1, which ends at once through that handler. The limits (report 300, end 600 of the
    virtual clock's seconds) never pass: the test moves no clock."""
    def kill_when_waiting():
        try:
            for rank in (0, 1):
                _wait_for(f"rank {rank} where the stall leaves it", lambda r=rank: (tmp_path / f"rank{r}.arrived").exists())
            killed.append(time.monotonic())
            os.kill(int(_text(tmp_path, 0, "pid")), signal.SIGTERM)
            _wait_for("rank 0's end", lambda: _gone(tmp_path, 0))
            ended.append(time.monotonic())
            os.kill(int(_text(tmp_path, 1, "pid")), signal.SIGTERM)
        except BaseException as error:  # noqa: BLE001 - said by the test
            errors.append(error)

    killed: list[float] = []
    ended: list[float] = []
    errors: list[BaseException] = []
    sender = threading.Thread(target=kill_when_waiting, daemon=True)
    sender.start()
    with pytest.raises(MultiprocessFailure) as failed:
        run_multiprocess(cases.run, world_size=2, args=("collective", str(tmp_path)),
                         kwargs=dict(report_s=300.0, end_s=600.0, signal_exit_s=3.0,
                                     places={0: ["a collective"], 1: ["a collective"]}), timeout_s=4 * HANG_S,
                         failure_grace_s=HANG_S)
    sender.join(HANG_S)
    assert not errors, (errors, failed.value.errors)
    # The grace (3 s) and the end: 30 s is ten times what it took on CI's loaded 2 cores, and far below what a rank
    # blocked for good would take (the test's hang bound).
    assert killed and ended and ended[0] - killed[0] < 30.0, (killed, ended)
    assert failed.value.exitcodes.get(0) == 128 + signal.SIGTERM, (failed.value.exitcodes, failed.value.errors)
    rank0 = _text(tmp_path, 0)
    assert "[automicro] rank 0: SIGTERM received; the process ends within 3 s" in rank0, rank0[-2000:]
    [still] = _lines(rank0, "[automicro] rank 0: still running 3 s after SIGTERM: the main thread is in a collective")  # noqa: E501
    assert still.endswith(f"exit code {128 + signal.SIGTERM}") and "--- Thread MainThread (main) ---" in rank0, still
    assert "no progress" not in rank0 + _text(tmp_path, 1)


# ---- the limits, without processes -----------------------------------------------------------------


def test_a_settled_batch_is_bounded_by_the_median_and_anything_else_generously():
    now = [100.0]
    dog = wd.Watchdog(0, clock=lambda: now[0])
    assert dog.limits()[:2] == (wd.GENEROUS_REPORT_S, wd.GENEROUS_END_S)  # nothing measured yet
    for index in range(4):
        dog.batch(index, True, "settled")
        now[0] += 2.0  # each takes 2 s
    dog.enter("between batches")
    assert dog.median() == 2.0
    dog.batch(4, True, "settled")
    report, end, why = dog.limits()
    assert (report, end) == (max(wd.SETTLED_REPORT_MIN_S, wd.SETTLED_REPORT_X * 2.0), max(wd.SETTLED_END_MIN_S, wd.SETTLED_END_X * 2.0))
    assert why == "a settled batch takes 2.000 s"
    dog.enter("an evaluation")
    assert dog.limits()[:2] == (wd.GENEROUS_REPORT_S, wd.GENEROUS_END_S)
    # A value the user sets applies to every batch, compiling ones included.
    user = wd.Watchdog(0, report_s=5.0, end_s=9.0)
    user.enter("a compile")
    assert user.limits() == (5.0, 9.0, "stall_report_s and stall_end_s")


def test_the_watchdog_reports_once_per_stall_then_ends_and_a_beat_resets_it():
    """The clock is the test's: the watchdog's thread polls every 10 ms of real time, but what it compares is what the
    test set, so how the machine schedules the thread changes when a line comes, never which."""
    ended: list[int] = []
    now = [0.0]
    dog = wd.Watchdog(3, report_s=0.3, end_s=0.9, poll_s=0.01, exit=ended.append, context=lambda: "batch 7, attempt 1",
                      clock=lambda: now[0])
    dog.arm()
    for _ in range(10):  # beats 0.25 s apart keep it quiet, however long the polls between them
        now[0] += 0.25
        time.sleep(0.02)
        assert dog.reports == 0
        dog.beat()
    now[0] += 0.5  # past the report, not the end: one report, however many polls
    _wait_for("the report", lambda: dog.reports == 1, 60)
    time.sleep(0.05)
    assert dog.reports == 1 and not ended
    dog.beat()  # progress, then a new stall past the end: its own report, then the end
    now[0] += 1.0
    _wait_for("the end", lambda: ended, 60)
    assert ended == [wd.STALL_EXIT_CODE] and dog.reports == 2
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
    holds the thread; Python's handler cannot run there); SIGTERM ends it within signal_exit_s, its stacks written.
    The signal goes once the main thread sleeps in that wait (a thread of the script reads the kernel's state of it),
    not after a fixed pause."""
    script = textwrap.dedent("""
        import datetime, sys, threading, time
        import torch.distributed as dist
        from automicro.core.watchdog import SignalExit
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(hours=1))
        SignalExit.install(1.0, rank=0)
        main = threading.main_thread()
        def say_when_blocked():
            while True:
                frame = sys._current_frames().get(main.ident)
                with open(f"/proc/self/task/{main.native_id}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
                if frame is not None and frame.f_lineno == 18 and state == "S":
                    print("blocked", flush=True)
                    return
                time.sleep(0.01)
        threading.Thread(target=say_when_blocked, daemon=True).start()
        store.wait(["never"], datetime.timedelta(hours=1))
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "blocked"
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=HANG_S)
    # 1 s of grace and the end: 30 s is ten times what it took on CI's loaded 2 cores; a process the signal did not end
    # would run until the hang bound.
    assert process.returncode == 128 + signal.SIGTERM and time.monotonic() - sent < 30, (process.returncode, err)
    assert "SIGTERM received; the process ends within 1 s" in err and "still running 1 s after SIGTERM" in err, err
    assert "--- Thread MainThread (main) ---" in err and "the main thread is at <string>:18 in <module>" in err, err
