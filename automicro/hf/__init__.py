"""`AutoMicrobatchTrainer`: the Hugging Face `Trainer` with automicro's `auto` microbatching.

::

    from automicro.hf import AutoMicrobatchTrainer

    args = TrainingArguments(
        output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=4,  # 32 per device a step
        fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        bf16=True,
    )
    trainer = AutoMicrobatchTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                                    automicro={"budget": "tokens"})
    trainer.train()                  # accelerate launch / torchrun, as with the Trainer

The per-device batch of one optimizer step is ``per_device_train_batch_size x
gradient_accumulation_steps`` samples, as with the plain `Trainer`, and it stays that whatever
memory allows: the gradient accumulation is automicro's. The Trainer's data loader hands each rank
that whole batch once a step; `automicro.AutoStep` splits it into the largest microbatches that fit
(searching with the sync hooks on, every rank agreeing, an OOM retried smaller on every rank), runs
their forward and backward through the Trainer's own `compute_loss` and accelerate's backward, and
leaves the gradients of the whole batch to the Trainer, which clips them, steps the optimizer and
the schedule, logs (with the ``automicro/*`` figures) and checkpoints as always. Each microbatch's
loss is weighted by its share of the global batch: its loss tokens where the Trainer normalizes by
tokens (models that take ``num_items_in_batch``: causal LMs), else its samples; so the step's
gradients are those of the whole batch at once, whatever the split.

The model is sharded with FSDP2: by accelerate (``fsdp_config={"fsdp_version": 2}`` or accelerate's
config file), or by the user with torch's ``fully_shard`` (blocks, then the root) before the
Trainer sees it; then accelerate leaves it as it is (no DistributedDataParallel around it). The
search's state goes into every checkpoint (``automicro_state.json``) and is read back by
``train(resume_from_checkpoint=...)``.

Refused, with what to change: ``auto_find_batch_size=True`` (the Trainer's own halving, which
restarts training and changes the global batch), DeepSpeed, a model that is not FSDP2-sharded
(DistributedDataParallel, FSDP1), a run that is not distributed (launch with ``torchrun`` or
``accelerate launch``; one GPU: one process). Evaluation is the Trainer's own, at
``per_device_eval_batch_size`` (the search's eval mode is Composer's: docs/guides/composer.md, Eval).

Owns: the Trainer's side of the seam (arguments, the lazy start, checkpoint state, the log line).
May not touch: the search and the step (`automicro.step.AutoStep`); transformers/accelerate
privates outside `hf/_hf_internals`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

try:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("automicro.hf needs transformers and accelerate: pip install 'automicro[hf]'") from error

from automicro.hf import _hf_internals as internals
from automicro.step import SETTINGS, AutoStep, StepResult

log = logging.getLogger(__name__)

STATE_FILE = "automicro_state.json"
# AutoStep's keywords the `automicro` mapping may carry besides the settings (clipping is the Trainer's:
# `max_grad_norm` in TrainingArguments).
STEP_KEYWORDS = ("memory", "sites")


class AutoMicrobatchTrainer(Trainer):
    """A `transformers.Trainer` whose microbatch is found, and kept safe, by automicro.

    The positional and other keyword arguments are the `Trainer`'s own.

    Args:
        automicro: `AutoMicrobatching`'s settings (docs/reference/configuration.md; the eval ones excepted), e.g.
            ``{"budget": "tokens", "stable_batches": 4}``; and `memory` (a `MemorySource`: on CPU,
            `automicro.testing.CapMemory` emulates a GPU's limit). ``loss_normalization`` defaults
            to the Trainer's own choice: ``tokens`` where it normalizes by ``num_items_in_batch``.
    """

    def __init__(self, *args: Any, automicro: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        settings = dict(automicro or {})
        unknown = sorted(set(settings) - set(SETTINGS) - set(STEP_KEYWORDS))
        if unknown:
            raise TypeError(
                f"AutoMicrobatchTrainer: unknown automicro setting(s) {unknown}; the settings are "
                f"{list(SETTINGS) + list(STEP_KEYWORDS)} (gradient clipping: TrainingArguments.max_grad_norm)"
            )
        if len(args) >= 2:
            args = (args[0], _own_accumulation(args[1]), *args[2:])
        elif kwargs.get("args") is not None:
            kwargs["args"] = _own_accumulation(kwargs["args"])
        self._automicro_settings = settings
        self._auto: Optional[AutoStep] = None
        self._resume_state: Optional[dict[str, Any]] = None
        self._last_state: Optional[dict[str, Any]] = None
        self.last_step: Optional[StepResult] = None
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            raise ValueError(
                "AutoMicrobatchTrainer: DeepSpeed is not supported; shard with FSDP2 "
                "(fsdp='full_shard', fsdp_config={'fsdp_version': 2}) or torch's fully_shard"
            )
        if self._user_sharded() and _saves_checkpoints(self.args):
            raise ValueError(self._user_sharded_save_error(f"save_strategy={_value(self.args.save_strategy)!r}"))
        self.add_callback(_SaveSearchState(self))

    # ---- set-up -------------------------------------------------------------------------------------

    def _user_sharded(self) -> bool:
        """The model came sharded by the user's `fully_shard`, not by accelerate."""
        return internals.is_fully_shard_root(self.model) and not internals.accelerate_shards(self.accelerator)

    @staticmethod
    def _user_sharded_save_error(what: str) -> str:
        return (
            f"AutoMicrobatchTrainer: {what} with a model you sharded with fully_shard: the Trainer saves such a model "
            "from one rank only, which cannot write its shards. Let accelerate shard it (fsdp='full_shard', "
            "fsdp_config={'fsdp_version': 2}) to get the Trainer's checkpoints, or set save_strategy='no' and save "
            "with torch.distributed.checkpoint (the search's state: trainer.search_state())"
        )

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        internals.keep_sharded_model(self.accelerator)

    def _start(self, model: torch.nn.Module) -> AutoStep:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "AutoMicrobatchTrainer: the run is not distributed; launch it with torchrun or accelerate launch "
                "(one GPU: one process) with FSDP2 (fsdp='full_shard', fsdp_config={'fsdp_version': 2})"
            )
        if not internals.is_fully_shard_root(model):
            raise TypeError(
                f"AutoMicrobatchTrainer: the model reached training as {type(model).__name__}, not an FSDP2 model; "
                "automicro guards FSDP2: set fsdp='full_shard' and fsdp_config={'fsdp_version': 2} in TrainingArguments "
                "(or fsdp_version: 2 in accelerate's config), or pass a model sharded with torch's fully_shard"
            )
        settings = dict(self._automicro_settings)
        if "loss_normalization" not in settings:
            settings["loss_normalization"] = "tokens" if internals.loss_takes_item_count(self) else "samples"
        auto = AutoStep(
            model, internals.inner_optimizer(self.optimizer), self._microbatch_loss,
            checkpoint_folder=self.args.output_dir, step_optimizer=False, backward=self.accelerator.backward,
            **settings,
        )
        if self._resume_state is not None:
            auto.load_state_dict(self._resume_state)
            self._resume_state = None
        auto.open()
        return auto

    # ---- the Trainer's hooks --------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        saved = self._read_search_state(resume_from_checkpoint)
        if saved is not None:
            self._resume_state = saved
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as error:
            self._finish(error)
            raise
        self._finish(None)
        return result

    def _finish(self, error: Optional[BaseException]) -> None:
        """Keep the search's state and close the AutoStep; after an error, through its job-lost alarm
        (which raises the error every rank sees)."""
        auto, self._auto = self._auto, None
        if auto is None:
            return
        self._last_state = auto.state_dict()
        auto.__exit__(None if error is None else type(error), error, None if error is None else error.__traceback__)

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None, *args: Any) -> torch.Tensor:
        """The whole per-device batch of one optimizer step: split, run, agree, retry (`AutoStep`);
        the gradients of the batch are left for the Trainer's clip and optimizer step."""
        if self._auto is None:
            self._auto = self._start(model)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        self.last_step = self._auto.step(inputs)
        return self.last_step.loss.to(self.args.device)

    def _microbatch_loss(self, model: torch.nn.Module, microbatch: Any) -> torch.Tensor:
        # The Trainer's own loss (label smoothing, compute_loss_func, a subclass's compute_loss) as the
        # microbatch's mean: no num_items_in_batch, automicro weights each microbatch by its share.
        with self.compute_loss_context_manager():
            return self.compute_loss(model, dict(microbatch))

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._auto is not None and "loss" in logs:
            logs = {**logs, **{k: v for k, v in self._auto.metrics().items() if isinstance(v, (int, float))}}
        super().log(logs, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        auto = self._auto
        if auto is not None:
            auto.layout.suspend()  # a layout trial's trade does not run the evaluation
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if auto is not None:
                auto.layout.resume()
                auto.search.rearm("eval")  # evaluation can leave memory fragmented: guard the next batches

    # ---- checkpoints --------------------------------------------------------------------------------

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if self._user_sharded():
            raise ValueError(self._user_sharded_save_error("save_model()"))
        super().save_model(output_dir, _internal_call)

    def search_state(self) -> Optional[dict[str, Any]]:
        """The search's state (plain values): of the running `train()`, else of the last one; None
        before any step."""
        return self._auto.state_dict() if self._auto is not None else self._last_state

    def load_search_state(self, state: dict[str, Any]) -> None:
        """Resume the search from `search_state()` at the next `train()` (for checkpoints the Trainer
        does not write; its own checkpoints carry the state and `train(resume_from_checkpoint=...)`
        reads it)."""
        if not isinstance(state, dict) or "search" not in state:
            raise ValueError("AutoMicrobatchTrainer.load_search_state: expected what search_state() returned")
        if self._auto is not None:
            raise RuntimeError("AutoMicrobatchTrainer.load_search_state: call it before train()")
        self._resume_state = state

    def _read_search_state(self, resume_from_checkpoint: Any) -> Optional[dict[str, Any]]:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        folder = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else str(resume_from_checkpoint)
        if folder is None:
            return None  # the Trainer raises its own error for a missing checkpoint
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            log.warning("automicro: %s has no %s: the microbatch search starts again", folder, STATE_FILE)
            return None
        with open(path) as f:
            return json.load(f)

    def save_search_state(self, folder: str) -> None:
        """Write the search's state into a checkpoint folder (the ranks that save: `args.should_save`)."""
        if self._auto is None or not self.args.should_save:
            return
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, STATE_FILE), "w") as f:
            json.dump(self._auto.state_dict(), f)

    @property
    def auto(self) -> Optional[AutoStep]:
        """The `AutoStep` of the running `train()` (None outside it)."""
        return self._auto


