"""Many ranks on one machine's cores: the control plane at 16 to 128 CPU ranks.

    python3 benchmarks/many_ranks.py --out DIR [--worlds 16,32,64,128] [--per-node 8] [--fuzz-world 64]

For each world size the command starts `world / per-node` launchers (`scripts/multinode.py
--launcher torchrun`, one simulated host each, gloo, no model), each of `per-node` ranks, and every
rank runs this file with `--worker`. What a rank runs is automicro's own control plane, no model:

- **rendezvous**: `init_process_group` (torchrun's store, gloo's full mesh), then `Consensus.create`
  per transport (`hierarchical`: shared memory within a host, recursive doubling among the hosts'
  leaders; `process_group`: one flat gloo all-reduce over every rank);
- **a consensus round** (`Consensus.sync()`), median and p99 over `--rounds` rounds, per transport;
- **a search**: the real `SearchPolicy` (probe, bisect, prediction) fed by the real `AttemptFence`
  and `Consensus`, over a memory model per rank (the worst rank decides: per-sample bytes drawn per
  rank with `--jitter`), with one-off OOMs injected on random ranks at random sync points
  (`--oom-rate` per attempt), `--hooks` sync points per microbatch while the hooks are on; until the
  policy is STEADY. Control plane only: no compute between sync points;
- **a steady-state rerun**: hooks off, one random rank runs out at the batch's end; the agreement,
  the rerun with the hooks on, back to STEADY (`--reruns` times);
- **fuzz** (the world `--fuzz-world` only): `--fuzz-attempts` attempts, each with random ranks failing
  (OOM or another error) at random sync points, hooks on or off; every rank must agree on every
  verdict, and the run must end (each launch runs under `--timeout`: a hang is a failed row);
- **memory per rank**: the resident set after all of it.

Rank 0 writes `DIR/wWORLD.json`; the command writes `DIR/many_ranks.json` and prints a table. The
timings are one machine's loopback and shared memory: the links between simulated hosts are not a
network's (the simulator, `automicro.core.control_sim`, takes the network's hop from public
figures).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rss_mib() -> float:
    try:
        with open("/proc/self/status", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class Driver:
    """One rank's loop: attempts under the real fence, decisions from the real policy."""

    def __init__(self, args: argparse.Namespace, consensus: Any, rank: int, world: int) -> None:
        from automicro.core import policy as search
        from automicro.core.attempt import AttemptFence
        from automicro.core.control_sim import MemoryModel
        from automicro.core.sites import AttemptContext

        self.search, self.args, self.rank, self.world = search, args, rank, world
        self.consensus = consensus
        self.context = AttemptContext()
        self.memory = MemoryModel(args.seed, rank, args.jitter)
        self.fence = AttemptFence(consensus, self.context, lambda: None)
        self.policy = search.SearchPolicy(search.PolicyConfig(probe=True), args.batch)
        self.attempt = 0

    def run_attempt(self, sizes: tuple[int, ...], hooks: bool, inject: Optional[tuple[int, int, int, str]] = None) -> Any:
        from automicro.core.control_sim import failure_plan, reported_peak, run_attempt

        self.attempt += 1
        plan = failure_plan(self.memory, sizes, self.args.hooks, self.rank, inject)
        return run_attempt(self.fence, self.consensus, self.context, sizes, hooks, self.args.hooks, plan,
                           reported_peak(self.memory, sizes, plan), self.memory.capacity)

    def observe(self, sizes: tuple[int, ...], verdict: Any) -> Any:
        search = self.search
        if verdict.failed:
            reached = [r.peak_bytes for r in verdict.reports if r.failed and r.peak_bytes > 0]
            return self.policy.observe(search.OOM(max(sizes), tuple(verdict.failed_ranks),
                                                  reached_bytes=min(reached) if reached else None,
                                                  capacity_bytes=verdict.capacity_bytes or None))
        distinct = sorted(set(sizes))[-2:]
        peaks = self.consensus.agree_max([self.memory.peak(s) for s in distinct]) if len(distinct) > 1 else ()
        return self.policy.observe(search.Success(
            max(sizes), peak_bytes=verdict.peak_bytes or None, capacity_bytes=verdict.capacity_bytes or None,
            peaks_by_size=tuple(zip(distinct, peaks)),
        ))

    def shared_draw(self, key: str) -> random.Random:
        """The same random draw on every rank (no round needed)."""
        return random.Random(f"{self.args.seed}/{key}")

    def search_until_steady(self) -> dict[str, Any]:
        search = self.search
        started, rounds0 = time.perf_counter(), self.consensus.sync_count
        attempts = ooms = 0
        while self.policy.phase != search.Phase.STEADY:
            draw = self.shared_draw(f"search/{self.attempt}")
            inject = None
            if draw.random() < self.args.oom_rate:
                inject = (draw.randrange(self.world), draw.randrange(4), draw.randrange(self.args.hooks), "oneoff")
            sizes = self.policy.current_split()
            verdict = self.run_attempt(tuple(sizes), self.policy.hooks, inject)
            attempts += 1
            ooms += int(verdict.failed)
            self.observe(tuple(sizes), verdict)
            if attempts > 200:
                raise RuntimeError("the search did not settle in 200 attempts")
        return {"seconds": time.perf_counter() - started, "attempts": attempts, "ooms": ooms,
                "rounds": self.consensus.sync_count - rounds0, "found": self.policy.found_size,
                "split": list(self.policy.current_split())}

    def steady_reruns(self, count: int) -> dict[str, Any]:
        search = self.search
        seconds, rounds = [], []
        for n in range(count):
            assert self.policy.phase == search.Phase.STEADY
            draw = self.shared_draw(f"steady/{n}")
            victim = draw.randrange(self.world)
            sizes = tuple(self.policy.current_split())
            started, rounds0 = time.perf_counter(), self.consensus.sync_count
            verdict = self.run_attempt(sizes, False, (victim, len(sizes) - 1, self.args.hooks - 1, "oneoff"))
            assert verdict.failed, "the injected steady-state OOM was not agreed"
            self.observe(sizes, verdict)
            while self.policy.phase != search.Phase.STEADY:
                sizes = tuple(self.policy.current_split())
                self.observe(sizes, self.run_attempt(sizes, self.policy.hooks))
            seconds.append(time.perf_counter() - started)
            rounds.append(self.consensus.sync_count - rounds0)
        return {"median_s": statistics.median(seconds), "rounds": statistics.median(rounds), "count": count}

    def fuzz(self, attempts: int) -> dict[str, Any]:
        digest = hashlib.sha256()
        failed = 0
        for n in range(attempts):
            draw = self.shared_draw(f"fuzz/{n}")
            micro = draw.randrange(1, 5)
            hooks = draw.random() < 0.5
            victims = draw.sample(range(self.world), draw.randrange(0, 4))
            mine = None
            if self.rank in victims:
                mine = (self.rank, draw.randrange(micro), draw.randrange(self.args.hooks),
                        "oneoff" if draw.random() < 0.8 else "error")
            from automicro.core.control_sim import MemoryModel

            self.memory = MemoryModel(self.args.seed, self.rank, 0.0, capacity=1 << 62)
            verdict = self.run_attempt((1,) * micro, hooks, mine)
            failed += int(verdict.failed)
            digest.update(repr((verdict.failed_ranks, verdict.error_ranks, verdict.failed)).encode())
            if sorted(verdict.failed_ranks) != sorted(victims):
                raise RuntimeError(f"fuzz attempt {n}: agreed {verdict.failed_ranks}, injected {sorted(victims)}")
        value = int.from_bytes(digest.digest()[:7], "big")
        high, = self.consensus.agree_max([value])
        low, = self.consensus.agree_max([(1 << 56) - 1 - value])
        return {"attempts": attempts, "failed": failed, "agreed": high == (1 << 56) - 1 - low}


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from automicro.core.consensus import Consensus
    from consensus import round_times  # benchmarks/consensus.py (this folder is on sys.path)

    if args.dump_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=True)  # a hang prints where each rank is
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    init_s = time.perf_counter() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    t1 = time.perf_counter()
    dist.barrier()
    first_collective_s = time.perf_counter() - t1
    mine: dict[str, Any] = {"rank": rank, "init_s": init_s, "first_collective_s": first_collective_s}
    transports: dict[str, Any] = {}
    for transport in args.transports.split(","):
        t = time.perf_counter()
        consensus = Consensus.create(transport=transport)
        create_s = time.perf_counter() - t
        times = round_times(consensus, args.rounds, warmup=20)
        mine[transport] = {"create_s": create_s, "median_us": statistics.median(times) * 1e6,
                           "p99_us": _pct(times, 0.99) * 1e6}
        transports[transport] = consensus
    for transport in args.transports.split(",")[: args.searched]:
        driver = Driver(args, transports[transport], rank, world)
        mine[transport]["search"] = driver.search_until_steady()
        mine[transport]["steady_rerun"] = driver.steady_reruns(args.reruns)
        if args.fuzz_attempts and transport == args.transports.split(",")[0]:
            mine["fuzz"] = driver.fuzz(args.fuzz_attempts)
    mine["rss_mib"] = _rss_mib()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        doc = summarize(every, args, world)
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(doc, handle, indent=1)
    for consensus in transports.values():
        consensus.close()
    dist.barrier()
    # Not `destroy_process_group()`: gloo's teardown of many groups sometimes outlasts the launch (seen
    # at 4 ranks on torch 2.7: one rank 40 s in it); the measurement is written, the launcher reaps us.
    sys.stdout.flush()
    os._exit(0)


