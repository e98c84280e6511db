#!/usr/bin/env bash
# Pipeline parallelism on 2 GPUs = 2 stages (device tool, kind nvidia-h200-x2, `.whl` carried):
# Llama 1B (22 layers, seq 2048, untied embeddings), amp_bf16, FSDP2 DEFAULT, synthetic data.
#   PARTS="nohang" bash benchmarks/gpu_pipeline.sh        # any of: nohang throughput memory
#   NOHANG_SPECS="zb-r0-015 ZeroBubble 0:0.15,1f1b-r1-020 1F1B 1:0.20"   # name schedule rank:fraction [override], comma-separated
#   (an override such as callbacks.fault_injector={"site":"forward","ranks":[0],"batch":8,"times":1} adds
#   a steady-phase fault: no spaces in it; separate the specs with ';' when an override holds commas)
#   CPU_DRY=1 bash benchmarks/gpu_pipeline.sh   # plumbing check on 2 gloo ranks (configs/tiny-cpu-pp.yaml), no GPU
# nohang:     auto microbatching with a tight memory_fraction on ONE stage, both schedules, each
#             run under `timeout` (rc 124/137 = hang);
# throughput: one memory setting, the auto run vs fixed device_train_microbatch_size at the found
#             size and the sizes around it (same memory_fraction); TP_SPECS picks the cases and
#             their order (interleaved repeats, an override such as
#             callbacks.auto_microbatching.steady_recovery=false, schedule FSDP2 = no pipeline);
# memory:     fixed microbatch, no fraction: 1F1B vs ZeroBubble x keep_graph_after_input_grad
#             false/true x activation checkpointing off/on; per-rank peak via gpu_pipeline.py probe.
# Runs live under $WORK (/tmp/gpu_pipeline); $OUT gets pipeline_<part>.json, its table and a
# tarball of the console logs (the device tool brings back 8 files at most).
set -uo pipefail
OUT=${OUT:-runs/gpu_pipeline}
WORK=${WORK:-/tmp/gpu_pipeline}
RUN_S=${RUN_S:-170}
if [ -n "${CPU_DRY:-}" ]; then
  mkdir -p "$OUT"; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PROBE_CPU_CAP=1
  CONFIG=configs/tiny-cpu-pp.yaml; GBS=${GBS:-12}; PRECISION=fp32; MP=FULL
  BASE=("global_train_batch_size=$GBS" loggers.console=false eval_interval=null save_folder=null load_path=null)
else
  source benchmarks/gpu_env.sh
  CONFIG=configs/tiny-gpu.yaml; GBS=${GBS:-32}; PRECISION=amp_bf16; MP=DEFAULT
  BASE=(model.preset=1b model.init_device=meta model.tie_embeddings=false data.kind=synthetic data.seq_len=2048
        data.num_samples=4096 "global_train_batch_size=$GBS" loggers.console=false eval_interval=null
        save_folder=null load_path=null precision=$PRECISION)
fi
mkdir -p "$WORK"
order=0

# case PART NAME SCHEDULE KEEP AC MB FRACTIONS DURATION [EXTRA OVERRIDE]
# SCHEDULE FSDP2: no pipeline, FSDP2 over both ranks at the same global batch.
case_run() {
  local part=$1 name=$2 sched=$3 keep=$4 ac=$5 mb=$6 frac=$7 dur=$8 extra=${9:-}
  local dir="$WORK/$part/$name"
  local pc="parallelism_config={fsdp2: {mixed_precision: $MP, activation_checkpointing: $ac}, pipeline: {stages: 2, schedule: $sched, keep_graph_after_input_grad: $keep}}"
  [ "$sched" = "FSDP2" ] && pc="parallelism_config={fsdp2: {mixed_precision: $MP, activation_checkpointing: $ac}}"
  rm -rf "$dir"; mkdir -p "$dir"
  order=$((order + 1))
  local cb="callbacks.auto_microbatching.log_attempts=true"
  [ "$frac" != "none" ] && [ -z "${CPU_DRY:-}" ] && cb="callbacks.auto_microbatching.memory_fraction={$frac}"
  EXTRA=()  # the CPU stand-in's memory caps stay tight for the searches, roomy for fixed sizes
  [ -n "${CPU_DRY:-}" ] && [ "$frac" = "none" ] && EXTRA=("callbacks.memory_cap.limit_bytes={0: 2000000000, 1: 2000000000}")
  # A fixed size leaves AutoMicrobatching idle (no memory_fraction): the probe sets the same fraction.
  local pf=""; [ "$frac" != "none" ] && pf="$frac"
  local t0=$(date +%s)
  PROBE_FRACTION="$pf" PROBE_DIR="$dir/probe" timeout -k 15 "$RUN_S" python3 -m composer.cli.launcher -n 2 benchmarks/gpu_pipeline.py probe \
    $CONFIG run_name="pp-$name" run_dir="$dir/run" "${BASE[@]}" max_duration="$dur" \
    device_train_microbatch_size="$mb" "$pc" "$cb" "${EXTRA[@]}" ${extra:+"$extra"} > "$dir/console.log" 2>&1
  local rc=$?
  echo $rc > "$dir/rc"
  local wall=$(( $(date +%s) - t0 ))
  printf '{"order": %d, "schedule": "%s", "keep_graph": %s, "ac": %s, "mb": "%s", "fractions": "%s", "duration": "%s", "extra": "%s", "wall_s": %d}\n' \
    $order "$sched" "$keep" "$ac" "$mb" "$frac" "$dur" "${extra//\"/\\\"}" $wall > "$dir/meta.json"
  echo "-- $part/$name: rc $rc in ${wall}s; $(grep -h '\[automicro\] \(done\|microbatch size found\|fixed\)' "$dir/console.log" | tr '\n' ' ' | cut -c1-300)"
  if [ $rc -ne 0 ]; then grep -v Warning "$dir/console.log" | grep -B2 -A25 "Traceback" | head -60; fi
  # a killed launcher can leave ranks behind: show what still holds a GPU
  [ -z "${CPU_DRY:-}" ] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | head -4
}

