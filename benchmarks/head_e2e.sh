#!/usr/bin/env bash
# The vocabulary head on one GPU, end to end (a device-tool command; `.whl` carried, with liger-kernel):
#
#   OUT=... bash benchmarks/head_e2e.sh "gemma3 llama32" [BATCHES]      # VARIANTS="plain-auto fused-auto blocks-auto"
#
# First the head alone (benchmarks/head_check.py: liger-kernel's and the torch-native fused head against the plain one,
# loss, gradients, time, memory), unless CHECK=0. Then each family a transformers model built from its config
# (benchmarks/one_gpu.py's FAMILIES), each block compiled, whole card, `max_duration` 1,000 batches stopped after BATCHES
# (60): `plain-auto` (head: plain), `fused-auto` (head: fused), `blocks-auto` (head: auto, the default: priced,
# measured, timed) and, where VARIANTS names it, `composercompile-auto` (Composer's own compiled auto). Each variant its
# own process and its own cold inductor and Triton caches. Everything goes to OUT/results.tgz as it comes:
# res/FAMILY-VARIANT/{one_gpu.json,*.log,*.metrics.jsonl} and res/head_check.json.
set -u
source benchmarks/gpu_env.sh
families=${1:-"gemma3 llama32"}
batches=${2:-60}
limit=${RUN_TIMEOUT:-240}
mkdir -p /tmp/res
if [ "${CHECK:-1}" = 1 ]; then
  timeout -k 10 180 python3 benchmarks/head_check.py --out /tmp/res > /tmp/res/head_check.out 2>&1
  echo "== head_check (rc $?)"; grep '^\[head_check\]' /tmp/res/head_check.out
  tar czf "$OUT/results.tgz" -C /tmp res
fi
for model in $families; do
  shape=""
  [ "$model" = gpt2l ] && shape="--seq 1024 --batch 64"
  for variant in ${VARIANTS:-plain-auto fused-auto blocks-auto}; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$model-$variant TRITON_CACHE_DIR=/tmp/triton-$model-$variant timeout -k 10 $((limit + 30)) \
      python3 benchmarks/one_gpu.py --out /tmp/res/$model-$variant --model $model $shape --variants $variant \
      --batches "$batches" --skip $((batches - 10)) --planned 1000 --timeout "$limit" > /tmp/res/$model-$variant.out 2>&1
    echo "== $model $variant (rc $?)"
    grep '^\[one_gpu\] |' /tmp/res/$model-$variant.out | tail -1
    grep -h '\] head: \|vocabulary head profiled\|microbatch size found' /tmp/res/$model-$variant/*.log 2>/dev/null | cut -c1-400
    tar czf "$OUT/results.tgz" -C /tmp res
  done
done
