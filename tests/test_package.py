"""The built artefacts: the wheel and the sdist build from the working tree and pass `twine
check`; the wheel, installed into a fresh environment outside the repository, runs the main job by a
shipped config's name under the composer launcher, and its console script checks a config."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.launch import REPO, run


def _working_tree(dest: Path) -> None:
    """The repository's files as a user's clone has them (tracked and new, not ignored): the build
    must not write into the repository, which other tests read."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _dependencies_path() -> list[str]:
    """This interpreter's package folders (torch, Composer, ...), less any that holds an `automicro`
    package (the repository, a `pip --target` copy): the fresh environment gets its dependencies from
    them and automicro only from the wheel. (A path file does not run the `.pth` files of the folders
    it adds, so an editable install's finder stays behind.)"""
    folders = [*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["purelib"]]
    folders += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [f for f in dict.fromkeys(folders) if f and os.path.isdir(f) and not os.path.isdir(os.path.join(f, "automicro"))]


@pytest.mark.multiproc
def test_the_wheel_installed_outside_the_repository_trains_the_shipped_config_by_name(tmp_path):
    # The dev extra carries both (setup.py): CI runs this test; a GPU machine's image lacks twine.
    pytest.importorskip("build", reason="the `build` package (setup.py's dev extra) builds the artefacts")
    pytest.importorskip("twine", reason="`twine` (setup.py's dev extra) checks the artefacts")
    source, dist, env, outside = (tmp_path / name for name in ("source", "dist", "env", "outside"))
    for folder in (source, outside):
        folder.mkdir()
    _working_tree(source)
    built = run([sys.executable, "-m", "build", "--outdir", str(dist), str(source)], timeout_s=300)
    assert built.returncode == 0, built.stdout[-4000:]
    artefacts = sorted(dist.iterdir())
    assert sorted(p.suffix for p in artefacts) == [".gz", ".whl"], artefacts
    checked = run([sys.executable, "-m", "twine", "check", "--strict", *map(str, artefacts)], timeout_s=120)
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout[-3000:]

    # A fresh environment: its own interpreter and site-packages, the dependencies on a path file.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "dependencies.pth").write_text("\n".join(_dependencies_path()) + "\n")
    wheel = next(p for p in artefacts if p.suffix == ".whl")
    installed = run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
                    timeout_s=180)
    assert installed.returncode == 0, installed.stdout[-3000:]

    env_vars = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env_vars.update(WANDB_MODE="offline", PYTHONUNBUFFERED="1", PATH=f"{env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    where = run([str(python), "-c", "import automicro, composer; print(automicro.__file__); print(automicro.__version__)"],
                timeout_s=120, env=env_vars, cwd=outside)
    assert where.returncode == 0 and where.stdout.startswith(purelib), (purelib, where.stdout[-2000:])

    checked_config = run([str(env / "bin" / "automicro-train"), "--check", "tiny-cpu"], timeout_s=120, env=env_vars, cwd=outside)
    assert checked_config.returncode == 0 and "config ok:" in checked_config.stdout, checked_config.stdout[-2000:]

    # `composer -n 2 -m automicro.train tiny-cpu` with the fresh environment's interpreter.
    trained = run([str(python), "-m", "composer.cli.launcher", "-n", "2", "-m", "automicro.train", "tiny-cpu",
                   "max_duration=2ba", f"run_dir={outside / 'run'}"], timeout_s=300, env=env_vars, cwd=outside)
    out = trained.stdout
    assert trained.returncode == 0, out[-4000:]
    assert "[automicro] done: 2 batches" in out and "[automicro] microbatch size found:" in out, out[-4000:]
    assert (outside / "run" / "metrics.jsonl").is_file()
