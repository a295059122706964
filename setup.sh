#!/usr/bin/env bash
# Creates .venv with python3, installs the pinned requirements (CPU by default) and the MaxText
# package itself, editable (pyproject.toml; `from MaxText import ...` works from any directory).
#   bash setup.sh            CPU-only JAX
#   bash setup.sh --gpu      adds the CUDA 12 plugin for NVIDIA hosts
# Idempotent: when requirements.txt and pyproject.toml have not changed since the last successful
# install, it returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")"
GPU=0
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    -h|--help) sed -n 2,7p "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (known: --gpu)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "setup.sh: $PY is $("$PY" --version 2>&1); Python >= 3.11 is required" >&2; exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.requirements.sha256
want="$( (cat requirements.txt requirements-nodeps.txt pyproject.toml; echo "gpu=$GPU") | sha256sum \
  | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install -qq --disable-pip-version-check -r requirements.txt
# xpk without its dependencies: its pins conflict with ours (see requirements.txt)
.venv/bin/python -m pip install -qq --disable-pip-version-check --no-deps -r requirements-nodeps.txt
# this checkout, editable: no dependencies of its own (the pins above are the environment)
.venv/bin/python -m pip install -qq --disable-pip-version-check --no-deps -e .
if [ "$GPU" = 1 ]; then
  jaxver=$(.venv/bin/python -c 'import jax; print(jax.__version__)')
  .venv/bin/python -m pip install -qq "jax[cuda12]==$jaxver"
fi
echo "$want" > "$stamp"
echo "setup.sh: .venv ready ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
