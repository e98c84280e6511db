"""The optimizer step on local shards (`automicro.engine.local_step`): the same numbers as the
DTensor step wherever it is installed, installed only where that holds, and nothing left swapped
after a step that raised. CPU ranks (gloo), each launch under the multiprocess watchdog."""

from __future__ import annotations

import pytest
import torch

from automicro.engine import FSDP2Config, FSDP2ConfigError
from automicro.testing.multiprocess import run_multiprocess
from tests import local_step_cases as cases


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "two_ranks"])
def launched(request):
    world = request.param
    return world, run_multiprocess(cases.everything, world_size=world, timeout_s=600)


def test_installed_where_the_numbers_are_the_same_and_they_are(launched):
    world, ranks = launched
    for out in ranks:
        for name, row in out["compare"].items():
            elementwise = name != "adagrad"
            assert row["installed"] == (world == 1 or elementwise), (world, name, row["why"])
            if not row["installed"]:
                assert "adagrad" in row["why"].lower() and "element-wise" in row["why"], row["why"]
            # The local step runs the same kernels on the same numbers: bit for bit.
            assert row["param_diff"] == 0.0 and row["state_diff"] == 0.0, (world, name, row)
            assert row["moved"] > 1e-4, (name, row)  # the steps did change the parameters
            assert row["groups_are_dtensors"] and row["state_dict_keys_equal"], (name, row)
            for key, local_type, dtensor_type in row["kinds"]:
                assert local_type == dtensor_type, (name, key, local_type, dtensor_type)


def test_a_step_that_raises_leaves_the_dtensors_in_place_and_the_next_step_runs(launched):
    for out in launched[1]:
        assert out["failing"] == {"raised": True, "restored": True, "states_dtensor": True, "grads_dropped": True}


def test_required_where_it_would_change_the_numbers_is_refused_naming_the_fix(launched):
    world, ranks = launched
    for out in ranks:
        message = out["required"]
        if world == 1:
            assert message == "installed"  # one rank: any optimizer
        else:
            assert "local_optimizer_step=true" in message and "Adagrad" in message and "null" in message and "false" in message


def test_the_trainer_installs_it_by_default_and_the_pin_turns_it_off_with_the_same_parameters(launched):
    world, ranks = launched
    assert [r["trainer_on"]["installed"] for r in ranks] == [True] * world
    assert [r["trainer_off"]["installed"] for r in ranks] == [False] * world
    on, off = ranks[0]["trainer_on"]["params"], ranks[0]["trainer_off"]["params"]
    assert on.keys() == off.keys() and on
    for name, value in on.items():
        assert torch.equal(value, off[name]), name


def test_the_setting_takes_null_true_or_false():
    assert FSDP2Config().local_optimizer_step is None
    assert FSDP2Config(local_optimizer_step=False).local_optimizer_step is False
    with pytest.raises(FSDP2ConfigError, match=r"local_optimizer_step='yes': must be true, false or null"):
        FSDP2Config(local_optimizer_step="yes")
