"""A simulator of the control plane: the real search policy and consensus protocol, simulated ranks and links.

What a search, a consensus round and a steady-state rerun cost at 512, 4,096 or 16,384 ranks cannot
be run here; it can be computed from two things this module keeps apart:

- **How many rounds** a search and a rerun take. That comes from the real code: `SearchPolicy`
  decides, `AttemptFence` and `Consensus` run every attempt (`run_attempt`, the same function the
  measured runs of `benchmarks/many_ranks.py` run on every rank). A simulated world has one memory
  model per rank (`MemoryModel`); the outcome of an attempt (which ranks run out, the worst peak) is
  taken over all of them, and the protocol itself runs on a witness world of threads (`_Witness`):
  the rank that fails first, one that does not, one more that fails. A round's count does not depend
  on how many other ranks sit in it: every rank runs the same rounds, ended by the first failure it
  sees (DESIGN.md, "consensus"), so three threads give the rounds of any world.
- **What a round costs** at a world size: `Links.round_s`, a model of the hierarchical transport
  (`automicro.core.hierarchical`): every rank of a node writes its vector, the node's leader reduces
  them (memory bandwidth), the leaders run recursive doubling (`leader_exchanges` exchanges, each a
  hop plus the vector's bytes over the link), the leader publishes. The vector is 1 + 8 x world
  int64 (`automicro.core.consensus`): it grows with the world, so a round does too, at every size
  past the point where the bytes outweigh the hops.

`ONE_MACHINE` is the model fitted to the measured runs (`benchmarks/RESULTS.md`, 2026-11-29, many ranks: 16 to 128
CPU ranks on 16 cores, hosts of 8 simulated by one launcher each), including a term for more ranks
than cores, which real hosts of 8 GPUs do not have. `projected_links` keeps the one-machine node leg
(8 ranks, shared memory, no oversubscription) and takes the link between hosts from public figures:

- a hop of gloo over TCP: 1 KB all-reduced by 2 processes on 2 servers in 0.354 ms with gloo's TCP
  transport (pytorch/gloo#158, 2018: a ring of 2 has 2 steps, so ~0.18 ms a step) — the pessimistic
  figure; 10 us application-level end to end on 10 GbE for one isolated request (Larsen, Sarangam,
  Huggahalli, "Architectural Breakdown of End-to-End Latency in a TCP/IP Network", SBAC-PAD 2007) —
  the optimistic one;
- the link's bandwidth as gloo sees it: ~1.07 GB/s all-reduce over 40 GbE (pytorch/gloo#248).

Assumptions, named: hosts of `per_node` ranks; one leader per host; no other traffic on the leaders'
link during a round (the training's own NCCL traffic shares the NIC: a loaded fabric costs more per
hop, which the pessimistic hop stands for); the store is one TCPStore server (`store_ops`); the
sync hooks' points per microbatch are `hooks` (real models: a few per FSDP2 unit); compute between
sync points is not counted (the control plane alone: what the run pays on top of its batches).

Owns: the memory model of a simulated rank, the per-rank attempt body the measured runs share, the
cost model and the projection. May not touch: the policy or the protocol (it runs them as they are),
torch beyond what the consensus needs, Composer.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np

GIB = 1 << 30
SLOTS = 8  # automicro.core.consensus.SLOTS: int64 words per rank in a round's vector


# ---- one simulated rank ------------------------------------------------------------------------


class MemoryModel:
    """A rank's peak at a microbatch: fixed bytes plus per-sample bytes drawn per rank (up to
    `jitter` above the base), so the worst rank decides, as with variable-length data."""

    def __init__(self, seed: int, rank: int, jitter: float, capacity: int = 80 * GIB,
                 fixed: int = 20 * GIB, per_sample: int = 2 * GIB) -> None:
        draw = random.Random(f"{seed}/{rank}").random()
        self.capacity, self.fixed = capacity, fixed
        self.per_sample = int(per_sample * (1.0 + jitter * draw))

    def peak(self, size: int) -> int:
        return self.fixed + self.per_sample * size

    def fits(self, size: int) -> bool:
        return self.peak(size) <= self.capacity


def failure_plan(memory: MemoryModel, sizes: tuple[int, ...], hooks: int, rank: int,
                 inject: Optional[tuple[int, int, int, str]]) -> Optional[tuple[int, int, str]]:
    """Where `rank` fails in an attempt at `sizes`: (microbatch, sync point, kind), or None. Kinds:
    "oom" at the first microbatch that does not fit (half-way through it); `inject` is (rank,
    microbatch, sync point, kind) for a failure of that rank where it fits: "oneoff" (out of memory
    once: fragmentation, a spike) or "error" (anything else)."""
    for index, size in enumerate(sizes):
        if not memory.fits(size):
            return index, hooks // 2, "oom"
    if inject is not None and inject[0] == rank:
        return inject[1] % len(sizes), inject[2], inject[3]
    return None


def reported_peak(memory: MemoryModel, sizes: tuple[int, ...], plan: Optional[tuple[int, int, str]]) -> int:
    """The peak a rank reports for an attempt: the largest microbatch's where it did not fail; where it
    ran out (not fitting, or a one-off spike), the capacity less the allocation that failed (a quarter
    sample); the failing microbatch's peak where an error stopped it."""
    if plan is None:
        return memory.peak(max(sizes))
    if plan[2] in ("oom", "oneoff"):
        return memory.capacity - memory.per_sample // 4
    return memory.peak(sizes[plan[0]])


