"""Cases for tests/test_head.py: tiny transformers causal LMs of every family the head fuses (built from their configs,
no weights downloaded), the fused head against the plain one under FSDP2 on gloo ranks, and the main job under a cap
with `head: plain`, `fused` and `auto`."""

from __future__ import annotations

from typing import Any, Callable

import torch

import automicro
from automicro.testing.faults import FaultInjector

VOCAB = 500
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


def _config(family: str) -> Any:
    import transformers

    make: dict[str, Callable[[], Any]] = {
        "llama": lambda: transformers.LlamaConfig(**_COMMON),
        "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=None),
        "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=8),
        "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=8),
        "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=8, final_logit_softcapping=3.0),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**_COMMON, head_dim=8, final_logit_softcapping=3.0),
        "olmo2": lambda: transformers.Olmo2Config(**_COMMON),
        "phi3": lambda: transformers.Phi3Config(**_COMMON, pad_token_id=0),
        "stablelm": lambda: transformers.StableLmConfig(**_COMMON),
        "granite": lambda: transformers.GraniteConfig(**_COMMON, logits_scaling=4.0),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        # The routed families: each config's default ``output_router_logits`` (false), 4 experts, 2 a token.
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_COMMON, head_dim=8, moe_intermediate_size=32, num_experts=4,
                                                         num_experts_per_tok=2),
        "olmoe": lambda: transformers.OlmoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2),
        "mixtral": lambda: transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
    }
    return make[family]()


TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi3", "stablelm",
                 "granite", "gpt2", "qwen3_moe", "olmoe", "mixtral")


def tiny_causal_lm(family: str) -> torch.nn.Module:
    """A transformers causal LM of `family` from its config (its defaults but the sizes), eager attention, no dropout."""
    import transformers

    config = _config(family)
    config._attn_implementation = "eager"
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


