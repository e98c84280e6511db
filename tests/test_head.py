"""The vocabulary head (`automicro.engine.head`, `head_models`, `automicro.batch.head_choice`): the fused loss and its
gradients equal the plain head's on automicro's Llama and on every transformers family it fuses (fp32, relative
1e-5), on 1 and 2 gloo ranks under FSDP2; `head: fused` finds a larger microbatch under the same cap and trains to the
same numbers; `head: auto` prices, measures and times it, and keeps it where faster, on every rank alike."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch

from automicro.batch.settings import Settings
from automicro.batch.trial_price import HEAD_EAGER_SAVED, HEAD_MEASURE_BATCHES, Measured, price
from automicro.batch.batch_profile import BatchProfile, figures
from automicro.core.layout import FUSED_HEAD, NO_RESHARD, LayoutConfig, LayoutConfigError, LayoutSearch
from automicro.engine import head as head_module
from automicro.engine._torch_internals import ProfiledEvent
from automicro.engine.head import HeadSwitch, fused_linear_cross_entropy, plain_linear_cross_entropy
from automicro.engine.head_models import FAMILIES, FusedHeadOutput, find_head, install_head
from automicro.testing.multiprocess import run_multiprocess
from tests import head_cases as cases

transformers = pytest.importorskip("transformers")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# ---- the fused loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap,scale,bias,smoothing,num_items", [
    (None, None, False, 0.0, None), (30.0, None, False, 0.0, None), (2.0, None, True, 0.0, 40),
    (None, 0.25, True, 0.1, None), (None, None, False, 0.2, 17),
])
def test_the_fused_loss_and_both_gradients_equal_the_plain_heads_in_fp32_over_many_chunks(monkeypatch, softcap, scale, bias,
                                                                                           smoothing, num_items):
    monkeypatch.setattr(head_module, "MIN_CHUNK", 1)  # 3 rows a chunk: many chunks, a short last one
    torch.manual_seed(0)
    rows, hidden, vocab = 37, 16, 300
    h = torch.randn(rows, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (rows,))
    labels[::5] = -100
    inputs = [h, w] + ([b] if b is not None else [])
    kwargs = dict(softcap=softcap, scale=scale, label_smoothing=smoothing, num_items=num_items)
    fused = fused_linear_cross_entropy(h, w, labels, b, backend="torch", **kwargs)
    fused_grads = torch.autograd.grad(fused * 1.7, inputs)
    plain = plain_linear_cross_entropy(h, w, labels, b, **kwargs)
    plain_grads = torch.autograd.grad(plain * 1.7, inputs)
    assert head_module.chunk_rows(rows, vocab, hidden) < rows
    assert abs(float(fused - plain)) <= 1e-5 * abs(float(plain))
    for got, want in zip(fused_grads, plain_grads):
        assert _rel(got, want) < 1e-5


def test_the_fused_loss_takes_shaped_hidden_states_and_refuses_labels_of_another_shape():
    h, w = torch.randn(2, 5, 8), torch.randn(40, 8)
    labels = torch.randint(0, 40, (2, 5))
    assert torch.allclose(fused_linear_cross_entropy(h, w, labels), plain_linear_cross_entropy(h, w, labels), rtol=1e-5)
    with pytest.raises(ValueError, match="hidden states .* and labels .* differ"):
        fused_linear_cross_entropy(h, w, labels[:, :4])


def test_off_a_gpu_the_backend_is_torch_native_and_says_why():
    backend, why = head_module.choose_backend(torch.device("cpu"), torch.float32)
    assert backend == "torch" and "CUDA" in why
    with pytest.raises(head_module.HeadConfigError, match="liger backend cannot run here"):
        head_module.choose_backend(torch.device("cpu"), torch.float32, wanted="liger")


# ---- the models -------------------------------------------------------------------------------------


def _fused_and_plain(model: torch.nn.Module, run, switch: HeadSwitch = None):
    """`run(model) -> loss` on the model and on a copy with the switch on, fused: both losses and all gradients."""
    fused_model = copy.deepcopy(model)
    switch = switch or HeadSwitch(mode="fused", fused=True)
    install_head(fused_model, switch)
    results = []
    for one in (model, fused_model):
        one.train()
        loss = run(one)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in one.named_parameters() if p.grad is not None}))
    return results


@pytest.mark.parametrize("family", sorted(cases.TINY_FAMILIES))
def test_every_transformers_family_it_fuses_gives_the_plain_heads_loss_and_gradients(family):
    torch.manual_seed(0)
    model = cases.tiny_causal_lm(family)
    assert find_head(model) == (model.config.model_type, "")
    ids = torch.randint(0, cases.VOCAB, (3, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    (plain, plain_grads), (fused, fused_grads) = _fused_and_plain(model, lambda m: m(input_ids=ids, labels=labels).loss)
    assert abs(float(fused - plain)) <= 1e-5 * abs(float(plain)), (family, float(fused), float(plain))
    assert plain_grads.keys() == fused_grads.keys()
    worst = max(_rel(fused_grads[n], plain_grads[n]) for n in plain_grads)
    assert worst < 1e-5, (family, worst)


def _block_calls(model: torch.nn.Module, run: Any) -> list[tuple[str, ...]]:
    """The keyword arguments each decoder block is called with in `run(model)`: their names, and the values that are
    not tensors (what a compiled block's guards check)."""
    calls: list[tuple[str, ...]] = []
    blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        calls.append(tuple(sorted(f"{k}={v!r}" if not isinstance(v, (torch.Tensor, tuple)) and "Cache" not in type(v).__name__
                                  else k for k, v in kwargs.items())))

    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in blocks]
    try:
        run(model)
    finally:
        for handle in handles:
            handle.remove()
    return calls


