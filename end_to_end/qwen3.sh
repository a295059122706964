#!/usr/bin/env bash
# Qwen3 parity end to end, offline: build a tiny random-init Qwen3 with transformers (GQA, q/k norm,
# perturbed norm weights), convert it, check logits against transformers, fine-tune 20 steps from
# it, export back to Hugging Face, and check transformers reproduces our logits from the export.
#   bash end_to_end/qwen3.sh [WORK_DIR]
source "$(dirname "$0")/hf_round_trip.sh"

echo "== build a tiny Qwen3 in $W/hf"
$PY -c 'import sys; from end_to_end.tiny_hf import save_tiny
save_tiny(sys.argv[1], "Qwen3Config", "Qwen3ForCausalLM", vocab_size=384, hidden_size=64,
          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=False)' "$W/hf"
convert_and_check
finetune_export_check
