"""Multi-rank cases for `AutoMicrobatching(budget="tokens")` (tests/test_token_budget.py).

Each rank reads its own variable-length data (a different median length per rank, so the ranks
need different numbers of microbatches), padded by `pad_collate`. `TokenLimit` is the memory
model: a microbatch of more padded tokens than a rank's limit runs out of memory in its forward,
as a GPU would. Every case returns plain data; a case that breaks is returned as {"crash": ...}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from composer.core import Callback, DataSpec, State
from composer.loggers import Logger
from composer.utils import dist as composer_dist
from torch.utils.data import DataLoader

import automicro
from automicro.data import VariableLengthTokens, count_tokens, pad_collate
from automicro.composer.callback import AutoMicrobatching
from automicro.models import build_model
from automicro.testing.faults import FaultInjector
from tests.automicro_cases import adam_steps, max_error
from tests.case_runs import run_case
from tests.toy_models import full_state

VOCAB = 256
PER_RANK_BATCH = 8
MAX_LEN = 96
BATCHES = 14
FAULT_BATCH = 12  # after the hooks came off


class TokenLimit(Callback):
    """Out of memory in a microbatch's forward when its padded tokens exceed this rank's limit."""

    def __init__(self, limits: dict[int, int]) -> None:
        self.limits = limits
        self.seen: list[int] = []

    def before_forward(self, state: State, logger: Logger) -> None:
        tokens = int(state.batch["input_ids"].numel())
        limit = self.limits.get(dist.get_rank())
        self.seen.append(tokens)
        if limit is not None and tokens > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (test: {tokens} tokens > {limit} on rank {dist.get_rank()})")


def loader(rank: int, batches: int = BATCHES, median: Optional[int] = None) -> DataLoader:
    dataset = VariableLengthTokens(
        PER_RANK_BATCH * batches, VOCAB, median_len=median or 12 * (rank + 1), sigma=0.7, min_len=4, max_len=MAX_LEN,
        seed=100 + rank,
    )
    # Each rank reads its own dataset whole (a sampler over one replica: Composer wants a DistributedSampler).
    sampler = composer_dist.get_sampler(dataset, shuffle=False, num_replicas=1, rank=0)
    return DataLoader(dataset, batch_size=PER_RANK_BATCH, sampler=sampler, drop_last=True, collate_fn=pad_collate)


def fit(microbatch: Any, callbacks: list, batches: int = BATCHES, on_tokens: bool = False, sgd: bool = False,
        before_fit: Optional[Callable[[], None]] = None, fsdp2: Optional[dict[str, Any]] = None, **kwargs: Any) -> dict[str, Any]:
    """`sgd`: plain SGD instead of AdamW (Adam's normalised step turns rounding differences in a
    near-zero gradient into differences of the learning rate's size). `before_fit`: called once the
    trainer is built. `fsdp2`: the engine's settings (default: all defaults)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model("tiny", n_layers=2, max_seq_len=MAX_LEN)
    data = loader(rank, batches)
    train = DataSpec(data, get_num_tokens_in_batch=count_tokens) if on_tokens else data
    auto = next((c for c in callbacks if isinstance(c, AutoMicrobatching)), None)
    trainer = automicro.Trainer(
        model=model, train_dataloader=train, max_duration=f"{batches}ba",
        optimizers=(torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), lr=1e-2), device="cpu",
        parallelism_config={"fsdp2": fsdp2 or {}}, device_train_microbatch_size=microbatch, callbacks=callbacks,
        loggers=[], progress_bar=False, log_to_console=False, seed=17,
        accumulate_train_batch_on_tokens=on_tokens, **kwargs,
    )
    result: dict[str, Any] = {}
    if before_fit is not None:
        before_fit()
    try:
        trainer.fit()
    except Exception as error:  # noqa: BLE001 - returned to the test
        result["exception"] = {"type": type(error).__name__, "message": str(error)}
    result.update(
        batches=int(trainer.state.timestamp.batch),
        adam_steps=adam_steps(trainer),
        clean=trainer.sharded_model.is_clean(),
        params=None if "exception" in result else full_state(trainer.state.model),
    )
    if auto is not None:
        result.update(
            history=[(r.batch, r.attempt, r.size, list(r.split), r.outcome, r.failed_ranks, r.sites, r.note) for r in auto.history],
            found=auto.found_size,
            hooks_after=auto.hooks_active,
            padding_waste=auto.tokens.padding_waste if auto.tokens else None,
            trials=[[r.trade, r.kept, r.size] for r in auto.layout.search.results] if auto.layout else [],
            trial_lines=[r.line() for r in auto.layout.search.results] if auto.layout else [],
        )
    trainer.close()
    return result