@pytest.mark.parametrize("family", sorted(cases.TINY_FAMILIES))
def test_the_blocks_are_called_alike_under_either_head_so_a_compiled_block_compiles_once(family):
    """On one H100 (transformers 5.17) Qwen3-MoE's fused head called its blocks without the ``output_router_logits``
    the model's own forward passes them: every compiled block compiled again for the fused head (12 s, and once a
    graph that inductor refused, run eager)."""
    torch.manual_seed(0)
    model = cases.tiny_causal_lm(family)
    fused_model = copy.deepcopy(model)
    install_head(fused_model, HeadSwitch(mode="fused", fused=True))
    ids = torch.randint(0, cases.VOCAB, (2, 10))
    for one in (model, fused_model):
        one.train()
    plain = _block_calls(model, lambda m: m(input_ids=ids, labels=ids))
    fused = _block_calls(fused_model, lambda m: m(input_ids=ids, labels=ids))
    assert plain and fused == plain, (family, plain[0], fused[0])
    assert fused_model(input_ids=ids, labels=ids).logits is None  # the fused head ran


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
def test_a_routed_forward_that_asks_for_its_routers_load_balancing_loss_runs_the_plain_head(family):
    """The fused head computes the language model's loss alone: a forward asking for ``output_router_logits`` (the
    load-balancing loss added to the loss) runs the model's own forward, its loss and logits the plain model's."""
    torch.manual_seed(0)
    model = cases.tiny_causal_lm(family)
    ids = torch.randint(0, cases.VOCAB, (2, 10))
    fused_model = copy.deepcopy(model)
    install_head(fused_model, HeadSwitch(mode="fused", fused=True))
    model.train()
    fused_model.train()
    plain = model(input_ids=ids, labels=ids, output_router_logits=True)
    out = fused_model(input_ids=ids, labels=ids, output_router_logits=True)
    assert out.logits is not None and out.aux_loss is not None and abs(float(out.loss - plain.loss)) <= 1e-6 * abs(float(plain.loss))
    assert float(plain.loss) != float(model(input_ids=ids, labels=ids).loss)  # the aux loss is in it
    assert fused_model(input_ids=ids, labels=ids).logits is None  # without it: fused


def test_a_transformers_model_takes_num_items_in_batch_and_returns_no_logits_fused_and_its_own_in_evaluation():
    """The Hugging Face Trainer's `num_items_in_batch` (the loss summed over the batch's loss tokens); a fused
    training forward returns the loss without logits; in evaluation, or without labels, the model's own forward."""
    torch.manual_seed(0)
    model = cases.tiny_causal_lm("granite")
    ids = torch.randint(0, cases.VOCAB, (2, 9))
    (plain, plain_grads), (fused, fused_grads) = _fused_and_plain(
        model, lambda m: m(input_ids=ids, labels=ids, num_items_in_batch=11).loss)
    assert abs(float(fused - plain)) <= 1e-5 * abs(float(plain))
    assert max(_rel(fused_grads[n], plain_grads[n]) for n in plain_grads) < 1e-5
    fused_model = copy.deepcopy(model)
    install_head(fused_model, HeadSwitch(mode="fused", fused=True))
    assert fused_model(input_ids=ids, labels=ids).logits is None
    assert fused_model(input_ids=ids).logits.shape == (2, 9, cases.VOCAB)  # no labels: the logits a caller asked for
    fused_model.eval()
    with torch.no_grad():
        out = fused_model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 9, cases.VOCAB)


@pytest.mark.parametrize("tied", [False, True])
def test_automicros_llama_fused_gives_the_plain_heads_loss_gradients_and_loss_metrics(tied):
    from automicro.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=512, tie_embeddings=tied)
    ids = torch.randint(0, 512, (3, 16))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    batch = {"input_ids": ids, "labels": labels}
    switch = HeadSwitch(mode="fused", fused=True)
    (plain, plain_grads), (fused, fused_grads) = _fused_and_plain(model, lambda m: m.loss(m(batch), batch), switch)
    assert abs(float(fused - plain)) <= 1e-5 * abs(float(plain))
    assert max(_rel(fused_grads[n], plain_grads[n]) for n in plain_grads) < 1e-5
    total, count = switch.last
    assert int(count) == int((labels != -100).sum()) and abs(float(total / count) - float(plain)) < 1e-5


def test_a_fused_output_names_the_key_to_set_when_its_logits_are_read():
    out = FusedHeadOutput(torch.tensor(1.0))
    assert out["loss"] is out.loss
    for read in (lambda: out.float(), lambda: out["logits"], lambda: out.logits):
        with pytest.raises(head_module.FusedHeadLogitsError, match="set head: plain"):
            read()


def test_a_model_whose_head_it_does_not_fuse_is_named_with_why():
    config = transformers.PhiConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2)
    family, why = find_head(transformers.AutoModelForCausalLM.from_config(config))
    assert family is None and "PhiForCausalLM (model_type 'phi') is not one of the families" in why
    # A routed family whose loss adds its routers' load-balancing loss: not fused, and why.
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        output_router_logits=True)
    family, why = find_head(transformers.AutoModelForCausalLM.from_config(config))
    assert family is None and "MixtralForCausalLM's loss adds its routers' load-balancing loss (output_router_logits: " \
        "true)" in why, why
    family, why = find_head(torch.nn.Linear(4, 4))
    assert family is None and "Linear has no head automicro knows" in why
    assert set(cases.TINY_FAMILIES) == set(FAMILIES)


