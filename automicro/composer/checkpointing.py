"""Sharded checkpoints (torch.distributed.checkpoint, "DCP") for models sharded by automicro's engine.

    trainer = automicro.Trainer(
        model=model, parallelism_config={"fsdp2": {}}, checkpoint_format="sharded",
        save_folder="ckpt", save_interval="100ba", ...)
    # ckpt/ep0-ba100/: .metadata, __0_0.distcp, __1_0.distcp, ... (every rank writes its own shards)
    trainer = automicro.Trainer(..., checkpoint_format="sharded", load_path="ckpt/ep0-ba100")

`checkpoint_format="full"` (the default) keeps Composer's full state dicts: rank 0 gathers the
whole model and optimizer and writes one `.pt` file. With `"sharded"` Composer's own sharded path
runs (`composer.utils.checkpoint`): model and optimizer state are saved as DTensor shards, each
rank writing only its own, and the rest of Composer's state (timestamp, schedulers, RNG,
callbacks' `state_dict`, e.g. the microbatch size `AutoMicrobatching` found) goes into the same
DCP checkpoint. The format applies to saving and loading alike, as Composer's `state_dict_type`
does: a sharded checkpoint is loaded with `checkpoint_format="sharded"` and `load_path` set to its
folder.

How it is switched on: `ShardedCheckpointing` (a callback `automicro.Trainer` adds) sets Composer's
sharded switch at `Event.BEFORE_LOAD`; why that point is right is in
`_composer_internals.enable_sharded_checkpoints`.

Callbacks' state. DCP loads *into* a template, the current run's state dict, flattened to keys;
a key the template lacks is not read, one the checkpoint lacks is an error. Callbacks' state
changes shape while training (`AutoMicrobatching`'s search state is `None` before the first batch
and a dict after; its history is a list of dicts), so a fresh run's template cannot match a saved
one. `CallbackStateLoadPlanner` rebuilds the `state.callbacks` part of the template from the
checkpoint's own metadata before loading, so every callback gets back exactly what it saved.
(An empty dict nested inside a callback's state leaves no key in DCP and comes back missing.)

Owns: DCP save/load of engine-sharded models and the checkpoint format check. May not touch:
the search state (the callback's own `state_dict` carries it), FSDP2 internals.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from automicro.config import CHECKPOINT_FORMATS, load_path_problem, sharded_checkpoint_problem
from automicro.config.schema import DCP_METADATA_FILENAME  # noqa: F401 - its old home
from automicro.composer import _composer_internals as composer_internals
_CALLBACKS_PATH = ("state", "callbacks")


def check_checkpoint_format(
    checkpoint_format: Any,
    *,
    sharded_model: bool,
    load_path: Optional[str] = None,
    save_metrics: bool = False,
) -> str:
    """Validate `automicro.Trainer(checkpoint_format=...)` against the other arguments; the
    message names the argument (and the YAML key) to change."""
    if checkpoint_format not in CHECKPOINT_FORMATS or not isinstance(checkpoint_format, str):
        raise ValueError(
            f"automicro.Trainer: checkpoint_format={checkpoint_format!r}: must be one of "
            f"{', '.join(repr(f) for f in CHECKPOINT_FORMATS)} (YAML key `checkpoint_format`)"
        )
    if checkpoint_format == "sharded":
        problem = sharded_checkpoint_problem(sharded=sharded_model)
        if problem:
            raise ValueError(f"automicro.Trainer: checkpoint_format='sharded': {problem}")
        if save_metrics:
            raise ValueError(
                "automicro.Trainer: checkpoint_format='sharded' does not save metrics (Composer shards metric "
                "tensors and cannot load them back); set save_metrics=False or checkpoint_format='full'"
            )
    problem = load_path_problem(load_path, checkpoint_format)
    if problem:
        raise ValueError(f"automicro.Trainer: load_path={load_path!r}: {problem}")
    return checkpoint_format


class ShardedCheckpointing(Callback):
    """Turns on Composer's sharded (DCP) checkpoint path for the engine-sharded model at
    BEFORE_LOAD (added by `automicro.Trainer(checkpoint_format='sharded')`). `pipeline`: each rank
    holds one stage's parameters, so the optimizer state is keyed by parameter name
    (`_composer_internals.key_optimizer_state_by_parameter`)."""

    def __init__(self, pipeline: bool = False) -> None:
        self.pipeline = pipeline

    def before_load(self, state: State, logger: Logger) -> None:
        composer_internals.enable_sharded_checkpoints(state, load_planner_factory=CallbackStateLoadPlanner)
        if self.pipeline:
            composer_internals.key_optimizer_state_by_parameter(state)


class FullCheckpointLoading(Callback):
    """Full (gathered) checkpoints of an optimizer without per-parameter state (plain SGD) load on
    the engine-sharded model (added by `automicro.Trainer` with `checkpoint_format='full'`)."""

    def before_load(self, state: State, logger: Logger) -> None:
        composer_internals.load_stateless_optimizers_directly(state)


class CallbackStateLoadPlanner(DefaultLoadPlanner):
    """Composer's default DCP load, with the template's `state.callbacks` rebuilt from the
    checkpoint's metadata (see the module docstring)."""

    def set_up_planner(
        self, state_dict: Any, metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        if metadata is not None:
            rebuild_callbacks_template(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def rebuild_callbacks_template(state_dict: dict[str, Any], metadata: Metadata) -> None:
    """Replace every callback's entry under `state_dict['state']['callbacks']` by a template with
    exactly the keys the checkpoint holds for it (placeholders that DCP then fills in); a callback
    the checkpoint has nothing for gets `{}` (Composer then calls its `load_state_dict({})`)."""
    callbacks = state_dict.get(_CALLBACKS_PATH[0], {}).get(_CALLBACKS_PATH[1])
    if not isinstance(callbacks, dict):
        return
    saved: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}
    for fqn, path in (metadata.planner_data or {}).items():
        path = tuple(path)
        if len(path) > len(_CALLBACKS_PATH) and path[: len(_CALLBACKS_PATH)] == _CALLBACKS_PATH:
            entry = metadata.state_dict_metadata.get(fqn)
            if entry is not None:
                saved.setdefault(path[len(_CALLBACKS_PATH)], []).append((path[len(_CALLBACKS_PATH) + 1 :], entry))
    for name in list(callbacks):
        entries = saved.get(name, [])
        if len(entries) == 1 and entries[0][0] == ():  # the whole state was one leaf
            callbacks[name] = _placeholder(entries[0][1])
            continue
        template: Any = {}
        for relative, entry in entries:
            template = _set_path(template, relative, _placeholder(entry))
        callbacks[name] = template


def _placeholder(entry: Any) -> Any:
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(entry.size, dtype=entry.properties.dtype)
    return None  # bytes: DCP replaces the value wholesale


def _set_path(container: Any, path: tuple[Any, ...], value: Any) -> Any:
    """Set `value` at `path` (str keys: dicts, int keys: lists) inside `container`; returns it."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        if not isinstance(container, list):
            container = []
        while len(container) <= key:
            container.append(None)
        container[key] = _set_path(container[key], rest, value)
    else:
        if not isinstance(container, dict):
            container = {}
        container[key] = _set_path(container.get(key), rest, value)
    return container


__all__ = [
    "CHECKPOINT_FORMATS",
    "CallbackStateLoadPlanner",
    "FullCheckpointLoading",
    "ShardedCheckpointing",
    "check_checkpoint_format",
    "rebuild_callbacks_template",
]
