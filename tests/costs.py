"""What each test file costs, measured by the run that ran it (costs are data).

Every phase of every test (setup, call, teardown: a module-scoped launch is charged to the file whose
fixture starts it) adds its seconds to its file. With ``AUTOMICRO_COSTS_OUT=PATH`` in the environment the
run writes ``{"files": {file: seconds}, "launches": {file: {launch: seconds}}}`` to PATH (a launch: what
`tests/conftest.launch_of` names; "" the file's tests that launch nothing) (`.ci/run` gives each leg its own); the end of the run prints
the ten costliest files either way. `.ci/costs.py` turns the legs' files into the report against the
budget and, with ``update``, into `tests/costs.json`, the costs kept in the repo per leg.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

_seconds: dict[str, float] = defaultdict(float)
# {test id: the launch it belongs to ("": none)}: tests/conftest.py fills it at collection (`launch_of`).
LAUNCH_OF: dict[str, str] = {}
_launches: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))


def record(report: Any) -> None:
    """`pytest_runtest_logreport`: one phase of one test, charged to its file and, within it, to its launch."""
    seconds = float(getattr(report, "duration", 0.0) or 0.0)
    file = report.nodeid.split("::", 1)[0]
    _seconds[file] += seconds
    _launches[file][LAUNCH_OF.get(report.nodeid, "")] += seconds


def costliest(seconds: dict[str, float], count: int = 10) -> list[tuple[str, float]]:
    return sorted(seconds.items(), key=lambda item: (-item[1], item[0]))[:count]


def summary_lines() -> list[str]:
    """The ten costliest files of this run, and the file written where asked."""
    if not _seconds:
        return []
    out = os.environ.get("AUTOMICRO_COSTS_OUT")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as handle:
            json.dump({"files": {name: round(value, 1) for name, value in sorted(_seconds.items())},
                       "launches": {file: {launch: round(value, 1) for launch, value in sorted(groups.items())}
                                    for file, groups in sorted(_launches.items())}}, handle, indent=1)
    total = sum(_seconds.values())
    lines = [f"test costs: {total:.0f} s over {len(_seconds)} files" + (f" (written to {out})" if out else "")]
    lines += [f"  {value:7.1f} s  {name}" for name, value in costliest(_seconds)]
    return lines