# ---- the key ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(head="fast"), "head='fast': must be left out"),
    (dict(head="auto", trials=False), "head='auto' times the fused head .* trials=false"),
    (dict(head="auto", layout="fixed"), "head='auto' times the fused head .* layout='fixed' keeps the layout trials off"),
])
def test_a_bad_head_value_is_refused_with_what_to_set(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Settings.parse(**kwargs)


@pytest.mark.parametrize("head,match", [
    ("auto", r"head='auto' times the fused head .* sets it to 2: set head: fused .* or device_train_microbatch_size: auto"),
    ("fused", r"head='fused' with device_train_microbatch_size=2 is put on the sharded model, and this run has none: pass "
              r"parallelism_config=\{'fsdp2': \{\}\}"),
])
def test_a_head_the_callback_cannot_put_on_under_a_size_set_by_hand_is_refused_with_what_to_set(head, match):
    """The microbatch size set by hand: the callback searches nothing; `head: fused` is put on the sharded model
    (tests/test_head.py's parity on ranks), `head: auto` has no trials to time it in, a run without FSDP2 no
    sharded model: both refused before a batch runs."""
    import automicro
    from automicro.engine.head import HeadConfigError
    from automicro.models import build_model

    model = build_model("tiny", vocab_size=512)
    with pytest.raises(HeadConfigError, match=match):
        automicro.Trainer(model=model, train_dataloader=[], max_duration="1ba", device="cpu", device_train_microbatch_size=2,
                          callbacks=[automicro.AutoMicrobatching(head=head)], loggers=[], progress_bar=False)


def test_the_fused_head_is_not_a_layout_trade_to_pin():
    with pytest.raises(LayoutConfigError, match="the fused head is the head key's"):
        LayoutConfig.parse([FUSED_HEAD])


# ---- the trial: when, what it measures, what it keeps ------------------------------------------------


def _search(*others: str) -> LayoutSearch:
    return LayoutSearch(LayoutConfig("auto", trial_batches=2), [FUSED_HEAD, *others])


def _layout(search: LayoutSearch, **kwargs):
    args = dict(steady=True, fits=lambda trade: None, size=4, found=4, measure_at=1, largest_at=lambda n: n,
                capacity=1000, whole_batch=16)
    args.update(kwargs)
    return search.layout_for_batch(**args)


def test_the_fused_head_goes_first_measured_then_timed_at_the_larger_size_it_fits_and_kept_where_faster():
    search = _search()
    layout, lines = _layout(search)
    assert layout == (FUSED_HEAD,) and search.trial.measure and search.trial_size == 4, lines  # near the size found
    assert lines == ["head: the fused head's bytes measured in one batch at two microbatch sizes up to 4 (found 4 with the "
                     "plain head): a larger microbatch may fit with it"]
    search.observe(layout, 1.0)
    assert search.measuring is not None
    assert search.measured(None, "figures", fits_up_to=12) == "head: fused fits microbatch 12 at most (figures)"
    layout, lines = _layout(search)
    assert search.trial.size == 12 and lines == ["head: fused at microbatch 12 against plain at 4, the size found: 2 batches each"]
    for on in (True, False, True, False):
        layout, _ = _layout(search, steady=True)
        assert (FUSED_HEAD in layout) is on and search.trial_size == (12 if on else None)
        search.observe(layout, 1.0 if on else 2.0)
    assert search.needs_agreement
    result = search.decide(search.local_times())
    assert result.kept and result.size == 12 and result.line().startswith(
        "head: fused at microbatch 12 against plain at 4, the size found: fused kept; median batch 1.0000 s fused, 2.0000 s plain")
    assert search.settled == (FUSED_HEAD,)
    # Pressure later undoes another trade, never the head (it holds less than the plain head: the size shrinks).
    search.candidates.append("grad_sync_once")
    search.kept.append("grad_sync_once")
    assert search.relieve((FUSED_HEAD, "grad_sync_once"), "out of memory", 12) == "grad_sync_once"
    assert search.relieve((FUSED_HEAD,), "out of memory", 12) is None and FUSED_HEAD in search.kept
    # Checkpointed and resumed as kept.
    resumed = _search()
    resumed.load_state_dict(search.state_dict())
    assert FUSED_HEAD in resumed.kept and resumed.fits_up_to[FUSED_HEAD] == 12


def test_a_fused_head_tried_past_the_margin_that_runs_out_is_tried_at_the_size_under_the_margin_once():
    """Where the head's line puts a size under the capacity itself whose split runs fewer microbatches than the size
    under the margin, its trial runs that size; out of memory there (or retrying the allocator), the batch is rerun
    without it and the head is tried again from the same size found at the margin's size, once."""
    search = _search()
    _layout(search, found=7, size=6, largest_at=lambda n: min(n, 6) if n < 8 else n)
    search.observe((FUSED_HEAD,), 1.0)
    search.measured(None, "", fits_up_to=8, fallback=6)
    layout, lines = _layout(search, found=7, size=6, largest_at=lambda n: min(n, 6) if n < 8 else n)
    assert search.trial.size == 8 and layout == (FUSED_HEAD,), lines
    resumed = _search()  # a checkpoint here keeps the size to fall back to
    resumed.load_state_dict(search.state_dict())
    assert resumed.fits_up_to[FUSED_HEAD] == 8 and resumed.fallback == {FUSED_HEAD: 6}
    assert search.relieve((FUSED_HEAD,), "out of memory at size 8", 8) == FUSED_HEAD
    assert search.fell_back == (FUSED_HEAD, 8, 6) and search.trial is None and search.fallback == {}
    assert search.head_open(7) and search.fits_up_to[FUSED_HEAD] == 6
    layout, lines = _layout(search, found=7, size=6, largest_at=lambda n: min(n, 6) if n < 8 else n)
    assert search.trial.size is None and search.trial.trades == (FUSED_HEAD,), lines  # 6's split is 7's
    assert lines == ["head: fused against plain at the size found (it fits microbatch 6 at most, no larger split than at "
                     "7): 2 batches each"]
    # Out of memory again (at the size found): the head is not tried a third time from there.
    search.fell_back = None
    assert search.relieve((FUSED_HEAD,), "out of memory at size 6", 6) == FUSED_HEAD
    assert search.fell_back is None and not search.head_open(7)


@pytest.mark.parametrize("kept", [(), ("grad_sync_once",)])
def test_a_head_tried_past_the_margin_falls_back_where_the_batch_without_it_shows_the_retries(kept):
    """Its arms alternate: the memory pressure the batch at the larger size starts shows in the plain head's batch after
    it (Mixtral's 2 blocks on one H100: the fused head at 8 retried, the plain head at 7 after it, and the thrash ended
    the trial there, the head never tried again). The head is tried once more at the margin's size, and nothing kept
    is undone (the pool the larger size cut explains the pressure). A trial's allocator retries are timed since, not a
    thrash (tests/test_layout.py): an OOM in the plain head's batch takes this path."""
    search = _search("grad_sync_once")
    largest = lambda n: min(n, 6) if n < 8 else n  # noqa: E731
    _layout(search, found=7, size=6, largest_at=largest)
    search.observe((FUSED_HEAD,), 1.0)
    search.measured(None, "", fits_up_to=8, fallback=6)
    search.kept.extend(kept)
    layout, lines = _layout(search, found=7, size=6, largest_at=largest)
    assert search.trial.size == 8 and FUSED_HEAD in layout, lines
    undone = search.relieve(tuple(kept), "thrashing at size 6", 6)  # the plain head's batch
    assert undone is None and search.trial is None and search.kept == list(kept)
    assert search.fell_back == (FUSED_HEAD, 8, 6) and search.fallback == {} and search.fits_up_to[FUSED_HEAD] == 6
    assert search.head_open(7) and FUSED_HEAD not in search.kept
    layout, lines = _layout(search, found=7, size=6, largest_at=largest)
    assert search.trial.trades == (FUSED_HEAD,) and search.trial.size is None, lines  # at the size found: 6's split is 7's
    # Once: the trial at the margin's size ends as any other (a kept trade undone, as in any trial's batch without it).
    assert search.relieve((), "thrashing at size 6", 6) == (kept[0] if kept else None) and search.fell_back is None
    if kept:
        return
    # The line says which batch showed it (`LayoutTrials.relieve`; the engine stands in: nothing is undone).
    from automicro.batch.layout_trials import LayoutTrials
    from automicro.engine.unsharded import UnshardedModel

    lines = []
    trials = LayoutTrials(LayoutConfig.parse("auto"), UnshardedModel(module=torch.nn.Linear(2, 2), device=torch.device("cpu")),
                          None, lines.append, recoverable=True, pipeline=False)
    trials.engine, trials.search = object(), _search()
    _layout(trials.search, found=7, size=6, largest_at=largest)
    trials.search.observe((FUSED_HEAD,), 1.0)
    trials.search.measured(None, "", fits_up_to=8, fallback=6)
    _layout(trials.search, found=7, size=6, largest_at=largest)
    trials.layout = ()  # the plain head's batch
    assert trials.relieve("thrashing at size 6", 6) is None
    assert lines[-1] == ("head: fused at microbatch 8, past the margin: thrashing at size 6 in the batch without it, after "
                         "its own at 8; tried at 6, the size under the 95% margin, next")


@pytest.mark.parametrize("family,peaks,capacity_mib,line", [
    # Mixtral's 2 blocks on one H100 (16 x 4,096, gradients reduced once): (6, 6, 3, 1) measured, found 7 at (6, 5, 5).
    ("mixtral", ((3, 72921.5 - 3 * 2433.92), (6, 72921.5)), 78036.1,
     "head: fused fits microbatch 8 at most (2433.92 MiB per sample with it at microbatches 3 and 6, peak 72921.5 MiB at "
     "6, capacity 78036.1 MiB; 6 under the 95% margin runs 3 microbatches, 8 under the capacity 2: tried at 8, at 6 if "
     "it runs out)"),
    # OLMoE's 6 blocks on one H100: measured at 1 and 4 on top of no_reshard; 10 ran at 93.2% of the card by hand.
    ("olmoe", ((1, 63501.5 - 3 * 3456.08), (4, 63501.5)), 79086.6,
     "head: fused fits microbatch 8 at most (3456.08 MiB per sample with it at microbatches 1 and 4, peak 63501.5 MiB at "
     "4, capacity 79086.6 MiB; 7 under the 95% margin runs 3 microbatches, 8 under the capacity 2: tried at 8, at 7 if "
     "it runs out)"),
    # 5 is under the capacity itself, but its split runs as many microbatches as 4's: the margin's size alone.
    ("margin", ((1, 1000.0), (2, 2000.0)), 5100.0, "head: fused fits microbatch 4 at most (1000.00 MiB per sample with "
     "it at microbatches 1 and 2, peak 2000.0 MiB at 2, capacity 5100.0 MiB)"),
])
def test_the_head_line_names_a_size_past_the_margin_where_its_split_runs_fewer_microbatches(family, peaks, capacity_mib, line):
    """The GPU's figures (`benchmarks/RESULTS.md`, 2026-12-07): the line under the margin stopped at 3 microbatches
    where the card ran 2 (Mixtral 8 at 98% by hand, OLMoE 10 at 93%)."""
    from automicro.batch.layout_trials import LayoutTrials
    from automicro.core.layout import Trial
    from automicro.core.policy import PolicyConfig, SearchPolicy
    from automicro.engine.unsharded import UnshardedModel

    trials = LayoutTrials(LayoutConfig.parse("auto"), UnshardedModel(module=torch.nn.Linear(2, 2), device=torch.device("cpu")),
                          None, print, recoverable=True, pipeline=False)
    trials.search = _search()
    trials.search.trial = Trial((FUSED_HEAD,), size=6, from_size=7, measure=True)
    policy = SearchPolicy(PolicyConfig(), 16)
    trials._capacity, trials._batch_size = int(capacity_mib * 2**20), 16
    trials._count_at = lambda n: len(policy.split_for(n))
    assert trials._measured_upsize([(size, int(peak * 2**20)) for size, peak in peaks]) == line
    fits = int(line.split("fits microbatch ")[1].split()[0])
    assert trials.search.fits_up_to[FUSED_HEAD] == fits
    assert trials.search.fallback == ({} if family == "margin" else {FUSED_HEAD: 6 if family == "mixtral" else 7})


def test_the_heads_price_counts_the_size_past_the_margin_and_the_batch_an_oom_there_may_rerun():
    """Mixtral's 2 blocks on one H100 (`benchmarks/RESULTS.md`, 2026-12-07): found 7 at (6, 5, 5), a sample 2,433.92
    MiB with the fused head (the plain head's 1,000 MiB a sample are made up here); the head's facts count the split
    its trial runs (8: two microbatches, past the margin) and its price adds the one batch an OOM there may rerun;
    where the margin's size is the trial's, nothing is added."""
    from automicro.batch.layout_trials import LayoutTrials
    from automicro.core.policy import PolicyConfig, SearchPolicy
    from automicro.engine.unsharded import UnshardedModel

    policy = SearchPolicy(PolicyConfig(), 16)
    head_mib, sample_mib = 1000.0, 2433.92  # the plain head's bytes a sample (made up); a sample's with the fused head
    base_mib = 72921.5 - 6 * sample_mib  # the fused head's peak at a largest microbatch of 6: 72,921.5 MiB
    facts = {}
    for capacity_mib in (78036.1, 66000.0):  # the H100's; one where 8 is over the capacity itself
        trials = LayoutTrials(LayoutConfig.parse("auto"), UnshardedModel(module=torch.nn.Linear(2, 2), device=torch.device("cpu")),
                              None, print, recoverable=True, pipeline=False)
        trials._capacity, trials._batch_size, trials._found, trials._microbatches = int(capacity_mib * 2**20), 16, 7, 3
        trials._count_at = lambda n: len(policy.split_for(n))
        trials._largest_at = lambda n: max(policy.split_for(n))
        trials._peak_at = lambda n: (max(policy.split_for(n)),
                                     int((base_mib + max(policy.split_for(n)) * (sample_mib + head_mib)) * 2**20))
        trials.head_bytes = lambda: int(head_mib * 2**20)
        facts[capacity_mib] = trials.head_facts()
    past, under = facts[78036.1], facts[66000.0]
    assert (past["fits"], past["microbatches"], past.get("past_margin")) == (8.0, 2.0, 1.0), past
    assert "past_margin" not in under and under["microbatches"] == 3.0, under
    profile = BatchProfile(wall_s=1.0, idle_s=0.1, fsdp_s=0.02, comm_s=0.0, fusable_s=0.2, head_s=0.3, head_eager_s=0.2,
                           head_bytes=3 << 30)
    measured = Measured(batch_s=0.9, left=900, planned=1000, profile=profile, microbatches=3, microbatch_fit_s=0.05,
                        sizes_compile=False)
    at_margin = price(FUSED_HEAD, FUSED_HEAD, measured, microbatches=2.0, measure=0.0)
    over = price(FUSED_HEAD, FUSED_HEAD, measured, microbatches=2.0, measure=0.0, past_margin=1.0)
    assert over.win_s == at_margin.win_s and math.isclose(over.cost_s, at_margin.cost_s + 0.9)
    assert over.costs == "its arms' batches and one batch an OOM past the margin may rerun" and at_margin.costs == "its arms' batches"


def test_a_fused_head_that_fits_no_larger_split_is_timed_at_the_size_found_and_one_its_price_rules_out_is_said():
    search = _search()
    _layout(search)
    search.observe((FUSED_HEAD,), 1.0)
    search.measured(None, "", fits_up_to=4)
    layout, lines = _layout(search)
    assert search.trial.size is None and lines == [
        "head: fused against plain at the size found (it fits microbatch 4 at most, no larger split than at 4): 2 batches each"]
    shared = _search()  # another process holds memory on a rank's GPU: no larger microbatch for now
    _layout(shared, outside=1 << 30)
    shared.observe((FUSED_HEAD,), 1.0)
    shared.measured(None, "", fits_up_to=12)
    _layout(shared, outside=1 << 30)
    assert shared.trial.size is None and shared.trial.trades == (FUSED_HEAD,)
    priced_out = _search()
    refuse = lambda label, kind, facts: "expected +0.1% a batch, under the 1% it must win"  # noqa: E731
    layout, lines = _layout(priced_out, priced=refuse)
    assert layout == () and lines[0] == "head: plain kept, the fused head not tried: expected +0.1% a batch, under the 1% it must win"
    layout, lines = _layout(priced_out, priced=refuse)
    assert layout == () and not any(line.startswith("head:") for line in lines)  # not priced again at this size found
    _layout(priced_out, found=3, size=3)
    assert priced_out.trial.trades == (FUSED_HEAD,) and priced_out.trial.measure  # from another size found, it is


@pytest.mark.parametrize("batch,largest,split", [
    (32, 8, (8, 7, 8, 8, 1)), (32, 16, (16, 15, 1)), (8, 2, (2, 1, 2, 2, 1)), (32, 11, (11, 10, 11)),
    (31, 11, (11, 11, 9)), (32, 1, None), (32, 32, None), (4, 2, None), (5, 2, (2, 1, 2)), (3, 2, None),
    # Mixtral's blocks on one H100, found 7 at (6, 5, 5): not the probe's 1 and 2 (its line said "fits 4", 8 fitted).
    (16, 6, (6, 6, 4)), (12, 6, (6, 5, 1)), (10, 6, None),
])
def test_the_head_is_measured_near_the_size_found_where_a_split_gives_two_sizes_after_its_first(batch, largest, split):
    from automicro.core.policy import near_split

    assert near_split(batch, largest) == split
    if split is not None:
        assert sum(split) == batch and max(split) == largest and len(set(split[1:])) >= 2


@pytest.mark.parametrize("batch,largest,split", [
    (16, 6, (6, 6, 3, 1)), (32, 8, (8, 8, 8, 7, 1)), (14, 6, (6, 6, 1, 1)), (8, 2, (2, 2, 2, 1, 1)),
    (16, 8, None), (12, 6, None), (5, 2, None), (32, 1, None),
])
def test_with_gradients_reduced_once_the_head_is_measured_at_two_sizes_before_the_last_microbatch(batch, largest, split):
    """The last microbatch's peak holds the batch's gradient reduction (`MicrobatchPeaks`, last apart): two sizes
    between the first and the last, `largest` among them."""
    from automicro.core.policy import near_split

    assert near_split(batch, largest, last_apart=True) == split
    if split is not None:
        assert sum(split) == batch and max(split) == largest and len(set(split[1:-1])) == 2 and largest in split[1:-1]


def test_a_fused_head_or_trade_priced_out_for_the_budget_alone_is_priced_again_once_the_budget_grew():
    """On one H100 (Qwen3-MoE's blocks, 16 x 4,096) the fused head, expected +29.7% a batch, did not fit the 8.6 s
    budget at the size found; a kept trade then raised the budget to 45 s, but the head was never asked again there
    (it ran only after the size shrank; kept at once, it won 40%). Priced again and admitted, it is measured and then
    timed: the next H100 run measured it (it fits 16) and never timed it (the plan's admission ends its reprice)."""
    search = _search(NO_RESHARD)
    grown: set[str] = set()  # the plan's `over_budget` where the budget grew since: admitted, a price leaves it
    search.repriceable = lambda label: label in grown
    over = lambda label, kind, facts: "its predicted cost of 10.5 s does not fit the 8.58 s of the trials' budget"  # noqa: E731

    def admit(label, kind, facts):
        grown.discard(label)
        return None

    layout, lines = _layout(search, priced=over)
    assert layout == () and lines[0].startswith("head: plain kept, the fused head not tried: its predicted cost")
    assert lines[1].startswith("layout trade no_reshard (no resharding after forward, nor between microbatches) not tried")
    assert not search.reprices() and not search.head_open(4)
    assert _layout(search, priced=over) == ((), [])  # not asked again while the budget stands
    grown.update({FUSED_HEAD, NO_RESHARD})  # a kept trial won: the budget grew
    assert search.reprices() and search.head_open(4)
    layout, lines = _layout(search, priced=admit)
    assert search.trial.trades == (FUSED_HEAD,) and search.trial.measure, lines
    search.observe(layout, 1.0)
    search.measured(None, "", fits_up_to=4)
    for on in (True, False, True, False):  # timed at the size found
        layout, lines = _layout(search, priced=admit)
        assert search.trial.trades == (FUSED_HEAD,) and not search.trial.measure, lines
        search.observe(layout, 1.0 if on else 2.0)
    assert search.decide(search.local_times()).kept
    assert FUSED_HEAD in search.kept and not search.head_open(4)
    layout, lines = _layout(search, priced=admit)
    assert search.trial.trades == (NO_RESHARD,), lines  # and the trade it had priced out, priced again


def test_the_fused_heads_price_is_its_eager_work_and_the_microbatches_it_saves_less_its_measuring_batch():
    profile = BatchProfile(wall_s=1.0, idle_s=0.1, fsdp_s=0.02, comm_s=0.0, fusable_s=0.2, head_s=0.3, head_eager_s=0.2,
                           head_bytes=3 << 30)
    measured = Measured(batch_s=1.0, left=900, planned=1000, profile=profile, microbatches=4, microbatch_fit_s=0.05)
    got = price(FUSED_HEAD, FUSED_HEAD, measured, microbatches=1.0, measure_microbatches=17.0, measure=1.0)
    assert math.isclose(got.win_s, HEAD_EAGER_SAVED * 0.2 + 3 * 0.05)
    assert got.cost_s > HEAD_MEASURE_BATCHES * 1.0 and "a measuring batch at the probe's split" in got.costs
    assert "3 fewer microbatch(es)" in got.basis
    near = price(FUSED_HEAD, FUSED_HEAD, measured, microbatches=1.0, measure_microbatches=5.0, measure=1.0, near=1.0)
    assert near.win_s == got.win_s and near.cost_s < got.cost_s - 3.0 and "a measuring batch near the size found" in near.costs
    unmeasured = price(FUSED_HEAD, FUSED_HEAD, measured, microbatches=4.0, measure=0.0)
    assert math.isclose(unmeasured.win_s, HEAD_EAGER_SAVED * 0.2) and "measuring" not in unmeasured.costs


def test_the_profile_counts_what_the_heads_ranges_launch_and_its_eager_part():
    def event(name, on_device, start, end, correlation=0, thread=1):
        return ProfiledEvent((name, on_device, start * 1000, end * 1000, correlation, 0, thread))

    events = [
        event("automicro::head", False, 100, 200), event("automicro::head_backward", False, 300, 400, thread=2),
        event("cudaLaunchKernel", False, 110, 111, correlation=1), event("cudaLaunchKernel", False, 120, 121, correlation=2),
        event("cudaLaunchKernel", False, 310, 311, correlation=3, thread=2), event("cudaLaunchKernel", False, 500, 501, correlation=4),
        event("sm90_xmma_gemm_bf16", True, 130, 170, correlation=1), event("cross_entropy_kernel", True, 170, 190, correlation=2),
        event("log_softmax_backward", True, 320, 330, correlation=3), event("elementwise_kernel", True, 500, 600, correlation=4),
    ]
    profile = figures(events, 1e-3, "cuda")
    assert math.isclose(profile.head_s, 70e-6) and math.isclose(profile.head_eager_s, 30e-6)
    agreed = BatchProfile.from_micros(profile.to_micros()[:9] + [123], "cuda")
    assert agreed.head_bytes == 123 and "holding 0.00 MiB a sample" in agreed.head_line(262144)


def _head_operators(run) -> dict[str, set[str]]:
    """The operators `run` ran inside the head's host ranges (forward, backward), as the profiled batch reads them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = list(prof.events())
    found: dict[str, set[str]] = {}
    for span in (e for e in events if e.name.startswith(head_module.HEAD_RANGE)):
        inside = found.setdefault(span.name, set())
        inside.update(e.name.removeprefix("aten::") for e in events if e.name.startswith("aten::") and e.thread == span.thread
                      and span.time_range.start <= e.time_range.start and e.time_range.end <= span.time_range.end)
    return found


@pytest.mark.parametrize("family, through", [(f, "model") for f in sorted(cases.TINY_FAMILIES)]
                         + [(f, "composer") for f in ("llama", "gemma2", "granite")])
def test_the_heads_ranges_hold_its_projection_its_softcap_or_scale_and_its_loss_forward_and_backward(family, through):
    """What the meter counts as the head (`HeadMeter`): the projection, the soft-capping (Gemma 2/3) or scaling
    (Granite), the loss and their backward, called as the model's own forward or through Composer's
    HuggingFaceModel (the main job's path)."""
    model = cases.tiny_causal_lm(family).train()
    switch = HeadSwitch(mode="auto", family=family, vocab=cases.VOCAB)
    torch.manual_seed(0)
    ids = torch.randint(0, cases.VOCAB, (2, 12))
    if through == "composer":  # as the main job builds it: Composer's wrapper first, the head put on the model inside
        from composer.models import HuggingFaceModel

        wrapped = HuggingFaceModel(model, use_logits=True)
        install_head(wrapped, switch)
        batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
        run = lambda: wrapped.loss(wrapped(batch), batch).backward()  # noqa: E731
    else:
        install_head(model, switch)
        run = lambda: model(input_ids=ids, labels=ids).loss.backward()  # noqa: E731
    switch.meter.on = True
    ranges = _head_operators(run)
    forward, backward = ranges.get(head_module.HEAD_RANGE, set()), ranges.get(head_module.HEAD_RANGE + "_backward", set())
    assert {"log_softmax", "nll_loss"} <= forward, forward
    assert "mm" in forward or "addmm" in forward, forward
    assert {"nll_loss_backward", "_log_softmax_backward_data"} <= backward and "mm" in backward, backward
    if FAMILIES[family].softcap:
        assert "tanh" in forward and "tanh_backward" in backward, (forward, backward)
    if FAMILIES[family].divisor:
        assert "div" in forward or "mul" in forward, forward


# ---- on ranks: FSDP2, the search, the trial -------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks():
    return run_multiprocess(cases.suite, world_size=2, timeout_s=420)


@pytest.mark.multiproc
def test_fused_under_fsdp2_on_one_and_two_ranks_trains_to_the_plain_heads_parameters():
    """automicro's Llama (tied embeddings) and Gemma 2 (soft-capping, tied) and Granite (logits scaling) built from
    their configs, sharded with FSDP2, a fixed split: the fused head's parameters after 3 batches are the plain
    head's (fp32, 1e-5), on one rank and on two; so with the microbatch size set by hand (the callback idle, its
    head: fused put on: one H100 run of `head: fused` at 16 had the plain head and ran out of memory)."""
    for world in (1, 2):
        for result in run_multiprocess(cases.parity, world_size=world, timeout_s=300):
            for name, diff in result.items():
                assert diff < 1e-5, (world, name, diff)


@pytest.mark.multiproc
def test_the_main_job_with_a_large_vocabulary_finds_at_least_twice_the_microbatch_fused_and_the_same_loss(two_ranks):
    """The main job (configs/tiny-cpu.yaml, a vocabulary of 8,192, caps of 60 and 70 MB): head: plain finds 2,
    head: fused at least 4, on both ranks alike; every batch's loss, the final one too, and the training metric are
    the plain run's."""
    for result in two_ranks:
        plain, fused = result["main_plain"], result["main_fused"]
        assert plain["found"] == 2, plain
        assert fused["found"] >= 2 * plain["found"], fused
        assert any(line.startswith("head: fused (torch-native") for line in fused["lines"]), fused["lines"]
        # Every batch's loss, the last one the final loss the console prints. (The parameters: the test above, with SGD;
        # the job's AdamW divides each step by the gradients' running magnitude, which takes the fused head's rounding,
        # 1e-6 of the gradients, to 1e-4 of some parameters after 10 steps, as a change of split alone does.)
        assert len(fused["losses"]) == 10 and cases.loss_gap(fused, plain) < 1e-5, (fused["losses"], plain["losses"])
        # The training LanguageCrossEntropy of every batch, from the fused loss (no logits): the plain run's.
        assert None not in fused["metrics"] and max(abs(a - b) / b for a, b in zip(fused["metrics"], plain["metrics"])) < 1e-5
    assert two_ranks[0]["main_fused"]["splits"] == two_ranks[1]["main_fused"]["splits"]


@pytest.mark.multiproc
def test_head_auto_measures_times_and_keeps_the_fused_head_at_the_larger_size_on_every_rank_alike(two_ranks):
    """`head: auto` (layout: auto, the probe, the fused head timed faster): measured in one batch, timed at the
    larger size it fits against the plain head at the size found, kept, the size adopted; every rank the same lines
    and splits; every batch's loss the plain run's. Its line read under a margin where the size under it runs two
    microbatches and the whole batch fits the capacity: tried at the whole batch first, out of memory there on rank 1
    (injected: one batch rerun on both ranks), then tried and kept at the margin's size."""
    lines = [result["auto"]["lines"] for result in two_ranks]
    assert lines[0] == lines[1]
    run = two_ranks[0]["auto"]
    text = "\n".join(run["lines"])
    assert "head: auto: automicro-llama's head" in text and "head: the fused head's bytes measured in one batch" in text, text
    measured = next(line for line in run["lines"] if line.startswith("head: fused fits microbatch "))
    below = int(measured.split("% margin runs")[0].split("; ")[-1].split()[0])
    assert measured.startswith("head: fused fits microbatch 8 at most (") and f"tried at 8, at {below} if it runs out" in measured
    fell_back = next(line for line in run["lines"] if ", past the margin: " in line)
    assert fell_back == (f"head: fused at microbatch 8, past the margin: out of memory at size 8; tried at {below}, the "
                         "size under the 60% margin, next"), fell_back
    kept = next(line for line in run["lines"] if "fused kept; median batch" in line)
    assert kept.startswith(f"head: fused at microbatch {below} against plain at "), kept
    assert 1 < below < 8 and [below] * (8 // below) + ([8 % below] if 8 % below else []) in run["splits"], run
    rerun = next(line for line in run["lines"] if "-> oom on rank(s) [1]" in line)
    plain_found = int(kept.split(" against plain at ")[1].split(",")[0])
    assert rerun.endswith(f"(layout undone first; rerun at the size found, {plain_found}, now default)"), rerun
    assert run["found"] == below > two_ranks[0]["main_plain"]["found"] and run["head_fused"], run
    assert run["splits"] == two_ranks[1]["auto"]["splits"]
    assert cases.loss_gap(run, two_ranks[0]["main_plain"]) < 1e-5, (run["losses"], two_ranks[0]["main_plain"]["losses"])


@pytest.mark.multiproc
def test_a_batch_that_reads_the_logits_of_the_fused_head_auto_put_on_is_rerun_with_the_plain_head(two_ranks):
    """`head: auto`, and a callback that reads every training forward's logits: the fused head's measuring batch fails
    on every rank with the error that names the key; the batch is rerun with the plain head, which stays; every batch
    trains, with the plain run's losses."""
    for result in two_ranks:
        run = result["reads_logits"]
        assert any(line.startswith("head: plain for the rest of the run: a batch with the fused head failed "
                                   "(FusedHeadLogitsError: automicro: the fused head computed the loss without the logits")
                   for line in run["lines"]), run["lines"]
        assert not run["head_fused"] and len(run["losses"]) == 10
        assert cases.loss_gap(run, result["main_plain"]) < 1e-5, (run["losses"], result["main_plain"]["losses"])


@pytest.mark.multiproc
def test_where_size_1_does_not_fit_with_the_plain_head_the_ladder_fuses_it_first_and_trains_with_no_recompute(two_ranks):
    """`head: auto` under caps where one sample does not fit with the plain head, even with every block recomputed (at
    32,768 and 65,536 tokens on one H100, Llama-3.2 1B's shape: `benchmarks/RESULTS.md`): the ladder below size 1 takes
    the fused head as its first rung, on both ranks alike, size 1 fits with it and no recompute, and every batch's loss
    is the plain run's. Size 1 ran in batch 0 with the plain head, before AdamW's state existed: the rung is taken right
    after that step, with no OOM at size 1 (before, batch 1 ran out at size 1 twice first)."""
    for result in two_ranks:
        run = result["below_one"]
        assert run["found"] == 1 and run["head_fused"] and run["floor"] == ["fused_head"], run
        assert any(line.startswith("head: fused below size 1: size 1 ran with the plain head, but its peak with the optimizer "
                                   "state the first step added does not fit (rank 0: peak ") and "from batch 1" in line
                   for line in run["lines"]), run["lines"]
        assert not [line for line in run["lines"] if re.search(r"size 1 split \[[1, ]+\] -> oom", line)], run["lines"]
        assert not any(line.startswith("recompute on:") for line in run["lines"]), run["lines"]
        assert "ladder: the fused head on (size 1 did not fit without it)" in run["summary"], run["summary"]
        assert len(run["losses"]) == 4 and cases.loss_gap(run, result["main_plain"]) < 1e-5, (run["losses"], result["main_plain"]["losses"])
    assert two_ranks[0]["below_one"]["splits"] == two_ranks[1]["below_one"]["splits"]
    assert two_ranks[0]["below_one"]["lines"] == two_ranks[1]["below_one"]["lines"]
