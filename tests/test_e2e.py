"""The main job end to end: the Composer launcher runs configs/tiny-cpu.yaml on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.launch import COMPOSER, REPO
from tests.launch import run as _run


# The demo config under the launcher with a real search: test_dashboard.py's
# `test_launcher_runs_tiny_cpu_config_on_two_ranks_with_a_real_search` (one launch serves both).


def test_bad_config_fails_before_any_process_starts_with_the_key_named():
    result = _run([sys.executable, "scripts/train.py", "configs/tiny-cpu.yaml", "device_train_microbatch_size=big"], 120)
    assert result.returncode == 2
    assert "device_train_microbatch_size='big'" in result.stdout


def _train_main(argv: list[str]) -> int:
    """scripts/train.py's main() in this process (a `--check` returns before any heavy import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("automicro_train_script", REPO / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_check_runs_every_config_check_alone_for_the_world_size_it_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _train_main(["--check", "configs/tiny-cpu.yaml", f"run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "[automicro] config ok: configs/tiny-cpu.yaml" in out and "per-rank batch 16" in out, out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # The same checks as a launch of that size: 16 samples do not split over 3 ranks.
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert _train_main(["--check", "configs/tiny-cpu.yaml"]) == 2
    assert "global_train_batch_size=16" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    assert _train_main(["--check", "configs/tiny-cpu.yaml", f"load_path={tmp_path}/nope.pt"]) == 2
    assert "config error: load_path=" in capsys.readouterr().err


@pytest.mark.multiproc
def test_under_the_launcher_a_bad_config_is_said_once_and_fails_the_launch():
    result = _run([str(COMPOSER), "-n", "2", "scripts/train.py", "configs/tiny-cpu.yaml", "seed=-1"], 180)
    assert result.returncode != 0
    assert result.stdout.count("config error: seed=-1") == 1, result.stdout[-3000:]
    assert "Traceback" not in result.stdout


@pytest.mark.multiproc
def test_restart_with_autoresume_finishes_a_run_lost_between_batches_below_the_size_in_use(tmp_path):
    """docs/guides/checkpoints.md, 'When a run cannot recover in-process', end to end with the composer launcher (what
    the restart loop there runs): rank 1 runs out of memory in a callback between batches (nothing
    to retry) and every rank stops naming it; the next launch, same YAML and folder without the
    fault, autoresumes from the last checkpoint and finishes below the size that was in use, with
    the hooks on from the start."""
    folder = tmp_path / "checkpoints"
    common = [
        str(COMPOSER), "-n", "2", "scripts/train.py", "configs/tiny-cpu.yaml", "max_duration=10ba",
        f"run_dir={tmp_path}", f"save_folder={folder}", "save_interval=1ba", "autoresume=true",
    ]
    first = _run(common + ["callbacks.fault_injector={site: between_batches, ranks: [1], batch: 7}"], timeout_s=300)
    out = first.stdout
    assert first.returncode != 0, out[-4000:]
    assert "rank 1 cannot recover in-process from the failure at between_batches in batch 7" in out, out[-5000:]
    assert "(at Event.BATCH_END)" in out, out[-5000:]
    note = json.loads((folder / "automicro_failure.json").read_text())
    assert note["batch"] == 7, note
    # The newest checkpoint cut short, as a kill in the middle of writing it
    # leaves one (from Composer's own writer; automicro's writes are atomic). The next launch
    # skips it with one line and resumes from the one before.
    newest = max(folder.glob("ep0-ba*-rank0.pt"), key=lambda p: int(p.name.split("-ba")[1].split("-")[0]))
    assert newest.name == "ep0-ba6-rank0.pt", sorted(p.name for p in folder.iterdir())
    os.truncate(newest, newest.stat().st_size // 2)
    second = _run(common, timeout_s=300)
    out = second.stdout
    assert second.returncode == 0, out[-5000:]
    skipped = [line for line in out.splitlines() if "is incomplete" in line]
    assert len(skipped) == 1 and skipped[0].startswith(f"[automicro] checkpoint {newest} is incomplete (not a whole zip archive"), out[-5000:]
    assert skipped[0].endswith("resuming from ep0-ba5-rank0.pt (set aside as *.incomplete)"), skipped
    assert "[automicro] batch 5 attempt 1:" in out and "[automicro] batch 4 attempt" not in out, out[-5000:]
    assert f"the previous launch could not recover from an OOM at size {note['size']} in batch 7" in out, out[-5000:]
    resumed = [line for line in out.splitlines() if "resuming at size" in line]
    assert resumed and int(resumed[0].split("resuming at size ")[1].split()[0]) < note["size"], resumed
    assert "with the sync hooks on" in resumed[0]
    assert any(p.name.startswith("ep0-ba10") for p in folder.iterdir()), sorted(p.name for p in folder.iterdir())
