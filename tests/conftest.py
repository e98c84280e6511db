"""Markers CI's legs select by (`.ci/run`).

- ``torch_versions``: the tests of code that differs between torch versions (FSDP2 and pipeline
  internals behind `automicro.engine._torch_internals`' gates, compile, checkpoints, the sync hooks
  and the ledger on FSDP2's collectives). Leg 1 (torch 2.7, Composer's pin) runs every test; legs
  2 and 3 (torch 2.11, 2.15) run these. What they leave out is automicro's own logic above the
  engine (config, launcher, consensus transports, console and dashboards, token packing), which
  the torch version does not reach. test_packing.py is one of them for the transformers version
  the newer legs carry (5.x, as the GPU machines; leg 1 has llm-foundry's pin 4.51): which
  transformers keeps packed samples apart differs by version.
- ``many_ranks``: 4-rank launches (2 CPU cores run them at half speed). The same code paths run on
  2 ranks in every leg; leg 1 runs a seeded quarter of the 4-rank launches each run, at most four (all
  with `--full`).

- ``full_tier``: `tests/gate.py`'s FULL_TIER, left out of every leg unless ``--full`` (`make test-full`):
  the gate (`make test`, CI) keeps a test for each guarantee within its budget.

``--versions-share K/N`` (CI's legs 2 and 3: 1/2 and 2/2, one seed for the three legs): of the
``torch_versions`` tests that launch processes, this leg takes its share, dealt per file
(`tests/matrix.shares`): the two legs together run every launch on a newer torch each CI run, each
launch once (a file with one launch goes whole to one leg), and over runs each launch comes up on
each version. A
launch: the tests that share one module- or class-scoped fixture (one process group serves them),
else one test function with its parameters (marked ``multiproc``, or calling ``run_multiprocess``).
Tests that launch nothing run on every leg.
"""

from __future__ import annotations

import os
from pathlib import Path

# Multi-rank tests fork their workers from one server that imported torch, Composer and automicro
# once per pytest process (`automicro.testing.multiprocess`, "forkserver"), instead of a fresh
# interpreter per worker ("spawn": 3-5 s of imports per worker). On the 2-core CI machine this
# took the torch_versions tests from 1117 s to 749 s (torch 2.7, 2026-11-26). A test that reads
# the workers' output through capfd passes start_method="spawn" (a forkserver's workers write to
# the server's stderr). AUTOMICRO_MP_START_METHOD=spawn in the environment restores spawn for all.
os.environ.setdefault("AUTOMICRO_MP_START_METHOD", "forkserver")
# The server also imports what the ranks of most launches import (Composer, automicro's integration and
# the tiny models' transformers modules): else every rank of every launch imports them after the fork,
# ~5 s of CPU a rank on 2 cores (scripts/launch_costs.py; `automicro.testing.multiprocess`, "Start method").
# tests/forkserver_warmup.py does once what each rank's first Trainer would (1.4 s a rank).
os.environ.setdefault(
    "AUTOMICRO_MP_PRELOAD",
    "composer,composer.trainer,composer.algorithms,automicro.composer.callback,automicro.composer.trainer,"
    "automicro.step,automicro.models,tests.forkserver_warmup",
)

