"""Which models' heads can be fused, and how the switch is put on them (`automicro.engine.head`).

A fused head needs three things of a model: the last hidden states before the output projection, the
projection's weight (and bias), and what the model does between them and its loss (soft-capping, a scale, the
label shift). Where those are known, the model's training forward is wrapped once, at attach: while the switch is
fused, a forward in training mode with labels computes the hidden states, then the loss through the fused path,
and returns the loss without logits; otherwise (plain, evaluation, no labels, a generation) the model's own
forward runs unchanged. The fused loss runs *inside* the output projection's own call (its ``forward`` wrapped
too), so FSDP2's hooks on it, where it is a unit of its own, gather its weight and reduce its gradient as for
the plain head; a tied weight (the embedding's) is the same parameter either way.

Where it applies:

- automicro's own Llama (`automicro.models.ComposerLlama`): labels come shifted;
- transformers' causal LMs of the families in `FAMILIES` (transformers 4.51 to 5.x; each checked against its
  plain head in tests/test_head.py): the hidden states of ``model`` (``transformer`` for GPT-2), ``lm_head``,
  Gemma 2/3's ``final_logit_softcapping``, Granite's ``logits_scaling``; labels shifted as transformers'
  ``ForCausalLMLoss`` shifts them (or ``shift_labels`` where given), ``num_items_in_batch`` honoured.

The routed families (Qwen3-MoE, OLMoE, Mixtral) too, where their loss is the language model's alone: their config's
``output_router_logits`` false (each one's default) and no forward asking for it; with it, the model adds its routers'
load-balancing loss to the loss, which the fused head does not compute (`find_head` says so; a forward that asks for it
runs the plain head).

Elsewhere (`find_head` says why): another family (its forward may do more between the hidden states and the
loss: a multimodal head), a pipeline stage, a head that is not one linear layer.

Owns: the families and the wrapping. May not touch: the switch's state (the trials'), Composer,
transformers' privates (the batch step reads a transformers model only through its public attributes; the
output class through ``sys.modules``, never an import).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from automicro.engine.head import FusedHeadLogitsError, HeadSwitch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Family:
    """How one transformers family computes its loss from the hidden states: the base model's attribute, the
    config attribute of its soft-capping (``softcap * tanh(logits / softcap)``) and of a divisor of its logits."""

    base: str = "model"
    softcap: Optional[str] = None
    divisor: Optional[str] = None
    routed: bool = False  # its loss may add the routers' load-balancing loss (``output_router_logits``)


# transformers' `config.model_type` -> its family. Each is checked against its plain head (tests/test_head.py).
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "gemma": Family(),
    "gemma2": Family(softcap="final_logit_softcapping"),
    "gemma3_text": Family(softcap="final_logit_softcapping"),
    "olmo2": Family(),
    "phi3": Family(),
    "stablelm": Family(),
    "granite": Family(divisor="logits_scaling"),
    "gpt2": Family(base="transformer"),
    "qwen3_moe": Family(routed=True),
    "olmoe": Family(routed=True),
    "mixtral": Family(routed=True),
}


class FusedHeadOutput:
    """What a fused head's forward returns where the model returned logits (automicro's Llama): the loss, and a
    clear error for whoever reads the logits (a training metric, a loss computed from them)."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss

    def _no_logits(self) -> FusedHeadLogitsError:
        return FusedHeadLogitsError(
            "automicro: the fused head computed the loss without the logits, and this batch read them (a training "
            "metric, or a loss computed from the logits); set head: plain (callbacks.auto_microbatching.head) where "
            "training needs the logits"
        )

    def __getattr__(self, name: str) -> Any:
        raise self._no_logits()

    def float(self) -> Any:  # what a metric or a loss on logits calls first
        raise self._no_logits()

    def __getitem__(self, key: Any) -> Any:
        if key in ("loss", 0):
            return self.loss
        raise self._no_logits()


