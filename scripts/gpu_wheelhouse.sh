#!/usr/bin/env bash
# Build .whl/: the wheels the lent GPU machines (Python 3.12, torch 2.11, no
# network) lack for running automicro with Composer 0.32.1, omegaconf and wandb.
#
#   bash scripts/gpu_wheelhouse.sh          # from anywhere; works in the repo root
#
# On the device machine (name `.whl` in the run's `carry`), start the command with:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# --target with PYTHONPATH puts the carried wheels ahead of the image's own
# site-packages, so the few carried packages that the image also holds (see
# SHADOWED below) are deliberately shadowed by the carried versions; everything
# else comes from the image.
#
# What is carried and why (pins and exceptions: see PINS below):
#   * mosaicml 0.32.1 itself (installed with --no-deps: its torch<2.7.1 and
#     torchvision<0.22.1 pins are ignored; the image's torch 2.11 is used).
#   * its runtime requirements missing from the image, mosaicml-cli's too
#     (composer.loggers imports mcli at import time), wandb's and omegaconf's
#     (omegaconf 2.4 vendors antlr4, so no antlr4-python3-runtime).
#   * liger-kernel 0.8.5 (pure python, Triton kernels; needs the image's torch
#     and triton): the fused vocabulary head's CUDA backend (automicro.engine.head).
#   * torchmetrics 1.7.4 (pure python): mosaicml pins torchmetrics<1.7.5 and the
#     image has 1.9.0; the carried copy matches the CPU test environment.
#     (Composer also trained fine with the image's 1.9.0 in a device check.)
# Not carried on purpose: the image's numpy 2.5.2 and pillow 12.3.0 (mosaicml
# pins numpy<2.3, pillow<12), torch 2.11 and torchvision 0.26. In a device check
# on an H200 (2026-11-21) composer, mcli, omegaconf and wandb imported from this
# wheelhouse and a Trainer.fit ran on the GPU (amp_bf16, torchmetrics metric,
# offline WandBLogger, checkpoints). See ACCEPTED_PIN_VIOLATIONS below.
#
# The script re-creates .whl/ from scratch, makes sure /.whl/ is git-excluded,
# checks each wheel's tags (cp312 / py3, manylinux x86_64 or any), that there is
# exactly one version of each package, and that the Requires-Dist closure of the
# carried wheels is covered by the carried wheels plus the image's packages. It
# prints the total size and fails above 60 MiB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUTDIR=.whl
MAX_MIB=60

# name==version, one per line. Versions are those pip resolved for the CPU test
# environment (torch 2.7) where they fit, all available for CPython 3.12 on
# manylinux x86_64. Exceptions:
#   * wandb 0.28.2, not 0.31.0: composer 0.32.1's WandBLogger calls
#     wandb.run.get_url(), which wandb removed in 0.29.0 (AttributeError at
#     Trainer init). 0.28.2 is the newest wandb that still has it; it needs
#     sentry-sdk and opentelemetry-api (not cwevals / the otlp exporter).
#   * tabulate 0.9.0, rich 13.9.4, packaging 25.0 (pure python, small): the
#     image's 0.10.0 / 15.0.0 / 26.3 break mosaicml's and mosaicml-cli's pins
#     (tabulate==0.9.0, rich<14, packaging<25.1), so the pinned ones are carried.
PINS="
liger-kernel==0.8.5
mosaicml==0.32.1
torchmetrics==1.7.4
torch-optimizer==0.3.0
pytorch-ranger==0.1.1
coolname==2.2.0
importlib-metadata==8.9.0
tabulate==0.9.0
packaging==25.0
mosaicml-cli==0.7.5
rich==13.9.4
argcomplete==3.7.2
arrow==1.4.0
tzdata==2026.6
backoff==2.2.1
gql==3.5.3
graphql-core==3.2.6
websockets==11.0.3
prompt-toolkit==3.0.36
wcwidth==0.9.4
questionary==2.0.1
ruamel.yaml==0.19.1
termcolor==3.3.0
validators==0.36.0
omegaconf==2.4.0
wandb==0.28.2
sentry-sdk==2.75.0
opentelemetry-api==1.45.2
platformdirs==4.14.5
pydantic==2.14.3
pydantic-core==2.50.4
annotated-types==0.8.0
typing-inspection==0.4.5
"

