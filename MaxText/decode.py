"""Generates text from a trained model (MaxText.inference underneath).

  python -m MaxText.decode configs/base.yml load_parameters_path=CKPT prompt="def main(" \\
      max_new_tokens=64 [temperature=0.8 top_p=0.95 seed=1] [decode_output=out.jsonl]

Parameters: `load_parameters_path` (a run's checkpoints/, a step, a converter's output) or
`hf_path=HF_DIR` (a Hugging Face folder, converted in memory). Prompts, one of: `prompt="..."`,
`prompt_ids=1,5,9` (token ids: no tokenizer needed), `prompt_file=F` (one prompt per line, or
.jsonl lines with "prompt", "prompt_ids" or chat "messages", these with "tools" and
"chat_template_kwargs" as transformers' apply_chat_template takes them); `chat=true` renders text prompts as a
user message with the tokenizer's own chat template. Images and audio (a model whose family takes
them): `image=chart.png` / `audio=clip.wav` (repeat the key for several) go with the one prompt
(placed as MaxText/data/multimodal/prompts.py says: before the text, or where it holds the
placeholder tokens), a prompt_file's .jsonl line takes its own "images" / "audio" lists or chat
messages with {"type": "image", "image": path} / {"type": "audio", "audio": path} parts, all
prepared by the model's processor as transformers' is. Sampling: `temperature` (0 = greedy),
`top_k`, `top_p`, `min_p`, `seed`; stopping: `max_new_tokens`, `eos_ids` ([] = the tokenizer's
eos), `stop='["\\n\\n"]'` strings. The tokenizer: `tokenizer_path`, else the checkpoint's or the
Hugging Face folder's. Every decoding key: configs/base.yml, section "decoding".

Prints each prompt and its continuation (their text, or their ids without a tokenizer; control
characters escaped, `\\x00`, so a log stays text; white space at the end, which a block cannot
show, written after it, quoted as Python writes a string, with its count), after a header saying
how the completion ended; the first line (stderr) names the model,
with its weights' integer width when the checkpoint is quantized. `decode_output=FILE.jsonl`
writes one JSON line per prompt (the exact text): prompt_ids, output_ids, output_logprobs (of the chosen tokens
under the unmodified distribution), text, finish_reason. Exit 0; 2 on a bad config or request
(an empty prompt, a prompt longer than the cache or the model's positions, max_new_tokens that
overflows them, no chat template, no tokenizer for text, an image or clip for a model without that
tower, more soft tokens than the positions leave room for); 3 on an image or audio file that
cannot be read; 4 on a damaged checkpoint.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from typing import Any, Sequence

from MaxText.config import cli
from MaxText.config.load import ConfigError, load_config
from MaxText.data.errors import DataError
from MaxText.data.multimodal import audio as audio_lib
from MaxText.data.multimodal import images as images_lib
from MaxText.data.multimodal.errors import MediaError
from MaxText.data.printable import printable
from MaxText.decoding.errors import InferenceError
from MaxText.runtime.exit_codes import EXIT_OK, reported
from MaxText.runtime.startup import StartupClock

PROMPT_KEYS = ("prompt", "prompt_ids", "prompt_file")


def read_prompt_file(path: str) -> list[Any]:
  """Prompts of a file: .jsonl objects (prompt / prompt_ids / messages) or lines of text."""
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise ConfigError(f"prompt_file '{path}' does not exist")
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  prompts = []
  for n, line in enumerate(lines, 1):
    if path.endswith(".jsonl"):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except ValueError as e:
        raise ConfigError(f"prompt_file {path} line {n} is not JSON: {e}") from None
      if not isinstance(obj, dict):
        raise ConfigError(f"prompt_file {path} line {n}: expected an object with prompt, "
                          f"prompt_ids or messages")
      prompts.append(obj)
    elif not line:
      raise ConfigError(f"prompt_file {path} line {n} is an empty prompt")
    else:
      prompts.append(line)
  if not prompts:
    raise ConfigError(f"prompt_file {path} holds no prompt")
  return prompts


def prompts_of(cfg) -> list[Any]:
  given = [k for k in PROMPT_KEYS if getattr(cfg, k)]
  if len(given) != 1:
    raise ConfigError("give exactly one of prompt=..., prompt_ids=..., prompt_file=... (got "
                      f"{', '.join(given) or 'none'})")
  if cfg.prompt_file:
    return read_prompt_file(cfg.prompt_file)
  return [cfg.prompt_ids] if cfg.prompt_ids else [cfg.prompt]


def check_media_files(cfg) -> None:
  """The image= and audio= files read (MediaError, exit 3, naming one that does not), before the
  model loads; they go with one prompt."""
  if (cfg.image or cfg.audio) and cfg.prompt_file:
    raise ConfigError("image= / audio= go with prompt= or prompt_ids=; a prompt_file's .jsonl "
                      "lines take their own \"images\" / \"audio\" lists")
  for i, path in enumerate(cfg.image):
    images_lib.read_image(path, f"image={path} (image {i})")
  for i, path in enumerate(cfg.audio):
    audio_lib.read_wav(path, None, f"audio={path} (clip {i})")


def prompt_text(model, ids: Sequence[int]) -> str | None:
  """The prompt's text, each run of image / audio soft tokens shown once with its count
  (`<|image|>×280`)."""
  processor = model.processor if model.tokenizer is not None else None
  names = {processor.ids[n]: processor.tokens[n] for n in ("image_token", "audio_token")
           if n in processor.ids} if processor is not None else {}
  soft = set(names)
  if not soft & set(ids):
    return model.text(ids)
  parts, start = [], 0
  for (is_soft, token), run in itertools.groupby(
      ids, key=lambda t: (t in soft, t if t in soft else None)):
    n = len(list(run))
    parts.append(f"{names[token]}×{n}" if is_soft else model.text(ids[start:start + n]))
    start += n
  return "".join(p for p in parts if p)


def shown(text: str | None, ids: Sequence[int], what: str) -> str:
  """`what`, then the text as an indented block (escaped), or the ids without a tokenizer. White
  space the block cannot show (at its end: spaces, newlines, tabs) is written after it, quoted
  as Python writes a string ('\\n  '), with its count; text of white space only is shown so, with
  its ids."""
  if text is None:
    return f"{what}:\n  | {' '.join(map(str, ids))}"
  body = printable(text)
  kept = body.rstrip()
  tail = body[len(kept):]
  ids_text = " ".join(map(str, ids)) or "none"
  if not kept:
    return (f"{what}: no text (ids {ids_text})" if not tail else
            f"{what}: white space only, {tail!r} (ids {ids_text})")
  lines = "\n".join(f"  | {line}" if line else "  |" for line in kept.split("\n"))
  if tail:
    lines += f"\n  (then {len(tail)} white-space character{'s' if len(tail) > 1 else ''}: {tail!r})"
  return f"{what}:\n{lines}"


def load(argv: Sequence[str]) -> Any:
  """The model (`MaxText.inference.load`), its machinery (jax) imported only here: `--help` and a
  refused key answer without it."""
  from MaxText import inference  # pylint: disable=import-outside-toplevel
  return inference.load(argv, per_layer=True)


def main(argv: Sequence[str]) -> int:
  if cli.wants_help(argv):
    cli.print_help(cli.usage(__doc__, {}, "decode"))
    return EXIT_OK
  return reported(lambda: run(argv), (ConfigError, DataError, InferenceError),
                  data=(MediaError,))


def run(argv: Sequence[str]) -> int:
  clock = StartupClock()
  # before the model loads: a bad prompt, or a key decoding does not read, fails fast
  first = load_config(argv, tool="decode")
  prompts = prompts_of(first)
  check_media_files(first)
  if first.speculative_tokens and first.temperature > 0:
    raise ConfigError(f"speculative_tokens={first.speculative_tokens} decodes greedily: set "
                      f"temperature=0 (got {first.temperature:g}) or speculative_tokens=0")
  # the model's machinery (jax) after the checks above: --help and a refused key answer without it
  from MaxText.runtime import compile_cache  # pylint: disable=import-outside-toplevel
  print(compile_cache.use(first.jax_cache_dir), file=sys.stderr)
  clock.mark("config")
  model = load(argv)
  clock.mark("model")
  cfg = model.cfg
  weights = (f"int{cfg.weight_bits} weights (quantized checkpoint"
             + (f", groups of {cfg.weight_group_size}" if cfg.weight_group_size else "") + ")"
             if cfg.weight_bits else "float weights")
  print(f"model {cfg.decoder_block} ({cfg.num_decoder_layers} layers, vocab {cfg.vocab_size}, "
        f"{weights}); {model.tokenizer_source}; {len(prompts)} prompt(s)", file=sys.stderr)
  t0 = time.perf_counter()
  with compile_cache.CompileMeter() as compiling:
    outs = model.generate(prompts, images=first.image or None, audio=first.audio or None)
  seconds = time.perf_counter() - t0
  clock.mark("answer")
  new = sum(len(g.output_ids) for g in outs)
  print(f"{new} tokens in {seconds:.2f} s (compilation included)", file=sys.stderr)
  print(clock.line("the first answer", f"({compiling.text()})"), file=sys.stderr)
  if model.engine.speculative is not None:
    spec = model.engine.speculative
    print(f"speculative decoding: {spec.k} drafted tokens per step, acceptance rate "
          f"{spec.acceptance_rate():.3f} ({spec.stats['accepted']} of {spec.stats['drafted']} "
          "drafts)", file=sys.stderr)
  for i, g in enumerate(outs):
    print(f"--- {i}: {len(g.output_ids)} tokens ({g.finish_reason}) ---")
    print(shown(prompt_text(model, g.prompt_ids), g.prompt_ids, "prompt"))
    print(shown(g.text, g.output_ids, "continued by the model"))
  if cfg.decode_output:
    with open(os.path.expanduser(cfg.decode_output), "w", encoding="utf-8") as f:
      for g in outs:
        f.write(json.dumps(g.as_json(), ensure_ascii=False) + "\n")
    print(f"wrote {cfg.decode_output}", file=sys.stderr)
  return EXIT_OK

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
