"""Memory of the pipeline executor, measured: the live tensor bytes of one stage after each forward
(F), input gradient (dI), weight gradient (dW) or full backward (B), against activation bytes known
in advance; with and without activation checkpointing; after a failed attempt.

Set-up: 2 gloo ranks = 2 stages of the 4-block tiny Llama (embedding + blocks 0-1 on stage 0,
blocks 2-3 + norm + head on stage 1), FSDP2 over one rank per stage, N = 2 microbatches of
[MB, SEQ] tokens (two is the fewest a 2-stage schedule runs). Every worker runs all cases in one
process group (`_run_cases`, about 10 s) and returns its samples; the tests read them.

How the bytes are counted: `MemoryCap(None)` (no limit, counting only) is active around each batch
and the stage's parameters are counted with `track_existing`. Each sample splits the live bytes
into
- params: sharded parameters, FSDP2's unsharded parameters (all-gathered at the first forward of
  a batch) and every gradient, sharded or unsharded;
- buffers: what the stage received: torch's receive buffers (allocated up front on torch 2.7 and
  2.11, at the first receive on 2.15, which also takes them out of the stage when it uses them),
  found in the stage's receive infos and through a spy on the executor's exchanges
  (`dist.batch_isend_irecv`), which also tells which tensors each microbatch sent and received;
- activations: everything else, what the issue is about: autograd's saved tensors, stage outputs,
  losses, input gradients. `left`: the part of it that finished microbatches (their W, or B, ran)
  still hold of what crossed the boundary (their sent tensors, the `.grad` of their received ones).
"after X" is sampled at the barrier of the step in which X ran (after X, before the step's sends
and receives), "before X" at the start of X (after the previous step's exchange). Python's cyclic
garbage collector is off during the batches: what is freed is what reference counting frees.

The activation bytes of one microbatch are "known in advance" by measurement, not by counting
saved tensors by hand: the same stage module, unsharded, in this process without any pipeline,
runs one forward of one microbatch (and the loss on the last stage) under a fresh MemoryCap; the
bytes it holds afterwards (output and loss kept) are the figure (`_plain_forward_bytes`). With
activation checkpointing the figures are also derived from the shapes: the first stage holds
exactly 3 boundary-sized tensors (its 2 blocks' inputs and its output), the last stage 2 (block 3's
input and output) plus what its head (norm, lm_head, loss; not checkpointed) holds.

Problems this file found and the engine now fixes (each test here failed before its fix):
- finished microbatches left one boundary tensor each until the end of the batch (the input
  gradient as `.grad` of a receive buffer, torch 2.7's output chunks, the last exchange's work
  object): `_torch_internals.drop_finished_microbatch` and `pipeline._exchange`;
- torch >= 2.9: the compute-stream reduce-scatter comm held its last outputs after a pipeline
  batch (its release is an autograd callback; a stage reduce-scatters outside autograd):
  `ShardedModel.end_of_backward`;
- torch < 2.15: an OOM inside dI left that microbatch's graph alive for good (1,612,288 bytes on
  the test's stage): `_torch_internals.install_input_grad_failure_cleanup`.
ZeroBubble with activation checkpointing is refused by `build_pipeline` (torch's composable
checkpoint recomputes through a one-shot context manager, and zero bubble recomputes twice): the
checkpointing cases run 1F1B.
"""

from __future__ import annotations

import gc
import traceback
import weakref
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from automicro.engine import _torch_internals as internals
from automicro.engine.config import FSDP2Config, PipelineConfig
from automicro.engine.pipeline import Action, build_pipeline, split_blocks
from automicro.models.llama import build_model
from automicro.testing.memory_cap import MemoryCap
from automicro.testing.multiprocess import run_multiprocess