class PlanRecorder(Callback):
    """Every attempt's plan on this rank: (batch, agreed count, own count, largest, budget)."""

    def __init__(self, auto: AutoMicrobatching) -> None:
        self.auto, self.rows = auto, []

    def after_train_batch(self, state: State, logger: Logger) -> None:
        plan = self.auto.tokens.plan
        self.rows.append((int(state.timestamp.batch), plan.count, plan.own, plan.largest, plan.budget))


LIMIT = 200  # padded tokens per microbatch every rank fits (the same memory on every rank)


def limits(world: int) -> dict[int, int]:
    return {r: LIMIT for r in range(world)}


SITES = ("forward_pre", "forward", "backward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc", "loss", "optimizer_step")


SEARCH_SITES = ("forward_pre", "backward", "unshard_alloc", "reduce_scatter_alloc")


def run_search_and_faults(rank: int, world: int, sites: tuple = SITES, search_sites: tuple = SEARCH_SITES) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def run(fault: Optional[Callback]) -> dict[str, Any]:
        auto = AutoMicrobatching(log_attempts=False, budget="tokens")
        recorder = PlanRecorder(auto)
        callbacks = [auto, TokenLimit(limits(world)), recorder] + ([fault] if fault is not None else [])
        result = fit("auto", callbacks)
        result["plans"] = recorder.rows
        return result

    reference = run(None)
    out["search"] = {k: v for k, v in reference.items() if k != "params"}
    for site in search_sites:
        # While searching (batch 1, hooks on): a one-off OOM on the last rank at this site.
        fault = FaultInjector(site, ranks=[world - 1], batch=1, microbatch_index=0, times=1)
        run_case(out, f"search/{site}", lambda fault=fault: {**{k: v for k, v in run(fault).items() if k != "params"},
                                                          "fired": fault.fired})
    for site in sites:
        who = [world - 1] if site != "optimizer_step" else None
        fault = FaultInjector(site, ranks=who, batch=FAULT_BATCH, microbatch_index=0 if site != "optimizer_step" else None, times=1)

        def one(fault: Any = fault) -> dict[str, Any]:
            result = run(fault)
            params = result.pop("params")
            result["error"] = None if params is None else max_error(params, reference["params"])
            result["fired"] = fault.fired
            return result

        run_case(out, f"steady/{site}", one)
    return out


