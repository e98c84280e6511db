"""`packing: true`: under a token budget each microbatch is one row of its samples
end to end, attention kept within each sample, and training equals the padded training of the
same samples.

One 2-rank launch (tests/packing_cases.py, under `run_multiprocess`'s hang watchdog) trains
automicro's Llama and a transformers Llama (right- and left-padded batches from transformers' own
collator) packed under a token limit, against the unsplit padded batches. Which transformers can
keep packed samples apart differs by version (from 4.54, with sdpa; CI's torch 2.7 leg carries
llm-foundry's pin 4.51, the newer legs transformers 5): the tests assert what the installed one
does. The rest runs in this process.
"""

from __future__ import annotations

import sys

import pytest
import torch

from automicro.batch import packed_input, token_split
from automicro.composer.callback import AutoMicrobatching
from automicro.batch.token_budget import TokenBudget
from automicro.testing.multiprocess import run_multiprocess
from tests import packing_cases as cases

TOLERANCE = 1e-6


def _transformers_packs() -> bool:
    import transformers.masking_utils  # noqa: F401  (absent before 4.53: the import fails there)

    return hasattr(sys.modules["transformers.masking_utils"], "find_packed_sequence_indices")


def transformers_packs() -> bool:
    try:
        return _transformers_packs()
    except ImportError:
        return False


@pytest.fixture(scope="module")
def packing():
    return run_multiprocess(cases.run_packing, world_size=2, timeout_s=500)


def _ok(result):
    assert "crash" not in result, result["crash"]
    assert result.get("exception") is None, result["exception"]
    return result


@pytest.mark.multiproc
def test_automicro_llama_trains_packed_rows_as_the_unsplit_padded_batch(packing):
    for per_rank in packing:
        result = _ok(per_rank["llama"])
        assert result["batches"] == cases.BATCHES
        assert result["lines"] == [
            "packing: each microbatch is one row of its samples end to end (the model keeps attention within each "
            "sample: it says so); the token budget counts real tokens"
        ]
        # Every microbatch was one packed row: position ids, no mask; several microbatches per batch.
        assert result["shapes"] and all(rows == 1 and positions and not mask for rows, _, positions, mask in result["shapes"])
        assert any(len(split) > 1 for _, _, _, split, outcome, *_ in result["history"] if outcome == "ok")
        assert result["padding_waste"] == 0.0
        assert result["error_vs_unsplit"] <= TOLERANCE, result["error_vs_unsplit"]
    assert len({per_rank["llama"]["found"] for per_rank in packing}) == 1


