"""Tools to test auto microbatching on your own setup, shipped with the package.

- `FaultInjector`: raise at an exact site / module / rank / microbatch / size (a Composer callback).
- `MemoryCap`: CPU emulation of a per-rank allocator limit, and `MemoryCapCallback` (with its
  `CapMemory` memory source) to put one on a whole Composer fit.
- `RoutingSkew`: a routed model's routers biased so that most tokens of chosen batches go to one expert.
- `CheckpointFault`: break one checkpoint save (SIGKILL at a point of the save, a truncated file, a
  deleted shard, a full disk); YAML `callbacks.checkpoint_fault`.
- `run_multiprocess`: run a function on N local ranks under a hang watchdog.

The kit may import the product; no product module imports the kit at import time (the YAML
builder imports a kit callback only when a config names it).
"""

from typing import Any

# Imported on first use, like `automicro`'s own names: a `run_multiprocess` worker imports
# `automicro.testing.multiprocess`, and importing Composer there (through `callbacks`) cost every
# spawned rank about 6 s of CPU, in tests that never use Composer too.
_LAZY = {
    "CapMemory": "automicro.testing.callbacks",
    "CheckpointFault": "automicro.testing.checkpoint_faults",
    "MemoryCapCallback": "automicro.testing.callbacks",
    "FaultInjector": "automicro.testing.faults",
    "InjectedFault": "automicro.testing.faults",
    "MemoryCap": "automicro.testing.memory_cap",
    "MultiprocessFailure": "automicro.testing.multiprocess",
    "RoutingSkew": "automicro.testing.routing",
    "run_multiprocess": "automicro.testing.multiprocess",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'automicro.testing' has no attribute {name!r}")


__all__ = [
    "CapMemory",
    "CheckpointFault",
    "FaultInjector",
    "InjectedFault",
    "MemoryCap",
    "MemoryCapCallback",
    "MultiprocessFailure",
    "RoutingSkew",
    "run_multiprocess",
]
