"""`FSDP2Config`: every choice the engine makes, as one validated dataclass, and the one reading
of a ``parallelism_config`` mapping into it.

YAML: ``parallelism_config: {fsdp2: {...}}``; each key maps one to one onto a field here.

Owns: every check on ``parallelism_config`` / ``parallelism_config.fsdp2`` (known keys, Composer's
``state_dict_type`` redirected to ``checkpoint_format``, each value), for Python callers of
`automicro.Trainer` and for the YAML loader alike (`automicro.config` wraps `FSDP2ConfigError`
into its `ConfigError`). May not touch: Composer, `automicro.config`, anything above the engine;
torch is imported only through `_torch_internals`, lazily, for the `compute_stream_buffers` gate.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

MIXED_PRECISION_CHOICES = ("FULL", "DEFAULT", "PURE")
PARALLELISM_KEYS = ("fsdp2", "pipeline")
# `parallelism_config.pipeline.schedule` names (torch classes in `automicro.engine.pipeline`).
PIPELINE_SCHEDULES = ("1F1B", "ZeroBubble")
PIPELINE_KEY = "parallelism_config.pipeline"
# How a sharded model's checkpoints are written (`automicro.Trainer(checkpoint_format=...)`, YAML
# top-level `checkpoint_format`); here because Composer's `fsdp2.state_dict_type` is redirected to it.
CHECKPOINT_FORMATS = ("full", "sharded")
# `parallelism_config.fsdp2.on_one_rank`: what a job of one rank does with FSDP2 (`automicro.batch.one_rank`).
ON_ONE_RANK = ("auto", "keep", "unshard")
SAVE_FAILURES = ("continue", "stop")
"""What a checkpoint save that failed on any rank does: an error line and training goes on, or every rank stops."""
FSDP2_KEY = "parallelism_config.fsdp2"


class FSDP2ConfigError(ValueError):
    """A bad `parallelism_config.fsdp2` value; the message names the key and what is allowed."""


@dataclass
class FSDP2Config:
    """How the engine shards a model with torch's `fully_shard`.

    Attributes:
        reshard_after_forward: ``True`` frees unsharded parameters after forward (ZeRO-3),
            ``False`` keeps them until backward (ZeRO-2), an int ``k`` reshards to a world of
            ``k`` ranks (must divide the shard group size).
        mixed_precision: ``FULL`` (fp32 everywhere), ``DEFAULT`` (bf16 params, fp32 reduce),
            ``PURE`` (bf16 params and bf16 reduce).
        activation_checkpointing: what the wrapped blocks recompute in backward (`automicro.engine.recompute`):
            ``True`` every block's forward, ``False`` nothing, ``"op"`` each block's cheap work (its matrix
            products' and attention's outputs saved), an int ``k`` the first ``k`` blocks' forward. Under
            ``layout: auto`` what is set is tried down as well: off (``no_recompute``), and ``True`` to ``"op"``
            where off does not fit (``recompute_op``), each kept only where timed faster.
        replicate: HSDP replicate degree; the world is a ``replicate x shard`` mesh.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the host from the start (FSDP2's
            ``CPUOffloadPolicy``, pinned). Under ``auto``, ``offload: auto`` (the callback's key) switches the same
            on only where microbatch size 1 does not fit with every block recomputing (`automicro.engine.offload`).
        wrap: ``None`` follows Composer's conventions (a module's ``_fsdp_wrap`` attribute or
            the model's ``fsdp_wrap_fn``) and, where the model has neither, the block classes a
            Hugging Face model names in ``_no_split_modules``; a list of class names wraps every
            module of those classes; ``[]`` shards the root alone (with no warning).
        forward_prefetch: how many following blocks each block all-gathers ahead in forward
            (default 2: with the copy-in on the compute stream, depth 1 would make each
            all-gather wait for the previous one's copy-out; depth 2 keeps one in flight).
        backward_prefetch: how many earlier blocks each block all-gathers ahead in backward.
        unshard_async_op: issue all-gathers as async ops (default true); the copy-in runs on the
            compute stream (no inter-stream fragmentation) and the overlap comes from explicit
            prefetch.
        compute_stream_buffers: allocate FSDP2's side-stream buffers -- the flat all-gather
            outputs and the reduce-scatter outputs (with an fp32 reduce, the sharded gradients
            themselves) -- from the compute stream's caching-allocator pool instead of the
            all-gather / reduce-scatter streams' own pools, which the optimizer, activations and
            the next forward can never reuse. Streams, overlap and numerics are unchanged.
            ``None`` (default): on wherever it is supported (torch >= 2.9, ``replicate: 1``, no
            ``cpu_offload``); ``True``: required (an error says why it cannot be); ``False``:
            FSDP2's own allocation.
        expandable_segments: the CUDA caching allocator's ``expandable_segments`` mode (one
            growing segment per stream instead of many fixed ones; what closes the rest of the
            reserved/allocated gap). A process-wide allocator setting: ``None`` (default) turns
            it on when the job runs on CUDA and neither ``PYTORCH_CUDA_ALLOC_CONF`` nor
            ``PYTORCH_ALLOC_CONF`` mentions ``expandable_segments`` (an explicit choice there
            wins); ``True`` turns it on regardless; ``False`` leaves the allocator alone.
        on_one_rank: ``None`` (default): with ``auto`` on one GPU, the model unsharded is timed
            against FSDP2 once the size settles and the faster kept (`automicro.batch.
            sharding_choice`), FSDP2 elsewhere; ``auto``: that on CPU too; ``keep`` shards with
            FSDP2 on one rank too; ``unshard`` trains the model unsharded from the start when the
            job has one rank (Composer's placement and autocast, the whole model compiled), and
            with FSDP2 on several: one YAML for both. Read by the trainer (`automicro.batch.
            one_rank`), not by the engine.
        local_optimizer_step: run the optimizer step on each parameter's local shard instead of
            through DTensor (`automicro.engine.local_step`): ``None`` (default) where that gives
            the same numbers (a mesh of one rank: any optimizer; several ranks: the element-wise
            optimizers it lists); ``True``: required (an error says why it cannot be);
            ``False``: the DTensor step.
    """

    reshard_after_forward: Union[bool, int] = True
    mixed_precision: str = "FULL"
    activation_checkpointing: Union[bool, str, int] = False
    replicate: int = 1
    cpu_offload: bool = False
    wrap: Optional[list[str]] = None
    forward_prefetch: int = 2
    backward_prefetch: int = 1
    unshard_async_op: bool = True
    compute_stream_buffers: Optional[bool] = None
    expandable_segments: Optional[bool] = None
    on_one_rank: Optional[str] = None
    local_optimizer_step: Optional[bool] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        rab = self.reshard_after_forward
        if not isinstance(rab, (bool, int)) or (not isinstance(rab, bool) and rab < 1):
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2.reshard_after_forward={rab!r}: "
                "must be true, false or a positive int (the world size to reshard to)"
            )
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2.mixed_precision={self.mixed_precision!r}: "
                f"must be one of {', '.join(MIXED_PRECISION_CHOICES)}"
            )
        from automicro.engine.recompute import RecomputeConfigError, parse

        try:
            parse(self.activation_checkpointing)
        except RecomputeConfigError as error:
            raise FSDP2ConfigError(str(error)) from None
        for name in ("cpu_offload", "unshard_async_op"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise FSDP2ConfigError(f"parallelism_config.fsdp2.{name}={value!r}: must be true or false")
        for name in ("forward_prefetch", "backward_prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise FSDP2ConfigError(
                    f"parallelism_config.fsdp2.{name}={value!r}: must be an int >= 0 "
                    "(0 leaves FSDP2's implicit prefetch)"
                )
        for name in ("compute_stream_buffers", "expandable_segments", "local_optimizer_step"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise FSDP2ConfigError(
                    f"parallelism_config.fsdp2.{name}={value!r}: must be true, false or null "
                    "(null: on where supported)"
                )
        if self.on_one_rank is not None and self.on_one_rank not in ON_ONE_RANK:
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2.on_one_rank={self.on_one_rank!r}: must be null or one of {', '.join(ON_ONE_RANK)} "
                "(null: measured on one GPU; auto: measured on CPU too; keep: FSDP2 on one rank too; unshard: the model "
                "unsharded when the job has one rank)"
            )
        if isinstance(self.replicate, bool) or not isinstance(self.replicate, int) or self.replicate < 1:
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2.replicate={self.replicate!r}: must be an int >= 1 (HSDP replicate degree)"
            )
        if self.wrap is not None:
            if isinstance(self.wrap, str) or not all(isinstance(w, str) and w for w in self.wrap):
                raise FSDP2ConfigError(
                    f"parallelism_config.fsdp2.wrap={self.wrap!r}: must be a list of module class names, "
                    "or null for Composer's `_fsdp_wrap` / `fsdp_wrap_fn` conventions"
                )
            self.wrap = list(self.wrap)
        if self.compute_stream_buffers:
            from automicro.engine import _torch_internals as internals

            self.use_compute_stream_buffers(internals.TORCH_VERSION, internals.HAS_CUSTOM_COMMS)

    @property
    def rung(self) -> Any:
        """The recompute rung ``activation_checkpointing`` sets (`automicro.engine.recompute.Rung`)."""
        from automicro.engine.recompute import parse

        return parse(self.activation_checkpointing)

    def compute_stream_buffers_blocker(self, torch_version: tuple[int, int], has_api: bool) -> Optional[str]:
        """Why `compute_stream_buffers` cannot be on here, or None when it can."""
        if self.replicate > 1:
            return "is not supported with HSDP (replicate > 1): the replicate all-reduce runs on a third stream"
        if self.cpu_offload:
            return "has nothing to do with cpu_offload: true (sharded gradients live on the host)"
        if not has_api:
            return (
                f"needs torch >= 2.9 (FSDPModule.set_custom_reduce_scatter); this is torch "
                f"{torch_version[0]}.{torch_version[1]}"
            )
        return None

    def use_compute_stream_buffers(self, torch_version: tuple[int, int], has_api: bool) -> bool:
        """Resolve `compute_stream_buffers` (None = where supported); True that cannot be is an error."""
        blocker = self.compute_stream_buffers_blocker(torch_version, has_api)
        if self.compute_stream_buffers is None:
            return blocker is None
        if self.compute_stream_buffers and blocker is not None:
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2.compute_stream_buffers=true {blocker}; "
                "set it to null (on where supported) or false"
            )
        return self.compute_stream_buffers

    @classmethod
    def from_dict(cls, values: Optional[Mapping[str, Any]], key: str = FSDP2_KEY) -> "FSDP2Config":
        """Build from the mapping found at ``key`` (None or ``{}``: every default)."""
        if values is not None and not isinstance(values, Mapping):
            raise FSDP2ConfigError(f"{key}={values!r}: must be a mapping of FSDP2 settings (or {{}} for defaults)")
        values = dict(values or {})
        cls.check_keys(values, key)
        return cls(**values)

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], key: str = FSDP2_KEY) -> None:
        """Every key of ``values`` (found at ``key``) is a field; Composer's ``state_dict_type`` is
        redirected to ``checkpoint_format``."""
        known = [f.name for f in dataclasses.fields(cls)]
        for k, v in values.items():
            if k == "state_dict_type":
                fmt = v if v in CHECKPOINT_FORMATS else "sharded"
                raise FSDP2ConfigError(
                    f"{key}.{k}={v!r}: Composer's FSDP key is not used by automicro's engine; set "
                    f"checkpoint_format={fmt!r} instead (automicro.Trainer(checkpoint_format=...); YAML: "
                    f"top-level key checkpoint_format: {fmt}; one of {', '.join(CHECKPOINT_FORMATS)})"
                )
            if k not in known:
                close = difflib.get_close_matches(str(k), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise FSDP2ConfigError(f"{key}.{k}={v!r}: unknown key{hint}; allowed keys at {key}: {', '.join(known)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fsdp2_from_parallelism_config(parallelism_config: Any) -> Optional[FSDP2Config]:
    """`automicro.Trainer(parallelism_config=...)` -> the FSDP2 settings, or None (not sharded).

    ``{"fsdp2": {...}}`` (a mapping of `FSDP2Config` fields, None / ``{}`` for defaults, or an
    `FSDP2Config`); any other key is refused: automicro shards with FSDP2 only."""
    if parallelism_config is None:
        return None
    if not isinstance(parallelism_config, Mapping):
        raise FSDP2ConfigError(
            "automicro.Trainer: parallelism_config must be a dict like {'fsdp2': {...}} "
            f"(got {type(parallelism_config).__name__})"
        )
    unknown = sorted(set(parallelism_config) - set(PARALLELISM_KEYS))
    if unknown:
        raise FSDP2ConfigError(
            f"automicro.Trainer: parallelism_config keys {unknown} are not supported; automicro shards "
            "with FSDP2 (and pipelines over it): use parallelism_config={'fsdp2': {...}, 'pipeline': {...}}"
        )
    value = parallelism_config.get("fsdp2")
    if isinstance(value, FSDP2Config):
        return value
    return FSDP2Config.from_dict(value)


@dataclass
class PipelineConfig:
    """Pipeline parallelism over FSDP2 (`automicro.engine.pipeline`).

    Attributes:
        stages: pipeline stages; must divide the world size, each stage then runs on
            world/stages data-parallel ranks that shard it with FSDP2.
        schedule: ``1F1B`` or ``ZeroBubble`` (ZB1P: input and weight gradients split, the weight
            gradients fill the bubbles), torch's schedules with one stage per rank.
        keep_graph_after_input_grad: a measurement aid: keep each stage output's autograd graph
            alive until the end of the batch, the memory behaviour before torch's zero-bubble
            fix (default false).
    """

    stages: int = 2
    schedule: str = "1F1B"
    keep_graph_after_input_grad: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
            raise FSDP2ConfigError(
                f"{PIPELINE_KEY}.stages={self.stages!r}: must be an int >= 2 (leave parallelism_config.pipeline out "
                "for no pipeline)"
            )
        if self.schedule not in PIPELINE_SCHEDULES:
            close = difflib.get_close_matches(str(self.schedule), PIPELINE_SCHEDULES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise FSDP2ConfigError(
                f"{PIPELINE_KEY}.schedule={self.schedule!r}: unknown{hint}; must be one of {', '.join(PIPELINE_SCHEDULES)}"
            )
        if not isinstance(self.keep_graph_after_input_grad, bool):
            raise FSDP2ConfigError(
                f"{PIPELINE_KEY}.keep_graph_after_input_grad={self.keep_graph_after_input_grad!r}: must be true or false"
            )

    @classmethod
    def from_dict(cls, values: Any) -> "PipelineConfig":
        if isinstance(values, PipelineConfig):
            return values
        if not isinstance(values, Mapping):
            raise FSDP2ConfigError(f"{PIPELINE_KEY}={values!r}: must be a mapping like {{stages: 2, schedule: 1F1B}}")
        known = [f.name for f in dataclasses.fields(cls)]
        for k, v in values.items():
            if k not in known:
                close = difflib.get_close_matches(str(k), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise FSDP2ConfigError(f"{PIPELINE_KEY}.{k}={v!r}: unknown key{hint}; allowed keys: {', '.join(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pipeline_from_parallelism_config(parallelism_config: Any) -> Optional[PipelineConfig]:
    """`parallelism_config.pipeline` -> a `PipelineConfig`, or None (no pipeline)."""
    if not isinstance(parallelism_config, Mapping) or parallelism_config.get("pipeline") is None:
        return None
    return PipelineConfig.from_dict(parallelism_config["pipeline"])


__all__ = [
    "CHECKPOINT_FORMATS",
    "FSDP2Config",
    "FSDP2ConfigError",
    "MIXED_PRECISION_CHOICES",
    "PARALLELISM_KEYS",
    "PIPELINE_SCHEDULES",
    "PipelineConfig",
    "fsdp2_from_parallelism_config",
    "pipeline_from_parallelism_config",
]
