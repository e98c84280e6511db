#!/usr/bin/env bash
# Interleaved comparisons on the GPUs of one machine (device tool, repo root, `.whl` carried):
#   bash benchmarks/gpu_interleaved.sh
# 1. benchmarks/vs_plain.py: automicro with its hooks off vs plain Composer at fixed sizes ($SIZES);
# 2. benchmarks/hooks.py: sync hooks on vs off at size $HOOKS_SIZE, per sync-points:transport ($COMBOS).
# Both: Llama 1B, seq 2048, per-rank batch 24, trainers built once, timed windows of $WINDOW batches
# alternated A B A B for $ROUNDS rounds, then a profiled window each (GPU busy fraction), then all of
# it again in the reversed build order (counterbalanced; COUNTERBALANCE=0 adds --no-counterbalance,
# which is how session 6's first call ran, before the build-order bias was found).
# NPROC=1 runs without a launcher; NPROC>1 under torchrun. JSON, tables and logs land in $OUT.
# Time on one H200, 1B, batch 24, 4 rounds of 3 batches, one order: ~60 s a pair (size 2: ~80 s);
# counterbalanced twice that, so give a 600 s device call fewer SIZES.
set -uo pipefail
OUT=${OUT:-runs/gpu_interleaved}
source benchmarks/gpu_env.sh
NPROC=${NPROC:-1}
if [ "$NPROC" = 1 ]; then RUN=(python3); else RUN=(python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC"); fi
COMMON=(--out "$OUT" --rounds "${ROUNDS:-4}" --window "${WINDOW:-3}" --per-rank-batch "${BATCH:-24}" --quiet --case-timeout 200)
[ "${COUNTERBALANCE:-1}" = 0 ] && COMMON+=(--no-counterbalance)
start=$(date +%s)
timeout -k 10 "${VS_S:-330}" "${RUN[@]}" benchmarks/vs_plain.py "${COMMON[@]}" --sizes "${SIZES:-2,3,4,8}" \
  --budget-s "$(( ${VS_S:-330} - 70 ))" 2>&1 | grep -v Warning > "$OUT/vs_plain.log"
echo "vs_plain exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
start=$(date +%s)
timeout -k 10 "${HOOKS_S:-200}" "${RUN[@]}" benchmarks/hooks.py "${COMMON[@]}" --hooks-size "${HOOKS_SIZE:-4}" \
  --combos "${COMBOS:-all:auto,collectives:auto}" --budget-s "$(( ${HOOKS_S:-200} - 80 ))" 2>&1 | grep -v Warning > "$OUT/hooks.log"
echo "hooks exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
grep -h '^\[bench\]\|Error\|Traceback' "$OUT/vs_plain.log" "$OUT/hooks.log" | grep -v '^\[bench\] suite' | cut -c1-220
# The device tool brings back at most 8 files: PACK=$OUT/name.tgz packs the whole folder into one.
[ -n "${PACK:-}" ] && tar czf "$PACK" -C "$(dirname "$OUT")" "$(basename "$OUT")" && cp "$OUT"/*.json "$(dirname "$PACK")/"