# The GPU machines' image ('cuda'): python3 -m pip list --format=freeze there,
# read on an nvidia-h200 machine, 2026-11-21. Requirements on these need not be
# carried; their versions are checked against the carried wheels' pins.
IMAGE="
absl-py==2.5.0 accelerate==1.15.0 aiofiles==25.1.0 aiohappyeyeballs==2.7.1
aiohttp==3.14.3 aiosignal==1.4.0 annotated-doc==0.0.5 anyio==4.15.1
attrs==26.1.0 botorch==0.18.1 build==1.6.1 certifi==2026.7.22
charset-normalizer==3.5.1 chex==0.1.92 click==8.5.0 cloudpickle==3.1.2
cmake==4.4.3 colorama==0.4.6 contourpy==1.4.0 coverage==7.16.2
cuda-bindings==13.3.1 cuda-core==1.2.0 cuda-pathfinder==1.8.1
cuda-toolkit==13.0.2 cupy-cuda13x==14.2.0 cycler==0.12.1 Cython==3.3.0
diffrax==0.7.2 e3nn==0.6.0 einops==0.8.2 equinox==0.13.8 etils==1.14.0
execnet==2.1.2 filelock==3.32.5 flatbuffers==25.12.19 flax==0.12.10
fonttools==4.66.1 formulaic==1.2.2 frozenlist==1.8.0 fsspec==2026.7.0
gpytorch==1.15.2 grpcio==1.84.0 h11==0.16.0 h5py==3.16.0 hf-xet==1.6.0
httpcore==1.0.9 httpx==0.28.1 huggingface_hub==1.33.0 humanize==4.16.0
hypothesis==6.168.3 idna==3.19 ImageIO==2.38.0 iniconfig==2.3.0
interface_meta==2.0.1 jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2
jax==0.11.2 jaxlib==0.11.2 jaxtyping==0.3.11 Jinja2==3.1.6 joblib==1.6.0
kiwisolver==1.5.1 lazy-loader==0.6 lightning-utilities==0.15.3
lightning==2.6.6 linear_operator==0.6.1 lineax==0.1.1 llvmlite==0.50.0
lxml==6.1.3 markdown-it-py==4.2.0 Markdown==3.11 MarkupSafe==3.0.3
matplotlib==3.11.2 mdurl==0.1.2 meson==1.12.1 ml_dtypes==0.6.0 mpi4py==4.1.2
mpmath==1.3.0 msgpack==1.2.3 multidict==6.9.1 multipledispatch==1.0.0
mypy_extensions==1.1.0 nanobind==3.1.0 narwhals==2.26.0 networkx==3.6.1
ninja==1.13.2 numba-cuda==0.30.4 numba==0.68.0 numpy==2.5.2 numpyro==0.21.0
nvidia-cublas==13.1.0.3 nvidia-cuda-cupti==13.0.85 nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96 nvidia-cudnn-cu13==9.19.0.56
nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66 nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.0 nvidia-ml-py==13.610.43 nvidia-nccl-cu13==2.28.9
nvidia-nvjitlink==13.0.88 nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx==13.0.85
onnx-ir==1.0.0 onnx==1.23.1 onnxruntime==1.30.0 onnxscript==0.7.2
opencv-python-headless==5.0.0.93 opt-einsum-fx==0.1.4 optax==0.2.8
optimistix==0.1.0 opt_einsum==3.4.0 orbax-checkpoint==0.12.4 packaging==26.3
pandas==3.0.6 pathspec==1.1.1 patsy==1.0.3 peft==0.21.0 pillow==12.3.0
pip==24.0 pluggy==1.6.0 portalocker==4.4.0 prometheus_client==0.26.0
propcache==0.5.4 protobuf==7.36.2 psutil==7.2.2 py-cpuinfo==9.0.0
pyarrow==25.0.1 pybind11==3.1.0 Pygments==2.21.0 pyparsing==3.3.3
pyproject_hooks==1.3.3 pyre-extensions==0.0.32 pytest-benchmark==5.2.3
pytest-cov==7.1.0 pytest-mock==3.16.0 pytest-timeout==2.5.0
pytest-xdist==3.8.0 pytest==9.1.1 python-dateutil==2.9.0.post0
pytorch-lightning==2.6.6 PyYAML==6.0.3 regex==2026.9.3 requests==2.34.2
rich==15.0.0 sacrebleu==2.6.0 safetensors==0.8.0 scikit-image==0.26.0
scikit-learn==1.9.1 scikit_build_core==1.1.0 scipy==1.18.1 seaborn==0.13.2
sentence-transformers==6.0.1 sentencepiece==0.2.2 setuptools==81.0.0
shellingham==1.5.4 simplejson==4.1.2 six==1.17.0 sortedcontainers==2.4.0
statsmodels==0.15.0 sympy==1.14.0 tabulate==0.10.0
tensorboard-data-server==0.7.2 tensorboard==2.21.0 tensorstore==0.1.85
threadpoolctl==3.7.0 tifffile==2026.9.20 tiktoken==0.14.0 timm==1.0.29
tokenizers==0.23.2 toolz==1.1.0 torch-geometric==2.8.0.post1 torch==2.11.0
torchaudio==2.11.0 torchdiffeq==0.2.5 torchmetrics==1.9.0 torchvision==0.26.0
tqdm==4.70.1 transformers==5.17.0 treescope==0.1.10 triton==3.6.0
typer==0.27.2 typing-inspect==0.9.0 typing_extensions==4.16.0 urllib3==2.7.0
uvloop==0.23.0 wadler_lindig==0.1.7 Werkzeug==3.1.9 wheel==0.48.0 wrapt==2.5.0
xarray==2026.9.0 xxhash==4.0.1 yarl==1.25.1 zipp==4.1.0
"

