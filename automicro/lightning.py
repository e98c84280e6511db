"""Lightning (`pytorch-lightning` 2.6) with automicro's `auto` microbatching: manual optimization on
`automicro.AutoStep`, its lifecycle and checkpoint state kept by the `AutoMicrobatch` callback.

::

    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from automicro.lightning import AutoMicrobatch

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False           # the step is automicro's
            self.model = LlamaForCausalLM(config)

        def configure_model(self):                         # FSDP2, as ModelParallelStrategy wants it
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=3e-4)

        def training_step(self, batch, batch_idx):
            result = self.auto.step(batch)                 # split, run, agree, retry, optimizer.step()
            self.log("loss", result.loss)

    trainer = pl.Trainer(strategy=ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1),
                         callbacks=[AutoMicrobatch(budget="tokens")], max_steps=1000)
    trainer.fit(LitLlama(), loader)                        # the loader's batch: the whole batch of a step

Why manual optimization: in Lightning's automatic optimization its loop runs the forward, the
backward and the optimizer step of each batch itself (its ``accumulate_grad_batches`` counts whole
batches of the loader), and no public hook lets a callback or a strategy split a batch, wipe a failed
attempt and run it again smaller on every rank. Driving that loop would take Lightning's private
loop classes. With ``automatic_optimization = False`` the step is the module's: `AutoStep` does it,
with the same code as the Composer callback and the plain loop. ``accumulate_grad_batches="auto"``
is then what the loader's batch size means: the batch of one optimizer step, split as memory allows.

`AutoMicrobatch` builds the `AutoStep` at the start of training (``pl_module.auto``) over the module's
FSDP2 model (``model_attr``, default ``"model"``) and the optimizers Lightning wrapped (their ``step``
counts Lightning's ``global_step``, so ``max_steps``, schedules and checkpoints see every step),
closes it at the end (after an exception too, with the job-lost alarm), logs the ``automicro/*``
figures with the module's own ``log``, and keeps the search's state in Lightning's checkpoints
(``trainer.fit(ckpt_path=...)`` resumes at the split it saved).

Owns: Lightning's side of the seam. May not touch: the search and the step (`automicro.step`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

try:
    import pytorch_lightning as pl
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("automicro.lightning needs pytorch-lightning: pip install 'automicro[lightning]'") from error

from automicro.step import SETTINGS, AutoStep

STEP_KEYWORDS = ("memory", "sites", "max_grad_norm", "loss_fn")


class AutoMicrobatch(pl.Callback):
    """The `AutoStep` of a `LightningModule` trained with manual optimization (``pl_module.auto``).

    Args:
        model_attr: the module's attribute holding the model sharded with `fully_shard` (root
            included), e.g. in `configure_model`.
        **settings: ``loss_fn`` (``(model, microbatch) -> loss``; default: ``model(**microbatch)``'s
            ``.loss``) and `AutoStep`'s keywords: `AutoMicrobatching`'s settings (``budget``,
            ``stable_batches``, ...), ``max_grad_norm``, ``memory``, ``sites``.
    """

    def __init__(self, model_attr: str = "model", **settings: Any) -> None:
        unknown = sorted(set(settings) - set(SETTINGS) - set(STEP_KEYWORDS))
        if unknown:
            raise TypeError(f"AutoMicrobatch: unknown setting(s) {unknown}; the settings are {list(SETTINGS) + list(STEP_KEYWORDS)}")
        self.model_attr = model_attr
        self.settings = settings
        self.auto: Optional[AutoStep] = None
        self._resume: Optional[dict[str, Any]] = None
        self._last: Optional[dict[str, Any]] = None

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if pl_module.automatic_optimization:
            raise ValueError(
                "AutoMicrobatch: the module trains with automatic optimization, where Lightning's loop runs each batch "
                "itself; set self.automatic_optimization = False in __init__ and call self.auto.step(batch) in "
                "training_step (automicro.lightning's docstring has the recipe)"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"AutoMicrobatch: accumulate_grad_batches={trainer.accumulate_grad_batches}: the accumulation is automicro's "
                "(the loader's batch is one optimizer step's batch); leave accumulate_grad_batches=1 and make the loader's "
                "batch the step's batch"
            )
        if not isinstance(getattr(pl_module, self.model_attr, None), torch.nn.Module):
            raise ValueError(f"AutoMicrobatch: the module has no model at model_attr={self.model_attr!r}")

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        optimizers = pl_module.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        settings = dict(self.settings)
        loss_fn = settings.pop("loss_fn", None)
        auto = AutoStep(getattr(pl_module, self.model_attr), optimizers, loss_fn,
                        checkpoint_folder=trainer.default_root_dir, **settings)
        if self._resume is not None:
            auto.load_state_dict(self._resume)
            self._resume = None
        auto.open()
        self.auto = auto
        pl_module.auto = auto

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.auto is not None:
            figures = {k: float(v) for k, v in self.auto.metrics().items() if isinstance(v, (int, float))}
            if figures:
                pl_module.log_dict(figures, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close(None)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # An OOM or an error outside any attempt: the job-lost alarm tells every rank (no rank hangs in a
        # collective waiting for this one); Lightning re-raises the exception itself.
        self._close(exception)

    def _close(self, error: Optional[BaseException]) -> None:
        auto, self.auto = self.auto, None
        if auto is None:
            return
        self._last = auto.state_dict()
        try:
            if error is not None:
                auto.search.lost(error, "between steps", auto.batches, auto.checkpoint_folder)
        finally:
            auto.close()

    def state_dict(self) -> dict[str, Any]:
        state = self.auto.state_dict() if self.auto is not None else self._last
        return dict(state) if state else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict) if state_dict else None


__all__ = ["AutoMicrobatch"]
