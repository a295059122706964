"""The byte tokenizer (MaxText/data/tokenizers.py `ByteTokenizer`: 0 <pad>, 1 <bos>, 2 <eos>, byte
b -> b + 3) as Hugging Face tokenizer files, so a byte-level model's export loads with
`AutoTokenizer.from_pretrained` and gives our ids.

`tokenizer.json` is a `tokenizers` byte-level BPE without merges: the ByteLevel pre-tokenizer
maps each UTF-8 byte to its printable character (GPT-2's table), the vocabulary maps that
character to the byte's id, the ByteLevel decoder maps back; the post-processor puts <bos> in
front, as training's `add_bos` does. One difference remains: transformers matches the special
tokens' spellings in text ("<bos>" typed in a prompt is id 1), where our tokenizer reads every
character as bytes.
"""
from __future__ import annotations

import json

from MaxText.data.tokenizers import ByteTokenizer
from MaxText.storage import paths


def tokenizer_json() -> str:
  """The byte tokenizer's tokenizer.json (text)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # pylint: disable=g-import-not-at-top
  table = _bytes_to_unicode()
  if sorted(table.values()) != sorted(pre_tokenizers.ByteLevel.alphabet()):
    raise RuntimeError("tokenizers' ByteLevel alphabet is not GPT-2's byte table")
  pad, bos, eos = ByteTokenizer.SPECIAL_TOKENS
  vocab = {pad: 0, bos: 1, eos: 2, **{table[b]: b + ByteTokenizer.OFFSET for b in range(256)}}
  tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                     special_tokens=[(bos, 1)])
  tok.add_special_tokens([pad, bos, eos])
  return tok.to_str(pretty=True)


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer applies)."""
  kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  out, n = {}, 0
  for b in range(256):
    if b in kept:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + n)
      n += 1
  return out


def write(output_dir: str) -> list[str]:
  """Writes tokenizer.json and tokenizer_config.json of the byte tokenizer into `output_dir`."""
  pad, bos, eos = ByteTokenizer.SPECIAL_TOKENS
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "pad_token": pad, "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000_000_000_019_884_624_838_656}
  paths.write_text(paths.join(output_dir, "tokenizer.json"), tokenizer_json())
  paths.write_text(paths.join(output_dir, "tokenizer_config.json"), json.dumps(config, indent=2))
  return ["tokenizer.json", "tokenizer_config.json"]
