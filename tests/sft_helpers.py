"""The SFT / LoRA tests' chat data (end_to_end/tiny_chat.py) and their command line."""
import os

from end_to_end.tiny_chat import (GEMMA_TAGGED, QWEN3_TAGGED, WORDS, conversations,  # noqa: F401
                                  save_chat_tokenizer, untagged, write_jsonl)


def sft_argv(out_dir, run_name: str, *overrides: str) -> list[str]:
  """configs/sft.yml + the tests' tiny model (conftest.TINY) + run location + overrides."""
  from conftest import ROOT, TINY
  merged = {}
  for item in [*TINY, "vocab_size=320", f"base_output_directory={out_dir}",
               f"run_name={run_name}", *overrides]:
    key, value = item.split("=", 1)
    merged[key] = value
  return [os.path.join(ROOT, "configs", "sft.yml"), *(f"{k}={v}" for k, v in merged.items())]
