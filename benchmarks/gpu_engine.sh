#!/usr/bin/env bash
# Engine benchmarks (issue 3) in one device call on a 4-GPU machine (kind nvidia-h200-x4), repo
# root, `.whl` carried; two 2-GPU jobs side by side (they share the host, not the GPUs):
#   GPUs 0,1: the seed repro under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and under the
#             plain allocator (3 interleaved rounds); the engine's true default (it switches
#             expandable segments on itself) in its own launch; 4 microbatches a step (gradient
#             accumulation: every X / X_fsdpbufs pair must stay bitwise equal).
#   GPUs 2,3: Llama 1B at microbatch 4 and 2 (2 rounds) and 8 with per-block compile, each with the
#             engine default alone in its own launch too; then no-hang auto-microbatching runs with
#             real OOMs on the engine defaults (benchmarks/gpu_auto.sh, K runs).
# Usage: bash benchmarks/gpu_engine.sh            (results in runs/engine/, packed into $OUT/engine.tgz)
# Each job has its own time limit (JOB_S, default 480 s) so that the results of finished parts come back.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
R=runs/engine
mkdir -p "$R"
OUT_DIR=${OUT:-runs/engine_out}
mkdir -p "$OUT_DIR"
JOB_S=${JOB_S:-480}
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/engine.py"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/gpus.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$R/gpus.txt"
start=$(date +%s)
SEEDV=implicit,explicit_async,engine_default,engine_default_fsdpbufs,engine_sync_f1,engine_sync_f1_fsdpbufs,engine_sync_f2_fsdpbufs
( export CUDA_VISIBLE_DEVICES=0,1
  timeout -k 10 "$JOB_S" bash -c "
    $RUN --suite seed --variants engine_default --expandable-by-engine --rounds 3 --iters 20 --out $R/seed_engine_default
    $RUN --suite seed --variants $SEEDV --rounds 3 --iters 20 --out $R/seed
    $RUN --suite seed_expandable --variants $SEEDV --rounds 3 --iters 20 --out $R/seed
    $RUN --suite seed --accum 4 --rounds 2 --iters 20 --out $R/seed_accum4
  "
) > "$R/job01.out" 2>&1 &
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 "$JOB_S" bash -c "
    $RUN --suite llama --microbatch 4 --rounds 2 --out $R/llama_mb4
    $RUN --suite llama --microbatch 4 --variants engine --expandable-by-engine --out $R/llama_mb4_engine_default
    $RUN --suite llama --microbatch 2 --rounds 2 --variants baseline,engine,engine_sync_f1 --out $R/llama_mb2
    $RUN --suite llama --microbatch 8 --compile --variants baseline,engine,engine_sync_f1 --out $R/llama_mb8_compile
    $RUN --suite llama --microbatch 8 --compile --variants engine --expandable-by-engine --out $R/llama_mb8_compile_engine_default
    OUT=$R/nohang SUITES=nohang K=${K:-8} NOHANG_S=${NOHANG_S:-200} SKIP_INSTALL=1 bash benchmarks/gpu_auto.sh
  "
) > "$R/job23.out" 2>&1 &
wait
for f in "$R/job01.out" "$R/job23.out"; do
  echo "==== $f"
  grep -v '^\[\(seed\|seed_expandable\|llama\)\] round\|^W[0-9]\|^\*\*\*\*\|OMP_NUM_THREADS\|bench:detail\|UserWarning\|return func\|^note\|^(step' "$f" | grep -v '^\s*$' | tail -120
done
echo "engine benchmarks: $(( $(date +%s) - start )) s"
tar czf "$OUT_DIR/engine.tgz" "$R"