TORCH_VERSION_FILES = {
    "test_automicro.py", "test_autostep.py", "test_capacity.py", "test_checkpoint.py", "test_checkpoint_commit.py", "test_compile.py",
    "test_control_sim.py", "test_engine.py", "test_sharding_choice.py",
    "test_fsdp_config.py", "test_head.py", "test_hf_models.py", "test_hf_trainer.py", "test_install.py", "test_ladder.py", "test_moe.py", "test_routing.py", "test_compile_watch.py", "test_forward_state.py", "test_ledger.py", "test_lightning.py", "test_local_step.py", "test_model.py",
    "test_offload.py", "test_optimizer_memory.py", "test_packing.py", "test_pipeline.py", "test_pipeline_memory.py", "test_recompute.py", "test_steady_state.py",
    "test_testing_tools.py", "test_trainer.py", "test_trial_plan.py", "test_watchdog.py",
}
# Not in the set though they run on FSDP2: test_floor_rule.py (the size-1 rule of the policy, over
# paths test_steady_state and test_pipeline cover on every torch) and test_unsharded.py (no FSDP2;
# Composer's own batch step). test_layout.py left them on 2026-11-26: the FSDP2 switches a layout
# turns (`automicro.engine.layout`: reshard after forward and after backward, gradient sync, the
# trades' projected bytes) run on every torch in test_engine's launch; test_layout's trials, undo
# and checkpoints are automicro's logic above them (about 75 s a leg).
# In test_pipeline.py, the 1F1B cases whose ZeroBubble twin runs the same sites and more (its fault
# matrix is 1F1B's plus the weight-gradient steps; the search is the same under either schedule):
# leg 1 runs both, legs 2 and 3 the ZeroBubble one (2026-11-26: about 70 s a leg).
# In test_checkpoint.py, the checkpoint commits on 2 simulated nodes of 2 ranks (a 4-rank launch,
# ~45 s): the node logic (one checker per node, the agreement) is automicro's own; the DCP save and
# load it goes through run on every torch in the 2-rank cases of the same tests.
# Test name -> the parameter (name, value) whose case runs on leg 1 only, or None: the whole test.
# The last one: a rank SIGKILLed in the middle of a full save and the relaunch (two 2-rank launches,
# ~25 s; the commit protocol runs on every torch in test_checkpoint's process group, the kill points
# in test_checkpoint_commit's forked children).
LEG1_ONLY = {
    "test_an_oom_on_one_stage_in_forward_di_or_dw_at_the_first_or_last_microbatch_is_retried_without_hang": ("fault_results", "1F1B"),
    "test_after_a_failed_attempt_on_one_stage_the_parameters_equal_a_fixed_size_run": ("fault_results", "1F1B"),
    "test_search_on_two_stages_finds_a_size_that_fits_and_trains_like_a_fixed_size_run": ("schedule", "1F1B"),
    "test_autoresume_skips_a_broken_newest_checkpoint_and_trains_like_a_run_loaded_from_the_good_one": ("layout", "2x2 sharded"),
    "test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_and_continue_or_stop_does_what_it_says": ("layout", "2x2 sharded"),
    "test_a_rank_killed_mid_save_leaves_a_folder_the_relaunch_resumes_from_like_a_run_loaded_there": None,
    # The watchdog's stalls other than in a collective, and the first compile left alone: Python-level waits and
    # thread stacks, the same on every torch; what the torch version reaches (a thread blocked in c10d, SIGTERM
    # there) runs on every leg: the stall in a collective and the SIGTERM test (about 40 s off legs 2 and 3).
    "test_a_stall_is_named_on_every_rank_with_its_stacks_and_ends_the_run": ("where", ("consensus", "compile", "checkpoint", "evaluation")),
    "test_a_long_legitimate_first_compile_is_not_ended": None,
    # The undo of a failed attempt's buffer writes through a plain loop on 2 ranks (a launch, ~26 s): the batch step's
    # logic is automicro's own; what it reads of torch (write counters, batch norm's statistics) runs on every leg in
    # test_forward_state's in-process tests.
    "test_a_plain_loop_rerun_after_an_oom_in_backward_leaves_every_buffer_as_the_run_without_it": None,
}
# Module fixtures that launch 4 ranks: every test that uses one is a 4-rank test.
MANY_RANK_FIXTURES = {"matrix_four_ranks", "steady_four_ranks", "data_parallel", "four_ranks"}  # four_ranks: test_token_budget


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        leg1_only = _named_case(LEG1_ONLY, item)
        if Path(str(item.fspath)).name in TORCH_VERSION_FILES and not leg1_only:
            item.add_marker(pytest.mark.torch_versions)
        if MANY_RANK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.many_ranks)
    _leave_the_full_tier(config, items)
    _keep_the_launches(config, items)
    _sample_many_rank_launches(config, items)
    _share_version_launches(config, items)
    _draw_launch_share(config, items)
    from tests import costs

    costs.LAUNCH_OF.update({item.nodeid: launch_of(item) or "" for item in items})


