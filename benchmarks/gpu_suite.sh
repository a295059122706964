#!/usr/bin/env bash
# The GPU suite, one command (under 10 minutes on one H200; each step has its own limit, which
# together fit one device call): runs, in order,
#   1. the Pallas kernel tests compiled for the GPU (JAX_PLATFORMS=cuda: no interpret mode)
#   2. benchmarks/attention.py: our flash kernel vs cuDNN, S = 1k..32k
#   3. MFU of a ~1.1B dense Qwen3-shaped model (Qwen3-1.7B dimensions, 16 layers), bf16, S = 4096
#   4. the hot paths (MaxText/backend/hot_path.py): step 3's run (hot_path=plain, the GPU default:
#      XLA's own dot, attention and norm) again with hot_path=tuned (the XLA:CPU mechanisms)
#   5. benchmarks/moe.py: one MoE layer (Qwen3-30B-A3B-like: 64 experts, top-8) on one device,
#      EP 1, grouped matmuls (ragged_dot; moe_dispatch=auto: the real ragged_all_to_all on GPU)
#      vs a dense MLP of equal active parameters, bf16
#   6. benchmarks/decode.py: decode tokens/s of our engine (on the GPU) vs transformers' generate
# and writes one Markdown file (default gpu_suite.md) with every step's command, status, time and
# result table, for benchmarks/RESULTS.md.
#
#   bash benchmarks/gpu_suite.sh [--out FILE] [--only 1,3,4] [--dry-run]
#
# --only runs the listed steps alone (a rerun of the ones that failed); --dry-run prints what would
# run (and the file it would write) without running anything.
# PYTHON=... picks the interpreter (default .venv/bin/python); GPU_SUITE_LOGS=DIR keeps each step's
# whole log there.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1   # a step cut at its limit still shows what it printed

PY=${PYTHON:-.venv/bin/python}
OUT=gpu_suite.md
DRY=0
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT=$2; shift ;;
    --only) ONLY=",$2,"; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

WORK=$(mktemp -d /tmp/gpu_suite.XXXXXX)
MFU_RUN=(train.py configs/base.yml model_name=qwen3-1.7b num_decoder_layers=16
         max_target_length=4096 per_device_batch_size=4 dtype=bfloat16 weight_dtype=float32
         attention=flash loss_chunk_length=1024 dataset_type=synthetic steps=20 log_period=5
         enable_checkpointing=false enable_tensorboard=false sample_at_end=false jax_cache_dir=
         base_output_directory="$WORK")
FAILED=0

# step TITLE TIMEOUT_S CMD...: runs CMD (env assignments allowed in front), records it in $OUT
step() {
  local title=$1 limit=$2
  shift 2
  [ -z "$ONLY" ] || [[ "$ONLY" == *",${title%%.*},"* ]] || return 0
  echo "## $title" >> "$OUT"
  echo >> "$OUT"
  echo "\`$*\` (limit ${limit} s)" >> "$OUT"
  echo >> "$OUT"
  if [ $DRY = 1 ]; then
    echo "[dry-run] $title: $* (limit ${limit} s)"
    return 0
  fi
  echo "[gpu_suite] $title ..." >&2
  local log="$WORK/step.log" start end rc
  start=$(date +%s)
  timeout "$limit" env "$@" > "$log" 2>&1
  rc=$?
  end=$(date +%s)
  [ $rc = 0 ] || FAILED=1
  echo "exit status $rc after $((end - start)) s" >> "$OUT"
  echo >> "$OUT"
  echo '```' >> "$OUT"
  tail -n 80 "$log" >> "$OUT"
  # GPU_SUITE_LOGS=DIR keeps each step's whole log
  [ -z "${GPU_SUITE_LOGS:-}" ] || cp "$log" "$GPU_SUITE_LOGS/step${title%%.*}.log"
  echo '```' >> "$OUT"
  echo >> "$OUT"
}

if [ $DRY = 1 ]; then
  echo "[dry-run] would write the results to $OUT"
  OUT=/dev/null
else
  {
    echo "# GPU suite ($(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
    echo
    "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1
    echo
  } > "$OUT"
fi

step "1. Pallas kernel tests on the GPU (no interpret mode)" 90 \
  JAX_PLATFORMS=cuda "$PY" -m pytest -q -n 0 -p no:cacheprovider tests/test_flash_attention.py
step "2. Flash attention: ours vs cuDNN, S 1k-32k" 110 \
  "$PY" benchmarks/attention.py --seqs 1024,2048,4096,8192,16384,32768
# mfu RUN_NAME: the median MFU and tokens/s of steps 6-20 of that MFU run, into $OUT
mfu() {
  [ $DRY = 0 ] && [ -f "$WORK/$1/metrics.jsonl" ] || return 0
  "$PY" - "$WORK/$1/metrics.jsonl" "$1" >> "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][5:]
mfu = statistics.median(r["mfu"] for r in rows)
tok = statistics.median(r["tokens_per_s"] for r in rows)
step = statistics.median(r["step_time_s"] for r in rows)
print(f"{sys.argv[2]}, median of steps 6-20: **MFU {100 * mfu:.1f}%** (goal >= 55%), "
      f"{tok:,.0f} tokens/s, {step:.3f} s per step\n")
EOF
}

step "3. MFU: ~1.1B dense Qwen3-shaped model, bf16, S 4096, one GPU" 120 \
  "$PY" "${MFU_RUN[@]}" hot_path=plain run_name=mfu_1b
mfu mfu_1b
step "4. Hot paths: step 3's run with hot_path=tuned (XLA:CPU's mechanisms) vs plain" 110 \
  "$PY" "${MFU_RUN[@]}" hot_path=tuned run_name=mfu_1b_tuned
mfu mfu_1b
mfu mfu_1b_tuned
step "5. MoE layer, one device, EP 1: grouped matmuls vs dense" 45 \
  "$PY" benchmarks/moe.py --devices 1 --tokens 32768 --dim 2048 --experts 64 --top-k 8 \
  --expert-dim 768 --repeats 10 --dtype bfloat16
step "6. Decode tokens/s: our engine vs transformers' generate (~100M Qwen3-shaped, greedy)" 90 \
  "$PY" benchmarks/decode.py --batches 1,8,32

[ $DRY = 1 ] || echo "[gpu_suite] results in $OUT" >&2
rm -rf "$WORK"
exit $FAILED
