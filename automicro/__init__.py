"""automicro: OOM-safe `device_train_microbatch_size: auto` for MosaicML Composer on FSDP2.

`Trainer`, `AutoMicrobatching`, `MicrobatchSizeError` and `AutoStep` (the same `auto` for a plain
PyTorch loop, no Composer) are imported on first use, so that
`import automicro.engine` (or a test worker) does not pay for importing Composer.
"""

from typing import Any

__version__ = "0.1.0"

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


__all__ = ["AutoStep", "AutoMicrobatching", "MicrobatchSizeError", "StepResult", "Trainer", "__version__"]
