#!/usr/bin/env bash
# "Prove it on GPUs": auto microbatching on 2 GPUs (torch 2.11, NCCL) with real CUDA OOMs.
# One launch per suite file (benchmarks/<suite>.py), many Trainers per launch:
#   nohang (K runs under random per-rank memory fractions), throughput (auto vs a fixed-size sweep,
#   halving baseline, search cost; one run each), thrash (allocator retries), parity (losses),
#   hooks and vs_plain (interleaved comparisons: benchmarks/harness.py).
# Run on the GPU machine from the repo root with `.whl` carried (scripts/gpu_wheelhouse.sh builds it):
#   bash benchmarks/gpu_auto.sh
# Writes OUT/<suite>.json (rewritten after every case), OUT/<suite>.log, OUT/summary.txt;
# OUT defaults to runs/gpu_auto.
# Env knobs: NPROC=2 (ranks), SKIP_INSTALL=1 (wheels already in /tmp/site), K=12 (nohang runs; the issue asks >= 20: raise NOHANG_S too), SUITES="nohang throughput thrash",
#   TOTAL_S=500 (all suites together, launches included), NOHANG_S=190 THROUGHPUT_S=190 THRASH_S=120
#   (per-suite hard timeouts), PARITY=1 (adds the 300-step parity suite, ~8-9 min on 1B, outside TOTAL_S;
#   better alone: SUITES=parity, PARITY_S=560),
#   hooks (sync hooks on vs off at one size, interleaved; HOOKS_S=300), vs_plain (automicro hooks off vs
#   plain Composer at fixed sizes, interleaved; VS_PLAIN_S=400),
#   DRIVER_ARGS="..." (appended to every driver call; the last value of a flag wins).
# CPU check of the same script: AUTO_DEVICE=cpu PYTHON=.venv/bin/python bash benchmarks/gpu_auto.sh
set -uo pipefail
OUT=${OUT:-runs/gpu_auto}
mkdir -p "$OUT"
# Keep NVLink multicast off (shared hosts: see the device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export WANDB_MODE=offline PYTHONUNBUFFERED=1
K=${K:-12}
SUITES=${SUITES:-"nohang throughput thrash"}
[ "${PARITY:-0}" = 1 ] && SUITES="$SUITES parity"
TOTAL_S=${TOTAL_S:-500}
script_start=$(date +%s)

if [ "${AUTO_DEVICE:-gpu}" = cpu ]; then
  PY=${PYTHON:-.venv/bin/python}
  DEVICE_ARGS=(--device cpu --tiny)
else
  PY=${PYTHON:-python3}
  DEVICE_ARGS=()
  if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
fi
"$PY" -c "import torch, composer; print('torch', torch.__version__, 'composer', composer.__version__)" | tee "$OUT/versions.txt"
LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}")
: > "$OUT/summary.txt"
suites_start=$(date +%s)

run_suite() {  # name, hard cap (s), then driver arguments
  local suite=$1 cap=$2
  shift 2
  local left=$(( TOTAL_S - ($(date +%s) - suites_start) ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 40 ]; then
    echo "suite $suite: skipped, ${left} s left of TOTAL_S=${TOTAL_S}" | tee -a "$OUT/summary.txt"
    return
  fi
  # The driver stops starting new cases at --budget-s; the timeout is the hang watchdog.
  local budget=$(( limit - 40 ))
  echo "=== $suite (timeout ${limit} s, case budget ${budget} s)"
  rm -f "$OUT/$suite.json"
  local start=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "${LAUNCH[@]}" "benchmarks/$suite.py" --out "$OUT" \
    --budget-s "$budget" ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"} "$@" ${DRIVER_ARGS:-} > "$OUT/$suite.log" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - start ))
  grep '^\[bench\]' "$OUT/$suite.log"
  local state
  state=$("$PY" - "$OUT/$suite.json" <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as error:  # noqa: BLE001
    print(f"no JSON ({type(error).__name__})"); sys.exit()
cases = doc.get("cases", [])
word = "complete" if doc.get("done") else "INCOMPLETE"
extra = f"; case running at the end: {doc['in_progress']} (hang or crash: see the log)" if doc.get("in_progress") else ""
print(f"{word}, {len(cases)} case(s){extra}")
PY
)
  echo "suite $suite: exit $rc in ${took} s; $state" | tee -a "$OUT/summary.txt"
  case $state in complete*) ;; *) grep '^\[bench:detail\]' "$OUT/$suite.log" | tail -4 ;; esac
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "suite $suite: TIMEOUT after ${limit} s" | tee -a "$OUT/summary.txt"
    grep -n "Traceback\|Error\|error\|Timeout\|timeout\|Thread 0x\|File \"" "$OUT/$suite.log" | grep -v Warning | tail -25
  fi
}

for suite in $SUITES; do
  case $suite in
    nohang) run_suite nohang "${NOHANG_S:-190}" --runs "$K" --case-timeout 90 ;;
    throughput) run_suite throughput "${THROUGHPUT_S:-190}" --case-timeout 90 ;;
    thrash) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False run_suite thrash "${THRASH_S:-120}" --case-timeout 90 ;;
    # parity is outside TOTAL_S: ~2 x 300 batches of ~0.8 s on 1B; run it alone (SUITES=parity).
    hooks) run_suite hooks "${HOOKS_S:-300}" --case-timeout 150 ;;
    vs_plain) run_suite vs_plain "${VS_PLAIN_S:-400}" --case-timeout 150 ;;
    parity) TOTAL_S=$(( TOTAL_S + ${PARITY_S:-560} )) run_suite parity "${PARITY_S:-560}" --case-timeout 400 ;;
    *) echo "unknown suite $suite" ;;
  esac
done
echo "all suites: $(( $(date +%s) - script_start )) s (install included)" | tee -a "$OUT/summary.txt"
