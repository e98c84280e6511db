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


def arm(error: BaseException, timeout_s: float = DEFAULT_TIMEOUT_S, rank: Optional[int] = None) -> BaseException:
    """Mark `error` as ending the run and make sure the watcher runs; returns `error` (to raise)."""
    global _watcher_pid, _timeout_s, _rank
    setattr(error, MARK, True)
    with _lock:
        _timeout_s, _rank = float(timeout_s), rank
        if _watcher_pid != os.getpid():
            _watcher_pid = os.getpid()
            threading.Thread(target=_watch, name="automicro-exit-watch", daemon=True).start()
    return error


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
    if not ends_run(error):
        return
    time.sleep(_timeout_s)
    who = "" if _rank is None else f"rank {_rank}: "
    sys.stderr.write(
        f"[automicro] {who}the process is still exiting {_timeout_s:g} s after the run ended with "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; what holds it (every thread's "
        "stack) follows; ending the process with exit code 1 (AutoMicrobatching(exit_timeout_s=...) sets the wait)\n"
    )
    try:
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a stderr without a file descriptor: the line was said
        pass
    os._exit(1)


__all__ = ["arm", "ends_run", "DEFAULT_TIMEOUT_S"]
