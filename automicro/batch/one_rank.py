"""One rank with ``parallelism_config.fsdp2``: keep FSDP2, train the model unsharded, or measure.

On one rank FSDP2 shards nothing: the parameters, gradients and optimizer state take the same
bytes sharded over a world of one as unsharded, so the choice is speed alone, and which is faster
depends on the model and on compile (measured on one H200, `benchmarks/RESULTS.md`, 2026-11-28, one GPU against Composer):
eager, FSDP2 with the layout trades is level with or ahead of unsharded (1.00-1.03x); compiled,
transformers' Llama runs 1.13x faster with FSDP2 and each block compiled than with the whole
model compiled unsharded, while `automicro.models`' Llama runs 1.05-1.06x faster unsharded with
the whole model compiled, and under a memory cap at small microbatches Qwen2.5-0.5B 1.9x (2026-11-29, the capped row profiled).
So by default (``on_one_rank`` left out) a one-GPU job with ``auto`` times both once the size settles
(`automicro.batch.sharding_choice`, on the model's unsharded twin: `twin_problem` says where it cannot),
and ``keep`` and ``unshard`` are the pins; ``unshard`` also lets one YAML shard over many GPUs and run
unsharded on one:

    parallelism_config:
      fsdp2:
        on_one_rank: unshard   # null (default): measured on one GPU | auto: on CPU too | keep | unshard

With ``unshard`` on one rank the job runs as with ``parallelism_config: null`` (Composer's model
placement and autocast; with ``auto``, the same search and recovery on the unsharded handle), and
``compile`` compiles the whole model (Composer's ``compile_config``; each-block compile needs
FSDP2's blocks); the allocator setting ``expandable_segments`` still applies (it is the
process's, not FSDP2's). On several ranks ``on_one_rank`` changes nothing.

Owns: that decision and the line that says it. May not touch: the model, Composer's state, torch
(the world size comes in as a number).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from automicro.engine.compile import CompileConfig, CompileConfigError
from automicro.engine.config import FSDP2_KEY, FSDP2Config, FSDP2ConfigError

# What FSDP2 does on one rank that the unsharded model cannot: an `unshard` pin with either is refused.
_SHARDED_ONLY = {
    "cpu_offload": "keeps parameters, gradients and optimizer state on the host, which only FSDP2 does",
    "activation_checkpointing": "checkpoints each block FSDP2 wraps; the unsharded model has no blocks to checkpoint",
}


@dataclasses.dataclass(frozen=True)
class OneRankChoice:
    """What the trainer builds: `fsdp2` None means unsharded; `compile` is the compile to apply."""

    fsdp2: Optional[FSDP2Config]
    compile: Any
    line: Optional[str] = None  # said once at start where the choice changed something
    # The FSDP2 settings a pinned one-rank job left: its process-wide allocator choice
    # (`expandable_segments`) still holds unsharded.
    unsharded_from: Optional[FSDP2Config] = None


def choose(fsdp2: Optional[FSDP2Config], *, world_size: int, pipeline: bool, compile: Any,
           checkpoint_format: Optional[str], model_on_meta: bool, precision: Any, auto_eval: bool = False) -> OneRankChoice:
    """Resolve ``fsdp2.on_one_rank`` for a job of `world_size` ranks. `compile` is the trainer's
    ``compile`` argument as given (None, True, a mapping or a `CompileConfig`); `precision` is
    Composer's (a name or its `Precision`), which sets the unsharded model's compute dtype;
    `auto_eval`: an evaluator asks for ``device_eval_microbatch_size: auto``."""
    if fsdp2 is None or fsdp2.on_one_rank != "unshard" or world_size != 1:
        return OneRankChoice(fsdp2, compile)
    key = f"{FSDP2_KEY}.on_one_rank=unshard"
    if pipeline:
        raise FSDP2ConfigError(f"{key} with parallelism_config.pipeline: a pipeline needs one rank per stage; remove one of them")
    for name, why in _SHARDED_ONLY.items():
        if getattr(fsdp2, name):
            raise FSDP2ConfigError(
                f"{key} with {FSDP2_KEY}.{name}=true: {name} {why}; set on_one_rank: keep, or {name}: false"
            )
    if checkpoint_format == "sharded":
        raise FSDP2ConfigError(
            f"{key} with checkpoint_format='sharded': sharded (DCP) checkpoints are FSDP2's; on one rank unsharded the "
            "checkpoint is one file: set checkpoint_format: full (or leave it out), or on_one_rank: keep"
        )
    if auto_eval:
        raise FSDP2ConfigError(
            f"{key} with device_eval_microbatch_size='auto': the eval search runs on the FSDP2 engine; set a positive "
            "int device_eval_microbatch_size, or on_one_rank: keep"
        )
    if model_on_meta:
        raise FSDP2ConfigError(
            f"{key}: the model's parameters are on the meta device, which FSDP2 materializes shard by shard and the "
            "unsharded model cannot; build the model on a real device (YAML: model.init_device: cpu), or set on_one_rank: keep"
        )
    precision_name = _precision_name(precision)
    if not _same_compute(fsdp2, precision):
        raise FSDP2ConfigError(
            f"{key} with {FSDP2_KEY}.mixed_precision={fsdp2.mixed_precision} and precision={precision_name}: FSDP2 would "
            "compute in bf16, the unsharded model in Composer's precision; set precision: amp_bf16 (the same bf16 "
            "compute), or mixed_precision: FULL for fp32 on both"
        )
    try:
        config = CompileConfig.from_value(compile)
    except CompileConfigError:
        config = compile  # the trainer's own compile check names the bad key
    compiled = ""
    if isinstance(config, CompileConfig) and config.compiles_blocks:
        config = dataclasses.replace(config, scope="model")
        compiled = "; compile: the whole model (each-block compile needs FSDP2's blocks)"
    line = f"one rank: training unsharded ({key}): Composer's placement and autocast{compiled}"
    return OneRankChoice(None, config, line, unsharded_from=fsdp2)


def _precision_name(precision: Any) -> str:
    """Composer's precision (a name or its `Precision`) as its lower-case name ("default" where unset)."""
    return str(getattr(precision, "value", precision) or "default").lower()