def run_numerics(rank: int, world: int) -> dict[str, Any]:
    """Token budget (under a token limit) against the unsplit batch, per-token normalisation (the
    model's loss is a token mean; Composer weights each microbatch by its loss tokens)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for on_tokens in (True,):
        key = "tokens"

        def one(on_tokens: bool = on_tokens) -> dict[str, Any]:
            auto = AutoMicrobatching(log_attempts=False, budget="tokens")
            searched = fit("auto", [auto, TokenLimit(limits(world))], batches=5, on_tokens=on_tokens, sgd=True)
            whole = fit(PER_RANK_BATCH, [], batches=5, on_tokens=on_tokens, sgd=True)
            return {"history": searched["history"], "found": searched["found"], "exception": searched.get("exception"),
                    "error_vs_unsplit": max_error(searched["params"], whole["params"])}

        run_case(out, key, one)
    run_case(out, "padded_counter", lambda: _padded_counter(world))
    for layout in ("right", "left", "packed"):
        run_case(out, f"hf/{layout}", lambda layout=layout: _hf_split_invariant(world, layout))
    run_case(out, "hf/right/samples", lambda: _hf_split_invariant(world, "right", loss_normalization="samples"))
    run_case(out, "hf/right/unshifted", lambda: _hf_split_invariant(world, "right", label_shift=0))
    run_case(out, "fastest_budget", lambda: _fastest_budget(world))
    return out


def _fastest_budget(world: int) -> dict[str, Any]:
    """Size trials over a token budget: `layout: auto`, one batch
    per trial arm; a budget below the first one found is timed faster (the batch times are replaced,
    `LayoutTrials.timing`): 3/4 of it is kept, and from there nothing smaller is faster. Per-token
    normalisation, so the parameters equal the unsplit batch's whatever the budgets."""
    # The size trials' logic, unpriced (`bound_trials`; their price is tests/test_trial_plan.py's).
    auto = AutoMicrobatching(log_attempts=False, budget="tokens", layout="auto", layout_trial_batches=1, bound_trials=False)
    first: dict[str, int] = {}

    def timing(layout: tuple[str, ...], measured: float) -> float:
        search = auto.layout.search
        budget = search.trial_size if search.trial_size is not None else auto.found_size
        first.setdefault("found", auto.found_size)
        return 1.0 if budget < first["found"] else 2.0

    def hook() -> None:
        auto.layout.timing = timing

    batches = 22  # the search (its finer grid at a few quanta: 3 attempts more), settling, 2 trades, 3 size trials
    searched = fit("auto", [auto, TokenLimit(limits(world))], batches=batches, on_tokens=True, sgd=True, before_fit=hook)
    whole = fit(PER_RANK_BATCH, [], batches=batches, on_tokens=True, sgd=True)
    return {**{k: v for k, v in searched.items() if k != "params"}, "first_found": first.get("found"),
            "error_vs_unsplit": max_error(searched["params"], whole["params"])}


def _padded_counter(world: int) -> dict[str, Any]:
    """budget: tokens with Composer's own (padded) token counter and nothing else set: per-token
    normalisation comes on, with automicro's counter in place of Composer's, and the line says so;
    the same where the train dataloader comes with `fit()` (after the callback's checks)."""
    from automicro.composer import _composer_internals as composer_internals
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    for when in ("trainer", "fit"):
        torch.manual_seed(0)
        model = build_model("tiny", n_layers=2, max_seq_len=MAX_LEN)
        lines: list[str] = []
        auto = AutoMicrobatching(log_attempts=False, budget="tokens")
        auto.runtime.info = lines.append
        data = loader(rank, 2)
        trainer = automicro.Trainer(
            model=model, train_dataloader=data if when == "trainer" else None, max_duration="1ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu",
            parallelism_config={"fsdp2": {}}, device_train_microbatch_size="auto",
            callbacks=[auto], loggers=[], progress_bar=False,
        )
        if when == "fit":
            trainer.fit(train_dataloader=data, duration="1ba")
        result[when] = {
            "on_tokens": trainer.accumulate_train_batch_on_tokens,
            "counter": repr(composer_internals.current_token_counter(trainer)),
            "lines": [line for line in lines if line.startswith("loss per")],
        }
        trainer.close()
    return result


