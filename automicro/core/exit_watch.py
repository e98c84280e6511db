"""After a run-ending error the process exits within a bound, or says what holds it and ends.

When automicro ends a run with an error (a non-OOM error in an attempt on any rank, no microbatch
size left, a job lost), the error leaves the training loop and the interpreter exits. What runs at
exit is not automicro's: non-daemon threads are joined, then atexit handlers run, loggers flush.
Some of it can wait for a long time or for ever: torch inductor's compile-worker shutdown waits up
to 300 s for its workers after a cold start (pytorch/pytorch#162199), and a compile worker that
died leaves its reader thread waiting for ever (pytorch/pytorch#189290, fixed after torch 2.11).
A process that does not exit is a job its launcher never ends: a hang after the error was printed.

`arm(error, timeout_s)` marks the error and starts, once per process, a daemon thread that waits
for the main thread to end. Where it ended with a marked error the interpreter did not catch (it
printed it: `sys.last_value`), the thread gives the exit `timeout_s`; if the process is still
alive then, it prints one line and every thread's stack, and ends the process with exit code 1.
A program that catches the error and goes on (a sweep, a notebook, the tests), or that exits
cleanly after catching it, is left alone.

A run that finished is bounded the same way where the program that owns the process says so
(`arm_finished`: `automicro.train`, `automicro.foundry` and `automicro.bound_exit()` at the end of a user's
script): once the main thread returned, the exit gets `timeout_s`; still alive then, the line names what
holds it, every thread's stack follows, and the process ends with exit code 0 (the run itself finished).
Measured on one H200 (torch 2.11, OLMo-2 1B compiled, a cold inductor cache): the run printed its last line
and the process stayed up past its launcher's limit, inductor's compile-worker shutdown waiting at exit
(pytorch/pytorch#162199); with a warm cache it exited at once.

Owns: the mark, the watcher thread, the line. May not touch: torch, Composer, the ranks.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Optional

MARK = "_automicro_ends_run"
DEFAULT_TIMEOUT_S = 30.0

_lock = threading.Lock()
_watcher_pid: Optional[int] = None  # the process whose watcher runs (a forked child starts its own)
_timeout_s = DEFAULT_TIMEOUT_S
_rank: Optional[int] = None
_finished_pid: Optional[int] = None  # the process whose run finished, its exit bounded (`arm_finished`)


def arm(error: BaseException, timeout_s: float = DEFAULT_TIMEOUT_S, rank: Optional[int] = None) -> BaseException:
    """Mark `error` as ending the run and make sure the watcher runs; returns `error` (to raise)."""
    setattr(error, MARK, True)
    _start(timeout_s, rank)
    return error


def arm_finished(timeout_s: float = DEFAULT_TIMEOUT_S, rank: Optional[int] = None) -> None:
    """This process's run finished and its program is about to return: once the main thread returned, its exit
    gets `timeout_s`, then what holds it is written and the process ends with exit code 0. Call it only from the
    program that owns the process, after its last line (a caller that goes on after it would be ended once its
    main thread ends and the exit takes longer than `timeout_s`)."""
    global _finished_pid
    _finished_pid = os.getpid()
    _start(timeout_s, rank)


def _start(timeout_s: float, rank: Optional[int]) -> None:
    global _watcher_pid, _timeout_s, _rank
    with _lock:
        _timeout_s, _rank = float(timeout_s), rank
        if _watcher_pid != os.getpid():
            _watcher_pid = os.getpid()
            threading.Thread(target=_watch, name="automicro-exit-watch", daemon=True).start()


def ends_run(error: Optional[BaseException]) -> bool:
    """Whether `error`, or an error it was raised from or during, was marked by `arm`."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        each = stack.pop()
        if each is None or id(each) in seen:
            continue
        seen.add(id(each))
        if getattr(each, MARK, False):
            return True
        stack.extend((each.__cause__, each.__context__))
    return False


def _uncaught() -> Optional[BaseException]:
    """The error the interpreter printed as uncaught, if any (set before threads are joined)."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _watch() -> None:
    threading.main_thread().join()  # returns once the interpreter begins to shut down
    error = _uncaught()
    finished = not ends_run(error) and error is None and _finished_pid == os.getpid()
    if not ends_run(error) and not finished:
        return
    time.sleep(_timeout_s)
    who = "" if _rank is None else f"rank {_rank}: "
    how = (f"the run ended with {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}" if not finished
           else "its run finished")
    sys.stderr.write(
        f"[automicro] {who}the process is still exiting {_timeout_s:g} s after {how}; what holds it (every thread's "
        f"stack) follows; ending the process with exit code {0 if finished else 1} (AutoMicrobatching(exit_timeout_s=...) "
        "sets the wait)\n"
    )
    try:
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a stderr without a file descriptor: the line was said
        pass
    os._exit(0 if finished else 1)


__all__ = ["arm", "arm_finished", "ends_run", "DEFAULT_TIMEOUT_S"]
