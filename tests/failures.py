"""A failure says itself last: each failing test with the line its assertion failed on, and how to repeat it.

Every failed phase of a test (setup, call, teardown) is kept with the test's id, the place in the test's own file
where it failed (the last traceback entry under ``tests/``: the assertion, or the call into the code that raised)
and the first line of the error. The end of the run prints them after everything else, with the seed and the
command that repeats them; with ``AUTOMICRO_FAILURES_OUT=PATH`` they are also appended to PATH as JSON lines
(`.ci/run` gives each leg one and prints them all as its last lines: `.ci/failures.py`).
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any, Optional

MESSAGE_CHARS = 300  # of the error's first line: enough for an assertion's operands, short enough to read
_failed: list[dict[str, Any]] = []


def _where(report: Any) -> tuple[str, str]:
    """(file:line in the tests, the error's first line) of a failed report; ("", text) where pytest kept no
    traceback (a timeout's or a crashed worker's plain text)."""
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    message = (getattr(crash, "message", None) or str(longrepr)).strip()
    first = message.splitlines()[0] if message else ""
    place = ""
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", None) or []
    for entry in entries:
        loc = getattr(entry, "reprfileloc", None)
        if loc is not None and os.path.normpath(str(loc.path)).split(os.sep)[0] == "tests":
            place = f"{loc.path}:{loc.lineno}"
    if not place and crash is not None:
        place = f"{os.path.relpath(str(crash.path))}:{crash.lineno}"
    return place, first[:MESSAGE_CHARS] + ("..." if len(first) > MESSAGE_CHARS else "")


def record(report: Any) -> None:
    """`pytest_runtest_logreport`: a failed phase kept for the run's last lines (and AUTOMICRO_FAILURES_OUT)."""
    if not report.failed:
        return
    from tests import matrix

    place, message = _where(report)
    row = {"test": report.nodeid, "when": report.when, "where": place, "error": message, "seed": matrix.seed()}
    _failed.append(row)
    out = os.environ.get("AUTOMICRO_FAILURES_OUT")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


def lines(rows: list[dict[str, Any]], repeat: Optional[str] = None) -> list[str]:
    """The failures as the last lines of a run: one line each, then the command that repeats them."""
    if not rows:
        return []
    out = [f"FAILED {row['test']} ({row['when']}) at {row['where'] or '?'}: {row['error']}" for row in rows]
    seeds = sorted({int(row["seed"]) for row in rows})
    out.append(f"failed: {len(rows)} test(s); seed {', '.join(map(str, seeds))}")
    if repeat:
        out.append(f"repeat: {repeat}")
    return out


def repeat_command(config: Any, rows: list[dict[str, Any]]) -> str:
    """The command that repeats these failures: this interpreter, the run's seed (which draws the fault matrices'
    cells, so the ids exist) and `--full` or `--every` where the run had them; the tests named by id, so no share
    option (a draw over the named tests alone could leave one out)."""
    import sys

    from tests import matrix

    python = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    flags = [flag for flag in ("--full", "--every") if config.getoption(flag)]
    tests = sorted({row["test"] for row in rows})
    return " ".join([f"AUTOMICRO_TEST_SEED={matrix.seed()}", python, "-m", "pytest", *flags,
                     *(shlex.quote(test) for test in tests)])


def summary_lines(config: Any) -> list[str]:
    """The run's last lines (pytest_terminal_summary); the repeat command also goes to AUTOMICRO_FAILURES_OUT."""
    if not _failed:
        return []
    repeat = repeat_command(config, _failed)
    out = os.environ.get("AUTOMICRO_FAILURES_OUT")
    if out:
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"repeat": repeat}) + "\n")
    return lines(_failed, repeat)


def read(path: str) -> tuple[list[dict[str, Any]], Optional[str]]:
    """What a run wrote to AUTOMICRO_FAILURES_OUT: its failures and its repeat command."""
    rows, repeat = [], None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for text in handle:
                if text.strip():
                    row = json.loads(text)
                    if "repeat" in row:
                        repeat = row["repeat"]
                    else:
                        rows.append(row)
    return rows, repeat
