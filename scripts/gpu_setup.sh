#!/usr/bin/env bash
# One-command set-up of the whole stack (engine, tritonserver, gateway, benchmarks) on a CUDA machine that
# already has torch: an NGC PyTorch container, or a venv with a CUDA build of torch. Idempotent.
#
#   scripts/gpu_setup.sh [--python PY] [--stub-env DIR] [--separate-stub-env] [--offline-wheels DIR]
#                        [--break-system-packages] [--dry-run]
#
#   --python PY            the interpreter that has torch (default: $PYTHON, else python3)
#   --stub-env DIR         where the Triton stubs' environment goes when one is needed (default REPO/.venv-stub)
#   --separate-stub-env    make that environment even when PY's numpy is < 2
#   --offline-wheels DIR   install from the wheels in DIR only (no package index); DIR needs the wheels of every
#                          requirement that is not installed yet, and setuptools >= 68 must be installed
#   --break-system-packages  allow installing into a distribution-managed Python outside a venv (containers)
#   --dry-run              print the commands instead of running them (the checks of PY still run)
#
# What it installs, and why (docs/PERFORMANCE.md, "Reproduce"):
#   1. this project, editable, with the `engine` and `bench` extras, into PY's environment; a constraints file
#      pins the torch (and numpy) already there, so pip never replaces the CUDA build.
#   2. nvidia-pytriton: the tritonserver binary and the python-backend stubs. It pins numpy < 2, which the stub
#      needs (with numpy 2 every output tensor comes back empty).
#      - PY has numpy < 2 (or none): the `triton` extra, and the stubs run in PY's environment.
#      - PY has numpy >= 2 (NGC images): the wheel without its dependencies (only its binaries are used), and a
#        separate stub environment: a venv of the same interpreter whose site-packages links every entry of PY's
#        site-packages except numpy, scipy, scikit-learn and ml_dtypes (built for numpy 2), with numpy < 2 and
#        ml_dtypes <= 0.5.4 (the last release that imports with numpy 1) installed there instead.
#   3. a check that the stubs' environment imports what the Triton models import, then the benchmark command.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
STUB_ENV=$REPO/.venv-stub
FORCE_STUB_ENV=0
WHEELS=""
DRY_RUN=0
BREAK_SYSTEM=0

usage() { sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_setup: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case $1 in
    --python) [ $# -ge 2 ] || die "--python needs a value"; PY=$2; shift 2 ;;
    --stub-env) [ $# -ge 2 ] || die "--stub-env needs a value"; STUB_ENV=$2; shift 2 ;;
    --separate-stub-env) FORCE_STUB_ENV=1; shift ;;
    --offline-wheels) [ $# -ge 2 ] || die "--offline-wheels needs a value"; WHEELS=$2; shift 2 ;;
    --break-system-packages) BREAK_SYSTEM=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; echo "gpu_setup: unknown option $1" >&2; exit 2 ;;
  esac
done
STUB_ENV=$(realpath -m "$STUB_ENV")  # the printed commands run from the repository root

# Every change goes through run: printed (copy-pasteable), and executed unless --dry-run.
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./:=+,@%-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
run() {
  local arg line="+"
  for arg in "$@"; do line+=" $(quote "$arg")"; done
  printf '%s\n' "$line"
  if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter '$PY' (give --python)"
PY=$(command -v "$PY")
pyq() { "$PY" -c "$1" 2>/dev/null; }

# The checks below only read PY's environment (one interpreter start: importing torch takes seconds), so they
# run in a dry run too.
mapfile -t FACTS < <("$PY" - <<'PYEOF'
import os, sys, sysconfig
print(f"{sys.version_info[0]}.{sys.version_info[1]}")
print(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)
# pip refuses a distribution-managed Python outside a venv (PEP 668)
print(int(sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))
try:
    import numpy
    print(numpy.__version__)
except ImportError:
    print("")
try:
    import importlib.metadata, torch
    print(importlib.metadata.version("torch"))  # the installed distribution's version (the constraint pins it)
    print(torch.cuda.is_available())
except ImportError:
    print("")
    print("")
PYEOF
)
[ "${#FACTS[@]}" = 6 ] || die "$PY did not start"
PYVER=${FACTS[0]} SHARED=${FACTS[1]} MANAGED=${FACTS[2]} NUMPY=${FACTS[3]} TORCH=${FACTS[4]} CUDA=${FACTS[5]}
if [ -z "$TORCH" ]; then
  [ "$DRY_RUN" = 1 ] || die "$PY cannot import torch: install a CUDA build of torch first (or use an NGC PyTorch image)"
  echo "gpu_setup: warning: $PY cannot import torch (a real run stops here)" >&2
else
  echo "torch $TORCH, CUDA available: $CUDA"
fi
echo "python $PYVER ($PY), numpy ${NUMPY:-not installed}"
[ "$SHARED" = 1 ] || echo "gpu_setup: warning: $PY is not a shared-library build; the Triton python stub links libpython$PYVER.so" >&2
GLIBC=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}') || GLIBC=""
if [ -n "$GLIBC" ] && [ "$(printf '%s\n2.35\n' "$GLIBC" | sort -V | head -1)" != 2.35 ]; then
  echo "gpu_setup: warning: glibc $GLIBC; the nvidia-pytriton wheel (tritonserver) needs glibc >= 2.35" >&2
fi

PIP=("$PY" -m pip install --disable-pip-version-check)
if [ "$MANAGED" = 1 ]; then
  [ "$BREAK_SYSTEM" = 1 ] || [ "$DRY_RUN" = 1 ] || die "$PY is managed by the distribution: use a venv (python3 -m venv --system-site-packages) or pass --break-system-packages (fine in a container)"
  [ "$BREAK_SYSTEM" = 0 ] || PIP+=(--break-system-packages)
