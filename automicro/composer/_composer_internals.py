"""Every use of a private Composer API in automicro lives in this module.

Checked on Composer 0.32.1 (with torch 2.7.0, 2.11.0 and 2.15.0; on 2.11 and 2.15 Composer is
installed with --no-deps and needs no shim: it imports and trains unchanged). Another Composer version is refused
when the Trainer is built, with a message, rather than misbehaving inside a batch.

What is private here and why:
- `Trainer._train_batch` is overridden (in `automicro.Trainer`) to run the guarded batch step.
- `Trainer._train_microbatch` runs one microbatch (forward, loss, backward and their events);
  we call it as Composer's own `_train_microbatches` does.
- `_train_microbatches` itself is mirrored by `run_microbatches` below rather than called,
  because the end-of-attempt consensus must come *before* `Event.AFTER_TRAIN_BATCH`: algorithms
  there (gradient clipping) issue collectives that a rank which ran out of memory never reaches.
- `Trainer._train_data_spec`, `_use_grad_scaling`, `_backwards_create_graph`; `DataSpec`'s
  `_get_num_tokens_in_batch` / `_default_get_num_tokens_in_batch` (which token counter is in use).
- `enable_sharded_checkpoints` sets a Composer `FSDP2Config` on `State.fsdp_config` (a public
  setter) at `Event.BEFORE_LOAD`; what is version specific is *when* Composer reads it (see there).
- `load_stateless_optimizers_directly` replaces `State.load_optim_state` on one `State` (see there).
- `forget_closed_trainer` drops `Engine._close` from `atexit` (Composer registers it with the
  trainer's state and never unregisters it on `close()`, so a closed trainer's model and
  optimizer stay alive for the whole process; see there).
- `eval_labels_of_samples` slices `HuggingFaceModel.labels` (set by its `eval_forward`, read by its
  `update_metric` instead of the batch's labels) with the samples of an eval metric update in pieces.
- Checkpoint commits (`automicro.composer.checkpoint_commit`): `install_atomic_checkpoint_writes`
  replaces `composer.utils.checkpoint._write_checkpoint_file` (the full-format writer) and
  `save_checkpoint` (module attributes `CheckpointSaver._save_checkpoint` and `Trainer.save_checkpoint`
  look up at each call), and gives that module a `dist_cp` whose `FileSystemWriter` fires the save
  points; `wrap_checkpoint_save` replaces `CheckpointSaver._save_checkpoint` on one saver instance;
  `forget_failed_checkpoint` / `last_saved_checkpoint` read and edit the saver's
  `all_saved_checkpoints_to_timestamp` / `saved_checkpoints`; `checkpoint_names` reads its
  `folder`, `filename`, `latest_filename` and `State.fsdp_config.sharded_ckpt_prefix_dir`.
- `check_before_composer_trainer` wraps `composer.Trainer.__init__` (the class is public, patching
  its method is not): Composer validates `device_train_microbatch_size` and `parallelism_config`
  before any callback runs, so this is the only point that can speak before its refusals.

Owns: every private Composer access, behind the Composer version check. May not touch: FSDP2,
the consensus; it knows no automicro state beyond the arguments it is handed.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import composer
import torch
from composer.core import Event
from composer.utils import FSDP2Config as ComposerFSDP2Config
from composer.utils import dist, ensure_tuple

CHECKED_COMPOSER_VERSIONS = ("0.32.1",)


def fill_node_rank_from_torchrun() -> None:
    """Composer reads the node rank from NODE_RANK (its own launcher sets it) in autoresume and
    checkpointing; torchrun sets GROUP_RANK instead, so under torchrun `autoresume` failed with
    Composer's MissingEnvironmentError. Copy it over when NODE_RANK is missing."""
    import os

    if "NODE_RANK" not in os.environ and os.environ.get("GROUP_RANK", "").strip():
        os.environ["NODE_RANK"] = os.environ["GROUP_RANK"].strip()