def _trial(result):
    """Per batch of the run: "packed", "padded" or "mixed" (a rerun)."""
    return {int(b): ("packed" if v == [True] else "padded" if v == [False] else "mixed") for b, v in result["packed_by_batch"].items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("arm", ["packed", "padded"])
def test_packing_left_out_is_measured_and_the_faster_kept(packing, arm):
    """The trial alternates packed and padded batches once the budget settles and keeps the faster
    (one arm made to look slower); the run then equals one started pinned that way (fp32, SGD)."""
    for rank, per_rank in enumerate(packing):
        result = _ok(per_rank[f"measured/{arm}"])
        assert result["batches"] == cases.MEASURED_BATCHES and result["state"] == arm, result["state"]
        by_batch = _trial(result)
        first = min(b for b, a in by_batch.items() if a == "packed")  # the trial's first batch
        # 3 batches a side, or 2 where their spread is tiny (`trial_timing.enough`), then the faster for good.
        pairs = [n for n in (2, 3) if [by_batch[b] for b in range(first, first + 2 * n)] == ["packed", "padded"] * n
                 and all(by_batch[b] == arm for b in range(first + 2 * n, cases.MEASURED_BATCHES))]
        assert pairs, by_batch
        assert all(by_batch[b] == "padded" for b in range(first)), by_batch  # padded while the budget was searched
        assert first + 2 * pairs[0] < cases.MEASURED_BATCHES, by_batch
        if rank == 0:
            said = result["lines"]
            assert said[0].startswith("packing: measured once the token budget settles, packed rows against padded batches"), said
            assert said[1].startswith("packing trial: up to 3 batches packed, as many padded"), said
            assert said[2].startswith(f"packing: {'packed rows kept' if arm == 'packed' else 'padded batches kept'}; median"), said
            assert "real tokens/s of the busiest rank" in said[2], said
        assert result["error_vs_pinned"] <= TOLERANCE, result["error_vs_pinned"]


@pytest.mark.multiproc
def test_an_oom_with_packed_rows_reruns_the_batch_padded_and_pads_from_then_on(packing):
    for rank, per_rank in enumerate(packing):
        result = _ok(per_rank["measured/oom"])
        assert result["batches"] == cases.MEASURED_BATCHES and result["state"] == "padded", result["state"]
        last = cases.MEASURED_BATCHES - 1
        notes = [h for h in result["history"] if h[0] == last]
        assert [h[4] for h in notes] == ["oom", "ok"] and notes[0][2] == notes[1][2], notes  # the same budget
        assert "packed rows undone first; rerun padded" in notes[0][7], notes
        assert _trial(result)[last] == "mixed", _trial(result)  # its packed attempt, then its padded rerun
        if rank == 0:
            assert any(line.startswith("packing: out of memory with packed rows at the settled budget (kept)") for line in result["lines"])
    assert packing[1]["measured/oom"]["oom_fired"] == 1


@pytest.mark.multiproc
def test_packing_left_out_pads_on_cpu_and_says_how_to_measure_or_pin(packing):
    for rank, per_rank in enumerate(packing):
        result = _ok(per_rank["default_on_cpu"])
        assert result["state"] is None and set(_trial(result).values()) == {"padded"}, result
        if rank == 0:
            assert result["lines"] == [
                "packing: batches are padded on CPU (measured against packed rows on a GPU; packing: true pins packing)"
            ], result["lines"]


@pytest.mark.multiproc
def test_packing_with_the_trainers_per_sample_accumulation_is_refused_naming_both(packing):
    for per_rank in packing:
        refused = per_rank["per_sample"]["refused"]
        assert refused is not None and "accumulate_train_batch_on_tokens=False" in refused and "packing" in refused


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["right", "left"])
def test_a_transformers_llama_trains_packed_rows_as_the_unsplit_padded_batch_where_transformers_can(packing, layout):
    packs = transformers_packs()
    import transformers

    for per_rank in packing:
        result = _ok(per_rank[f"hf/{layout}"])
        assert result["batches"] == cases.BATCHES and any(len(split) > 1 for split in result["splits"]), result["splits"]
        assert result["error_vs_unsplit"] <= TOLERANCE, result["error_vs_unsplit"]
        if packs:
            assert result["lines"] == [
                f"packing: each microbatch is one row of its samples end to end (transformers {transformers.__version__} "
                "finds the samples from position_ids (sdpa attention)); use_cache=False passed to its training forwards of "
                "packed rows (a KV cache made in the forward turns the packed-row detection off, and the samples of a row "
                "would attend to each other; the config is left as it is); the token budget counts real tokens; with sdpa "
                "attention transformers masks a dense square "
                "of each row's tokens (attention costs them squared): attn_implementation='flex_attention' or "
                "'flash_attention_2' skips the other samples"
            ]
            assert result["use_cache"] is True  # the config (and so an export) is left alone
            assert all(rows == 1 and positions and not mask for rows, _, positions, mask in result["shapes"])
            assert result["padding_waste"] == 0.0
        else:
            assert len(result["lines"]) == 1 and "only with attn_implementation='flash_attention_2'" in result["lines"][0]
            assert result["lines"][0].endswith("batches are padded as without packing")
            assert all(mask and not positions for _, _, positions, mask in result["shapes"])
            assert result["padding_waste"] > 0.0


# ---- one process ------------------------------------------------------------------------------


