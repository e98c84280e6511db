"""The FSDP2 engine: same numbers as one process, recovery from every failure point, config."""

from __future__ import annotations

import os

import pytest
import torch

from automicro.engine import FSDP2Config, FSDP2ConfigError
from automicro.engine import _torch_internals as internals
from automicro.engine.sharding import plan_wrapping
from automicro.testing.multiprocess import run_multiprocess
from tests import engine_cases
from tests.toy_models import Stack, TiedStack

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two_rank_results():
    return run_multiprocess(engine_cases.run_engine_cases, world_size=2, timeout_s=420)


def _ok(result):
    assert "exception" not in result, result.get("exception")
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(engine_cases.NUMERICS_CONFIGS))
def test_two_ranks_match_single_process_after_three_steps(two_rank_results, name):
    for rank_result in two_rank_results:
        result = _ok(rank_result[f"numerics/{name}"])
        assert result["error"] < TOLERANCE, f"{name}: max parameter difference {result['error']}"
        assert result["clean"]


@pytest.mark.multiproc
@pytest.mark.parametrize("config_name", ["defaults", "sync_unshard_ac"])
@pytest.mark.parametrize("point", engine_cases.FAIL_POINTS)
def test_recover_after_failure_trains_as_if_it_never_failed(two_rank_results, point, config_name):
    for rank_result in two_rank_results:
        result = _ok(rank_result[f"recover/{point}/{config_name}"])
        assert result["failed"], "the injected failure did not fire"
        assert result["clean"], "an FSDP2 state is not IDLE/sharded after recover()"
        assert result["unsharded_bytes"] == 0, "recover() left unsharded storage"
        assert result["grads"] == 0, "recover() left gradients of the failed attempt"
        assert result["error"] < TOLERANCE, f"parameters differ from a run that never failed by {result['error']}"


COMPUTE_STREAM_BUFFERS = internals.HAS_CUSTOM_COMMS


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["defaults", "sync_unshard_ac", "buffers_on_fsdp_streams"])
def test_gradient_accumulation_matches_single_process(two_rank_results, name):
    for rank_result in two_rank_results:
        result = _ok(rank_result[f"accum/{name}"])
        assert result["error"] < TOLERANCE, f"{name}: max parameter difference {result['error']}"
        assert result["clean"]


@pytest.mark.multiproc
def test_compute_stream_buffers_are_the_default_where_torch_has_custom_comms(two_rank_results):
    for rank_result in two_rank_results:
        on = _ok(rank_result["accum/defaults"])
        off = _ok(rank_result["accum/buffers_on_fsdp_streams"])
        assert off["rs_comm"] is None
        if not COMPUTE_STREAM_BUFFERS:
            assert on["rs_comm"] is None, "torch < 2.9 has no set_custom_reduce_scatter; the engine must not use it"
            continue
        assert on["one_comm"], "every FSDP2 module of one root must share one reduce-scatter comm"
        # 3 steps x 2 microbatches x 4 parameter groups (3 blocks + root), every output from
        # the compute stream's pool (CPU streams are distinct objects, so the path is the GPU one).
        assert on["rs_comm"]["outputs"] == 3 * 2 * 4, on["rs_comm"]
        assert on["rs_comm"]["max_held"] == 2, "at most the previous and the current output are held"
        assert on["held_after_backward"] == [0] * 6, "every held output is dropped at the end of backward"
        # The default (async unshard) copies in on the compute stream already: nothing to redirect ...
        assert on["rs_comm"]["all_gather_outputs"] == 0, on["rs_comm"]
        # ... with sync unshard every flat all-gather output comes from the compute stream's pool.
        sync_run = _ok(rank_result["accum/sync_unshard_ac"])
        assert sync_run["rs_comm"]["all_gather_outputs"] > 0, sync_run["rs_comm"]
        assert sync_run["rs_comm"]["outputs"] == 3 * 2 * 4


@pytest.mark.multiproc
@pytest.mark.parametrize("point", engine_cases.FAIL_POINTS)
def test_recover_drops_held_reduce_scatter_outputs(two_rank_results, point):
    for rank_result in two_rank_results:
        result = _ok(rank_result[f"recover/{point}/defaults"])
        if not COMPUTE_STREAM_BUFFERS:
            assert result["rs_comm"] is None
            continue
        assert result["rs_comm"]["held"] == 0, f"recover() after a failure at {point} left outputs held"


@pytest.mark.multiproc
def test_prefetch_plan_chains_follow_forward_order(two_rank_results):
    plan = two_rank_results[0]["plan"]
    assert "blocks.0: forward -> ['blocks.1', 'blocks.2'], backward -> []" in plan
    assert "blocks.2: forward -> [], backward -> ['blocks.1', 'blocks.0']" in plan