def check_supported_composer() -> None:
    if composer.__version__ not in CHECKED_COMPOSER_VERSIONS:
        raise RuntimeError(
            f"automicro.Trainer was checked on Composer {CHECKED_COMPOSER_VERSIONS}; found "
            f"{composer.__version__}. Install mosaicml==0.32.1."
        )


_TRAINER_INIT_CHECKS: list[Callable[[Any, dict[str, Any]], None]] = []


def check_before_composer_trainer(check: Callable[[Any, dict[str, Any]], None]) -> bool:
    """Run ``check(trainer, kwargs)`` first thing in every `composer.Trainer.__init__` (subclasses
    included), before Composer validates anything; a check raises to refuse. Idempotent per check.

    Why here: Composer 0.32.1's `Trainer.__init__` refuses ``device_train_microbatch_size='auto'``
    (`_is_auto_microbatching`: "Can only use adaptive device_train_microbatch_size on GPU"; then
    "Auto microbatching is not supported outside of FSDP1") long before it builds the `State`, and
    a callback's first event (`Event.INIT`) runs only after the `State` exists. Returns False (and
    installs nothing) on a Composer version this was not checked on; callers then rely on a check
    at `Event.INIT`.
    """
    if composer.__version__ not in CHECKED_COMPOSER_VERSIONS:
        return False
    if check not in _TRAINER_INIT_CHECKS:
        _TRAINER_INIT_CHECKS.append(check)
    trainer_class = composer.Trainer
    if getattr(trainer_class.__init__, "_automicro_checked", False):
        return True
    import functools

    original = trainer_class.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for run_check in list(_TRAINER_INIT_CHECKS):
            run_check(self, kwargs)
        original(self, *args, **kwargs)

    __init__._automicro_checked = True  # type: ignore[attr-defined]
    trainer_class.__init__ = __init__
    return True


def train_data_spec(trainer: Any) -> Any:
    spec = trainer._train_data_spec
    if spec is None:
        raise RuntimeError("automicro: the train data spec is not set; pass train_dataloader")
    return spec


def num_samples(trainer: Any, batch: Any) -> int:
    """Samples in this rank's batch (also on a pipeline stage that reports 0 to Composer)."""
    spec = train_data_spec(trainer)
    return int(getattr(spec, "_automicro_num_samples", spec.get_num_samples_in_batch)(batch))


def counts_padded_tokens(trainer: Any) -> bool:
    """Whether the train data spec counts tokens with Composer's default, which reads the padded
    shape of ``input_ids`` (`DataSpec._default_get_num_tokens_in_batch`)."""
    from composer.core.data_spec import DataSpec

    counter = getattr(train_data_spec(trainer), "_get_num_tokens_in_batch", None)
    return getattr(counter, "__func__", None) is DataSpec._default_get_num_tokens_in_batch


def token_counter(trainer: Any) -> str:
    """Who counts the train data spec's tokens: "default" (Composer's, the padded shape of
    ``input_ids``), "automicro" (`automicro.data`'s counters) or "own" (the user's)."""
    from automicro.data import TokenCounter, count_tokens

    if counts_padded_tokens(trainer):
        return "default"
    counter = getattr(train_data_spec(trainer), "_get_num_tokens_in_batch", None)
    return "automicro" if counter is count_tokens or isinstance(counter, TokenCounter) else "own"


def current_token_counter(trainer: Any) -> Any:
    """The train data spec's token counter; None before there is a train data spec (a train
    dataloader passed to `fit()`)."""
    spec = trainer._train_data_spec
    return None if spec is None else getattr(spec, "_get_num_tokens_in_batch", None)


def set_token_counter(trainer: Any, counter: Callable[[Any], Any]) -> None:
    """The train data spec's `get_num_tokens_in_batch` (what `DataSpec(get_num_tokens_in_batch=...)` sets)."""
    train_data_spec(trainer)._get_num_tokens_in_batch = counter


def uses_default_split(trainer: Any) -> bool:
    from composer.core.data_spec import default_split_batch

    return train_data_spec(trainer).split_batch is default_split_batch


def split_batch_default(trainer: Any, batch: Any, microbatch_size: int) -> list[Any]:
    return list(train_data_spec(trainer).split_batch(batch, microbatch_size))


