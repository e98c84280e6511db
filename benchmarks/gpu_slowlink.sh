#!/usr/bin/env bash
# Issue 13 item 3 on 2 GPUs (device tool, kind nvidia-h200-x2, `.whl` carried): the engine where
# the link between the ranks is slow. NCCL's socket transport stands in for an inter-node link
# (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1); NVLink runs next to it in the same call.
#   bash benchmarks/gpu_slowlink.sh            (MBS="2 4 8", VARIANTS=..., NVL_VARIANTS=...)
# 1. the engine's link probe on both links (benchmarks/link_probe.py);
# 2. Llama 1B, seq 2048, per microbatch size in MBS: plain fully_shard vs engine variants
#    (benchmarks/engine.py --suite llama), on sockets, then the NVL_VARIANTS on NVLink.
set -uo pipefail
OUT=${OUT:-runs/gpu_slowlink}
source benchmarks/gpu_env.sh
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
SLOW="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
MBS=${MBS:-4}
VARIANTS=${VARIANTS:-baseline,engine,engine_implicit,engine_implicit_fsdpbufs,zero2,zero2_pure,hsdp,hsdp_pure}
NVL_VARIANTS=${NVL_VARIANTS:-baseline,engine,engine_implicit}
start=$(date +%s)
if [ -z "${SKIP_PROBE:-}" ]; then
  timeout 90 $RUN benchmarks/link_probe.py --out "$OUT/probe_nvlink" 2>&1 | grep "link_probe\]\|Error"
  env $SLOW timeout 90 $RUN benchmarks/link_probe.py --out "$OUT/probe_socket" 2>&1 | grep "link_probe\]\|Error"
fi
for mb in $MBS; do
  env $SLOW timeout ${JOB_S:-330} $RUN benchmarks/engine.py --suite llama --microbatch "$mb" --rounds ${ROUNDS:-1} --variants "$VARIANTS" \
    --out "$OUT/socket_mb$mb" > "$OUT/socket_mb$mb.log" 2>&1
  echo "== socket transport, microbatch $mb (exit $?, $(( $(date +%s) - start )) s)"
  grep -v "round\|Warning\|warn\|^W[0-9]\|^\s*$" "$OUT/socket_mb$mb.log" | tail -20
done
if [ -n "$NVL_VARIANTS" ]; then
  for mb in ${NVL_MBS:-4}; do
    timeout 150 $RUN benchmarks/engine.py --suite llama --microbatch "$mb" --variants "$NVL_VARIANTS" \
      --out "$OUT/nvlink_mb$mb" > "$OUT/nvlink_mb$mb.log" 2>&1
    echo "== NVLink, microbatch $mb (exit $?, $(( $(date +%s) - start )) s)"
    grep -v "round\|Warning\|warn\|^W[0-9]\|^\s*$" "$OUT/nvlink_mb$mb.log" | tail -12
  done
fi
echo "gpu_slowlink: $(( $(date +%s) - start )) s"
