#!/usr/bin/env bash
# Follow-up to gpu_engine.sh (same machine kind and set-up): does forward prefetch depth 2 hide
# the copy-in stream's wait for the compute stream that compute-stream all-gather buffers add?
#   GPUs 0,1: seed repro, sync/async x fwd prefetch 1/2 x compute-stream buffers on/off, 3 rounds,
#             under expandable segments and under the plain allocator.
#   GPUs 2,3: Llama 1B microbatch 4 (2 rounds) and microbatch 8 with per-block compile.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
R=runs/engine_fwd2
mkdir -p "$R"
OUT_DIR=${OUT:-runs/engine_out}
mkdir -p "$OUT_DIR"
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/engine.py"
V=engine_sync_fsdpbufs,engine_default,engine_fwd2,engine_fwd2_fsdpbufs,engine_async,engine_async_fwd2
start=$(date +%s)
( export CUDA_VISIBLE_DEVICES=0,1
  timeout -k 10 "${JOB_S:-400}" bash -c "
    $RUN --suite seed_expandable --variants $V --rounds 3 --iters 20 --out $R/seed
    $RUN --suite seed --variants $V --rounds 3 --iters 20 --out $R/seed
    $RUN --suite seed --variants engine_fwd2 --expandable-by-engine --rounds 3 --iters 20 --out $R/seed_fwd2_engine_alloc
    $RUN --suite seed --accum 4 --variants engine_fwd2,engine_fwd2_fsdpbufs --rounds 2 --iters 20 --out $R/seed_accum4
  "
) > "$R/job01.out" 2>&1 &
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 "${JOB_S:-400}" bash -c "
    $RUN --suite llama --microbatch 4 --variants baseline,engine,engine_fwd2 --rounds 2 --out $R/llama_mb4
    $RUN --suite llama --microbatch 8 --compile --variants baseline,engine,engine_fwd2 --out $R/llama_mb8_compile
  "
) > "$R/job23.out" 2>&1 &
wait
for f in "$R/job01.out" "$R/job23.out"; do
  echo "==== $f"
  grep -v '^\[\(seed\|seed_expandable\|llama\)\] round\|^W[0-9]\|^\*\*\*\*\|OMP_NUM_THREADS\|UserWarning\|return func\|^note\|^(step' "$f" | grep -v '^\s*$' | tail -60
done
echo "fwd2 follow-up: $(( $(date +%s) - start )) s"
tar czf "$OUT_DIR/engine_fwd2.tgz" "$R"
