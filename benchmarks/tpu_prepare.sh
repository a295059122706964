#!/usr/bin/env bash
# Prepares what a TPU machine without network needs, here (network: PyPI only), into .whl-tpu/
# (ignored by git; the run tool carries it with the tree, <= 64 MiB per command in all):
#   .whl-tpu/*.whl          the runtime closure of train.py, MaxText.decode / MaxText.inference,
#                           MaxText.quantize and the serve engine (MaxText/serve/scheduler.py) for
#                           Python 3.11
#                           manylinux x86_64, at requirements.txt's pins; NOT jax, jaxlib, numpy,
#                           scipy, ml_dtypes, opt_einsum (the machine's own JAX + libtpu stay first)
#                           nor test / oracle / dev-only packages (torch, transformers, ruff, ray, ...)
#   .whl-tpu/maxtext/*.whl  the comparison arm: maxtext 0.2.5 (repacked without maxtext/assets,
#                           examples, tests and dependencies/) and the wheels it needs beyond ours
#                           (antlr4-python3-runtime 4.9.3 has no wheel: built here from its sdist)
# Then, on the chip: `source benchmarks/tpu_install.sh` (docs/performance.md, "TPU lane").
#
#   bash benchmarks/tpu_prepare.sh [--force | --pins]
#
# --pins prints the pins it would fetch (ours, then the arm's) and stops, without network.
# Idempotent: when .whl-tpu/PINS equals the pins computed now (and every wheel is there) it only
# prints the size. PYTHON=... picks the interpreter that runs pip (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl-tpu
FORCE=0
PRINT_PINS=0
case "${1:-}" in
  --force) FORCE=1 ;;
  --pins) PRINT_PINS=1 ;;
  "") ;;
  -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
  *) echo "tpu_prepare.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

# The runtime closure of ours (versions: requirements.txt). Found by importing train.py's run,
# MaxText.decode, MaxText.inference, MaxText.quantization.convert (tqdm: the chip's int8 decode
# rows) and MaxText.serve.scheduler with only these + jax on the path.
OURS=(absl-py aiofiles array_record attrs cloudpickle etils filelock flax fsspec grain humanize
      Jinja2 MarkupSafe markdown-it-py mdurl msgpack optax orbax-checkpoint packaging portpicker
      prometheus_client protobuf psutil Pygments PyYAML qwix rich safetensors simplejson
      tensorboardX tensorstore tokenizers tqdm treescope typing_extensions uvloop zipp
      pytest-xdist execnet pytest-timeout)   # pytest.ini's -n / timeout, for the tests run there
# MaxText 0.2.5's synthetic pre-training on Python 3.11 + jax 0.10.2, beyond ours (its newest
# releases that still take Python 3.11 / jax < 0.11; ../shared/notes/tpu-v5e.md).
# Found as train.py's: its run on CPU with only these, ours and jax on the path (pydantic: its
# config; jaxtyping: tokamax; requests: pathwaysutils' profiler; ml_collections: its grain input).
ARM=(maxtext==0.2.5 omegaconf==2.3.0 pathwaysutils==0.1.13 aqtp==0.9.0 drjax==0.2.1
     tokamax==0.0.12 einshape==1.0 typeguard==2.13.3 immutabledict==4.3.1
     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
     jaxtyping==0.3.11 wadler_lindig==0.1.8 ml_collections==1.1.0 requests==2.34.2
     urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3)
ARM_SDIST=(antlr4-python3-runtime==4.9.3)
STRIP_VERSION=1   # bump when the repacking of maxtext's wheel changes

norm() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
# requirements.txt's pins as "normalized-name name==version" lines, by one awk (a `norm` per line
# and per name forked ~14,000 processes, 12 s)
REQ_PINS=$(awk '{ line = $0; sub(/#.*/, "", line) }
  line ~ /==/ { name = substr(line, 1, index(line, "==") - 1); sub(/\[.*/, "", name)
                n = tolower(name); gsub(/[_.]/, "-", n)
                pin = name "==" substr(line, index(line, "==") + 2); gsub(/ /, "", pin)
                print n, pin }' requirements.txt)
pin_of() {   # name -> name==version from requirements.txt, or exit 2
  local want n pin
  want=$(norm "$1")
  while read -r n pin; do
    if [ "$n" = "$want" ]; then echo "$pin"; return 0; fi
  done <<< "$REQ_PINS"
  echo "tpu_prepare.sh: '$1' has no pin in requirements.txt" >&2
  exit 2
}
PINS=()
for n in "${OURS[@]}"; do PINS+=("$(pin_of "$n")"); done
if [ $PRINT_PINS = 1 ]; then printf '%s\n' "${PINS[@]}" "${ARM[@]}" "${ARM_SDIST[@]}"; exit 0; fi
STAMP=$(printf '%s\n' "ours:" "${PINS[@]}" "maxtext:" "${ARM[@]}" "${ARM_SDIST[@]}" "strip $STRIP_VERSION")

size() {
  echo "[tpu_prepare] $(find "$DEST" -name '*.whl' | wc -l) wheels: $(du -sh --apparent-size "$DEST" | cut -f1) in $DEST ($(du -sh --apparent-size "$DEST/maxtext" | cut -f1) of it the MaxText arm)"
}
complete() {   # every wheel the last preparation listed is there
  [ -f "$DEST/FILES" ] || return 1
  local f
  while IFS= read -r f; do [ -f "$DEST/$f" ] || return 1; done < "$DEST/FILES"
}
if [ $FORCE = 0 ] && [ -f "$DEST/PINS" ] && [ "$(cat "$DEST/PINS")" = "$STAMP" ] && complete; then
  echo "[tpu_prepare] up to date (pins unchanged)"
  size
  exit 0
fi

TMP=$(mktemp -d /tmp/tpu_prepare.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
PLATFORMS=(--python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
DL=("$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}")
echo "[tpu_prepare] ours: ${#PINS[@]} wheels" >&2
"${DL[@]}" -d "$TMP/ours" "${PINS[@]}"
echo "[tpu_prepare] the MaxText arm: ${#ARM[@]} wheels + ${ARM_SDIST[*]} built from its sdist" >&2
# maxtext declares Requires-Python >= 3.12; it runs on 3.11 with the fixes tpu_install.sh applies
"${DL[@]}" --ignore-requires-python -d "$TMP/arm" "${ARM[@]}"
"$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$TMP/arm" "${ARM_SDIST[@]}"

# maxtext's wheel without what a synthetic-data run never reads (13.6 MB -> ~2.5 MB); its RECORD
# loses the dropped files' lines so pip installs it as a consistent wheel
"$PY" - "$TMP/arm" <<'EOF'
import glob, os, re, sys, zipfile
src, = glob.glob(os.path.join(sys.argv[1], "maxtext-*.whl"))
drop = re.compile(r"^(maxtext/(assets|examples)/|dependencies/|.*/tests?/)")
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
  for info in zin.infolist():
    if drop.match(info.filename):
      continue
    data = zin.read(info.filename)
    if info.filename.endswith(".dist-info/RECORD"):
      data = b"".join(l for l in data.splitlines(keepends=True) if not drop.match(l.decode()))
    zout.writestr(info, data)
os.replace(tmp, src)
EOF

rm -rf "$DEST"
mkdir -p "$DEST/maxtext"
mv "$TMP"/ours/*.whl "$DEST/"
mv "$TMP"/arm/*.whl "$DEST/maxtext/"
(cd "$DEST" && find . -name '*.whl' | sed 's|^\./||' | sort > FILES)
echo "$STAMP" > "$DEST/PINS"
size
