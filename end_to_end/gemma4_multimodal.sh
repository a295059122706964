#!/usr/bin/env bash
# Multimodal Gemma 4 end to end, offline: build a tiny random-init Gemma4ForConditionalGeneration
# with a vision and an audio tower (end_to_end/tiny_multimodal.py: the tokenizer with the
# placeholder tokens, a chat template and the processor's files beside it), convert it with both
# towers, check our logits on a prompt with an image and an audio clip against transformers,
# decode a chat image and a clip, run a few SFT steps on chat records with images (towers frozen),
# and export back to a folder transformers loads strictly.
#   bash end_to_end/gemma4_multimodal.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
W=${1:-$(mktemp -d)}
bash setup.sh
PY=.venv/bin/python
export JAX_PLATFORMS=cpu

echo "== build a tiny multimodal Gemma 4 in $W/hf"
[ -f "$W/hf/config.json" ] || $PY -m end_to_end.tiny_multimodal build "$W"
echo "== convert to our checkpoint (text model, both towers and their embedders, the processor)"
rm -rf "$W/ckpt" "$W/runs" "$W/export"
$PY -m MaxText.checkpoint_conversion.to_maxtext hf_path="$W/hf" output_path="$W/ckpt"
echo "== logits with an image and an audio clip against transformers"
$PY -m end_to_end.tiny_multimodal logits "$W"
echo "== decode: an image, then an audio clip"
$PY -m MaxText.decode configs/base.yml load_parameters_path="$W/ckpt" image="$W/img0.png" \
    prompt="what is this" max_new_tokens=8 ici_fsdp_parallelism=1
$PY -m MaxText.decode configs/base.yml load_parameters_path="$W/ckpt" audio="$W/clip.wav" \
    prompt="what is this" max_new_tokens=8 ici_fsdp_parallelism=1
echo "== SFT on chat records with images (towers frozen)"
$PY train.py configs/sft.yml load_parameters_path="$W/ckpt" dataset_path="$W/chat.jsonl" \
    base_output_directory="$W/runs" run_name=sft steps=4 warmup_steps=0 packing=false \
    max_num_images_per_example=1 max_target_length=128 per_device_batch_size=2 \
    ici_fsdp_parallelism=1 checkpoint_period=4 sample_at_end=false
echo "== export the fine-tuned model; transformers loads it strictly"
$PY -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path="$W/runs/sft/checkpoints" \
    output_path="$W/export"
$PY - "$W" <<'PY'
import sys, transformers
model, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(
    sys.argv[1] + "/export", output_loading_info=True)
bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
assert not bad, bad
assert model.model.audio_tower is not None and model.model.vision_tower is not None
print("export: Gemma4ForConditionalGeneration with both towers loads strictly")
PY
echo "gemma4_multimodal: all checks passed"
