"""Chat data for the SFT / LoRA tests and end_to_end/sft_lora.sh, built offline: a byte-level BPE
tokenizer trained in memory (offsets like Qwen's and Gemma's), saved with a chat template as
transformers saves it, Qwen3- and Gemma-style templates (with {% generation %} blocks, and
`untagged` without), and a small generated chat set whose answers are learnable."""
import json
import os

QWEN3_TAGGED = (
    "{%- for message in messages %}\n"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{% generation %}{{- '<think>\\n\\n</think>\\n\\n' + message.content"
    " + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{%- endif %}{{- '\\n' }}\n"
    "{%- elif message.role in ['system', 'user', 'tool'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- else %}{{ raise_exception('unknown role ' + message.role) }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")
GEMMA_TAGGED = (
    "{{ bos_token }}{%- for message in messages %}\n"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{{- '<start_of_turn>' + role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{- message.content | trim }}"
    "<end_of_turn>{% endgeneration %}{%- else %}{{- message.content | trim }}<end_of_turn>"
    "{%- endif %}{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}\n")


def untagged(template: str) -> str:
  """The same template without its {% generation %} blocks (renders the same text)."""
  return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


SPECIALS = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>",
            "<think>", "</think>"]
WORDS = ("hello how are you today fine thanks what is the capital of france paris two plus "
         "three equals five tell me a joke why did chicken cross road system be brief answer "
         "user assistant model tool weather sunny rain name my yes no please").split()


def conversations(n: int, seed: int = 0) -> list[dict]:
  """`n` generated chat records (multi-turn messages and prompt/completion), deterministic. The
  assistant always answers a question with the word after its last word in WORDS (learnable)."""
  import random
  rng = random.Random(seed)
  out = []
  for i in range(n):
    msgs = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
    for _ in range(1 + i % 2):
      q = rng.sample(WORDS, 3)
      msgs.append({"role": "user", "content": " ".join(q)})
      msgs.append({"role": "assistant",
                   "content": " ".join(WORDS[(WORDS.index(w) + 1) % len(WORDS)] for w in q)})
    if i % 4 == 3:
      out.append({"prompt": msgs[-2]["content"], "completion": msgs[-1]["content"]})
    else:
      out.append({"messages": msgs})
  return out


def write_jsonl(path, records) -> str:
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def save_chat_tokenizer(folder, template: str | None, vocab_size: int = 320,
                        bos_token: str | None = "<s>"):
  """A byte-level BPE tokenizer (trained on the generated chat text) with `template`, saved by
  transformers; returns transformers' tokenizer loaded from `folder`. `bos_token=None`: none (as
  Qwen3's)."""
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = [json.dumps(c) for c in conversations(200, seed=1)] + [" ".join(WORDS)]
  tok.train_from_iterator(text, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=bos_token, eos_token="<|im_end|>", pad_token="<pad>")
  if template:
    fast.chat_template = template
  os.makedirs(folder, exist_ok=True)
  fast.save_pretrained(str(folder))
  return transformers.AutoTokenizer.from_pretrained(str(folder))