MB, SEQ, N = 4, 32, 2  # microbatch size, sequence length, microbatches per batch
D_MODEL, VOCAB = 64, 256  # the tiny preset
HIDDEN_BYTES = MB * SEQ * D_MODEL * 4  # one [MB, SEQ, d_model] fp32 tensor: a stage boundary (32 KiB)
LOGITS_BYTES = MB * SEQ * VOCAB * 4  # one [MB, SEQ, vocab] fp32 tensor (128 KiB)
# Bytes the executor allocates per microbatch besides the stage's own activations: the losses'
# running total and the loss scalars (4 bytes each). Far below one boundary tensor.
TOL = 1024

# Failed attempts: (rank, action kind, microbatch, how). "hook": the hooks raise an OOM before the
# action; "cap": a real (emulated) OOM inside the action (inside autograd), from a second MemoryCap
# active during the action only, which lets the action allocate INSIDE_LIMIT bytes.
FAILURES = {
    "oom_before_1I0": (1, "I", 0, "hook"),  # rank 1 holds microbatch 0's forward (loss and logits)
    "oom_before_1W0": (1, "W", 0, "hook"),  # rank 1 holds both forwards after dI: dW state, input gradients
    "oom_before_0F1": (0, "F", 1, "hook"),  # rank 0 holds microbatch 0's forward and the unsharded parameters
    "oom_inside_1I0": (1, "I", 0, "cap"),  # inside autograd: dI half done
    "oom_inside_1W0": (1, "W", 0, "cap"),  # inside autograd: some weight gradients accumulated
}


INSIDE_LIMIT = 8 * HIDDEN_BYTES  # dI allocates ~24, dW ~15 boundary tensors here: both fail midway


# ---- the worker -----------------------------------------------------------------------------


class _StoppedByPeer(RuntimeError):
    """Another stage failed in this time step (seen at the step's barrier)."""


def _microbatches() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (MB * N, SEQ), generator=g)
    labels = torch.roll(ids, -1, 1)
    return [
        {"input_ids": ids[i * MB : (i + 1) * MB], "labels": labels[i * MB : (i + 1) * MB], "index": i} for i in range(N)
    ]


class _LossProbe:
    """The loss (cross entropy written as log_softmax + nll_loss, so that the largest tensor of the
    loss graph, the saved log_softmax output of LOGITS_BYTES, can be watched through a weak
    reference to its storage). `hold_graph`: keep each loss's autograd node for the whole batch,
    as the loss torch's schedules returned to the caller did before torch's fix (#138119)."""

    def __init__(self, hold_graph: bool = False) -> None:
        self.hold_graph = hold_graph
        self.log_probs: dict[int, Any] = {}
        self.held: list[Any] = []

    def __call__(self, outputs: torch.Tensor, microbatch: dict[str, Any]) -> torch.Tensor:
        log_probs = F.log_softmax(outputs.float(), dim=-1)
        self.log_probs[microbatch["index"]] = weakref.ref(log_probs.untyped_storage())
        loss = F.nll_loss(log_probs.flatten(0, 1), microbatch["labels"].flatten()) / N
        if self.hold_graph:
            self.held.append(loss.grad_fn)
        return loss

    def alive(self) -> list[bool]:
        return [m in self.log_probs and self.log_probs[m]() is not None for m in range(N)]


def _caused_by_oom(error: Optional[BaseException]) -> bool:
    """An OOM, or an error raised `from` one (torch 2.15's stages wrap backward errors)."""
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        error = error.__cause__
    return False


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor: its local shard
            t = t.to_local()
        storage = t.untyped_storage()
        seen[internals.storage_key(storage)] = storage.nbytes()
    return sum(seen.values())


