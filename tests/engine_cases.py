"""Multi-rank engine cases, run many per process group (start-up dominates on CPU).

Each case returns plain data; the tests in test_engine.py assert on it.
"""

from __future__ import annotations

import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist

from automicro.engine import FSDP2Config, shard
from automicro.engine import _torch_internals as internals
from tests.toy_models import Stack, full_state, make_data

STEPS = 3
GLOBAL_BATCH = 8


class Boom(RuntimeError):
    pass


def _reference(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in make_data(steps, GLOBAL_BATCH):
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _local(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    share = x.shape[0] // world
    return x[rank * share : (rank + 1) * share]


def _raise(*_: Any) -> None:
    raise Boom("injected failure")


def _inject(sharded, model, point: str):
    """Arrange for a plain exception at `point` during the next forward/backward."""
    block = model.blocks[1]
    if point == "pre_forward":
        return [block.register_forward_pre_hook(_raise, prepend=True)]
    if point == "mid_forward":
        return [block.register_forward_hook(_raise)]
    if point == "pre_backward":
        return [block.register_full_backward_pre_hook(_raise, prepend=True)]
    if point == "mid_backward":
        return [block.register_full_backward_hook(_raise)]
    if point == "post_backward_reduce_scatter":
        return [internals.add_pre_collective_hook(lambda site, params: _raise() if site == "reduce_scatter_alloc" else None)]
    if point == "forward_all_gather":
        state = {"n": 0}

        def hook(site, params):
            if site == "unshard_alloc":
                state["n"] += 1
                if state["n"] == 3:
                    _raise()

        return [internals.add_pre_collective_hook(hook)]
    raise ValueError(point)


def _rs_comm_stats(sharded) -> Optional[dict[str, int]]:
    comm = sharded._reduce_scatter_comm
    if comm is None:
        return None
    return {
        "outputs": comm.outputs_from_compute_stream,
        "max_held": comm.max_held,
        "held": comm.held,
        "all_gather_outputs": sharded._all_gather_comm.outputs_from_compute_stream,
    }


def train_sharded(
    rank: int,
    world: int,
    config: FSDP2Config,
    fail_at: Optional[str] = None,
    mesh=None,
    accum: int = 1,
) -> dict[str, Any]:
    """3 AdamW steps; `accum` > 1 splits each rank's batch into that many microbatches whose
    gradients accumulate (every backward reduce-scatters, as Composer's loop does)."""
    torch.manual_seed(0)
    model = Stack()
    sharded = shard(model, config, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report: dict[str, Any] = {"failed": False, "held_after_backward": []}
    groups = [m for m in sharded.fsdp_modules if internals.param_group(m) is not None]
    report["one_comm_for_all_modules"] = (
        len({id(internals.reduce_scatter_comm(m)) for m in groups}) == 1
        and len({id(internals.all_gather_comm(m)) for m in groups}) == 1
    )
    for step, (x, y) in enumerate(make_data(STEPS, GLOBAL_BATCH)):
        x, y = _local(x, rank, world), _local(y, rank, world)
        if fail_at is not None and step == 1:
            handles = _inject(sharded, model, fail_at)
            try:
                out = model(x)
                loss = ((out - y) ** 2).mean()
                loss.backward()
            except Boom:
                report["failed"] = True
            finally:
                for handle in handles:
                    handle.remove()
            out = loss = None
            sharded.recover()
            report["clean_after_recover"] = sharded.is_clean()
            report["unsharded_bytes_after_recover"] = sharded.unsharded_bytes()
            report["grads_after_recover"] = sum(p.grad is not None for p in model.parameters())
            report["rs_comm_after_recover"] = _rs_comm_stats(sharded)
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            (((model(xm) - ym) ** 2).mean() / accum).backward()
            stats = _rs_comm_stats(sharded)
            report["held_after_backward"].append(None if stats is None else stats["held"])
        opt.step()
    report["clean_at_end"] = sharded.is_clean()
    report["rs_comm"] = _rs_comm_stats(sharded)
    report["params"] = full_state(model)
    report["plan"] = sharded.prefetch_plan()
    return report


def max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


NUMERICS_CONFIGS = {
    "defaults": FSDP2Config(),
    "prefetch0": FSDP2Config(forward_prefetch=0, backward_prefetch=0),
    "prefetch2": FSDP2Config(forward_prefetch=2, backward_prefetch=2),
    "no_reshard_after_forward": FSDP2Config(reshard_after_forward=False),
    "activation_checkpointing": FSDP2Config(activation_checkpointing=True),
    "sync_unshard": FSDP2Config(unshard_async_op=False, forward_prefetch=1),
    "async_unshard_prefetch2_ac": FSDP2Config(unshard_async_op=True, forward_prefetch=2, backward_prefetch=2, activation_checkpointing=True),
    "sync_unshard_ac": FSDP2Config(unshard_async_op=False, forward_prefetch=1, activation_checkpointing=True),
    "buffers_on_fsdp_streams": FSDP2Config(compute_stream_buffers=False),
    # The recompute dial's rungs below full (`automicro.engine.recompute`): the same numbers.
    "recompute_op": FSDP2Config(activation_checkpointing="op"),
    "recompute_first_block": FSDP2Config(activation_checkpointing=1),
}

FAIL_POINTS = ["pre_forward", "mid_forward", "forward_all_gather", "pre_backward", "mid_backward", "post_backward_reduce_scatter"]


def run_engine_cases(rank: int, world: int) -> dict[str, Any]:
    """Numerics for every config and recovery from every failure point, in one process group."""
    results: dict[str, Any] = {"torch": torch.__version__}
    reference = _reference(STEPS)
    for name, config in NUMERICS_CONFIGS.items():
        try:
            report = train_sharded(rank, world, config)
            results[f"numerics/{name}"] = {"error": max_error(report["params"], reference), "clean": report["clean_at_end"]}
        except Exception:  # noqa: BLE001 - report which case broke
            results[f"numerics/{name}"] = {"exception": traceback.format_exc()}
    # Gradient accumulation: 2 microbatches per step, each reduce-scattered; FSDP2 adds each
    # output into `.grad` on the reduce-scatter stream (the case the held outputs are for).
    for name in ("defaults", "sync_unshard_ac", "buffers_on_fsdp_streams"):
        try:
            report = train_sharded(rank, world, NUMERICS_CONFIGS[name], accum=2)
            results[f"accum/{name}"] = {
                "error": max_error(report["params"], reference),
                "clean": report["clean_at_end"],
                "rs_comm": report["rs_comm"],
                "held_after_backward": report["held_after_backward"],
                "one_comm": report["one_comm_for_all_modules"],
            }
        except Exception:  # noqa: BLE001
            results[f"accum/{name}"] = {"exception": traceback.format_exc()}
    for point in FAIL_POINTS:
        for config_name in ("defaults", "sync_unshard_ac"):
            config = NUMERICS_CONFIGS[config_name]
            try:
                report = train_sharded(rank, world, config, fail_at=point)
                results[f"recover/{point}/{config_name}"] = {
                    "error": max_error(report["params"], reference),
                    "failed": report["failed"],
                    "clean": report["clean_after_recover"],
                    "unsharded_bytes": report["unsharded_bytes_after_recover"],
                    "grads": report["grads_after_recover"],
                    "rs_comm": report["rs_comm_after_recover"],
                }
            except Exception:  # noqa: BLE001
                results[f"recover/{point}/{config_name}"] = {"exception": traceback.format_exc()}
    results["plan"] = train_sharded(rank, world, NUMERICS_CONFIGS["prefetch2"])["plan"]
    for name, (layout, ac) in KEEP_LAYOUTS.items():
        for fail in (False, True):
            try:
                results[f"keep/{name}/{'fail' if fail else 'clean'}"] = keep_between_microbatches(rank, world, layout, fail, ac)
            except Exception:  # noqa: BLE001
                results[f"keep/{name}/{'fail' if fail else 'clean'}"] = {"exception": traceback.format_exc()}
    return results


# name: (layout, the blocks checkpoint their activations). With checkpointing, "fixed" recomputes
# every block in backward; "no_recompute" and "all" switch that off (a layout trade).
KEEP_LAYOUTS = {
    "fixed": ((), False),
    "no_reshard": (("no_reshard",), False),
    "both": (("no_reshard", "grad_sync_once"), False),
    "ac_fixed": ((), True),
    "no_recompute": (("no_recompute",), True),
    "all": (("no_reshard", "grad_sync_once", "no_recompute"), True),
    # "switch": checkpointing carried switched off (`shard`'s checkpoint_switch); "recompute" turns it on.
    "recompute": (("recompute", "grad_sync_once"), "switch"),
    # The user's ``op`` rung: no_recompute switches it off, undone it is ``op`` again (not full).
    "op_no_recompute": (("no_recompute",), "op"),
    # A full recompute asked for, tried down to ``op`` (``recompute_op``): undone it is full again.
    "full_op": (("recompute_op",), True),
}
ACCUM = 3


def keep_between_microbatches(rank: int, world: int, layout: tuple[str, ...], fail: bool, ac: Any = False) -> dict[str, Any]:
    """`LayoutEngine` with `layout` over 3 microbatches per step: the blocks' sharded state after
    each backward (no_reshard keeps them unsharded until the last microbatch), and with `fail` a
    forward that raises in step 1's second microbatch (after the first kept its parameters
    unsharded), then the recovery and the step run again; the parameters against the reference.
    `ac`: the blocks checkpoint their activations (True), or carry checkpointing switched off
    ("switch"); each step counts the blocks' forwards (a recomputed block runs its forward twice per
    microbatch), and a last step runs at the engine's own layout again (the switch turned back)."""
    from automicro.engine.layout import LayoutEngine

    torch.manual_seed(0)
    model = Stack()
    asked = ac if ac in (True, "op") else False
    sharded = shard(model, FSDP2Config(activation_checkpointing=asked), checkpoint_switch=ac == "switch")
    engine = LayoutEngine(sharded)
    engine.apply(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report: dict[str, Any] = {"states": [], "failed": False, "forwards": [], "candidates": engine.candidates()}
    # What each trade is projected to cost: every block's unsharded parameters / gradients (fp32).
    report["extra_bytes"] = (engine.extra_bytes("no_reshard"), engine.extra_bytes("grad_sync_once"))
    report["block_bytes"] = 4 * sum(p.numel() for block in model.blocks for p in block.parameters())
    forwards = [0]

    def count(*_: Any) -> None:
        forwards[0] += 1

    for block in model.blocks:
        block.up.register_forward_hook(count)

    def blocks_state() -> list[str]:
        return sorted({row["sharded"] for row in sharded.states() if row["module"].startswith("blocks")})

    def run_step(x: torch.Tensor, y: torch.Tensor, raise_in: Optional[int]) -> list[list[str]]:
        states = []
        for index, (xm, ym) in enumerate(zip(x.chunk(ACCUM), y.chunk(ACCUM))):
            engine.before_microbatch(index, ACCUM)
            handles = [model.blocks[1].register_forward_hook(_raise)] if index == raise_in else []
            try:
                (((model(xm) - ym) ** 2).mean() / ACCUM).backward()
            finally:
                for handle in handles:
                    handle.remove()
            states.append(blocks_state())
        return states

    for step, (x, y) in enumerate(make_data(STEPS, GLOBAL_BATCH * ACCUM)):
        x, y = _local(x, rank, world), _local(y, rank, world)
        opt.zero_grad(set_to_none=True)
        if ac and step == STEPS - 1:
            # Undone between batches: recomputation is back (no_recompute) or gone again (recompute).
            engine.apply(tuple(t for t in layout if t not in ("no_recompute", "recompute", "recompute_op")))
        if fail and step == 1:
            try:
                run_step(x, y, raise_in=1)
            except Boom:
                report["failed"] = True
                report["unsharded_before_recover"] = blocks_state()
            sharded.recover()
            engine.reset()
            report["clean_after_recover"] = sharded.is_clean()
            opt.zero_grad(set_to_none=True)
        forwards[0] = 0
        report["states"].append(run_step(x, y, raise_in=None))
        report["forwards"].append(forwards[0])
        opt.step()
        engine.reset()
    report["clean_at_end"] = sharded.is_clean()
    report["rung_at_end"] = sharded.recompute.rung.kind if sharded.recompute is not None else None
    report["error"] = max_error(full_state(model), _reference_accum())
    return report


def _reference_accum() -> dict[str, torch.Tensor]:
    """The unsharded model on the whole batch of `keep_between_microbatches` (3 x GLOBAL_BATCH)."""
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in make_data(STEPS, GLOBAL_BATCH * ACCUM):
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_hsdp_case(rank: int, world: int) -> dict[str, Any]:
    reference = _reference(STEPS)
    if internals.TORCH_VERSION < (2, 8):
        try:
            train_sharded(rank, world, FSDP2Config(replicate=2))
        except Exception as error:  # noqa: BLE001 - the test checks the type and message
            return {"refused": f"{type(error).__name__}: {error}"}
        return {"refused": None}
    report = train_sharded(rank, world, FSDP2Config(replicate=2))
    return {"error": max_error(report["params"], reference), "clean": report["clean_at_end"], "world": dist.get_world_size()}


def _llama_batches(steps: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=generator)
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def run_llama_case(rank: int, world: int) -> dict[str, Any]:
    """Tiny Llama: 2-rank FSDP2 (engine defaults) vs one process, 3 AdamW steps, fp32."""
    from automicro.models import build_model

    batches = _llama_batches(STEPS, 4, 32)

    def run(sharded: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = build_model("tiny", max_seq_len=32)
        if sharded:
            shard(model, FSDP2Config())
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for batch in batches:
            if sharded:
                share = batch["input_ids"].shape[0] // world
                batch = {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
            opt.zero_grad(set_to_none=True)
            loss = model.loss(model(batch), batch)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses, full_state(model)

    ref_losses, ref_params = run(sharded=False)
    losses, params = run(sharded=True)
    local_mean = torch.tensor(losses)
    dist.all_reduce(local_mean)
    global_losses = (local_mean / world).tolist()
    return {
        "loss_error": max(abs(a - b) for a, b in zip(global_losses, ref_losses)),
        "param_error": max_error(params, ref_params),
    }
