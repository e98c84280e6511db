"""Deprecated: the modules that lived here moved (issue 60). Their old paths keep working through
0.1 (removed in 0.2), each with a `DeprecationWarning` that names its new path.

- the batch step every loop shares: `automicro.batch` (`batch_step`, `training_search`, `settings`, ...);
- the Composer integration: `automicro.composer` (`callback`, `trainer`, `checkpoint_commit`, ...);
- the Hugging Face Trainer's transformers internals: `automicro.hf._hf_internals`.

``import automicro.integration.callback`` gives the module `automicro.composer.callback` itself (not
a copy): what is patched on one is patched on the other. Two names changed home inside their
module: `ComposerHost` (now `automicro.composer.composer_host`) and `LossNormalization.apply` /
``ensure_counter`` (now functions of `automicro.composer.loss_counting`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any, Optional, Sequence

_BATCH = (
    "batch_host", "batch_kinds", "batch_step", "compile_scope", "compile_shapes", "flattened", "layout_trials",
    "loss_normalization", "memory_truth", "one_rank", "packed_input", "packing_choice", "runtime", "settings",
    "splitting", "token_budget", "token_split", "torch_host", "training_search", "trial_timing",
)
_COMPOSER = (
    "_composer_internals", "_foundry_internals", "builders", "callback", "checkpoint_commit", "checkpointing",
    "composer_config", "eval_search", "loggers", "pipeline_batch", "stock_trainer", "trainer",
)
# The old module name under this package -> its new full name.
MOVED = {
    **{name: f"automicro.batch.{name}" for name in _BATCH},
    **{name: f"automicro.composer.{name}" for name in _COMPOSER},
    "_hf_internals": "automicro.hf._hf_internals",
}


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as its new module: the import system re-reads ``sys.modules`` after
    `exec_module`, so the module it returns (and binds on this package) is the new one."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return None  # a placeholder; `exec_module` puts the real module in its place

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        warnings.warn(
            f"{old} moved to {self.new}; import it from there (the old path works in automicro 0.1, not in 0.2)",
            DeprecationWarning, stacklevel=2,  # warnings skips importlib's own frames: the importing line
        )
        sys.modules[old] = importlib.import_module(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        prefix = f"{__name__}."
        if not fullname.startswith(prefix) or fullname[len(prefix):] not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(MOVED[fullname[len(prefix):]]))


if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