class _Recorder:
    """The executor's hooks: a sample of the live bytes before and after every action, a barrier
    per time step that stops every stage in the step where one failed, an injected OOM. Also a
    spy on the executor's exchanges (`exchange_spy`): which tensors crossed the stage boundary,
    per microbatch (both schedules here receive and send in microbatch order)."""

    def __init__(
        self, pipe: Any, cap: MemoryCap, sharded_bytes: int, probe: _LossProbe, fail: Optional[tuple[str, int, str]]
    ) -> None:
        self.pipe = pipe
        self.cap = cap
        self.sharded_bytes = sharded_bytes
        self.probe = probe
        self.fail = fail  # (kind, microbatch, how) of this rank's injected failure
        self.inner: Optional[MemoryCap] = None  # "cap": active during the failing action only
        self.flag = torch.zeros(1)  # allocated before the cap is entered: votes allocate nothing
        self.samples: list[dict[str, Any]] = []
        self.current: Optional[Action] = None
        self.finished: set[int] = set()  # microbatches whose last backward action (W or B) ran
        self.barriers = 0
        self.received: list[tuple[Any, Any]] = []  # (tensor ref, storage ref) per microbatch
        self.sent: list[tuple[Any, Any]] = []

    def exchange_spy(self, original: Any) -> Any:
        def batch_isend_irecv(ops: list[Any]) -> Any:
            if self.barriers >= 2:  # the executor's exchanges (not torch's set-up message, 2.11+)
                for op in ops:
                    if tuple(op.tensor.shape) == (MB, SEQ, D_MODEL):
                        refs = (weakref.ref(op.tensor), weakref.ref(op.tensor.untyped_storage()))
                        (self.received if op.op is dist.irecv else self.sent).append(refs)
            return original(ops)

        return batch_isend_irecv

    # -- the accounting --------------------------------------------------------------------------

    def params_bytes(self) -> int:
        """Sharded parameters (constant, counted at the start) + FSDP2's unsharded parameters and
        every gradient, sharded or unsharded (the attributes `_torch_internals.unsharded_bytes`
        reads, checked on torch 2.7, 2.11 and 2.15)."""
        tensors: list[Any] = []
        for module in self.pipe.sharded.fsdp_modules:
            group = internals.param_group(module)
            for fsdp_param in group.fsdp_params if group is not None else ():
                tensors.extend(getattr(fsdp_param, "all_gather_outputs", None) or ())
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    tensors += [unsharded, unsharded.grad]
                tensors += [getattr(fsdp_param, "unsharded_accumulated_grad", None), fsdp_param.sharded_param.grad]
        for p in self.pipe.sharded.module.parameters():
            tensors += [p if not hasattr(p, "to_local") else None, p.grad]
        return self.sharded_bytes + _storage_bytes(tensors)

    def buffers_bytes(self) -> int:
        """Received tensors: torch's receive buffers still in the stage's receive infos (allocated
        up front on 2.7 and 2.11) and every tensor an exchange received (2.15 takes the buffer
        out of the info when it uses it)."""
        storages: dict[int, int] = {}
        stage = self.pipe.runner._stage
        if stage is not None:
            for infos_of in (stage.args_recv_info, stage.grad_recv_info):
                for infos in infos_of.values():
                    for info in infos:
                        buffer = getattr(info, "buffer", None)
                        if isinstance(buffer, torch.Tensor):
                            storage = buffer.untyped_storage()
                            storages[internals.storage_key(storage)] = storage.nbytes()
        for _, storage_ref in self.received:
            storage = storage_ref()
            if storage is not None:
                storages[internals.storage_key(storage)] = storage.nbytes()
        return sum(storages.values())

    def left_bytes(self) -> tuple[int, int]:
        """What finished microbatches still hold of what crossed the boundary: (the `.grad` of the
        tensors they received: the last stage's input gradients; the tensors they sent, not
        counted already: the first stage's outputs, the last stage's input gradients)."""
        grads: dict[int, int] = {}
        sent: dict[int, int] = {}
        for m in self.finished:
            if m < len(self.received):
                tensor = self.received[m][0]()
                grad = None if tensor is None else tensor.grad
                if grad is not None:
                    grads[internals.storage_key(grad.untyped_storage())] = grad.untyped_storage().nbytes()
            if m < len(self.sent):
                storage = self.sent[m][1]()
                if storage is not None:
                    sent[internals.storage_key(storage)] = storage.nbytes()
        return sum(grads.values()), sum(n for key, n in sent.items() if key not in grads)

    def sample(self, label: str) -> dict[str, Any]:
        live = self.cap.live_bytes
        params = self.params_bytes()
        buffers = self.buffers_bytes()
        left = self.left_bytes()
        row = dict(
            label=label,
            live=live,
            params=params,
            buffers=buffers,
            activations=live - params - buffers,
            left=sum(left),
            left_recv_grads=left[0],
            left_sent=left[1],
            log_probs_alive=self.probe.alive(),
        )
        self.samples.append(row)
        return row

    # -- the hooks -------------------------------------------------------------------------------

    def before_action(self, action: Action) -> None:
        self.sample(f"before {action}")
        self.current = action
        if self.fail is not None and self.fail[:2] == (action.kind, action.microbatch):
            if self.fail[2] == "hook":
                self.current = None
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected before {action})")
            self.inner = MemoryCap(INSIDE_LIMIT)
            self.inner.__enter__()

    def leave_inner(self) -> None:
        if self.inner is not None:
            self.inner.__exit__(None, None, None)
            self.inner = None

    def after_loss(self, microbatch: int) -> None:
        pass

    every_step = True
    drains = False

    def barrier(self) -> None:
        self.leave_inner()
        self.barriers += 1
        action, self.current = self.current, None
        if action is not None:
            if action.kind in ("W", "B"):
                self.finished.add(action.microbatch)
            self.sample(f"after {action}")
        self.vote(0)

    def vote(self, failed: int) -> None:
        """The step's barrier: every stage learns whether one failed in this step."""
        self.flag.fill_(failed)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.pipe.layout.pp_group)
        if self.flag.item() and not failed:
            raise _StoppedByPeer("another stage failed in this time step")


