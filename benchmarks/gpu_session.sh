#!/usr/bin/env bash
# One device call per phase on a 4-GPU machine (kind nvidia-h200-x4), repo root, `.whl` carried:
#   bash benchmarks/gpu_session.sh A   # GPUs 0,1: 300-step loss parity (1B, per-rank batch 8);
#                                      # GPUs 2,3 meanwhile: consensus round cost, hooks on/off, 12 no-hang runs (1B)
#   bash benchmarks/gpu_session.sh B   # all 4 GPUs: no-hang runs on Llama 3B
# Everything lands in runs/session/<phase>/ and, packed, in $OUT/session_<phase>.tgz (the device
# tool brings back at most 8 files). The two jobs of phase A share the host (not the GPUs): their
# timings are taken under the same conditions for "on" and "off", not on an idle machine.
set -uo pipefail
PHASE=${1:?phase A or B}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export WANDB_MODE=offline PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD SKIP_INSTALL=1
R=runs/session/$PHASE
mkdir -p "$R"
OUT_DIR=${OUT:-runs/session_out}
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/gpus.txt"
start=$(date +%s)
case $PHASE in
  A)
    ( CUDA_VISIBLE_DEVICES=0,1 OUT=$R/parity SUITES=parity PARITY_S=${PARITY_S:-540} \
        DRIVER_ARGS="--per-rank-batch 8" bash benchmarks/gpu_auto.sh > "$R/parity.out" 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=2,3
      python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/consensus.py --nccl \
        --out "$R/consensus.json" > "$R/consensus.out" 2>&1
      OUT=$R/hooks SUITES=hooks DRIVER_ARGS="--fractions 0.5,0.5" bash benchmarks/gpu_auto.sh
      OUT=$R/nohang1b SUITES=nohang K=${K:-12} NOHANG_S=${NOHANG_S:-250} bash benchmarks/gpu_auto.sh
    ) > "$R/jobs23.out" 2>&1 &
    wait
    grep '^\[consensus\]' "$R/consensus.out"
    cat "$R/jobs23.out" | grep -v '^\[bench:detail\]'
    grep '^\[gpu_auto\]\|^suite\|TIMEOUT' "$R/parity.out" | grep -v ' ba [0-9]*/' | tail -12
    ;;
  B)
    NPROC=4 OUT=$R/nohang3b SUITES=nohang K=${K:-10} NOHANG_S=${NOHANG_S:-500} \
      DRIVER_ARGS="--model 3b --case-timeout 150" bash benchmarks/gpu_auto.sh 2>&1 | grep -v '^\[bench:detail\]'
    ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
echo "phase $PHASE: $(( $(date +%s) - start )) s"
tar czf "$OUT_DIR/session_$PHASE.tgz" "$R"