class _Tokens(torch.utils.data.Dataset):
    """Random tokens; labels the inputs (`shifted`: the next token, as automicro's Llama takes them)."""

    def __init__(self, samples: int, seq: int, vocab: int, shifted: bool) -> None:
        generator = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(0, vocab, (samples, seq + 1), generator=generator)
        self.shifted = shifted

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index]
        return {"input_ids": row[:-1], "labels": row[1:] if self.shifted else row[:-1]}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over the parameters."""
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _fixed_run(build: Callable[[], Any], head: str, shifted: bool, vocab: int, batches: int = 3,
               microbatch: Any = "auto") -> dict[str, torch.Tensor]:
    """`batches` batches of 4 samples a rank under FSDP2 with `head` (`AutoMicrobatching`, no trial: the whole batch
    fits, one microbatch; `microbatch` a size: set by hand, the callback idle but for its head)."""
    from automicro.data import build_dataloader

    torch.manual_seed(0)
    model = build()
    world = torch.distributed.get_world_size()
    data = build_dataloader(_Tokens(4 * world * batches, 16, vocab, shifted), 4, shuffle=False)
    auto = automicro.AutoMicrobatching(log_attempts=False, head=head, trials=False)
    trainer = automicro.Trainer(
        model=model, train_dataloader=data, max_duration=f"{batches}ba", optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
        device="cpu", parallelism_config={"fsdp2": {}}, device_train_microbatch_size=microbatch, callbacks=[auto], loggers=[],
        progress_bar=False, log_to_console=False, seed=17,
    )
    try:
        trainer.fit()
        assert auto.used_split == ((4,) if microbatch == "auto" else ()), auto.used_split
        assert (getattr(trainer.sharded_model, "head", None) is not None) == (head == "fused")
        return _params(model)
    finally:
        trainer.close()


def parity(rank: int, world: int) -> dict[str, float]:
    """The fused head's parameters against the plain head's after 3 batches (relative, the largest over tensors)."""
    from composer.models import HuggingFaceModel

    from automicro.models import build_model

    out = {}
    llama = lambda: build_model("tiny", vocab_size=512, tie_embeddings=True)  # noqa: E731
    out["automicro-llama, tied"] = _diff(_fixed_run(llama, "fused", True, 512), _fixed_run(llama, "plain", True, 512))
    # The size set by hand (2: two microbatches a batch): the callback searches nothing, its head: fused is put on.
    out["automicro-llama, tied, microbatch 2 set"] = _diff(_fixed_run(llama, "fused", True, 512, microbatch=2),
                                                          _fixed_run(llama, "plain", True, 512, microbatch=2))
    for family in ("gemma2", "granite"):
        hf = lambda: HuggingFaceModel(tiny_causal_lm(family), tokenizer=None, use_logits=True)  # noqa: E731
        out[family] = _diff(_fixed_run(hf, "fused", False, VOCAB), _fixed_run(hf, "plain", False, VOCAB))
    return out


# ---- the main job under a cap -----------------------------------------------------------------------------

MAIN = ["data.kind=synthetic", "model.overrides.vocab_size=8192", "callbacks.memory_cap.limit_bytes={0: 60000000, 1: 70000000}"]


class ReadsLogits:
    """A callback that reads the training forward's logits after each forward (as a user's metric or loss might)."""

    def __new__(cls) -> Any:
        from composer.core import Callback

        class Reader(Callback):
            def after_forward(self, state: Any, logger: Any) -> None:
                state.outputs.float()

        return Reader()


def main_job(head: str, batches: int, more: tuple[str, ...] = (), fused_faster: bool = False,
             extra: tuple[Any, ...] = (), margin: float = 0.0) -> dict[str, Any]:
    """configs/tiny-cpu.yaml as `composer -n 2 -m automicro.train tiny-cpu` builds it (`automicro.composer.builders`),
    with `MAIN`, `callbacks.auto_microbatching.head=HEAD` and `more`, for `batches` batches. `fused_faster`: the
    layout trials' clock says a batch with the fused head takes 1 s, without it 2 s (a CPU's times say nothing of a
    GPU's). `extra`: more callbacks. `margin`: the share of the capacity the fused head's measured line is read
    under (0: the search's own, `SAFETY_MARGIN`), for this run."""
    from automicro.batch import layout_trials
    from automicro.composer import builders
    from automicro.config import load_config
    from automicro.config.load import resolve_config
    from automicro.core.layout import FUSED_HEAD

    overrides = MAIN + [f"callbacks.auto_microbatching.head={head}", f"max_duration={batches}ba",
                        "callbacks.auto_microbatching.log_attempts=false", *more]
    cfg = load_config(resolve_config("tiny-cpu"), overrides)
    world = torch.distributed.get_world_size()
    callbacks = [c for c in builders.build_callbacks(cfg) if type(c).__name__ != "SpeedMonitor"] + list(extra)
    auto = next(c for c in callbacks if isinstance(c, automicro.AutoMicrobatching))
    torch.manual_seed(cfg.seed)
    model = builders.build_model_from(cfg)
    dataset = builders.build_dataset(cfg, model.model.config.vocab_size)
    data = builders.train_data(cfg, builders.build_train_dataloader(cfg, dataset, cfg.per_rank_batch_size(world)))
    lines: list[str] = []
    auto.runtime.info = lines.append  # type: ignore[method-assign]
    trainer = automicro.Trainer(
        model=model, train_dataloader=data, max_duration=cfg.max_duration, optimizers=builders.build_optimizer(cfg, model),
        schedulers=builders.build_scheduler(cfg), device="cpu", precision=cfg.precision, device_train_microbatch_size="auto",
        parallelism_config={"fsdp2": cfg.fsdp2}, callbacks=callbacks, loggers=[], progress_bar=False, log_to_console=False,
        seed=cfg.seed,
    )
    splits: list[list[int]] = []
    losses: list[float] = []  # every batch's loss (the mean over the ranks' batches, as Composer logs it)
    metrics: list[Any] = []  # every batch's training LanguageCrossEntropy (over the ranks)
    original = auto.batch_end

    def batch_end(state: Any, logger: Any) -> None:
        splits.append(list(auto.used_split or ()))
        losses.append(float(state.total_loss_dict["loss/train/total"]))
        metric = (state.train_metrics or {}).get("LanguageCrossEntropy")
        metrics.append(None if metric is None else float(metric.compute()))
        original(state, logger)

    auto.batch_end = batch_end  # type: ignore[method-assign]
    own_margin = layout_trials.SAFETY_MARGIN
    layout_trials.SAFETY_MARGIN = margin or own_margin
    try:
        if fused_faster:
            assert auto.layout is not None
            auto.layout.timing = lambda layout, seconds: 1.0 if FUSED_HEAD in layout else 2.0
        trainer.fit()
        switch = getattr(trainer.sharded_model, "head", None)
        return {
            "found": auto.found_size, "splits": splits, "lines": lines, "losses": losses,
            "metrics": metrics, "head_fused": bool(switch is not None and switch.fused), "summary": auto.summary_line(2),
            "floor": None if auto.layout is None else list(auto.layout.search.floor),
        }
    finally:
        layout_trials.SAFETY_MARGIN = own_margin
        trainer.close()


def suite(rank: int, world: int) -> dict[str, Any]:
    """- ``main_plain``, ``main_fused``: the main job for 16 and 10 batches with `head: plain` and `head: fused`;
    - ``auto``: `head: auto` with the layout trials (`layout: auto`, the probe, unpriced: `bound_trials: false`, one
      batch a side, no size trials), the fused head timed faster, 16 batches; its line read under 60% of the capacity
      (the size there runs 2 microbatches, the whole batch fits under the capacity itself: the trial runs the whole
      batch, past the margin), and rank 1 out of memory in the first microbatch of more than 7 samples (that trial's);
    - ``reads_logits``: the same for 10 batches with a callback that reads every forward's logits;
    - ``below_one``: `head: auto` under caps of 30 and 35 MB, where size 1 does not fit with the plain head even with
      full recompute (`head: plain` ends the run there), 4 batches."""
    plain = main_job("plain", 16)
    fused = main_job("fused", 10)
    auto = main_job("auto", 16, ("callbacks.auto_microbatching.layout=auto", "callbacks.auto_microbatching.start_size=probe",
                                 "callbacks.auto_microbatching.bound_trials=false", "callbacks.auto_microbatching.layout_trial_batches=1",
                                 "callbacks.auto_microbatching.layout_size_trials=false"), fused_faster=True, margin=0.6,
                    extra=(FaultInjector(site="forward", ranks=[1], above=7, times=1),))
    reads = main_job("auto", 10, ("callbacks.auto_microbatching.layout=auto", "callbacks.auto_microbatching.start_size=probe",
                                  "callbacks.auto_microbatching.bound_trials=false", "callbacks.auto_microbatching.layout_trial_batches=1",
                                  "callbacks.auto_microbatching.layout_size_trials=false"), fused_faster=True,
                     extra=(ReadsLogits(),))
    below_one = main_job("auto", 4, ("callbacks.auto_microbatching.layout=auto", "callbacks.memory_cap.limit_bytes={0: 30000000, 1: 35000000}",
                                     "callbacks.auto_microbatching.layout_trial_batches=1",
                                     "callbacks.auto_microbatching.layout_size_trials=false"))
    return {"main_plain": plain, "main_fused": fused, "auto": auto, "reads_logits": reads, "below_one": below_one}


def loss_gap(run: dict[str, Any], reference: dict[str, Any]) -> float:
    """The largest relative difference between two runs' losses over the batches both ran."""
    return max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))