def _build(schedule: str, keep: bool = False, ac: bool = False) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = build_model("tiny", n_layers=4)
    config = PipelineConfig(stages=2, schedule=schedule, keep_graph_after_input_grad=keep)
    return model, build_pipeline(model, config, FSDP2Config(activation_checkpointing=ac))


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_case(
    schedule: str,
    keep: bool = False,
    ac: bool = False,
    hold_loss_graph: bool = False,
    fail: Optional[tuple[int, str, int, str]] = None,
) -> dict[str, Any]:
    """One batch under the cap, samples before and after every action. After a failure (`fail`,
    see FAILURES): release, recover, one more batch."""
    model, pipe = _build(schedule, keep, ac)
    rank = dist.get_rank()
    probe = _LossProbe(hold_graph=hold_loss_graph)
    microbatches = _microbatches()
    cap = MemoryCap(None)
    sharded_bytes = cap.track_existing(pipe.sharded.module)
    recorder = _Recorder(pipe, cap, sharded_bytes, probe, fail[1:] if fail is not None and fail[0] == rank else None)
    result: dict[str, Any] = {"sharded_bytes": sharded_bytes, "error": None}
    original = dist.batch_isend_irecv
    try:
        with cap:
            dist.batch_isend_irecv = recorder.exchange_spy(original)
            try:
                total = pipe.runner.run(microbatches, model.pipeline_inputs, probe, recorder)
                result["loss"] = None if total is None else float(total)
                del total
            except BaseException as error:  # noqa: BLE001 - a failed attempt, recorded
                recorder.leave_inner()
                if not isinstance(error, _StoppedByPeer):
                    recorder.vote(1)  # the barrier the other stages wait at in this step
                result["error"] = f"{type(error).__name__}: {error}"
                result["oom"] = _caused_by_oom(error)
                result["failed_in"] = None if recorder.current is None else str(recorder.current)
                result["at_failure"] = recorder.sample("at failure")
                pipe.runner.release()
                pipe.sharded.recover()
                result["released_frames_alive"] = recorder.sample("released, traceback frames alive")
                # What the attempt fence does with an OOM before it wipes (`attempt._drop_frames`).
                traceback.clear_frames(error.__traceback__)
                result["released_in_except"] = recorder.sample("released, frames cleared")
            result["end"] = recorder.sample("end")
            pipe.runner.release()
            result["end_released"] = recorder.sample("end, release() again")
            probe.held.clear()
            result["probe_cleared"] = recorder.sample("loss nodes dropped")
            result["grad_bytes"] = _storage_bytes(p.grad for p in model.parameters())
        if result["error"] is not None and fail is not None:
            # The next attempt: a normal batch on the same (recovered) stage, no limit, counted
            # from the parameters again.
            first_cap, first_cap_params = cap, sharded_bytes
            cap = MemoryCap(None)
            sharded_bytes = cap.track_existing(pipe.sharded.module)
            again = _Recorder(pipe, cap, sharded_bytes, _LossProbe(), None)
            with cap:
                dist.batch_isend_irecv = again.exchange_spy(original)
                pipe.runner.run(microbatches, model.pipeline_inputs, again.probe, again)
                result["retry_end"] = again.sample("retry end")
                result["grad_bytes"] = _storage_bytes(p.grad for p in model.parameters())
            # What the failed attempt allocated and is still live after the next batch.
            result["failed_attempt_live_after_retry"] = first_cap.live_bytes - first_cap_params
            gc.collect()
            result["failed_attempt_live_after_gc"] = first_cap.live_bytes - first_cap_params
    finally:
        dist.batch_isend_irecv = original
    result["grads"] = _grads(model)  # outside the cap: the copies are not counted
    if result["error"] is None:
        for p in model.parameters():
            p.grad = None  # zero_grad(set_to_none=True)
        result["zero_grad"] = recorder.sample("gradients dropped")
    result["samples"] = recorder.samples
    result["compute_stream_buffers"] = pipe.sharded.compute_stream_buffers
    return result