class InstalledHead:
    """The switch put on one model's output projection: the fused loss runs inside its own call."""

    def __init__(self, lm_head: nn.Linear, switch: HeadSwitch, label_shift: int) -> None:
        self.lm_head, self.switch, self.label_shift = lm_head, switch, label_shift
        self._pending: Optional[tuple[torch.Tensor, Any, Optional[float], Optional[float]]] = None
        head = self
        plain_linear = lm_head.forward

        def linear_forward(x: torch.Tensor) -> torch.Tensor:
            pending = head._pending
            if pending is None:
                return plain_linear(x)
            head._pending = None
            labels, num_items, softcap, scale = pending
            return switch.loss(x, lm_head.weight, labels, lm_head.bias, softcap, scale, num_items)

        lm_head.forward = linear_forward
        # The plain head's start, for the meter (the profiled batch only: a flag read otherwise).
        lm_head.register_forward_pre_hook(lambda module, args: switch.started(args[0]) if args else None)

    def fused_loss(self, hidden: torch.Tensor, labels: torch.Tensor, num_items: Any = None, softcap: Optional[float] = None,
                   scale: Optional[float] = None, shifted: bool = False) -> torch.Tensor:
        """The loss through the fused head, inside the output projection's own call (its FSDP2 hooks run)."""
        if not shifted and self.label_shift:
            labels = F.pad(labels, (0, self.label_shift), value=IGNORE_INDEX)[..., self.label_shift:]
        labels = labels.to(hidden.device)
        self.switch.started(hidden)
        self._pending = (labels, num_items, softcap, scale)
        try:
            loss = self.lm_head(hidden)
        finally:
            self._pending = None
        self.switch.finished(loss)
        count = (labels != IGNORE_INDEX).sum()
        total = loss.detach() * (count if num_items is None else torch.as_tensor(num_items, device=loss.device))
        self.switch.last = (total, count)
        return loss

    def fuses(self, training: bool, labels: Any) -> bool:
        return self.switch.fused and training and torch.is_grad_enabled() and isinstance(labels, torch.Tensor)


# ---- automicro's Llama ------------------------------------------------------------------------------


