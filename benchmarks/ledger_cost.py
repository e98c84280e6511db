"""What the collective ledger costs per collective when nothing fails (host time, CPU).

    python benchmarks/ledger_cost.py [--calls 20000] [--rounds 5]

One process with a gloo process group (so the ledger reads c10d's sequence numbers, as in a real
run) and a shared-memory board: times `ledger.before()` + `ledger.after()` around no collective
at all, i.e. exactly the work the ledger adds in front of each FSDP2 collective. Prints the
median over rounds in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from automicro.core.ledger import Board, CollectiveLedger
    from automicro.testing.multiprocess import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    board = Board.create(None)
    ledger = CollectiveLedger(board, [dist.group.WORLD], torch.device("cpu"), poll_s=0.2)
    tensor = torch.zeros(1024, dtype=torch.bfloat16)
    per_call = []
    for _ in range(args.rounds):
        ledger.begin_attempt(stop_early=True)
        started = time.perf_counter()
        for _ in range(args.calls):
            ledger.before("all_gather", tensor, None, None)
            ledger.after()
        per_call.append((time.perf_counter() - started) / args.calls * 1e6)
    ledger.close()
    dist.destroy_process_group()
    print(f"ledger before()+after(): median {statistics.median(per_call):.2f} us per collective "
          f"(rounds: {', '.join(f'{x:.2f}' for x in per_call)}; torch {torch.__version__})")


if __name__ == "__main__":
    main()