def _plain_forward_bytes(stage_index: int, ac: bool, head_only: bool = False) -> int:
    """The known figure: live bytes one microbatch's forward (and loss, on the last stage) leaves
    on this stage's module, unsharded, no pipeline, output and loss kept. `head_only`: only the
    last stage's norm + head + loss, on a hidden-state input."""
    torch.manual_seed(0)
    model = build_model("tiny", n_layers=4)
    stage = model.pipeline_stage(split_blocks(4, 2)[stage_index], first=stage_index == 0, last=stage_index == 1)
    if ac:
        for block in stage.blocks.values():
            internals.apply_activation_checkpointing(block)
    microbatch = _microbatches()[0]
    last = stage_index == 1
    x = microbatch["input_ids"] if stage_index == 0 else torch.randn(MB, SEQ, D_MODEL, requires_grad=True)
    probe = _LossProbe()
    cap = MemoryCap(None)
    with cap:
        before = cap.live_bytes
        out = stage.lm_head(stage.norm(x)) if head_only else stage(x)
        loss = probe(out, microbatch) if last else None
        held = cap.live_bytes - before
    del out, loss
    return held


def _run_cases(rank: int, world: int) -> dict[str, Any]:
    gc.collect()
    gc.disable()
    try:
        out: dict[str, Any] = {
            "plain": _plain_forward_bytes(rank, ac=False),
            "plain_ac": _plain_forward_bytes(rank, ac=True),
            "plain_head": _plain_forward_bytes(1, ac=False, head_only=True) if rank == 1 else None,
            "zb": _run_case("ZeroBubble"),
            "zb_keep": _run_case("ZeroBubble", keep=True),
            "zb_hold_loss_graph": _run_case("ZeroBubble", hold_loss_graph=True),
            "1f1b_ac": _run_case("1F1B", ac=True),
        }
        for name, fail in FAILURES.items():
            out[name] = _run_case("ZeroBubble", fail=fail)
        return out
    finally:
        gc.enable()


