#!/usr/bin/env bash
# Main job on 2 GPUs through the device tool (torch 2.11, NCCL), plus a real-OOM auto search.
# Run there from the repo root, with `.whl` carried (scripts/gpu_wheelhouse.sh builds it):
#   bash benchmarks/gpu_smoke.sh
# Writes logs and metrics under $OUT (or ./runs/gpu_smoke when OUT is unset).
set -uo pipefail
OUT=${OUT:-runs/gpu_smoke}
source benchmarks/gpu_env.sh
COMPOSER="python3 -m composer.cli.launcher"

echo "=== 1. main job: configs/tiny-gpu.yaml on 2 GPUs"
start=$(date +%s)
$COMPOSER -n 2 scripts/train.py configs/tiny-gpu.yaml run_dir="$OUT/tiny" loggers.console=false 2>&1 | grep -v Warning | tee "$OUT/tiny.log" | grep "\[automicro\]"
echo "tiny-gpu exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"

echo "=== 2. Llama 1b, seq 2048, per-rank memory fractions 0.22 / 0.32: a real CUDA OOM search"
start=$(date +%s)
$COMPOSER -n 2 scripts/train.py configs/tiny-gpu.yaml run_name=llama1b-auto run_dir="$OUT/l1b" \
  model.preset=1b model.init_device=meta data.kind=synthetic data.seq_len=2048 data.num_samples=4096 \
  global_train_batch_size=48 max_duration=16ba loggers.console=false \
  'callbacks.auto_microbatching={memory_fraction: {0: 0.22, 1: 0.32}}' \
  2>&1 | grep -v Warning | tee "$OUT/l1b.log" | grep "\[automicro\]\|Error\|error" | head -40
echo "llama1b exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
for run in ("tiny", "l1b"):
    path = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(path):
        print(run, "no metrics"); continue
    rows = [json.loads(l) for l in open(path)]
    tps = [r["throughput/tokens_per_sec"] for r in rows if "throughput/tokens_per_sec" in r]
    mfu = [r.get("throughput/device/mfu") for r in rows if "throughput/device/mfu" in r]
    mb = [r["automicro/microbatch_size"] for r in rows if "automicro/microbatch_size" in r]
    print(run, "last tokens/s", tps[-3:], "mfu", mfu[-1:], "microbatch sizes", mb)
PY