def use_grad_scaling(trainer: Any) -> bool:
    return trainer._use_grad_scaling(trainer.state.precision, trainer.state.scaler)


def run_microbatches(
    trainer: Any,
    microbatches: Sequence[Any],
    total_loss_dict: dict[str, torch.Tensor],
    before_microbatch: Callable[[int], None],
    end_of_attempt: Callable[[], None],
    all_reduce: Callable[[torch.Tensor], None],
) -> None:
    """Composer 0.32.1's `_train_microbatches`, with `end_of_attempt()` before AFTER_TRAIN_BATCH.

    `all_reduce(tensor)` sums over every rank (the batch-size all-reduce Composer does with
    `dist.all_reduce`; automicro's collective ledger records it). FSDP2 models are never wrapped
    in DDP, so there is no `no_sync` context here.
    """
    state = trainer.state
    spec = train_data_spec(trainer)
    trainer.engine.run_event(Event.BEFORE_TRAIN_BATCH)
    grad_scaling = use_grad_scaling(trainer)
    for optimizer in state.optimizers:
        try:
            optimizer.zero_grad(set_to_none=True)
        except TypeError:
            optimizer.zero_grad()
    if trainer.accumulate_train_batch_on_tokens:
        current_batch_size = sum(spec.get_num_tokens_in_batch(b, token_type="loss_generating") for b in microbatches)
    else:
        current_batch_size = sum(spec.get_num_samples_in_batch(b) for b in microbatches)
    # Every rank contributes by its share of the global batch, as Composer does.
    current_batch_size = state.device.tensor_to_device(torch.tensor(current_batch_size))
    all_reduce(current_batch_size)
    current_batch_size = current_batch_size.item() / dist.get_world_size()

    device_batch = state.batch
    for index, microbatch in enumerate(microbatches):
        before_microbatch(index)
        state.batch = state.device.batch_to_device(microbatch)
        state.batch = spec.microbatch_transforms(state.batch)
        is_final = index + 1 == len(microbatches)
        loss_dict = trainer._train_microbatch(grad_scaling, current_batch_size, is_final)
        for key, value in loss_dict.items():
            loss_key = f"loss/train/{key}"
            if loss_key not in total_loss_dict:
                total_loss_dict[loss_key] = state.device.tensor_to_device(torch.zeros(size=(1,)))
            total_loss_dict[loss_key] += value
    state.batch = device_batch

    end_of_attempt()

    if grad_scaling:
        for optimizer in ensure_tuple(state.optimizers):
            state.scaler.unscale_(optimizer)
    trainer.engine.run_event(Event.AFTER_TRAIN_BATCH)


def swap_model(trainer: Any, module: Any) -> Any:
    """Make `module` the model Composer 0.32.1's `_train_microbatch` calls: `state.model` for the
    forward and `_original_model` for the loss. Returns what it replaced (both), which swaps them back."""
    if isinstance(module, tuple):
        trainer.state.model, trainer._original_model = module
        return None
    previous = (trainer.state.model, trainer._original_model)
    trainer.state.model = trainer._original_model = module
    return previous


def run_pipeline_batch(
    trainer: Any,
    run: Callable[[], None],
    end_of_attempt: Callable[[], None],
) -> None:
    """A batch run by a pipeline schedule (`automicro.composer.pipeline_batch`): Composer's
    batch events and gradient reset around `run()`, with `end_of_attempt()` before
    AFTER_TRAIN_BATCH as in `run_microbatches`. The schedule interleaves the microbatches'
    forwards and backwards across stages, so Composer's per-microbatch events (BEFORE_FORWARD ...
    AFTER_BACKWARD) do not fire; the batch events do."""
    state = trainer.state
    trainer.engine.run_event(Event.BEFORE_TRAIN_BATCH)
    for optimizer in state.optimizers:
        optimizer.zero_grad(set_to_none=True)
    run()
    end_of_attempt()
    trainer.engine.run_event(Event.AFTER_TRAIN_BATCH)


