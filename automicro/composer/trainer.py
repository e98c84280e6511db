"""`automicro.Trainer`: Composer's `Trainer` with FSDP2 through the engine and a guarded batch step.

Differences from `composer.Trainer`, all opt-in through arguments Composer already has:
- `parallelism_config={"fsdp2": {...}}` shards the model with `automicro.engine.shard` (the keys
  are `automicro.engine.FSDP2Config` fields) instead of Composer's own FSDP2 path; Composer's own
  `ParallelismConfig` / `FSDP2Config` are carried over where they mean the same thing, or refused
  naming the field (`automicro.composer.composer_config`);
- `device_train_microbatch_size="auto"` works with FSDP2 (Composer refuses it), driven by the
  `AutoMicrobatching` callback (one is added with defaults if none is given); without FSDP it runs
  on one rank (`automicro.engine.unsharded`); evaluators with a pinned size are split after an
  eval OOM (`eval_oom`).
Arguments of its own: `checkpoint_format="full" | "sharded"` (default "full", or what a
Composer `FSDP2Config.state_dict_type` asks for; see
`automicro.composer.checkpointing`); `"sharded"` saves and loads torch.distributed.checkpoint
shards, Composer's `state_dict_type: sharded`. `compile=` (`automicro.engine.CompileConfig`, a
mapping of its keys or True): each sharded block's forward compiled, or Composer's whole-model
`compile_config` with ``scope: model``. `save_failure="continue" | "stop"`: what a checkpoint save
that failed on any rank does (`automicro.composer.checkpoint_commit`: every save is atomic and
agreed, and `autoresume` takes the newest complete checkpoint).
Everything else is passed to Composer unchanged.
"""

from __future__ import annotations

import dataclasses

import logging
from typing import Any, Optional, Union

import composer
import torch
from composer.core import Callback, Evaluator
from composer.devices import Device, DeviceCPU, DeviceGPU
from composer.utils import dist as composer_dist
from torch.distributed.fsdp import register_fsdp_forward_method

from automicro.config.schema import AUTO, auto_eval_problem, check_microbatch_size, pipeline_problem
from automicro.core.sites import SiteDispatcher
from automicro.engine import ShardedModel, ensure_record_stream_free, shard
from automicro.engine.compile import CompileConfig, CompileConfigError
from automicro.engine.unsharded import UnshardedModel, unsharded
from automicro.engine.config import FSDP2Config, FSDP2ConfigError, fsdp2_from_parallelism_config, pipeline_from_parallelism_config
from automicro.engine.pipeline import build_pipeline
from automicro.engine import local_step
from automicro.engine.sharding import apply_expandable_segments
from automicro.engine.twin import TwinError, UnshardedTwin
from automicro.composer import _composer_internals as composer_internals
from automicro.composer.callback import AutoMicrobatching
from automicro.composer.checkpoint_commit import CommittedCheckpoints, check_save_failure
from automicro.composer.checkpointing import FullCheckpointLoading, ShardedCheckpointing, check_checkpoint_format
from automicro.composer.composer_config import from_composer_parallelism
from automicro.batch import one_rank, packed_input, routing
from automicro.batch.head_choice import attach_head_at_set_size
from automicro.composer import head_metrics
from automicro.composer.pipeline_batch import PipelineBatch

log = logging.getLogger(__name__)


def _say(line: str, console: bool = True) -> None:
    """One of the Trainer's own lines: on rank 0's console (where `console`), and to the log on every rank."""
    if console and composer_dist.get_global_rank() == 0:
        print(f"[automicro] {line}", flush=True)
    log.info("automicro: %s", line)


def _composer_device(device: Any) -> Device:
    if device is None:
        return DeviceGPU() if torch.cuda.is_available() else DeviceCPU()
    if isinstance(device, Device):
        return device
    if device == "cpu":
        return DeviceCPU()
    if device == "gpu":
        return DeviceGPU()
    raise ValueError(f"automicro.Trainer: device={device!r}: use 'cpu', 'gpu' or a composer Device")


class _PlacedModelGPU(DeviceGPU):
    """Composer's GPU device for a model sharded with ``cpu_offload: true``. Composer moves the model it is given to
    its device where its own parallelism config is None (as `Trainer` passes it: the engine shards), which would copy
    the shards FSDP2 keeps on the host back to the GPU (FSDP2's first forward then refuses them: "FSDP parameters
    should be materialized on CPU"). The engine placed this model: it is left where it is; every other module
    (metrics) moves as before."""

    def __init__(self, placed: torch.nn.Module) -> None:
        super().__init__()
        self._placed = placed

    def module_to_device(self, module: Any) -> Any:
        return module if module is self._placed else super().module_to_device(module)