# 1. .whl/ must stay out of git.
if [ -d .git ]; then
  EXCLUDE=.git/info/exclude
elif [ -f .git ]; then # worktree: info/exclude lives in the common git dir
  GITDIR="$(sed -n 's/^gitdir: //p' .git)"
  case "$GITDIR" in /*) ;; *) GITDIR="$ROOT/$GITDIR" ;; esac
  if [ -f "$GITDIR/commondir" ]; then
    C="$(cat "$GITDIR/commondir")"
    case "$C" in /*) GITDIR="$C" ;; *) GITDIR="$GITDIR/$C" ;; esac
  fi
  EXCLUDE="$GITDIR/info/exclude"
else
  echo "error: $ROOT is not a git checkout" >&2
  exit 1
fi
mkdir -p "$(dirname "$EXCLUDE")"
touch "$EXCLUDE"
grep -qxF '/.whl/' "$EXCLUDE" || echo '/.whl/' >>"$EXCLUDE"

# 2. Fresh download.
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
BASE_PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# shellcheck disable=SC2086
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp $BASE_PLATFORMS -d "$OUTDIR" $PINS
# Only wheels belong here (the device installs .whl/*.whl).
if find "$OUTDIR" -mindepth 1 ! -name '*.whl' | grep -q .; then
  echo "error: non-wheel files in $OUTDIR:" >&2
  find "$OUTDIR" -mindepth 1 ! -name '*.whl' >&2
  exit 1
fi

# 3. Checks: tags, one version each, Requires-Dist closure.
PINS="$PINS" IMAGE="$IMAGE" "$PY" - "$OUTDIR" <<'EOF'
import os, re, sys, zipfile
from email.parser import HeaderParser

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

outdir = sys.argv[1]
errors = []

# Requirements known to be violated on the device on purpose: mosaicml is
# installed with --no-deps on the image's torch 2.11; the image's newer versions
# of these are used (composer imported and trained with them there).
ACCEPTED_PIN_VIOLATIONS = {
    ("mosaicml", "torch"),
    ("mosaicml", "torchvision"),
    ("mosaicml", "numpy"),
    ("mosaicml", "pillow"),
}

# Target interpreter: CPython 3.12 on Linux x86_64.
env = {
    "implementation_name": "cpython", "implementation_version": "3.12.3",
    "os_name": "posix", "platform_machine": "x86_64", "platform_release": "",
    "platform_system": "Linux", "platform_version": "",
    "python_full_version": "3.12.3", "platform_python_implementation": "CPython",
    "python_version": "3.12", "sys_platform": "linux", "extra": "",
}

pins = {}
for line in os.environ["PINS"].split():
    n, v = line.split("==")
    pins[canonicalize_name(n)] = Version(v)
image = {}
for line in os.environ["IMAGE"].split():
    n, v = line.split("==")
    image[canonicalize_name(n)] = Version(v)

plat_re = re.compile(r"^(any|manylinux(1|2010|2014)_x86_64|manylinux_2_(\d+)_x86_64)$")
MAX_GLIBC = 35  # the image's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39)


def usable(t):
    """Whether wheel tag t installs on CPython 3.12, manylinux x86_64."""
    if t.interpreter in ("py3", "py312", "cp312") and t.abi in ("none", "cp312"):
        pass
    elif t.abi == "abi3" and re.fullmatch(r"cp3(\d+)", t.interpreter):
        if int(t.interpreter[3:]) > 12:
            return False
    else:
        return False
    m = plat_re.match(t.platform)
    return bool(m) and (m.group(3) is None or int(m.group(3)) <= MAX_GLIBC)


carried = {}  # name -> (version, path)
for fn in sorted(os.listdir(outdir)):
    path = os.path.join(outdir, fn)
    name, ver, _build, tags = parse_wheel_filename(fn)
    if not any(usable(t) for t in tags):
        errors.append(f"{fn}: no tag usable by CPython 3.12 on manylinux x86_64 (glibc<=2.{MAX_GLIBC})")
    if name in carried:
        errors.append(f"two versions of {name}: {carried[name][0]} and {ver}")
    carried[name] = (ver, path)
    if name in pins and pins[name] != ver:
        errors.append(f"{fn}: expected {name}=={pins[name]}")

for n in pins:
    if n not in carried:
        errors.append(f"pinned {n}=={pins[n]} missing from {outdir}")
for n in ("mosaicml", "omegaconf", "wandb"):
    if n not in carried:
        errors.append(f"{n} not carried")

def requires(name, extras=()):
    with zipfile.ZipFile(carried[name][1]) as z:
        meta = next(m for m in z.namelist() if m.endswith(".dist-info/METADATA"))
        msg = HeaderParser().parsestr(z.read(meta).decode())
    out = []
    for r in msg.get_all("Requires-Dist") or []:
        req = Requirement(r)
        for e in ("",) + tuple(extras):
            if req.marker is None or req.marker.evaluate(dict(env, extra=e)):
                out.append(req)
                break
    return out

missing, shadowed, warnings = set(), set(), []
seen, todo = set(), [(n, ()) for n in carried]
while todo:
    name, extras = todo.pop()
    if (name, extras) in seen:
        continue
    seen.add((name, extras))
    for req in requires(name, extras):
        dep = canonicalize_name(req.name)
        if dep in carried:
            if req.extras:
                todo.append((dep, tuple(sorted(req.extras))))
            have, where = carried[dep][0], "carried"
        elif dep in image:
            have, where = image[dep], "image"
        else:
            missing.add(f"{dep} (needed by {name}: {req})")
            continue
        if req.specifier.contains(have, prereleases=True):
            continue
        msg = f"{name} requires {req}, {where} has {dep} {have}"
        if (name, dep) in ACCEPTED_PIN_VIOLATIONS:
            warnings.append(msg + " (accepted)")
        else:
            errors.append(msg)

for n in sorted(carried):
    if n in image:
        shadowed.add(n)
for m in sorted(missing):
    errors.append(f"requirement neither carried nor in the image: {m}")

print(f"{len(carried)} wheels:")
for n in sorted(carried):
    print(f"  {os.path.basename(carried[n][1])}  ({os.path.getsize(carried[n][1]) / 2**20:.2f} MiB)")
print("SHADOWED (carried and also in the image):", ", ".join(sorted(shadowed)) or "none")
for w in warnings:
    print("warning:", w)
for e in errors:
    print("error:", e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF

# 4. Size.
BYTES=$(du -cb "$OUTDIR"/*.whl | tail -n1 | cut -f1)
MIB=$(awk -v b="$BYTES" 'BEGIN { printf "%.2f", b / 1048576 }')
echo "total: $MIB MiB in $(ls "$OUTDIR"/*.whl | wc -l) wheels ($OUTDIR/)"
if [ "$BYTES" -gt $((MAX_MIB * 1048576)) ]; then
  echo "error: $OUTDIR is over $MAX_MIB MiB" >&2
  exit 1
fi
