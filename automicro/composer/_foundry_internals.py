"""llm-foundry internals automicro relies on, in one place, gated on the one version checked.

llm-foundry 0.22.0 (July 2025, its last release) builds a stock `composer.Trainer` inside
`llmfoundry.command_utils.train.train` from a module-level name `Trainer`; `automicro.foundry`
swaps that name for automicro's Trainer for the length of one `train()` call. Its registries
(`llmfoundry.registry.callbacks`, `.dataloaders`) are public and take automicro's callbacks and
a synthetic-token loader. `stage_hf_exports` makes its `hf_checkpointer` export atomic by
replacing `HuggingFaceCheckpointer._save_checkpoint` on the instance (its `save_dir_format_str` and
`huggingface_folder_name_fstr` are read and, for one call, the first replaced). Owns: the version
gate, the swap, registration, the export's staging. May not touch: automicro's engine or search (it
only hands a Trainer class over).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any, Callable

SUPPORTED_VERSIONS = ("0.22.",)
INSTALL_HINT = "pip install -e '.[foundry]' (llm-foundry==0.22.0; it needs torch 2.7.0, the default environment)"


class FoundryUnavailable(RuntimeError):
    """llm-foundry is missing or a version automicro has not checked."""


def check_llmfoundry() -> str:
    """The installed llm-foundry version; raises `FoundryUnavailable` saying what to install."""
    try:
        import llmfoundry
    except ImportError as error:
        raise FoundryUnavailable(f"automicro.foundry needs llm-foundry: {INSTALL_HINT} ({error})") from error
    version = str(getattr(llmfoundry, "__version__", "unknown"))
    if not version.startswith(SUPPORTED_VERSIONS):
        raise FoundryUnavailable(
            f"automicro.foundry was checked against llm-foundry 0.22.x, this is {version}: {INSTALL_HINT}"
        )
    return version


def _train_module() -> Any:
    # `llmfoundry.command_utils` exports a function named `train` over its submodule's name.
    return importlib.import_module("llmfoundry.command_utils.train")


def train_function() -> Callable[[Any], Any]:
    """llm-foundry's `train(cfg)`: its own train path, registries and data loaders."""
    return _train_module().train


@contextlib.contextmanager
def trainer_class(factory: Callable[..., Any]) -> Iterator[None]:
    """While inside, llm-foundry's train path builds its Trainer with `factory(**kwargs)`."""
    module = _train_module()
    if not hasattr(module, "Trainer"):
        raise FoundryUnavailable("llmfoundry.command_utils.train has no module-level `Trainer` to replace")
    stock = module.Trainer
    module.Trainer = factory
    try:
        yield
    finally:
        module.Trainer = stock


def register(registry_name: str, name: str, obj: Any) -> None:
    """Add `obj` to one of llm-foundry's registries under `name` (once per process)."""
    from llmfoundry import registry

    target = getattr(registry, registry_name)
    if name not in target.get_all():
        target.register(name, func=obj)


__all__ = ["FoundryUnavailable", "INSTALL_HINT", "check_llmfoundry", "register", "train_function", "trainer_class"]


STAGING_FOLDER = ".partial-hf"


def stage_hf_exports(callbacks: Any) -> int:
    """Every llm-foundry `HuggingFaceCheckpointer` among `callbacks` writes its local export under
    `<save_folder>/.partial-hf/` and rank 0 renames the finished folder into place
    (`<save_folder>/huggingface/ba4`), fsynced: the export appears whole or not at all. Exports to
    an object store (llm-foundry uploads from a temporary folder) and those registered to MLflow (a
    background process reads the folder after the call) go through unchanged. Returns how many."""
    from llmfoundry.callbacks import HuggingFaceCheckpointer

    staged = 0
    for callback in callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]:
        if isinstance(callback, HuggingFaceCheckpointer) and not getattr(callback, "_automicro_staged", False):
            _stage(callback)
            staged += 1
    return staged


def _stage(checkpointer: Any) -> None:
    import os
    import shutil

    from composer.utils import dist, format_name_with_dist_and_time

    from automicro.composer.checkpoint_commit import fsync_files, fsync_folder

    original = checkpointer._save_checkpoint

    def _save_checkpoint(state: Any, logger: Any, upload_to_save_folder: bool, register_to_mlflow: bool) -> None:
        if checkpointer.remote_ud is not None or register_to_mlflow or not upload_to_save_folder:
            return original(state, logger, upload_to_save_folder, register_to_mlflow)
        final_root = checkpointer.save_dir_format_str
        staging_root = os.path.join(final_root, STAGING_FOLDER)
        checkpointer.save_dir_format_str = staging_root
        try:
            original(state, logger, upload_to_save_folder, register_to_mlflow)
        finally:
            checkpointer.save_dir_format_str = final_root
        if dist.get_global_rank() != 0:
            return None
        relative = checkpointer.huggingface_folder_name_fstr
        staged = format_name_with_dist_and_time(os.path.join(staging_root, relative), state.run_name, state.timestamp)
        final = format_name_with_dist_and_time(os.path.join(final_root, relative), state.run_name, state.timestamp)
        if os.path.isdir(staged):
            fsync_files(staged)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            if os.path.lexists(final):  # the same batch exported before (a rerun): the new one wins
                shutil.rmtree(final, ignore_errors=True)
            os.rename(staged, final)
            fsync_folder(os.path.dirname(final))
        shutil.rmtree(format_name_with_dist_and_time(staging_root, state.run_name, state.timestamp), ignore_errors=True)
        return None

    checkpointer._save_checkpoint = _save_checkpoint
    checkpointer._automicro_staged = True
