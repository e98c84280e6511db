"""What a user watches: wandb (offline) and the local record carry the automicro and throughput
metrics, every failed attempt is an event, the plot renders, and the README documents each key."""

from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_e2e import COMPOSER, REPO, _run


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dashboard")
    result = _run(
        [str(COMPOSER), "-n", "2", "scripts/train.py", "configs/tiny-cpu.yaml", "loggers.wandb=true",
         "loggers.console=false", "max_duration=8ba", f"run_dir={run_dir}"],
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    return run_dir, result.stdout


def _wandb_history_keys(run_dir: Path) -> set[str]:
    """Read the offline run file with wandb's own record reader (no mocking)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    paths = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(paths) == 1, paths
    store = datastore.DataStore()
    store.open_for_scan(paths[0])
    keys: set[str] = set()
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            keys.update(item.key or "/".join(item.nested_key) for item in record.history.item)
    return keys


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
def test_offline_wandb_run_holds_automicro_and_throughput_metrics(demo_run):
    run_dir, _ = demo_run
    keys = _wandb_history_keys(run_dir)
    for key in ("automicro/microbatch_size", "automicro/num_microbatches", "automicro/attempts", "automicro/ooms_total",
                "automicro/searching", "automicro/hooks_active", "automicro/thrash_events", "automicro/search_time_s",
                "automicro/alloc_retries", "automicro/last_oom_rank", "automicro/last_oom_site",
                "throughput/tokens_per_sec", "throughput/samples_per_sec", "loss/train/total"):
        assert key in keys, f"{key} missing from the wandb run; has {sorted(keys)}"


@pytest.mark.multiproc
def test_every_failed_attempt_is_an_event_trace_not_a_training_step(demo_run):
    run_dir, stdout = demo_run
    rows = _jsonl(run_dir)
    events = [row["automicro/event"] for row in rows if "automicro/event" in row]
    oom_lines = [line for line in stdout.splitlines() if "-> oom on rank(s)" in line]
    assert len(events) == len(oom_lines) >= 1
    assert all(row.get("trace") is True for row in rows if "automicro/event" in row)
    assert all(event["outcome"] == "oom" and event["ranks"] == [0] and event["site"] for event in events)
    # The logged microbatch size per step is the one each batch trained with, never a failed size.
    sizes = [row["automicro/microbatch_size"] for row in rows if "automicro/microbatch_size" in row]
    assert len(sizes) == 8 and max(sizes) <= 5


@pytest.mark.multiproc
def test_plot_script_renders_a_png_from_the_run_record(demo_run, tmp_path):
    run_dir, _ = demo_run
    png = tmp_path / "run.png"
    result = subprocess.run([sys.executable, "scripts/plot_run.py", str(run_dir), "-o", str(png)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.shape[0] > 400 and image.shape[1] > 600
    assert image.std() > 0.01  # not a blank canvas


def test_plot_script_refuses_a_missing_run_dir_naming_it(tmp_path):
    missing = tmp_path / "nope"
    result = subprocess.run([sys.executable, "scripts/plot_run.py", str(missing), "-o", str(tmp_path / "x.png")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert str(missing) in result.stderr + result.stdout


@pytest.mark.multiproc
def test_readme_metrics_table_documents_every_logged_automicro_key(demo_run):
    run_dir, _ = demo_run
    logged = {key for row in _jsonl(run_dir) for key in row if key.startswith("automicro/") and key != "automicro/event"}
    documented = set(re.findall(r"`(automicro/[a-z_]+)`", (REPO / "README.md").read_text()))
    assert logged and logged <= documented, sorted(logged - documented)
