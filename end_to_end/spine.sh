#!/usr/bin/env bash
# End-to-end check of the spine on this machine, no network: set-up, a short training run on the
# embedded corpus, an interrupted-and-resumed run that must match it bitwise, and a config error.
#   bash end_to_end/spine.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
bash setup.sh
PY=.venv/bin/python
COMMON=(configs/base.yml base_output_directory="$OUT" steps=20 checkpoint_period=10 log_period=5
        max_checkpoints_to_keep=5 emb_dim=128 mlp_dim=512 num_decoder_layers=2 learning_rate=1e-2)

echo "== 20 straight steps"
$PY train.py "${COMMON[@]}" run_name=straight
echo "== the same run interrupted after step 10 (step-20 checkpoint and rows removed), then resumed"
$PY train.py "${COMMON[@]}" run_name=resumed
rm -rf "$OUT/resumed/checkpoints/20"
head -n 10 "$OUT/resumed/metrics.jsonl" > "$OUT/resumed/m10" && mv "$OUT/resumed/m10" "$OUT/resumed/metrics.jsonl"
$PY train.py "${COMMON[@]}" run_name=resumed

$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = lambda r: [json.loads(l) for l in open(f"{out}/{r}/metrics.jsonl")]
a, b = rows("straight"), rows("resumed")
assert [r["step"] for r in b] == list(range(1, 21)), [r["step"] for r in b]
assert [r["loss"] for r in a] == [r["loss"] for r in b], "resumed losses differ"
first, last = sum(r["loss"] for r in a[:3]) / 3, sum(r["loss"] for r in a[-3:]) / 3
assert last < first - 1.0, (first, last)
print(f"OK: loss {first:.3f} -> {last:.3f}; resumed run equals the straight run bitwise")
PY

echo "== a config error exits 2 before compiling"
set +e
$PY train.py configs/base.yml stpes=5 2> "$OUT/err.txt"; code=$?
set -e
grep -q "did you mean 'steps'" "$OUT/err.txt" && [ "$code" = 2 ] && echo "OK: exit 2: $(cat "$OUT/err.txt")"