def _rebind_optimizers(optimizers: Any, names_before: dict[int, str], model: torch.nn.Module) -> None:
    """`fully_shard` replaces every parameter by a new (DTensor) one: point the optimizers, built on
    the unsharded model, at those (as Composer's own FSDP2 path does); parameter names do not change.
    A pipeline stage keeps only its own parameters: the others leave the optimizer."""
    if optimizers is None:
        return
    after = dict(model.named_parameters())
    for optimizer in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
        if optimizer.state:
            raise ValueError(
                "automicro.Trainer: the optimizer already has state; with FSDP2 pass an optimizer that has "
                "not stepped yet (its parameters are replaced by the sharded ones)"
            )
        for group in optimizer.param_groups:
            group["params"] = [
                after[names_before[id(p)]] if id(p) in names_before else p
                for p in group["params"]
                if id(p) not in names_before or names_before[id(p)] in after
            ]


def _route_eval_forward_through_fsdp(model: Any) -> None:
    """Composer calls `model.eval_forward()` directly, not through `__call__`, so FSDP2's hooks
    would not unshard the root's own parameters (a mixed Tensor/DTensor error in eval).

    Only a real eval forward goes through FSDP2. Composer also calls `eval_forward(batch, outputs)`
    for training metrics, after backward and before the optimizer step: routed through FSDP2, that
    call would unshard the root and leave it unsharded holding pre-step values, which the next
    forward would then use. With `outputs` given no parameter is needed, so it skips FSDP2.
    """
    if not callable(getattr(model, "eval_forward", None)):
        return
    plain = model.eval_forward
    register_fsdp_forward_method(model, "eval_forward")
    through_fsdp = model.eval_forward

    def eval_forward(batch: Any, outputs: Any = None, *args: Any, **kwargs: Any) -> Any:
        if outputs is not None:
            return plain(batch, outputs, *args, **kwargs)
        return through_fsdp(batch, *args, **kwargs)

    model.eval_forward = eval_forward


class _ReshardRootAfterEval(Callback):
    """FSDP2 keeps the root unsharded after a forward; after eval nothing may hold unsharded
    parameters into training (a checkpoint load or any change to the shards would go unseen)."""

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded

    def eval_end(self, state: Any, logger: Any) -> None:
        self.sharded.reshard_root()


def _check_compile_under_token_budget(config: Optional[CompileConfig], composer_compile: Any) -> None:
    """`budget: tokens` gives every microbatch its own shape (rows x padded length). Compiled with
    torch's automatic dynamic shapes (`dynamic: null`, the default) that stays a few graphs (4 over
    32 batches in tests/test_compile.py); with `dynamic: false` every new shape recompiles until
    torch's recompile limit (8), after which the model runs uncompiled: refused, naming the fix."""
    dynamic = config.dynamic if config is not None else (composer_compile or {}).get("dynamic") if isinstance(composer_compile, dict) else None
    if dynamic is False:
        raise ValueError(
            "automicro.Trainer: compile dynamic=false with AutoMicrobatching(budget='tokens'): each microbatch of a token "
            "budget has its own shape (rows x padded length), so static graphs recompile for every new one until torch's "
            "recompile limit, then run uncompiled; set compile.dynamic: null (static at the first shape, dynamic from the "
            "second: a few graphs) or true"
        )


def _evaluators(eval_dataloader: Any) -> list[Evaluator]:
    items = eval_dataloader if isinstance(eval_dataloader, (list, tuple)) else [eval_dataloader]
    return [item for item in items if isinstance(item, Evaluator)]