def _padded(side: str):
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 0]])
    mask = (ids != 0).long()
    if side == "left":
        ids, mask = ids.flip(1), mask.flip(1)
    labels = torch.where(mask.bool(), ids + 100, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_packed_microbatch_is_one_row_of_real_tokens_with_positions_restarting_per_sample(side):
    batch = _padded(side)
    lengths = token_split.sample_lengths(batch)
    part = token_split.select_packed(batch, [0, 2], lengths, mask_first_label=False)
    assert sorted(part) == ["input_ids", "labels", "position_ids"]  # no attention mask: the positions say it
    assert part["input_ids"].tolist() == ([[5, 6, 7, 1, 2, 3, 4]] if side == "right" else [[7, 6, 5, 4, 3, 2, 1]])
    assert part["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert part["labels"].tolist() == [[i + 100 for i in part["input_ids"][0].tolist()]]
    # A model that shifts its labels would predict each sample's first token from the one before.
    shifted = token_split.select_packed(batch, [0, 2], lengths, mask_first_label=True)
    assert shifted["labels"][0, 0] == -100 and shifted["labels"][0, 3] == -100
    assert (shifted["labels"] != -100).sum() == 5


def test_a_row_that_already_packs_documents_keeps_its_own_positions():
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 0], [5, 6, 0, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]),
             "position_ids": torch.tensor([[0, 1, 0, 1, 0], [0, 1, 0, 0, 0]])}
    part = token_split.select_packed(batch, [0, 1], token_split.sample_lengths(batch), mask_first_label=False)
    assert part["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1]]


def test_a_per_sample_key_is_named_and_such_batches_are_padded_with_one_line():
    batch = {**_padded("right"), "sample_id": torch.tensor([7, 8, 9])}
    assert token_split.unpackable_key(batch) == "sample_id"
    assert token_split.unpackable_key(_padded("right")) is None
    budget = TokenBudget()
    budget.packing = True
    lines: list[str] = []
    budget.info = lines.append

    class OneRank:
        def agree_max(self, values):
            return tuple(values)

    for _ in range(2):
        lengths, largest = budget.agree_domain(OneRank(), batch)
        plan = budget.plan_attempt(OneRank(), lengths, 8)
        assert not plan.packed and largest == 3 * 4  # padded tokens: 3 samples x the longest
        parts = budget.split(batch, plan)
        assert all("attention_mask" in part and part["sample_id"].dim() == 1 for part in parts)
    assert lines == ["packing: batch key 'sample_id' is not a per-token tensor [samples, sequence] (per-sample values "
                     "cannot be packed into one row): such batches are padded as without packing"]
    lengths, largest = budget.agree_domain(OneRank(), _padded("right"))
    plan = budget.plan_attempt(OneRank(), lengths, 5)
    assert plan.packed and largest == 9 and plan.padded == plan.real == 9 and plan.count == 2


def test_packing_needs_a_token_budget_and_per_token_loss():
    with pytest.raises(ValueError, match="packing=true needs budget='tokens'"):
        AutoMicrobatching(packing=True)
    with pytest.raises(ValueError, match="loss_normalization='samples'"):
        AutoMicrobatching(budget="tokens", packing=True, loss_normalization="samples")
    with pytest.raises(ValueError, match=r"packing='yes': must be null .*'auto' \(measured on any device\), true or false"):
        AutoMicrobatching(budget="tokens", packing="yes")


def test_a_model_that_does_not_say_it_takes_packed_rows_is_padded_with_a_line_saying_how_to_declare_it():
    lines: list[str] = []
    assert packed_input.check(torch.nn.Linear(2, 2), lines.append) is False
    assert "set packed_input = True on the model" in lines[0] and lines[0].endswith("padded as without packing")

    class Says(torch.nn.Module):
        packed_input = False

    lines.clear()
    assert packed_input.check(Says(), lines.append) is False and "packed_input = False" in lines[0]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_transformers_llama_keeps_packed_samples_apart_exactly_where_the_check_says_so(impl):
    """The check against the model's own forward: a row packing two samples gives the second
    sample's logits of the sample alone (within rounding) iff `packed_input.check` said True (and
    turned use_cache off); with the cache on, transformers 5 attends across them (measured)."""
    import warnings

    from composer.models import HuggingFaceModel
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attn_implementation=impl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HuggingFaceModel(LlamaForCausalLM(config), tokenizer=None, use_logits=True)
    a, b = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 7))
    row = {"input_ids": torch.cat([a, b], 1), "position_ids": torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)}
    alone = model.model(input_ids=b).logits
    across = (model.model(**row).logits[:, 5:] - alone).abs().max().item()
    lines: list[str] = []
    said = packed_input.check(model, lines.append)
    assert said is transformers_packs(), lines
    apart = (model.model(**row).logits[:, 5:] - alone).abs().max().item()
    if said:
        assert model.model.config.use_cache is True, "the config (and so an export) is left alone"
        assert across > 1e-3, "with the cache on, the samples attend to each other"
        assert apart < 1e-5
        # Eval (or a padded batch) keeps the model's own use_cache.
        model.model.eval()
        assert (model.model(**row).logits[:, 5:] - alone).abs().max().item() > 1e-3
        model.model.train()
        assert packed_input.check(model, lines.append) and len(lines) == 2 and "use_cache" not in lines[1]
    else:
        assert apart > 1e-3, "this transformers attends across the packed samples: packing must stay off"


def test_automicro_llamas_varlen_path_cuts_the_samples_where_the_positions_restart(monkeypatch):
    """The varlen flash path (CUDA) through a CPU stand-in for `varlen_attn` (causal SDPA over each
    cu_seqlens slice): rows flattened, every row and every restart a sample, the longest right; the
    logits equal the dense document mask's and each sample's alone (two rows, the second starting
    mid-count as a row cut from a longer document would)."""
    import torch.nn.functional as F

    from automicro.models import build_model

    seen = {}

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k
        seen.update(cu=cu_q.tolist(), longest=max_q)
        out = torch.empty_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            piece = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # [H, n, D]
            out[a:b] = F.scaled_dot_product_attention(*piece, is_causal=True).transpose(0, 1)
        return out

    torch.manual_seed(0)
    model = build_model("tiny", n_layers=2, max_seq_len=32).model
    ids = torch.randint(0, 100, (2, 9))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 0, 1, 2, 3, 0, 0, 1]])
    dense = model(ids, positions)
    # The namespace the model's forward reads (test_config re-imports automicro.models.llama, so the
    # package's attribute may name another copy of the module than the one the model was built from).
    namespace = type(model).forward.__globals__
    monkeypatch.setitem(namespace, "_uses_varlen", lambda x: True)
    monkeypatch.setitem(namespace, "_varlen_attn", lambda: reference)
    flat = model(ids, positions)
    assert seen == {"cu": [0, 3, 5, 9, 11, 15, 16, 18], "longest": 4}
    assert (flat - dense).abs().max() < 1e-5
    monkeypatch.undo()
    alone = model(ids[:1, 5:], positions[:1, 5:])
    assert (flat[:1, 5:] - alone).abs().max() < 1e-5
