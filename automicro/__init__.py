"""automicro: OOM-safe `device_train_microbatch_size: auto` for MosaicML Composer on FSDP2.

`Trainer`, `AutoMicrobatching`, `MicrobatchSizeError` and `AutoStep` (the same `auto` for a plain
PyTorch loop, no Composer) are imported on first use, so that
`import automicro.engine` (or a test worker) does not pay for importing Composer.
"""

from typing import Any, Optional

__version__ = "0.1.0"


def bound_exit(timeout_s: float = 30.0, rank: Optional[int] = None) -> None:
    """Call at the end of a training script, after its last line: once the script returns, the process gets
    `timeout_s` to exit; still alive then (something at exit holds it, such as torch inductor's compile-worker
    shutdown after a cold start, pytorch/pytorch#162199), what holds it is written (every thread's stack) and the
    process ends with exit code 0. `automicro.train` and `automicro.foundry` do it themselves."""
    from automicro.core import exit_watch

    exit_watch.arm_finished(timeout_s, rank)

_LAZY = {
    "AutoStep": "automicro.step",
    "StepResult": "automicro.step",
    "AutoMicrobatching": "automicro.composer.callback",
    "MicrobatchSizeError": "automicro.batch.training_search",
    "Trainer": "automicro.composer.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'automicro' has no attribute {name!r}")


__all__ = ["AutoStep", "AutoMicrobatching", "MicrobatchSizeError", "StepResult", "Trainer", "__version__", "bound_exit"]
