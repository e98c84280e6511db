#!/usr/bin/env bash
# Engine benchmarks (issue 3) in one device call on a 4-GPU machine (kind nvidia-h200-x4), repo
# root, `.whl` carried; two 2-GPU jobs side by side (they share the host, not the GPUs):
#   GPUs 0,1: the seed repro, every variant, 3 interleaved rounds, plain allocator and expandable
#             segments; then with 4 microbatches a step (gradient accumulation: the parameters of
#             engine_X and engine_X_fsdpbufs must stay bitwise equal); then Llama 1B, microbatch 8,
#             per-block compile.
#   GPUs 2,3: Llama 1B without compile at microbatch 2 and 4 (2 rounds each), and the baseline at
#             microbatch 8 without compile (what Composer's FSDP2 path runs).
# Usage: bash benchmarks/gpu_engine.sh            (results in runs/engine/, packed into $OUT/engine.tgz)
# Each job has its own time limit (JOB_S, default 520 s) so that the results of finished parts come back.
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
JOB_S=${JOB_S:-520}
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/engine.py"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/gpus.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$R/gpus.txt"
start=$(date +%s)
( export CUDA_VISIBLE_DEVICES=0,1
  timeout -k 10 "$JOB_S" bash -c "
    $RUN --suite seed --rounds 3 --iters 20 --out $R/seed
    $RUN --suite seed_expandable --rounds 3 --iters 20 --out $R/seed
    $RUN --suite seed --accum 4 --rounds 2 --iters 20 --out $R/seed_accum4
    $RUN --suite llama --microbatch 8 --compile --variants baseline,engine,engine_fsdpbufs,engine_async --out $R/llama_mb8_compile
  "
) > "$R/job01.out" 2>&1 &
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 "$JOB_S" bash -c "
    $RUN --suite llama --microbatch 2 --rounds 2 --out $R/llama_mb2
    $RUN --suite llama --microbatch 4 --rounds 2 --out $R/llama_mb4
    $RUN --suite llama --microbatch 8 --variants baseline,engine --out $R/llama_mb8
  "
) > "$R/job23.out" 2>&1 &
wait
for f in "$R/job01.out" "$R/job23.out"; do
  echo "==== $f"
  grep -v '^\[\(seed\|seed_expandable\|llama\)\] round\|^W[0-9]\|^\*\*\*\*\|OMP_NUM_THREADS' "$f" | tail -80
done
echo "engine benchmarks: $(( $(date +%s) - start )) s"
tar czf "$OUT_DIR/engine.tgz" "$R"
