#!/usr/bin/env bash
# Qwen3-MoE parity end to end, offline: build a tiny random-init Qwen3-MoE with transformers
# (8 experts, top-2, renormalised; perturbed norm weights), convert it (hub per-expert files →
# our fused experts), check logits against transformers, fine-tune 20 steps with expert
# parallelism 4 over 4 CPU devices (load-balancing loss on), export back to per-expert files and
# check transformers reproduces our logits from the export.
#   bash end_to_end/qwen3_moe.sh [WORK_DIR]
source "$(dirname "$0")/hf_round_trip.sh"

echo "== build a tiny Qwen3-MoE in $W/hf"
$PY -c 'import sys; from end_to_end.tiny_hf import save_tiny
save_tiny(sys.argv[1], "Qwen3MoeConfig", "Qwen3MoeForCausalLM", vocab_size=384, hidden_size=64,
          intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
          norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=False)' "$W/hf"
convert_and_check
export XLA_FLAGS=--xla_force_host_platform_device_count=4
FINETUNE_ARGS=(ici_expert_parallelism=4 per_device_batch_size=2 moe_aux_loss_weight=0.001)
finetune_export_check
