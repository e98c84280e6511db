"""Tools to test auto microbatching on your own setup, shipped with the package.

- `FaultInjector`: raise at an exact site / module / rank / microbatch / size (a Composer callback).
- `MemoryCap`: CPU emulation of a per-rank allocator limit (and `MemoryCapCallback` for Composer).
- `run_multiprocess`: run a function on N local ranks under a hang watchdog.
"""

from automicro.testing.faults import FaultInjector, InjectedFault
from automicro.testing.memory_cap import MemoryCap
from automicro.testing.multiprocess import MultiprocessFailure, run_multiprocess

__all__ = ["FaultInjector", "InjectedFault", "MemoryCap", "MultiprocessFailure", "run_multiprocess"]
