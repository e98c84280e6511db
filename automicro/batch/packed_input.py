"""Whether a model takes packed rows (``packing: true``): several samples end to end in one row,
attention kept within each sample by ``position_ids`` that restart at every sample.

- A model that says so: a ``packed_input`` attribute on the Composer model (or on the module it
  wraps), True or False. `automicro.models`' Llama says True (a document mask from the position ids).
- A transformers model (Composer's ``HuggingFaceModel``): from transformers 4.54, the models whose
  modeling code builds its mask with ``masking_utils.create_causal_mask`` (Llama, Mistral, Qwen2,
  Gemma, GPT-2, ... in 5.x) find packed rows from ``position_ids`` when no attention mask is given
  and no KV cache is made, with every attention implementation (eager, sdpa, flex, flash). With
  the config's default ``use_cache: true`` the forward makes a cache in training too, and the
  samples of a row then attend to each other without a word (measured: transformers 5.17, Llama,
  sdpa and eager): a forward pre-hook passes ``use_cache=False`` to the model's training forwards
  of packed rows (the config is left alone: exports keep it), said once. Older transformers keep
  packed rows apart only with ``attn_implementation`` ``flash_attention_2``/``_3``.
- Anything else cannot: one line says why, and batches are padded as without packing.

Owns: that decision, the hooks that keep the cache off in training forwards (of packed rows; of
every training forward where the blocks are compiled, `no_cache_in_training`), and the lines. May not touch: the batch, the
search, the loss.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional


def _declared(model: Any) -> Optional[bool]:
    for candidate in (model, getattr(model, "model", None)):
        said = getattr(candidate, "packed_input", None)
        if isinstance(said, bool):
            return said
    return None


def _transformers_model(model: Any) -> Any:
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if base is None:
        return None
    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, base):
            return candidate
    return None


def _builds_packed_masks(hf: Any) -> bool:
    """The model's modeling module builds its mask with ``create_causal_mask`` and this
    transformers detects packed rows in it (FSDP2 subclasses the model's class: the MRO is read)."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return False
    for cls in type(hf).__mro__:
        module = sys.modules.get(cls.__module__)
        if cls.__module__.startswith("transformers.models.") and getattr(module, "create_causal_mask", None) is not None:
            return True
    return False


def _no_cache_for_packed_rows(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A transformers model's forward pre-hook: a training forward of packed rows (position_ids, no
    attention mask) makes no KV cache."""
    if module.training and kwargs.get("position_ids") is not None and kwargs.get("attention_mask") is None:
        kwargs["use_cache"] = False
    return args, kwargs


def _no_cache_in_training(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A transformers model's forward pre-hook: a training forward makes no KV cache."""
    if module.training:
        kwargs["use_cache"] = False
    return args, kwargs


def no_cache_in_training(model: Any) -> Optional[str]:
    """Where `model` is a transformers model whose config makes a KV cache (``use_cache: true``, the
    default): its training forwards get ``use_cache=False`` (a forward pre-hook; the config, and so
    an export or generation, is left alone). A cache made in a training forward holds nothing the
    loss needs, and with each block compiled it costs the compile: every layer's slot of the cache
    is a guard of its own, so dynamo compiles the block once per layer until torch's recompile limit
    (8) and runs the other layers uncompiled (measured: transformers 5.17 Llama, 12 layers, 8 graphs
    then ``recompile_limit``). Returns the line to say, or None where nothing changed."""
    hf = _transformers_model(model)
    config = getattr(hf, "config", None)
    if hf is None or not getattr(config, "use_cache", False) or getattr(hf, "_automicro_training_no_cache", False):
        return None
    hf.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
    hf._automicro_training_no_cache = True
    return (
        f"compile: use_cache=False passed to {type(hf).__name__}'s training forwards (with its config's use_cache: true "
        "each compiled block would compile once per layer, past torch's recompile limit, and run the rest uncompiled; "
        "a training forward's KV cache holds nothing the loss needs; the config is left as it is)"
    )


@dataclass(frozen=True)
class Assessment:
    """What a model does with packed rows. `can`: it keeps attention within each packed sample;
    `skips`: it also skips the other samples' tokens (a model that says it takes packed rows, flash
    or flex attention), so packing can be faster; `line`: the console line for a pinned `packing:
    true` (what was decided and how); `why`: why packing is not measured (`can` or `skips` False)."""

    can: bool
    skips: bool
    line: str
    why: str = ""
    hf: Any = None  # the transformers model, where the cache hook goes
    how: str = ""  # what keeps the samples apart (`can`)


def assess(model: Any) -> Assessment:
    """Whether `model` takes packed rows and whether its attention skips the other samples; installs nothing."""
    declared = _declared(model)
    if declared is not None:
        if declared:
            how = "the model keeps attention within each sample: it says so"
            return Assessment(True, True, f"packing: each microbatch is one row of its samples end to end ({how}); the token "
                              "budget counts real tokens", how=how)
        return Assessment(False, False, "packing: the model says it cannot keep attention within packed samples "
                          "(packed_input = False): batches are padded as without packing",
                          "the model says it cannot keep attention within packed samples (packed_input = False)")
    hf = _transformers_model(model)
    if hf is None:
        why = (f"{type(model).__name__} does not say that it keeps attention within packed samples (set packed_input = "
               "True on the model if its forward takes position_ids restarting at each sample and masks attention by them)")
        return Assessment(False, False, f"packing: {why}: batches are padded as without packing", why)
    transformers = sys.modules["transformers"]  # the model is one of its classes: imported by the user

    config = getattr(hf, "config", None)
    impl = str(getattr(config, "_attn_implementation", None) or "")
    if _builds_packed_masks(hf):
        how = f"transformers {transformers.__version__} finds the samples from position_ids ({impl or 'default'} attention)"
    elif "flash" in impl:
        how = f"{impl} keeps the samples apart by position_ids"
    else:
        why = (f"transformers {transformers.__version__} keeps packed samples apart in {type(hf).__name__} only with "
               f"attn_implementation='flash_attention_2' (from transformers 4.54 also eager, sdpa and flex for models built "
               f"on masking_utils); this model runs {impl or 'its default attention'}")
        return Assessment(False, False, f"packing: {why}: batches are padded as without packing", why)
    cache = ""
    if (config is not None and getattr(config, "use_cache", False) and not getattr(hf, "_automicro_training_no_cache", False)
            and not getattr(hf, "_automicro_packed_no_cache", False)):
        cache = ("; use_cache=False passed to its training forwards of packed rows (a KV cache made in the forward turns "
                 "the packed-row detection off, and the samples of a row would attend to each other; the config is "
                 "left as it is)")
    dense, why = "", ""
    skips = "flash" in impl or impl == "flex_attention"
    if impl in ("sdpa", "eager", ""):
        dense = (f"; with {impl or 'this'} attention transformers masks a dense square of each row's tokens (attention "
                 "costs them squared): attn_implementation='flex_attention' or 'flash_attention_2' skips the other samples")
        why = (f"with {impl or 'its default'} attention transformers masks a dense square of each packed row's tokens "
               "(attention costs them squared); attn_implementation='flex_attention' or 'flash_attention_2' skips the "
               "other samples")
    line = (f"packing: each microbatch is one row of its samples end to end ({how}){cache}; the token budget counts real "
            f"tokens{dense}")
    return Assessment(True, skips, line, why, hf, how + cache)


def _keep_cache_off_for_packed_rows(assessment: Assessment) -> None:
    hf = assessment.hf
    config = getattr(hf, "config", None)
    if hf is None or not getattr(config, "use_cache", False) or getattr(hf, "_automicro_packed_no_cache", False):
        return
    if not getattr(hf, "_automicro_training_no_cache", False):
        hf.register_forward_pre_hook(_no_cache_for_packed_rows, with_kwargs=True)
    hf._automicro_packed_no_cache = True


def check(model: Any, info: Callable[[str], None]) -> bool:
    """`packing: true`: whether `model` takes packed rows; a line says what was decided (and what changed)."""
    assessment = assess(model)
    if assessment.can:
        _keep_cache_off_for_packed_rows(assessment)
    info(assessment.line)
    return assessment.can


def measurable(model: Any, info: Callable[[str], None]) -> bool:
    """`packing` left out with a token budget: whether packing is measured against padding once the
    budget settles (the model keeps packed samples apart and its attention skips the other samples'
    tokens); one line says which and why."""
    assessment = assess(model)
    if assessment.can and assessment.skips:
        _keep_cache_off_for_packed_rows(assessment)
        info(f"packing: measured once the token budget settles, packed rows against padded batches (packed: each "
             f"microbatch is one row of its samples end to end, {assessment.how}); packing: true or false pins it")
        return True
    info(f"packing: batches are padded ({assessment.why}); packing: true pins packing")
    return False


__all__ = ["Assessment", "assess", "check", "measurable", "no_cache_in_training"]
