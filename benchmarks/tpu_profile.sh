#!/usr/bin/env bash
# Our step and MaxText's, profiled side by side on the chip in one command (from the repository
# root, .whl-tpu/ carried): the rows of the lane's table where MaxText leads (benchmarks/tpu_suite.sh:
# bf16 weights, q/k/v and attention output saved, batch 8, Qwen3-0.6B at 2048), each traced over 3
# steps after 5 by its own profiler (benchmarks/tpu_profile.py), then both sides' categories and
# jax operations in one Markdown file: $OUT/profile.md (or $TPU_PROFILE_OUT/), beside each
# side's JSON. TPU_PROFILE_OURS / TPU_PROFILE_MAXTEXT: extra key=value for a side (e.g. another
# remat policy). TPU_PROFILE_ROW=<row of benchmarks/tpu_family_rows.py> (e.g. moe16): that row's
# keys on each side instead of the dense row's. About 3-4 minutes on one v5e. --dry-run prints
# the commands.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
out=${TPU_PROFILE_OUT:-${OUT:-/tmp/tpu_profile}}
export PYTHONUNBUFFERED=1
# shellcheck source=benchmarks/tpu_lane.sh
source benchmarks/tpu_lane.sh   # run, lane_install
if [ "$DRY" = 0 ]; then
  mkdir -p "$out"
  [ -n "${MAXTEXT_ARM_PYTHONPATH:-}" ] || lane_install tpu_profile
else
  out=$(mktemp -d)
fi
COMMON="model_name=qwen3-0.6b max_target_length=2048 per_device_batch_size=8"
MAXTEXT_KEYS="$COMMON attention=flash dtype=bfloat16 weight_dtype=bfloat16 remat_policy=custom \
context=device query_proj=device key_proj=device value_proj=device sa_block_q=1024 \
sa_block_kv=1024 sa_block_kv_compute=1024 sa_block_q_dkv=1024 sa_block_kv_dkv=1024 \
sa_block_kv_dkv_compute=1024 sa_use_fused_bwd_kernel=true"
OURS_KEYS="$COMMON dataset_type=synthetic flash_block_q=1024 flash_block_kv=1024 \
flash_fused_bwd=true weight_dtype=bfloat16 remat_policy=save_qkv_attention"
if [ -n "${TPU_PROFILE_ROW:-}" ]; then
  MAXTEXT_KEYS=$(python3 benchmarks/tpu_family_rows.py keys "$TPU_PROFILE_ROW" maxtext | tr '\n' ' ') \
    || exit 2
  OURS_KEYS="$(python3 benchmarks/tpu_family_rows.py keys "$TPU_PROFILE_ROW" ours | tr '\n' ' ') \
dataset_type=synthetic" || exit 2
fi
# shellcheck disable=SC2086
run timeout 200 python3 benchmarks/tpu_profile.py maxtext --timeout 190 --top 60 \
  --work /tmp/tpu_profile_maxtext --out "$out/profile_maxtext.json" $MAXTEXT_KEYS \
  ${TPU_PROFILE_MAXTEXT:-} > "$out/profile_maxtext.log" 2>&1
# shellcheck disable=SC2086
run timeout 200 python3 benchmarks/tpu_profile.py ours --timeout 190 --top 60 \
  --work /tmp/tpu_profile_ours --out "$out/profile_ours.json" $OURS_KEYS \
  ${TPU_PROFILE_OURS:-} > "$out/profile_ours.log" 2>&1
if [ "$DRY" = 1 ]; then
  rm -rf "$out"
  exit 0
fi
{
  echo "# Step profiles, ours and MaxText's (benchmarks/tpu_profile.sh)"
  echo
  python3 benchmarks/tpu_profile.py compare "$out/profile_ours.json" "$out/profile_maxtext.json" --top 40
  echo
  python3 -c "import json,sys; sys.path.insert(0,'benchmarks'); import tpu_profile as t
for side in ('ours', 'maxtext'):
  print(t.markdown(json.load(open('$out/profile_' + side + '.json')), 40)); print()"
} > "$out/profile.md" 2>&1
cat "$out/profile.md"
