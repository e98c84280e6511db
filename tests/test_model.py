"""Specification of automicro.models: the Llama decoder, its config, presets and Composer wrapper."""

from __future__ import annotations

import math

import pytest
import torch
from composer.metrics import LanguageCrossEntropy, LanguagePerplexity

from automicro.models import PRESETS, ComposerLlama, Llama, LlamaConfig, build_model
from automicro.models.llama import Block


def tiny_batch(batch: int = 2, seq: int = 16, seed: int = 0, vocab: int = 256) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


# --- presets and config ---------------------------------------------------------------------


def test_presets_are_named_tiny_125m_1b_3b_7b():
    assert set(PRESETS) == {"tiny", "125m", "1b", "3b", "7b"}


def test_tiny_preset_builds_on_cpu_with_the_documented_shape():
    model = build_model("tiny")
    cfg = model.model.config
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.max_seq_len) == (256, 64, 2, 4, 128)
    assert isinstance(model, ComposerLlama) and isinstance(model.model, Llama)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.model.num_params() < 1_000_000


@pytest.mark.parametrize(
    "preset, low, high",
    [("125m", 0.1e9, 0.2e9), ("1b", 0.9e9, 1.5e9), ("3b", 2.5e9, 3.6e9), ("7b", 6.0e9, 7.5e9)],
)
def test_large_presets_build_on_meta_with_param_counts_in_their_ballpark(preset, low, high):
    model = build_model(preset, init_device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert low <= model.model.num_params() <= high
    cfg = model.model.config
    assert cfg.vocab_size == 32000 and cfg.max_seq_len == 2048


def test_default_ffn_hidden_is_eight_thirds_d_model_rounded_up_to_multiple_of():
    assert LlamaConfig(vocab_size=10, d_model=4096, n_layers=1, n_heads=32).ffn_hidden == 11008
    assert LlamaConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=4, multiple_of=64).ffn_hidden == 192
    assert LlamaConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=4, ffn_hidden=100).ffn_hidden == 100


def test_n_kv_heads_defaults_to_n_heads():
    assert LlamaConfig(vocab_size=10, d_model=64, n_layers=1, n_heads=4).n_kv_heads == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=65, n_heads=4), "d_model"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(n_layers=0), "n_layers"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(d_model=64.0), "d_model"),
        (dict(max_seq_len=0), "max_seq_len"),
        (dict(ffn_hidden=0), "ffn_hidden"),
        (dict(d_model=12, n_heads=4), "d_model // n_heads"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(init_std=-0.1), "init_std"),
        (dict(rope_theta=0), "rope_theta"),
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(kwargs, field):
    base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4)
    with pytest.raises(ValueError, match=field.replace("/", r"\/")):
        LlamaConfig(**{**base, **kwargs})


def test_unknown_preset_raises_listing_the_allowed_names():
    with pytest.raises(ValueError) as info:
        LlamaConfig.from_preset("13b")
    for name in PRESETS:
        assert name in str(info.value)


def test_unknown_override_raises_naming_it():
    with pytest.raises(ValueError, match="d_modle"):
        LlamaConfig.from_preset("tiny", d_modle=128)


def test_overrides_replace_preset_values():
    cfg = LlamaConfig.from_preset("tiny", n_layers=3, n_kv_heads=2)
    assert cfg.n_layers == 3 and cfg.n_kv_heads == 2 and cfg.d_model == 64


def test_build_model_rejects_a_bad_init_device():
    with pytest.raises(ValueError, match="init_device"):
        build_model("tiny", init_device="not-a-device")


# --- module structure -------------------------------------------------------------------------


def test_blocks_are_fsdp_wrap_and_activation_checkpointing_units():
    model = build_model("tiny")
    assert isinstance(model.model.blocks, torch.nn.ModuleList)
    assert len(model.model.blocks) == 2
    assert all(isinstance(b, Block) for b in model.model.blocks)
    assert Block._fsdp_wrap is True and Block._activation_checkpointing is True


def test_linear_layers_have_no_bias_and_rope_tables_are_not_in_the_state_dict():
    model = build_model("tiny")
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            assert module.bias is None
    assert not any("rope" in key for key in model.state_dict())
    assert model.model.rope.cos.shape == (128, 8)


# --- forward, loss, causality -----------------------------------------------------------------


def test_forward_returns_logits_of_shape_batch_seq_vocab():
    model = build_model("tiny")
    logits = model(tiny_batch(batch=3, seq=20))
    assert logits.shape == (3, 20, 256)