def run_attempt(fence: Any, consensus: Any, context: Any, sizes: tuple[int, ...], hooks_on: bool, hooks: int,
                plan: Optional[tuple[int, int, str]], peak: int, capacity: int) -> Any:
    """One attempt on one rank under the real `AttemptFence`: `hooks` sync points per microbatch
    (`Consensus.sync()` while `hooks_on`), the failure `plan` raised where it says; returns the verdict."""
    import torch

    from automicro.core.consensus import LocalFigures

    context.attempt += 1

    def body(finish: Callable[[], None]) -> None:
        for index in range(len(sizes)):
            context.microbatch_index = index
            for point in range(hooks):
                context.last_site = "forward" if point < hooks // 2 else "backward"
                if plan is not None and plan[:2] == (index, point):
                    if plan[2] in ("oom", "oneoff"):
                        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
                    raise RuntimeError("simulated error")
                if hooks_on:
                    consensus.sync()
        finish()

    figures = LocalFigures(peak_bytes=peak, capacity_bytes=capacity)
    fence.figures = lambda: figures
    return fence.run(body, lambda: None, hooks_active=hooks_on).verdict


# ---- the protocol on a witness world of threads ----------------------------------------------


class _ThreadTransport:
    """MAX over the witness threads: a barrier, a shared maximum, a barrier."""

    name = "threads"

    def __init__(self, world: int, length: int) -> None:
        self._barrier = threading.Barrier(world)
        self._lock = threading.Lock()
        self._result = np.zeros(length, dtype=np.int64)
        # Rounds in which a rank that did not fail sent its figures (a finish round, `agree_max`): over a
        # whole world every rank's words are set, so the leaders send the whole vector (`hierarchical`).
        self.dense_rounds = 0
        self._dense = False

    def describe(self) -> str:
        return "threads"

    def max_reduce(self, vec: np.ndarray, timeout_s: Optional[float] = None) -> np.ndarray:
        if self._barrier.wait(timeout=60) == 0:
            self._result.fill(np.iinfo(np.int64).min)
            self._dense = False
        self._barrier.wait(timeout=60)
        slots = vec[1:].reshape(-1, SLOTS)
        with self._lock:
            np.maximum(self._result, vec, out=self._result)
            self._dense = self._dense or bool(((slots[:, 0] == 0) & slots[:, 1:].any(axis=1)).any())
        if self._barrier.wait(timeout=60) == 0 and self._dense:
            self.dense_rounds += 1
        out = self._result.copy()
        self._barrier.wait(timeout=60)
        return out

    def close(self) -> None:
        return None


