"""`automicro.composer.builders`: the product does not import its test kit, and the names that
moved out of it (to `automicro.testing` and `automicro.composer.loggers`) still resolve from
the old path for one release, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

MOVED = {
    "MemoryCapCallback": "automicro.testing.callbacks",
    "CapMemory": "automicro.testing.callbacks",
    "JSONLLogger": "automicro.composer.loggers",
    "AutomicroWandBLogger": "automicro.composer.loggers",
    "build_loggers": "automicro.composer.loggers",
}


def test_importing_the_builders_and_the_trainer_does_not_import_the_test_kit():
    code = (
        "import sys; import automicro.composer.builders, automicro.composer.trainer, "
        "automicro.composer.loggers; "
        "print(sorted(m for m in sys.modules if m.startswith('automicro.testing')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name, new_module", sorted(MOVED.items()))
def test_moved_names_resolve_from_the_old_path_with_a_warning(name, new_module):
    from automicro.composer import builders
    with pytest.warns(DeprecationWarning, match=rf"builders\.{name} moved to {new_module}\.{name}"):
        old = getattr(builders, name)
    assert old is getattr(importlib.import_module(new_module), name)


def test_old_from_import_still_works():
    with pytest.warns(DeprecationWarning, match="automicro.testing.callbacks.MemoryCapCallback"):
        from automicro.composer.builders import MemoryCapCallback
    from automicro.testing import MemoryCapCallback as new

    assert MemoryCapCallback is new


def test_old_callbacks_table_resolves_the_registry_with_a_warning():
    from automicro.config import CALLBACK_REGISTRY
    from automicro.composer import builders
    with pytest.warns(DeprecationWarning, match="CALLBACK_REGISTRY"):
        table = builders.CALLBACKS
    assert list(table) == list(CALLBACK_REGISTRY)
    assert table["memory_cap"].__module__ == "automicro.testing.callbacks"


def test_a_memory_cap_in_the_config_is_built_from_the_kit():
    from automicro.config import load_config
    from automicro.composer import builders
    from automicro.testing import MemoryCapCallback

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml")
    assert "memory_cap" in cfg.callbacks
    assert any(isinstance(c, MemoryCapCallback) for c in builders.build_callbacks(cfg))


def test_unknown_attribute_is_still_an_attribute_error():
    from automicro.composer import builders
    with pytest.raises(AttributeError, match="no_such_name"):
        builders.no_such_name  # noqa: B018
