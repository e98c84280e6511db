"""The host offload (`automicro.engine.offload`, ``offload: auto``: `automicro.batch.host_offload`): switched on
between batches it gives every number of the run built with FSDP2's CPU offload and of the run without it, the
parameters the same objects; refused mid-step; the ladder's last rung, its words, its checkpoint state and resume; the
config errors. One 2-rank CPU launch (gloo) under `run_multiprocess`'s hang watchdog, cases in tests/offload_cases.py;
on every torch (the switch reaches FSDP2's privates through `_torch_internals`)."""

from __future__ import annotations

import pytest

from automicro.testing.multiprocess import run_multiprocess
from tests import offload_cases as cases

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def two_ranks():
    return run_multiprocess(cases.everything, world_size=2, timeout_s=600)


@pytest.mark.parametrize("optimizer", ["adamw", "decoupled_adamw"])
def test_switched_on_mid_run_every_parameter_is_the_run_built_with_the_offload_and_the_run_without(two_ranks, optimizer):
    for out in two_ranks:
        row = out[optimizer]
        assert row["trained"] > 1e-3, row  # the steps moved the parameters
        # The same shards, reductions and optimizer math: equal (CPU, fp32), well inside 1e-5.
        assert row["switched_vs_built"] <= 1e-6 and row["switched_vs_engine"] <= 1e-6, row
        assert row["same_objects"], "the optimizer's and the module's parameters must stay the same objects"
        switch = row["switch"]
        assert switch["before"] is False and switch["after"] is True, switch
        # Padded shards (FSDP2 pads each to an equal size over the ranks): at least every parameter byte of the rank.
        assert switch["param_bytes"] <= switch["moved_params"] < 2 * switch["param_bytes"] and switch["again_params"] == 0, switch
        assert switch["states_dtensor"] and switch["config_offload"] is True and switch["compute_stream_buffers"] is False
        if optimizer == "decoupled_adamw":
            assert row["local_step"] is None, row["local_step"]  # installed: the local step over host shards


@pytest.mark.parametrize("optimizer", ["adamw", "decoupled_adamw"])
def test_taken_after_a_batch_that_trained_it_is_switched_on_before_the_next_one_with_the_same_numbers(two_ranks, optimizer):
    """Size 1 ran, but its peak with the optimizer state the step added does not fit, and the host offload is the rung
    left: taken between batches (no OOM spent), the step's gradients left to what runs at the batch's end, switched on
    before the next batch with them dropped; every parameter then is the run built with the offload's."""
    for out in two_ranks:
        row = out[optimizer]
        assert row["projected_vs_built"] <= 1e-6, row
        taken = row["projected"]
        assert taken["line"].startswith(
            "host offload on: size 1 ran with what the blocks recompute, but its peak with the optimizer state the first "
            "step added does not fit (rank 0: peak 1.5 MiB with it, capacity 1.0 MiB); FSDP2's CPU offload of the sharded "
            "parameters, their gradients and the optimizer state switched on before batch 3, the size searched again "
            "from batch 3 ("), taken["line"]
        assert taken["last"] == "the host offload on" and taken["left"] == "the model has no FSDP2 blocks to checkpoint"
        # Nothing moved at the batch's end: its gradients still there for what reads them.
        assert taken["on_at_step"] is False and taken["offloaded_at_step"] is False and taken["grads_held_at_step"] > 0, taken
        assert taken["state"] == {"on": True}, taken  # a checkpoint taken now resumes with it on
        assert taken["summary"] == "ladder: the host offload on (size 1 did not fit without it)", taken
        assert taken["on"] is True and taken["offloaded"] is True and taken["grads_after"] == 0, taken
        assert taken["lines"][-1].startswith("host offload: switched on before batch 3; ") and taken["lines"][-1].endswith(
            "moved to the host on this rank (the last batch's gradients, stepped already, dropped first)"), taken["lines"]


def test_the_local_steps_state_over_a_host_parameter_keeps_its_local_tensor(two_ranks):
    for out in two_ranks:
        assert out["dtensor_like"] == {"same_local": True, "placements": True, "shape": True, "dtype": True}


def test_a_module_mid_step_is_refused_and_switched_after_recovery(two_ranks):
    for out in two_ranks:
        assert "between batches" in out["mid_step"]["refused"], out["mid_step"]
        assert out["mid_step"]["after_recover"]


def test_the_ladders_last_rung_switches_it_on_says_so_is_checkpointed_and_resumes(two_ranks):
    for rank, out in enumerate(two_ranks):
        ladder = out["ladder"]
        assert ladder["left_before"] is None and ladder["stepped"] and ladder["last"] == "the host offload on", ladder
        assert ladder["line"].startswith("host offload on: size 1 did not fit with what the blocks recompute (rank 0 at "
                                         "forward: peak 1.0 MiB of 1.0 MiB); FSDP2's CPU offload"), ladder["line"]
        assert "the size searched again in batch 0" in ladder["line"], ladder["line"]
        assert ladder["left_after"] == "the model has no FSDP2 blocks to checkpoint" and ladder["again"] is None, ladder
        assert ladder["tried"].startswith(" with the host offload on (switched on by auto at batch 0"), ladder["tried"]
        assert ladder["summary"] == "ladder: the host offload on (size 1 did not fit without it)", ladder["summary"]
        assert ladder["state"] == {"on": True} and ladder["metrics"] == {"automicro/host_offload": 1}
        assert ladder["unasked_why"] == "the model has no FSDP2 blocks to checkpoint", ladder["unasked_why"]
        assert ladder["unasked_words"] == "", ladder["unasked_words"]  # a CPU job: offload: auto is not for it
        assert ladder["resumed"] == {"on": True, "offloaded": True}, ladder["resumed"]
        assert any(line.startswith("resumed with the host offload on") for line in ladder["lines"]), ladder["lines"]


def test_offload_auto_is_refused_off_a_gpu_in_a_pipeline_and_for_an_unknown_value(two_ranks):
    errors = two_ranks[0]["errors"]
    assert "this job runs on cpu, where there is nothing to offload: drop offload" in errors["cpu"], errors
    assert "pipeline stage" in errors["pipeline"] and "cpu_offload: true" in errors["pipeline"], errors
    assert errors["value"].startswith("offload='on': must be left out or 'off'"), errors
