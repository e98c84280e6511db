"""Tests of automicro.testing: the multi-process runner (`run_multiprocess`) and `MemoryCap`.

Worker functions are at module top level: the runner pickles them by reference. The tests use the
default spawn start method; one test also covers the opt-in forkserver one.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from automicro.testing.memory_cap import MemoryCap
from automicro.testing.multiprocess import MultiprocessFailure, free_port, run_multiprocess



# ------------------------------------------------------------------------------------------------
# worker functions (top level: pickled by reference)
# ------------------------------------------------------------------------------------------------


def _allreduce_and_env(rank, world_size, scale, *, tag):
    t = torch.tensor([float(rank)]) * scale
    dist.all_reduce(t)
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                          "LOCAL_WORLD_SIZE", "NODE_RANK", "AUTOMICRO_TEST_VAR")}
    return dict(rank=rank, world_size=world_size, dist_rank=dist.get_rank(), total=t.item(), tag=tag, env=env)


def _imported_at_entry(rank, world_size):
    """What the rank had imported before `fn` ran: the forkserver's preload (this module imports
    torch only at its top; unpickling `fn` imports it)."""
    return {m: m in sys.modules for m in ("composer", "automicro.composer.trainer", "automicro.models")}


def _wait_in_barrier():
    dist.barrier()  # rank 1 never enters


def _sleep_forever():
    while True:
        time.sleep(0.2)


def _hang(rank, world_size):
    if rank == 0:
        _wait_in_barrier()
    else:
        _sleep_forever()


def _raise_on_rank1_other_in_collective(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # waits for rank 1, which never comes
    return t.item()


def _raise_on_rank1_other_sleeps(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1, rank 0 sleeps")
    _sleep_forever()


def _exit_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _fsdp_mlp_under_cap(rank, world_size, limits, steps):
    """Two steps of a fully_shard-ed MLP (forward, backward, Adam) with a MemoryCap active."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cap = MemoryCap(limits)
    sharded_param_bytes = sum(p.to_local().nbytes for p in model.parameters())
    tracked = cap.track_existing(model)
    x = torch.randn(32, 64)
    phases = []
    try:
        with cap:
            for _ in range(steps):
                out = model(x)
                phases.append(("forward", cap.stats()["live_bytes"]))
                out.sum().backward()
                phases.append(("backward", cap.stats()["live_bytes"]))
                opt.step()
                opt.zero_grad()
                del out
                phases.append(("step", cap.stats()["live_bytes"]))
    except torch.OutOfMemoryError as e:
        return dict(oom=str(e), stats=cap.stats())
    return dict(oom=None, stats=cap.stats(), phases=phases, tracked=tracked,
                sharded_param_bytes=sharded_param_bytes, resize_patched="resize_" in torch.UntypedStorage.__dict__,
                completes=_gloo_works_say_they_completed())


def _gloo_works_say_they_completed() -> dict:
    """For each collective FSDP2 and the consensus run, whether its gloo work said it completed once waited on, and
    whether `_torch_internals.work_reports_completion` (which the cap's holding follows) says it does."""
    import time

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from automicro.engine._torch_internals import collective_work, work_reports_completion

    class Works(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.last = (func, collective_work(func, out))
            return out

    x = torch.ones(64)
    runs = {
        "all_reduce": lambda: dist.all_reduce(x, async_op=True),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(128), x, async_op=True),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(32), x, async_op=True),
        "broadcast": lambda: dist.broadcast(x, 0, async_op=True),
    }
    out = {}
    for name, run in runs.items():
        with Works() as mode:
            work = run()
        work.wait()
        func, seen = mode.last
        deadline = time.monotonic() + 5.0  # gloo's worker marks it a moment after wait() returns
        while not seen.is_completed() and time.monotonic() < deadline and work_reports_completion(func):
            time.sleep(0.001)
        out[name] = (seen.is_completed(), work_reports_completion(func))
    return out


