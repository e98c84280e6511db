"""Imported once by the test runs' forkserver (tests/conftest.py, AUTOMICRO_MP_PRELOAD): work every
rank of a launch would otherwise redo, done once before the fork.

- Composer's first `Trainer` in a process asks py-cpuinfo for the CPU's name (`collect_env.get_cpu_model`,
  cached per process), which runs a Python subprocess: 1.4 s of the first construction's 1.7 s in each
  rank of each launch (2 cores, torch 2.7, 2026-11-29; scripts/launch_costs.py's `trainer` row).
"""

from composer.utils.collect_env import get_cpu_model

get_cpu_model()
