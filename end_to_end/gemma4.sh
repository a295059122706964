#!/usr/bin/env bash
# Gemma 4 parity end to end, offline: build a tiny random-init Gemma 4 text model with transformers
# (every feature on: sliding + full layers, global head width and kv heads, K = V, proportional
# RoPE, a KV-shared tail with a double-wide MLP, per-layer inputs, soft-capped logits; norm weights
# and layer scalars perturbed), convert it, check logits against transformers (fp32 and bf16),
# fine-tune 20 steps from it, export back to Hugging Face, and check transformers reproduces our
# logits from the export. A multimodal `gemma4` checkpoint layout (model.language_model.*, with
# vision weights) converts to the same parameters, and a Gemma 4 with the MoE block converts,
# passes the logit check and exports to a folder transformers reloads with the same logits.
#   bash end_to_end/gemma4.sh [WORK_DIR]
source "$(dirname "$0")/hf_round_trip.sh"

echo "== build a tiny Gemma 4 in $W/hf"
$PY -c 'import sys; from end_to_end.tiny_hf import save_tiny
save_tiny(sys.argv[1], "Gemma4TextConfig", "Gemma4ForCausalLM", buffer_suffixes=("layer_scalar",),
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    num_kv_shared_layers=3, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=384, final_logit_softcapping=30.0, max_position_embeddings=1024)' "$W/hf"
convert_and_check
echo "== logit check in bf16"
$PY -m MaxText.logit_check hf_path="$W/hf" load_parameters_path="$W/ckpt" dtype=bfloat16
echo "== a multimodal gemma4 layout of the same weights converts to the same parameters"
$PY - "$W" <<'PY'
import json, os, sys
import numpy as np
from safetensors.numpy import load_file, save_file
w = sys.argv[1]
os.makedirs(f"{w}/hf_mm")
text = json.load(open(f"{w}/hf/config.json"))
json.dump({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
           "text_config": text}, open(f"{w}/hf_mm/config.json", "w"))
tensors = {("model.language_model." + k[6:] if k.startswith("model.") else k): v
           for k, v in load_file(f"{w}/hf/model.safetensors").items()}
tensors["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.zeros((4, 4), np.float32)
save_file(tensors, f"{w}/hf_mm/model.safetensors")
PY
$PY -m MaxText.checkpoint_conversion.to_maxtext hf_path="$W/hf_mm" output_path="$W/ckpt_mm"
$PY - "$W" <<'PY'
import sys, jax, numpy as np
from MaxText.checkpoint.manager import load_params
w = sys.argv[1]
a, b = load_params(f"{w}/ckpt"), load_params(f"{w}/ckpt_mm")
assert jax.tree.structure(a) == jax.tree.structure(b)
jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
print("multimodal layout: identical parameters")
PY
echo "== a Gemma 4 with the MoE block (26B-A4B shape): convert and logit check"
$PY -c 'import sys; from end_to_end.tiny_hf import save_tiny
save_tiny(sys.argv[1], "Gemma4TextConfig", "Gemma4ForCausalLM", seed=1,
    perturb_suffixes=("router.scale", "per_expert_scale"),
    vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
    enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
    final_logit_softcapping=30.0, max_position_embeddings=1024)' "$W/hf_moe"
$PY -m MaxText.checkpoint_conversion.to_maxtext hf_path="$W/hf_moe" output_path="$W/ckpt_moe"
$PY -m MaxText.logit_check hf_path="$W/hf_moe" load_parameters_path="$W/ckpt_moe"
$PY -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path="$W/ckpt_moe" \
    output_path="$W/export_moe"
$PY -m MaxText.logit_check hf_path="$W/export_moe" load_parameters_path="$W/ckpt_moe"
finetune_export_check