def _in_flight_collective_dropped(rank, world_size):
    """Rank 0 drops an all-gather's output, input and work before rank 1 joined it; gloo's worker completes it later
    and drops the work. The cap counts the buffers until the work is gone and frees them on rank 0's own thread."""
    cap = MemoryCap(1 << 30)
    with cap:
        if rank == 1:
            time.sleep(1.0)  # joins after rank 0 dropped everything
        out = torch.empty(2_000_000)  # 8 MB
        inp = out.narrow(0, rank * 1_000_000, 1_000_000).fill_(rank + 1.0)  # FSDP2's shape: the input a view of it
        work = dist.all_gather_into_tensor(out, inp, async_op=True)
        if rank == 0:
            del out, inp, work
            torch.empty(1)  # a check with the collective in flight
            time.sleep(2.0)  # the GIL free, off any collective: where rank 1 joins by then, the worker completes it here
        else:
            work.wait()
            del out, inp, work
        dist.barrier()  # the all-gather completed on both ranks (gloo's barrier waits for the work before it)
        for _ in range(3000):  # checks until gloo's worker dropped the work (at once as a rule; bounded, not timed)
            torch.empty(1)
            if not cap._collectives:
                break
            time.sleep(0.01)
        s = cap.stats()
    return dict(live=s["live_bytes"], foreign=s["foreign_frees"], ops=s["foreign_ops"])

# ------------------------------------------------------------------------------------------------
# run_multiprocess
# ------------------------------------------------------------------------------------------------


def test_free_port_draws_from_a_slice_of_its_own_below_the_ephemeral_range_and_skips_a_busy_port(monkeypatch):
    """Concurrent pytest-xdist workers never draw the same rendezvous port (a race between two test
    files' launches failed one with EADDRINUSE on 16 workers): each worker's slice is its own, the
    OS's ephemeral ports (port 0, outgoing connections) lie above, and a port in use is passed over."""
    import socket

    from automicro.testing import multiprocess as mp

    monkeypatch.setattr(mp, "_next_port", None)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    width = (mp._ephemeral_start() - mp._PORT_BASE) // mp._PORT_SLICES
    assert width >= 16
    ours = mp._port_slice(width)
    first, second = free_port(), free_port()
    assert first in ours and second in ours and first != second
    assert ours.stop <= mp._ephemeral_start()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw4")
    assert not set(ours) & set(mp._port_slice(width))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0 if not mp._bindable("127.0.0.1", mp._next_port) else mp._next_port))
        busy.listen()
        taken = busy.getsockname()[1]
        port = free_port()
        assert port != taken and port in ours


def test_the_forkserver_preloads_what_the_tests_launches_import_and_spawn_does_not(monkeypatch):
    """A 2-rank launch's fixed cost: the forkserver's workers find Composer, automicro's Composer
    integration and the tiny models imported (tests/conftest.py's AUTOMICRO_MP_PRELOAD; before, each
    rank of each launch imported Composer after the fork: ~4.5 s on 2 cores); a spawned worker starts
    without them. `_preload` adds what the caller imported of `_PRELOAD_IF_IMPORTED` and `fn`'s module."""
    from automicro.testing import multiprocess as mp

    assert os.environ.get("AUTOMICRO_MP_PRELOAD"), "tests/conftest.py sets it"
    forked = run_multiprocess(_imported_at_entry, world_size=2, start_method="forkserver", timeout_s=120)
    assert forked == [{"composer": True, "automicro.composer.trainer": True, "automicro.models": True}] * 2
    spawned = run_multiprocess(_imported_at_entry, world_size=1, start_method="spawn", timeout_s=120)
    assert spawned == [{"composer": False, "automicro.composer.trainer": False, "automicro.models": False}]
    monkeypatch.setenv("AUTOMICRO_MP_PRELOAD", " a.b , c ")
    monkeypatch.setitem(sys.modules, "tests.some_cases", sys.modules[__name__])
    wanted = mp._preload(["x"], "tests.some_cases")
    assert wanted[:3] == ["torch", "torch.distributed", "automicro.testing.multiprocess"]
    assert wanted[3:6] == ["x", "a.b", "c"] and wanted[-1] == "tests.some_cases"
    assert "composer" not in wanted or "composer" in sys.modules
    monkeypatch.setitem(sys.modules, "composer", sys.modules.get("composer") or sys.modules[__name__])
    assert "composer" in mp._preload([], None)  # the caller imported it: the ranks will
    assert "tests.not_imported_cases" not in mp._preload([], "tests.not_imported_cases")
    assert "__main__" not in mp._preload([], "__main__")


