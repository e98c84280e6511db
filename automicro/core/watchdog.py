"""A run that stops making progress says where it is stuck, then ends; SIGTERM and SIGINT end it within seconds.

Why. A run can stop making progress with nothing said: a rank waits in a collective for a rank that never comes,
a compile worker's pipe never answers, a host-side wait never returns. NCCL's watchdog covers a collective only
(and only NCCL's), torchelastic's timers and Composer's ``dist_timeout`` know nothing of what a batch should cost,
and a scheduler's SIGTERM, handled by Composer's Python handler, never runs while the main thread is blocked in C:
the job sits until its grace period and is killed with nothing written.

`Watchdog` is a daemon thread per process (no device sync, nothing on the hot path but attribute writes).
The loop it watches calls `beat()` at every sign of progress (every Composer event; every `AutoStep` step)
and `batch(settled)` when a training batch starts: a *settled* batch (the size found, the sync hooks off,
no trial holding it) should take about the median of the settled batches so far; any other (the search, a
trial, a compile, an evaluation, a checkpoint, the first batches) gets a generous bound. With no beat for
longer than the first limit (``stall_report_s``) it writes, once per stall, on this rank: what automicro was
doing (the phase the loop named, the attempt, the site, where the main thread is: a collective, a consensus
round, a compile, a checkpoint save, an evaluation) and every thread's Python stack. Past the second limit
(``stall_end_s``) it ends the process with `STALL_EXIT_CODE` and a line that names the stall and its phase.
Every rank runs its own: a stalled rank and the ranks waiting on it all stop. A value the user sets applies to
every batch, compiling ones included; the defaults need no setting:

- settled: report after ``max(SETTLED_REPORT_MIN_S, SETTLED_REPORT_X * median)``, end after
  ``max(SETTLED_END_MIN_S, SETTLED_END_X * median)``;
- anything else: report after `GENEROUS_REPORT_S`, end after `GENEROUS_END_S` (a first compile of a large
  model takes minutes; it is not ended).

`SignalExit` makes SIGTERM and SIGINT end the process within ``signal_exit_s`` even when the main thread is
blocked in C: the C-level signal handler writes the signal's number to a pipe (`signal.set_wakeup_fd`) even
when the Python handler cannot run; a thread reading it gives the process ``signal_exit_s`` to exit by itself
(a signal while training normally goes through Composer's own handler and exits at once), then writes every
thread's stack and ends the process with the signal's exit code (128 + the signal). A checkpoint being
committed then is either committed or left as a SIGKILL would leave it, which the checkpoint fallback handles
(`automicro.composer.checkpoint_commit`).

Owns: the stall limits, the report, the end, the signal's grace. May not touch: torch, Composer, the ranks (it
reads the main thread's stack and the context the loop gives it; it writes stderr and ends this process only).
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

STALL_EXIT_CODE = 4
SETTLED_REPORT_MIN_S, SETTLED_REPORT_X = 60.0, 10.0
SETTLED_END_MIN_S, SETTLED_END_X = 300.0, 50.0
GENEROUS_REPORT_S = 600.0
GENEROUS_END_S = 3600.0
SETTLED_WINDOW = 20  # the settled batches whose median is what a settled batch should cost
DEFAULT_SIGNAL_EXIT_S = 30.0
IDLE_EXIT_S = 10.0  # a watchdog disarmed this long ends its thread (a loop between its steps, a closed trainer)
_LOCK = threading.Lock()

# Where the main thread waits, read from its stack, innermost first: (what, file marker).
_PLACES = (
    ("a consensus round", "automicro/core/consensus.py"),
    ("a consensus round", "automicro/core/hierarchical.py"),
    # dynamo's compiling frames (not eval_frame.py: every `torch._dynamo.disable`d call, FSDP2's own, passes there).
    ("a compile (torch.compile)", "torch/_inductor/"),
    ("a compile (torch.compile)", "torch/_dynamo/convert_frame.py"),
    ("a compile (torch.compile)", "torch/_dynamo/symbolic_convert.py"),
    ("a compile (torch.compile)", "torch/_dynamo/output_graph.py"),
    ("a compile (torch.compile)", "torch/_functorch/aot_autograd"),
    ("a collective", "torch/distributed/distributed_c10d.py"),
    ("a collective", "torch/distributed/_functional_collectives"),
    ("a collective", "torch/distributed/fsdp/"),  # FSDP2 waiting on its all-gather or reduce-scatter
    ("a checkpoint save", "automicro/composer/checkpoint_commit.py"),
    ("a checkpoint save", "composer/utils/checkpoint.py"),
    ("a checkpoint save", "composer/callbacks/checkpoint_saver.py"),
    ("a checkpoint save", "torch/distributed/checkpoint/"),
    ("an evaluation", "automicro/composer/eval_search.py"),
)


def where_waiting(frames: list[traceback.FrameSummary]) -> str:
    """Where the main thread is, from its stack (outermost first): the places named, innermost first, and the
    innermost frame ("in a collective (all_gather_into_tensor) in a checkpoint save, at file.py:12 in f")."""
    seen: list[str] = []
    kinds: set[str] = set()
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        what = next((w for w, marker in _PLACES if marker in path), None)
        if what is None and path.endswith("composer/trainer/trainer.py") and frame.name in ("_eval_loop", "eval"):
            what = "an evaluation"
        if what is not None and what not in kinds:
            kinds.add(what)
            seen.append(f"{what} ({frame.name})" if what == "a collective" else what)
    innermost = frames[-1] if frames else None
    at = f"at {innermost.filename}:{innermost.lineno} in {innermost.name}" if innermost is not None else "no frame"
    return ("in " + " in ".join(seen) + ", " if seen else "") + at


def thread_stacks() -> str:
    """Every thread's Python stack, named ("--- Thread MainThread (main) ---")."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():  # documented in `sys`, for debuggers and watchdogs
        label = names.get(ident, f"thread {ident}") + (" (main)" if ident == main else "")
        out.append(f"--- Thread {label} ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def main_thread_frames() -> list[traceback.FrameSummary]:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return list(traceback.extract_stack(frame)) if frame is not None else []


def _write(text: str) -> None:
    try:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr: nothing else to tell
        pass


class Watchdog:
    """One process's progress watchdog. `context()`: what automicro is doing, in words (the batch, attempt,
    split, site, the trial holding the batch); `rank` names the lines. `clock`: the seconds every limit and
    batch is measured in (`time.monotonic`; a test sets its own, so that no outcome depends on how long the
    machine took), read on every beat and poll; the poll itself sleeps `poll_s` of real time."""

    def __init__(
        self, rank: int, report_s: Optional[float] = None, end_s: Optional[float] = None,
        context: Callable[[], str] = lambda: "", poll_s: Optional[float] = None,
        exit: Callable[[int], Any] = os._exit, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank, self.report_s, self.end_s, self.context = rank, report_s, end_s, context
        self.poll_s = poll_s if poll_s is not None else max(0.05, min(1.0, (report_s or 60.0) / 4))
        self._exit = exit
        self.clock = clock
        self.phase = "starting"  # what the loop said it is doing (set by `batch`, `enter`)
        self.settled = False  # the batch in progress is a settled one (the tight bound)
        self._last = clock()
        self._batch_started: Optional[float] = None
        self._durations: deque[float] = deque(maxlen=SETTLED_WINDOW)
        self._reported_at: Optional[float] = None  # the beat the report was written for
        self.armed = False
        self.reports = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- the loop's calls (attribute writes only) ----------------------------------------------

    def arm(self) -> None:
        """Watch from now on (the thread starts where none runs)."""
        self._last = self.clock()
        self.armed = True
        with _LOCK:
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._watch, name="automicro-watchdog", daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        """Stop watching (the thread ends once disarmed for `IDLE_EXIT_S`; `arm` starts it again)."""
        self._end_batch()
        self.armed = False

    def beat(self) -> None:
        self._last = self.clock()

    def batch(self, index: int, settled: bool, phase: str) -> None:
        """A training batch starts: `settled` ones should take the settled median."""
        self._end_batch()
        now = self.clock()
        self._batch_started, self.settled, self.phase, self._last = now, settled, phase, now

    def enter(self, phase: str, settled: bool = False) -> None:
        """Something else holds the loop now (the batch's end: callbacks, a checkpoint save; an evaluation): its bound
        is generous."""
        self._end_batch()
        self.phase, self.settled, self._last = phase, settled, self.clock()

    def _end_batch(self) -> None:
        """The training batch in progress, if any, ended: a settled one's seconds count in the median."""
        if self._batch_started is not None and self.settled:
            self._durations.append(self.clock() - self._batch_started)
        self._batch_started = None

    # ---- the limits ------------------------------------------------------------------------------

    def median(self) -> Optional[float]:
        return statistics.median(self._durations) if self._durations else None

    def limits(self) -> tuple[float, float, str]:
        """(report after, end after, why) for the wait in progress."""
        median = self.median()
        if self.settled and median is not None:
            report = max(SETTLED_REPORT_MIN_S, SETTLED_REPORT_X * median)
            end = max(SETTLED_END_MIN_S, SETTLED_END_X * median)
            why = f"a settled batch takes {median:.3f} s"
        else:
            report, end, why = GENEROUS_REPORT_S, GENEROUS_END_S, "a batch that searches, compiles or runs a trial, or an evaluation"
        if self.report_s is not None:
            report, why = self.report_s, "stall_report_s"
        if self.end_s is not None:
            end, why = self.end_s, ("stall_report_s and stall_end_s" if self.report_s is not None else "stall_end_s")
        return report, max(end, report), why

    # ---- the thread ------------------------------------------------------------------------------

    def _watch(self) -> None:
        idle_since: Optional[float] = None
        while not self._stop.wait(self.poll_s):
            if not self.armed:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > IDLE_EXIT_S:
                    with _LOCK:  # `arm` starts a new thread once this one is gone, never misses it going
                        if not self.armed:
                            self._thread = None
                            return
                continue
            idle_since = None
            last = self._last
            waited = self.clock() - last
            report, end, why = self.limits()
            if waited >= report and self._reported_at != last:
                self._reported_at = last
                self.reports += 1
                _write(self._stalled_line(waited, report, why) + "\n" + thread_stacks())
            if waited >= end and self.armed:
                _write(f"[automicro] rank {self.rank}: ending the run: no progress for {waited:.1f} s (the limit "
                       f"{end:.1f} s: {why}) in {self.phase}; the main thread is {where_waiting(main_thread_frames())}; exit code "
                       f"{STALL_EXIT_CODE}")
                self._exit(STALL_EXIT_CODE)
                return

    def _stalled_line(self, waited: float, limit: float, why: str) -> str:
        context = self.context()
        return (f"[automicro] rank {self.rank}: no progress for {waited:.1f} s (the limit {limit:.1f} s: {why}); "
                f"stalled in {self.phase}{'; ' + context if context else ''}; the main thread is "
                f"{where_waiting(main_thread_frames())}; every thread's stack follows "
                "(AutoMicrobatching(stall_report_s=..., stall_end_s=...) set the limits)")

    def close(self) -> None:
        self.armed = False
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        with _LOCK:
            self._thread = None


class SignalExit:
    """SIGTERM and SIGINT end the process within `timeout_s` even when its main thread is blocked in C. One per
    process (`install`): the most recent caller's `timeout_s` applies; it stays for the life of the process (a
    SIGTERM asks the process to end, whatever it does then)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, timeout_s: float, rank: int, exit: Callable[[int], Any] = os._exit) -> None:
        self.timeout_s, self.rank, self._exit = timeout_s, rank, exit
        self._previous_fd = -1
        self._pid = os.getpid()
        self.received: Optional[int] = None

    @classmethod
    def install(cls, timeout_s: float = DEFAULT_SIGNAL_EXIT_S, rank: int = 0) -> tuple[Optional["SignalExit"], str]:
        """The process's one `SignalExit` with `timeout_s` (made now where this process has none: a forked child
        makes its own), and "" or why it is not installed (signals are set from the main thread only)."""
        global _SIGNAL_EXIT
        with _LOCK:
            current = _SIGNAL_EXIT
            if current is not None and current._pid == os.getpid():
                current.timeout_s, current.rank = timeout_s, rank
                return current, ""
            if threading.current_thread() is not threading.main_thread():
                return None, "not installed: signals are set from the main thread only"
            made = cls(timeout_s, rank)
            why = made._install()
            if why:
                return None, why
            _SIGNAL_EXIT = made
            return made, ""

    def _install(self) -> str:
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError) as error:
            os.close(read)
            os.close(write)
            return f"not installed: {error}"
        for sig in self.SIGNALS:
            # The pipe hears a signal only where a Python handler is set (the default would end the process at
            # once with nothing written; an ignored signal stays ignored).
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _default_handler)
        threading.Thread(target=self._listen, args=(read,), name="automicro-signal-exit", daemon=True).start()
        return ""

    def _listen(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return
            if self._previous_fd >= 0:  # whoever listened before (asyncio, another library) still hears it
                try:
                    os.write(self._previous_fd, data)
                except OSError:
                    pass
            signals = [b for b in data if b in self.SIGNALS]
            if signals and self.received is None:
                self.received = signals[0]
                threading.Thread(target=self._grace, args=(signals[0],), name="automicro-signal-grace", daemon=True).start()

    def _grace(self, signum: int) -> None:
        name = signal.Signals(signum).name
        _write(f"[automicro] rank {self.rank}: {name} received; the process ends within {self.timeout_s:g} s "
               "(AutoMicrobatching(signal_exit_s=...))")
        time.sleep(self.timeout_s)
        _write(f"[automicro] rank {self.rank}: still running {self.timeout_s:g} s after {name}: the main thread is "
               f"{where_waiting(main_thread_frames())}; every thread's stack follows; ending the process with exit code "
               f"{128 + signum}\n" + thread_stacks())
        self._exit(128 + signum)


def _default_handler(signum: int, frame: Any) -> None:
    """Where nobody had a handler: what the default does, from Python (`SignalExit`'s thread ends a main thread that
    cannot run this)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


_SIGNAL_EXIT: Optional[SignalExit] = None


__all__ = ["DEFAULT_SIGNAL_EXIT_S", "STALL_EXIT_CODE", "SignalExit", "Watchdog", "thread_stacks", "where_waiting"]
