#!/usr/bin/env bash
# Several GPUs of one host under NCCL: the trials, the fused head, a routed model and the ladder, each against sizes set
# by hand (a device-tool command on a kind with GPUS GPUs; `.whl` carried):
#
#   OUT=... bash benchmarks/several_gpus.sh GPUS [BATCHES]            # GPUS 2, 4 or 8; BATCHES 60
#   OUT=... CASES="head late" bash benchmarks/several_gpus.sh 2       # some of the cases
#   bash benchmarks/several_gpus.sh GPUS --dry-run                    # CPU ranks (gloo), aot_eager, 2-layer models
#   VARIANTS=blocks-auto,composercompile-auto ...                      # other variants
#   ONE_GPU_ARGS="--layers 3 --skip 26" ...                            # more one_gpu.py arguments (fewer blocks: an H100)
#   ROUTED_BATCH=16 SKIP=24 ...                                        # the routed cases' per-rank batch; steady from SKIP
#   ONE_GPU_ARGS="--auto-extra callbacks.routing_skew.batches=[36],callbacks.routing_skew.forwards=1" ...  # skew auto only
#
# Each case is benchmarks/one_gpu.py on GPUS ranks (`--nproc`: torchrun's standalone rendezvous, the composer launcher's
# environment), each block compiled, whole cards, per-rank batch as given, `max_duration` 1,000 batches stopped after
# BATCHES; each variant its own launch with its own cold inductor and Triton caches:
#   head  Qwen2.5 0.5B's shape (a 151,936-token vocabulary), 2,048 x 32 a rank: `blocks-auto` (`head: auto`), the size
#         it found and half of it set by hand (`blocks-fixed-found`, `blocks-fixed-half`), Composer's own `auto`
#         (`composercompile-auto`: DDP, torch.compile of the whole model; Composer refuses `auto` under FSDP2).
#   moe   Qwen3-30B-A3B's blocks, 6 of 48 (128 experts, 8 a token), 4,096 x 32 a rank: `blocks-auto`, the two sizes
#         set by hand and Composer's own `auto` (the routing watch on; its skew on settled batches in the log).
#   olmoe, mixtral  the same with OLMoE-1B-7B's blocks (12 of 16) and Mixtral-8x7B's (3 of 32) (one_gpu.py's FAMILIES);
#         not in the default CASES. The routed models' table on one GPU: CASES="moe olmoe mixtral" ... several_gpus.sh 1.
#   long  Llama-3.2 1B's shape at 32,768 x 2 a rank, where size 1 needs recompute: `blocks-auto` (the floor's ladder)
#         against `acblocks-fixed-1` (every block checkpointed by hand, microbatch 1).
#   offload  a routed model where size 1 with every block recomputing does not fit: Mixtral-8x7B's blocks, OFFLOAD_LAYERS
#         of 32 (default 3: 4.6B parameters, their fp32 weights, gradients and AdamW state 68.5 GiB, on an H100's 80 GB),
#         OFFLOAD_BATCH (default 4) x 4,096 a rank: `auto` with `offload: auto` (the ladder ends at the host offload)
#         against the hand-set run (`cpu_offload: true`, full recompute and the fused head from the start, the size
#         searched, no trials). Not in the default CASES; GPU only. On an H200 (139 GiB) the state must near the card
#         before size 1 runs out at 4,096 tokens, more than the machine's 128 GiB of host memory holds pinned.
#   late  the head case under `auto` with another process taking LATE_GIB GiB (default 40) of GPU 1 only, once batch 20
#         is logged, until batch 30: a late OOM on one rank in a settled batch (one rerun on every rank, no hang).
# Per variant and rank 0: the size found, the trials' lines and price line, the final batch, peak reserved GiB, steady
# tokens/s (all ranks), the run projected to 1,000 batches (one_gpu.py's table). Everything goes to OUT/results.tgz as
# it comes: res/CASE-VARIANT/{one_gpu.json,*.log,*.metrics.jsonl}.
#
# --dry-run: the same cases and variants on GPUS CPU ranks (gloo, fp32, `compile.backend=aot_eager`, each family's
# 2-layer shape, 3 batches at 128 tokens x 4 a rank), the GPU-only parts left out (Composer's own `auto`, which needs
# a GPU, and the late case's memory-holding process): it checks the script and the launches, it measures nothing.
set -u
gpus=${1:?usage: several_gpus.sh GPUS [BATCHES | --dry-run]}
dry=0
batches=${2:-60}
if [ "$batches" = "--dry-run" ]; then dry=1; batches=3; fi
limit=${RUN_TIMEOUT:-420}
if [ "$dry" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}
  python=${PYTHON:-python3}
  mkdir -p "$OUT"
else
  source benchmarks/gpu_env.sh
  python=python3