def test_unpicklable_fn_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(TypeError, match="top-level function"):
        run_multiprocess(lambda rank, ws: rank, world_size=2)
    assert time.monotonic() - t0 < 1


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size,start_method", [(2, "spawn"), (4, "forkserver")])
def test_results_by_rank(world_size, start_method):
    results = run_multiprocess(
        _allreduce_and_env, world_size=world_size, args=(2.0,), kwargs=dict(tag="t"), timeout_s=60,
        env={"AUTOMICRO_TEST_VAR": "yes"}, start_method=start_method,
    )
    assert len(results) == world_size
    expected_total = 2.0 * sum(range(world_size))
    for rank, res in enumerate(results):
        assert res["rank"] == res["dist_rank"] == rank
        assert res["world_size"] == world_size
        assert res["total"] == expected_total
        assert res["tag"] == "t"
        assert res["env"] == {
            "MASTER_ADDR": "127.0.0.1", "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), "NODE_RANK": "0",
            "AUTOMICRO_TEST_VAR": "yes",
        }


@pytest.mark.multiproc
def test_hang_is_reported_with_every_rank_stack():
    timeout_s = 3
    t0 = time.monotonic()
    with pytest.raises(MultiprocessFailure) as info:
        run_multiprocess(_hang, world_size=2, timeout_s=timeout_s)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert msg.splitlines()[0].endswith(f"hang: ranks [0, 1] did not finish within {timeout_s} s"), msg
    assert info.value.hung == [0, 1]
    assert "_wait_in_barrier" in info.value.stacks[0] and "barrier" in info.value.stacks[0], msg
    assert "_sleep_forever" in info.value.stacks[1], msg
    assert "_wait_in_barrier" in msg and "_sleep_forever" in msg
    assert info.value.exitcodes == {0: -9, 1: -9}  # killed
    assert elapsed < 60 + timeout_s + 15  # start-up (forkserver, first use) + timeout + dumps


@pytest.mark.multiproc
def test_raising_rank_reported_fast_while_other_blocks_in_collective():
    t0 = time.monotonic()
    with pytest.raises(MultiprocessFailure) as info:
        run_multiprocess(_raise_on_rank1_other_in_collective, world_size=2, timeout_s=120)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert next(iter(info.value.errors)) == 1
    assert "ValueError: deliberate failure on rank 1" in info.value.errors[1]
    assert "===== rank 1 failed =====" in msg and "_raise_on_rank1_other_in_collective" in msg
    assert elapsed < 40, elapsed  # not the 120 s timeout


def test_failures_are_ordered_by_when_each_rank_failed_not_by_which_report_arrived_first():
    """Rank 1 raised; rank 0 failed after it (its collective lost rank 1) and its report reached the parent first, as
    on a loaded machine (what the flake hunt saw): rank 1 is the first failure. A rank with no time (its report could
    not be read) comes last."""
    from automicro.testing.multiprocess import failures_in_order

    arrived = {0: "RuntimeError: Connection closed by peer", 1: "ValueError: deliberate failure on rank 1"}
    assert list(failures_in_order(arrived, {0: 105.2, 1: 105.1})) == [1, 0]
    assert list(failures_in_order(arrived, {1: 105.1})) == [1, 0]
    assert list(failures_in_order({2: "x", 0: "y", 1: "z"}, {0: 3.0})) == [0, 2, 1]


@pytest.mark.multiproc
def test_raising_rank_others_get_grace_then_stack_dump():
    t0 = time.monotonic()
    with pytest.raises(MultiprocessFailure) as info:
        run_multiprocess(_raise_on_rank1_other_sleeps, world_size=2, timeout_s=120, failure_grace_s=2)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "deliberate failure on rank 1, rank 0 sleeps" in info.value.errors[1]
    assert info.value.hung == [0]
    assert "hang: ranks [0] did not finish within 2 s after the first failure" in msg
    assert "_sleep_forever" in info.value.stacks[0]
    assert elapsed < 40, elapsed


@pytest.mark.multiproc
def test_worker_dying_without_result_reports_exit_code():
    with pytest.raises(MultiprocessFailure) as info:
        run_multiprocess(_exit_on_rank1, world_size=2, timeout_s=60, failure_grace_s=5)
    assert "rank 1 died without returning a result: exit code 3" in info.value.errors[1]


