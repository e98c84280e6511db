"""Run a function on N local processes under torch.distributed, with a hang watchdog.

::

    from automicro.testing.multiprocess import run_multiprocess, MultiprocessFailure

    def _allreduce_rank(rank, world_size, scale):      # top level of an importable module
        t = torch.tensor([float(rank)]) * scale
        torch.distributed.all_reduce(t)
        return t.item()

    results = run_multiprocess(_allreduce_rank, world_size=2, args=(10.0,), timeout_s=120)
    # results == [10.0, 10.0]: the return values, indexed by rank

Each worker process gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK (0, or its simulated node, `nodes=`) and the entries of `env`, initializes the default
process group (`init_process_group(backend, rank=rank, world_size=world_size)`; `backend=None`
skips it, for code that initializes it itself), calls `fn(rank, world_size, *args, **kwargs)`,
sends the return value back and, once every rank got there (a barrier), destroys the process
group. (A GIL-free faulthandler watchdog ends a worker whose teardown hangs, see `_worker`.)

`fn`, `args`, `kwargs` and the return value travel by pickle to and from fresh processes: `fn`
must be a top-level function of a module the worker can import (a test module is fine: pytest's
sys.path is passed on; lambdas, closures and functions defined inside a test are not). They are
pickled in the caller first, so an unpicklable `fn` fails at once with a clear error.

Watchdog.
- Start-up (interpreter, imports, unpickling `fn`, `init_process_group`) has its own budget,
  `startup_timeout_s`; `timeout_s` is the budget of `fn` itself, counted from the moment the
  last rank finished start-up. Start-up takes seconds per process and varies with machine load;
  keeping it out of `timeout_s` lets tests use tight timeouts without flaking.
- When a worker raises, its formatted traceback is collected; the other ranks are then given
  `failure_grace_s` (default 10 s; they may be blocked in a collective waiting for the failed
  rank) and not the whole timeout. A worker that dies without returning (segfault, os._exit) is
  reported with its exit code.
- When a deadline passes, the parent sends SIGUSR1 to every unfinished worker (each registered
  `faulthandler` on SIGUSR1, dumping all its threads' Python stacks to a per-rank file), waits
  up to `dump_wait_s` for the dumps, kills every worker with SIGKILL (with its children: each
  worker leads its own process group) and raises `MultiprocessFailure`. Its message starts with a
  summary line, e.g. "hang: ranks [0, 1] did not finish within 30 s", then every failed rank's
  traceback and every unfinished rank's stack dump.
- Workers get PR_SET_PDEATHSIG (Linux), so they die with the parent (e.g. pytest killed).

Many cases in one process group. Process start-up costs seconds per process, so test many cases
with one call: let `fn` loop over them and return one result per case, then assert in the
parent::

    CASES = [(4, 1), (8, 2), (16, 4)]

    def _check_cases(rank, world_size, cases):
        out = {}
        for case in cases:                      # every rank runs the same cases in the same order
            out[case] = run_one(case, rank)     # so collectives stay matched across ranks
        return out

    @pytest.mark.multiproc
    def test_cases():
        per_rank = run_multiprocess(_check_cases, world_size=2, args=(CASES,), timeout_s=120)
        for case in CASES:
            assert per_rank[0][case] == per_rank[1][case], case

A case that raises on one rank only must not be followed by collectives on the other ranks (they
would wait for it): either let the exception end the worker (the runner reports it with the
rank's traceback and stops the others after `failure_grace_s`) or catch it on every rank the
same way and return it as that case's result. Name the case in assertion messages inside `fn`;
the traceback in the failure shows them.

Start method. "spawn" (default) starts every worker from a fresh interpreter: it imports torch,
the package and the module of `fn` each time (3-5 s per process, CPU bound). "forkserver"
forks workers from a server process that imported torch, torch.distributed and automicro once
(plus `forkserver_preload`, the modules the env variable AUTOMICRO_MP_PRELOAD lists, comma-separated,
and those of Composer, transformers, automicro's Composer integration and `fn`'s own module that the
caller has imported by then: `_PRELOAD_IF_IMPORTED`), typically 10x faster after the server's own
start; the caller's
os.environ at call time is given to each worker, but settings torch reads at import (thread
counts) are the server's. The workers' stdout/stderr are those the server inherited when it
started (under pytest: the capture of the test that started it). The env variable
AUTOMICRO_MP_START_METHOD picks the default.

Owns: spawning, the watchdog, the result hand-back and simulated nodes. May not touch:
automicro's product modules (it is used by their tests, never the other way round).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import connection as mp_connection
from typing import Any, Optional

__all__ = ["MultiprocessFailure", "run_multiprocess", "free_port"]

_START_METHOD_ENV = "AUTOMICRO_MP_START_METHOD"
_PRELOAD_ENV = "AUTOMICRO_MP_PRELOAD"  # more modules for the forkserver, comma-separated
# Imported once by the forkserver.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", __name__]
# Also imported by the forkserver where the caller has imported them when it starts (the automicro
# package imports Composer lazily, so the list above does not): else each rank of every launch imports
# them after the fork. Composer alone took 4.8 s a rank on 2 cores (scripts/launch_costs.py, torch 2.7,
# 2026-11-29): a 2-rank test's fixed cost went from ~0.2 s to ~5 s.
_PRELOAD_IF_IMPORTED = (
    "composer", "composer.trainer", "transformers", "automicro.composer.callback", "automicro.composer.trainer",
    "automicro.step",
)


def _preload(extra: Sequence[str], fn_module: Optional[str]) -> list[str]:
    """What the forkserver imports when it starts: the base list, what the caller asked for (the argument,
    AUTOMICRO_MP_PRELOAD), and of `_PRELOAD_IF_IMPORTED` and `fn`'s module what the caller has imported
    (a module it has not, the workers may not need)."""
    listed = [m.strip() for m in os.environ.get(_PRELOAD_ENV, "").split(",") if m.strip()]
    wanted = list(_FORKSERVER_PRELOAD) + list(extra) + listed
    # A module the caller hid (sys.modules[name] = None: importing it raises) counts as not imported.
    wanted += [m for m in (*_PRELOAD_IF_IMPORTED, fn_module) if m and m != "__main__" and sys.modules.get(m) is not None]
    return list(dict.fromkeys(wanted))


class MultiprocessFailure(RuntimeError):
    """A rank raised, died, or did not finish in time.

    Attributes: `errors` (rank -> formatted traceback or exit description, in the order the
    ranks failed: each rank's own time of failure, not the order its report arrived), `hung` (ranks that did not finish), `stacks` (rank -> stack dump text of the
    hung ranks), `exitcodes` (rank -> exit code after the kill), `results` (rank -> return value,
    for the ranks that returned)."""

    def __init__(self, message: str, *, errors=None, hung=None, stacks=None, exitcodes=None, results=None):
        super().__init__(message)
        self.errors: dict[int, str] = dict(errors or {})
        self.hung: list[int] = list(hung or [])
        self.stacks: dict[int, str] = dict(stacks or {})
        self.exitcodes: dict[int, Optional[int]] = dict(exitcodes or {})
        self.results: dict[int, Any] = dict(results or {})


# Rendezvous ports come from below the kernel's ephemeral range (which the OS hands to every socket bound
# to port 0 and every outgoing connection), in a slice of their own per process: concurrent callers (the
# test files pytest-xdist runs side by side, 16 at once on a GPU machine's cores) never draw the same
# port in the moment between the check and rank 0's listen. One such race on 2026-11-29 failed a launch
# with EADDRINUSE; worse, the other ranks of a launch whose rank 0 lost it would have joined the
# winner's store. (The composer launcher and torchrun pick their ports in the ephemeral range.)
_PORT_BASE = 12000
_PORT_SLICES = 64
_next_port: Optional[int] = None


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_slice(width: int) -> range:
    """This process's ports: slice N for pytest-xdist's worker gwN, else one drawn by the pid."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else os.getpid()
    start = _PORT_BASE + (index % _PORT_SLICES) * width
    return range(start, start + width)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def failures_in_order(errors: dict[int, str], failed_at: dict[int, float]) -> dict[int, str]:
    """`errors` ordered by when each rank failed (`failed_at`, the host's monotonic clock; a rank with no time last,
    in the order seen): the first is the one that failed first, whichever report reached the parent first."""
    seen = list(errors)
    return dict(sorted(errors.items(), key=lambda item: (failed_at.get(item[0], float("inf")), seen.index(item[0]))))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now and that no other caller of this function draws while this process
    uses it: the next free one of this process's slice below the ephemeral range, in turn (a port
    is reused only after the whole slice). Where the ephemeral range leaves too little room below it,
    a port the OS picks (bound to port 0, then released)."""
    global _next_port
    width = (_ephemeral_start() - _PORT_BASE) // _PORT_SLICES
    if width >= 16:
        ports = _port_slice(width)
        first = ports.start + os.getpid() % width if _next_port not in ports else _next_port
        for step in range(width):
            port = ports.start + (first - ports.start + step) % width
            if _bindable(host, port):
                _next_port = ports.start + (port - ports.start + 1) % width
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# worker side
# ------------------------------------------------------------------------------------------------

_dump_file = None  # keeps the faulthandler file open for the life of the worker


def _set_parent_death_signal(parent_pid: Optional[int]) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def _release_forkserver_alive_fd() -> None:
    """A forkserver child inherits the write end of the pipe by which the server notices that
    its client (our caller) died; while any worker holds it, the server outlives a killed caller
    and so do the workers (their parent is the server). Closing our copy lets the server exit
    with the caller, which then kills us through PR_SET_PDEATHSIG. (A worker that starts its own
    forkserver processes gets a new server.)"""
    try:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        fd = getattr(server, "_forkserver_alive_fd", None)
        if fd is not None:
            server._forkserver_alive_fd = None
            os.close(fd)
    except Exception:
        pass


def _send(conn, kind: str, value: Any) -> None:
    try:
        conn.send_bytes(pickle.dumps((kind, value)))
    except Exception:
        pass


def _share_the_cores(world_size: int) -> None:
    """Every rank of this runner runs on this machine: each takes its share of the cores for torch's
    intra-op threads, as torchrun does with OMP_NUM_THREADS (the Composer launcher does not). Left
    alone, each rank takes every core: on 2 cores, 2 ranks ran a tiny model's batches 3x slower
    (2026-11-27). OMP_NUM_THREADS in the caller's environment is kept."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    import torch

    torch.set_num_threads(max(1, cores // max(1, world_size)))


def _worker(rank, world_size, payload, port, backend, env, base_env, conn, dump_path, parent_pid,
            teardown_watchdog_s, nodes=1):
    global _dump_file
    try:
        os.setpgid(0, 0)  # own process group: the parent kills our children with us
    except OSError:
        pass
    if parent_pid is None:  # forkserver
        _release_forkserver_alive_fd()
    _set_parent_death_signal(parent_pid)
    _dump_file = open(dump_path, "w")
    faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True, chain=False)

    if base_env is not None:  # forkserver: take the caller's environment of now
        os.environ.clear()
        os.environ.update(base_env)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % (world_size // nodes)),
        LOCAL_WORLD_SIZE=str(world_size // nodes),
        NODE_RANK=str(rank // (world_size // nodes)),
    )

    ok = False
    try:
        fn, args, kwargs = pickle.loads(payload)
        _share_the_cores(world_size)
        if backend is not None:
            import torch
            import torch.distributed as dist

            if "nccl" in str(backend) and torch.cuda.is_available():
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        _send(conn, "started", None)
        result = fn(rank, world_size, *args, **kwargs)
        try:
            msg = pickle.dumps(("ok", result))
        except Exception as e:
            raise TypeError(
                f"the return value of {getattr(fn, '__qualname__', fn)!r} on rank {rank} cannot be "
                f"pickled back to the parent: {e!r}"
            ) from e
        ok = True
    except BaseException:
        # When it failed, on the host's monotonic clock (one clock for every process of the host): the parent orders
        # the failures by it, not by which report reached it first (a rank that fails because another died reports
        # after that one failed, though its report can arrive first on a loaded machine).
        failed_at = time.monotonic()
        msg = pickle.dumps(("error", traceback.format_exc(), failed_at))
    try:
        conn.send_bytes(msg)
    except Exception:
        pass
    if not ok:
        # Skip destroy_process_group and interpreter teardown: other ranks may be stuck in a
        # collective with us, and the parent is waiting to report.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)
    dist = sys.modules.get("torch.distributed")  # also a group that `fn` initialized itself
    if dist is not None and dist.is_available() and dist.is_initialized():
        # gloo: destroying the process group joins gloo's worker threads while holding the GIL;
        # a worker thread still releasing a finished work that holds a Python tensor needs the
        # GIL: deadlock (seen on torch 2.7 in 2 of 6 runs of 4 ranks under load; gdb stacks).
        # The barrier makes sure no peer is mid-collective, the sleep (GIL released) lets the
        # worker threads release their works, and a GIL-free watchdog ends the process (exit
        # code 1, stacks in the dump file) should teardown still hang.
        faulthandler.dump_traceback_later(teardown_watchdog_s, exit=True, file=_dump_file)
        dist.barrier()
        time.sleep(0.1)
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    conn.close()


# ------------------------------------------------------------------------------------------------
# parent side
# ------------------------------------------------------------------------------------------------


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def _kill_worker(proc) -> None:
    """SIGKILL the worker's process group (itself and its children), then the worker."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker made its pid its group id
    except OSError:
        pass
    try:
        proc.kill()
    except Exception:
        pass


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _collect_dumps(procs, ranks, paths, wait_s: float) -> dict[int, str]:
    """SIGUSR1 each live rank in `ranks`, wait until their dump files stop growing (at most
    `wait_s`), return rank -> dump text."""
    signalled = []
    for r in ranks:
        p = procs[r]
        if p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
                signalled.append(r)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    sizes = {r: -1 for r in signalled}
    while signalled and time.monotonic() < deadline:
        time.sleep(0.05)
        stable = True
        for r in signalled:
            try:
                size = os.path.getsize(paths[r])
            except OSError:
                size = 0
            if size == 0 or size != sizes[r]:
                stable = False
            sizes[r] = size
        if stable:
            break
    return {r: _read(paths[r]) for r in ranks}


def run_multiprocess(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    *,
    timeout_s: float = 120.0,
    backend: Optional[str] = "gloo",
    env: Optional[Mapping[str, str]] = None,
    startup_timeout_s: float = 300.0,
    failure_grace_s: float = 10.0,
    dump_wait_s: float = 2.0,
    teardown_timeout_s: float = 30.0,
    start_method: Optional[str] = None,
    forkserver_preload: Sequence[str] = (),
    nodes: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes; return the
    results indexed by rank, or raise `MultiprocessFailure` (see the module docstring).

    Args:
        fn: top-level function of an importable module (pickled by reference).
        timeout_s: budget for every rank to return from `fn`, counted from the moment the last
            rank finished start-up.
        backend: torch.distributed backend of the default process group ("gloo", "nccl",
            "cpu:gloo,cuda:nccl", ...); None to not initialize one.
        env: extra environment variables for the workers.
        startup_timeout_s: budget for all ranks to start (imports, unpickling, init).
        failure_grace_s: once a rank failed, how long the others may still take.
        dump_wait_s: how long to wait for the stack dumps of unfinished ranks.
        teardown_timeout_s: after every rank returned, how long each may take to exit before it
            is killed (with a warning and its stacks; the results are still returned). Each
            worker's own watchdog ends a hanging teardown after half of it.
        start_method: "spawn" or "forkserver"; default: env AUTOMICRO_MP_START_METHOD, else
            "spawn".
        forkserver_preload: more modules for the forkserver to import (only used when this
            process starts its forkserver, i.e. on the first forkserver call).
        nodes: simulated nodes, as separate launchers would set them up: rank r gets
            NODE_RANK = r // (world_size // nodes) and LOCAL_RANK / LOCAL_WORLD_SIZE within it;
            automicro treats each as a node of its own (no shared memory across them).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"nodes={nodes} must divide world_size={world_size}")
    start_method = start_method or os.environ.get(_START_METHOD_ENV) or "spawn"
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    try:
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as e:
        raise TypeError(
            f"run_multiprocess: cannot pickle fn/args for the worker processes ({e!r}). `fn` must be "
            "a top-level function of an importable module (not a lambda, closure or a function "
            "defined inside another function), and args/kwargs must be picklable."
        ) from e

    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    extra_env = {str(k): str(v) for k, v in (env or {}).items()}
    base_env = None
    parent_pid: Optional[int] = os.getpid()
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_preload(forkserver_preload, getattr(fn, "__module__", None)))
        base_env = dict(os.environ)
        parent_pid = None  # the workers' parent is the server, which exits with us
    fn_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="automicro-mp-")
    dump_paths = [os.path.join(tmpdir, f"rank{r}.stacks.txt") for r in range(world_size)]
    procs: list = []
    conns: list = []
    clean = False
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, payload, port, backend, extra_env, base_env, writer, dump_paths[rank], parent_pid,
                      max(1.0, teardown_timeout_s / 2), nodes),
                name=f"automicro-rank{rank}",
                daemon=False,  # workers may start their own children (DataLoader workers)
            )
            p.start()
            writer.close()
            procs.append(p)
            conns.append(reader)

        start = time.monotonic()
        started: set[int] = set()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}  # ordered by when each rank failed (`failed_at`) once the run is over
        failed_at: dict[int, float] = {}  # rank -> when it failed: its own stamp, else when its death was seen
        run_deadline: Optional[float] = None
        first_failure_at: Optional[float] = None
        open_conns = {conns[r]: r for r in range(world_size)}
        sentinels = {procs[r].sentinel: r for r in range(world_size)}

        def pending() -> list[int]:
            return [r for r in range(world_size) if r not in results and r not in errors]

        def deadline() -> float:
            d = run_deadline if run_deadline is not None else start + startup_timeout_s
            if first_failure_at is not None:
                d = min(d, first_failure_at + failure_grace_s)
            return d

        def drain(conn) -> None:
            r = open_conns[conn]
            while conn in open_conns and conn.poll(0):
                try:
                    kind, value, *stamp = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    open_conns.pop(conn, None)
                    return
                except Exception:
                    errors.setdefault(r, f"rank {r}: could not unpickle its message:\n{traceback.format_exc()}")
                    failed_at.setdefault(r, time.monotonic())
                    open_conns.pop(conn, None)
                    return
                if kind == "started":
                    started.add(r)
                elif kind == "ok":
                    results[r] = value
                    open_conns.pop(conn, None)
                else:
                    errors[r] = value
                    failed_at[r] = stamp[0] if stamp else time.monotonic()
                    open_conns.pop(conn, None)

        while pending():
            now = time.monotonic()
            if now >= deadline():
                break
            live_pending = pending()
            waitables = list(open_conns) + [procs[r].sentinel for r in live_pending]
            ready = mp_connection.wait(waitables, timeout=deadline() - now)
            for obj in ready:
                if obj in open_conns:
                    drain(obj)
            for obj in ready:
                r = sentinels.get(obj)
                if r is None or r not in pending():
                    continue
                if conns[r] in open_conns:
                    drain(conns[r])
                if r in pending():
                    procs[r].join(0.1)
                    failed_at[r] = time.monotonic()
                    errors[r] = (
                        f"rank {r} died without returning a result: {_describe_exit(procs[r].exitcode)} "
                        f"(its stderr may say why)\n"
                    )
                    open_conns.pop(conns[r], None)
            if run_deadline is None and len(started) == world_size:
                run_deadline = time.monotonic() + timeout_s
            if errors and first_failure_at is None:
                first_failure_at = time.monotonic()

        hung = pending()
        if not hung and not errors:
            teardown_deadline = time.monotonic() + teardown_timeout_s
            for p in procs:
                p.join(max(0.0, teardown_deadline - time.monotonic()))
            stuck = [r for r in range(world_size) if procs[r].exitcode is None]
            if stuck:
                stacks = _collect_dumps(procs, stuck, dump_paths, dump_wait_s)
                for r in stuck:
                    _kill_worker(procs[r])
                    procs[r].join(5)
                warnings.warn(
                    f"run_multiprocess({fn_name}): ranks {stuck} returned their results but did not "
                    f"exit within {teardown_timeout_s:g} s; killed them. Stacks:\n"
                    + "\n".join(f"--- rank {r} ---\n{stacks[r].rstrip() or '(no dump)'}" for r in stuck)
                )
            for r, p in enumerate(procs):
                if r not in stuck and p.exitcode != 0:
                    dump = _read(dump_paths[r]).rstrip()
                    warnings.warn(
                        f"run_multiprocess({fn_name}): rank {r} returned its result, then exited with "
                        f"{_describe_exit(p.exitcode)}" + (f"; its teardown watchdog dumped:\n{dump}" if dump else "")
                    )
            clean = True
            return [results[r] for r in range(world_size)]

        stacks = _collect_dumps(procs, hung, dump_paths, dump_wait_s) if hung else {}
        for p in procs:
            _kill_worker(p)
        for p in procs:
            p.join(5)
        exitcodes = {r: procs[r].exitcode for r in range(world_size)}

        errors = failures_in_order(errors, failed_at)
        summary = []
        if errors:
            summary.append(f"ranks {sorted(errors)} failed (first: rank {next(iter(errors))})")
        not_started = [r for r in hung if r not in started]
        running = [r for r in hung if r in started]
        grace_cut = first_failure_at is not None and (
            first_failure_at + failure_grace_s
            <= (run_deadline if run_deadline is not None else start + startup_timeout_s)
        )
        if hung and grace_cut:
            summary.append(
                f"hang: ranks {hung} did not finish within {failure_grace_s:g} s after the first failure"
            )
        elif running:
            summary.append(f"hang: ranks {running} did not finish within {timeout_s:g} s")
        if not_started and not grace_cut:
            summary.append(
                f"hang: ranks {not_started} did not start (imports, init_process_group) within "
                f"{startup_timeout_s:g} s"
            )
        lines = [f"run_multiprocess({fn_name}, world_size={world_size}): " + "; ".join(summary)]
        for r, text in errors.items():
            lines.append(f"\n===== rank {r} failed =====\n{text.rstrip()}")
        for r in hung:
            dump = stacks.get(r, "").rstrip() or (
                "(no stack dump: the worker had not installed its SIGUSR1 handler yet, or did not answer)"
            )
            lines.append(f"\n===== rank {r} did not finish: stack dump (most recent call first) =====\n{dump}")
        if results:
            lines.append(f"\n(ranks {sorted(results)} returned normally)")
        raise MultiprocessFailure(
            "\n".join(lines), errors=errors, hung=hung, stacks=stacks, exitcodes=exitcodes, results=results
        )
    finally:
        if not clean:
            for p in procs:
                if p.exitcode is None:
                    _kill_worker(p)
            for p in procs:
                p.join(5)
        for c in conns:
            try:
                c.close()
            except Exception:
                pass
        shutil.rmtree(tmpdir, ignore_errors=True)
