"""`parallelism_config.fsdp2.on_one_rank` (`automicro.batch.one_rank`): what one rank builds,
and every setting an `unshard` pin cannot honour refused with the fix. The runs are in
tests/test_unsharded.py (one rank unsharded, two ranks sharded)."""

from __future__ import annotations

import pytest

from automicro.engine.compile import CompileConfig
from automicro.engine.config import FSDP2Config, FSDP2ConfigError
from automicro.batch.one_rank import choose, twin_problem

PIN = FSDP2Config(on_one_rank="unshard")


def _choose(fsdp2=PIN, *, world_size=1, pipeline=False, compile=None, checkpoint_format="full", model_on_meta=False,
            precision="fp32", auto_eval=False):
    return choose(fsdp2, world_size=world_size, pipeline=pipeline, compile=compile, checkpoint_format=checkpoint_format,
                  model_on_meta=model_on_meta, precision=precision, auto_eval=auto_eval)


def test_fsdp2_is_built_unless_pinned_unshard_and_several_ranks_keep_fsdp2_whatever_the_pin():
    assert FSDP2Config().on_one_rank is None  # measured where it can be (`twin_problem`), FSDP2 built either way
    for setting in (None, "auto", "keep"):
        kept = _choose(FSDP2Config(on_one_rank=setting), compile=True)
        assert kept.fsdp2 == FSDP2Config(on_one_rank=setting) and kept.compile is True and kept.line is None
        assert kept.unsharded_from is None
    for world in (2, 8):
        assert _choose(world_size=world, compile=True).fsdp2 is PIN
    assert _choose(None).fsdp2 is None  # no FSDP2 asked: nothing to decide


def test_unshard_on_one_rank_drops_fsdp2_and_compiles_the_whole_model():
    eager = _choose()
    assert eager.fsdp2 is None and eager.compile is None and eager.unsharded_from is PIN
    assert "training unsharded" in eager.line and "compile" not in eager.line
    blocks = _choose(compile={"mode": "max-autotune", "backend": "aot_eager"})
    assert blocks.compile == CompileConfig(scope="model", mode="max-autotune", backend="aot_eager")
    assert "compile: the whole model" in blocks.line
    assert _choose(compile={"scope": "model"}).compile == CompileConfig(scope="model")
    assert _choose(FSDP2Config(on_one_rank="unshard", mixed_precision="DEFAULT"), precision="amp_bf16").fsdp2 is None


@pytest.mark.parametrize("setting, match", [
    (dict(fsdp2=FSDP2Config(on_one_rank="unshard", cpu_offload=True)), r"cpu_offload=true: .*on_one_rank: keep, or cpu_offload: false"),
    (dict(fsdp2=FSDP2Config(on_one_rank="unshard", activation_checkpointing=True)), r"activation_checkpointing: false"),
    (dict(checkpoint_format="sharded"), r"set checkpoint_format: full"),
    (dict(model_on_meta=True), r"model.init_device: cpu"),
    (dict(pipeline=True), r"pipeline"),
    (dict(auto_eval=True), r"set a positive int device_eval_microbatch_size, or on_one_rank: keep"),
    (dict(fsdp2=FSDP2Config(on_one_rank="unshard", mixed_precision="DEFAULT"), precision="fp32"), r"set precision: amp_bf16"),
    (dict(fsdp2=FSDP2Config(on_one_rank="unshard", mixed_precision="PURE"), precision=None), r"precision=default"),
])
def test_an_unshard_pin_that_one_rank_cannot_honour_is_refused_naming_the_fix(setting, match):
    with pytest.raises(FSDP2ConfigError, match=match):
        _choose(**setting)
    _choose(**{**setting, "world_size": 2})  # several ranks shard as configured: nothing to refuse


def _twin(fsdp2=FSDP2Config(), *, world_size=1, pipeline=False, auto=True, device_type="cuda", precision="fp32",
          grouped_experts=()):
    walked = []

    def experts():
        walked.append(True)
        return grouped_experts

    why = twin_problem(fsdp2, world_size=world_size, pipeline=pipeline, auto=auto, device_type=device_type,
                       precision=precision, grouped_experts=experts)
    # The model is walked for its experts only where the twin would be built and FSDP2 computes in bf16.
    assert bool(walked) == (why is None and fsdp2.mixed_precision != "FULL" or "experts' weights" in (why or "")), (why, walked)
    return why


def test_one_gpu_under_auto_times_the_model_unsharded_unless_pinned_or_it_cannot():
    assert _twin() is None and _twin(FSDP2Config(on_one_rank="auto"), device_type="cpu") is None
    assert _twin(FSDP2Config(mixed_precision="DEFAULT"), precision="amp_bf16") is None
    # Not asked: nothing to say (several ranks, a pipeline, no auto, a pin, the default on CPU).
    for quiet in (dict(world_size=2), dict(pipeline=True), dict(auto=False), dict(device_type="cpu"),
                  dict(fsdp2=FSDP2Config(on_one_rank="keep")), dict(fsdp2=FSDP2Config(on_one_rank="unshard")), dict(fsdp2=None)):
        assert _twin(**quiet) == "", quiet
    # Asked and impossible: the console says why.
    assert "cpu_offload=true" in _twin(FSDP2Config(cpu_offload=True))
    assert "activation_checkpointing=true" in _twin(FSDP2Config(activation_checkpointing=True))
    assert "precision: amp_bf16 lets" in _twin(FSDP2Config(mixed_precision="DEFAULT"), precision="fp32")
    # Experts autocast does not cast (`routing.grouped_experts`): fp32 unsharded where FSDP2 computes them in bf16.
    experts = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for mixed in ("DEFAULT", "PURE"):
        why = _twin(FSDP2Config(mixed_precision=mixed), precision="amp_bf16", grouped_experts=experts)
        assert why == (f"the experts' weights (model.layers.0.mlp.experts and 1 more) are 3-d, which autocast does not cast: "
                       f"unsharded they would compute in fp32 where parallelism_config.fsdp2.mixed_precision={mixed} computes "
                       "them in bf16"), why
    assert _twin(grouped_experts=experts) is None  # FULL: fp32 both ways
    assert _twin(FSDP2Config(mixed_precision="DEFAULT"), precision="amp_bf16", grouped_experts=experts, world_size=2) == ""


def test_on_one_rank_takes_auto_keep_or_unshard():
    with pytest.raises(FSDP2ConfigError, match=r"on_one_rank='unsharded': must be null or one of auto, keep, unshard"):
        FSDP2Config(on_one_rank="unsharded")
    assert FSDP2Config.from_dict({"on_one_rank": "unshard"}).on_one_rank == "unshard"


def test_the_yaml_takes_the_pin(tmp_path):
    from automicro.config.load import load_config

    cfg = load_config("configs/tiny-cpu.yaml", ["parallelism_config.fsdp2.on_one_rank=unshard"])
    assert cfg.fsdp2.on_one_rank == "unshard"