class Trainer(composer.Trainer):
    """Composer's Trainer, plus FSDP2 through automicro's engine and auto microbatching on it."""

    # `stock_trainer.AUTOMICRO_TRAINER_FLAG`: `refuse_stock_trainer` lets this Trainer through.
    _automicro_runs_the_batch = True

    def __init__(
        self,
        *,
        model: Any,
        parallelism_config: Optional[dict[str, Any]] = None,
        device_train_microbatch_size: Optional[Union[int, str]] = None,
        callbacks: Any = None,
        device: Any = None,
        dist_timeout: float = 300.0,
        checkpoint_format: Optional[str] = None,
        compile: Any = None,
        save_failure: str = "continue",
        **kwargs: Any,
    ) -> None:
        composer_internals.check_supported_composer()
        composer_internals.fill_node_rank_from_torchrun()
        # Composer's own ParallelismConfig / FSDP2Config: carried over where they mean the same.
        parallelism_config, checkpoint_format = from_composer_parallelism(
            parallelism_config, checkpoint_format, precision=kwargs.get("precision"), device=device
        )
        checkpoint_format = "full" if checkpoint_format is None else checkpoint_format
        fsdp2 = fsdp2_from_parallelism_config(parallelism_config)
        pipeline = pipeline_from_parallelism_config(parallelism_config)
        evaluators = _evaluators(kwargs.get("eval_dataloader"))
        # `fsdp2.on_one_rank: unshard`: one rank trains unsharded (`one_rank`); several keep FSDP2.
        choice = one_rank.choose(
            fsdp2, world_size=composer_dist.get_world_size(), pipeline=pipeline is not None, compile=compile,
            checkpoint_format=checkpoint_format, model_on_meta=fsdp2 is not None and _on_meta(model),
            precision=kwargs.get("precision"),
            auto_eval=any(e.auto_microbatching for e in evaluators),
        )
        fsdp2, compile = choice.fsdp2, choice.compile
        if choice.line:
            _say(choice.line)
        if pipeline is not None:
            problem = pipeline_problem(
                eval_interval=kwargs.get("eval_dataloader"), save_folder=kwargs.get("save_folder"),
                load_path=kwargs.get("load_path"), precision=kwargs.get("precision"), sharded=fsdp2 is not None,
                checkpoint_format=checkpoint_format,
            )
            if problem:
                raise ValueError(f"automicro.Trainer: parallelism_config['pipeline'] {problem}")
        if fsdp2 is None and pipeline is None and _on_meta(model):
            raise ValueError(
                "automicro.Trainer: the model's parameters are on the meta device (no memory yet), and without "
                "parallelism_config['fsdp2'] nothing materializes them; build the model on a real device (YAML: "
                "model.init_device: cpu) or pass parallelism_config={'fsdp2': {}}, which materializes it shard by shard"
            )
        compile_config = self._compile_config(compile, fsdp2 is not None, pipeline is not None, kwargs)
        check_checkpoint_format(
            checkpoint_format,
            sharded_model=fsdp2 is not None,
            load_path=kwargs.get("load_path"),
            save_metrics=bool(kwargs.get("save_metrics", False)),
        )
        check_save_failure(save_failure)
        callback_list = list(callbacks) if isinstance(callbacks, (list, tuple)) else ([callbacks] if callbacks else [])
        if isinstance(device_train_microbatch_size, str):  # ints, floats and None are Composer's to check
            check_microbatch_size(device_train_microbatch_size, "device_train_microbatch_size")
        auto = device_train_microbatch_size == AUTO
        automicro = next((c for c in callback_list if isinstance(c, AutoMicrobatching)), None)
        for callback in callback_list:
            if isinstance(callback, AutoMicrobatching):
                callback.bind_trainer()
        if auto and automicro is None:
            automicro = AutoMicrobatching()
            automicro.bind_trainer()
            callback_list.append(automicro)
        idle: Optional[AutoMicrobatching] = None  # configured under a set size: searches nothing, puts head: fused on
        if automicro is not None and not auto:
            log.warning(
                "automicro: AutoMicrobatching is configured but device_train_microbatch_size=%r; the callback stays idle%s",
                device_train_microbatch_size,
                " (its head: fused is put on the model)" if automicro.settings.head == "fused" else "",
            )
            idle, automicro = automicro, None

        if automicro is not None and automicro.tokens is not None:
            _check_compile_under_token_budget(compile_config, kwargs.get("compile_config"))
        # c10d reads this when a process group is created: set it before Composer creates one.
        ensure_record_stream_free()
        composer_device = _composer_device(device)
        if choice.unsharded_from is not None:
            apply_expandable_segments(
                choice.unsharded_from.expandable_segments, composer_device.tensor_to_device(torch.empty(0)).device
            )
        self._automicro_sharded: Optional[ShardedModel] = None
        self._automicro_unsharded: Optional[UnshardedModel] = None
        self._automicro_pipeline: Optional[PipelineBatch] = None
        if auto and fsdp2 is None:
            # One rank without FSDP: Composer's own model placement and autocast; the search runs
            # on an unsharded handle (`automicro.engine.unsharded`).
            composer_dist.initialize_dist(composer_device, dist_timeout)
            if composer_dist.get_world_size() > 1:
                raise FSDP2ConfigError(
                    f"device_train_microbatch_size='auto' without parallelism_config['fsdp2'] runs on one rank only "
                    f"(this job has {composer_dist.get_world_size()}): DDP is not supported with auto; pass "
                    "parallelism_config={'fsdp2': {}} to shard over the ranks"
                )
            self._automicro_unsharded = unsharded(model, composer_device.tensor_to_device(torch.empty(0)).device)
        if fsdp2 is not None:
            composer_dist.initialize_dist(composer_device, dist_timeout)
            names_before = {id(p): n for n, p in model.named_parameters()}
            shard_device = composer_device.tensor_to_device(torch.empty(0)).device
            if pipeline is not None:
                pipe = build_pipeline(model, pipeline, fsdp2, device=shard_device)
                self._automicro_sharded = pipe.sharded
                self._automicro_pipeline = PipelineBatch(pipe, model)
                _rebind_optimizers(kwargs.get("optimizers"), names_before, model)
                if checkpoint_format == "sharded":
                    callback_list.append(ShardedCheckpointing(pipeline=True))
            else:
                # Checkpointing on every block, switched off, under `auto`: the ladder below the floor switches it on
                # where microbatch size 1 runs out without it (`automicro.batch.floor_ladder`), the layout search's
                # upsize trial where it pays (`recompute`). Compiled blocks carry it too (its hooks
                # sit on the block's call, outside the compiled forward); not where the whole model is compiled
                # (`compile.scope: model`, Composer's `compile_config`: checkpointing switched on inside a
                # whole-model graph recomputes other values than the forward saved, torch 2.11 and 2.15).
                whole_model = (compile_config is not None and not compile_config.compiles_blocks) or kwargs.get("compile_config") is not None
                switch = automicro is not None and not whole_model
                if compile_config is not None and compile_config.compiles_blocks:
                    line = packed_input.no_cache_in_training(model)
                    if line is not None:
                        _say(line)
                if fsdp2.cpu_offload and type(composer_device) is DeviceGPU and (device is None or device == "gpu"):
                    composer_device = _PlacedModelGPU(model)
                twin = self._unsharded_twin(model, fsdp2, automicro, shard_device, compile_config, kwargs)
                self._automicro_sharded = shard(
                    model, fsdp2, device=shard_device, compile=compile_config, checkpoint_switch=switch,
                )
                _rebind_optimizers(kwargs.get("optimizers"), names_before, model)
                if twin is not None:
                    twin.bind(model)
                    twin.blocks = tuple(self._automicro_sharded.wrapped_names)
                    self._automicro_sharded.twin = twin
                _route_eval_forward_through_fsdp(model)
                callback_list.append(_ReshardRootAfterEval(self._automicro_sharded))
                callback_list.append(ShardedCheckpointing() if checkpoint_format == "sharded" else FullCheckpointLoading())
        if idle is not None:
            self._head_at_set_size(idle, device_train_microbatch_size, pipeline is not None)
        self._automicro = automicro
        # One attempt context per trainer: the callback fires its sites, the fault injectors
        # (any callback with `attach_sites`) listen there.
        self._automicro_sites = SiteDispatcher()
        for callback in callback_list:
            attach_sites = getattr(callback, "attach_sites", None)
            if callable(attach_sites):
                attach_sites(self._automicro_sites)
        if automicro is not None:
            handle = self._automicro_sharded if self._automicro_sharded is not None else self._automicro_unsharded
            assert handle is not None
            automicro.attach(handle, sites=self._automicro_sites, pipeline=self._automicro_pipeline)

        auto_evaluators = [e for e in evaluators if e.auto_microbatching]
        if auto_evaluators:
            problem = auto_eval_problem(train_auto=automicro is not None, sharded=fsdp2 is not None)
            if problem:
                raise ValueError(f"device_eval_microbatch_size='auto' in automicro.Trainer {problem}")
        # Under a training `auto`, an evaluator with a pinned size is split further after an eval
        # OOM instead of ending the run (eval_oom='split'; llm-foundry pins every evaluator).
        pinned = [] if automicro is None or automicro.eval_oom != "split" else [
            e for e in evaluators if not e.auto_microbatching
        ]
        for evaluator in pinned:
            automicro.pin_eval(evaluator.label, evaluator.device_eval_microbatch_size)
        if auto_evaluators or pinned:
            # Composer only checks that an auto evaluator runs on a GPU; automicro's eval search is
            # device-independent, so the flag is lowered while Composer validates and raised after.
            for evaluator in auto_evaluators:
                evaluator.auto_microbatching = False
            model.eval_forward = automicro.guard_eval_forward(model.eval_forward)
            model.update_metric = automicro.guard_eval_metric(model)

        if kwargs.get("save_folder") is not None or kwargs.get("autoresume"):
            # After ShardedCheckpointing: the format is known at BEFORE_LOAD when this one runs.
            callback_list.append(CommittedCheckpoints(autoresume=bool(kwargs.get("autoresume")), save_failure=save_failure))
        # Passed or not: AutoMicrobatching's loss normalisation decides where it is left out.
        accumulate_on_tokens = kwargs.get("accumulate_train_batch_on_tokens")
        super().__init__(
            model=model,
            parallelism_config=None,
            # None lets Composer take the per-rank batch size; the callback picks the real split.
            device_train_microbatch_size=None if auto else device_train_microbatch_size,
            callbacks=callback_list,
            device=composer_device,
            dist_timeout=dist_timeout,
            **kwargs,
        )
        if fsdp2 is not None:
            # After Composer built its optimizers (or took the caller's) and loaded any checkpoint.
            for optimizer in self.state.optimizers:
                why = local_step.install(optimizer, fsdp2.local_optimizer_step)
                log.info("automicro: the optimizer step of %s %s", local_step.class_name(optimizer),
                         "runs on the local shards" if why is None else f"stays on DTensors: {why}")
        # The flag is what makes Composer's eval loop rerun an eval batch after an OOM.
        for evaluator in auto_evaluators + pinned:
            evaluator.auto_microbatching = True
        if automicro is not None:
            automicro.check_trainer(self, accumulate_on_tokens)
        if self._automicro_pipeline is not None and self._automicro_pipeline.stage_index > 0:
            composer_internals.count_samples_on_first_stage_only(self)
            if callable(getattr(model, "flops_per_batch", None)):
                # SpeedMonitor sums every rank's flops_per_batch; each stage would count the whole
                # model's flops for the same samples: count them once, on the first stage.
                model.flops_per_batch = lambda batch: 0

    def _head_at_set_size(self, idle: AutoMicrobatching, size: Any, pipeline: bool) -> None:
        """A set microbatch size: the idle callback's ``head: fused`` put on the model (`head_choice`), its line on rank 0."""
        sharded = self._automicro_sharded

        def info(line: str) -> None:
            _say(line, console=idle.settings.log_attempts)

        model = None if sharded is None else sharded.module
        switch = attach_head_at_set_size(
            idle.settings, sharded, size, info, pipeline=pipeline,
            logits_needed="" if model is None else head_metrics.logits_needed(model),
            also="" if model is None else head_metrics.from_loss(model),
        )
        if switch is not None:
            head_metrics.install(model, switch)

    @staticmethod
    def _unsharded_twin(model: Any, fsdp2: FSDP2Config, automicro: Optional[AutoMicrobatching], device: torch.device,
                        compile_config: Optional[CompileConfig], kwargs: dict[str, Any]) -> Optional[UnshardedTwin]:
        """Before sharding, on one rank under ``auto``: the model's unsharded twin for `sharding_choice`
        to time against FSDP2 (`one_rank.twin_problem` says where not; the console says why where asked)."""
        why = one_rank.twin_problem(
            fsdp2, world_size=composer_dist.get_world_size(), pipeline=False, auto=automicro is not None,
            device_type=device.type, precision=kwargs.get("precision"), grouped_experts=lambda: routing.grouped_experts(model),
        )
        if why is None:
            compile_kwargs = compile_config.torch_kwargs() if compile_config is not None else kwargs.get("compile_config")
            try:
                scope = "model" if compile_config is None or compile_config.scope == "model" else "blocks"
                return UnshardedTwin.before_sharding(model, compile_kwargs, scope)
            except TwinError as error:
                why = str(error)
        if why:
            _say(f"one rank: FSDP2 kept ({why}); the model unsharded is not timed against it")
        return None

    @staticmethod
    def _compile_config(value: Any, sharded: bool, pipeline: bool, kwargs: dict[str, Any]) -> Optional[CompileConfig]:
        """`compile` (a `CompileConfig`, a mapping of its keys, True or None), checked; with ``scope:
        model`` it becomes Composer's ``compile_config`` in `kwargs`."""
        try:
            config = CompileConfig.from_value(value)
        except CompileConfigError as error:
            raise ValueError(f"automicro.Trainer: {error}") from None
        if config is None:
            return None
        if kwargs.get("compile_config") is not None:
            raise ValueError(
                "automicro.Trainer: compile and compile_config are both set: keep compile (scope: model is "
                "Composer's compile_config; scope: blocks compiles each sharded block)"
            )
        if pipeline:
            raise ValueError("automicro.Trainer: compile with parallelism_config['pipeline'] is not supported yet; set compile=None")
        if config.scope == "blocks" and not sharded:
            raise ValueError(
                "automicro.Trainer: compile scope 'blocks' compiles each block the FSDP2 engine shards and needs "
                "parallelism_config={'fsdp2': {...}}; without FSDP2 use scope 'model'"
            )
        if config.scope is None and not sharded:  # nothing sharded into blocks: the whole model
            config = dataclasses.replace(config, scope="model")
        if config.scope == "model":
            kwargs["compile_config"] = config.torch_kwargs()
        return config

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The engine's handle on the sharded model (None without FSDP2)."""
        return self._automicro_sharded

    @property
    def pipeline(self) -> Optional[PipelineBatch]:
        """This rank's pipeline stage and how batches run through it (None without a pipeline)."""
        return self._automicro_pipeline

    @property
    def checkpoint_format(self) -> str:
        """'sharded' when Composer saves and loads this run's checkpoints as DCP shards, else 'full'."""
        return "sharded" if self.state.fsdp_sharded_state_dict_enabled else "full"

    @property
    def auto_microbatching(self) -> Optional[AutoMicrobatching]:
        return self._automicro

    @property
    def sites(self) -> SiteDispatcher:
        """This trainer's site dispatcher: its attempt context and the listeners at its sites."""
        return self._automicro_sites

    def fit(self, *args: Any, **kwargs: Any) -> None:
        """Composer's `fit`; an out-of-memory error that escapes it from outside any attempt (a
        callback between batches, a checkpoint save, a fixed-size eval) stops every rank naming
        this one (`AutoMicrobatching.fit_raised`) instead of leaving them blocked."""
        try:
            super().fit(*args, **kwargs)
        except BaseException as error:
            if self._automicro is not None:
                lost = self._automicro.fit_raised(self.state, error)
                if lost is not None:
                    raise lost from error
            raise

    def release(self) -> None:
        """`close()`, then let this trainer's model, optimizer and last batch be freed while the
        process goes on (several trainers in one process: sweeps, benchmarks, notebooks).

        Composer keeps a closed trainer's state alive until the process exits (its exit-time
        close is registered with the state and not dropped by `close()`); this drops it, for every
        trainer of the process at once: call it when no other trainer still needs its close at
        exit (`_composer_internals.forget_closed_trainer`)."""
        self.close()
        composer_internals.forget_closed_trainer(self)

    def _train_batch(self, use_grad_scaling: bool) -> dict[str, torch.Tensor]:  # Composer private hook
        if self._automicro is None and self._automicro_pipeline is not None:
            total_loss_dict = self._train_pipeline_batch()
            self.first_train_batch_complete = True
            return total_loss_dict
        if self._automicro is None:
            return super()._train_batch(use_grad_scaling)
        total_loss_dict = self._automicro.train_batch(self)
        # As Composer's own `_train_batch` does; without it Composer warns "No batches were trained".
        self.first_train_batch_complete = True
        return total_loss_dict

    def _train_pipeline_batch(self) -> dict[str, torch.Tensor]:
        """A fixed microbatch size through the pipeline (no search, no attempt fence)."""
        assert self._automicro_pipeline is not None
        pipe = self._automicro_pipeline
        batch = self.state.batch
        batch_size = composer_internals.num_samples(self, batch)
        size = int(self.state.device_train_microbatch_size or batch_size)
        pipe.check_fixed_size(batch_size, size)
        pipe.check_same_samples(batch)
        total_loss_dict: dict[str, torch.Tensor] = {}
        pipe.run(self, pipe.split(batch, [size] * (batch_size // size)), total_loss_dict, end_of_attempt=lambda: None)
        composer_internals.step_optimizers(self)
        return total_loss_dict


def _on_meta(model: Any) -> bool:
    """Whether any parameter of `model` is on the meta device."""
    parameters = getattr(model, "parameters", None)
    return callable(parameters) and any(p.is_meta for p in parameters())
