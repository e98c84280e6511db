"""A callback that needs `automicro.Trainer`, given to Composer's own `Trainer`: refused first.

`AutoMicrobatching` only works inside `automicro.Trainer` (its guarded batch step runs every
attempt). Given to a stock `composer.Trainer`, Composer's own checks would speak first -- "Can only
use adaptive device_train_microbatch_size on GPU" on CPU, "Auto microbatching is not supported
outside of FSDP1" on GPU with FSDP2 -- or, with a fixed size, the callback would do nothing,
silently. `refuse_stock_trainer` runs first thing in every `composer.Trainer.__init__` (installed by
`_composer_internals.check_before_composer_trainer` when the first such callback is built) and
raises `StockTrainerError` naming the fix; `AutoMicrobatching` repeats the check at `Event.INIT`
where that early point is not available (a Composer version it was not checked on).

Owns: the refusal and its message. May not touch: Composer internals (the hook point lives in
`_composer_internals`), the callback's state.
"""

from __future__ import annotations

from typing import Any

from composer.utils import ensure_tuple

# Set on `automicro.Trainer` (the class): its `__init__` binds the callbacks before Composer's runs.
AUTOMICRO_TRAINER_FLAG = "_automicro_runs_the_batch"
# Set on a callback instance (class attribute True) that works only inside `automicro.Trainer`.
NEEDS_AUTOMICRO_TRAINER = "needs_automicro_trainer"


class StockTrainerError(ValueError):
    """A callback that needs `automicro.Trainer` was given to another Composer `Trainer`."""


def trainer_name(trainer_class: type) -> str:
    name = f"{trainer_class.__module__}.{trainer_class.__qualname__}"
    return "composer.Trainer" if name == "composer.trainer.trainer.Trainer" else name


def stock_trainer_message(callback_name: str, trainer_name: str, microbatch_size: Any) -> str:
    fix = (
        "replace `from composer import Trainer` with `from automicro import Trainer` (the same arguments; "
        "parallelism_config={'fsdp2': {}} shards the model with FSDP2, which the search needs)"
    )
    if microbatch_size == "auto":
        return (
            f"automicro: {callback_name} needs automicro's Trainer: {trainer_name} runs its own batch step, which "
            "cannot run the search (it refuses device_train_microbatch_size='auto' on CPU, and outside FSDP1 on "
            f"GPU); {fix}"
        )
    return (
        f"automicro: {callback_name} needs automicro's Trainer: with device_train_microbatch_size="
        f"{microbatch_size!r} on {trainer_name} it would do nothing. For the search, set "
        f"device_train_microbatch_size='auto' and {fix}; to keep the fixed size, remove {callback_name} from callbacks"
    )


def refuse_stock_trainer(trainer: Any, kwargs: dict[str, Any]) -> None:
    """Raise `StockTrainerError` when a Trainer other than `automicro.Trainer` is built with a
    callback that needs it (checked before Composer validates anything)."""
    if getattr(type(trainer), AUTOMICRO_TRAINER_FLAG, False):
        return
    for callback in ensure_tuple(kwargs.get("callbacks")):
        if getattr(callback, NEEDS_AUTOMICRO_TRAINER, False):
            raise StockTrainerError(
                stock_trainer_message(type(callback).__name__, trainer_name(type(trainer)), kwargs.get("device_train_microbatch_size"))
            )


__all__ = ["AUTOMICRO_TRAINER_FLAG", "NEEDS_AUTOMICRO_TRAINER", "StockTrainerError", "refuse_stock_trainer", "stock_trainer_message"]