def _named_case(table, item) -> bool:
    """`item` is in `table` (test name -> None: every case, or (parameter, value): that case, or (parameter,
    (value, ...)): those cases)."""
    name = getattr(item, "originalname", item.name)
    if name not in table:
        return False
    case = table[name]
    params = getattr(getattr(item, "callspec", None), "params", {})
    values = case[1] if case is not None and isinstance(case[1], tuple) else (None if case is None else (case[1],))
    return case is None or str(params.get(case[0])) in {str(v) for v in values}


def _deselect(config, items, dropped):
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]


def _leave_the_full_tier(config, items):
    """`tests/gate.py`'s FULL_TIER: marked ``full_tier``; left out of the run unless `--full`."""
    import pytest

    from tests import gate

    full = [item for item in items if _named_case(gate.FULL_TIER, item)]
    for item in full:
        item.add_marker(pytest.mark.full_tier)
    if not config.getoption("--full"):
        _deselect(config, items, full)


def _keep_the_launches(config, items):
    """`--launches-only` (`make test-repeat`): the tests that start processes, nothing else."""
    if config.getoption("--launches-only"):
        _deselect(config, items, [item for item in items if launch_of(item) is None])


def _sample_many_rank_launches(config, items):
    """The 4-rank launches are sampled like the fault matrices (`tests/matrix.py`): each run takes a
    seeded quarter of them (a launch: a 4-rank module fixture with its tests, or one 4-rank test), the
    rest deselected; `--full` takes every one. The same paths run on 2 ranks in every run; over runs
    every 4-rank launch comes up (each is ~1-3 minutes on CI's 2 cores; a quarter since 2026-11-27,
    for the 45-minute budget)."""
    import math

    from tests import matrix

    def launch(item):
        fixture = sorted(MANY_RANK_FIXTURES & set(getattr(item, "fixturenames", ())))
        return f"{Path(str(item.fspath)).name}::{fixture[0] if fixture else item.name}"

    many = [item for item in items if item.get_closest_marker("many_ranks") is not None]
    launches = sorted({launch(item) for item in many})
    if not launches:
        return
    # One row (a constant key): a quarter of the launches drawn, at most four (the gate's budget, tests/gate.py:
    # six of 23 cost 120-330 s a run, by the draw), every one under --full.
    chosen = set(matrix.sample("4-rank launches", launches, key=lambda _: 0, per_key=min(4, math.ceil(len(launches) / 4))))
    dropped = [item for item in many if launch(item) not in chosen]
    _deselect(config, items, dropped)


def _launch_group(item):
    """The launch a torch_versions test belongs to (None: it launches nothing)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    shared = sorted(name for name, chain in defs.items() if chain and chain[-1].scope in ("module", "class"))
    if shared:
        return f"fixture {shared[0]}"
    if item.get_closest_marker("multiproc") is not None or "run_multiprocess(" in _source(item):
        return f"test {getattr(item, 'originalname', item.name)}"
    return None


def launch_of(item):
    """The launch a test belongs to (None: it starts no process): the processes one module- or class-scoped fixture
    starts serve every test that uses it; else the test's own (with its parameters, one launch each)."""
    if item.get_closest_marker("multiproc") is None and "run_multiprocess(" not in _source(item):
        return None
    group = _launch_group(item)
    return group if group and group.startswith("fixture ") else f"test {item.name}"


