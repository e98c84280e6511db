"""`FSDP2Config`: every choice the engine makes, as one validated dataclass.

YAML: ``parallelism_config: {fsdp2: {...}}``; each key maps one to one onto a field here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

MIXED_PRECISION_CHOICES = ("FULL", "DEFAULT", "PURE")


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
        activation_checkpointing: recompute every wrapped block's activations in backward.
        replicate: HSDP replicate degree; the world is a ``replicate x shard`` mesh.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the host.
        wrap: ``None`` follows Composer's conventions (a module's ``_fsdp_wrap`` attribute or
            the model's ``fsdp_wrap_fn``); a list of class names wraps every module of those
            classes.
        forward_prefetch: how many following blocks each block all-gathers ahead in forward.
        backward_prefetch: how many earlier blocks each block all-gathers ahead in backward.
        unshard_async_op: issue all-gathers as async ops; the copy-in runs on the default
            stream (no inter-stream fragmentation) and the overlap comes from explicit prefetch.
    """

    reshard_after_forward: Union[bool, int] = True
    mixed_precision: str = "FULL"
    activation_checkpointing: bool = False
    replicate: int = 1
    cpu_offload: bool = False
    wrap: Optional[list[str]] = None
    forward_prefetch: int = 1
    backward_prefetch: int = 1
    unshard_async_op: bool = False

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
        for name in ("activation_checkpointing", "cpu_offload", "unshard_async_op"):
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

    @classmethod
    def from_dict(cls, values: Optional[dict[str, Any]]) -> "FSDP2Config":
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise FSDP2ConfigError(
                f"parallelism_config.fsdp2: unknown key(s) {unknown}; allowed keys are {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = ["FSDP2Config", "FSDP2ConfigError", "MIXED_PRECISION_CHOICES"]
