"""Cost of one consensus round (`Consensus.sync()`) on each transport that applies.

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/consensus.py [--rounds 5000] [--out F.json]
    # several simulated nodes (one launcher each):
    python3 scripts/multinode.py --launcher torchrun --nodes 2 --nproc-per-node 4 -- benchmarks/consensus.py --out F.json

Runs on CPU (gloo default group) or, with `--nccl`, next to an NCCL default group the way a GPU
job does (the process-group transport then uses a gloo side group). Prints the median and p90 of
per-round wall time on rank 0 for every transport that can serve the layout: shm (one node),
hierarchical (several nodes) and the flat gloo process group.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def round_times(consensus, rounds: int, warmup: int = 200) -> list[float]:
    """Seconds of each of `rounds` consensus rounds (`Consensus.sync()`), after `warmup` untimed ones."""
    for _ in range(warmup):
        consensus.sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        consensus.sync()
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5000)
    p.add_argument("--nccl", action="store_true", help="NCCL default group (GPU machine)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    from automicro.core.consensus import Consensus

    if args.nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.nccl else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from automicro.core.transport import gather_identities, node_layout

    nodes = node_layout(gather_identities(None))
    report = {"world": world, "nodes": len(nodes), "backend": dist.get_backend(), "torch": torch.__version__,
              "rounds": args.rounds, "cpus": os.cpu_count()}
    transports = ("hierarchical", "process_group") if len(nodes) > 1 else ("shm", "process_group")
    for transport in transports:
        consensus = Consensus.create(transport=transport)
        times = sorted(round_times(consensus, args.rounds))
        report[transport] = {
            "median_us": round(statistics.median(times) * 1e6, 2),
            "p90_us": round(times[int(0.9 * len(times))] * 1e6, 2),
            "mean_us": round(statistics.fmean(times) * 1e6, 2),
        }
        consensus.close()
    if rank == 0:
        print(json.dumps(report), flush=True)
        for t in transports:
            print(f"[consensus] {world} ranks on {len(nodes)} node(s) {t:14s} median {report[t]['median_us']:8.1f} us  p90 {report[t]['p90_us']:8.1f} us")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
