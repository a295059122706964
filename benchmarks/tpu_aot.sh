#!/usr/bin/env bash
# benchmarks/tpu_aot.py with the libtpu its compile needs: the wheel pinned by the installed jax's
# `tpu` extra, downloaded once from PyPI into .libtpu-aot/ (git-ignored, ~140 MB) and unpacked
# there; then `.venv/bin/python benchmarks/tpu_aot.py "$@"` with TPU_LIBRARY_PATH set (`tpu_aot.sh
# decode ...`: benchmarks/tpu_aot_decode.py, the decoding engine's programs; a first argument that
# names a .py file runs that script: `bash benchmarks/tpu_aot.sh benchmarks/tpu_init.py --aot
# qwen3-tiny`). No chip needed: the program is compiled for one TPU v5e on this machine's CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
dir=.libtpu-aot
pin=$("$PY" - <<'PY'
import importlib.metadata as md, re
for req in md.requires("jax") or []:
  if "libtpu" in req and "tpu" in req.split(";", 1)[-1]:
    print(re.sub(r"\s*;.*", "", req).replace(" ", ""))
    break
PY
)
[ -n "$pin" ] || { echo "tpu_aot.sh: the installed jax names no libtpu in its tpu extra" >&2; exit 3; }
if [ ! -f "$dir/$pin/libtpu/libtpu.so" ]; then
  mkdir -p "$dir/$pin"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$dir/$pin" "$pin" >&2 \
    || { echo "tpu_aot.sh: could not download $pin from the package index" >&2; exit 3; }
  "$PY" - "$dir/$pin" <<'PY'
import glob, sys, zipfile
whl = glob.glob(f"{sys.argv[1]}/libtpu-*.whl")[0]
zipfile.ZipFile(whl).extractall(sys.argv[1])
PY
  rm -f "$dir/$pin"/libtpu-*.whl
fi
export TPU_LIBRARY_PATH=$PWD/$dir/$pin/libtpu/libtpu.so
script=benchmarks/tpu_aot.py
if [ "${1:-}" = decode ]; then script=benchmarks/tpu_aot_decode.py; shift
elif [ $# -gt 0 ] && [[ "$1" == *.py ]]; then script=$1; shift; fi
exec "$PY" "$script" "$@"
