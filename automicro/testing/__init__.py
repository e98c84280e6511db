"""Tools to test auto microbatching on your own setup, shipped with the package.

- `FaultInjector`: raise at an exact site / module / rank / microbatch / size (a Composer callback).
- `MemoryCap`: CPU emulation of a per-rank allocator limit, and `MemoryCapCallback` (with its
  `CapMemory` memory source) to put one on a whole Composer fit.
- `run_multiprocess`: run a function on N local ranks under a hang watchdog.

The kit may import the product; no product module imports the kit at import time (the YAML
builder imports a kit callback only when a config names it).
"""

from automicro.testing.callbacks import CapMemory, MemoryCapCallback
from automicro.testing.faults import FaultInjector, InjectedFault
from automicro.testing.memory_cap import MemoryCap
from automicro.testing.multiprocess import MultiprocessFailure, run_multiprocess

__all__ = [
    "CapMemory",
    "FaultInjector",
    "InjectedFault",
    "MemoryCap",
    "MemoryCapCallback",
    "MultiprocessFailure",
    "run_multiprocess",
]
