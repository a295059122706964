#!/usr/bin/env bash
# Creates .venv with python3, installs the pinned requirements (CPU by default) and the MaxText
# package itself, editable (pyproject.toml; `from MaxText import ...` works from any directory).
# The installs run through uv (pinned: UV_VERSION, put in .venv/uv-<version> by the venv's pip, not
# among the venv's packages), which downloads and unpacks in parallel, with the package sources of
# pip's configuration (setup_uv.py): the same packages as pip would install. When uv cannot be had,
# or an install with it fails, setup.sh says so and installs with pip. (--gpu's plugin: with pip.)
#   bash setup.sh            CPU-only JAX
#   bash setup.sh --gpu      adds the CUDA 12 plugin for NVIDIA hosts
#   bash setup.sh --tpu      TPU VMs: jax's pinned libtpu (jax[tpu]); where the host's Python already
#                            has libtpu (a provided image), .venv sees the host's packages instead
# It prints one line before installing (how many packages, the size, how long it usually takes) and
# one when done. Idempotent: when requirements.txt and pyproject.toml have not changed since the last
# successful install, it prints nothing and returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")"
GPU=0
TPU=0
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    --tpu) TPU=1 ;;
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (known: --gpu, --tpu)" >&2; exit 2 ;;
  esac
done
if [ "$GPU" = 1 ] && [ "$TPU" = 1 ]; then
  echo "setup.sh: --gpu and --tpu exclude each other" >&2; exit 2
fi
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "setup.sh: $PY is $("$PY" --version 2>&1); Python >= 3.11 is required" >&2; exit 1
fi
# --tpu on a host whose Python already has libtpu (an image that provides jax for its chip): the
# venv sees the host's packages, so that libtpu is the one jax loads; else jax[tpu]'s pin below
HOST_LIBTPU=0
if [ "$TPU" = 1 ] && "$PY" -c 'import libtpu' 2> /dev/null; then
  HOST_LIBTPU=1
fi
if [ ! -x .venv/bin/python ]; then
  if [ "$HOST_LIBTPU" = 1 ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
stamp=.venv/.requirements.sha256
want="$( (cat requirements.txt requirements-nodeps.txt pyproject.toml; echo "gpu=$GPU tpu=$TPU") \
  | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
n_pkgs=$(cat requirements.txt requirements-nodeps.txt | grep -cv '^[[:space:]]*\(#\|$\)')
if [ -f "$stamp" ]; then
  echo "setup.sh: requirements changed: updating .venv's $n_pkgs pinned packages (usually under a minute)"
else   # measured: docs/README quick start
  echo "setup.sh: installing $n_pkgs pinned packages (~3.1 GB) into .venv; usually 1-5 min, silent until done"
fi
UV_VERSION=0.13.9
uv_dir=.venv/uv-$UV_VERSION   # uv's wheel, installed beside the venv's packages, not among them
uv=$uv_dir/bin/uv
pip_install() { .venv/bin/python -m pip install -qq --disable-pip-version-check "$@"; }
uv_install() { .venv/bin/python setup_uv.py "$uv" "$@"; }
install_all() {   # with $1 (pip_install or uv_install); stops at the first install that fails
  "$1" -r requirements.txt &&
    # xpk without its dependencies: its pins conflict with ours (see requirements.txt)
    "$1" --no-deps -r requirements-nodeps.txt &&
    # this checkout, editable: no dependencies of its own (the pins above are the environment)
    "$1" --no-deps -e .
}
if ! { [ -x "$uv" ] || pip_install --upgrade --target "$uv_dir" "uv==$UV_VERSION"; }; then
  echo "setup.sh: could not install uv $UV_VERSION (above); installing with pip" >&2
  install_all pip_install
elif ! install_all uv_install; then
  echo "setup.sh: installing with uv $UV_VERSION failed (above); installing with pip" >&2
  install_all pip_install
fi
if [ "$GPU" = 1 ]; then
  jaxver=$(.venv/bin/python -c 'import jax; print(jax.__version__)')
  .venv/bin/python -m pip install -qq "jax[cuda12]==$jaxver"
fi
if [ "$TPU" = 1 ]; then
  if [ "$HOST_LIBTPU" = 1 ]; then
    echo "setup.sh: --tpu: the host's libtpu is used ($("$PY" -c 'import importlib.metadata as m; print("libtpu", m.version("libtpu"))' 2> /dev/null || echo libtpu))"
  else   # the libtpu jax's own [tpu] extra pins, for the pinned jax
    jaxver=$(.venv/bin/python -c 'import jax; print(jax.__version__)')
    .venv/bin/python -m pip install -qq "jax[tpu]==$jaxver"
  fi
fi
echo "$want" > "$stamp"
echo "setup.sh: .venv ready ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