@pytest.mark.multiproc
def test_memory_cap_under_fully_shard_two_ranks():
    limits = {0: 1 << 30, 1: 1 << 29}
    results = run_multiprocess(_fsdp_mlp_under_cap, world_size=2, args=(limits, 2), timeout_s=120)
    for rank, res in enumerate(results):
        s = res["stats"]
        assert res["oom"] is None
        assert s["rank"] == rank and s["limit_bytes"] == limits[rank]
        assert res["tracked"] == res["sharded_param_bytes"] > 0  # DTensor params: local shards
        assert s["peak_bytes"] > res["tracked"]
        assert s["num_ooms"] == 0 and s["num_alloc_retries"] == 0
        # every counted buffer freed on the program's thread, none by gloo's worker
        assert s["foreign_frees"] == 0, s["foreign_ops"]
        assert not res["resize_patched"]  # UntypedStorage.resize_ restored on exit
        # which gloo works say they completed (the cap holds only those): as `work_reports_completion` says
        assert all(said == told for said, told in res["completes"].values()), res["completes"]
        assert res["completes"]["reduce_scatter_tensor"] == (False, False) and res["completes"]["all_reduce"] == (True, True)
        (_, step1), (_, fwd2), (_, bwd2), (_, step2) = res["phases"][2:]
        assert fwd2 > step1 and bwd2 > step1  # activations, then sharded grads
        # after the step: params + Adam's two states, grads freed by zero_grad. Exact, so the
        # unsharded parameters FSDP2 freed with storage.resize_(0) are not counted any more.
        assert 3 * res["tracked"] <= step1 == step2 < 3 * res["tracked"] + 4096
    # Same shapes on both ranks: the same bytes to the byte, at every phase and at the peak (the cap frees a
    # collective's buffers in the program's order, not when gloo's worker thread lets go of them).
    p0, p1 = (r["stats"]["peak_bytes"] for r in results)
    assert p0 == p1 and results[0]["phases"] == results[1]["phases"], (p0, p1, results[0]["phases"], results[1]["phases"])

    # the same limit on both ranks, twice the sharded params: both OOM at the first all-gather
    # (the same op on both, so no rank is left waiting in a collective)
    small = 2 * results[0]["tracked"]
    results = run_multiprocess(_fsdp_mlp_under_cap, world_size=2, args=(small, 1), timeout_s=30)
    for rank, res in enumerate(results):
        assert res["oom"] is not None and f"rank {rank}," in res["oom"]
        assert "CUDA out of memory" in res["oom"] and f"limit_bytes={small}" in res["oom"]
        assert res["stats"]["num_ooms"] == 1 and res["stats"]["live_bytes"] <= small


@pytest.mark.multiproc
def test_memory_cap_holds_an_in_flight_collective_the_program_dropped_until_its_work_is_gone():
    """An all-gather whose output, input and work rank 0 dropped before rank 1 joined it (a prefetch the program gave
    up on) is freed on rank 0's thread once its work is gone, not by gloo's worker when it completes (the cap let go
    of it at once before, and the worker freed the 8 MB buffer: one foreign free on torch 2.7)."""
    results = run_multiprocess(_in_flight_collective_dropped, world_size=2, timeout_s=60)
    for rank, res in enumerate(results):
        assert res["foreign"] == 0, (rank, res)
        assert res["live"] <= 64, (rank, res)  # the small tensors of the checks only


_TEST_COLLECTIVE = "_automicro_test_collective_"


def _test_collective_op():
    """A collective in c10d's namespace whose work is a future's, completed by a thread of the test that goes on
    holding the tensors (as gloo's worker holds a work and its temporaries a moment after it completed): the thread
    marks it completed, keeps a view of the first tensor until `drop_temp` is set, and the tensors until `drop_all`."""
    if not hasattr(torch.ops.c10d, _TEST_COLLECTIVE):
        lib = torch.library.Library("c10d", "FRAGMENT")
        lib.define(f"{_TEST_COLLECTIVE}(Tensor[] tensors) -> __torch__.torch.classes.c10d.Work")

        def impl(tensors):
            fut = torch.futures.Future()
            work = torch._C._distributed_c10d._create_work_from_future(fut)
            ev = _test_collective_op.events

            def worker(tensors=tensors, fut=fut):  # the future (and through it the tensors), not the work's handle
                ev["complete"].wait()
                fut.set_result(list(tensors))
                temp = tensors[0].view(-1)
                ev["completed"].set()
                ev["drop_temp"].wait()
                del temp
                ev["temp_dropped"].set()
                ev["drop_all"].wait()

            th = threading.Thread(target=worker, daemon=True)
            ev["thread"] = th
            th.start()
            return work.boxed()

        lib.impl(_TEST_COLLECTIVE, impl, "CPU")
        _test_collective_op.lib = lib  # kept for the process's life
    return getattr(torch.ops.c10d, _TEST_COLLECTIVE)


