#!/usr/bin/env bash
# Trials on against `trials: false`, end to end, on one GPU (a device-tool command; `.whl` carried):
#
#   OUT=... bash benchmarks/trials_e2e.sh "tinyllama olmo2" [BATCHES]      # VARIANTS="blocks-auto" for one of the two
#
# Each family a transformers model built from its config (benchmarks/one_gpu.py's FAMILIES), compiled (each block),
# whole card, `max_duration` 1,000 batches stopped after BATCHES (60): `blocks-auto` (the trials priced, those that
# pay run) and `notrials-auto` (`trials: false`: the size search and nothing else). Each variant its own process
# and its own cold inductor and Triton caches (a first run compiles cold; a shared cache would favour the second). one_gpu.py
# projects each run end to end (its launch plus the batches it did not run at its settled time) and reads the
# plan's lines (each trial's real and predicted cost, the price line). Everything goes to OUT/results.tgz as it
# comes (the device tool brings back 8 files at most): res/FAMILY-VARIANT/{one_gpu.json,*.log,*.metrics.jsonl}.
set -u
source benchmarks/gpu_env.sh
families=${1:-"tinyllama olmo2 qwen25 gpt2l"}
batches=${2:-60}
limit=${RUN_TIMEOUT:-240}
mkdir -p /tmp/res
for model in $families; do
  shape=""
  [ "$model" = gpt2l ] && shape="--seq 1024 --batch 64"
  for variant in ${VARIANTS:-blocks-auto notrials-auto}; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$model-$variant TRITON_CACHE_DIR=/tmp/triton-$model-$variant timeout -k 10 $((limit + 30)) \
      python3 benchmarks/one_gpu.py --out /tmp/res/$model-$variant --model $model $shape --variants $variant \
      --batches "$batches" --skip $((batches - 10)) --planned 1000 --timeout "$limit" > /tmp/res/$model-$variant.out 2>&1
    echo "== $model $variant (rc $?)"
    grep '^\[one_gpu\] |' /tmp/res/$model-$variant.out | tail -1
    tar czf "$OUT/results.tgz" -C /tmp res
  done
done