def test_loss_at_init_is_finite_and_close_to_ln_vocab():
    torch.manual_seed(0)
    model = build_model("tiny")
    batch = tiny_batch(batch=4, seq=64)
    loss = model.loss(model(batch), batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(256)) < 0.1


def test_loss_ignores_labels_of_minus_100():
    model = build_model("tiny")
    batch = tiny_batch(batch=2, seq=8)
    logits = model(batch)
    masked = dict(batch, labels=batch["labels"].clone())
    masked["labels"][:, 4:] = -100
    expected = torch.nn.functional.cross_entropy(logits[:, :4].reshape(-1, 256), batch["labels"][:, :4].reshape(-1))
    torch.testing.assert_close(model.loss(logits, masked), expected)


def test_sequences_longer_than_max_seq_len_raise():
    model = build_model("tiny", max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tiny_batch(seq=17))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(n_kv_heads):
    torch.manual_seed(0)
    model = build_model("tiny", n_kv_heads=n_kv_heads).eval()
    batch = tiny_batch(batch=2, seq=32)
    changed = batch["input_ids"].clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        before = model.model(batch["input_ids"])
        after = model.model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_position_matters_through_rope():
    torch.manual_seed(0)
    model = build_model("tiny", n_layers=1).eval()
    # One block, the same tokens before the last one in another order: attention without positions
    # sees the same set of keys and values and gives the last position the same output (checked
    # with cos=1, sin=0: equal within 1e-4); only the rotary
    # positions tell the two apart. (Identical tokens everywhere, as this test once used, give every
    # position the same attention output with or without positions: it passed by rounding alone.)
    tokens = torch.tensor([[3, 5, 11, 7, 9], [11, 3, 5, 7, 9]])
    with torch.no_grad():
        logits = model.model(tokens)
    assert not torch.allclose(logits[0, -1], logits[1, -1], atol=1e-4)


# --- tied embeddings ----------------------------------------------------------------------------


def test_tied_embeddings_share_storage_and_reduce_param_count():
    untied = build_model("tiny")
    tied = build_model("tiny", tie_embeddings=True)
    assert tied.model.lm_head.weight is tied.model.tok_embeddings.weight
    assert tied.model.lm_head.weight.data_ptr() == tied.model.tok_embeddings.weight.data_ptr()
    assert untied.model.num_params() - tied.model.num_params() == 256 * 64


def test_tie_survives_meta_build_and_to_empty():
    model = build_model("tiny", tie_embeddings=True, init_device="meta")
    model.to_empty(device="cpu")
    model.model.init_weights()
    assert model.model.lm_head.weight is model.model.tok_embeddings.weight