def test_memory_cap_holds_a_collectives_tensors_until_the_thread_that_completed_it_let_go_of_them():
    """The cap's holding against a worker that holds a collective's tensors after the work said it completed, and
    lets go of a temporary first (gloo's worker did both: the cap read the temporary's drop as the work's, let go, and
    the worker then freed an FSDP2 all-gather's buffer on its own thread, about one routed-model launch in ten on a
    loaded machine). Both orders: the program drops the work once it completed, and before."""
    from torch._C._distributed_c10d import Work

    op = _test_collective_op()
    for drop_before_completion in (False, True):
        ev = _test_collective_op.events = {k: threading.Event() for k in ("complete", "completed", "drop_temp", "temp_dropped", "drop_all")}
        cap = MemoryCap(1 << 30, collective_wait_s=0.01)
        with cap:
            x = torch.empty(1_000_000)  # 4 MB
            work = Work.unbox(op([x]))
            if drop_before_completion:
                del work, x
                torch.empty(1)  # a check while in flight: held
                ev["complete"].set()
                assert ev["completed"].wait(10)
            else:
                ev["complete"].set()
                work.wait()
                del work, x
            torch.empty(1)  # the program let go: the cap waits for the worker (0.01 s), which still holds them
            assert cap.stats()["live_bytes"] >= 4_000_000
            ev["drop_temp"].set()
            assert ev["temp_dropped"].wait(10)
            torch.empty(1)  # a use count fell; the work and its tensors still held by the worker
            assert cap.stats()["live_bytes"] >= 4_000_000
            ev["drop_all"].set()
            ev["thread"].join(10)
            assert not ev["thread"].is_alive()
            torch.empty(1)  # gone: let go of here, on this thread
            s = cap.stats()
        assert s["foreign_frees"] == 0 and s["live_bytes"] < 100, (drop_before_completion, s)
        assert s["slow_releases"] == 1, s  # the wait for the worker timed out once, and nothing was let go of then


# ------------------------------------------------------------------------------------------------
# MemoryCap, single process
# ------------------------------------------------------------------------------------------------

MB = 1_000_000