fi
res=${RES:-/tmp/res}
mkdir -p "$res"
failed=0
# The device tool returns only a few files a call: everything travels in OUT/results.tgz, written after each case and
# every minute meanwhile (a call cut at its limit still returns what had run). Keep RES outside OUT.
if [ "$dry" = 0 ]; then
  ( while sleep 60; do tar czf "$OUT/results.tgz.part" -C "$(dirname "$res")" "$(basename "$res")" 2>/dev/null \
      && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; done ) &
  snapshots=$!
  trap 'kill $snapshots 2>/dev/null' EXIT
fi

# run CASE MODEL SEQ BATCH "VARIANTS" [more one_gpu.py arguments]: one launch of one_gpu.py over the variants (fixed-found
# and fixed-half read the auto run before them in the same launch).
run() {
  local case=$1 model=$2 seq=$3 batch=$4 variants=${VARIANTS:-$5}
  shift 5
  local skip=${SKIP:-$((batches / 2))}
  if [ "$dry" = 1 ]; then
    seq=128; batch=4; skip=1
    variants=$(echo "$variants" | tr ',' '\n' | grep -v '^composer' | paste -sd, -)
    set -- --dry-run "$@"
  fi
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$case TRITON_CACHE_DIR=/tmp/triton-$case timeout -k 10 $((limit * 4 + 60)) \
    "$python" benchmarks/one_gpu.py --out "$res/$case" --model "$model" --seq "$seq" --batch "$batch" --nproc "$gpus" \
    --variants "$variants" --batches "$batches" --skip "$skip" --planned 1000 --timeout "$limit" --memory-fraction 0 \
    ${ONE_GPU_ARGS:-} "$@" > "$res/$case.out" 2>&1
  local rc=$?
  echo "== $case: $model $seq x $batch a rank on $gpus ranks (rc $rc)"
  grep '^\[one_gpu\] |' "$res/$case.out" | tail -n +1
  grep -h '\] trials: \|final at batch\|\] recompute on\|\] head: \|routing moved\|converged on\|OutOfMemory' "$res/$case"/*.log 2>/dev/null \
    | cut -c1-240 | head -16
  # A variant that did not train says why in its row (error): a dry run of the plumbing fails on any of them.
  if [ "$rc" != 0 ] || ! "$python" - "$res/$case" <<'EOF'
import json, sys, glob
rows = [r for f in glob.glob(sys.argv[1] + "/one_gpu*.json") for r in json.load(open(f))["results"]]
bad = [r["variant"] + ": " + r["error"][-300:] for r in rows if r.get("error")]
print("\n".join(bad), file=sys.stderr)
sys.exit(1 if bad or not rows else 0)
EOF
  then
    failed=1
  fi
  tar czf "$OUT/results.tgz" -C "$(dirname "$res")" "$(basename "$res")"
}

for case in ${CASES:-head moe long late}; do
  case $case in
    head) run head qwen25 2048 32 blocks-auto,blocks-fixed-found,blocks-fixed-half,composercompile-auto ;;
    moe) run moe qwen3moe 4096 "${ROUTED_BATCH:-32}" blocks-auto,blocks-fixed-found,blocks-fixed-half,composercompile-auto ;;
    olmoe) run olmoe olmoe 4096 "${ROUTED_BATCH:-32}" blocks-auto,blocks-fixed-found,blocks-fixed-half,composercompile-auto ;;
    mixtral) run mixtral mixtral 4096 "${ROUTED_BATCH:-32}" blocks-auto,blocks-fixed-found,blocks-fixed-half,composercompile-auto ;;
    long) run long llama32 32768 2 blocks-auto,acblocks-fixed-1 ;;
    offload)
      if [ "$dry" = 1 ]; then
        echo "== offload: left out of the dry run (offload: auto is refused off a GPU)"
      else
        run offload-auto mixtral 4096 "${OFFLOAD_BATCH:-4}" blocks-auto --layers "${OFFLOAD_LAYERS:-3}" \
          --extra callbacks.auto_microbatching.offload=auto
        run offload-by-hand mixtral 4096 "${OFFLOAD_BATCH:-4}" fused-auto --layers "${OFFLOAD_LAYERS:-3}" \
          --extra parallelism_config.fsdp2.activation_checkpointing=true,parallelism_config.fsdp2.cpu_offload=true,callbacks.auto_microbatching.layout=fixed,callbacks.auto_microbatching.trials=false
      fi ;;
    late)
      if [ "$dry" = 1 ]; then
        echo "== late: left out of the dry run (another process holding GPU memory)"
      else
        run late qwen25 2048 32 blocks-auto --hog-later "b20:${LATE_GIB:-40}:b30" --hog-device 1
      fi ;;
    *) echo "unknown case $case (head, moe, olmoe, mixtral, long, offload, late)"; failed=1 ;;
  esac
done
exit $failed