class _SaveSearchState(TrainerCallback):
    """After the Trainer wrote a checkpoint: the search's state beside it."""

    def __init__(self, trainer: AutoMicrobatchTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.save_search_state(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))


def _value(option: Any) -> str:
    return str(getattr(option, "value", option))


def _saves_checkpoints(args: TrainingArguments) -> bool:
    return _value(args.save_strategy) != "no"


def _own_accumulation(args: TrainingArguments) -> TrainingArguments:
    """A copy of `args` whose per-device batch is the whole step's and whose accumulation is 1."""
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"AutoMicrobatchTrainer: args={args!r}: must be a transformers.TrainingArguments")
    if args.auto_find_batch_size:
        raise ValueError(
            "AutoMicrobatchTrainer: auto_find_batch_size=True is the Trainer's own search (it halves the per-device "
            "batch and restarts training, which changes the global batch); automicro finds the microbatch in the run "
            "and keeps the batch: set auto_find_batch_size=False"
        )
    steps = int(args.gradient_accumulation_steps)
    if steps < 1:
        raise ValueError(f"AutoMicrobatchTrainer: gradient_accumulation_steps={steps}: must be >= 1")
    if steps == 1:
        return args
    own = copy.copy(args)
    own.per_device_train_batch_size = int(args.per_device_train_batch_size) * steps
    own.gradient_accumulation_steps = 1
    log.info(
        "automicro: the per-device batch of a step is per_device_train_batch_size %d x gradient_accumulation_steps %d "
        "= %d samples; automicro splits it into microbatches (the Trainer sees per_device_train_batch_size %d, "
        "gradient_accumulation_steps 1)", args.per_device_train_batch_size, steps, own.per_device_train_batch_size,
        own.per_device_train_batch_size,
    )
    return own


__all__ = ["AutoMicrobatchTrainer", "STATE_FILE"]
