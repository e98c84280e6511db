#!/usr/bin/env bash
# One sample that does not fit without recompute, on one GPU (a device-tool command; `.whl` carried):
#
#   OUT=... bash benchmarks/ladder_e2e.sh [MODEL] [SEQ] [BATCH] [BATCHES]      # llama32 65536 2 16
#
# A transformers model built from its config (benchmarks/one_gpu.py's FAMILIES; Llama-3.2 1B's shape by default) at SEQ
# tokens a sample, per-rank batch BATCH, each block compiled, whole card, `max_duration` 1,000 batches stopped after
# BATCHES, in VARIANTS (default "blocks-auto acblocks-fixed-1"): `blocks-auto` is `auto` with no key added (where size 1
# runs out, the ladder switches the blocks' checkpointing on: `automicro.batch.floor_ladder`), `acblocks-fixed-1` the
# hand-set run (`activation_checkpointing: true`, microbatch 1, layout fixed). Each variant its own process and its own
# cold inductor and Triton caches; automicro is told no memory fraction (MEMORY_FRACTION, default 0: the whole card, as the
# hand-set run has it). EXTRA: more overrides for every variant, comma-separated (e.g.
# `parallelism_config.fsdp2.activation_checkpointing=op`: a rung of the recompute dial set by hand; TAG names the run's
# folder then). Everything goes to OUT/results.tgz as it comes: res/VARIANT[TAG]/{one_gpu.json,*.log,...}.
set -u
source benchmarks/gpu_env.sh
model=${1:-llama32}
seq=${2:-65536}
batch=${3:-2}
batches=${4:-16}
limit=${RUN_TIMEOUT:-270}
mkdir -p /tmp/res
for variant in ${VARIANTS:-blocks-auto acblocks-fixed-1}; do
  run=$variant${TAG:-}
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$run TRITON_CACHE_DIR=/tmp/triton-$run timeout -k 10 $((limit + 30)) \
    python3 benchmarks/one_gpu.py --out /tmp/res/$run --model "$model" --seq "$seq" --batch "$batch" --variants "$variant" \
    --batches "$batches" --skip $((batches / 2)) --planned 1000 --timeout "$limit" --memory-fraction "${MEMORY_FRACTION:-0}" \
    --extra "${EXTRA:-}" > /tmp/res/$run.out 2>&1
  echo "== $model $seq x $batch $run ${EXTRA:-} (rc $?)"
  grep '^\[one_gpu\] |' /tmp/res/$run.out | tail -2
  grep -h '\] recompute on\|\] recompute\|microbatch size found\|batch 0 attempt\|OutOfMemory\|Error' /tmp/res/$run/*.log 2>/dev/null | cut -c1-300 | head -12
  tar czf "$OUT/results.tgz" -C /tmp res
done