class _Witness:
    """Three ranks that run the real protocol: their rounds are the rounds of the whole world."""

    def __init__(self, world: int = 3) -> None:
        from automicro.core.attempt import AttemptFence
        from automicro.core.consensus import Consensus
        from automicro.core.sites import AttemptContext

        transport = _ThreadTransport(world, 1 + SLOTS * world)
        self.transport = transport
        self.ranks = []
        for rank in range(world):
            consensus = Consensus(group=None, world_size=world, rank=rank, transport=transport)
            context = AttemptContext()
            self.ranks.append((consensus, context, AttemptFence(consensus, context, lambda: None)))

    def attempt(self, sizes: tuple[int, ...], hooks_on: bool, hooks: int,
                plans: list[Optional[tuple[int, int, str]]], peak: int, capacity: int) -> tuple[int, int, bool]:
        """Rounds the attempt took, how many of them dense, and whether it was agreed failed."""
        before, dense_before = self.ranks[0][0].sync_count, self.transport.dense_rounds
        results: list[Any] = [None] * len(self.ranks)
        errors: list[BaseException] = []

        def one(index: int) -> None:
            consensus, context, fence = self.ranks[index]
            try:
                results[index] = run_attempt(fence, consensus, context, sizes, hooks_on, hooks, plans[index], peak, capacity)
            except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(error)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(self.ranks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        if errors:
            raise errors[0]
        if any(thread.is_alive() for thread in threads):
            raise RuntimeError("the witness ranks did not end their attempt: the protocol hung")
        failed = {bool(v.failed) for v in results}
        assert len(failed) == 1, "the witness ranks disagree on the verdict"
        return self.ranks[0][0].sync_count - before, self.transport.dense_rounds - dense_before, failed.pop()


# ---- the cost of a round ---------------------------------------------------------------------


def leader_exchanges(nodes: int) -> int:
    """Exchanges in the leaders' recursive doubling (`hierarchical._RecursiveDoubling`): log2 of the
    largest power of two in `nodes`, and two more (fold in, send back) where `nodes` is not one."""
    if nodes <= 1:
        return 0
    p = 1 << (nodes.bit_length() - 1)
    return int(math.log2(p)) + (2 if p != nodes else 0)


def vector_bytes(world: int) -> int:
    return 8 * (1 + SLOTS * world)


HEADER_BYTES = 8 * (1 + 2 * 64)  # the leaders' sparse header (`hierarchical._RecursiveDoubling.SPARSE_PAIRS` = 64)


@dataclass(frozen=True)
class Links:
    """What one consensus round costs, in parts (seconds; bytes per second)."""

    node_s: float  # a node's shared-memory leg (write, gather, publish) for a small vector
    hop_s: float  # one exchange between two hosts' leaders, small message
    link_bytes_per_s: float  # between hosts, as gloo moves a round's vector
    memory_bytes_per_s: float = 4e9  # a node's slots written and max-reduced by its leader
    per_extra_rank_s: float = 0.0  # one machine: per round, per rank beyond one per core
    cores: int = 0  # 0: a core for every rank (real hosts)
    store_op_s: float = 50e-6  # one request served by the launcher's TCPStore (libuv server)

    def round_s(self, world: int, per_node: int = 8, dense: bool = True) -> float:
        """One round over `world` ranks in hosts of `per_node`; `dense`: every rank's words are set (a
        finish round), so the leaders send the whole vector; else a sync round, whose leaders send the
        header alone where it is the shorter (`hierarchical._RecursiveDoubling.SPARSE_PAIRS`)."""
        nodes = max(1, math.ceil(world / per_node))
        vec = vector_bytes(world)
        node = self.node_s + per_node * vec / self.memory_bytes_per_s if per_node > 1 else 0.0
        sent = vec if dense else min(vec, HEADER_BYTES)
        leaders = leader_exchanges(nodes) * (self.hop_s + sent / self.link_bytes_per_s)
        crowd = self.per_extra_rank_s * max(0.0, world / self.cores - 1.0) * self.cores if self.cores else 0.0
        return node + leaders + crowd


# Fitted to the measured runs of many ranks on one machine (`benchmarks/RESULTS.md`: a round's median, a search's and a
# steady-state rerun's seconds per round, at 16, 32, 64 and 128 CPU ranks on 16 cores, hosts of 8): three
# numbers (the node leg, a loopback hop, the cost of a rank beyond one per core) for twelve, the largest
# error 19%, but for the 16-rank rerun (20 ms in all, 41% below the model; `tests/test_control_sim.py`).
ONE_MACHINE = Links(node_s=227e-6, hop_s=150e-6, link_bytes_per_s=1e9, per_extra_rank_s=86.5e-6, cores=16)

HOPS = {"optimistic": 10e-6, "pessimistic": 180e-6}  # the public figures (module docstring)
LINK_BYTES_PER_S = 1.07e9  # pytorch/gloo#248


def projected_links(hop: str = "pessimistic") -> Links:
    """Real hosts: the measured node leg, no oversubscription, the link from public figures."""
    return replace(ONE_MACHINE, hop_s=HOPS[hop], link_bytes_per_s=LINK_BYTES_PER_S, per_extra_rank_s=0.0, cores=0)


# ---- the store --------------------------------------------------------------------------------


def store_ops(world: int, per_node: int = 8, ranks_in_failure: int = 1) -> dict[str, int]:
    """Requests the launcher's one TCPStore serves, counted from what automicro does with it. At start:
    gloo connects a group through the store (each member publishes its address and reads every other
    member's), so a group of n costs n x n reads; a group made with every rank calling `new_group`
    also runs a barrier over the world through the store (two requests a rank). Per steady-state failure
    across hosts: the collective ledger's board (`automicro.core.store_board`): the failing rank writes
    a notice to every other rank (two requests each), and every rank's listener answers (three)."""
    nodes = max(1, math.ceil(world / per_node))
    return {
        # a CPU side group over every rank (an NCCL job's consensus group; the board's exchange group)
        "world_group": world * world,
        # before the fix measured there: every rank made every node's group and the leaders' (a world barrier each)
        "every_node_group": nodes * per_node * per_node + nodes * nodes + 2 * world * (nodes + 1),
        # since: each rank makes only its own groups, synchronized among their members
        "own_groups": nodes * per_node * per_node + nodes * nodes,
        "failure_notice": 2 * (world - 1) * ranks_in_failure + 3 * world,
    }


# ---- a whole search, a rerun ------------------------------------------------------------------


@dataclass
class SimResult:
    attempts: int
    rounds: int
    ooms: int
    found: Optional[int]
    seconds: float
    dense_rounds: int = 0  # of `rounds`, those that carry every rank's figures (finish rounds, `agree_max`)


def _seconds(links: Links, world: int, per_node: int, rounds: int, dense: int) -> float:
    return (rounds - dense) * links.round_s(world, per_node, dense=False) + dense * links.round_s(world, per_node)


class Simulation:
    """One simulated world: `world` ranks in hosts of `per_node`, each with its memory model; the
    same seeds as `benchmarks/many_ranks.py`, so a measured world and its simulation take the same
    decisions."""

    def __init__(self, world: int, per_node: int = 8, seed: int = 62, jitter: float = 0.2, oom_rate: float = 0.1,
                 hooks: int = 12, batch: int = 32) -> None:
        from automicro.core import policy as search

        self.search, self.world, self.per_node = search, world, per_node
        self.seed, self.oom_rate, self.hooks = seed, oom_rate, hooks
        self.memory = [MemoryModel(seed, rank, jitter) for rank in range(world)]
        self.worst = max(self.memory, key=lambda m: m.per_sample)
        self.capacity = self.worst.capacity
        self.policy = search.SearchPolicy(search.PolicyConfig(probe=True), batch)
        self.witness = _Witness()
        self.dense_rounds = 0  # rounds so far that carried every rank's figures
        self.attempt_count = 0  # the measured driver's attempt counter: the shared draws' key

    def _draw(self, key: str) -> random.Random:
        return random.Random(f"{self.seed}/{key}")

    def _attempt(self, sizes: tuple[int, ...], hooks_on: bool, inject: Optional[tuple[int, int, int, str]]) -> tuple[int, Any]:
        """Rounds, and the verdict's (failed ranks, reached) for the policy, over the whole world."""
        self.attempt_count += 1
        plans = {}
        for rank in range(self.world):
            plan = failure_plan(self.memory[rank], sizes, self.hooks, rank, inject)
            if plan is not None:
                plans[rank] = plan
        failing = sorted(plans, key=lambda r: (plans[r][0], plans[r][1], r))
        fine = next((r for r in range(self.world) if r not in plans), None)
        # The witnesses: the first to fail, one that does not, the next to fail (or more that do not).
        chosen = failing[:1] + ([fine] if fine is not None else []) + failing[1:2]
        while len(chosen) < 3:
            chosen.append(fine if fine is not None else failing[-1])
        witness_plans = [plans.get(r) for r in chosen[:3]]
        peak = max(m.peak(max(sizes)) for m in self.memory)
        rounds, dense, failed = self.witness.attempt(sizes, hooks_on, self.hooks, witness_plans, peak, self.capacity)
        self.dense_rounds += dense
        if not hooks_on:
            # Hooks off: every rank runs to its own failure, so every planned failure is reported.
            reported = failing
        else:
            first = plans[failing[0]][:2] if failing else None
            reported = [r for r in failing if plans[r][:2] == first]
        assert failed == bool(reported)
        reached = [reported_peak(self.memory[r], sizes, plans[r]) for r in reported]
        return rounds, (tuple(sorted(reported)), min(reached) if reached else None)

    def _observe(self, sizes: tuple[int, ...], outcome: Any) -> int:
        """Feed the policy; returns the extra rounds (the probe's peaks by size: one `agree_max`)."""
        search = self.search
        failed, reached = outcome
        if failed:
            self.policy.observe(search.OOM(max(sizes), failed, reached_bytes=reached, capacity_bytes=self.capacity))
            return 0
        distinct = sorted(set(sizes))[-2:]
        peaks = tuple(max(m.peak(s) for m in self.memory) for s in distinct) if len(distinct) > 1 else ()
        self.policy.observe(search.Success(
            max(sizes), peak_bytes=max(m.peak(max(sizes)) for m in self.memory), capacity_bytes=self.capacity,
            peaks_by_size=tuple(zip(distinct, peaks)),
        ))
        agreed = 1 if len(distinct) > 1 else 0  # one `agree_max` round, every rank's peaks: dense
        self.dense_rounds += agreed
        return agreed

    def search_until_steady(self, links: Links) -> SimResult:
        search = self.search
        attempts = rounds = ooms = 0
        dense0 = self.dense_rounds
        while self.policy.phase != search.Phase.STEADY:
            draw = self._draw(f"search/{self.attempt_count}")
            inject = None
            if draw.random() < self.oom_rate:
                inject = (draw.randrange(self.world), draw.randrange(4), draw.randrange(self.hooks), "oneoff")
            sizes = tuple(self.policy.current_split())
            used, outcome = self._attempt(sizes, self.policy.hooks, inject)
            rounds += used + self._observe(sizes, outcome)
            attempts += 1
            ooms += int(bool(outcome[0]))
            if attempts > 200:
                raise RuntimeError("the simulated search did not settle in 200 attempts")
        dense = self.dense_rounds - dense0
        return SimResult(attempts, rounds, ooms, self.policy.found_size,
                         _seconds(links, self.world, self.per_node, rounds, dense), dense)

    def steady_rerun(self, links: Links, n: int = 0) -> SimResult:
        """One steady-state OOM on a random rank at the batch's end, agreed, rerun until STEADY again."""
        search = self.search
        assert self.policy.phase == search.Phase.STEADY
        victim = self._draw(f"steady/{n}").randrange(self.world)
        dense0 = self.dense_rounds
        sizes = tuple(self.policy.current_split())
        used, outcome = self._attempt(sizes, False, (victim, len(sizes) - 1, self.hooks - 1, "oneoff"))
        rounds, attempts = used + self._observe(sizes, outcome), 1
        while self.policy.phase != search.Phase.STEADY:
            sizes = tuple(self.policy.current_split())
            used, outcome = self._attempt(sizes, self.policy.hooks, None)
            rounds += used + self._observe(sizes, outcome)
            attempts += 1
        dense = self.dense_rounds - dense0
        return SimResult(attempts, rounds, 1, self.policy.found_size,
                         _seconds(links, self.world, self.per_node, rounds, dense), dense)


def project(worlds: tuple[int, ...] = (512, 4096, 16384), per_node: int = 8, hop: str = "pessimistic",
            batch_s: float = 1.0, reruns: int = 5, **kwargs: Any) -> list[dict[str, Any]]:
    """The projection table: per world, a round, a whole search and a steady-state rerun. A search's
    cost on a 1,000-batch run of `batch_s` a batch is its rounds plus the batches its OOMs threw
    away (each failed attempt's compute, taken as a whole batch); a rerun's, its rounds plus the
    batch it reruns."""
    links = projected_links(hop)
    rows = []
    for world in worlds:
        sim = Simulation(world, per_node, **kwargs)
        found = sim.search_until_steady(links)
        again = [sim.steady_rerun(links, n) for n in range(reruns)]
        rerun = sorted(again, key=lambda r: r.rounds)[len(again) // 2]
        rows.append({
            "world": world, "hosts": math.ceil(world / per_node), "hop": hop,
            "round_ms": 1e3 * links.round_s(world, per_node, dense=False),
            "finish_round_ms": 1e3 * links.round_s(world, per_node),
            "vector_kib": vector_bytes(world) / 1024,
            "search_attempts": found.attempts, "search_ooms": found.ooms, "search_rounds": found.rounds,
            "search_dense_rounds": found.dense_rounds,
            "search_control_s": found.seconds,
            "search_share_of_1000_batches": (found.seconds + found.ooms * batch_s) / (1000 * batch_s),
            "rerun_rounds": rerun.rounds, "rerun_control_s": rerun.seconds, "rerun_s": rerun.seconds + batch_s,
            "store_ops": store_ops(world, per_node),
        })
    return rows


__all__ = ["Links", "MemoryModel", "ONE_MACHINE", "SimResult", "Simulation", "failure_plan", "leader_exchanges",
           "project", "projected_links", "reported_peak", "run_attempt", "store_ops", "vector_bytes"]
