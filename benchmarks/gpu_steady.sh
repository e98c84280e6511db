#!/usr/bin/env bash
# Steady-phase OOM recovery on 2 GPUs through the device tool (torch 2.11, NCCL), one call:
#   bash benchmarks/gpu_steady.sh         (from the repo root, `.whl` carried: scripts/gpu_wheelhouse.sh)
# 1. benchmarks/steady_oom.py --suite oom: 12 runs of Llama 1B with a real CUDA OOM after the sync
#    hooks are off (rank 1, rank 0, both; in forward and in backward; twice each).
# 2. --suite overhead: the collective ledger on vs off, 3 interleaved rounds, steady tokens/s.
# 3. --suite stray: a collective outside the ledger is detected, never paired with a replay.
set -uo pipefail
OUT=${OUT:-runs/gpu_steady}
source benchmarks/gpu_env.sh
RUN="python3 -m torch.distributed.run --nproc-per-node 2"
start=$(date +%s)
$RUN --master-port 29601 benchmarks/steady_oom.py --out "$OUT" --suite oom ${OOM_ARGS:-} 2>&1 \
  | grep -v Warning | tee "$OUT/oom.log" | grep "steady_oom\]\|Error\|Traceback\|Timeout\|File \"/" | head -80
echo "oom suite exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
start=$(date +%s)
$RUN --master-port 29602 benchmarks/steady_oom.py --out "$OUT" --suite overhead ${OVERHEAD_ARGS:-} 2>&1 \
  | grep -v Warning | tee "$OUT/overhead.log" | grep "steady_oom\]\|Error\|Traceback" | head -40
echo "overhead suite exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
start=$(date +%s)
# 3. A collective outside the ledger (expected: rank 1 stops naming it, rank 0's watcher ends rank 0).
timeout 120 $RUN --master-port 29603 benchmarks/steady_oom.py --out "$OUT" --suite stray 2>&1 \
  | grep -v Warning | tee "$OUT/stray.log" | grep "steady_oom\]\|\[automicro\]" | head -10
echo "stray suite exit ${PIPESTATUS[0]} (a failure is expected) in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
