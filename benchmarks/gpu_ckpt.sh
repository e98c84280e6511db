#!/usr/bin/env bash
# Sharded (DCP) checkpoints on GPUs: tiny-gpu config on 2 GPUs (NCCL), auto microbatching, save at
# batch 4 with checkpoint_format=sharded, resume to batch 8, and an uninterrupted 8-batch run.
# Run on the GPU machine from the repo root (wheels installed, PYTHONPATH set): bash benchmarks/gpu_ckpt.sh OUTDIR
set -uo pipefail
O=${1:?output folder}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 WANDB_MODE=offline
L=(${PY:-python3} -m composer.cli.launcher -n 2)
common=(configs/tiny-gpu.yaml loggers.console=false ${EXTRA:-})
"${L[@]}" scripts/train.py "${common[@]}" run_dir="$O/full8" max_duration=8ba > "$O/full8.log" 2>&1; echo "full8 exit $?"
"${L[@]}" scripts/train.py "${common[@]}" run_dir="$O/first4" max_duration=4ba save_folder="$O/ck" save_interval=4ba \
  checkpoint_format=sharded > "$O/first4.log" 2>&1; echo "first4 exit $?"
ls -la "$O/ck" "$O/ck"/ep0-ba4* 2>&1 | head -20
"${L[@]}" scripts/train.py "${common[@]}" run_dir="$O/resumed" max_duration=8ba load_path="$O/ck/ep0-ba4" \
  checkpoint_format=sharded > "$O/resumed.log" 2>&1; echo "resumed exit $?"
${PY:-python3} - "$O" <<'PY'
import json, sys, os
o = sys.argv[1]
def losses(d):
    out = {}
    for line in open(os.path.join(o, d, "metrics.jsonl")):
        row = json.loads(line)
        m = row.get("metrics", row)
        if "loss/train/total" in m:
            out[row.get("step")] = m["loss/train/total"]
    return out
full, res = losses("full8"), losses("resumed")
print("uninterrupted:", {k: round(v, 5) for k, v in sorted(full.items())})
print("resumed      :", {k: round(v, 5) for k, v in sorted(res.items())})
PY
grep -h "automicro\]" "$O/resumed.log" | head -5
tail -3 "$O/resumed.log"