# ---- reading the samples --------------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_multiprocess(_run_cases, world_size=2, timeout_s=120)


def _at(case: dict[str, Any], label: str) -> dict[str, Any]:
    rows = [row for row in case["samples"] if row["label"] == label]
    assert len(rows) == 1, f"{label!r} sampled {len(rows)} times: {[r['label'] for r in case['samples']]}"
    return rows[0]


def _acts(case: dict[str, Any], label: str) -> int:
    return _at(case, label)["activations"]


def _forward_bytes(case: dict[str, Any], rank: int, microbatch: int) -> int:
    return _acts(case, f"after {rank}F{microbatch}") - _acts(case, f"before {rank}F{microbatch}")


def _ok(case: dict[str, Any]) -> dict[str, Any]:
    assert case["error"] is None, case["error"]
    return case


# ---- 1. ZeroBubble without activation checkpointing ------------------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("case_name", ["zb", "zb_keep"])
def test_forward_holds_the_activation_bytes_of_the_plain_stage(results, case_name):
    for rank, result in enumerate(results):
        case = _ok(result[case_name])
        for m in range(N):
            held = _forward_bytes(case, rank, m)
            assert abs(held - result["plain"]) <= TOL, (
                f"{case_name} rank {rank} F{m}: activations grew by {held} bytes, the plain stage's forward holds "
                f"{result['plain']}"
            )
    # The figure itself: a forward holds many boundary-sized tensors.
    assert results[0]["plain"] > 20 * HIDDEN_BYTES and results[1]["plain"] > 20 * HIDDEN_BYTES


@pytest.mark.multiproc
def test_input_gradient_frees_the_loss_graph_on_the_last_stage(results):
    case = _ok(results[1]["zb"])
    for m in range(N):
        assert _at(case, f"after 1F{m}")["log_probs_alive"][m], f"F{m}: the loss graph's log_softmax output is not held"
        assert not _at(case, f"after 1I{m}")["log_probs_alive"][m], (
            f"after 1I{m} (dI) microbatch {m}'s loss graph (its log_softmax output, {LOGITS_BYTES} bytes) is alive"
        )
    # The same batch with each loss's autograd node held (as torch's schedules handed the loss to
    # the caller before torch's fix): the log_softmax output survives dI, and the byte count sees it.
    held = _ok(results[1]["zb_hold_loss_graph"])
    assert _at(held, "after 1I0")["log_probs_alive"][0]
    extra = _acts(held, "after 1I0") - _acts(case, "after 1I0")
    assert extra >= LOGITS_BYTES, f"a held loss graph keeps only {extra} bytes more after dI"
    assert abs(_forward_bytes(held, 1, 0) - _forward_bytes(case, 1, 0)) <= TOL  # the same forward


# The orders (torch's ZB1P on 2 stages): rank 0 F0 F1 I0 W0 I1 W1 (the first stage's dI is part of
# its dW), rank 1 F0 I0 F1 I1 W0 W1. After dW of microbatch 0 a rank holds what it held when
# microbatch 0 alone was where microbatch 1 is now (same shapes): rank 0 after W0 as after F0,
# rank 1 after W0 as after I0. "before X" samples: after the previous step's exchange.
ZB_AFTER_W0 = {0: ("before 0I1", "before 0F1"), 1: ("before 1W1", "before 1F1")}


def _residue(case: dict[str, Any], later: str, reference: str) -> int:
    """Activations at `later` minus those at `reference`, without what finished microbatches
    left outside their graphs (`left`, checked to be zero by its own test below)."""
    row, ref = _at(case, later), _at(case, reference)
    return (row["activations"] - row["left"]) - (ref["activations"] - ref["left"])