def count_samples_on_first_stage_only(trainer: Any) -> None:
    """The stages of one pipeline run the same samples; Composer sums every rank's sample and token
    counts into its timestamp (and the throughput), so the ranks of later stages count zero."""
    spec = train_data_spec(trainer)
    spec._automicro_num_samples = spec.get_num_samples_in_batch
    spec.get_num_samples_in_batch = lambda batch: 0
    spec.get_num_tokens_in_batch = lambda batch, token_type="total": 0


def checkpoint_folder(state: Any) -> Optional[str]:
    """The local folder Composer's `CheckpointSaver` writes this run's checkpoints to (None
    without one). `CheckpointSaver.folder` is a format string (`{run_name}`); the saver formats it
    the same way when it saves."""
    from composer.callbacks import CheckpointSaver
    from composer.utils import format_name_with_dist

    for callback in state.callbacks:
        if isinstance(callback, CheckpointSaver):
            return format_name_with_dist(callback.folder, state.run_name)
    return None


def checkpoint_saver(state: Any) -> Optional[Any]:
    """Composer's `CheckpointSaver` of this run (None without one)."""
    from composer.callbacks import CheckpointSaver

    return next((c for c in state.callbacks if isinstance(c, CheckpointSaver)), None)


class _DistCheckpointWithWriter:
    """`torch.distributed.checkpoint` as Composer's checkpoint module sees it, with another
    `FileSystemWriter` (every other name is torch's own)."""

    def __init__(self, module: Any, writer_class: type) -> None:
        self._module = module
        self.FileSystemWriter = writer_class

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def install_atomic_checkpoint_writes(
    write_atomically: Callable[..., None], committing_save: Callable[..., Optional[str]], writer_class: type
) -> None:
    """Route Composer 0.32.1's checkpoint writes through automicro's commit protocol, once per
    process: `_write_checkpoint_file(state_dict, filename)` (rank 0's full checkpoint) becomes
    `write_atomically(original, state_dict, filename)`, `save_checkpoint(state, filename, **kw)`
    becomes `committing_save(original, state, filename, **kw)`, and DCP saves use `writer_class`."""
    from composer.utils import checkpoint as composer_checkpoint

    if getattr(composer_checkpoint, "_automicro_commits", False):
        return
    write = composer_checkpoint._write_checkpoint_file
    save = composer_checkpoint.save_checkpoint

    def _write_checkpoint_file(state_dict: dict[str, Any], filename: str) -> None:
        write_atomically(write, state_dict, filename)

    def save_checkpoint(state: Any, filename: str = "ep{epoch}-ba{batch}-rank{rank}", **kwargs: Any) -> Optional[str]:
        return committing_save(save, state, filename, **kwargs)

    save_checkpoint.__doc__ = save.__doc__
    composer_checkpoint._write_checkpoint_file = _write_checkpoint_file
    composer_checkpoint.save_checkpoint = save_checkpoint
    composer_checkpoint.dist_cp = _DistCheckpointWithWriter(composer_checkpoint.dist_cp, writer_class)
    composer_checkpoint._automicro_commits = True


def sharded_save_folder(state: Any, filename: str) -> str:
    """The DCP folder Composer's sharded save of `filename` (a format string) writes to now."""
    from composer.utils import checkpoint as composer_checkpoint

    if not state.fsdp_sharded_state_dict_enabled:
        return ""
    return str(os.path.dirname(composer_checkpoint.get_save_filename(state, filename)))


def wrap_checkpoint_save(saver: Any, handler: Callable[[Callable[[Any, Any], None], Any, Any, Any], None]) -> None:
    """`saver._save_checkpoint(state, logger)` becomes `handler(original, saver, state, logger)`
    (once per saver)."""
    if getattr(saver, "_automicro_wrapped", False):
        return
    original = saver._save_checkpoint

    def _save_checkpoint(state: Any, logger: Any) -> None:
        handler(original, saver, state, logger)

    saver._save_checkpoint = _save_checkpoint
    saver._automicro_wrapped = True