# --- initialization ---------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_to_empty_and_init_weights_equals_a_cpu_build_with_the_same_seed(tie):
    torch.manual_seed(1234)
    cpu = build_model("tiny", tie_embeddings=tie)
    torch.manual_seed(1234)
    meta = build_model("tiny", tie_embeddings=tie, init_device="meta")
    assert all(p.is_meta for p in meta.parameters()) and meta.model.rope.cos.is_meta
    meta.to_empty(device="cpu")
    meta.model.init_weights()
    cpu_state, meta_state = cpu.state_dict(), meta.state_dict()
    assert cpu_state.keys() == meta_state.keys()
    for key in cpu_state:
        torch.testing.assert_close(meta_state[key], cpu_state[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(meta.model.rope.cos, cpu.model.rope.cos, rtol=0, atol=0)
    torch.testing.assert_close(meta.model.rope.sin, cpu.model.rope.sin, rtol=0, atol=0)


def test_init_weights_uses_normal_init_std_for_matrices_and_ones_for_norms():
    torch.manual_seed(0)
    model = build_model("125m", init_device="meta", n_layers=1, vocab_size=4096)
    model.to_empty(device="cpu")
    model.model.init_weights()
    for name, param in model.named_parameters():
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert abs(param.mean().item()) < 1e-3, name
            assert abs(param.std().item() - 0.02) < 1e-3, name


def test_different_seeds_give_different_weights():
    torch.manual_seed(0)
    a = build_model("tiny")
    torch.manual_seed(1)
    b = build_model("tiny")
    assert not torch.equal(a.model.tok_embeddings.weight, b.model.tok_embeddings.weight)


# --- flops ------------------------------------------------------------------------------------


def test_flops_per_token_is_6n_nonembedding_plus_12_layers_width_seq():
    model = build_model("tiny")
    cfg = model.model.config
    n_nonembedding = model.model.num_params() - cfg.vocab_size * cfg.d_model
    assert model.model.num_params(exclude_embeddings=True) == n_nonembedding
    expected = 6 * n_nonembedding + 12 * cfg.n_layers * cfg.d_model * 100
    assert model.model.flops_per_token(100) == expected


def test_flops_per_batch_is_flops_per_token_times_tokens():
    model = build_model("tiny")
    batch = tiny_batch(batch=3, seq=40)
    assert model.flops_per_batch(batch) == model.model.flops_per_token(40) * 3 * 40


def test_tied_lm_head_still_counts_towards_flops():
    tied = build_model("tiny", tie_embeddings=True)
    assert tied.model.num_params(exclude_embeddings=True) == tied.model.num_params()


# --- Composer interface -----------------------------------------------------------------------


def test_get_metrics_returns_language_cross_entropy_and_perplexity():
    model = build_model("tiny")
    for is_train in (True, False):
        metrics = model.get_metrics(is_train)
        assert set(metrics) == {"LanguageCrossEntropy", "LanguagePerplexity"}
        assert isinstance(metrics["LanguageCrossEntropy"], LanguageCrossEntropy)
        assert isinstance(metrics["LanguagePerplexity"], LanguagePerplexity)
    # metrics are not submodules: sharding and to_empty never touch them
    assert not any(isinstance(m, LanguageCrossEntropy) for m in model.modules())


def test_update_metric_and_eval_forward_agree_with_the_loss():
    torch.manual_seed(0)
    model = build_model("tiny").eval()
    batch = tiny_batch(batch=2, seq=16)
    with torch.no_grad():
        outputs = model.eval_forward(batch)
        torch.testing.assert_close(model.eval_forward(batch, outputs), outputs)
        loss = model.loss(outputs, batch)
    metrics = model.get_metrics(is_train=False)
    for metric in metrics.values():
        model.update_metric(batch, outputs, metric)
    torch.testing.assert_close(metrics["LanguageCrossEntropy"].compute(), loss)
    torch.testing.assert_close(metrics["LanguagePerplexity"].compute(), loss.exp())


def test_tiny_model_loss_goes_down_over_20_adamw_steps_on_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model("tiny")
    batch = tiny_batch(batch=4, seq=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1.0


# --- FSDP2: meta build, shard, materialize --------------------------------------------------------


def _sharded_init_matches_unsharded_both_ties(rank, world_size):
    """Both cases in one process group (one spawn of two ranks instead of two)."""
    return {tie: _sharded_init_matches_unsharded(rank, world_size, tie) for tie in (False, True)}


def _sharded_init_matches_unsharded(rank, world_size, tie):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = build_model("tiny", tie_embeddings=tie, vocab_size=255)  # 255 rows: uneven shards
    torch.manual_seed(0)
    model = build_model("tiny", tie_embeddings=tie, vocab_size=255, init_device="meta")
    for block in model.model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.model.init_weights()
    mismatched = [
        name
        for name, value in model.state_dict().items()
        if not torch.equal(value.full_tensor(), reference.state_dict()[name])
    ]
    batch = tiny_batch(batch=2, seq=16, vocab=255)
    loss = model.loss(model(batch), batch).item()
    return dict(
        mismatched=mismatched,
        tied=model.model.lm_head.weight is model.model.tok_embeddings.weight,
        rope_equal=torch.equal(model.model.rope.cos, reference.model.rope.cos),
        loss=loss,
        reference_loss=reference.loss(reference(batch), batch).item(),
    )


@pytest.fixture(scope="module")
def sharded_init_results():
    from automicro.testing.multiprocess import run_multiprocess

    return run_multiprocess(_sharded_init_matches_unsharded_both_ties, world_size=2, timeout_s=240)


@pytest.mark.multiproc
@pytest.mark.parametrize("tie", [False, True])
def test_fsdp2_sharded_meta_model_initializes_to_the_same_weights_as_an_unsharded_one(sharded_init_results, tie):
    for result in (per_rank[tie] for per_rank in sharded_init_results):
        assert result["mismatched"] == []
        assert result["tied"] is tie
        assert result["rope_equal"]
        assert result["loss"] == pytest.approx(result["reference_loss"], abs=1e-5)
