"""Throughput dashboards: the demo under the Composer launcher with `loggers.wandb: true` (offline),
read back with wandb's own record reader; the plot script on that run's metrics.jsonl; the
`automicro/event` traces; the metrics table of docs/guides/dashboards.md; the console lines.

One launcher run (module-scoped fixture) serves every test that needs a real run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.launch import COMPOSER, REPO
from tests.launch import run as _run

PLOT = REPO / "scripts" / "plot_run.py"
BATCHES = 8
# scripts/plot_run.py: figsize (11, 8.2) inches at 110 dpi with auto microbatching.
PNG_SHAPE = (902, 1210)


def _offline_env(tmp: Path) -> dict[str, str]:
    # WANDB_MODE unset on purpose: `build_loggers` must choose offline itself (no project set).
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONUNBUFFERED="1", WANDB_CONFIG_DIR=str(tmp / "wandb-config"), WANDB_SILENT="false")
    return env


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Any]:
    """configs/tiny-cpu.yaml on 2 gloo ranks with wandb on. `memory_monitor` rides along to show
    that it only warns on CPU."""
    tmp = tmp_path_factory.mktemp("dashboard")
    run_dir = tmp / "run"
    result = _run(
        [
            str(COMPOSER), "-n", "2", "scripts/train.py", "configs/tiny-cpu.yaml", "loggers.wandb=true",
            f"max_duration={BATCHES}ba", f"run_dir={run_dir}", "callbacks.memory_monitor={}",
        ],
        timeout_s=420,
        env=_offline_env(tmp),
    )
    assert result.returncode == 0, result.stdout[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"tmp": tmp, "run_dir": run_dir, "stdout": result.stdout, "rows": rows}


@pytest.fixture(scope="module")
def varlen_demo(tmp_path_factory) -> dict[str, Any]:
    """configs/tiny-cpu-varlen.yaml (budget: tokens) on 2 gloo ranks, wandb off."""
    tmp = tmp_path_factory.mktemp("dashboard-varlen")
    run_dir = tmp / "run"
    result = _run(
        [str(COMPOSER), "-n", "2", "scripts/train.py", "configs/tiny-cpu-varlen.yaml", f"max_duration={BATCHES}ba",
         f"run_dir={run_dir}"],
        timeout_s=420,
        env=_offline_env(tmp),
    )
    assert result.returncode == 0, result.stdout[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"tmp": tmp, "run_dir": run_dir, "stdout": result.stdout, "rows": rows}


def _metric_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r.get("trace")]


def _events(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("trace") and "automicro/event" in r]


def _logged_automicro_keys(rows: list[dict[str, Any]]) -> set[str]:
    return {k for r in _metric_rows(rows) for k in r if k.startswith("automicro/")}


def _read_wandb_records(run_dir: Path) -> dict[str, Any]:
    """The offline run's `.wandb` file through wandb's own reader (what `wandb sync --view` uses)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {run_dir / 'wandb'}, found {files}"
    store = DataStore()
    store.open_for_scan(files[0])
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    kinds: set[str] = set()
    while True:
        data = store.scan_data()
        if data is None:
            break
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        kinds.add(kind)
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind in ("run", "config"):  # the run's first record holds wandb.init's config
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {"history": history, "summary": summary, "config": config, "kinds": kinds, "file": files[0]}