def test_oom_raised_at_crossing_allocation_with_message_fields():
    cap = MemoryCap(10 * MB)
    with cap:
        a = torch.empty(MB // 4)  # 1 MB
        b = torch.empty(4 * MB // 4)  # 4 MB
        c = torch.empty(4 * MB // 4)  # 4 MB: 9 MB live
        assert cap.stats()["live_bytes"] == 9 * MB
        with pytest.raises(torch.OutOfMemoryError) as info:
            b + c  # 4 MB more: 13 MB > 10 MB
        assert cap.stats()["live_bytes"] == 9 * MB  # the failed output is not counted
        d = a * 2  # 1 MB still fits exactly
    msg = str(info.value)
    for part in ("CUDA out of memory", "emulated by automicro.testing.MemoryCap", "rank 0",
                 f"requested_bytes={4 * MB}", f"live_bytes={9 * MB}", f"limit_bytes={10 * MB}", "aten.add"):
        assert part in msg, (part, msg)
    assert isinstance(info.value, RuntimeError)  # Composer's string check applies
    s = cap.stats()
    assert s["live_bytes"] == s["peak_bytes"] == 10 * MB and s["num_ooms"] == 1
    del a, b, c, d


def test_compile_under_the_cap_compiles_where_torch_can_and_the_cap_still_counts_and_ooms_in_compiled_code():
    """Dynamo skipped every frame under the cap's dispatch mode, silently: each CPU `compile` under
    `memory_cap` trained eager. torch 2.11+ compiles (the mode off while compiling, on while the
    graph runs); torch 2.7 cannot without recompiling each call, and stays eager (said by the main job)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from automicro.engine._torch_internals import COMPILES_UNDER_DISPATCH_MODES, _torch_version

    assert COMPILES_UNDER_DISPATCH_MODES == (_torch_version() >= (2, 11))
    torch._dynamo.reset()

    def f(x):
        return (x @ x.T).relu() * 2

    compiled = torch.compile(f, backend="aot_eager")
    x = torch.randn(256, 256)  # each 256 x 256 fp32 output: 256 KiB
    graphs = counters["stats"]["unique_graphs"]
    cap = MemoryCap(None)
    with cap:
        for _ in range(3):  # one graph for all three calls, where torch compiles
            out = compiled(x)
        assert cap.stats()["peak_bytes"] >= 2 * 256 * 256 * 4  # the compiled ops' outputs are counted
    assert torch.equal(out, f(x))
    assert counters["stats"]["unique_graphs"] - graphs == (1 if COMPILES_UNDER_DISPATCH_MODES else 0)
    with MemoryCap(256 * 256 * 4 + 1000), pytest.raises(torch.OutOfMemoryError):
        compiled(x)  # the second output crosses the limit inside the graph
    torch._dynamo.reset()


def test_live_bytes_drop_when_freed_and_peak_kept():
    cap = MemoryCap(None)
    with cap:
        a = torch.empty(250_000)
        b = torch.empty(500_000)
        assert cap.live_bytes == 3 * MB
        del a
        assert cap.live_bytes == 2 * MB
    del b  # freed after the cap exited: still subtracted
    s = cap.stats()
    assert s["live_bytes"] == 0 and s["peak_bytes"] == 3 * MB and s["num_tracked_storages"] == 0
    cap.reset_peak()
    assert cap.stats()["peak_bytes"] == 0


def test_paused_cap_counts_no_new_storage_but_still_sees_frees():
    """A checkpoint's state dict is host memory on a GPU: while paused, nothing new is counted (and
    nothing runs out); frees of storages counted before still come off."""
    cap = MemoryCap(2 * MB)
    with cap:
        a = torch.empty(250_000)
        cap.pause()
        assert cap.paused
        host = torch.empty(1_000_000)  # 4 MB: over the limit, but not device memory
        assert cap.live_bytes == MB
        del a
        assert cap.live_bytes == 0
        cap.resume()
        b = torch.empty(250_000)
        assert cap.live_bytes == MB and not cap.paused
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(500_000)
    del host, b


def test_views_inplace_and_preexisting_storages_not_counted():
    pre = torch.randn(1000)  # created before the cap
    cap = MemoryCap(None)
    with cap:
        v = pre[10:].view(-1, 10)
        pre.add_(1)
        torch.mul(pre, 2, out=pre)
        assert cap.live_bytes == 0
        a = pre * 2
        views = [a[1:], a.view(10, 100), a.unsqueeze(0), a.detach()]
        a.mul_(3)
        assert cap.live_bytes == 4000 and cap.stats()["num_allocs"] == 1
    del v, views


def test_retries_counted_in_band_and_memory_stats_names():
    cap = MemoryCap(1000, retry_band=0.10)
    with cap:
        a = torch.empty(200)  # 800 B: below 900
        assert cap.stats()["num_alloc_retries"] == 0
        b = torch.empty(30)  # 920 B: in the band
        assert cap.stats()["num_alloc_retries"] == 1
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(100)  # 1320 B: OOM (the allocator retried, then gave up)
    ms = cap.memory_stats()
    assert ms["num_alloc_retries"] == 2 and ms["num_ooms"] == 1
    assert ms["allocated_bytes.all.current"] == 920 and ms["allocated_bytes.all.peak"] == 920
    del a, b


def test_backward_ops_are_seen_and_can_oom():
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, 256, requires_grad=True)
    loss = (x @ w).relu().sum()  # graph built outside the cap
    cap = MemoryCap(None)
    with cap:
        loss.backward()
    s = cap.stats()
    assert s["num_allocs"] > 2  # grad of relu, of matmul, ... all ran under the mode
    assert s["live_bytes"] == x.grad.nbytes + w.grad.nbytes  # intermediates freed
    assert s["peak_bytes"] > s["live_bytes"]

    x.grad = w.grad = None
    loss = (x @ w).relu().sum()
    with MemoryCap(x.nbytes) as small:
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            loss.backward()
    assert small.stats()["num_ooms"] == 1


def test_track_existing_counts_parameters():
    model = nn.Linear(100, 100)  # 40400 bytes of parameters
    cap = MemoryCap(50_000)
    assert cap.track_existing(model) == 40_400
    assert cap.track_existing(model.parameters()) == 0  # counted once
    with cap:
        with pytest.raises(torch.OutOfMemoryError):
            model(torch.randn(40, 100))  # input 16 KB + output 16 KB
    with pytest.raises(torch.OutOfMemoryError):
        MemoryCap(1000).track_existing(model)
    del model
    assert cap.stats()["live_bytes"] == 0


def test_limit_per_rank(monkeypatch):
    limits = {0: 10_000, 1: 20_000}
    monkeypatch.setenv("RANK", "1")
    cap = MemoryCap(limits)
    with cap:
        pass
    assert cap.stats()["limit_bytes"] == 20_000 and cap.stats()["rank"] == 1
    assert MemoryCap(limits, rank=0).limit_bytes == 10_000
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(KeyError, match="no limit given for rank 2"):
        with MemoryCap(limits):
            pass


def test_storage_resize_is_tracked_and_patch_removed():
    cap = MemoryCap(10_000)
    with cap:
        t = torch.empty(1000)  # 4000 B
        t.untyped_storage().resize_(0)  # what FSDP2 does to free unsharded params
        assert cap.live_bytes == 0
        t.untyped_storage().resize_(4000)
        assert cap.live_bytes == 4000
        with pytest.raises(torch.OutOfMemoryError, match="resize_"):
            t.untyped_storage().resize_(40_000)
        assert t.untyped_storage().nbytes() == 4000 and cap.live_bytes == 4000
    assert "resize_" not in torch.UntypedStorage.__dict__
    t.untyped_storage().resize_(0)  # while inactive: picked up by stats()
    assert cap.stats()["live_bytes"] == 0


def test_reentrant_and_nested_caps_and_thread_local():
    outer, inner = MemoryCap(None), MemoryCap(None)
    with outer:
        with outer:  # re-entering the same cap: counted once
            with inner:
                a = torch.empty(100)
        b = torch.empty(100)
        seen_from_thread = []
        th = threading.Thread(target=lambda: seen_from_thread.append(torch.empty(1000)))
        th.start()
        th.join()
    assert outer.live_bytes == 800 and inner.live_bytes == 400  # the thread's 4000 B not counted
    del a, b, seen_from_thread


def test_oom_waits_for_frees_pending_in_other_threads():
    cap = MemoryCap(1000, settle_attempts=5, settle_s=0.01)
    go = threading.Event()
    with cap:
        holder = [torch.empty(200)]  # 800 B, to be freed by another thread
    th = threading.Thread(target=lambda: (go.wait(), holder.clear()))
    th.start()
    with cap:
        go.set()
        t = torch.empty(100)  # 400 B: fits once the other thread's free landed
    th.join()
    assert cap.stats()["live_bytes"] == 400 and cap.stats()["num_ooms"] == 0
    del t


def test_wrapper_subclass_without_flatten_is_not_counted():
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    assert MemoryCap(None).track_existing(Wrapper(torch.randn(4))) == 0


def _env_without_process_group(rank, world_size):
    return dist.is_initialized(), os.environ["RANK"], os.environ["WORLD_SIZE"]


@pytest.mark.multiproc
def test_backend_none_skips_init():
    assert run_multiprocess(_env_without_process_group, world_size=1, backend=None, timeout_s=60) == [
        (False, "0", "1")
    ]


def test_fault_injector_refuses_bad_sites_and_a_between_batches_fault_without_its_batch():
    from automicro.testing.faults import FaultInjector

    with pytest.raises(ValueError, match=r"site='nowhere': must be one of .*'between_batches'"):
        FaultInjector("nowhere")
    with pytest.raises(ValueError, match=r"'between_batches' needs batch"):
        FaultInjector("between_batches")
    assert FaultInjector("between_batches", batch=3, ranks=[1]).batch == 3


def test_fault_injector_outside_automicro_trainer_says_what_to_use():
    from automicro.testing.faults import FaultInjector

    # Without automicro.Trainer nothing hands the injector an attempt context: it would never fire.
    with pytest.raises(ValueError, match=r"needs automicro\.Trainer, .*from automicro import Trainer"):
        FaultInjector("forward").fit_start(None, None)
    FaultInjector("between_batches", batch=1).fit_start(None, None)  # needs no attempt context
