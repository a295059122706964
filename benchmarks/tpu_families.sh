#!/usr/bin/env bash
# The families on the TPU chip (issue 57), ours vs MaxText 0.2.5 side by side, one command (from the
# repository root, with .whl-tpu/ carried: `bash benchmarks/tpu_prepare.sh` fills it where PyPI is
# reachable). One stage per row pair, MaxText's row then ours, each a cold `train.py`-style run of 12
# steps on synthetic data (benchmarks/tpu_rows.py: the same steps' medians on both sides), with the
# shapes and settings of benchmarks/tpu_family_rows.py (one table translates them into each
# trainer's keys):
#   moe16   Qwen3-30B-A3B widths, 4 layers, 16 experts top-4, vocab 32k, seq 2048, batch 4, remat full
#   moe64   the same widths, 2 layers, 64 experts top-8, batch 2
#   gemma4  Gemma 4 E2B widths, 5 layers, no KV sharing, seq 2048, batch 4, bf16 weights
#           (MaxText: scan_layers=false, which its Gemma 4 E2B requires)
#   next2k  Qwen3-Next widths, 4 layers (3 Gated DeltaNet + 1 full), 16 experts top-10, vocab 32k
#   next8k  the same at seq 8192, batch 1
# Writes $OUT/tpu_families.md (or $TPU_FAMILIES_OUT/) beside the raw records and logs
# (<row>_maxtext.json/.log, <row>_ours.json/.log). Every run gets min(its timeout, what is left of
# TPU_FAMILIES_BUDGET seconds, default 520: the command stays under 9 minutes); a run with less than
# 60 s left is skipped and the report says so (run the rest in a second command). By estimate the
# five rows take ~14 minutes on one v5e: run them as two commands, TPU_FAMILIES_ROWS="moe16 moe64
# gemma4" (~7.5 min) then TPU_FAMILIES_ROWS="next2k next8k" (~6.5 min).
#   TPU_FAMILIES_ROWS="moe16 gemma4"  the rows to run (default: the five above; any row of
#                                     tpu_family_rows.py, e.g. moe16-auto)
#   TPU_FAMILIES_QUICK=1              one pair (moe16), 8 steps (a check of the lane itself)
#   SUITE_COMMIT=<hash>               names the commit in the file (else `git describe --dirty`: a tree that differs from its .git says so)
#   --dry-run                         prints each stage's commands (no install, nothing run or written)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "tpu_families.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
out=${TPU_FAMILIES_OUT:-${OUT:-/tmp/tpu_families}}
quick=${TPU_FAMILIES_QUICK:-0}
budget=${TPU_FAMILIES_BUDGET:-520}
steps=12
warmup=5
[ "$quick" = 1 ] && { steps=8; warmup=3; }
# the runs: "row<TAB>title<TAB>text" then "row<TAB>side<TAB>limit s<TAB>keys" (maxtext before ours)
plan_args=(plan)
[ "$quick" = 1 ] && plan_args+=(--quick)
# shellcheck disable=SC2206
[ -n "${TPU_FAMILIES_ROWS:-}" ] && plan_args+=(${TPU_FAMILIES_ROWS})
plan=$("$PY" benchmarks/tpu_family_rows.py "${plan_args[@]}") || exit 2   # an unknown row: said
export PYTHONUNBUFFERED=1
t0=$SECONDS
stage() { echo "== $1 (at $((SECONDS - t0)) s)" >&2; }
# shellcheck source=benchmarks/tpu_lane.sh
source benchmarks/tpu_lane.sh   # lane_install, lane_commit

if [ $DRY = 0 ]; then
  mkdir -p "$out"
  rm -f "$out/skipped.txt"
  awk -F '\t' '$2 == "title" {print $1}' <<< "$plan" > "$out/rows.txt"
  lane_install tpu_families
fi
commit=$(lane_commit)
work=/tmp/tpu_families_runs

# one side of a row: tpu_rows.py with the row's keys, its record in $out/<row>_<side>.json, the run's
# log in $out/<row>_<side>.log; the time limit: the row's, cut to what the budget leaves
run_side() {
  local row=$1 side=$2 limit=$3 keys left
  read -r -a keys <<< "$4"
  if [ $DRY = 1 ]; then
    echo "[dry-run] $row $side (limit ${limit} s): python3 benchmarks/tpu_rows.py $side --steps $steps --warmup $warmup ${keys[*]}"
    return
  fi
  left=$((budget - (SECONDS - t0)))
  if [ "$left" -lt 60 ]; then
    echo "$row/$side ${left} s left of the ${budget} s budget" >> "$out/skipped.txt"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  rm -rf "$work/$row-$side"
  timeout $((limit + 5)) "$PY" benchmarks/tpu_rows.py "$side" --steps $steps --warmup $warmup \
    --timeout "$limit" --work "$work/$row-$side" "${keys[@]}" \
    < /dev/null > "$out/${row}_$side.json" 2> "$out/${row}_$side.err"
  cp "$work/$row-$side/$side.log" "$out/${row}_$side.log" 2>/dev/null
  rm -rf "$work/$row-$side"
}

while IFS=$'\t' read -r row what a b; do
  if [ "$what" = title ]; then
    stage "$row: $a"
  else
    run_side "$row" "$what" "$a" "$b"
  fi
done <<< "$plan"

if [ $DRY = 1 ]; then
  echo "[dry-run] would write $out/tpu_families.md"
  exit 0
fi
stage "report"
"$PY" benchmarks/tpu_family_rows.py report --dir "$out" --commit "$commit" \
  --seconds $((SECONDS - t0)) > "$out/tpu_families.md"
cat "$out/tpu_families.md"
