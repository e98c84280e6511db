"""Installing on a newer torch in one command (issue 63 item 3): ``uv pip install --override
requirements/override-torch-X.txt ...`` (README "Install", docs/supported-versions.md). `make venv-211` and `make
venv-215` build CI's torch 2.11 and 2.15 legs with that command, so on those legs the environment
running this file is what the command gave: the torch and torchvision its file pins, beside Composer
0.32.1 whose own pin (torch<2.7.1) it replaced. On leg 1 (Composer's own torch) the checks that need
such an environment skip; the README, Makefile and files are checked on every leg."""

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


def test_this_environment_has_the_torch_its_override_file_pins_beside_composer():
    """On CI's legs 2 and 3 (built by the one command): torch and torchvision as pinned, Composer 0.32.1
    installed with every other dependency it asks for, at a version it accepts (the override
    replaced only its torch and torchvision pins)."""
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if minor not in VERSIONS:
        pytest.skip(f"torch {torch.__version__}: Composer's own torch (leg 1), no override")
    pins = _pins(minor)
    assert torch.__version__.split("+")[0] == pins["torch"]
    assert metadata.version("torchvision").split("+")[0] == pins["torchvision"]
    assert metadata.version("mosaicml") == "0.32.1"
    unmet = []
    for text in metadata.requires("mosaicml") or []:
        requirement = Requirement(text)
        if requirement.marker is not None or requirement.name in ("torch", "torchvision"):
            continue  # its extras; the two the override replaced
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} (installed: {installed})")
    assert unmet == [], unmet