def forget_failed_checkpoint(saver: Any, state: Any) -> None:
    """A save that did not commit: out of the saver's record of saved checkpoints (Composer adds
    the name before it saves)."""
    from composer.utils import checkpoint as composer_checkpoint

    name = composer_checkpoint.get_save_filename(state, saver.filename.format(state, keep_placeholders=True))
    saver.all_saved_checkpoints_to_timestamp.pop(name, None)


def last_saved_checkpoint(saver: Any) -> Optional[str]:
    saved = getattr(saver, "saved_checkpoints", None) or []
    return str(saved[-1]) if saved else None


def checkpoint_names(state: Any, saver: Any) -> Optional[tuple[str, str, str]]:
    """(the save folder, the checkpoint name template relative to it, rank 0's `latest` path), or
    None without a `latest` (autoresume has nothing to read then). The template: the save filename
    (e.g. `ep{epoch}-ba{batch}-rank{rank}.pt`), or for sharded saves the DCP folder Composer makes of
    it (`sharded_ckpt_prefix_dir`, e.g. `ep{epoch}-ba{batch}`)."""
    from composer.utils import format_name_with_dist

    if saver.latest_filename is None:
        return None
    folder = format_name_with_dist(saver.folder, state.run_name)
    template = str(saver.filename.filename)
    if state.fsdp_sharded_state_dict_enabled:
        prefix = getattr(state.fsdp_config, "sharded_ckpt_prefix_dir", None) or "ep{epoch}-ba{batch}"
        template = os.path.join(os.path.dirname(template), prefix)
    latest = os.path.join(folder, format_name_with_dist(str(saver.latest_filename.filename), state.run_name))
    return folder, template, latest


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """Composer's own batch-size all-reduce (no-op without a process group)."""
    dist.all_reduce(tensor, reduce_operation="SUM")


def step_optimizers(trainer: Any) -> None:
    state = trainer.state
    grad_scaling = use_grad_scaling(trainer)
    for optimizer in state.optimizers:
        if grad_scaling:
            state.scaler.step(optimizer)
        else:
            optimizer.step()


def reset_after_failure(trainer: Any, device_batch: Any) -> None:
    """Drop everything a failed attempt left on the Composer state (outputs keep the graph)."""
    state = trainer.state
    state.outputs = None
    state.loss = None
    state.batch = device_batch
    for optimizer in state.optimizers:
        optimizer.zero_grad(set_to_none=True)
    # Train metrics are reset at the start of every attempt (AutoMicrobatching.train_batch).


class _ShardedCheckpointConfig(ComposerFSDP2Config):
    """Composer's FSDP2 config, used only as the switch for Composer's sharded checkpoint path:
    `state_dict_type='sharded'`, plus a DCP load planner (Composer's own FSDP2Config has none)."""

    load_planner_factory: Optional[Callable[[], Any]] = None  # a class attribute, not a dataclass field

    @property
    def load_planner(self) -> Optional[Any]:
        return None if self.load_planner_factory is None else self.load_planner_factory()


def enable_sharded_checkpoints(state: Any, load_planner_factory: Optional[Callable[[], Any]] = None) -> None:
    """Turn on Composer 0.32.1's sharded (torch.distributed.checkpoint) save and load for a model
    that automicro's engine sharded, without Composer sharding it again.

    Composer decides everything about checkpoints from `State.fsdp_sharded_state_dict_enabled`
    (`fsdp_config is not None`, an FSDP/FSDP2 module in the model, `fsdp_config.state_dict_type ==
    'sharded'`) at the time it saves or loads: `checkpoint.load_checkpoint` /
    `load_sharded_checkpoint`, `checkpoint.save_checkpoint` / `get_save_filename`,
    `CheckpointSaver._save_checkpoint` (symlinks, rotation), `State.get_model_state_dict` /
    `get_optim_state_dict` / `load_model_state` / `load_optim_state`. The only place Composer
    acts on `fsdp_config` itself is `Trainer._wrap_model_for_distributed` (it would shard the model
    with `parallelize_composer_model`), which runs right *before* `Event.BEFORE_LOAD`, and the
    checkpoint load runs right after it. So this is called at BEFORE_LOAD: the model is never
    sharded twice, the load (`load_path` or autoresume) already takes the sharded path, and DDP is
    not applied (`fsdp_enabled` is true). Composer's `State.__init__` check that `save_metrics` is
    off with sharded state dicts has run by then, so `automicro.Trainer` repeats it.
    """
    if state.fsdp_config is not None:
        raise RuntimeError(
            "automicro: Composer already has an FSDP config on this run; sharded checkpoints are turned on "
            "by automicro.Trainer(checkpoint_format='sharded') with parallelism_config={'fsdp2': {...}} only"
        )
    with warnings.catch_warnings():
        # "FSDP2 Config/APIs are experimental": this config never shards anything.
        warnings.simplefilter("ignore", UserWarning)
        config = _ShardedCheckpointConfig(state_dict_type="sharded")
    config.load_planner_factory = load_planner_factory
    state.fsdp_config = config


