#!/usr/bin/env bash
# Chat SFT with LoRA end to end, offline: a tiny random-init Qwen3 with a byte-level BPE tokenizer
# and a Qwen3-style chat template (built here) → to_maxtext → LoRA SFT (rank 8) on a generated
# chat file, loss on the assistant's tokens only → the assistant loss falls → export merged and as
# a PEFT adapter → transformers (merged) and transformers + peft (base + adapter) reproduce our
# logits within 1e-4 → the PEFT adapter imported back by to_maxtext gives the same logits.
#   bash end_to_end/sft_lora.sh [WORK_DIR]
source "$(dirname "$0")/hf_round_trip.sh"

echo "== build a tiny Qwen3, its tokenizer and chat template in $W/hf; chats in $W/chats.jsonl"
$PY -c 'import sys; from end_to_end.tiny_hf import save_tiny; from end_to_end import tiny_chat as c
W = sys.argv[1]
tok = c.save_chat_tokenizer(W + "/hf", c.untagged(c.QWEN3_TAGGED))
save_tiny(W + "/hf", "Qwen3Config", "Qwen3ForCausalLM", vocab_size=len(tok), hidden_size=64,
          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=False,
          initializer_range=0.3)   # a base whose head can make peaked predictions
c.write_jsonl(W + "/chats.jsonl", c.conversations(400))' "$W"

echo "== convert to our checkpoint"
$PY -m MaxText.checkpoint_conversion.to_maxtext hf_path="$W/hf" output_path="$W/ckpt"

echo "== LoRA SFT: 80 steps, rank 8, loss on the assistant tokens"
$PY train.py configs/sft.yml load_parameters_path="$W/ckpt" tokenizer_path="$W/hf/tokenizer.json" \
    dataset_path="$W/chats.jsonl" lora_rank=8 lora_alpha=16 learning_rate=1e-2 steps=80 \
    warmup_steps=5 per_device_batch_size=8 max_target_length=128 checkpoint_period=80 \
    log_period=10 base_output_directory="$W/runs" run_name=lora ici_fsdp_parallelism=1 \
    enable_tensorboard=false

echo "== export merged and as a PEFT adapter; import the adapter back"
$PY -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path="$W/runs/lora/checkpoints" \
    output_path="$W/merged"
$PY -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path="$W/runs/lora/checkpoints" \
    output_path="$W/peft" adapter_format=peft
$PY -m MaxText.checkpoint_conversion.to_maxtext hf_path="$W/hf" adapter_path="$W/peft" \
    output_path="$W/back"

echo "== the assistant loss fell; transformers, transformers + peft and our import agree with us"
$PY - "$W" <<'PYEOF'
import json, sys
import numpy as np, peft, torch, transformers
from MaxText.checkpoint_conversion.to_huggingface import checkpoint_config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def
from MaxText.resolve import lora_base

W = sys.argv[1]
rows = [json.loads(l) for l in open(f"{W}/runs/lora/metrics.jsonl")]
first, last = np.mean([r["loss"] for r in rows[:5]]), np.mean([r["loss"] for r in rows[-5:]])
print(f"assistant-token loss: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
assert last < first - 1.0, (first, last)

def ours(ckpt, tokens):
  mcfg = ModelConfig.from_config(checkpoint_config(ckpt))
  md = make_model_def(mcfg)
  params = lora_base.load_host(ckpt, mcfg, md.abstract_params)   # a LoRA run's: adapters + its base
  pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return np.asarray(md.apply(params, tokens, pos, np.ones(tokens.shape, np.int32)))

def theirs(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()

tok = transformers.AutoTokenizer.from_pretrained(f"{W}/hf")
chat = [{"role": "user", "content": "hello how are"}, {"role": "assistant", "content": "how are you"}]
tokens = np.asarray([tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]],
                    np.int32)
want = ours(f"{W}/runs/lora/checkpoints", tokens)
base = transformers.AutoModelForCausalLM.from_pretrained(f"{W}/hf").eval()
base_err = float(np.max(np.abs(theirs(base, tokens) - want)))   # before peft wraps the base
for name, got in [
    ("transformers (merged export)",
     theirs(transformers.AutoModelForCausalLM.from_pretrained(f"{W}/merged").eval(), tokens)),
    ("transformers + peft (base + adapter)",
     theirs(peft.PeftModel.from_pretrained(base, f"{W}/peft").eval(), tokens)),
    ("ours from the imported adapter", ours(f"{W}/back", tokens))]:
  err = float(np.max(np.abs(got - want)))
  print(f"{name}: max |logit difference| {err:.2e}")
  assert err <= 1e-4 * max(1.0, float(np.max(np.abs(want)))), err
print(f"(the base model alone differs by {base_err:.2e}: the adapters were trained)")
assert base_err > 1e-2
PYEOF
echo "OK: $W"
