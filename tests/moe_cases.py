"""Routed (mixture-of-experts) models from transformers, built from a config (tests/test_routing.py, tests/test_moe.py).

Tiny configs of the three routed families (Qwen3-MoE, OLMoE, Mixtral: 2 blocks, 16 experts, 2 per token, a narrow
hidden size and wide experts, a vocabulary of 128), samples of 128 tokens; for the Trainer cases, Composer's
`HuggingFaceModel`, `automicro.Trainer` with `AutoMicrobatching` under an emulated per-rank cap (`limits`), FSDP2 over
the ranks, AdamW, a per-rank batch of 8. Every case returns plain data; one that breaks is {"crash": ...}.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch

from automicro.batch import routing
from tests.case_runs import run_case

SEQ, VOCAB = 128, 128
FAMILIES = ("qwen3moe", "olmoe", "mixtral")
PER_RANK, BATCHES, SKEWED = 8, 4, 3  # SKEWED: the batch whose first attempt is skewed on rank 1
RETRY_BAND = 0.01  # the emulated allocator retries only within 1% of the cap (the caps sit a few % above the peaks)


def moves_with_routing() -> bool:
    """Whether the family's expert layers hold more at their peak when one expert takes most tokens, under the CPU
    emulation: transformers 4.x's expert loop (each expert an `nn.Linear` MLP) does (a skewed batch's peak 5-8% above
    an even one's at 2-8 samples of 128 tokens, FSDP2 over 2 ranks with AdamW's state); 5.x's experts (3D weights, one product per expert hit) do not (the same peak
    to 0.01 MB: the activations they save are the same bytes however the tokens are routed)."""
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


def config(family: str, aux_loss: bool = False) -> Any:
    """The family's transformers config at the tiny shape (`aux_loss`: the load-balancing loss in the loss)."""
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=SEQ, output_router_logits=aux_loss, use_cache=False)
    if family == "qwen3moe":
        return transformers.Qwen3MoeConfig(**base, intermediate_size=64, moe_intermediate_size=1024, num_experts=16,
                                           num_experts_per_tok=2, head_dim=8)
    if family == "olmoe":
        return transformers.OlmoeConfig(**base, intermediate_size=1024, num_experts=16, num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralConfig(**base, intermediate_size=1024, num_local_experts=16, num_experts_per_tok=2)
    raise ValueError(family)


def limits(kind: str = "search") -> dict[int, int]:
    """The emulated caps, with a few MB either way of each size that must or must not fit (each rank's peak at 4, AdamW's
    state included: 75 MB on 4.x, 84 MB on 5.x; at 8: 105 MB and 123 MB). ``search``: 4 fits, 8 does not;
    ``skewed``: as ``search``, and on 4.x rank 1 does not fit a skewed batch at 4 (80 MB)."""
    if not moves_with_routing():
        return {0: 89_000_000, 1: 89_000_000}
    return {0: 80_500_000, 1: 78_500_000 if kind == "skewed" else 80_500_000}


def model(family: str, aux_loss: bool = False) -> Any:
    import transformers
    from composer.models import HuggingFaceModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the tokenizer was not provided", a config's token ids
        return HuggingFaceModel(transformers.AutoModelForCausalLM.from_config(config(family, aux_loss)), tokenizer=None,
                                use_logits=True)


def run(family: str, microbatch: Any = "auto", *, aux_loss: bool = False, batches: int = BATCHES, extra: tuple[Any, ...] = (),
        save_folder: Optional[str] = None, load_path: Optional[str] = None, caps: str = "search",
        auto_args: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """`family` for `batches` batches at `microbatch` ("auto": `AutoMicrobatching(**auto_args)` under `limits(caps)`):
    the losses, the lines, the search's history, the parameters (gathered), the routers the watch counts in
    (``watched``)."""
    from composer.core import Callback

    import automicro
    from automicro.data import SyntheticTokens, build_dataloader
    from automicro.testing import MemoryCapCallback

    from tests.toy_models import full_state

    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    net = model(family, aux_loss)
    callbacks: list[Any] = list(extra)
    auto = cap = None
    if microbatch == "auto":
        auto = automicro.AutoMicrobatching(log_attempts=True, **(auto_args or {}))
        cap = MemoryCapCallback(limit_bytes=limits(caps), retry_band=RETRY_BAND)
        callbacks += [auto, cap]
    losses: dict[int, float] = {}
    lines: list[str] = []

    class Losses(Callback):
        def batch_end(self, state: Any, logger: Any) -> None:
            losses[int(state.timestamp.batch)] = float(state.loss)

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, log = Lines(level=logging.INFO), logging.getLogger("automicro")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    out: dict[str, Any] = {}
    try:
        trainer = automicro.Trainer(
            model=net, optimizers=torch.optim.AdamW(net.parameters(), lr=1e-3), max_duration=f"{batches}ba",
            train_dataloader=build_dataloader(SyntheticTokens(PER_RANK * world * 6, SEQ, VOCAB, seed=3), PER_RANK, shuffle=False),
            device="cpu", parallelism_config={"fsdp2": {}}, device_train_microbatch_size=microbatch,
            callbacks=callbacks + [Losses()], loggers=[], progress_bar=False, log_to_console=False, seed=17,
            save_folder=save_folder, save_interval="2ba", load_path=load_path,
        )
        try:
            trainer.fit()
            out["state"] = full_state(net)
        except Exception as error:  # noqa: BLE001 - returned to the test
            out["exception"] = {"type": type(error).__name__, "message": str(error)[:3000]}
        out.update(batches=int(trainer.state.timestamp.batch))
        trainer.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    out.update(losses=losses, lines=lines, watched=sum(hasattr(m, routing._BUFFER) for m in net.modules()))
    if cap is not None:  # counted buffers gloo's worker thread freed (not the program): 0, or the sizes move run to run
        stats = cap.cap.stats()
        out.update(foreign_frees=stats["foreign_frees"], foreign_ops=stats["foreign_ops"], slow_releases=stats["slow_releases"])
    if auto is not None:
        out.update(found=auto.found_size, history=[(r.batch, r.attempt, r.size, list(r.split), r.outcome, r.failed_ranks, r.note)
                                                   for r in auto.history])
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The largest parameter and loss gaps of two runs; their parameters dropped (plain data back to the test)."""
    sa, sb = a.pop("state", None), b.pop("state", None)
    gap = None if sa is None or sb is None else max(float((sa[k] - sb[k]).abs().max()) for k in sa)
    shared = [i for i in a["losses"] if i in b["losses"]]
    return {"param_gap": gap, "loss_gap": max((abs(a["losses"][i] - b["losses"][i]) for i in shared), default=None)}



def _pair(family: str, aux_loss: bool = False, batches: int = BATCHES) -> dict[str, Any]:
    auto = run(family, aux_loss=aux_loss, batches=batches)
    # The size found; after one batch, the size that batch trained at (the search goes on in the next).
    size = auto.get("found") or next((h[2] for h in reversed(auto.get("history", [])) if h[4] == "ok"), None)
    if not size:
        return {"auto": auto}
    fixed = run(family, size, aux_loss=aux_loss, batches=batches)
    return {"auto": auto, "fixed": fixed, **compare(auto, fixed)}


def two_ranks(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Per family ``auto`` under `limits()` against a fixed run at the size found; ``olmoe_aux``: OLMoE with its
    load-balancing loss in the loss, one batch (8 runs out, 4 trains: a later batch's search tries other splits, and
    that loss is not the same over another split); ``skew``: Qwen3-MoE with the first attempt of batch `SKEWED` skewed on rank 1 (its 2 forward passes at
    the settled split (4, 4), 90% of the tokens to expert 0), against a fixed run routed as the model routes where that ran out (4.x) and skewed alike where it
    did not (5.x); ``resume``: Qwen3-MoE's 2 batches with a checkpoint, then the rest, against the whole run."""
    from automicro.testing import RoutingSkew

    torch.set_num_threads(1)
    out: dict[str, Any] = {"moves": moves_with_routing()}
    for family in FAMILIES:
        run_case(out, family, lambda family=family: _pair(family))
    run_case(out, "olmoe_aux", lambda: _pair("olmoe", aux_loss=True, batches=1))

    def skewed() -> dict[str, Any]:
        def skew() -> RoutingSkew:
            return RoutingSkew([SKEWED], expert=0, share=0.9, ranks=[1], forwards=2)

        auto = run("qwen3moe", extra=(skew(),), caps="skewed")
        if not auto.get("found"):
            return {"auto": auto}
        fixed = run("qwen3moe", auto["found"], extra=() if moves_with_routing() else (skew(),))
        return {"auto": auto, "fixed": fixed, **compare(auto, fixed)}

    run_case(out, "skew", skewed)

    def resume() -> dict[str, Any]:
        whole = run("qwen3moe")
        saved = run("qwen3moe", batches=2, save_folder=f"{folder}/saved")
        resumed = run("qwen3moe", load_path=f"{folder}/saved/ep0-ba2-rank0.pt")
        gaps = compare(resumed, whole)
        saved.pop("state", None)
        return {"whole": whole, "saved": saved, "resumed": resumed, **gaps}

    run_case(out, "resume", resume)
    return out


def one_rank(rank: int, world: int) -> dict[str, Any]:
    """Qwen3-MoE on one rank (FSDP2 over one: the whole model on it) under rank 0's cap: ``auto`` against a fixed run."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    run_case(out, "qwen3moe", lambda: _pair("qwen3moe", batches=3))
    run_case(out, "unwatched", lambda: run("qwen3moe", batches=2, auto_args={"watch_routing": False}))
    return out