fi
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || [ "$DRY_RUN" = 1 ] || die "--offline-wheels: $WHEELS is not a directory"
  WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")
  PIP+=(--no-index --find-links "$WHEELS")
fi

# Keep what the machine came with: the CUDA torch and (when present) its numpy.
CONSTRAINTS=$(mktemp "${TMPDIR:-/tmp}/gpu_setup_constraints.XXXXXX")
trap 'rm -f "$CONSTRAINTS"' EXIT
[ -z "$TORCH" ] || echo "torch==$TORCH" >>"$CONSTRAINTS"

NUMPY_MAJOR=${NUMPY%%.*}
if [ -n "$NUMPY" ] && [ "$NUMPY_MAJOR" -ge 2 ]; then
  SEPARATE=1
  echo "numpy==$NUMPY" >>"$CONSTRAINTS"
else
  SEPARATE=$FORCE_STUB_ENV
fi

echo "+ constraints ($CONSTRAINTS): $(tr '\n' ' ' <"$CONSTRAINTS")"

# 1 + 2: the project and the tritonserver binary into PY's environment.
EDITABLE=(-e "${REPO}[engine,bench]")
if [ "$SEPARATE" = 0 ]; then
  EDITABLE=(-e "${REPO}[engine,triton,bench]")
fi
OFFLINE_BUILD=()
[ -z "$WHEELS" ] || OFFLINE_BUILD=(--no-build-isolation)  # no index to fetch the build backend from
run "${PIP[@]}" -c "$CONSTRAINTS" "${OFFLINE_BUILD[@]}" "${EDITABLE[@]}"
if [ "$SEPARATE" = 1 ]; then
  run "${PIP[@]}" --no-deps "nvidia-pytriton>=0.7"
fi

# 3: the stubs' environment.
STUB_PY=$PY
if [ "$SEPARATE" = 1 ]; then
  SITE=$STUB_ENV/lib/python$PYVER/site-packages
  run "$PY" -m venv --without-pip --clear "$STUB_ENV"
  # Link PY's site-packages entries one by one (a .pth naming them would put PY's numpy 2 on the path too).
  mapfile -t SITE_DIRS < <(pyq 'import site, sysconfig
dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
seen = set()
for d in dirs:
    if d not in seen:
        seen.add(d)
        print(d)')
  HIDDEN='^(numpy|scipy|sklearn|scikit_learn|scikit-learn|ml_dtypes)([-_.].*)?$'
  LINKS=0
  for dir in "${SITE_DIRS[@]}"; do
    [ -d "$dir" ] || continue
    for entry in "$dir"/*; do
      name=$(basename "$entry")
      [[ $name =~ $HIDDEN ]] && continue
      [ -e "$SITE/$name" ] && continue  # the first site dir that has a name wins, as on sys.path
      LINKS=$((LINKS + 1))
      if [ "$DRY_RUN" = 0 ]; then ln -s "$entry" "$SITE/$name"; fi
    done
  done
  echo "+ linked $LINKS entries of ${SITE_DIRS[*]} into $SITE (hidden: numpy, scipy, scikit-learn, ml_dtypes)"
  run "${PIP[@]}" --no-deps --upgrade --target "$SITE" "numpy<2" "ml_dtypes<=0.5.4"
  STUB_PY=$STUB_ENV/bin/python3
fi

# What the Triton models import, in the environment the stubs will use.
run "$STUB_PY" -c 'import numpy, torch, transformers, onnxruntime, safetensors, soundfile, inflect
import cosyvoice2, speech_serving, triton_repo.internal_io
assert int(numpy.__version__.split(".")[0]) < 2, f"the Triton stub needs numpy < 2, found {numpy.__version__}"
print(f"stub environment: numpy {numpy.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")'
# pytriton itself is not imported (its own dependencies may be absent): only its binary is used.
run "$PY" -c 'import importlib.util, pathlib
import tritonclient.grpc, fastapi, uvicorn, av, httpx, gateway, ttsbench, stackbench.launch
server = pathlib.Path(importlib.util.find_spec("pytriton").submodule_search_locations[0]) / "tritonserver/bin/tritonserver"
assert server.exists(), f"no tritonserver binary at {server}"
print(f"tritonserver {server}; gateway, tts-bench and stack-bench importable")'

STUB_ARG=""
[ "$SEPARATE" = 0 ] || STUB_ARG=" --stub-env $STUB_ENV"
[ "$DRY_RUN" = 0 ] || echo "(dry run: nothing was installed or created)"
cat <<EOF

Set-up done. The whole-stack benchmark (released-size random weights are written on the first run):

  cd $REPO
  $PY -m stackbench$STUB_ARG --repeat 3
  $PY -m stackbench$STUB_ARG --repeat 3 --render-arg first_hop=15
  $PY -m stackbench$STUB_ARG --repeat 3 --token2wav dit   # the DiT token2wav
  $PY -m stackbench$STUB_ARG --spark --repeat 3 --only triton-stream,triton-offline --stream-levels 1,4,16 --offline-levels 1,4   # Spark-TTS

Each run prints and keeps its results in var/stackbench/results/<UTC time>-<settings>/ (summary.md first).

The soak through the gateway (64 streams; start-up included, it ends within 590 s, the run shortened to fit):

  $PY -m tests.reliability.soak --full-size --device cuda$STUB_ARG --concurrency 64 --minutes 10 --wall-budget 590

It prints a table and keeps its report in var/soak/soak-<UTC time>.json; it exits non-zero if anything was lost.
EOF