def _documented_metric_keys() -> set[str]:
    text = (REPO / "docs" / "guides" / "dashboards.md").read_text()
    match = re.search(r"^## Metrics\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, "docs/guides/dashboards.md has no '## Metrics' section"
    return set(re.findall(r"^\| `(automicro/[a-z_]+)` \|", match.group(1), flags=re.M))


# ---- (a) wandb, offline, read back with wandb's reader ----------------------------------------


@pytest.mark.multiproc
@pytest.mark.multiproc
def test_launcher_runs_tiny_cpu_config_on_two_ranks_with_a_real_search(demo):
    """`composer -n 2 scripts/train.py configs/tiny-cpu.yaml` (the demo, here with wandb offline and
    the memory monitor, neither of which moves the search)."""
    # Rank 0's cap (13 MB) fits 5 samples per microbatch: the search must land there exactly,
    # then split the per-rank batch of 8 evenly.
    assert "microbatch size found: 5 (per-rank batch 8); split in use [4, 4]" in demo["stdout"], demo["stdout"][-4000:]
    assert "oom on rank(s) [0]" in demo["stdout"]
    sizes = [row["automicro/microbatch_size"] for row in demo["rows"] if "automicro/microbatch_size" in row]
    assert sizes and sizes[-1] == 4
    assert any("loss/train/total" in row for row in demo["rows"])


def test_the_wandb_run_config_is_the_resolved_yaml_and_the_last_lines_say_where_outputs_are(demo):
    config = _read_wandb_records(demo["run_dir"])["config"]
    # The YAML's own values, the command line's overrides and the filled-in defaults.
    assert config["device_train_microbatch_size"] == "auto"
    assert config["max_duration"] == f"{BATCHES}ba" and config["run_dir"] == str(demo["run_dir"])
    assert config["loggers"]["wandb"] is True and "memory_monitor" in config["callbacks"]
    assert config["parallelism_config"]["fsdp2"]["forward_prefetch"] == 2 and config["global_train_batch_size"] == 16
    # Composer's own keys are still there next to them.
    assert "composer_version" in config
    # The run's own last lines (the launcher may print after them).
    last = [line for line in demo["stdout"].splitlines() if line.startswith("[automicro]")][-2:]
    metrics_line = next(line for line in last if line.startswith("[automicro] metrics: "))
    assert str(demo["run_dir"] / "metrics.jsonl") in metrics_line and "scripts/plot_run.py" in metrics_line
    wandb_line = next(line for line in last if line.startswith("[automicro] wandb run: "))
    run_folder = wandb_line.split("[automicro] wandb run: ")[1].split(" ")[0]
    assert Path(run_folder).is_dir() and Path(run_folder).name.startswith("offline-run-"), wandb_line


@pytest.mark.multiproc
def test_wandb_offline_run_holds_automicro_and_throughput_metrics(demo):
    assert "[automicro] wandb offline" in demo["stdout"], demo["stdout"][-3000:]
    records = _read_wandb_records(demo["run_dir"])
    assert "exit" in records["kinds"], "the offline run did not finish cleanly"
    keys = {k for row in records["history"] for k in row}
    expected = _logged_automicro_keys(demo["rows"]) | {"throughput/tokens_per_sec", "throughput/samples_per_sec"}
    assert expected - keys == set(), f"missing from the wandb history: {sorted(expected - keys)}"
    # Same values as the JSONL: the last batch's size, the OOM count and where the last OOM was.
    steps = {row["_step"]: row for row in records["history"] if "_step" in row}
    last = steps[BATCHES]
    assert last["automicro/microbatch_size"] == 4 and last["automicro/num_microbatches"] == 2
    assert last["automicro/ooms_total"] == 2 and last["automicro/found_size"] == 5
    assert last["automicro/last_oom_rank"] == 0
    # The batch's peak: reached under the cap the size was searched against, every batch its own.
    peaks = [row["automicro/peak_bytes"] for _, row in sorted(steps.items()) if "automicro/peak_bytes" in row]
    assert len(peaks) == BATCHES and 0 < last["automicro/peak_bytes"] <= last["automicro/capacity_bytes"], peaks
    from automicro.core.sites import ALL_SITES

    assert ALL_SITES[last["automicro/last_oom_site"]] == "forward"
    # Events do not advance wandb's step: one history row per step, and they sit in the summary.
    assert sorted(steps) == list(range(len(steps)))
    events = records["summary"]["automicro/events"]
    assert [(e["batch"], e["size"], e["outcome"], e["site"]) for e in events] == [
        (0, 8, "oom", "forward_pre"),
        (1, 6, "oom", "forward"),
    ]


# ---- (b) the plot script on the same run --------------------------------------------------------


@pytest.mark.multiproc
def test_plot_script_renders_the_real_run(demo):
    import matplotlib.image

    out = demo["tmp"] / "run.png"
    result = _run([sys.executable, str(PLOT), str(demo["run_dir"]), "-o", str(out)], 120, _offline_env(demo["tmp"]))
    assert result.returncode == 0, result.stdout
    assert f"({'tiny-cpu'}: {BATCHES} batches, 2 events)" in result.stdout, result.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000, len(data)
    image = matplotlib.image.imread(str(out))
    assert image.shape[:2] == PNG_SHAPE, image.shape
    # Not blank: red OOM marks are drawn (matplotlib's tab:red, #d62728).
    rgb = image[..., :3]
    red = (abs(rgb[..., 0] - 0xD6 / 255) < 0.03) & (abs(rgb[..., 1] - 0x27 / 255) < 0.03) & (abs(rgb[..., 2] - 0x28 / 255) < 0.03)
    assert red.sum() > 50, red.sum()


def test_plot_script_fails_clearly_without_a_run(tmp_path):
    env = _offline_env(tmp_path)
    missing = tmp_path / "no-such-run"
    result = _run([sys.executable, str(PLOT), str(missing)], 120, env)
    assert result.returncode == 2 and str(missing) in result.stdout, result.stdout
    (tmp_path / "empty").mkdir()
    result = _run([sys.executable, str(PLOT), str(tmp_path / "empty")], 120, env)
    assert result.returncode == 2 and str(tmp_path / "empty" / "metrics.jsonl") in result.stdout, result.stdout


def test_plot_script_draws_a_run_without_auto_microbatching(tmp_path):
    import matplotlib.image

    rows = [{"step": 0, "trace": True, "run_start": {"run_name": "fixed"}}]
    rows += [{"step": s, "throughput/tokens_per_sec": 1000.0 + s} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11, "thr')
    result = _run([sys.executable, str(PLOT), str(tmp_path), "-o", str(tmp_path / "p.png")], 120, _offline_env(tmp_path))
    assert result.returncode == 0, result.stdout
    assert "skipped 1 unreadable line" in result.stdout
    assert matplotlib.image.imread(str(tmp_path / "p.png")).shape[:2] == (495, 1210)


def test_plot_script_shades_each_trials_batches_with_its_name_outcome_and_cost(tmp_path):
    """The `automicro/trial` traces (one per trial that ended) become shaded spans, one colour per trial, named."""
    import importlib.util

    import matplotlib.image

    spec = importlib.util.spec_from_file_location("plot_run", PLOT)
    plot_run = importlib.util.module_from_spec(spec)
    sys.modules["plot_run"] = plot_run  # its dataclasses look their module up
    spec.loader.exec_module(plot_run)
    rows = [{"step": 0, "trace": True, "run_start": {"run_name": "priced"}}]
    rows += [{"step": s, "throughput/tokens_per_sec": 1000.0, "automicro/microbatch_size": 4, "automicro/num_microbatches": 2,
              "automicro/hooks_active": int(s < 4), "automicro/trial": 0, "automicro/trials_s": 0.0} for s in range(1, 21)]
    rows += [{"step": 7, "trace": True, "automicro/trial": {"trial": "profile", "kind": "profile", "first": 4, "last": 5,
                                                            "outcome": "", "cost_s": 0.4, "predicted_s": None}},
             {"step": 13, "trace": True, "automicro/trial": {"trial": "no_reshard", "kind": "no_reshard", "first": 6, "last": 11,
                                                             "outcome": "kept", "cost_s": -0.25, "predicted_s": 0.14}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = plot_run.read_run(str(tmp_path / "metrics.jsonl"))
    shades = plot_run.trial_shades(run)
    assert [(lo, hi, text) for lo, hi, _, text in shades] == [(3.5, 5.5, "profile, +0.40 s"), (5.5, 11.5, "no_reshard: kept, -0.25 s")]
    assert shades[0][2] == plot_run.PROFILE_COLOR and shades[1][2] != shades[0][2]
    result = _run([sys.executable, str(PLOT), str(tmp_path), "-o", str(tmp_path / "p.png")], 120, _offline_env(tmp_path))
    assert result.returncode == 0, result.stdout
    assert matplotlib.image.imread(str(tmp_path / "p.png")).shape[:2] == PNG_SHAPE


# ---- (c) one event trace per OOM in metrics.jsonl -----------------------------------------------


@pytest.mark.multiproc
def test_metrics_jsonl_has_one_event_trace_per_oom(demo):
    rows, stdout = demo["rows"], demo["stdout"]
    metrics = _metric_rows(rows)
    ooms_total = [r["automicro/ooms_total"] for r in metrics if "automicro/ooms_total" in r][-1]
    events = _events(rows)
    oom_lines = [line for line in stdout.splitlines() if line.startswith("[automicro] batch") and "-> oom" in line]
    assert len(events) == ooms_total == len(oom_lines) == 2, (events, oom_lines)
    for row, line in zip(events, oom_lines):
        event = row["automicro/event"]
        assert set(event) >= {"batch", "attempt", "size", "outcome", "ranks", "site", "site_index", "next_size"}
        assert line.startswith(f"[automicro] batch {event['batch']} attempt {event['attempt']}: size {event['size']} ")
        assert f"next size {event['next_size']}" in line
        # Logged at the step of the batch's own metrics (Composer logs batch N's at step N + 1).
        assert row["step"] == event["batch"] + 1
    assert [(e["automicro/event"]["size"], e["automicro/event"]["ranks"], e["automicro/event"]["site_index"]) for e in events] == [
        (8, [0], 0),
        (6, [0], 1),
    ]
    # Throughput is in the JSONL too, and traces never replace a metric row.
    assert any("throughput/tokens_per_sec" in r for r in metrics)
    assert any("throughput/samples_per_sec" in r for r in metrics)
    assert len([r for r in metrics if "automicro/microbatch_size" in r]) == BATCHES
    starts = [r for r in rows if r.get("trace") and "run_start" in r]
    assert starts == [{"step": 0, "trace": True, "run_start": {"run_name": "tiny-cpu"}}]


# ---- (d) the docs' metrics table -------------------------------------------------------------------


@pytest.mark.multiproc
def test_the_dashboards_page_lists_every_logged_automicro_key(demo, varlen_demo):
    logged = _logged_automicro_keys(demo["rows"]) | _logged_automicro_keys(varlen_demo["rows"])
    documented = _documented_metric_keys()
    assert logged - documented == set(), f"logged but not in the docs' ## Metrics: {sorted(logged - documented)}"
    assert documented - logged == set(), f"in the docs' ## Metrics but never logged: {sorted(documented - logged)}"


# ---- console ------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_console_has_one_line_per_search_event_and_one_when_hooks_come_off(demo):
    lines = [line for line in demo["stdout"].splitlines() if line.startswith("[automicro]")]
    attempts = [line for line in lines if line.startswith("[automicro] batch")]
    assert len(attempts) == 7 and len(set(attempts)) == 7, lines  # 2 + 2 + 3 clean batches, as the summary says
    assert lines.count("[automicro] sync hooks off after 3 clean batches at split [4, 4]") == 1, lines
    assert not [line for line in lines if "sync hooks off (" in line], lines
    assert "[automicro] microbatch size found: 5 (per-rank batch 8); split in use [4, 4]; layout: default; attempts 7, OOMs 2" in demo["stdout"]
    # memory_monitor on CPU only warns.
    assert "memory monitor only works on CUDA devices" in demo["stdout"]


# ---- builders and loggers: wandb mode, the GPU config --------------------------------------------------------


def test_build_loggers_chooses_offline_wandb_only_when_nothing_says_otherwise(tmp_path, monkeypatch):
    from composer.loggers import WandBLogger

    from automicro.config import load_config
    from automicro.composer.loggers import build_loggers

    for key in ("WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.setenv(key, "")  # records the original value, so what build_loggers sets is undone
        monkeypatch.delenv(key)
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["loggers.wandb=true", f"run_dir={tmp_path}"])
    wandb_loggers = [lg for lg in build_loggers(cfg) if isinstance(lg, WandBLogger)]
    assert len(wandb_loggers) == 1 and os.environ["WANDB_MODE"] == "offline"
    assert wandb_loggers[0]._init_kwargs["dir"] == str(tmp_path)

    monkeypatch.delenv("WANDB_MODE")
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["loggers.wandb=true", "loggers.wandb_project=p", f"run_dir={tmp_path}"])
    build_loggers(cfg)
    assert "WANDB_MODE" not in os.environ

    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["loggers.wandb=true", f"run_dir={tmp_path}"])
    build_loggers(cfg)
    assert os.environ["WANDB_MODE"] == "disabled"


def test_gpu_config_has_the_memory_monitor():
    from composer.callbacks import MemoryMonitor, SpeedMonitor

    from automicro.config import load_config
    from automicro.composer import builders
    cfg = load_config(REPO / "configs" / "tiny-gpu.yaml")
    kinds = {type(c) for c in builders.build_callbacks(cfg)}
    assert {MemoryMonitor, SpeedMonitor} <= kinds


# ---- loss parity plot -------------------------------------------------------------------------


def _parity_doc(first, second, searching=(0, 1), oom_batches=(0,)):
    rows = [{"batch": i, "hooks": i in searching, "attempts": 2 if i in oom_batches else 1} for i in range(len(first))]
    return {"model": "1b", "seq_len": 2048, "world_size": 2, "device": "GPU", "torch": "2.x",
            "cases": [{"name": "parity-auto", "rows": rows}, {"name": "parity-fixed-3", "rows": []}],
            "report": {"size": 3, "losses": {"auto": first, "fixed": second}}}


def test_plot_script_draws_loss_parity_with_the_noise_floor(tmp_path):
    import matplotlib.image

    auto = [5.0 / (1 + 0.05 * i) for i in range(60)]
    fixed = [x + (0.01 if i % 2 else -0.01) for i, x in enumerate(auto)]
    (tmp_path / "parity.json").write_text(json.dumps(_parity_doc(auto, fixed)))
    (tmp_path / "control.json").write_text(json.dumps(_parity_doc(fixed, [x + 0.005 for x in fixed], (), ())))
    out = tmp_path / "parity.png"
    result = _run([sys.executable, str(PLOT), "--parity", str(tmp_path / "parity.json"), "--control",
                   str(tmp_path / "control.json"), "-o", str(out)], 120, _offline_env(tmp_path))
    assert result.returncode == 0, result.stdout
    # The printed means are computed from the two files: 0.01 between auto and fixed, 0.005 in the control.
    assert "60 batches; mean_abs_diff 0.0100, control_mean_abs_diff 0.0050" in result.stdout, result.stdout
    image = matplotlib.image.imread(str(out))
    rgb = image[..., :3]
    red = (abs(rgb[..., 0] - 0xD6 / 255) < 0.03) & (abs(rgb[..., 1] - 0x27 / 255) < 0.03) & (abs(rgb[..., 2] - 0x28 / 255) < 0.03)
    assert red.sum() > 20, "the OOM batch of the auto run is not marked"


def test_plot_script_refuses_a_json_without_parity_losses(tmp_path):
    (tmp_path / "nohang.json").write_text(json.dumps({"suite": "nohang", "cases": []}))
    result = _run([sys.executable, str(PLOT), "--parity", str(tmp_path / "nohang.json")], 120, _offline_env(tmp_path))
    assert result.returncode == 2 and "no losses under report.losses" in result.stdout, result.stdout
    result = _run([sys.executable, str(PLOT), "--control", str(tmp_path / "nohang.json")], 120, _offline_env(tmp_path))
    assert result.returncode == 2 and "--control needs --parity" in result.stdout, result.stdout


@pytest.mark.multiproc
def test_a_token_budget_run_shows_its_budget_on_the_console_in_the_metrics_and_in_the_plot(varlen_demo):
    found = re.findall(r"\[automicro\] microbatch budget found: (\d+) tokens", varlen_demo["stdout"])
    assert found, varlen_demo["stdout"][-3000:]
    rows = [r for r in _metric_rows(varlen_demo["rows"]) if "automicro/budget_tokens" in r]
    assert rows and all(r["automicro/budget_tokens"] > 0 and 0.0 <= r["automicro/padding_waste"] < 1.0 for r in rows)
    assert rows[-1]["automicro/found_size"] == int(found[-1])
    out = varlen_demo["tmp"] / "varlen.png"
    result = _run([sys.executable, str(PLOT), str(varlen_demo["run_dir"]), "-o", str(out)], 120,
                  _offline_env(varlen_demo["tmp"]))
    assert result.returncode == 0 and out.read_bytes()[:4] == b"\x89PNG", result.stdout