def summarize(every: list[dict[str, Any]], args: argparse.Namespace, world: int) -> dict[str, Any]:
    import torch

    doc: dict[str, Any] = {
        "world": world, "per_node": args.per_node, "nodes": world // args.per_node, "cpus": os.cpu_count(),
        "torch": torch.__version__, "rounds": args.rounds, "hooks": args.hooks, "batch": args.batch,
        "init_s_max": max(r["init_s"] for r in every), "init_s_median": statistics.median(r["init_s"] for r in every),
        "first_collective_s_max": max(r["first_collective_s"] for r in every),
        "rss_mib_median": statistics.median(r["rss_mib"] for r in every), "rss_mib_max": max(r["rss_mib"] for r in every),
    }
    for transport in args.transports.split(","):
        rows = [r[transport] for r in every]
        doc[transport] = {
            "create_s_max": max(r["create_s"] for r in rows),
            "round_median_us": rows[0]["median_us"], "round_p99_us": rows[0]["p99_us"],
            "round_median_us_worst_rank": max(r["median_us"] for r in rows),
        }
        if "search" in rows[0]:
            doc[transport] |= {"search": rows[0]["search"], "search_seconds_max": max(r["search"]["seconds"] for r in rows),
                               "steady_rerun": rows[0]["steady_rerun"]}
    if "fuzz" in every[0]:
        doc["fuzz"] = every[0]["fuzz"] | {"every_rank_agreed": all(r["fuzz"]["agreed"] for r in every)}
    return doc


