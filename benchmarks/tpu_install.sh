# Installs what benchmarks/tpu_prepare.sh put in .whl-tpu/, on the TPU machine (no network, an
# ordinary user; its own jax/jaxlib/libtpu, numpy, scipy stay in use). Source it at the start of
# every command there (from the repository root), or run it with bash and export the paths it
# prints yourself:
#
#   source benchmarks/tpu_install.sh && python3 train.py configs/base.yml ...
#
#   - ours: .whl-tpu/*.whl into $TPU_SITE (default /tmp/site), appended to PYTHONPATH (no jax
#     among them, so the machine's JAX is the one imported);
#   - the MaxText arm (when .whl-tpu/maxtext/ is there): into $TPU_SITE_MAXTEXT (default
#     /tmp/site-maxtext), then benchmarks/maxtext_shims.py makes it run on Python 3.11 + jax 0.10.2.
#     Its path, exported as MAXTEXT_ARM_PYTHONPATH (the machine's PYTHONPATH, where its jax is, then
#     $TPU_SITE_MAXTEXT:$TPU_SITE), is what
#     benchmarks/maxtext_arm.py runs MaxText with; ours never sees it.
# About 10 s. PYTHON=... picks the interpreter (default python3). Returns (or exits) non-zero when
# something is missing.
_tpu_install() {
  local py=${PYTHON:-python3} root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  # the machine's own PYTHONPATH names the folder of its jax/jaxlib/libtpu: both paths below keep
  # it first (replacing it leaves a process without jax)
  local machine=${TPU_MACHINE_PYTHONPATH:-${PYTHONPATH:-}}
  export TPU_MACHINE_PYTHONPATH=$machine
  TPU_SITE=${TPU_SITE:-/tmp/site}
  TPU_SITE_MAXTEXT=${TPU_SITE_MAXTEXT:-/tmp/site-maxtext}
  if ! compgen -G "$root/.whl-tpu/*.whl" > /dev/null; then
    echo "tpu_install.sh: no wheels in $root/.whl-tpu (run 'bash benchmarks/tpu_prepare.sh' where PyPI is reachable, and carry .whl-tpu along)" >&2
    return 3
  fi
  # bytecode compiled at install (as an installed environment has it), and the repository's too:
  # else each process compiles every module it imports (~3 s of a start-up on the chip)
  local pip=(env PIP_CONFIG_FILE=/dev/null "$py" -m pip install --isolated -q --no-index --no-deps
             --no-cache-dir --upgrade --disable-pip-version-check)
  "$py" -m compileall -q "$root/MaxText" "$root/benchmarks" > /dev/null 2>&1 || true
  "${pip[@]}" --target "$TPU_SITE" "$root"/.whl-tpu/*.whl || return 1
  case ":${PYTHONPATH:-}:" in
    *":$TPU_SITE:"*) ;;
    *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$TPU_SITE ;;
  esac
  echo "[tpu_install] ours: $(ls "$root"/.whl-tpu/*.whl | wc -l) wheels in $TPU_SITE (PYTHONPATH=$PYTHONPATH)" >&2
  if compgen -G "$root/.whl-tpu/maxtext/*.whl" > /dev/null; then
    # maxtext's metadata asks for Python >= 3.12: installed anyway, made to run by the shims
    "${pip[@]}" --ignore-requires-python --target "$TPU_SITE_MAXTEXT" "$root"/.whl-tpu/maxtext/*.whl \
      || return 1
    export MAXTEXT_ARM_PYTHONPATH=${machine:+$machine:}$TPU_SITE_MAXTEXT:$TPU_SITE
    PYTHONPATH=$MAXTEXT_ARM_PYTHONPATH "$py" "$root/benchmarks/maxtext_shims.py" "$TPU_SITE_MAXTEXT" >&2 \
      || return 1
    echo "[tpu_install] the MaxText arm: $(ls "$root"/.whl-tpu/maxtext/*.whl | wc -l) wheels in $TPU_SITE_MAXTEXT (MAXTEXT_ARM_PYTHONPATH=$MAXTEXT_ARM_PYTHONPATH)" >&2
  fi
  export TPU_SITE TPU_SITE_MAXTEXT
}
if [ "${BASH_SOURCE[0]}" = "$0" ]; then   # executed: exit with its status
  _tpu_install
  exit $?
fi
_tpu_install