@pytest.mark.multiproc
def test_weight_gradient_frees_the_graph_of_its_microbatch(results):
    for rank, (later, reference) in ZB_AFTER_W0.items():
        case = _ok(results[rank]["zb"])
        residue = _residue(case, later, reference)
        assert abs(residue) <= TOL, f"rank {rank}: {residue} bytes of microbatch 0 outlive its dW"
        last = _at(case, f"after {rank}W{N - 1}")
        assert abs(last["activations"] - last["left"]) <= TOL, (
            f"rank {rank}: after the last dW {last['activations'] - last['left']} activation bytes are left"
        )


@pytest.mark.multiproc
def test_keep_graph_after_input_grad_keeps_each_graph_until_the_end_of_the_batch(results):
    """The measurement aid (the memory behaviour before torch's fix). On the last stage dI frees
    the same either way: the kept node is the stage output's (the logits'), which dW needs anyway,
    while the loss's own nodes are above it. The difference comes after dW: the graph's tensors
    that only dI used stay with the kept node, until `release()` at the end of the batch."""
    fixed, kept = _ok(results[1]["zb"]), _ok(results[1]["zb_keep"])
    assert abs(_acts(kept, "after 1I0") - _acts(fixed, "after 1I0")) <= TOL
    later, _ = ZB_AFTER_W0[1]
    extra = _acts(kept, later) - _acts(fixed, later)
    assert extra >= results[1]["plain"] // 4, f"keep_graph_after_input_grad kept only {extra} bytes after W0"
    assert kept["end"]["live"] == fixed["end"]["live"], "release() at the end of the batch drops the kept graphs"


@pytest.mark.multiproc
@pytest.mark.parametrize("case_name", ["zb", "zb_keep", "zb_hold_loss_graph", "1f1b_ac"])
def test_after_the_batch_only_parameters_and_gradients_are_live(results, case_name):
    for rank, result in enumerate(results):
        case = _ok(result[case_name])
        expected = case["sharded_bytes"] + case["grad_bytes"]
        assert case["grad_bytes"] > 0
        # hold_loss_graph: the caller's own references, dropped at "loss nodes dropped".
        ends = ("probe_cleared",) if case_name == "zb_hold_loss_graph" else ("end", "end_released", "probe_cleared")
        for name in ends:
            assert abs(case[name]["live"] - expected) <= TOL, (
                f"{case_name} rank {rank} {name}: {case[name]['live']} live bytes, parameters + gradients: {expected}"
            )


@pytest.mark.multiproc
def test_dropping_the_gradients_after_a_batch_frees_them(results):
    for rank, result in enumerate(results):
        case = _ok(result["zb"])
        excess = case["zero_grad"]["live"] - case["sharded_bytes"]
        assert abs(excess) <= TOL, f"rank {rank}: {excess} bytes stay live after the gradients are dropped"


@pytest.mark.multiproc
def test_a_finished_microbatch_leaves_nothing_until_the_end_of_the_batch(results):
    rows = [_at(_ok(result["zb"]), f"after {rank}W{N - 1}") for rank, result in enumerate(results)]
    assert all(row["left"] == 0 for row in rows), "; ".join(
        f"rank {rank}: finished microbatches leave {row['left_recv_grads']} bytes of receive-buffer gradients and "
        f"{row['left_sent']} bytes of sent tensors until release()"
        for rank, row in enumerate(rows)
    )


# ---- 2. activation checkpointing (1F1B: build_pipeline refuses ZeroBubble with it) ----------


@pytest.mark.multiproc
def test_activation_checkpointing_holds_only_block_inputs(results):
    for rank, result in enumerate(results):
        case = _ok(result["1f1b_ac"])
        for m in range(N):
            held = _forward_bytes(case, rank, m)
            assert abs(held - result["plain_ac"]) <= TOL, (
                f"rank {rank} F{m}: {held} bytes, the plain checkpointed stage holds {result['plain_ac']}"
            )
        assert result["plain_ac"] * 4 <= result["plain"], (result["plain_ac"], result["plain"])
    # Stage 0: the embedding's output (block 0's input), block 1's input, the stage output.
    assert abs(results[0]["plain_ac"] - 3 * HIDDEN_BYTES) <= TOL, results[0]["plain_ac"]
    # Stage 1: block 2's input is the received tensor (not new); block 3's input, block 3's output
    # (the head's input) and what the head (norm, lm_head, loss: not checkpointed) saves.
    assert abs(results[1]["plain_ac"] - 2 * HIDDEN_BYTES - results[1]["plain_head"]) <= TOL, results[1]["plain_ac"]


