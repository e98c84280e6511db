"""A run that ends with a non-OOM error on rank 1 in a process whose exit then hangs (an atexit handler
that waits for ever, as torch inductor's compile-worker shutdown can): tests/test_exit_watch.py runs
it under torchrun and checks every rank's process is ended. Rank 0's `exit_timeout_s` is 10 s, rank 1's 600 s, so
which rank the exit watch ends is not a race: rank 0's watch ends it, and torchrun then ends rank 1 (torchrun
stops every worker once one exits with an error; with equal timeouts, whichever rank's watch fired second was
killed first or not, by a margin of torchrun's 0.1 s monitor interval).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/exit_watch_run.py SITE
"""

from __future__ import annotations

import atexit
import sys
import time

import torch
import torch.distributed as dist

from automicro.composer.callback import AutoMicrobatching
from automicro.testing.faults import FaultInjector
from tests.automicro_cases import build_trainer

EXIT_TIMEOUT_S = {0: 10.0, 1: 600.0}  # by rank


def main() -> None:
    site = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    auto = AutoMicrobatching(exit_timeout_s=EXIT_TIMEOUT_S[dist.get_rank()])
    fault = FaultInjector(site, ranks=[world - 1], batch=1, times=1, exception="error")
    trainer = build_trainer(world, 3, callbacks=(auto, fault))
    atexit.register(time.sleep, 3600)  # an exit that never ends
    print(f"[test] rank {dist.get_rank()} starts", flush=True)
    trainer.fit()  # raises on every rank; nothing catches it
    print(f"[test] rank {dist.get_rank()} trained on", flush=True)


if __name__ == "__main__":
    main()