def _install_llama(composer_model: nn.Module, switch: HeadSwitch) -> InstalledHead:
    llama = composer_model.model
    head = InstalledHead(llama.lm_head, switch, label_shift=0)
    plain_forward, plain_loss = composer_model.forward, composer_model.loss

    def forward(batch: Any) -> Any:
        labels = batch.get("labels") if isinstance(batch, dict) else None
        if not head.fuses(composer_model.training, labels):
            return plain_forward(batch)
        hidden = llama.hidden_states(batch["input_ids"], batch.get("position_ids"))
        return FusedHeadOutput(head.fused_loss(hidden, labels))

    def loss(outputs: Any, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(outputs, FusedHeadOutput):
            return outputs.loss
        value = plain_loss(outputs, batch, *args, **kwargs)
        switch.finished(value)
        return value

    composer_model.forward, composer_model.loss = forward, loss
    return head


# ---- transformers' causal LMs -------------------------------------------------------------------------


def _output_class() -> Any:
    transformers = sys.modules.get("transformers")
    outputs = getattr(transformers, "modeling_outputs", None) if transformers is not None else None
    return getattr(outputs, "CausalLMOutputWithPast", None)


def _install_transformers(model: nn.Module, family: Family, switch: HeadSwitch) -> InstalledHead:
    config = model.config
    base = getattr(model, family.base)
    softcap = getattr(config, family.softcap, None) if family.softcap else None
    divisor = getattr(config, family.divisor, None) if family.divisor else None
    scale = 1.0 / float(divisor) if divisor else None
    lm_head = model.lm_head
    head = InstalledHead(lm_head, switch, label_shift=1)
    plain_forward = model.forward
    output_class = _output_class()

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:  # positional inputs (input_ids first): the model's own signature decides
            if len(args) > 1 or "input_ids" in kwargs:
                return plain_forward(*args, **kwargs)
            kwargs["input_ids"] = args[0]
        labels = kwargs.get("labels")
        keep = kwargs.get("logits_to_keep", kwargs.get("num_logits_to_keep", 0))
        aux = family.routed and bool(kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)))
        if not head.fuses(model.training, labels) or not (isinstance(keep, int) and keep == 0) or aux:
            out = plain_forward(**kwargs)
            switch.finished(out.get("loss") if isinstance(out, dict) else (out[0] if isinstance(out, tuple) and out else None))
            return out
        kwargs.pop("labels")
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("num_logits_to_keep", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        if family.base == "transformer":  # GPT-2's base takes return_dict; the others' do not in transformers 5
            kwargs["return_dict"] = True
        if family.routed:
            # As the model's own forward passes it (resolved: false here): transformers 5 hands it on to every block,
            # whose compiled graph guards on its keyword arguments (without it, each block compiles again).
            kwargs["output_router_logits"] = False
        outputs = base(**kwargs)
        hidden = outputs[0]
        if shift_labels is not None:
            loss = head.fused_loss(hidden, shift_labels, num_items, softcap, scale, shifted=True)
        else:
            loss = head.fused_loss(hidden, labels, num_items, softcap, scale)
        tuple_out = return_dict is False or (return_dict is None and not getattr(config, "use_return_dict", True))
        if tuple_out or output_class is None:
            return (loss,)
        return output_class(
            loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
            hidden_states=getattr(outputs, "hidden_states", None), attentions=getattr(outputs, "attentions", None),
        )

    model.forward = forward
    return head


def _transformers_causal_lm(model: nn.Module) -> Optional[nn.Module]:
    """The transformers causal LM in `model` (itself, Composer's ``HuggingFaceModel``'s ``model``, an adapter's)."""
    for candidate in (model, getattr(model, "model", None), getattr(model, "module", None)):
        config = getattr(candidate, "config", None)
        if isinstance(candidate, nn.Module) and hasattr(config, "model_type") and hasattr(candidate, "lm_head"):
            return candidate
    return None


def _is(obj: Any, name: str) -> bool:
    """`obj` is of the class `name` (by name: FSDP2 makes a subclass of each module it shards, and the engine
    imports no model)."""
    return any(cls.__name__ == name for cls in type(obj).__mro__)


def _name(module: nn.Module) -> str:
    """The model's own class name (FSDP2's subclass left out)."""
    cls = type(module)
    return cls.__mro__[1].__name__ if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 1 else cls.__name__


def find_head(model: nn.Module) -> tuple[Optional[str], str]:
    """(the family, "") where `model`'s head can be fused, else (None, why not, in a few words)."""
    inner = getattr(model, "model", None)
    if _is(model, "ComposerLlama") and inner is not None:
        if not _is(inner, "Llama") or not hasattr(inner, "hidden_states"):
            return None, "a pipeline stage holds the head apart from the blocks"
        return "automicro-llama", ""
    lm = _transformers_causal_lm(model)
    if lm is None:
        return None, f"{_name(model)} has no head automicro knows (automicro's Llama or a transformers causal LM)"
    model_type = lm.config.model_type
    family = FAMILIES.get(model_type)
    if family is None:
        return None, (f"{_name(lm)} (model_type {model_type!r}) is not one of the families whose head automicro "
                      f"fuses ({', '.join(sorted(FAMILIES))})")
    if not isinstance(lm.lm_head, nn.Linear):
        return None, f"{_name(lm)}'s lm_head is a {_name(lm.lm_head)}, not one linear layer"
    if family.routed and getattr(lm.config, "output_router_logits", False):
        return None, (f"{_name(lm)}'s loss adds its routers' load-balancing loss (output_router_logits: true), which the "
                      "fused head does not compute")
    if not isinstance(getattr(lm, family.base, None), nn.Module):
        return None, f"{_name(lm)} has no {family.base!r} base model"
    return model_type, ""


def install_head(model: nn.Module, switch: HeadSwitch) -> InstalledHead:
    """Put `switch` on `model` (`find_head` must have named its family)."""
    family, why = find_head(model)
    if family is None:
        raise ValueError(f"automicro: the head cannot be fused: {why}")
    if family == "automicro-llama":
        return _install_llama(model, switch)
    lm = _transformers_causal_lm(model)
    assert lm is not None
    return _install_transformers(lm, FAMILIES[family], switch)


def head_weight(model: nn.Module) -> Optional[torch.Tensor]:
    """The output projection's weight of a model `find_head` knows (its dtype and device decide the backend)."""
    if _is(model, "ComposerLlama"):
        return model.model.lm_head.weight
    lm = _transformers_causal_lm(model)
    return None if lm is None else lm.lm_head.weight


__all__ = ["FAMILIES", "Family", "FusedHeadOutput", "InstalledHead", "find_head", "head_weight", "install_head"]