def _hf_loader(rank: int, layout: str, batches: int, reference: bool = False) -> DataLoader:
    """This rank's batches for a transformers causal LM (labels = input_ids, the model shifts them):
    `right` / `left`: padded by transformers' own collator on that side; `packed`: rows of
    MAX_LEN tokens packing several documents, position_ids restarting per document and label -100
    at each document's first token (as packing collators do), each batch's last row half full.
    `reference`: the unsplit run's batches (left-padded: `_masking_first_labels`)."""
    dataset = VariableLengthTokens(PER_RANK_BATCH * batches * 3, VOCAB, median_len=12 * (rank + 1), sigma=0.7, min_len=4,
                                   max_len=MAX_LEN, seed=300 + rank)
    docs = [dataset[i]["input_ids"] for i in range(len(dataset))]
    if layout in ("right", "left"):
        collate = _hf_collator()
        collate.tokenizer.padding_side = layout
        rows: list[Any] = [{"input_ids": doc.tolist()} for doc in docs[: PER_RANK_BATCH * batches]]
    else:
        collate, rows, index = None, [], 0
        for n_row in range(PER_RANK_BATCH * batches):
            ids = torch.zeros(MAX_LEN, dtype=torch.long)
            labels, positions, mask = torch.full_like(ids, -100), torch.zeros_like(ids), torch.zeros_like(ids)
            at, room = 0, MAX_LEN // 2 if n_row % PER_RANK_BATCH == PER_RANK_BATCH - 1 else MAX_LEN
            while at < room:
                doc = docs[index % len(docs)][: room - at]
                index, n = index + 1, int(doc.shape[0])
                ids[at:at + n], labels[at + 1:at + n] = doc, doc[1:]
                positions[at:at + n], mask[at:at + n] = torch.arange(n), 1
                at += n
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": positions})
    if layout == "left" and reference:
        collate = _masking_first_labels(collate)
    sampler = composer_dist.get_sampler(rows, shuffle=False, num_replicas=1, rank=0)
    return DataLoader(rows, batch_size=PER_RANK_BATCH, sampler=sampler, drop_last=True, collate_fn=collate)


def _masking_first_labels(collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The unsplit reference of left-padded batches: the label of each padded row's first real token
    set to -100, as automicro does (a shifting model predicts it from a padding position)."""

    def masked(rows: Any) -> Any:
        batch = collate(rows)
        width = batch["labels"].shape[1]
        for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            if 0 < n < width:
                batch["labels"][row, width - n] = -100
        return batch

    return masked


def _hf_llama():
    import warnings

    from composer.models import HuggingFaceModel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=MAX_LEN, attn_implementation="sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HuggingFaceModel(LlamaForCausalLM(config), tokenizer=None, use_logits=True)


def _hf_fit(rank: int, world: int, layout: str, microbatch: Any, batches: int, auto: Optional[AutoMicrobatching],
            extra_callbacks: Sequence[Any] = (), after_fit: Optional[Callable[[Any], None]] = None,
            **kwargs: Any) -> dict[str, Any]:
    model = _hf_llama()
    train = kwargs.pop("train", None) or _hf_loader(rank, layout, batches)
    trainer = automicro.Trainer(
        model=model, train_dataloader=train, max_duration=f"{batches}ba", optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
        device="cpu", parallelism_config={"fsdp2": {}}, device_train_microbatch_size=microbatch,
        callbacks=([] if auto is None else [auto, TokenLimit(limits(world))]) + list(extra_callbacks), loggers=[],
        progress_bar=False, log_to_console=False, **kwargs,
    )
    trainer.fit()
    if after_fit is not None:
        after_fit(trainer)
    result = {"params": full_state(trainer.state.model), "batches": int(trainer.state.timestamp.batch)}
    if auto is not None:
        result["splits"] = [list(r.split) for r in auto.history if r.outcome == "ok"]
    trainer.close()
    return result


_HF_REFERENCES: dict[str, Any] = {}  # layout -> the unsplit run's parameters (this process)


def _hf_split_invariant(world: int, layout: str, **auto_kwargs: Any) -> dict[str, Any]:
    """A transformers Llama (config only, fp32, SGD) under budget: tokens with nothing set but
    `auto_kwargs`, against the unsplit batches weighted per loss token by a counter written here
    (labels[:, 1:] != -100): the parameters after 4 batches, the splits the search ran, its lines."""
    rank, batches = dist.get_rank(), 4

    def loss_tokens(batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return {"total": int(batch["attention_mask"].sum()), "loss_generating": int((batch["labels"][:, 1:] != -100).sum())}

    auto = AutoMicrobatching(log_attempts=False, budget="tokens", **auto_kwargs)
    lines: list[str] = []
    auto.runtime.info = lines.append
    searched = _hf_fit(rank, world, layout, "auto", batches, auto)
    if layout not in _HF_REFERENCES:
        _HF_REFERENCES[layout] = _hf_fit(
            rank, world, layout, PER_RANK_BATCH, batches, None, accumulate_train_batch_on_tokens=True,
            train=DataSpec(_hf_loader(rank, layout, batches, reference=True), get_num_tokens_in_batch=loss_tokens),
        )["params"]
    return {"splits": searched["splits"], "batches": searched["batches"], "lines": lines,
            "error_vs_unsplit": max_error(searched["params"], _HF_REFERENCES[layout])}


def run_resume(rank: int, world: int, folder: str) -> dict[str, Any]:
    """6 batches saved each batch; then a new trainer resumes at batch 6 and runs to 10."""
    torch.set_num_threads(1)
    saving = {"save_folder": folder, "save_interval": "1ba", "run_name": "tokens", "save_overwrite": True}
    first = AutoMicrobatching(log_attempts=False, budget="tokens")
    before = fit("auto", [first, TokenLimit(limits(world))], batches=6, **saving)
    second = AutoMicrobatching(log_attempts=False, budget="tokens")
    after = fit("auto", [second, TokenLimit(limits(world))], batches=BATCHES,
                load_path=f"{folder}/ep0-ba6-rank0.pt", **{k: v for k, v in saving.items() if k != "save_overwrite"},
                save_overwrite=True)
    whole = fit("auto", [AutoMicrobatching(log_attempts=False, budget="tokens"), TokenLimit(limits(world))])
    return {"found_before": before["found"], "found_after": after["found"], "history_after": after["history"],
            "history_whole": whole["history"], "batches": after["batches"], "exception": after.get("exception"),
            "error_vs_whole": max_error(after["params"], whole["params"])}


def _hf_collator():
    """Hugging Face's own padding collator for causal LM, over a word-level tokenizer built in memory."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]")), pad_token="[PAD]", unk_token="[UNK]",
    )
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)