@pytest.mark.multiproc
@pytest.mark.many_ranks
def test_hsdp_2x2_on_four_ranks_matches_single_process_or_is_refused_on_torch_27_cpu():
    results = run_multiprocess(engine_cases.run_hsdp_case, world_size=4, timeout_s=300)
    for result in results:
        if internals.TORCH_VERSION < (2, 8):
            # torch 2.7's FSDP2 cannot run the HSDP all-reduce on CPU streams: refused up front.
            assert result["refused"] and "HSDP on CPU needs torch >= 2.8" in result["refused"]
        else:
            assert result["error"] < TOLERANCE
            assert result["clean"]


def test_gloo_gradient_average_fix_applies_only_where_gloo_sums():
    applied = internals.install_gloo_gradient_average_fix()
    assert applied == (internals.TORCH_VERSION < (2, 8))


def test_record_stream_env_is_set_before_a_group_exists_on_torch_27(monkeypatch):
    from automicro.engine.sharding import AVOID_RECORD_STREAMS_ENV, ensure_record_stream_free

    monkeypatch.delenv(AVOID_RECORD_STREAMS_ENV, raising=False)
    assert not torch.distributed.is_initialized()
    assert ensure_record_stream_free()
    if internals.NEEDS_AVOID_RECORD_STREAMS_ENV:
        assert os.environ.get(AVOID_RECORD_STREAMS_ENV) == "1"
    else:
        assert AVOID_RECORD_STREAMS_ENV not in os.environ


