#!/usr/bin/env bash
# Qwen3-Next parity end to end, offline: build a tiny random-init Qwen3-Next with transformers
# ([3 Gated DeltaNet + 1 gated attention] x 2, 8 experts top-2 with a shared expert; perturbed norm
# weights and dt_bias), give its checkpoint a released model's multi-token-prediction block
# (mtp.*: a full-attention decoder layer made by transformers, its experts written per expert as
# the hub does, fc and norms; one norm holding signed zeros), convert it (the MTP layer counted
# from the tensors), check logits against transformers (a packed row against each document run
# alone), fine-tune 20 steps with tensor parallelism 2 over 4 CPU devices (load-balancing loss
# on), export, check transformers reproduces our logits from the export and that every mtp.*
# tensor came back bit for bit.
#   bash end_to_end/qwen3_next.sh [WORK_DIR]
source "$(dirname "$0")/hf_round_trip.sh"

echo "== build a tiny Qwen3-Next in $W/hf, with an MTP block"
$PY -c 'import sys; from end_to_end.tiny_hf import save_tiny
save_tiny(sys.argv[1], "Qwen3NextConfig", "Qwen3NextForCausalLM", perturb_suffixes=("dt_bias",),
          vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          shared_expert_intermediate_size=32, max_position_embeddings=1024, rope_theta=1e6,
          tie_word_embeddings=False, initializer_range=0.1)' "$W/hf"
$PY - "$W" <<'PY'
import sys, torch, transformers
from safetensors.numpy import load_file, save_file
w = sys.argv[1]
config = transformers.AutoConfig.from_pretrained(f"{w}/hf")
torch.manual_seed(1)
layer = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextDecoderLayer(config, 3)
mtp = {}
for name, p in layer.state_dict().items():
  p = (p + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.05)
  if name == "mlp.experts.gate_up_proj":                        # the hub's per-expert files
    F = config.moe_intermediate_size
    for e in range(config.num_experts):
      mtp[f"mlp.experts.{e}.gate_proj.weight"] = p[e, :F]
      mtp[f"mlp.experts.{e}.up_proj.weight"] = p[e, F:]
  elif name == "mlp.experts.down_proj":
    for e in range(config.num_experts):
      mtp[f"mlp.experts.{e}.down_proj.weight"] = p[e]
  else:
    mtp[name] = p
tensors = {f"mtp.layers.0.{k}": v.float().numpy().copy() for k, v in mtp.items()}
D = config.hidden_size
tensors["mtp.fc.weight"] = torch.randn(D, 2 * D).mul_(0.05).numpy()
for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
  tensors[f"mtp.{n}.weight"] = (0.1 * torch.randn(D)).numpy()
tensors["mtp.norm.weight"][::2] = -0.0
base = load_file(f"{w}/hf/model.safetensors")
save_file({**base, **tensors}, f"{w}/hf/model.safetensors", metadata={"format": "pt"})
save_file(tensors, f"{w}/mtp.safetensors")
print(f"added {len(tensors)} mtp.* tensors")
PY
convert_and_check
export XLA_FLAGS=--xla_force_host_platform_device_count=4
FINETUNE_ARGS=(ici_data_parallelism=2 ici_tensor_parallelism=2 per_device_batch_size=2
               moe_aux_loss_weight=0.001)
finetune_export_check
$PY - "$W" <<'PY'
import sys
from safetensors.numpy import load_file
w = sys.argv[1]
want, got = load_file(f"{w}/mtp.safetensors"), load_file(f"{w}/export/model.safetensors")
assert all(got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes() for k in want)
print(f"OK: the {len(want)} mtp.* tensors came back bit for bit through to_maxtext, 20 training "
      "steps and to_huggingface")
PY
