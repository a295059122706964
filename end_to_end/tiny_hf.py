"""Builds a tiny random-init Hugging Face model for the end_to_end parity scripts and saves it
(safetensors + config.json, as `save_pretrained` writes it). Weights that initialise to a constant
are perturbed (+0.1 N(0, 1)) so that a scale `w`, its `1 + w` variant or a forgotten factor cannot
look alike: parameters whose name contains "norm" or ends with one of `perturb_suffixes`, and
buffers ending with one of `buffer_suffixes`.

  save_tiny(folder, "Qwen3Config", "Qwen3ForCausalLM", vocab_size=384, ...)

The folder also gets a tiny tokenizer (`save_tiny_tokenizer`): a byte-level BPE trained on a few
sentences and saved by transformers itself (tokenizer.json, tokenizer_config.json with bos <|bos|>,
eos <|eos|>, pad <pad>; chat_template.jinja), so the tokenizer travels through conversion,
fine-tuning and export like a real model's. Its vocabulary also holds [CLS], [SEP], <s> and </s>,
which must never be taken for bos/eos by their spelling.
"""
from __future__ import annotations

CORPUS = ["the quick brown fox jumps over the lazy dog",
          "pack my box with five dozen liquor jugs",
          "how vexingly quick daft zebras jump",
          "sphinx of black quartz judge my vow"] * 5
SPECIALS = ["<pad>", "<|bos|>", "<|eos|>", "<unk>", "[CLS]", "[SEP]", "<s>", "</s>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>"
                 "{% endfor %}")


def trained_tokenizer(vocab_size: int = 300):
  """A `tokenizers.Tokenizer` (byte-level BPE, no unknown bytes) with `SPECIALS` as ids 0-7."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS, trainer)
  return tok


def save_tiny_tokenizer(folder: str, vocab_size: int = 300):
  """transformers' own save of `trained_tokenizer` (bos, eos, pad, chat template); returns the
  transformers tokenizer."""
  import transformers
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=trained_tokenizer(vocab_size), bos_token="<|bos|>", eos_token="<|eos|>",
      pad_token="<pad>", unk_token="<unk>")
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(str(folder))
  return fast


def save_tiny(folder: str, config_cls: str, model_cls: str, *, seed: int = 0,
              perturb_suffixes: tuple[str, ...] = (), buffer_suffixes: tuple[str, ...] = (),
              **config) -> None:
  import torch
  import transformers
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or (perturb_suffixes and name.endswith(perturb_suffixes)):
        p.add_(0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if buffer_suffixes and name.endswith(buffer_suffixes):
        b.add_(0.1 * torch.randn_like(b))
  model.save_pretrained(folder)
  save_tiny_tokenizer(folder)