@pytest.mark.parametrize(
    "values, message",
    [
        ({"reshard_after_forward": 0}, "reshard_after_forward=0"),
        ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
        ({"forward_prefetch": -1}, "forward_prefetch=-1"),
        ({"backward_prefetch": True}, "backward_prefetch=True"),
        ({"replicate": 0}, "replicate=0"),
        ({"wrap": "Block"}, "wrap='Block'"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing='yes'"),
        ({"bogus": 1}, "parallelism_config.fsdp2.bogus=1: unknown key"),
        ({"compute_stream_buffers": "auto"}, "compute_stream_buffers='auto'"),
        ({"expandable_segments": 1}, "expandable_segments=1"),
        ({"compute_stream_buffers": True, "replicate": 2}, "not supported with HSDP"),
        ({"compute_stream_buffers": True, "cpu_offload": True}, "cpu_offload"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_fsdp2_config_values_are_refused_with_the_key(values, message):
    with pytest.raises(FSDP2ConfigError) as info:
        FSDP2Config.from_dict(values)
    assert message in str(info.value)


def test_wrap_policy_follows_fsdp_wrap_attribute_children_first():
    wrapped, notes = plan_wrapping(Stack(), FSDP2Config())
    assert sorted(wrapped) == ["blocks.0", "blocks.1", "blocks.2"]
    assert notes == []


def test_tied_blocks_are_wrapped_at_their_common_parent():
    wrapped, notes = plan_wrapping(TiedStack(), FSDP2Config())
    assert wrapped == ["blocks.1"]
    assert any("blocks.0" in note and "blocks.2" in note for note in notes)


def test_tied_modules_both_listed_for_wrapping_are_refused_naming_them():
    with pytest.raises(FSDP2ConfigError, match=r"blocks\.0.*blocks\.2"):
        plan_wrapping(TiedStack(), FSDP2Config(wrap=["Linear"]))


@pytest.mark.multiproc
def test_tiny_llama_on_two_ranks_matches_one_process_in_loss_and_parameters_after_three_steps():
    for result in run_multiprocess(engine_cases.run_llama_case, world_size=2, timeout_s=300):
        assert result["loss_error"] < 1e-5
        assert result["param_error"] < TOLERANCE


def test_compute_stream_buffers_resolve_per_torch_version():
    assert FSDP2Config().use_compute_stream_buffers(internals.TORCH_VERSION, internals.HAS_CUSTOM_COMMS) == (
        internals.TORCH_VERSION >= (2, 9)
    )
    assert not FSDP2Config(replicate=2).use_compute_stream_buffers((2, 11), True), "auto stays off under HSDP"
    assert not FSDP2Config(compute_stream_buffers=False).use_compute_stream_buffers((2, 11), True)
    if internals.HAS_CUSTOM_COMMS:
        assert FSDP2Config(compute_stream_buffers=True).use_compute_stream_buffers((2, 11), True)
    else:
        with pytest.raises(FSDP2ConfigError, match=r"needs torch >= 2.9 .*this is torch 2.7"):
            FSDP2Config(compute_stream_buffers=True)


class _FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited_for = []

    def wait_stream(self, other):
        self.waited_for.append(other.name)


class _FakeHandle:
    """torch.cuda's stream API in miniature: a current stream and a `stream()` context."""

    def __init__(self):
        self.compute = _FakeStream("compute")
        self.reduce = _FakeStream("reduce_scatter")
        self.current = self.compute
        self.allocated_on = []

    def current_stream(self, device=None):
        return self.current

    def stream(self, stream):
        handle = self

        class _Ctx:
            def __enter__(self):
                self.prev, handle.current = handle.current, stream

            def __exit__(self, *exc):
                handle.current = self.prev

        return _Ctx()


def _fake_reduce(comm, handle, numel=4):
    """What `foreach_reduce` does with the comm: input on the compute stream, output inside
    `with stream(reduce_scatter_stream)`."""
    inp = comm.allocate((numel * 2,), dtype=torch.float32, device=torch.device("cpu"))
    with handle.stream(handle.reduce):
        out = comm.allocate((numel,), dtype=torch.float32, device=torch.device("cpu"))
    return inp, out


def test_compute_stream_reduce_scatter_holds_only_the_outputs_pending_work_may_use():
    import weakref

    handle = _FakeHandle()
    comm = internals.ComputeStreamReduceScatter(handle_for=lambda device: handle)
    refs = []
    for k in range(5):
        _, out = _fake_reduce(comm, handle)
        refs.append(weakref.ref(out))
        del out  # FSDP2 drops the output after queueing its `+=` (gradient accumulation)
        assert comm.held == min(k + 1, 2)
        # Output k-1 (its reduce-scatter may still be running) and k are alive; older ones freed.
        assert [r() is not None for r in refs] == [False] * max(0, k - 1) + [True] * min(k + 1, 2)
    assert comm.outputs_from_compute_stream == 5 and comm.max_held == 2
    assert handle.compute.waited_for == []
    comm.release_all()
    assert comm.held == 0 and all(r() is None for r in refs)
    assert handle.compute.waited_for == ["reduce_scatter"], "release must order the compute stream after the reduce-scatter stream"


def test_compute_stream_all_gather_orders_the_copy_in_stream_after_the_compute_stream():
    handle = _FakeHandle()
    comm = internals.ComputeStreamAllGather(handle_for=lambda device: handle)
    cpu = torch.device("cpu")
    comm.allocate((8,), dtype=torch.float32, device=cpu)  # before any forward: plain allocation
    assert comm.outputs_from_compute_stream == 0
    comm.note_compute_stream(cpu)
    copy_in = _FakeStream("copy_in")
    with handle.stream(copy_in):
        comm.allocate((8,), dtype=torch.float32, device=cpu)
    assert copy_in.waited_for == ["compute"], "the copy-in stream must wait for the compute stream first"
    assert comm.outputs_from_compute_stream == 1
    comm.allocate((8,), dtype=torch.float32, device=cpu)  # async unshard: already the compute stream
    assert comm.outputs_from_compute_stream == 1 and handle.compute.waited_for == []


def test_compute_stream_reduce_scatter_after_a_failure_between_its_two_allocations():
    handle = _FakeHandle()
    comm = internals.ComputeStreamReduceScatter(handle_for=lambda device: handle)
    _fake_reduce(comm, handle)
    # A reduction fails after allocating its input (e.g. OOM in the copy-in): the next input,
    # on the compute stream again, must still be taken for an input.
    comm.allocate((8,), dtype=torch.float32, device=torch.device("cpu"))
    comm.allocate((8,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm.outputs_from_compute_stream == 1
    comm.reset()
    assert comm.held == 0
    _fake_reduce(comm, handle)
    assert comm.outputs_from_compute_stream == 2 and comm.held == 1


@pytest.mark.parametrize(
    "choice, device, env, expected",
    [
        (None, "cuda", {}, True),
        (None, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
        (None, "cuda", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}, False),
        (None, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, True),
        (True, "cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True),
        (False, "cuda", {}, False),
        (None, "cpu", {}, False),
        (True, "cpu", {}, False),
    ],
)
def test_expandable_segments_default_respects_an_explicit_allocator_setting(monkeypatch, choice, device, env, expected):
    from automicro.engine import sharding

    calls = []
    monkeypatch.setattr(internals, "set_expandable_segments", lambda: calls.append(1))
    for key in sharding.ALLOC_CONF_ENVS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert sharding.apply_expandable_segments(choice, torch.device(device)) is expected
    assert calls == ([1] if expected else [])


def test_the_oom_observer_hook_is_on_this_torch_and_needs_a_cuda_device():
    """`attach_oom_observer` (varlen benchmark's pool at each OOM) calls a torch private that must
    exist on every supported torch; without a CUDA device it attaches nothing and says so."""
    import torch

    from automicro.engine import _torch_internals as internals

    assert callable(getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)), torch.__version__
    if not torch.cuda.is_available():
        assert internals.attach_oom_observer(lambda *args: None) is False
        assert not torch.cuda.is_initialized()


def test_set_expandable_segments_works_on_this_torch_without_initializing_cuda():
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from automicro.engine import _torch_internals as internals\n"
        "internals.set_expandable_segments()\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize(
    "version, supported",
    [((2, 6), False), ((2, 7), True), ((2, 11), True), ((2, 12), True), ((2, 15), True), ((2, 16), False), ((3, 0), False)],
)
def test_torch_version_gate_and_its_message_agree(monkeypatch, version, supported):
    from automicro.engine import _torch_internals as internals

    monkeypatch.setattr(internals, "TORCH_VERSION", version)
    if supported:
        internals.check_supported_torch()
    else:
        with pytest.raises(RuntimeError, match=r"supports torch 2\.7 to 2\.15 \(checked on 2\.7, 2\.11, 2\.15\).*Install torch 2\.7\.0 .*, 2\.11\.0 or 2\.15\.0"):
            internals.check_supported_torch()


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(engine_cases.KEEP_LAYOUTS))
@pytest.mark.parametrize("fail", ["clean", "fail"])
def test_layout_trades_switch_resharding_and_recomputation_and_recover(two_rank_results, name, fail):
    """The layout trades on the engine (`LayoutEngine`): with `no_reshard` the blocks stay unsharded
    after the backward of every microbatch but the batch's last; the fixed layout reshards after
    each. With `no_recompute` checkpointed blocks run their forward once, not twice, until the
    trade is undone between batches. A failure in
    a later microbatch (the parameters still unsharded from the one before) recovers to a clean,
    sharded model, and training equals the unsharded reference (fp32)."""
    result = _ok(two_rank_results[0][f"keep/{name}/{fail}"])
    layout, ac = engine_cases.KEEP_LAYOUTS[name]
    kept = "no_reshard" in layout
    # Unsharded parameters; unsharded gradients less this rank's sharded half (2 ranks, fp32).
    assert result["extra_bytes"] == (result["block_bytes"], result["block_bytes"] // 2), result
    # no_recompute is a candidate exactly where the blocks checkpoint their activations; each block
    # runs its forward once per microbatch, twice with recomputation (the last step: the trade undone).
    # recompute is one where they carry it switched off (`shard`'s checkpoint_switch).
    assert ("no_recompute" in result["candidates"]) == (ac in (True, "op")), result["candidates"]
    assert ("recompute" in result["candidates"]) == (ac == "switch"), result["candidates"]
    # recompute_op where full recompute was asked for (the ``op`` rung in its place), or where the blocks carry the
    # dial switched off (``op`` tried up, before full).
    assert ("recompute_op" in result["candidates"]) == (ac is True or ac == "switch"), result["candidates"]
    once = 3 * engine_cases.ACCUM  # 3 blocks, 3 microbatches
    if ac in (True, "op"):  # ``op`` runs each block's forward again too (its products served from what it saved)
        before = once if "no_recompute" in layout else 2 * once
        expected = [before] * (engine_cases.STEPS - 1) + [2 * once]
    elif ac == "switch":
        expected = [2 * once if "recompute" in layout else once] * (engine_cases.STEPS - 1) + [once]
    else:
        expected = [once] * engine_cases.STEPS
    assert result["forwards"] == expected, result["forwards"]
    # The rung the blocks end on: the user's (``op`` stays ``op`` once no_recompute is undone), off where auto's switch
    # was turned back, none where nothing carries checkpointing.
    assert result["rung_at_end"] == {True: "full", "op": "op", "switch": "off"}.get(ac), result["rung_at_end"]
    for states in result["states"]:
        assert states[-1] == ["SHARDED"], result["states"]
        assert all(s == (["UNSHARDED"] if kept else ["SHARDED"]) for s in states[:-1]), result["states"]
    assert result["clean_at_end"]
    if fail == "fail":
        assert result["failed"] and result["clean_after_recover"]
        if kept:  # every block still held from the microbatch before (the fixed layout: only the one that failed)
            assert result["unsharded_before_recover"] == ["UNSHARDED"], result
    assert result["error"] < TOLERANCE, result["error"]