def run_hugging_face(rank: int, world: int) -> dict[str, Any]:
    """GPT-2 from transformers (config only) in Composer's HuggingFaceModel, batches from
    transformers' DataCollatorForLanguageModeling (pads to the longest; labels -100 on padding)."""
    import warnings

    from composer.models import HuggingFaceModel
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    collator = _hf_collator()
    dataset = VariableLengthTokens(PER_RANK_BATCH * 8, VOCAB, median_len=12 * (rank + 1), sigma=0.7, min_len=4,
                                   max_len=MAX_LEN, seed=100 + rank)
    samples = [{"input_ids": dataset[i]["input_ids"].tolist()} for i in range(len(dataset))]
    sampler = composer_dist.get_sampler(samples, shuffle=False, num_replicas=1, rank=0)
    data = DataLoader(samples, batch_size=PER_RANK_BATCH, sampler=sampler, drop_last=True, collate_fn=collator)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=MAX_LEN, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HuggingFaceModel(GPT2LMHeadModel(config), tokenizer=None, use_logits=True)
    auto = AutoMicrobatching(log_attempts=False, budget="tokens")
    trainer = automicro.Trainer(
        model=model, train_dataloader=data, max_duration="8ba", optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu", parallelism_config={"fsdp2": {}}, device_train_microbatch_size="auto",
        callbacks=[auto, TokenLimit(limits(world))], loggers=[], progress_bar=False, log_to_console=False,
    )
    trainer.fit()
    first = next(iter(data))
    result = {
        "history": [(r.batch, r.attempt, r.size, list(r.split), r.outcome) for r in auto.history],
        "found": auto.found_size, "batches": int(trainer.state.timestamp.batch), "adam_steps": adam_steps(trainer),
        "collated_keys": sorted(first), "padded_width": int(first["input_ids"].shape[1]),
        "loss": float(trainer.state.total_loss_dict["loss/train/total"]),
    }
    trainer.close()
    return result
