"""All-gather bus bandwidth between the ranks (nccl-tests' definition), per message size.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/link_probe.py --out DIR

Prints and writes DIR/link_probe.json. Run it once per link (again with NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1 for NCCL's socket transport): the figure that says how slow a "slow link" is in
benchmarks/RESULTS.md. Every rank takes the slowest rank's time.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def all_gather_gbps(device: torch.device, nbytes: int, iters: int = 5) -> float:
    """Bus bandwidth in GB/s of an all-gather whose output is `nbytes` (bf16), slowest rank's."""
    size, rank = dist.get_world_size(), dist.get_rank()
    numel = max(size, nbytes // 2 // size * size)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    chunk = out.chunk(size)[rank].clone()
    dist.all_gather_into_tensor(out, chunk)  # warm-up: connections, buffers
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_gather_into_tensor(out, chunk)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    slowest = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return numel * 2 * (size - 1) / size / float(slowest.item()) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes-mib", default="4,16,64,256")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = {mib: all_gather_gbps(device, mib << 20) for mib in (int(x) for x in args.sizes_mib.split(","))}
    if dist.get_rank() == 0:
        env = {k: os.environ[k] for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_HOSTID") if k in os.environ}
        for mib, gbps in rows.items():
            print(f"[link_probe] {mib:4d} MiB all-gather: {gbps:8.2f} GB/s bus bandwidth  {env}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "link_probe.json"), "w") as f:
            json.dump({"world": dist.get_world_size(), "env": env, "bus_gbps_by_mib": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
