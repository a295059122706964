"""The SFT / LoRA tests' chat data (end_to_end/tiny_chat.py) and their command line."""
import os

from end_to_end.tiny_chat import (GEMMA_TAGGED, QWEN3_TAGGED, WORDS, conversations,  # noqa: F401
                                  save_chat_tokenizer, untagged, write_jsonl)


def sft_argv(out_dir, run_name: str, *overrides: str) -> list[str]:
  """configs/sft.yml + the tests' tiny model (conftest.TINY) + run location + overrides."""
  from conftest import ROOT, argv
  return argv(out_dir, run_name, "vocab_size=320", *overrides,
              config=os.path.join(ROOT, "configs", "sft.yml"))


def save_qwen3_chat(folder, bos_token: str | None = None, vocab_size: int = 320):
  """A tiny random-init transformers Qwen3 with the chat tokenizer (ChatML template without
  {% generation %} blocks, eos <|im_end|>; no bos by default, as Qwen3's) in `folder`; returns
  transformers' tokenizer."""
  import glob
  from end_to_end.tiny_hf import save_tiny
  save_tiny(str(folder), "Qwen3Config", "Qwen3ForCausalLM", vocab_size=vocab_size,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=1e6,
            tie_word_embeddings=False)
  for name in glob.glob(os.path.join(str(folder), "*")):   # save_tiny's own tokenizer goes
    if not os.path.basename(name).startswith(("config.json", "model", "generation_config")):
      os.remove(name)
  tok = save_chat_tokenizer(folder, untagged(QWEN3_TAGGED), vocab_size, bos_token=bos_token)
  assert len(tok) <= vocab_size
  return tok
