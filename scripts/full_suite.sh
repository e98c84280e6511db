#!/usr/bin/env bash
# The full suite (`pytest --full`: every test, every launch, every fault-matrix cell) spread over this
# machine's cores with pytest-xdist, one test file per worker at a time, the costliest files first
# (tests/costs_full.json: the last recorded run of this script; tests/costs.json's leg 1 for a file it
# lacks). Meant for a lent GPU machine's CPUs (16 cores, the image's torch 2.11 and transformers 5.x):
#
#   device run:  bash scripts/full_suite.sh            (carry: [".whl"]; scripts/gpu_wheelhouse.sh builds it)
#   here:        PYTHON=.venv-211/bin/python bash scripts/full_suite.sh
#
# Arguments: [K/N] runs part K of N of the test files (dealt by recorded cost, about equal), for a
# machine that allows a command less time than the whole takes; each part prints its own minutes.
# WORKERS (default: the cores) sets the pytest workers; PYTEST_ARGS adds to pytest's arguments;
# TIME_LIMIT_S interrupts pytest (SIGINT: it still reports what ran, and the costs) after that long.
# The tests run on CPU ranks (gloo) as on CI: no GPU is visible to them (CUDA_VISIBLE_DEVICES=""), and
# every rank and test process gets one intra-op thread (OMP_NUM_THREADS=1: the workers share the cores).
# Where $OUT is set (the device tool), the log, the per-file costs (costs.json) and junit.xml go there.
# tests/test_foundry.py skips on a torch other than 2.7 (llm-foundry 0.22 pins torch<2.7.1): it runs
# in full with `make test-full` on the default environment.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-}
PY=${PYTHON:-python3}
OUT=${OUT:-.full-suite}
mkdir -p "$OUT"
CORES=$(nproc)  # before OMP_NUM_THREADS=1 below: nproc honours it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export WANDB_MODE=offline PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
if ! "$PY" -c "import composer" 2>/dev/null; then
    if [ ! -d .whl ]; then
        echo "error: $PY cannot import composer and there is no .whl/ to install it from (bash scripts/gpu_wheelhouse.sh," \
             "then carry .whl; or PYTHON=a venv's python)" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH  # bin: the composer launcher
fi
WORKERS=${WORKERS:-$CORES}
mapfile -t FILES < <(python3 .ci/costs.py files ${PART:+"$PART"})
[ "${#FILES[@]}" -gt 0 ] || { echo "error: no test files for part '${PART:-all}'" >&2; exit 2; }
"$PY" -c "import torch, composer, sys; print('full suite:', sys.version.split()[0], 'torch', torch.__version__, 'composer', composer.__version__)"
echo "full suite: ${#FILES[@]} test files${PART:+ (part $PART)}, $WORKERS workers on $CORES cores"
start=$(date +%s)
AUTOMICRO_COSTS_OUT="$OUT/costs.json" ${TIME_LIMIT_S:+timeout -s INT -k 60 "$TIME_LIMIT_S"} "$PY" -m pytest "${FILES[@]}" --full -n "$WORKERS" --dist loadfile -p no:cacheprovider \
    -q --durations=20 --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
took=$(( $(date +%s) - start ))
verdict=$([ "$rc" -eq 0 ] && echo passed || echo "FAILED (pytest exit $rc)")
echo "full suite${PART:+ part $PART}: $verdict in $took s ($(awk -v s="$took" 'BEGIN { printf "%.1f", s / 60 }') min), $WORKERS workers on $CORES cores" \
    | tee "$OUT/verdict.txt"
exit "$rc"
