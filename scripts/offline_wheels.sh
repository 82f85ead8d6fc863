#!/usr/bin/env bash
# Downloads, on a machine with a package index, the wheels that `scripts/gpu_setup.sh --offline-wheels DIR`
# installs on a GPU machine without one: this project's requirements (base, engine, triton and bench extras, as
# pyproject.toml lists them) with everything they need, as manylinux x86-64 wheels for the GPU machine's Python.
# Torch is left out (the GPU machine's own CUDA build is used, and pinned); so is nothing else.
#
#   scripts/offline_wheels.sh DIR [--python-version 3.12] [--dry-run]
#
#   DIR               where the wheels go (created); copy it to the GPU machine, then
#                     scripts/gpu_setup.sh --offline-wheels DIR
#   --python-version  the GPU machine's Python, major.minor (default 3.12)
#   --dry-run         print the pip command instead of running it
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYVER=3.12
DRY_RUN=0
DIR=""

usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "offline_wheels: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case $1 in
    --python-version) [ $# -ge 2 ] || die "--python-version needs a value"; PYVER=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) usage >&2; die "unknown option $1" ;;
    *) [ -z "$DIR" ] || die "one directory only"; DIR=$1; shift ;;
  esac
done
[ -n "$DIR" ] || { usage >&2; die "give the directory the wheels go to"; }
[[ $PYVER =~ ^3\.[0-9]+$ ]] || die "--python-version takes major.minor, e.g. 3.12"

PY=$(command -v python3) || die "python3 is needed to read pyproject.toml and run pip"
# The requirements, read from pyproject.toml (one place defines them); torch is the GPU machine's.
mapfile -t REQS < <("$PY" - "$REPO/pyproject.toml" <<'PYEOF'
import re, sys
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
for req in [*project["dependencies"], *extras["engine"], *extras["triton"], *extras["bench"]]:
    if re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower() != "torch":
        print(req)
PYEOF
)
[ "${#REQS[@]}" -gt 0 ] || die "no requirements read from pyproject.toml"

# Every manylinux tag up to glibc 2.35 (the nvidia-pytriton wheel's); pip matches each tag exactly.
PLATFORMS=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
CMD=("$PY" -m pip download --disable-pip-version-check --only-binary=:all: --python-version "$PYVER"
     --implementation cp "${PLATFORMS[@]}" --dest "$DIR" "${REQS[@]}")
printf '+'; printf ' %q' "${CMD[@]}"; printf '\n'
if [ "$DRY_RUN" = 1 ]; then
  echo "(dry run: nothing was downloaded)"
  exit 0
fi
mkdir -p "$DIR"
"${CMD[@]}"
echo "Wheels in $DIR ($(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1)). On the GPU machine:"
echo "  scripts/gpu_setup.sh --offline-wheels $DIR"
