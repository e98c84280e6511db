"""llm-foundry internals automicro relies on, in one place, gated on the one version checked.

llm-foundry 0.22.0 (July 2025, its last release) builds a stock `composer.Trainer` inside
`llmfoundry.command_utils.train.train` from a module-level name `Trainer`; `automicro.foundry`
swaps that name for automicro's Trainer for the length of one `train()` call. Its registries
(`llmfoundry.registry.callbacks`, `.dataloaders`) are public and take automicro's callbacks and
a synthetic-token loader. Owns: the version gate, the swap, registration. May not touch: automicro's
engine or search (it only hands a Trainer class over).
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
