"""Composer's training metrics under a fused head (`automicro.engine.head`), which never holds the logits.

Composer 0.32 computes the model's training metrics (``get_metrics(is_train=True)``) on every microbatch, from
the training forward's outputs: automicro's Llama gives `LanguageCrossEntropy` and `LanguagePerplexity`, llm-foundry's
models add `TokenAccuracy`. The first two are the training loss itself (its sum over the loss tokens and their
count): with the fused head they come from the fused path's loss (`install`: the model's ``eval_forward`` and
``update_metric`` take the fused output and add its sum and count), with no second pass over the logits. A metric
that reads the logits (token accuracy, a user's) keeps the plain head for the run (`logits_needed` names it; the
head's line says so).

Owns: which metrics come from the loss, and the two wrappers. May not touch: the switch's decisions, the head's
computation, Composer's privates (`_composer_internals`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from automicro.composer import _composer_internals as composer_internals
from automicro.engine.head import HeadSwitch
from automicro.engine.head_models import FusedHeadOutput

# The metrics that are the training loss (Composer's cross-entropy and its exponential).
FROM_LOSS = ("LanguageCrossEntropy", "LanguagePerplexity")


def _from_loss(metric: Any) -> bool:
    return any(cls.__name__ in FROM_LOSS for cls in type(metric).__mro__)


def logits_needed(model: Any) -> str:
    """Why a training batch's logits are read (a metric other than the loss's), or ""."""
    get_metrics = getattr(model, "get_metrics", None)
    metrics = get_metrics(is_train=True) if callable(get_metrics) else {}
    others = sorted(name for name, metric in (metrics or {}).items() if not _from_loss(metric))
    return f"the training metric(s) {others} are computed from the logits" if others else ""


def from_loss(model: Any) -> str:
    """The training metrics that will come from the fused path's loss, in words ("" where none)."""
    get_metrics = getattr(model, "get_metrics", None)
    names = sorted((get_metrics(is_train=True) or {}) if callable(get_metrics) else {})
    return f"the training metrics {names} from the fused loss" if names else ""


def _fused(outputs: Any) -> bool:
    if isinstance(outputs, FusedHeadOutput):
        return True
    return isinstance(outputs, Mapping) and outputs.get("logits") is None and outputs.get("loss") is not None


def install(model: Any, switch: HeadSwitch) -> None:
    """Composer's training metrics of `model` from the fused loss while the head is fused (the plain path
    otherwise, evaluation included: its forward has no fused output)."""
    plain_eval_forward, plain_update = model.eval_forward, model.update_metric

    def eval_forward(batch: Any, outputs: Any = None) -> Any:
        if outputs is not None and _fused(outputs):
            return outputs
        return plain_eval_forward(batch, outputs)

    def update_metric(batch: Any, outputs: Any, metric: Any) -> Any:
        if _fused(outputs) and _from_loss(metric) and switch.last is not None:
            composer_internals.add_to_cross_entropy(metric, *switch.last)
            return None
        return plain_update(batch, outputs, metric)

    model.eval_forward = eval_forward
    model.update_metric = update_metric


__all__ = ["FROM_LOSS", "from_loss", "install", "logits_needed"]
