"""Installing on a newer torch in one command: ``uv pip install --override
requirements/override-torch-X.txt ...`` (README "Install", docs/supported-versions.md). `make venv-211` and `make
venv-215` build CI's torch 2.11 and 2.15 legs with that command, so on those legs the environment
running this file is what the command gave: the torch and torchvision its file pins, beside Composer
0.32.1 whose own pin (torch<2.7.1) it replaced. On leg 1 (Composer's own torch) the environment
holds to Composer's pins; the README, Makefile and files are checked on every leg."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
VERSIONS = ("2.11", "2.15")


def _pins(version: str) -> dict[str, str]:
    text = (REPO / "requirements" / f"override-torch-{version}.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)\s*$", text, re.M))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_readme_and_the_makefile_install_with_the_same_override_file(version):
    pins = _pins(version)
    assert pins["torch"] == f"{version}.0" and set(pins) == {"torch", "torchvision"}, pins
    readme = (REPO / "README.md").read_text()
    versions_page = (REPO / "docs" / "supported-versions.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    command = f"uv pip install -q --override requirements/override-torch-{version}.txt -e . -r requirements/torch-{version}.txt"
    assert command in makefile, f"make venv-{version.replace('.', '')} no longer runs the README's command"
    if version == "2.15":
        assert "uv pip install --override requirements/override-torch-2.15.txt -e " in readme
    assert f"requirements/override-torch-{version}.txt" in versions_page
    assert all(f"{name}=={pin}" in versions_page for name, pin in pins.items()), pins


def test_this_environment_has_the_torch_its_pins_ask_for_beside_composer():
    """On CI's legs 2 and 3 (built by the one command): torch and torchvision as the override file pins
    them; on leg 1 (no override): as Composer's own pins accept. Everywhere Composer 0.32.1 is installed
    with every other dependency it asks for, at a version it accepts (the override replaces only its
    torch and torchvision pins)."""
    installed = {"torch": torch.__version__.split("+")[0], "torchvision": metadata.version("torchvision").split("+")[0]}
    minor = ".".join(installed["torch"].split(".")[:2])
    assert metadata.version("mosaicml") == "0.32.1"
    unmet = []
    for text in metadata.requires("mosaicml") or []:
        requirement = Requirement(text)
        if requirement.marker is not None:
            continue  # its extras
        if requirement.name in installed and minor in VERSIONS:
            assert installed[requirement.name] == _pins(minor)[requirement.name], (requirement.name, installed)
            continue  # the override replaced this pin
        try:
            version = installed.get(requirement.name) or metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            version = None
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            unmet.append(f"{requirement} (installed: {version})")
    assert unmet == [], unmet