def _draw_launch_share(config, items):
    """A slow machine draws less, never nothing: with ``--launch-share S`` (S in (0, 1]; `.ci/run` sets it from its
    prediction, `.ci/costs.py predict`) each test file keeps a seeded share S of its launches, at least one (on the
    newer torch legs a file that leg 1 runs may keep none: each of its launches with chance S); the tests that
    launch nothing all run. Over successive seeds every launch runs; `--full` takes every one."""
    from tests import matrix

    share = matrix.parse_fraction(config.getoption("--launch-share"))
    if share >= 1.0:
        return
    launches, only_here = {}, set()
    for item in items:
        group = launch_of(item)
        if group is not None:
            file = Path(str(item.fspath)).name
            launches.setdefault(file, {}).setdefault(group, []).append(item)
            if item.get_closest_marker("torchtitan") is not None:
                only_here.add(file)
    # On the newer torch legs (--versions-share) a file leg 1 runs too may draw none of its launches: the
    # run keeps one launch of it there. The torchtitan files run on leg 3 only: they keep one.
    elsewhere = set(launches) - only_here if config.getoption("--versions-share") else set()
    kept = matrix.share_of("launch share", {file: sorted(groups) for file, groups in launches.items()}, share, elsewhere)
    dropped = [item for file, groups in launches.items() for group, tests in groups.items()
               if (file, group) not in kept for item in tests]
    _deselect(config, items, dropped)


def _source(item) -> str:
    import inspect

    try:
        return inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return ""


def _share_version_launches(config, items):
    text = config.getoption("--versions-share")
    if not text:
        return
    from tests import matrix

    part, parts = matrix.parse_share(text)
    grouped = {}
    for item in items:
        if item.get_closest_marker("torch_versions") is None or item.get_closest_marker("many_ranks") is not None:
            continue
        group = _launch_group(item)
        if group is not None:
            grouped[id(item)] = (Path(str(item.fspath)).name, group)
    taken = matrix.shares("version launches", list(grouped.values()), part, parts)
    dropped = [item for item in items if id(item) in grouped and grouped[id(item)] not in taken]
    _deselect(config, items, dropped)


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", default=False,
        help="run every cell of the fault matrices (tests/matrix.py); without it each run draws a seeded sample",
    )
    parser.addoption(
        "--every", action="store_true", default=False,
        help="every draw the gate can make: every fault-matrix cell, every 4-rank launch, every launch of each file "
        "(launch share 1); the full tier stays out (`make test-every`: what must pass before a change to the tests or "
        "a multi-rank path lands)",
    )
    parser.addoption(
        "--launches-only", action="store_true", default=False,
        help="only the tests that start processes (`make test-repeat`: the gate's launches, repeated under load)",
    )
    parser.addoption(
        "--versions-share", default=None, metavar="K/N",
        help="CI's torch 2.11 / 2.15 legs: this leg's share (1/2, 2/2) of the torch_versions tests' launches, dealt "
        "per file with the run's seed (tests/matrix.shares); --full takes every launch",
    )


    parser.addoption(
        "--launch-share", default="1", metavar="S",
        help="each test file runs a seeded share S (0 < S <= 1) of its launches, at least one; the tests that launch "
        "nothing all run (.ci/run: one of a few fixed steps, .ci/costs.py predict); --full and --every take every launch",
    )


def pytest_configure(config):
    from tests import matrix

    matrix.configure(config)


def pytest_report_header(config):
    from tests import matrix

    return f"automicro: fault matrices {'in full' if matrix.full() else f'sampled, seed {matrix.seed()}'}"


def pytest_runtest_logreport(report):
    from tests import costs, failures

    costs.record(report)
    failures.record(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests import costs, matrix

    line = matrix.summary()
    if line:
        terminalreporter.write_line(line)
    for line in costs.summary_lines():
        terminalreporter.write_line(line)
    from tests import failures

    for line in failures.summary_lines(config):
        terminalreporter.write_line(line)
