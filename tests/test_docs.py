"""The documentation (issue 61): the README stays short, the configuration reference is generated from
the code and lists every key the shipped configs use, and every guide is in the site's nav.
`make docs` (CI's first step) builds the site strict."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_hooks", module)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules["docs_hooks"])
    module = sys.modules["docs_hooks"]
    return module


def _used_keys(value, prefix: str, known: set[str]) -> set[str]:
    """The dotted keys a YAML mapping sets, descending only where the reference has keys below."""
    keys = set()
    for key, inner in value.items():
        dotted = f"{prefix}{key}"
        keys.add(dotted)
        if isinstance(inner, dict) and any(k.startswith(dotted + ".") for k in known):
            keys |= _used_keys(inner, dotted + ".", known)
    return keys


def test_the_readme_is_at_most_200_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("config", ["tiny-cpu.yaml", "tiny-gpu.yaml", "tiny-cpu-varlen.yaml", "tiny-cpu-pp.yaml"])
def test_the_configuration_reference_lists_every_key_a_shipped_config_uses(config):
    known = _hooks().reference_keys()
    used = _used_keys(yaml.safe_load((REPO / "automicro" / "configs" / config).read_text()), "", known)
    assert used and used - known == set(), sorted(used - known)


def test_the_reference_gives_every_key_a_meaning_and_catches_one_without(monkeypatch):
    hooks = _hooks()
    text = hooks.reference_markdown()
    assert "| `stable_batches` | `int` | `3` | Clean batches at one split" in text
    assert "| `device_train_microbatch_size` | `Union[int, str]` | `'auto'` |" in text
    sections = hooks.sections()
    sections[0].keys[0].meaning = ""
    monkeypatch.setattr(hooks, "sections", lambda: sections)
    with pytest.raises(ValueError, match="keys without a meaning"):
        hooks.reference_markdown()


def test_every_page_under_docs_is_in_the_nav_and_every_nav_page_exists():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    listed = set(re.findall(r"([\w/-]+\.md)", str(config["nav"])))
    excluded = ("results/", "autostep-plan.md")
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")
             if not str(p.relative_to(REPO / "docs")).startswith(excluded)}
    assert listed == pages, (sorted(listed - pages), sorted(pages - listed))
