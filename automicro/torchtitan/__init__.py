"""torchtitan's own `Trainer` with ``training.local_batch_size`` found by automicro's `auto`.

::

    # before: torchrun --nproc_per_node 8 -m torchtitan.train --module llama3 --config llama3_8b
    torchrun --nproc_per_node 8 -m automicro.torchtitan --module llama3 --config llama3_8b \\
        --training.local_batch_size auto

One key changes; the rest of the run is torchtitan's: its config registry and CLI, model zoo, data
loader, LR schedule, DCP checkpoints, metrics (tensorboard, wandb), validation and launcher.

What ``auto`` means. The samples each rank trains in one optimizer step stay what the config says:
``training.global_batch_size / data-parallel degree`` where the global batch is set, else the
config's own ``local_batch_size`` (torchtitan's default then: one microbatch a step). torchtitan's
data loader hands each rank that whole batch once a step; `automicro.AutoStep` splits it into the
largest microbatches that fit (searching with the sync hooks on, every rank agreeing, an OOM retried
smaller on every rank, steady-state recovery once the hooks are off) and runs each through
torchtitan's own ``forward_backward_step``. torchtitan's loss normalisation is kept: the global batch's
valid tokens are counted once a step and every microbatch's summed loss is divided by them, so the
gradients are those of a fixed ``local_batch_size`` at the same split. Clipping, the optimizer and LR
steps, logging (``automicro/*`` keys beside torchtitan's), checkpoints and validation are torchtitan's.

Settings: ``--automicro.<setting> <value>`` (`AutoMicrobatching`'s, docs/reference/configuration.md,
less the eval ones), e.g. ``--automicro.stable_batches 4``.

Where torchtitan and ``auto`` disagree (`refusals`): pipeline parallel (its microbatches are the
schedule's), context, tensor and expert parallel, DDP without sharding, quantized linears (float8,
MXFP8, NVFP4) are refused at start with what to set; CUDA graphs are turned off (a graph is
captured for one microbatch shape, which the search changes); a compiled model and loss run (each
block's forward compiled, the hooks eager around it; each new microbatch shape compiles once).

Owns: torchtitan's side of the seam (arguments, the step, checkpoint state, metrics, validation's
batch). May not touch: the search and the batch's attempts (`AutoStep`); torchtitan privates outside
`torchtitan/_torchtitan_internals`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

try:
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.components.validate import BaseValidator
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "automicro.torchtitan needs torchtitan 0.3.0 on torch >= 2.12: pip install 'automicro[torchtitan]'"
    ) from error

from automicro.core import exit_watch
from automicro.engine import _torch_internals as torch_internals
from automicro.step import SETTINGS, AutoStep, StepResult
from automicro.torchtitan import _torchtitan_internals as internals

log = logging.getLogger(__name__)

AUTO = "auto"
BATCH_KEY = "--training.local_batch_size"
SETTING_PREFIX = "--automicro."
LABELS = "_automicro_labels"  # the labels' key in the batch mapping AutoStep splits
STATE_KEY = "automicro"  # the search's state in torchtitan's train_state (DCP)
# AutoStep's keywords an `AutoTrainer` takes besides the settings (tests: memory sources, fault sites).
STEP_KEYWORDS = ("memory", "sites")


class TorchtitanConfigError(ValueError):
    """A torchtitan config `auto` cannot run (the message says what to set instead)."""


def refusals(config: Any) -> list[str]:
    """Why `config` cannot run with ``local_batch_size: auto``: one line each, with what to set."""
    p, out = config.parallelism, []
    if p.pipeline_parallel_degree > 1:
        out.append(
            f"parallelism.pipeline_parallel_degree {p.pipeline_parallel_degree}: under pipeline parallel the microbatches "
            "are the schedule's (pipeline_parallel_microbatch_size); set training.local_batch_size by hand, or use "
            "automicro's pipeline with Composer (docs/guides/pipeline.md)"
        )
    if p.context_parallel_degree > 1:
        out.append(
            f"parallelism.context_parallel_degree {p.context_parallel_degree}: context parallel shards each sample's "
            "sequence over ranks, which auto has not been tested with; set training.local_batch_size by hand"
        )
    if p.tensor_parallel_degree > 1:
        out.append(
            f"parallelism.tensor_parallel_degree {p.tensor_parallel_degree}: auto guards FSDP2's collectives, not "
            "tensor parallel's; set training.local_batch_size by hand"
        )
    if p.expert_parallel_degree > 1:
        out.append(
            f"parallelism.expert_parallel_degree {p.expert_parallel_degree}: expert parallel's token dispatch is not "
            "guarded by auto; set training.local_batch_size by hand"
        )
    if p.data_parallel_replicate_degree > 1 and p.data_parallel_shard_degree == 1:
        out.append(
            f"parallelism.data_parallel_replicate_degree {p.data_parallel_replicate_degree} with "
            "data_parallel_shard_degree 1 is DDP; auto guards FSDP2: set data_parallel_shard_degree to -1 (or > 1)"
        )
    if config.model_spec is not None and internals.converters(config.model_spec.model):
        out.append(
            "a quantized model (float8, MXFP8 or NVFP4 linears): auto has not been measured with them; use a config "
            "without converters, or set training.local_batch_size by hand"
        )
    if config.training.enable_cpu_offload:
        out.append(
            "training.enable_cpu_offload: auto measures device memory, which offloading moves to the host; set "
            "--training.no-enable_cpu_offload, or set training.local_batch_size by hand"
        )
    return out


def per_rank_batch(config: Any, world_size: int) -> tuple[int, str]:
    """The samples each rank trains in one step under `auto`, and where that number came from."""
    configured, global_batch = int(config.training.local_batch_size), int(config.training.global_batch_size)
    if global_batch > 0:
        if global_batch % world_size:
            raise TorchtitanConfigError(
                f"training.global_batch_size {global_batch} is not a multiple of the data-parallel degree {world_size}: "
                f"set it to a multiple of {world_size}"
            )
        return global_batch // world_size, f"training.global_batch_size {global_batch} / {world_size} ranks"
    if configured < 1:
        raise TorchtitanConfigError(
            f"training.local_batch_size {configured} in the config: with auto and no training.global_batch_size, the "
            "config's local_batch_size is each rank's batch of a step; set training.global_batch_size"
        )
    return configured, f"the config's local_batch_size {configured} (no training.global_batch_size)"


def split_arguments(argv: Sequence[str]) -> tuple[list[str], bool, dict[str, Any]]:
    """torchtitan's arguments without ``--training.local_batch_size auto`` and ``--automicro.*``; whether
    `auto` was asked; the settings (each value read as JSON where it parses: numbers, true/false, null)."""
    rest: list[str] = []
    auto = False
    settings: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=")
        takes_next = not eq and i + 1 < len(args) and not args[i + 1].startswith("--")
        if key == BATCH_KEY:
            value = value if eq else (args[i + 1] if takes_next else "")
            if value == AUTO:
                auto = True
                i += 1 if eq else 2
                continue
        elif key.startswith(SETTING_PREFIX):
            name = key[len(SETTING_PREFIX):]
            if not eq and not takes_next:
                raise TorchtitanConfigError(f"{arg}: give the setting a value ({arg} VALUE)")
            text = value if eq else args[i + 1]
            try:
                settings[name] = json.loads(text)
            except ValueError:
                settings[name] = text
            i += 1 if eq else 2
            continue
        rest.append(arg)
        i += 1
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TorchtitanConfigError(f"unknown automicro setting(s) {unknown}; the settings are {list(SETTINGS)}")
    if settings and not auto:
        raise TorchtitanConfigError(
            f"--automicro.* settings ({sorted(settings)}) without {BATCH_KEY} auto: add {BATCH_KEY} auto"
        )
    return rest, auto, settings


class AutoTrainer(Trainer):
    """torchtitan's `Trainer` whose microbatch is found, and kept safe, by automicro.

    Args:
        config: torchtitan's `Trainer.Config` (``training.local_batch_size`` as the config has it: see the
            module's docstring for what each rank's batch of a step is).
        automicro: `AutoMicrobatching`'s settings, plus `memory` and `sites` (tests).
    """

    def __init__(self, config: Any, automicro: Optional[Mapping[str, Any]] = None) -> None:
        internals.check_version()
        settings = dict(automicro or {})
        unknown = sorted(set(settings) - set(SETTINGS) - set(STEP_KEYWORDS))
        if unknown:
            raise TypeError(f"AutoTrainer: unknown automicro setting(s) {unknown}; the settings are {list(SETTINGS)}")
        if settings.get("budget", "samples") != "samples":
            raise TorchtitanConfigError(
                "budget: tokens: torchtitan's data loaders pack every row to training.seq_len, so a sample is a fixed "
                "number of tokens and the sample budget is the token budget; leave budget unset"
            )
        problems = refusals(config)
        if problems:
            raise TorchtitanConfigError(
                "automicro.torchtitan: training.local_batch_size auto cannot run with " + "; ".join(problems)
            )
        if internals.cpu_wanted():
            internals.use_cpu()
            log.info("automicro: no GPU: torchtitan runs on CPU ranks (gloo; attention as SDPA under the same mask)")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        batch, source = per_rank_batch(config, world)
        self.automicro_batch = batch
        config.training.local_batch_size = batch
        config.training.global_batch_size = batch * world
        if not config.training.disable_cuda_graphs:
            config.training.disable_cuda_graphs = True
            log.info(
                "automicro: CUDA graphs off under auto (a graph is captured for one microbatch shape; the search "
                "changes it); --training.disable_cuda_graphs says so and silences this line"
            )
        self._auto: Optional[AutoStep] = None
        self._resume_state: Optional[dict[str, Any]] = None
        self._last_state: Optional[dict[str, Any]] = None
        self.last_step: Optional[StepResult] = None
        self._global_valid_tokens: Optional[torch.Tensor] = None
        self._settings = settings
        validate = bool(config.validator.enable)
        config.validator.enable = False  # built at the first validation, at the microbatch size then in use
        try:
            super().__init__(config)
        finally:
            config.validator.enable = validate
        if validate:
            self.validator = _LateValidator(self)
        internals.sum_reduction_on_gloo(self.model_parts)
        if config.compile.enable and "model" in config.compile.components:
            # torchtitan compiles each block with `nn.Module.compile` (its hooks traced, fullgraph); automicro's
            # sync hooks on those blocks must run eager: the same blocks' forwards compiled instead.
            moved = torch_internals.compile_forwards_not_hooks(
                self.model_parts[0], backend=config.compile.backend, fullgraph=True
            )
            log.info("automicro: %d compiled blocks: their forward compiled, the module hooks left eager", moved)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0 and batch == 1:
            log.warning(
                "automicro: each rank's batch of a step is 1 sample (%s): there is no microbatch to find; set "
                "training.global_batch_size to the batch you want each step (a multiple of %d ranks)", source, world,
            )
        if rank0:
            log.info(
                "automicro: training.local_batch_size auto: each rank trains %d samples a step (%s; global batch %d); "
                "the microbatch is found in the run", batch, source, batch * world,
            )

    # ---- the step -------------------------------------------------------------------------------------

    def _start(self) -> AutoStep:
        model = self.model_parts[0]
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):  # torchtitan 0.3.0 shards every language model, one rank included
            raise TorchtitanConfigError(
                f"automicro.torchtitan: the model reached training as {type(model).__name__}, not sharded with FSDP2; "
                "auto guards FSDP2: leave parallelism.data_parallel_shard_degree at -1"
            )
        settings = {k: v for k, v in self._settings.items() if k not in STEP_KEYWORDS}
        auto = AutoStep(
            model, self.optimizers, self._microbatch, step_optimizer=False, own_backward=True,
            checkpoint_folder=self.config.dump_folder, memory=self._settings.get("memory"),
            sites=self._settings.get("sites"), **settings,
        )
        if self._resume_state is not None:
            auto.load_state_dict(self._resume_state)
            self._resume_state = None
        return auto  # `step` opens it (the sync hooks, the ledger) at the first batch

    @property
    def auto(self) -> AutoStep:
        """The run's `AutoStep` (made at the first step; tests arm fault injectors on its sites)."""
        if self._auto is None:
            self._auto = self._start()
        return self._auto

    def _microbatch(self, model: torch.nn.Module, microbatch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in microbatch.items() if k != LABELS}
        assert self._global_valid_tokens is not None
        return self.forward_backward_step(
            input_dict=inputs, labels=microbatch[LABELS], global_valid_tokens=self._global_valid_tokens,
        ).detach()

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        """torchtitan's `train_step` with the gradient accumulation automicro's: one fetch of the rank's
        whole batch, the global valid tokens counted once, `AutoStep` for the microbatches, then
        torchtitan's clip, optimizer and LR steps and logging."""
        auto = self.auto
        self.optimizers.zero_grad()
        lr_metrics = self.lr_schedulers.get_metrics()
        should_log = self.metrics_processor.should_log(self.step)
        input_dict, labels = next(data_iterator)
        if LABELS in input_dict:
            raise TorchtitanConfigError(f"automicro.torchtitan: the data loader's inputs carry a key {LABELS!r}; rename it")
        local_valid_tokens = (labels != IGNORE_INDEX).sum()
        dims = self.parallel_dims
        if dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens.to(self.device), dims.get_mesh("batch"))
        else:
            global_valid_tokens = local_valid_tokens.to(self.device)
        self._global_valid_tokens = global_valid_tokens
        seen = self.ntokens_seen
        try:
            result = auto.step({**input_dict, LABELS: labels})
        finally:
            self._global_valid_tokens = None
        # torchtitan counts tokens per microbatch; a failed attempt's microbatches ran again: count the batch once.
        self.ntokens_seen = seen + labels.numel()
        self.last_step = result
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=dims.get_optional_mesh("pp"), ep_enabled=dims.ep_enabled,
        )
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        if not should_log:
            return
        accumulated_loss = result.loss.to(self.device)
        if dims.dp_cp_enabled:
            loss_mesh = dims.get_optional_mesh("loss")
            local_avg_loss = accumulated_loss * global_valid_tokens / local_valid_tokens.to(self.device)
            global_avg_loss = dist_utils.dist_sum(accumulated_loss, loss_mesh)
            global_max_loss = dist_utils.dist_max(local_avg_loss, loss_mesh)
            global_ntokens_seen = dist_utils.dist_sum(
                torch.tensor(self.ntokens_seen, dtype=torch.int64, device=self.device), loss_mesh
            )
        else:
            global_avg_loss = global_max_loss = float(accumulated_loss.item())
            global_ntokens_seen = self.ntokens_seen
        if not math.isfinite(global_avg_loss):
            raise RuntimeError(f"Loss is not finite (global_avg_loss={global_avg_loss}) at step {self.step}. Stopping training.")
        extra = {"n_tokens_seen": global_ntokens_seen, **lr_metrics}
        extra.update({k: v for k, v in auto.metrics().items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        self.metrics_processor.log(self.step, global_avg_loss, global_max_loss, float(grad_norm.item()), extra_metrics=extra)

    def train(self) -> None:
        try:
            super().train()
        except BaseException as error:
            self._finish(error)
            raise
        self._finish(None)

    def _finish(self, error: Optional[BaseException]) -> None:
        auto, self._auto = self._auto, None
        if auto is None:
            return
        self._last_state = auto.state_dict()
        auto.__exit__(None if error is None else type(error), error, None if error is None else error.__traceback__)

    # ---- checkpoints (torchtitan's train_state, saved by DCP) -------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        search = self._auto.state_dict() if self._auto is not None else self._last_state
        state[STATE_KEY] = json.dumps(search if search is not None else self._resume_state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        text = state_dict.get(STATE_KEY)
        saved = json.loads(text) if isinstance(text, str) else None
        if saved is None:
            if dist.is_initialized() and dist.get_rank() == 0:
                log.warning("automicro: the checkpoint has no automicro state: the microbatch search starts again")
            return
        if self._auto is not None:
            self._auto.load_state_dict(saved)  # made early (tests arm fault sites on it); refused after a step
        else:
            self._resume_state = saved

    # ---- validation at the size in use ---------------------------------------------------------------

    def validation_batch(self) -> int:
        result = self.last_step
        return max(result.split) if result is not None and result.split else self.automicro_batch


class _LateValidator:
    """torchtitan's validator, built at its first use at the microbatch size then in use (torchtitan
    validates at ``local_batch_size``; under `auto` that is found in the run)."""

    # torchtitan's own rule (it reads `self.config.freq`), before its validator exists.
    should_validate = BaseValidator.should_validate

    def __init__(self, trainer: AutoTrainer) -> None:
        self._trainer = trainer
        self.config = trainer.config.validator
        self._built: Any = None
        self.batch: Optional[int] = None  # the samples a rank validates at (set at the first validation)
        self.runs = 0

    def validate(self, model_parts: list[torch.nn.Module], step: int) -> Any:
        trainer = self._trainer
        if self._built is None:
            size = self.batch = trainer.validation_batch()
            self._built = internals.build_validator(trainer, size)
            if dist.is_initialized() and dist.get_rank() == 0:
                log.info("automicro: validation at %d samples a rank (the microbatch size in use at step %d)", size, step)
        auto = trainer._auto
        if auto is not None:
            auto.layout.suspend()
        self.runs += 1
        try:
            return self._built.validate(model_parts, step)
        finally:
            if auto is not None:
                auto.layout.resume()
                auto.search.rearm("eval")


def settings_of(trainer: Trainer) -> dict[str, Any]:
    """The automicro settings a trainer runs with (none for torchtitan's own `Trainer`)."""
    return dict(getattr(trainer, "_settings", {}) or {})


def build(argv: Optional[Sequence[str]] = None, **automicro: Any) -> Trainer:
    """The trainer for torchtitan's command line `argv` (``--module``, ``--config``, overrides): an
    `AutoTrainer` with ``--training.local_batch_size auto``, else torchtitan's own `Trainer`."""
    rest, auto, settings = split_arguments(sys.argv[1:] if argv is None else argv)
    config = ConfigManager().parse_args(rest)
    if not auto:
        return config.build()
    return AutoTrainer(config, {**settings, **automicro})


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m automicro.torchtitan`` (under torchrun): torchtitan's `torchtitan.train` entry with
    `AutoTrainer` where ``--training.local_batch_size auto`` is given."""
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer: Optional[Trainer] = None
    try:
        trainer = build(argv)
        if trainer.config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        dist.destroy_process_group()
    # Once main returns, the process gets the settings' exit_timeout_s to exit (a compiled run's exit can hang:
    # pytorch/pytorch#162199); what holds it is written and the process ends with code 0.
    exit_watch.arm_finished(float(settings_of(trainer).get("exit_timeout_s", exit_watch.DEFAULT_TIMEOUT_S)), rank)


__all__ = ["AutoTrainer", "TorchtitanConfigError", "build", "main", "per_rank_batch", "refusals", "split_arguments"]
