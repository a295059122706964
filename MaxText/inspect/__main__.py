"""Inspects one prompt: hidden states, attention patterns and logits to an .npz, and pictures.

  python -m MaxText.inspect hf_path=HF_DIR prompt="the quick brown fox" \\
      capture=hidden_states,attentions,logits output=trace.npz plot=pictures/
  python -m MaxText.inspect load_parameters_path=CKPT prompt_ids=1,5,9 layers=0,3 heads=0,1

The model: `hf_path` (a Hugging Face folder, converted in memory) or `load_parameters_path` (a
run's checkpoints/, a step, a converter's output); any other config key as key=value (a first
argument ending in .yml replaces configs/base.yml). The prompt: `prompt="..."` (tokenized with the
model's tokenizer), `prompt_ids=1,5,9`, or a one-prompt `prompt_file`; `image=chart.png` /
`audio=clip.wav` (repeatable) for a model that takes them, as `python -m MaxText.decode` places
them (the npz then has `mm_token_type_ids` and `image_grids`). Attention is computed by the
dot-product path whatever the `attention` key says.

output (npz): `token_ids` [S], `hidden_states` [L+1, S, D] (entry 0 the embeddings, the last after
the final norm, as transformers' output_hidden_states), `attentions_{l}` [H, S, S] per layer with
softmax attention, `logits` [S, V]; with `layers`, only those layers' entries (and
`hidden_states_index`), with `heads`, only those heads (and `heads`); other captured site names
(e.g. capture=resid_post.*) under their names. plot=DIR writes attention_layer{l}.png (a heatmap
per head, token labels) and logit_lens.png (top next token and its probability per hidden state
and position; it needs the hidden states, which plot= captures).
Exit 0; 2 on a bad argument, config or prompt (an image or clip for a model without that tower);
3 on an image or audio file that cannot be read; 4 on a damaged checkpoint.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

import numpy as np

from MaxText.config.cli import Arg, parse
from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError
from MaxText.data.multimodal.errors import MediaError
from MaxText.decoding.errors import InferenceError
from MaxText.runtime.exit_codes import EXIT_OK, reported

ARGS = {
    "capture": Arg(str, "hidden_states,attentions,logits",
                   "what to keep: hidden_states, attentions, logits and/or site names or globs"),
    "output": Arg(str, "trace.npz", "the .npz to write"),
    "plot": Arg(str, "", "a folder for PNG pictures (attention heatmaps, logit lens)"),
    "layers": Arg(str, "", "decoder layers whose hidden states / attentions to keep (default all)"),
    "heads": Arg(str, "", "attention heads to keep (default all)"),
}


def softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _ints(text: str, key: str) -> list[int] | None:
  if not text:
    return None
  try:
    return [int(t) for t in text.split(",")]
  except ValueError:
    raise ConfigError(f"{key}={text!r}: expected integers separated by commas") from None


def run(argv: Sequence[str]) -> int:
  from MaxText.runtime.startup import StartupClock
  clock = StartupClock()
  parsed = parse(argv, ARGS, __doc__, tool="inspect", config_file=True)
  if parsed is None:
    return EXIT_OK
  # the model's machinery (jax): after --help and a bad argument or key
  from MaxText import inference
  from MaxText import inspect as inspect_api
  from MaxText.decode import check_media_files, prompts_of
  from MaxText.runtime import compile_cache
  args, cfg, config_argv = parsed
  layers, heads = _ints(args["layers"], "layers"), _ints(args["heads"], "heads")
  capture = [c for c in args["capture"].split(",") if c]
  if args["plot"] and "hidden_states" not in capture:
    capture.append("hidden_states")
  prompts = prompts_of(cfg)
  if len(prompts) != 1:
    raise ConfigError(f"the inspector takes one prompt; prompt_file holds {len(prompts)}")
  check_media_files(cfg)
  print(compile_cache.use(cfg.jax_cache_dir), file=sys.stderr)
  clock.mark("config")
  m = inspect_api.Inspector(inference.load(config_argv))
  clock.mark("model")
  media = dict(images=cfg.image or None, audio=cfg.audio or None)
  if not m.tokenize(prompts[0]):
    raise ConfigError("the prompt is empty")
  try:
    with compile_cache.CompileMeter() as compiling:
      trace = m.forward(prompts[0], capture=capture, layers=layers, heads=heads, **media)
  except InferenceError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from None
  clock.mark("answer")
  print(clock.line("the first answer", f"({compiling.text()})"), file=sys.stderr)
  ids = [int(t) for t in trace.tokens]
  print(f"model {m.mcfg.decoder_block} ({m.num_layers} layers); {len(ids)} tokens",
        file=sys.stderr)
  out = os.path.expanduser(args["output"])
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  trace.save(out)
  print(f"wrote {out}: {', '.join(sorted(trace.arrays()))}", file=sys.stderr)
  if args["plot"]:
    from MaxText.inspect import plots
    folder = os.path.expanduser(args["plot"])
    os.makedirs(folder, exist_ok=True)
    labels = m.token_text(ids)
    written = []
    if trace.attentions:
      written += plots.attention_heatmaps(trace.attentions, trace.attention_layers, labels,
                                          folder, heads, trace.mm_token_type_ids)
    kept = [i for i, h in enumerate(trace.hidden_states) if h is not None]
    inner = [i for i in kept if i < m.num_layers]
    logits = list(m.lens(np.stack([trace.hidden_states[i] for i in inner])))
    if m.num_layers in kept:     # the last hidden state is after the final norm already
      logits.append(m.lens(trace.hidden_states[m.num_layers], normed=True))
    probs = softmax(np.stack(logits))
    names = ["embeddings" if i == 0 else f"layer {i - 1}" for i in kept]
    written.append(plots.logit_lens(probs, names, labels, m.token_text, folder))
    print(f"wrote {', '.join(written)}", file=sys.stderr)
  return EXIT_OK


def main(argv: Sequence[str]) -> int:
  return reported(lambda: run(argv), (ConfigError, DataError, InferenceError),
                  data=(MediaError,))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
