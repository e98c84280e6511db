"""What a user sees first when they reach automicro from where Composer users already are (issue 14):
a stock `composer.Trainer` with `AutoMicrobatching`, Composer's own FSDP2 / parallelism configs,
and the inputs that used to end in raw tracebacks. Each case asserts automicro's message, naming
what to change; none depends on timing."""

from __future__ import annotations

import warnings

import composer
import pytest
import torch

import automicro
from automicro import AutoMicrobatching
from automicro.integration import _composer_internals
from automicro.integration.stock_trainer import StockTrainerError
from tests.toy_models import ComposerStack, make_data

FIX = "replace `from composer import Trainer` with `from automicro import Trainer`"


def _loader():
    return torch.utils.data.DataLoader(make_data(2, 4), batch_size=None)


def _stock_trainer(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return composer.Trainer(model=ComposerStack(), train_dataloader=_loader(), max_duration="1ba", **kwargs)


# ------------------------------------------------------------------------------------------
# Item 3: stock composer.Trainer + AutoMicrobatching
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, composer_own_refusal",
    [
        # CPU: Composer's `_is_auto_microbatching` refuses 'auto' off GPU before anything else.
        pytest.param({"device": "cpu", "device_train_microbatch_size": "auto"}, "adaptive", id="auto-cpu"),
        # GPU: with FSDP2 Composer refuses 'auto' outside FSDP1. Checked before Composer builds the
        # device, so it runs here without a GPU just as it would on one.
        pytest.param(
            {"device": "gpu", "device_train_microbatch_size": "auto", "parallelism_config": {"fsdp2": {}}},
            "FSDP1",
            id="auto-gpu-fsdp2",
        ),
        # Fixed size: Composer accepts it and the callback would do nothing, silently.
        pytest.param({"device": "cpu", "device_train_microbatch_size": 2}, None, id="fixed-cpu"),
    ],
)
def test_stock_composer_trainer_with_the_callback_is_refused_first_naming_the_fix(kwargs, composer_own_refusal):
    with pytest.raises(StockTrainerError) as info:
        _stock_trainer(callbacks=[AutoMicrobatching(log_attempts=False)], **kwargs)
    message = str(info.value)
    assert FIX in message, message
    assert "AutoMicrobatching needs automicro's Trainer" in message
    if composer_own_refusal is None:
        assert "device_train_microbatch_size=2" in message and "remove AutoMicrobatching from callbacks" in message
    else:
        assert composer_own_refusal not in message.split("(")[0]  # automicro's words, not Composer's


def test_stock_composer_trainer_without_the_callback_is_left_alone():
    trainer = _stock_trainer(device="cpu", device_train_microbatch_size=2, loggers=[], progress_bar=False)
    trainer.close()


def test_automicro_trainer_with_a_fixed_size_keeps_the_callback_idle_not_refused():
    callback = AutoMicrobatching(log_attempts=False)
    trainer = automicro.Trainer(
        model=ComposerStack(), train_dataloader=_loader(), max_duration="1ba", device="cpu",
        device_train_microbatch_size=2, callbacks=[callback], loggers=[], progress_bar=False,
    )
    assert trainer.auto_microbatching is None
    trainer.close()


def test_without_the_early_check_the_callback_refuses_the_stock_trainer_at_init(monkeypatch):
    """The fallback where the check before Composer's cannot be installed (another Composer version)."""
    monkeypatch.setattr(_composer_internals, "_TRAINER_INIT_CHECKS", [])
    with pytest.raises(StockTrainerError, match="remove AutoMicrobatching from callbacks"):
        _stock_trainer(device="cpu", device_train_microbatch_size=2, callbacks=[AutoMicrobatching(log_attempts=False)])
