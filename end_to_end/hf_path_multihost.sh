#!/usr/bin/env bash
# hf_path= on 2 local processes, offline: build a tiny random-init Qwen3 with transformers, train
# from the Hugging Face folder with no conversion step as 2 processes x 4 fake CPU devices
# (MaxText.launch.local; parameters over fsdp=8): each process logs the bytes its ranged reads
# fetched, about half the model each. Then the same first step from to_maxtext's checkpoint on the
# same 2 processes gives the same loss, bit for bit.
#   bash end_to_end/hf_path_multihost.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-$(mktemp -d)}
bash setup.sh
PY=.venv/bin/python
export JAX_PLATFORMS=cpu
MESH=(per_device_batch_size=1 ici_data_parallelism=1 ici_fsdp_parallelism=8 ici_tensor_parallelism=1)
RUN=(steps=1 warmup_steps=2 max_target_length=64 enable_checkpointing=false dtype=float32
     dataset_type=synthetic data_shards=2 log_period=1)

echo "== build a tiny Qwen3 in $W/hf"
$PY -c 'import sys; from end_to_end.tiny_hf import save_tiny
save_tiny(sys.argv[1], "Qwen3Config", "Qwen3ForCausalLM", vocab_size=384, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512)' "$W/hf"

echo "== train.py hf_path= on 2 processes x 4 devices: each reads only its slices"
$PY -m MaxText.launch.local processes=2 devices_per_process=4 log_dir="$W/logs" -- \
    train.py configs/base.yml hf_path="$W/hf" base_output_directory="$W/runs" run_name=hf \
    "${MESH[@]}" "${RUN[@]}"
grep -h "read .* bytes of" "$W"/logs/process_*.out
$PY -c 'import json, sys; from safetensors import safe_open
f = safe_open(sys.argv[1], "np"); print("array bytes in the folder:", sum(f.get_tensor(k).nbytes for k in f.keys()))' \
    "$W/hf/model.safetensors"

echo "== the same step from to_maxtext's checkpoint on the same 2 processes: the same loss"
$PY -m MaxText.checkpoint_conversion.to_maxtext hf_path="$W/hf" output_path="$W/ckpt"
$PY -m MaxText.launch.local processes=2 devices_per_process=4 log_dir="$W/logs_conv" -- \
    train.py configs/base.yml load_parameters_path="$W/ckpt" base_output_directory="$W/runs" \
    run_name=conv "${MESH[@]}" "${RUN[@]}"
$PY - "$W/runs" <<'PY'
import json, sys
loss = {r: [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/{r}/metrics.jsonl")] for r in ("hf", "conv")}
print("first loss: hf_path on 2 processes", loss["hf"], "| converted checkpoint", loss["conv"])
assert loss["hf"] == loss["conv"], loss
PY
echo "OK"