finish_part() {
  python3 benchmarks/gpu_pipeline.py parse "$WORK" "$1"
  cp "$WORK/pipeline_$1.json" "$WORK/pipeline_$1_table.txt" "$OUT/"
}

start=$(date +%s)
for part in ${PARTS:-nohang throughput memory}; do
  case $part in
    nohang)
      # name sched frac (one tight stage; 141 GB H200)
      sep=,; [[ "${NOHANG_SPECS:-}" == *";"* ]] && sep=";"  # ';' between specs when an override holds commas
      IFS=$sep read -ra specs <<< "${NOHANG_SPECS:-zb-r0-015 ZeroBubble 0:0.15,1f1b-r1-020 1F1B 1:0.20,zb-r1-025 ZeroBubble 1:0.25,1f1b-r0-030 1F1B 0:0.30,zb-r0-035 ZeroBubble 0:0.35,1f1b-r0-017 1F1B 0:0.17}"
      for spec in "${specs[@]}"; do
        set -- $spec
        case_run nohang "$1" "$2" false false auto "$3" "${NOHANG_DUR:-8ba}" "${4:-}"
      done
      finish_part nohang ;;
    throughput)
      # TP_SPECS: "name schedule microbatch [override]", comma-separated, run in this order (repeat a
      # name-suffixed pair to interleave); microbatch "found" = the size the first auto case found.
      FRAC=${TP_FRAC:-0:0.20}; DUR=${TP_DUR:-14ba}; S=${TP_SCHED:-1F1B}
      sep=,; [[ "${TP_SPECS:-}" == *";"* ]] && sep=";"
      IFS=$sep read -ra specs <<< "${TP_SPECS:-auto $S auto,fixed-half $S half,fixed-found $S found,fixed-double $S double}"
      found=""
      for spec in "${specs[@]}"; do
        set -- $spec
        mb=$3
        if [ "$mb" != "auto" ] && ! [[ "$mb" =~ ^[0-9]+$ ]]; then
          [ -z "$found" ] && { echo "skip $1: no size found yet"; continue; }
          case $mb in found) mb=$found ;; half) mb=$((found / 2)) ;; double) mb=$((found * 2)) ;; esac
          { [ "$mb" -lt 1 ] || [ "$mb" -gt $((GBS / 2)) ]; } && { echo "skip $1: size $mb"; continue; }
        fi
        case_run throughput "$1" "$2" false false "$mb" "$FRAC" "$DUR" "${4:-}"
        if [ -z "$found" ] && [ "$3" = "auto" ] && [ "$2" != "FSDP2" ]; then
          found=$(python3 benchmarks/gpu_pipeline.py found "$WORK/throughput/$1"); echo "found size: ${found:-none}"
        fi
      done
      finish_part throughput ;;
    memory)
      MB=${MEM_MB:-4}
      for sched in 1F1B ZeroBubble; do for keep in false true; do for ac in false true; do
        case_run memory "$sched-keep_$keep-ac_$ac" "$sched" "$keep" "$ac" "$MB" none "${MEM_DUR:-4ba}"
      done; done; done
      finish_part memory ;;
  esac
  echo "== $part done at $(( $(date +%s) - start )) s"
done
PARTS=${PARTS:-nohang throughput memory}
tar czf "$OUT/logs_${PARTS// /_}.tar.gz" -C "$WORK" $(cd "$WORK" && ls -d */ 2>/dev/null) 2>/dev/null
echo "gpu_pipeline: $(( $(date +%s) - start )) s"
for part in ${PARTS:-nohang throughput memory}; do echo "== $part"; cat "$OUT/pipeline_${part}_table.txt" 2>/dev/null; done