def key_optimizer_state_by_parameter(state: Any) -> None:
    """Sharded checkpoints of a pipeline stage: save and load the optimizer's state keyed by
    parameter name (torch's `flatten_optimizer_state_dict`), hyperparameters included.

    Composer 0.32.1's `State.get_optim_state_dict` / `load_optim_state` keep torch's nested form,
    whose `param_groups` is one list under one key. Every stage has its own parameters there, and
    DCP writes a key that all ranks hold only once, so every stage would load the first stage's
    groups (torch then finds none of its own parameters: `KeyError: 'betas'` at the next step).
    Keyed by name, each stage's entries are its own. Replaces the two methods on this `State`
    instance only (at `Event.BEFORE_LOAD`, before any save or load)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def get_optim_state_dict() -> dict[str, Any]:
        optimizer = ensure_tuple(state.optimizers)[0]
        options = StateDictOptions(full_state_dict=False, cpu_offload=True, flatten_optimizer_state_dict=True)
        return {type(optimizer).__qualname__: get_optimizer_state_dict(state.model, optimizer, options=options)}

    def load_optim_state(state_dict: dict[str, Any], strict: bool = True) -> None:
        saved = state_dict.get("optimizers") or {}
        for optimizer in ensure_tuple(state.optimizers):
            name = type(optimizer).__qualname__
            if name not in saved:
                raise ValueError(f"automicro: the checkpoint holds no {name} optimizer state; resume with the saved optimizer")
            options = StateDictOptions(full_state_dict=False, strict=strict, flatten_optimizer_state_dict=True)
            set_optimizer_state_dict(state.model, optimizer, optim_state_dict=saved[name], options=options)

    state.get_optim_state_dict = get_optim_state_dict
    state.load_optim_state = load_optim_state


def load_stateless_optimizers_directly(state: Any) -> None:
    """Make a full (gathered) checkpoint of an optimizer that keeps no per-parameter state (plain
    SGD without momentum) load on an FSDP2 model.

    Composer 0.32.1's `State.load_optim_state` loads full optimizer state dicts through torch's
    `set_optimizer_state_dict(full_state_dict=True)`, which (torch 2.7 to 2.11) looks for the device
    to scatter on among the optimizer's own state tensors and fails with a bare AssertionError when
    there are none. Where the checkpoint holds no optimizer state either, there is nothing to
    scatter: this run's optimizers get the saved param groups' hyperparameters through their own
    `load_state_dict` (what torch would have done after the scatter), every other case takes
    Composer's path. Called at `Event.BEFORE_LOAD` (the load runs right after it); replaces the
    method on this `State` instance only. Every rank reads the same file, so every rank takes the
    same branch and Composer's collectives stay matched.
    """
    composer_load = state.load_optim_state

    def load_optim_state(state_dict: dict[str, Any], strict: bool = True) -> None:
        serialized = state_dict.get("optimizers")
        optimizers = list(ensure_tuple(state.optimizers))
        saved = [serialized.get(type(o).__qualname__) if isinstance(serialized, dict) else None for o in optimizers]
        stateless = bool(optimizers) and all(isinstance(s, dict) and not s.get("state") for s in saved)
        if state.fsdp_sharded_state_dict_enabled or not stateless:
            composer_load(state_dict, strict)
            return
        for optimizer, saved_optimizer in zip(optimizers, saved):
            _load_param_groups(optimizer, saved_optimizer)

    state.load_optim_state = load_optim_state


def _load_param_groups(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    groups = saved.get("param_groups") or []
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"automicro: the checkpoint's {type(optimizer).__name__} has {len(groups)} param group(s), this run's "
            f"has {len(optimizer.param_groups)}; build the optimizer with the same param groups as the saved run"
        )
    loadable, first = [], 0
    for index, (group, local) in enumerate(zip(groups, optimizer.param_groups)):
        count = len(local["params"])
        if len(group.get("params", [])) != count:
            raise ValueError(
                f"automicro: param group {index} of the checkpoint's {type(optimizer).__name__} has "
                f"{len(group.get('params', []))} parameter(s), this run's has {count}; resume the same model"
            )
        loadable.append({**group, "params": list(range(first, first + count))})
        first += count
    optimizer.load_state_dict({"state": {}, "param_groups": loadable})


def set_eval_retry_size(evaluator: Any, size: int) -> None:
    """Make Composer's eval loop rerun the failed batch split by `size`.

    Composer 0.32.1's `_eval_loop`, after an OOM on any rank of an auto-microbatching evaluator,
    calls `_adjust_device_eval_microbatch_size`, which sets `max(int(size / 2), 1)` and refuses
    to go on from 1. Setting twice the wanted size first makes that halving land on it.
    """
    if size < 1:
        raise ValueError(f"eval microbatch size {size}: must be >= 1")
    evaluator.device_eval_microbatch_size = 2 * size


@contextlib.contextmanager
def eval_labels_of_samples(model: Any, start: int, stop: int, total: int) -> Iterator[None]:
    """While inside, `model.labels` holds samples start..stop of the eval microbatch of `total`.

    Composer 0.32.1's `HuggingFaceModel.eval_forward` keeps the microbatch's (shifted) labels on the
    model, and its `update_metric` scores the outputs against `self.labels`, not the batch's: a
    metric update over part of the microbatch needs the same part of them. Other models keep no
    labels there (nothing is changed)."""
    labels = getattr(model, "labels", None)
    if not (isinstance(labels, torch.Tensor) and labels.dim() and labels.shape[0] == total):
        yield
        return
    model.labels = labels[start:stop]
    try:
        yield
    finally:
        model.labels = labels


def forget_closed_trainer(trainer: Any) -> None:
    """Let a closed trainer's model, optimizer and last batch be freed while the process goes on
    (many trainers in one process: benchmarks, sweeps).

    Composer's `Engine` registers `atexit.register(Engine._close, state, logger)` and `close()`
    does not unregister it, so `state` stays referenced until the process exits. `Engine._close`
    is a static method: unregistering it drops the registration of *every* engine of the process
    (as Composer's own `Engine.__del__` does), so call this only once no other trainer still
    needs its close at exit. The last outputs carry FSDP2's pre-backward hooks and an autograd
    graph held from C++ (a cycle the garbage collector cannot see through): cut too."""
    import atexit

    from composer.core.engine import Engine

    if not trainer.engine._is_closed:
        raise RuntimeError("automicro: forget_closed_trainer needs trainer.close() first")
    trainer.state.outputs = None
    trainer.state.loss = None
    trainer.state.batch = None
    atexit.unregister(Engine._close)


def add_to_cross_entropy(metric: Any, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
    """Add a microbatch's summed loss and its loss tokens to Composer's `LanguageCrossEntropy` (or its subclass
    `LanguagePerplexity`) as its `update` would from the logits: its `sum_loss` and `total_items` states (Composer
    0.32.1's names) take them, on the metric's device."""
    metric.sum_loss += loss_sum.detach().to(device=metric.sum_loss.device, dtype=metric.sum_loss.dtype)
    metric.total_items += count.detach().to(device=metric.total_items.device, dtype=metric.total_items.dtype)