def drive(args: argparse.Namespace, passthrough: list[str]) -> int:
    import harness

    os.makedirs(args.out, exist_ok=True)
    root = harness.REPO_ROOT
    results, rows = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        nodes = world // args.per_node
        path = os.path.join(args.out, f"w{world}.json")
        fuzz = ["--fuzz-attempts", str(args.fuzz_attempts)] if world == args.fuzz_world else []
        command = [sys.executable, os.path.join(root, "scripts", "multinode.py"), "--launcher", "torchrun",
                   "--nodes", str(nodes), "--nproc-per-node", str(args.per_node), "--timeout", str(args.timeout),
                   "--log-dir", os.path.join(args.out, f"w{world}-logs"), "--",
                   os.path.join(root, "benchmarks", "many_ranks.py"), "--worker", "--json", path,
                   f"--dump-after={max(10.0, args.timeout - 20.0)}"] + fuzz + passthrough
        env = dict(os.environ, OMP_NUM_THREADS="1")
        started = time.perf_counter()
        proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0 or not os.path.exists(path):
            print(proc.stdout[-3000:])
            doc = {"world": world, "error": f"exit {proc.returncode} after {wall:.0f} s", "wall_s": wall}
        else:
            with open(path, encoding="utf-8") as handle:
                doc = json.load(handle)
            doc["wall_s"] = wall
        results.append(doc)
        for transport in args.transports.split(","):
            t = doc.get(transport, {})
            rows.append([world, doc.get("nodes", nodes), transport, harness.fmt(doc.get("init_s_max"), ".2f"),
                         harness.fmt(t.get("create_s_max"), ".2f"), harness.fmt(t.get("round_median_us"), ".0f"),
                         harness.fmt(t.get("round_p99_us"), ".0f"),
                         harness.fmt((t.get("search") or {}).get("seconds"), ".3f"),
                         (t.get("search") or {}).get("attempts", "-"), (t.get("search") or {}).get("rounds", "-"),
                         harness.fmt((t.get("steady_rerun") or {}).get("median_s"), ".3f"),
                         harness.fmt(doc.get("rss_mib_median"), ".0f"),
                         "ok" if (doc.get("fuzz") or {}).get("every_rank_agreed") else ("-" if "fuzz" not in doc else "DISAGREED"),
                         doc.get("error", "")])
        harness.write_json(os.path.join(args.out, "many_ranks.json"), {"results": results})
    header = ["ranks", "hosts", "transport", "init s", "create s", "round p50 us", "p99 us", "search s", "attempts",
              "rounds", "rerun s", "RSS MiB", "fuzz", "error"]
    for line in harness.table_lines(header, rows):
        print(line)
    return 0 if all("error" not in r for r in results) else 1


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    p.add_argument("--dump-after", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.environ.get("OUT", "runs/many_ranks"))
    p.add_argument("--worlds", default="16,32,64,128")
    p.add_argument("--per-node", type=int, default=8, help="ranks per simulated host")
    p.add_argument("--transports", default="hierarchical,process_group")
    p.add_argument("--searched", type=int, default=2, help="the search and the reruns run on the first N transports")
    p.add_argument("--rounds", type=int, default=500, help="consensus rounds timed per transport")
    p.add_argument("--hooks", type=int, default=12, help="sync points per microbatch while the hooks are on")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch (samples)")
    p.add_argument("--jitter", type=float, default=0.2, help="per-sample bytes vary by up to this fraction across ranks")
    p.add_argument("--oom-rate", type=float, default=0.1, help="chance per search attempt of a one-off OOM on a random rank")
    p.add_argument("--reruns", type=int, default=5, help="steady-state OOM reruns timed")
    p.add_argument("--seed", type=int, default=62)
    p.add_argument("--fuzz-world", type=int, default=64)
    p.add_argument("--fuzz-attempts", type=int, default=0, help="in the driver: attempts at --fuzz-world (default 200)")
    p.add_argument("--timeout", type=float, default=300.0, help="each launch is killed after this many seconds")
    args, rest = p.parse_known_args(argv)
    if args.worker:
        return worker(args)
    if not args.fuzz_attempts:
        args.fuzz_attempts = 200
    passthrough = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
                   ("per-node", "transports", "searched", "rounds", "hooks", "batch", "jitter", "oom-rate", "reruns", "seed")]
    return drive(args, passthrough + rest)


if __name__ == "__main__":
    raise SystemExit(main())
