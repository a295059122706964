#!/usr/bin/env bash
# Qwen3 parity end to end, offline: build a tiny random-init Qwen3 with transformers (GQA, q/k norm,
# perturbed norm weights), convert it, check logits against transformers, fine-tune 20 steps from
# it, export back to Hugging Face, and check transformers reproduces our logits from the export.
#   bash end_to_end/qwen3.sh [WORK_DIR]
source "$(dirname "$0")/hf_round_trip.sh"

echo "== build a tiny Qwen3 in $W/hf"
$PY - "$W/hf" <<'PY'
import sys, torch, transformers
torch.manual_seed(0)
cfg = transformers.Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=False)
m = transformers.Qwen3ForCausalLM(cfg)
with torch.no_grad():
  for n, p in m.named_parameters():
    if "norm" in n:
      p.add_(0.1 * torch.randn_like(p))
m.save_pretrained(sys.argv[1])
PY
convert_and_check
finetune_export_check
