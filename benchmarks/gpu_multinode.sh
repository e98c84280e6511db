#!/usr/bin/env bash
# Consensus round cost on simulated nodes (scripts/multinode.py, one torchrun per node), on a GPU
# machine's CPU cores (16): the round is host-side work on a gloo side group in a GPU job too.
#   bash benchmarks/gpu_multinode.sh        (device tool, `.whl` carried: scripts/gpu_wheelhouse.sh)
# Layouts of 8 ranks: 1 node x 8 (shm vs flat gloo), 2 x 4, 4 x 2, 8 x 1 (hierarchical vs flat
# gloo); with 2+ GPUs also 2 nodes x 1 GPU next to an NCCL default group, NCCL between the nodes
# over sockets (--slow-link).
set -uo pipefail
OUT=${OUT:-runs/gpu_multinode}
source benchmarks/gpu_env.sh
ROUNDS=${ROUNDS:-3000}
for layout in 1x8 2x4 4x2 8x1; do
  nodes=${layout%x*}; per=${layout#*x}
  timeout 240 python3 scripts/multinode.py --launcher torchrun --nodes "$nodes" --nproc-per-node "$per" --timeout 220 -- \
    benchmarks/consensus.py --rounds "$ROUNDS" --out "$OUT/consensus_cpu_${layout}.json" 2>&1 | grep "consensus\]\|Error" | head -4
done
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -ge 2 ]; then
  timeout 240 python3 scripts/multinode.py --launcher torchrun --nodes 2 --nproc-per-node 1 --gpu --slow-link --timeout 220 -- \
    benchmarks/consensus.py --nccl --rounds "$ROUNDS" --out "$OUT/consensus_nccl_2x1.json" 2>&1 | grep "consensus\]\|Error\|NCCL" | head -6
fi
