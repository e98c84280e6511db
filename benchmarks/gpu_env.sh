# Sourced by a hand-written device-tool command (`benchmarks/run.py --install` does the same for its
# suites): the shared set-up of a GPU call.
# Keeps NVLink multicast off (shared hosts: see the device tool's KINDS.md), installs the carried
# wheels (`.whl`, scripts/gpu_wheelhouse.sh) ahead of the image's packages, and writes the GPUs and
# versions under $OUT. WHL names the wheel folder when it is not ./.whl.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export WANDB_MODE=offline PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, composer; print('torch', torch.__version__, 'composer', composer.__version__)" | tee "$OUT/versions.txt"
