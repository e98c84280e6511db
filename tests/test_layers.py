"""The house's floors (CONTRIBUTING.md "Layers"): the batch step every loop shares
(`automicro.batch`), and what it stands on (`core`, `engine`, `data`) and `AutoStep` itself,
import no training framework; `AutoStep` trains on two ranks with Composer hidden."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "automicro"
FRAMEWORKS = ("composer", "transformers", "lightning", "pytorch_lightning", "accelerate", "llmfoundry", "torchtitan")
# The loop-neutral floors, bottom up, and what each may not import from automicro (what stands above it).
ABOVE_NEUTRAL = ("automicro.composer", "automicro.hf", "automicro.lightning", "automicro.torchtitan", "automicro.foundry", "automicro.config",
                 "automicro.testing", "automicro.train", "automicro.models")
FLOORS = {
    "core": ABOVE_NEUTRAL + ("automicro.engine", "automicro.batch", "automicro.data", "automicro.step"),
    "engine": ABOVE_NEUTRAL + ("automicro.batch", "automicro.data", "automicro.step"),
    "data": ABOVE_NEUTRAL + ("automicro.batch", "automicro.step"),
    "batch": ABOVE_NEUTRAL + ("automicro.step",),
    "step.py": ABOVE_NEUTRAL,
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, at the top or inside a function (relative imports resolved)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations(floor: str, forbidden: tuple[str, ...]) -> list[str]:
    root = PACKAGE / floor
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    bad = []
    for path in files:
        for line, name in _imports(path):
            if name.split(".")[0] in FRAMEWORKS or any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_the_loop_neutral_floors_import_no_framework_nor_anything_above_them(floor):
    files = [PACKAGE / floor] if floor.endswith(".py") else list((PACKAGE / floor).rglob("*.py"))
    assert files and all(f.exists() for f in files)
    assert _violations(floor, FLOORS[floor]) == []


def test_the_floor_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    """The check itself: a framework import buried in a function of a batch-step module is caught."""
    fake = tmp_path / "automicro" / "batch"
    fake.mkdir(parents=True)
    (fake / "room.py").write_text("def f():\n    from composer.utils import dist\n    import automicro.composer.callback\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "automicro")
    assert _violations("batch", FLOORS["batch"]) == [
        "automicro/batch/room.py:2 imports composer.utils", "automicro/batch/room.py:2 imports composer.utils.dist",
        "automicro/batch/room.py:3 imports automicro.composer.callback",
    ]


@pytest.mark.multiproc
def test_autostep_trains_on_two_ranks_with_composer_hidden_from_the_import_system():
    """Every framework hidden in a fresh interpreter and in its ranks; rank 1 runs out
    of memory above 3 samples, rank 0 never: both settle on 3 and train as a plain loop at that split."""
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOMICRO_MP_PRELOAD",)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    code = (
        "import json, sys\n"
        "import tests.composer_free_cases as cases\n"
        "import automicro\n"
        "from automicro.testing.multiprocess import run_multiprocess\n"
        "out = run_multiprocess(cases.run, world_size=2, timeout_s=240)\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in cases.HIDDEN and sys.modules[n] is not None)\n"
        "print(json.dumps({'ranks': out, 'parent_loaded': loaded, 'step': automicro.AutoStep.__module__}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["parent_loaded"] == [] and report["step"] == "automicro.step"
    for rank, out in enumerate(report["ranks"]):
        assert out["composer_hidden"] and out["frameworks_loaded"] == [], (rank, out)
        splits = [tuple(r["split"]) for r in out["results"]]
        assert splits[0] != (8,) and all(max(s) <= 3 for s in splits) and splits[-1] == (3, 3, 2), (rank, out["results"])
        assert out["results"][0]["attempts"] >= 2  # the search ran into rank 1's OOM and retried
        assert out["max_error"] < 1e-6, (rank, out["max_error"])
