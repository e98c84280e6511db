#!/usr/bin/env python3
"""Several "nodes" on one machine: one launcher per node, as on a real multi-host job.

Each node is its own launcher process (Composer's `composer`, or `torchrun`) with its node rank,
the total world size and one rendezvous address, exactly the command line each host of a
multi-host job runs. automicro treats each launcher as a node (no shared memory across them), so
the consensus runs hierarchically and the collective ledger has no board, as across real hosts.

    # CPU, gloo: 2 nodes x 2 ranks of the main job
    python scripts/multinode.py --nodes 2 --nproc-per-node 2 -- scripts/train.py configs/tiny-cpu.yaml

    # GPU, NCCL: 2 nodes x 1 GPU, the link between the nodes through NCCL's socket transport
    python scripts/multinode.py --nodes 2 --nproc-per-node 1 --gpu --slow-link -- scripts/train.py cfg.yaml

    # the same with torchrun as the launcher
    python scripts/multinode.py --nodes 2 --nproc-per-node 2 --launcher torchrun -- scripts/train.py cfg.yaml

What each node runs is printed first (the per-host command of a real job). Every output line is
prefixed with `[node k]`. On a GPU machine node k sees GPUs k*n .. k*n+n-1 (CUDA_VISIBLE_DEVICES).
`--slow-link` gives each node its own NCCL host id (NCCL_HOSTID), so NCCL treats the nodes as
separate hosts and moves data between them over its network (socket) transport on loopback,
while the GPUs within a node keep NVLink; `--no-p2p` instead turns P2P and shared memory off for
every pair (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), the setting of the measurements in
benchmarks/RESULTS.md. When one node fails, the others get `--grace` seconds to stop on their own,
then are killed; the exit code is the first failing node's (0 when every node succeeded).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(args: argparse.Namespace, node: int, port: int) -> list[str]:
    world = args.nodes * args.nproc_per_node
    if args.launcher == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run"]
        return launcher + [
            f"--nnodes={args.nodes}", f"--node-rank={node}", f"--nproc-per-node={args.nproc_per_node}",
            f"--master-addr={args.master_addr}", f"--master-port={port}",
        ] + args.command
    launcher = [sys.executable, "-m", "composer.cli.launcher"]
    return launcher + [
        "--world_size", str(world), "--node_rank", str(node), "-n", str(args.nproc_per_node),
        "--master_addr", args.master_addr, "--master_port", str(port),
    ] + args.command


def node_env(args: argparse.Namespace, node: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("WANDB_MODE", "offline")
    env["PYTHONUNBUFFERED"] = "1"
    for stale in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "BASE_RANK"):
        env.pop(stale, None)
    if args.gpu:
        first = node * args.nproc_per_node
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(args.nproc_per_node))
    if args.slow_link:
        env["NCCL_HOSTID"] = f"automicro-simulated-node-{node}"
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_IB_DISABLE", "1")
    if args.no_p2p:
        env["NCCL_P2P_DISABLE"] = "1"
        env["NCCL_SHM_DISABLE"] = "1"
    return env


def _pump(node: int, proc: subprocess.Popen, log, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[node {node}] {line}")
            sys.stdout.flush()
            if log is not None:
                log.write(line)
                log.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="launchers to start (simulated nodes)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument("--launcher", choices=("composer", "torchrun"), default="composer")
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--gpu", action="store_true", help="give node k GPUs k*n .. k*n+n-1")
    parser.add_argument("--slow-link", action="store_true", help="NCCL: the nodes talk over sockets (own NCCL_HOSTID per node)")
    parser.add_argument("--no-p2p", action="store_true", help="NCCL: no P2P / shared memory for any pair")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds the other nodes get once one failed")
    parser.add_argument("--timeout", type=float, default=0.0, help="kill every node after this many seconds (0: never)")
    parser.add_argument("--log-dir", default=None, help="also write node k's output to LOG_DIR/node{k}.log")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training script and its arguments")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the training script after --, e.g. -- scripts/train.py configs/tiny-cpu.yaml")
    if args.nodes < 1 or args.nproc_per_node < 1:
        parser.error("--nodes and --nproc-per-node must be at least 1")
    port = args.master_port or _free_port()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    logs = []
    for node in range(args.nodes):
        command = node_command(args, node, port)
        env = node_env(args, node)
        shown = {k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "NCCL_HOSTID", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE") if k in env}
        prefix = " ".join(f"{k}={v}" for k, v in shown.items())
        print(f"[multinode] node {node}: {prefix + ' ' if prefix else ''}{shlex.join(command)}", flush=True)
        log = open(Path(args.log_dir) / f"node{node}.log", "w") if args.log_dir else None
        logs.append(log)
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(node, proc, log, lock), daemon=True)
        pump.start()
        pumps.append(pump)

    started = time.monotonic()
    first_failure: tuple[int, int] | None = None
    failed_at = 0.0
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for node, proc in enumerate(procs):
                code = proc.poll()
                if code not in (None, 0) and first_failure is None:
                    first_failure, failed_at = (node, code), now
                    print(f"[multinode] node {node} exited with {code}; the others get {args.grace:g} s", flush=True)
            if first_failure is not None and now - failed_at > args.grace:
                print("[multinode] killing the nodes still running", flush=True)
                break
            if args.timeout and now - started > args.timeout:
                print(f"[multinode] timeout after {args.timeout:g} s: killing every node", flush=True)
                first_failure = first_failure or (-1, 124)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        first_failure = first_failure or (-1, 130)
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in procs:
            proc.wait()
        for pump in pumps:
            pump.join(timeout=5)
        for log in logs:
            if log is not None:
                log.close()
    if first_failure is None:
        for node, proc in enumerate(procs):
            if proc.returncode:
                first_failure = (node, proc.returncode)
                break
    codes = [p.returncode for p in procs]
    print(f"[multinode] exit codes per node: {codes}", flush=True)
    return 0 if first_failure is None else (first_failure[1] if first_failure[1] > 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
