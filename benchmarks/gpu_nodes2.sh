#!/usr/bin/env bash
# Two simulated nodes on a 2-GPU machine (device tool, kind nvidia-h200-x2, `.whl` carried): one
# torchrun per node (scripts/multinode.py --gpu --slow-link: own NCCL_HOSTID per node, so NCCL
# moves data between the nodes over its socket transport), then the ledger's cost on one node.
#   bash benchmarks/gpu_nodes2.sh
# 1. consensus round cost, 2 nodes x 1 GPU, hierarchical (gloo between the node leaders) next to
#    an NCCL default group (benchmarks/consensus.py --nccl);
# 2. steady-phase OOMs after the sync hooks are off across the 2 nodes (benchmarks/steady_oom.py
#    --suite oom): no board across nodes, so the ranks behind replay the record of the rank ahead
#    (CollectiveLedger.align) over the ledger's gloo group;
# 3. the ledger on vs off (--suite overhead: every other batch of one run, in pairs), one node, NVLink;
# 4. the sync hooks on vs off while searching at 2 nodes x 1 GPU (benchmarks/hooks.py, interleaved
#    windows; the consensus rounds cross the nodes);
# 5. search-phase no-hang runs across the 2 nodes (benchmarks/nohang.py: random per-rank memory
#    fractions, real CUDA OOMs while the sync hooks are on).
# Each part has SKIP_<PART>=1 and its own timeout (<PART>_S).
set -uo pipefail
OUT=${OUT:-runs/gpu_nodes2}
source benchmarks/gpu_env.sh
NODES="python3 scripts/multinode.py --launcher torchrun --nodes 2 --nproc-per-node 1 --gpu --slow-link"
start=$(date +%s)
if [ -z "${SKIP_CONSENSUS:-}" ]; then
  timeout 120 $NODES --timeout 100 -- benchmarks/consensus.py --nccl --rounds 2000 --out "$OUT/consensus_nccl_2x1.json" \
    2>&1 | grep "consensus\]\|Error" | head -6
  echo "== consensus 2x1: $(( $(date +%s) - start )) s"
fi
if [ -z "${SKIP_OOM:-}" ]; then
  timeout ${OOM_S:-270} $NODES --timeout $(( ${OOM_S:-270} - 10 )) -- benchmarks/steady_oom.py --out "$OUT/nodes2" --suite oom \
    ${OOM_ARGS:---runs 1:forward,0:backward,both:forward --repeat 2} > "$OUT/nodes2_oom.log" 2>&1
  echo "== steady OOMs on 2 nodes: exit $?, $(( $(date +%s) - start )) s"
  grep "steady_oom\]\|Error\|Traceback\|Timeout\|hang" "$OUT/nodes2_oom.log" | grep -v Warning | head -40
fi
if [ -z "${SKIP_OVERHEAD:-}" ]; then
  timeout ${OVERHEAD_S:-240} python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29602 benchmarks/steady_oom.py \
    --out "$OUT/overhead" --suite overhead ${OVERHEAD_ARGS:-} > "$OUT/overhead.log" 2>&1
  echo "== ledger overhead, 1 node: exit $?, $(( $(date +%s) - start )) s"
  grep "steady_oom\]\|Error\|Traceback" "$OUT/overhead.log" | grep -v Warning | head -30
fi
if [ -z "${SKIP_HOOKS:-}" ]; then
  timeout ${HOOKS_S:-330} $NODES --timeout $(( ${HOOKS_S:-330} - 10 )) -- benchmarks/hooks.py --out "$OUT/hooks_nodes2" \
    ${HOOKS_ARGS:---hooks-size 4 --per-rank-batch 8 --rounds 3 --window 2 --quiet} > "$OUT/hooks_nodes2.log" 2>&1
  echo "== hooks on vs off, 2 nodes: exit $?, $(( $(date +%s) - start )) s"
  grep -v "Warning\|warn" "$OUT/hooks_nodes2.log" | grep "hooks\]\|size-\|Error\|Traceback" | head -20
  cat "$OUT/hooks_nodes2/hooks_table.txt" 2>/dev/null
fi
if [ -z "${SKIP_NOHANG:-}" ]; then
  timeout ${NOHANG_S:-330} $NODES --timeout $(( ${NOHANG_S:-330} - 10 )) -- benchmarks/nohang.py --out "$OUT/nohang_nodes2" \
    ${NOHANG_ARGS:---runs 6 --nohang-batches 5 --per-rank-batch 8 --budget-s 270 --quiet} > "$OUT/nohang_nodes2.log" 2>&1
  echo "== search-phase no-hang runs, 2 nodes: exit $?, $(( $(date +%s) - start )) s"
  grep -v "Warning\|warn" "$OUT/nohang_nodes2.log" | grep "Error\|Traceback\|Timeout\|hang" | head -10
  cat "$OUT/nohang_nodes2/nohang_table.txt" 2>/dev/null
fi
echo "gpu_nodes2: $(( $(date +%s) - start )) s"
