#!/usr/bin/env bash
# The TPU lane, one command on the chip (from the repository root, with .whl-tpu/ carried: `bash
# benchmarks/tpu_prepare.sh` fills it where PyPI is reachable). Under 9 minutes on one v5e; writes
# one Markdown file for benchmarks/RESULTS.md ($OUT/tpu_suite.md, or $TPU_SUITE_OUT/), beside the
# raw logs and JSON it was made from:
#   1. the `tpu` tests in one process (tests/test_tpu.py: splash forward + backward against the
#      reference in float32 at highest precision; every family's first steps on the chip against
#      the CPU; bf16 weights training there);
#   2. the start-up of `train.py` on Qwen3-0.6B, cold then warm (one compilation cache, emptied
#      first; the start-up line's phases);
#   3. MaxText 0.2.5 side by side (benchmarks/tpu_rows.py maxtext: its best settings found),
#      then our step matrix in one process (benchmarks/tpu_step.py: the pre-flight's estimate
#      against XLA's count, init, compile, tokens/s, MFU per row), and the ratios.
#   SUITE_COMMIT=<hash> names the commit in the file (else `git describe --dirty`, where .git is there: a copied tree that differs from it says so).
#   TPU_SUITE_QUICK=1: one family, one row each side (a check of the lane itself).
#   --dry-run: prints each stage's command (`[dry-run] ...`; no install, nothing run or written);
#   tests/test_tpu_suite.py checks them on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
out=${TPU_SUITE_OUT:-${OUT:-/tmp/tpu_suite}}
export PYTHONUNBUFFERED=1
t0=$SECONDS
# each stage's command through `run`: in a dry run printed (on the script's stdout)
# shellcheck source=benchmarks/tpu_lane.sh
source benchmarks/tpu_lane.sh   # run, lane_install
if [ "$DRY" = 0 ]; then
  mkdir -p "$out"
  lane_install tpu_suite
else
  out=$(mktemp -d)   # the redirections' target in a dry run (removed at the end)
fi
commit=$(lane_commit)
quick=${TPU_SUITE_QUICK:-0}
stage() { echo "== $1 (at $((SECONDS - t0)) s)" >&2; }

stage "tpu tests"
tests=(tests/test_tpu.py)
[ "$quick" = 1 ] && tests=(tests/test_tpu.py -k "splash or qwen3-next or (three_steps and qwen3])")
# -v: each result as it comes; tests.jsonl: each measurement before its assertion
rm -f "$out/tests.jsonl"
TPU_TEST_RECORD=$out/tests.jsonl JAX_PLATFORMS=tpu,cpu run timeout 270 python3 -m pytest -v -n 0 \
  -p no:cacheprovider -m tpu -rA --tb=short "${tests[@]}" > "$out/tests.log" 2>&1
echo "tests exit $?" >> "$out/tests.log"

stage "start-up"
Q06="model_name=qwen3-0.6b max_target_length=2048 dataset_type=synthetic flash_block_q=1024 flash_block_kv=1024"
# twice on one persistent compilation cache, emptied first: cold (it fills it), then warm
cache=/tmp/tpu_suite_jax_cache
[ "$DRY" = 0 ] && rm -rf "$cache"
for phase in cold warm; do
  # shellcheck disable=SC2086
  run timeout 120 python3 train.py configs/base.yml $Q06 per_device_batch_size=8 remat_policy=full \
    flash_fused_bwd=true steps=3 jax_cache_dir=$cache enable_checkpointing=false sample_at_end=false \
    base_output_directory=/tmp/tpu_suite_runs > "$out/startup_$phase.log" 2>&1
  echo "exit $?" >> "$out/startup_$phase.log"
done

stage "MaxText"
MT="model_name=qwen3-0.6b max_target_length=2048 attention=flash dtype=bfloat16"
MT_BLOCKS="sa_block_q=1024 sa_block_kv=1024 sa_block_kv_compute=1024 sa_block_q_dkv=1024 sa_block_kv_dkv=1024 sa_block_kv_dkv_compute=1024 sa_use_fused_bwd_kernel=true"
# shellcheck disable=SC2086
run timeout 150 python3 benchmarks/tpu_rows.py maxtext --steps 12 --timeout 140 $MT \
  per_device_batch_size=8 remat_policy=full weight_dtype=float32 $MT_BLOCKS > "$out/maxtext_full.json" 2> "$out/maxtext_full.log"
if [ "$quick" != 1 ]; then
  # shellcheck disable=SC2086
  run timeout 150 python3 benchmarks/tpu_rows.py maxtext --steps 12 --timeout 140 $MT \
    per_device_batch_size=8 weight_dtype=bfloat16 remat_policy=custom context=device \
    query_proj=device key_proj=device value_proj=device $MT_BLOCKS \
    > "$out/maxtext_bf16.json" 2> "$out/maxtext_bf16.log"
fi

stage "ours"
variants=(--variant "full b8 (as MaxText's row): remat_policy=full per_device_batch_size=8 flash_fused_bwd=true")
if [ "$quick" != 1 ]; then
  variants+=(
    --variant "save_attention b6: remat_policy=save_attention per_device_batch_size=6 flash_fused_bwd=true"
    --variant "bf16 weights, save_qkv_attention b8 (as MaxText's bf16 row): weight_dtype=bfloat16 remat_policy=save_qkv_attention per_device_batch_size=8 flash_fused_bwd=true")
fi
run timeout 200 python3 benchmarks/tpu_step.py --steps 8 --base "$Q06" "${variants[@]}" \
  --out "$out/ours.json" > "$out/ours.log" 2>&1

stage "report"
if [ "$DRY" = 1 ]; then
  rm -rf "$out"
  echo "[dry-run] would write ${TPU_SUITE_OUT:-${OUT:-/tmp/tpu_suite}}/tpu_suite.md"
  exit 0
fi
python3 benchmarks/tpu_report.py --dir "$out" --commit "$commit" --seconds $((SECONDS - t0)) \
  > "$out/tpu_suite.md"
cat "$out/tpu_suite.md"
