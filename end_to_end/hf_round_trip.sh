# Shared steps of the Hugging Face parity scripts, sourced by end_to_end/<family>.sh with the
# script's arguments: on sourcing, set-up (repo root, `setup.sh`, $PY, work dir $W = $1 or a new
# temporary one); then, once the script has built a tiny model in "$W/hf": convert, logit check,
# fine-tune 20 steps with the architecture and tokenizer taken from the checkpoint (extra train.py
# overrides in FINETUNE_ARGS), export, and check that transformers reproduces our logits from the
# export and loads its tokenizer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
W=${1:-$(mktemp -d)}
bash setup.sh
PY=.venv/bin/python
export JAX_PLATFORMS=cpu
FINETUNE_ARGS=()
convert_and_check() {
  echo "== convert to our checkpoint"
  $PY -m MaxText.checkpoint_conversion.to_maxtext hf_path="$W/hf" output_path="$W/ckpt"
  echo "== logit check against transformers"
  $PY -m MaxText.logit_check hf_path="$W/hf" load_parameters_path="$W/ckpt" "$@"
}

finetune_export_check() {
  echo "== fine-tune 20 steps (architecture from the checkpoint)"
  $PY train.py configs/base.yml load_parameters_path="$W/ckpt" base_output_directory="$W/runs" \
      run_name=ft steps=20 warmup_steps=2 checkpoint_period=20 log_period=5 max_target_length=128 \
      ici_fsdp_parallelism=1 "${FINETUNE_ARGS[@]}"
  echo "== export to Hugging Face and check transformers reproduces our logits"
  $PY -m MaxText.checkpoint_conversion.to_huggingface load_parameters_path="$W/runs/ft/checkpoints" \
      output_path="$W/export"
  $PY -m MaxText.logit_check hf_path="$W/export" load_parameters_path="$W/runs/ft/checkpoints"
  echo "== the tokenizer travelled: transformers loads the export's and it encodes as the original"
  $PY -c 'import sys, transformers as t
a, b = (t.AutoTokenizer.from_pretrained(p) for p in sys.argv[1:])
text = "the quick brown fox, twice"
assert a.encode(text) == b.encode(text) and a.chat_template == b.chat_template, (a, b)
print("tokenizer: identical encoding and chat template")' "$W/hf" "$W/export"
  echo "OK: $W"
}
