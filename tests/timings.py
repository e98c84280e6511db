"""The trials' timing seam, recorded instead of measured: a trial's verdict in a test never depends on how long the
machine took (a loaded 2-core CI machine makes one arm's batches 10 times slower at random, which flipped verdicts
that scaled the measured seconds).

`arm_seconds(slow)` is what a trial's ``timing`` seam (`ShardingChoice`, `PackingChoice`, `StaticShapes`,
`ScopeChoice`: ``timing(arm, measured_seconds) -> seconds``) returns for every batch: `seconds` times the arm's
factor in `slow` (1 where not named), whatever was measured. `tests/layout_cases.py` does the same for the layout
trials (`seconds_where`, `seconds_by_size`)."""

from __future__ import annotations

from collections.abc import Callable


def arm_seconds(slow: dict[str, float], seconds: float = 1.0) -> Callable[[str, float], float]:
    """Each batch of arm A takes `seconds` x `slow.get(A, 1.0)`, whatever the clock read."""
    return lambda arm, measured: seconds * slow.get(arm, 1.0)
