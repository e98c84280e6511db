"""The gate keeps a test for every guarantee and fits its budget (`tests/gate.py`)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests import gate

TESTS = Path(__file__).parent


def _test_functions(file: str) -> set[str]:
    tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def _split(entry: str) -> tuple[str, str, str]:
    file, _, rest = entry.partition("::")
    name, _, case = rest.partition("[")
    return file, name, case.rstrip("]")


@pytest.mark.parametrize("guarantee", sorted(gate.GUARANTEES))
def test_every_guarantee_keeps_a_test_in_the_gate(guarantee):
    entries = gate.GUARANTEES[guarantee]
    assert entries, f"{guarantee!r}: no gate test"
    for entry in entries:
        file, name, _ = _split(entry)
        assert (TESTS / file).exists(), f"{guarantee!r}: {file} does not exist"
        if not name:
            assert _test_functions(file), f"{guarantee!r}: {file} has no tests"
            continue
        assert name in _test_functions(file), f"{guarantee!r}: {file} has no {name}"
        assert not (name in gate.FULL_TIER and gate.FULL_TIER[name] is None), f"{guarantee!r}: {name} is in the full tier only"


def test_the_torch_versions_guarantee_names_tests_the_newer_legs_run():
    from tests.conftest import TORCH_VERSION_FILES

    entries = [entry for guarantee, entries in gate.GUARANTEES.items() if "every supported torch" in guarantee for entry in entries]
    assert entries and all(_split(entry)[0] in TORCH_VERSION_FILES for entry in entries), entries


def test_the_full_tier_names_tests_that_exist():
    every = {name for file in TESTS.glob("test_*.py") for name in _test_functions(file.name)}
    missing = sorted(set(gate.FULL_TIER) - every)
    assert not missing, f"tests/gate.py FULL_TIER names tests that do not exist: {missing}"


def test_the_recorded_gate_fits_its_budget():
    """On the recording machine (`tests/costs.json`: its steps, every file and launch, its calibration) the gate draws at
    least a quarter of each file's launches within 30 minutes (so that a machine 1.33x slower fits CI's 40), and its
    floor (one launch a file, every test that launches none, the steps) fits them too (`.ci/costs.py predict`): a
    change that adds tests pays for them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ci_costs", TESTS.parent / ".ci" / "costs.py")
    ci = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ci)
    recorded = json.loads((TESTS / "costs.json").read_text(encoding="utf-8"))
    assert recorded.get("steps") and recorded.get("calibration_s"), (
        "tests/costs.json records no steps or calibration: record a whole .ci/run (python3 .ci/costs.py update .ci-costs)")
    share = ci.commit_share(recorded)
    predicted = ci.predicted_s(recorded, share)
    floor = ci.predicted_s(recorded, ci.SHARES[-1])
    what = (f"every launch {ci.predicted_s(recorded):.0f} s, share {share:g} {predicted:.0f} s, the floor {floor:.0f} s "
            f"(steps: {recorded['steps']}); make something cheaper or move tests to FULL_TIER (tests/gate.py), then record "
            "a .ci/run (python3 .ci/costs.py update .ci-costs)")
    assert gate.GATE_BUDGET_S == ci.BUDGET_S
    assert share >= ci.MIN_SHARE and predicted <= ci.RECORDED_BUDGET_S, (
        f"the gate no longer draws a quarter of its launches in 30 minutes: {what}")
    assert floor <= ci.RECORDED_BUDGET_S, f"even one launch a file does not fit 30 minutes: {what}"