def _same_compute(fsdp2: FSDP2Config, precision: Any) -> bool:
    """FSDP2's compute dtype is what Composer's precision gives the unsharded model: fp32 both, or bf16 both."""
    return fsdp2.mixed_precision == "FULL" or _precision_name(precision) == "amp_bf16"


def twin_problem(fsdp2: Optional[FSDP2Config], *, world_size: int, pipeline: bool, auto: bool, device_type: str,
                 precision: Any, grouped_experts: Callable[[], Sequence[str]] = tuple) -> Optional[str]:
    """Why this job does not time the model unsharded against FSDP2 (`automicro.batch.sharding_choice`):
    "" where it is not asked for at all (a pin, several ranks, no ``auto``, the default on CPU), a reason
    for the console where it is asked for and cannot be, None where the trainer builds the twin.
    `grouped_experts`: called only where the twin would be built, the model's expert modules whose weights autocast
    does not cast (`automicro.batch.routing.grouped_experts`, a walk of the model): where FSDP2 computes on bf16
    copies, the twin would compute those experts in fp32, another computation (and, compiled, transformers' per-expert fallback: on one H100, Qwen3-MoE's
    twin took 31.5 s in its first batch where FSDP2's blocks had compiled in 3.1 s, 3.3% of a 1,000-batch run,
    `benchmarks/RESULTS.md` 2026-12-06)."""
    if fsdp2 is None or world_size != 1 or pipeline or not auto or fsdp2.on_one_rank in ("keep", "unshard"):
        return ""
    if fsdp2.on_one_rank is None and device_type != "cuda":
        return ""  # as the layout trials: a CPU's time says nothing of a GPU's (on_one_rank: auto asks anyway)
    for name, why in _SHARDED_ONLY.items():
        if getattr(fsdp2, name):
            return f"{FSDP2_KEY}.{name}=true: {name} {why}"
    if not _same_compute(fsdp2, precision):
        return (f"{FSDP2_KEY}.mixed_precision={fsdp2.mixed_precision} computes in bf16, precision={_precision_name(precision)} would not: "
                "precision: amp_bf16 lets the model unsharded be timed")
    experts = grouped_experts() if fsdp2.mixed_precision != "FULL" else ()
    if experts:
        more = f" and {len(experts) - 1} more" if len(experts) > 1 else ""
        return (f"the experts' weights ({experts[0]}{more}) are 3-d, which autocast does not cast: unsharded "
                f"they would compute in fp32 where {FSDP2_KEY}.mixed_precision={fsdp2.mixed_precision} computes them "
                "in bf16")
    return None
