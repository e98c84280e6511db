"""The callbacks a config may name: one registry, ``name -> "module:attribute"``.

    callbacks: {speed_monitor: {}, memory_cap: {limit_bytes: 6000000}}

Owns: the list of callback names (the config accepts exactly these keys under ``callbacks:``)
and where each class lives. Strings only: nothing is imported here, so reading a config imports
neither Composer nor the fault kit; `automicro.composer.builders` imports a class when a
config asks for it (the fault kit's callbacks come from `automicro.testing`, only then).
May not touch: any import of what it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

CALLBACK_REGISTRY: Mapping[str, str] = MappingProxyType(
    {
        "speed_monitor": "composer.callbacks:SpeedMonitor",
        "memory_monitor": "composer.callbacks:MemoryMonitor",
        "lr_monitor": "composer.callbacks:LRMonitor",
        "runtime_estimator": "composer.callbacks:RuntimeEstimator",
        "auto_microbatching": "automicro.composer.callback:AutoMicrobatching",
        "fault_injector": "automicro.testing.faults:FaultInjector",
        "memory_cap": "automicro.testing.callbacks:MemoryCapCallback",
        "checkpoint_fault": "automicro.testing.checkpoint_faults:CheckpointFault",
        "routing_skew": "automicro.testing.routing:RoutingSkew",
    }
)
"""Callback name (the YAML key under ``callbacks:``) -> ``"module:attribute"`` of its class."""

KNOWN_CALLBACKS: tuple[str, ...] = tuple(CALLBACK_REGISTRY)
"""The registry's names (kept for compatibility: derived, not a second list)."""

__all__ = ["CALLBACK_REGISTRY", "KNOWN_CALLBACKS"]
