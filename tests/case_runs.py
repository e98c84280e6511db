"""What the multi-rank case modules share: run one case, keep what broke as data for the test to print."""

from __future__ import annotations

import traceback
from typing import Any, Callable


def run_case(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """`out[name]` = `fn()`, or {"crash": its traceback} (the test says which case broke; the other cases still run)."""
    try:
        out[name] = fn()
    except Exception:  # noqa: BLE001 - report which case broke
        out[name] = {"crash": traceback.format_exc()}
