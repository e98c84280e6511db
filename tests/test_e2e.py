"""The main job end to end: the Composer launcher runs configs/tiny-cpu.yaml on 2 gloo ranks."""

from __future__ import annotations

import json
import sys

import pytest

from tests.launch import COMPOSER
from tests.launch import run as _run


@pytest.mark.multiproc
def test_launcher_runs_tiny_cpu_config_on_two_ranks_with_a_real_search(tmp_path):
    result = _run(
        [str(COMPOSER), "-n", "2", "scripts/train.py", "configs/tiny-cpu.yaml", "max_duration=8ba", f"run_dir={tmp_path}"],
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    # Rank 0's cap (13 MB) fits 5 samples per microbatch: the search must land there exactly,
    # then split the per-rank batch of 8 evenly.
    assert "microbatch size found: 5 (per-rank batch 8); split in use [4, 4]" in result.stdout, result.stdout[-4000:]
    assert "oom on rank(s) [0]" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sizes = [row["automicro/microbatch_size"] for row in rows if "automicro/microbatch_size" in row]
    assert sizes and sizes[-1] == 4
    assert any("loss/train/total" in row for row in rows)


def test_bad_config_fails_before_any_process_starts_with_the_key_named():
    result = _run([sys.executable, "scripts/train.py", "configs/tiny-cpu.yaml", "device_train_microbatch_size=big"], 120)
    assert result.returncode == 2
    assert "device_train_microbatch_size='big'" in result.stdout
