"""Runs `scripts/train.py`'s `main` over several command lines in one process (one import of torch
and Composer instead of one per case): tests/test_user_errors.py's sweep of bad top-level values.

    python tests/config_error_run.py '[["configs/tiny-cpu.yaml", "seed=-1"], ...]'

Prints one JSON line after the marker: each case's return code and its stdout and stderr together
(an exception that escapes `main` is a traceback there, with return code 1)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback

MARKER = "@@config-error-run@@ "


def _run(main, argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:  # the sweep asserts there is none: say which
            traceback.print_exc()
            code = 1
    return {"returncode": code, "output": out.getvalue()}


if __name__ == "__main__":
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "scripts"))
    sys.path.insert(0, repo)
    from train import main  # scripts/train.py

    results = [_run(main, argv) for argv in json.loads(sys.argv[1])]
    print(MARKER + json.dumps(results), flush=True)