@pytest.mark.multiproc
def test_activation_checkpointing_backward_frees_its_microbatch(results):
    """1F1B: rank 0 runs F0 F1 B0 B1 (after B0 as after F0), rank 1 F0 B0 F1 B1 (after B0 as
    before F0)."""
    for rank, (later, reference) in {0: ("before 0B1", "before 0F1"), 1: ("before 1F1", "before 1F0")}.items():
        residue = _residue(_ok(results[rank]["1f1b_ac"]), later, reference)
        assert abs(residue) <= TOL, f"rank {rank}: {residue} bytes of microbatch 0 outlive its backward"


# ---- 3. after a failed attempt --------------------------------------------------------------


# torch 2.7 and 2.11 leave an OOM inside dI's graph alive through hooks torch never removes;
# `_torch_internals.install_input_grad_failure_cleanup` breaks those cycles (this test is what
# found them: 1,612,288 bytes stayed live after the next batch before it).
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "case_name", list(FAILURES)
)
def test_release_and_recover_after_a_failed_attempt_free_everything(results, case_name):
    fail_rank, kind, m, how = FAILURES[case_name]
    for rank, result in enumerate(results):
        case = result[case_name]
        assert case["error"] is not None, f"rank {rank}: the attempt did not fail"
        if rank == fail_rank:
            assert case["oom"], case["error"]
            if how == "cap":
                assert case["failed_in"] == f"{rank}{kind}{m}", f"failed in {case['failed_in']}: {case['error']}"
        else:
            assert case["error"].startswith("_StoppedByPeer"), f"rank {rank}: {case['error']}"
        # Something of the attempt was live when it failed ...
        assert case["at_failure"]["activations"] > HIDDEN_BYTES, case["at_failure"]
        # ... and nothing after release() and recover(), once the exception's frames are cleared
        # as the attempt fence does (they hold run()'s locals: the losses, the last output). An
        # OOM raised inside autograd (how == "cap") keeps part of the graph through the exception
        # object itself, not its frames' locals, until the exception is dropped (the fence drops
        # it before the next attempt): checked from there on.
        names = ("end", "end_released") if how == "cap" else ("released_in_except", "end", "end_released")
        for name in names:
            row = case[name]
            assert abs(row["live"] - case["sharded_bytes"]) <= TOL, (
                f"{case_name} rank {rank} {name}: {row['live']} live bytes, the parameters are {case['sharded_bytes']} "
                f"({row['activations']} activations, {row['params'] - case['sharded_bytes']} unsharded/gradients, "
                f"{row['buffers']} receive buffers)"
            )
        left = case["failed_attempt_live_after_retry"]
        assert abs(left) <= TOL, f"{case_name} rank {rank}: {left} bytes of the failed attempt outlive the next batch"


@pytest.mark.multiproc
@pytest.mark.parametrize("case_name", list(FAILURES))
def test_a_batch_after_a_failed_attempt_gives_the_gradients_of_a_fresh_run(results, case_name):
    for rank, result in enumerate(results):
        case, fresh = result[case_name], _ok(result["zb"])
        assert set(case["grads"]) == set(fresh["grads"]) and fresh["grads"]
        worst = max((case["grads"][n] - fresh["grads"][n]).abs().max().item() for n in fresh["grads"])
        assert worst <= 1e-6, f"{case_name} rank {rank}: gradients differ from a fresh run by {worst}"
        expected = case["sharded_bytes"] + case["grad_bytes"]
        assert abs(case["retry_end"]["live"] - expected) <= TOL, (case["retry_end"], expected)
