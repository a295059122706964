"""Compares our model's logits with Hugging Face transformers' on the same tokens.

  python -m MaxText.logit_check hf_path=HF_DIR load_parameters_path=CKPT [dtype=float32] \
      [max_kl=1e-6] [atol_fraction=1e-4] [seed=0] [long_length=512]

`dtype=bfloat16` runs transformers in bf16 and our model with bf16 compute; its defaults are
`max_kl=0.015` (the bound MaxText's own bf16 checks use) and no |Δlogit| bound.

Cases: a short prompt, a long one (`long_length` tokens, capped at the model's position limit) and
a packed row holding two documents (segment ids + restarting positions), which must equal
transformers run on each document alone. Token ids are drawn from the vocabulary with `seed`.
Prints per-case max per-token KL(HF ‖ ours) and max |Δlogit|; the LAST line is
`max_kl=<x> max_abs_diff=<y>`. Exit 0 only if max_kl ≤ max_kl and max |Δ| ≤ atol_fraction ×
max|logit|; 1 otherwise; 2 on bad arguments (or a missing folder); 4 on a damaged checkpoint.

Examples:
  python -m MaxText.logit_check hf_path=hf_out load_parameters_path=runs/ft/checkpoints
  python -m MaxText.logit_check hf_path=hf_out load_parameters_path=ckpt dtype=bfloat16 seed=3
"""
from __future__ import annotations

import sys

import numpy as np

from MaxText.config import cli
from MaxText.config.load import ConfigError, replace
from MaxText.runtime.exit_codes import reported

ARGS = {
    "hf_path": cli.Arg(help="the Hugging Face folder (transformers loads it)"),
    "load_parameters_path": cli.Arg(help="our checkpoint (a run's checkpoints/, a step, or a "
                                    "to_maxtext output)"),
    "dtype": cli.Arg(str, "float32", "float32 | bfloat16: both sides compute in it"),
    "max_kl": cli.Arg(float, None, "largest per-token KL(HF || ours) that passes (float32: 1e-6, "
                      "bfloat16: 0.015)"),
    "atol_fraction": cli.Arg(float, None, "largest |Δlogit| that passes, as a fraction of "
                             "max|logit| (float32: 1e-4, bfloat16: no bound)"),
    "seed": cli.Arg(int, 0, "seed of the random token ids"),
    "long_length": cli.Arg(int, 512, "tokens of the long case (capped at the model's positions)"),
}
DEFAULT_LIMITS = {"float32": (1e-6, 1e-4), "bfloat16": (0.015, float("inf"))}


def kl_per_token(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
  """KL(softmax(ref) ‖ softmax(ours)) per token, in float64."""
  a, b = ref_logits.astype(np.float64), logits.astype(np.float64)
  la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
  lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
  return np.sum(np.exp(la) * (la - lb), axis=-1)


def main(argv: list[str]) -> int:
  return reported(lambda: run(argv), (ConfigError, ValueError, KeyError, FileNotFoundError))


def run(argv: list[str]) -> int:
  parsed = cli.parse(argv, ARGS, __doc__)
  if parsed is None:
    return 0
  args = parsed[0]
  if args["dtype"] not in DEFAULT_LIMITS:
    raise ConfigError(f"dtype={args['dtype']!r}: must be one of {', '.join(DEFAULT_LIMITS)}")
  default_kl, default_atol = DEFAULT_LIMITS[args["dtype"]]
  max_kl_limit = default_kl if args["max_kl"] is None else args["max_kl"]
  atol_fraction = default_atol if args["atol_fraction"] is None else args["atol_fraction"]

  import torch
  import transformers

  from MaxText.checkpoint_conversion.hf_io import read_config
  from MaxText.checkpoint_conversion.to_huggingface import checkpoint_config
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import make_model_def
  from MaxText.resolve import lora_base

  read_config(args["hf_path"])  # refuses auto_map / missing config before transformers reads it
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      args["hf_path"], dtype=getattr(torch, args["dtype"]), trust_remote_code=False,
      use_safetensors=True)
  hf.eval()
  cfg = replace(checkpoint_config(args["load_parameters_path"]), dtype=args["dtype"])
  model_def = make_model_def(ModelConfig.from_config(cfg))
  params = lora_base.load_host(args["load_parameters_path"], ModelConfig.from_config(cfg),
                               model_def.abstract_params)

  def ours(tokens, positions, segments):
    return np.asarray(model_def.apply(params, tokens[None], positions[None], segments[None]))[0]

  def theirs(tokens):
    with torch.no_grad():
      return hf(torch.tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()

  rng = np.random.default_rng(args["seed"])
  vocab = cfg.vocab_size
  long_len = min(args["long_length"], cfg.max_position_embeddings)
  doc_a, doc_b = rng.integers(0, vocab, 40), rng.integers(0, vocab, 24)
  cases = {}
  for name, toks in (("short", rng.integers(0, vocab, 16)), ("long", rng.integers(0, vocab, long_len))):
    toks = toks.astype(np.int32)
    cases[name] = (theirs(toks), ours(toks, np.arange(len(toks), dtype=np.int32),
                                      np.ones(len(toks), np.int32)))
  packed = np.concatenate([doc_a, doc_b]).astype(np.int32)
  positions = np.concatenate([np.arange(len(doc_a)), np.arange(len(doc_b))]).astype(np.int32)
  segments = np.concatenate([np.ones(len(doc_a)), 2 * np.ones(len(doc_b))]).astype(np.int32)
  cases["packed"] = (np.concatenate([theirs(doc_a.astype(np.int32)), theirs(doc_b.astype(np.int32))]),
                     ours(packed, positions, segments))

  max_kl = max_diff = max_logit = 0.0
  for name, (ref, got) in cases.items():
    kl = kl_per_token(ref, got)
    diff = np.abs(ref - got).max(axis=-1)
    print(f"{name:7s} tokens={len(ref):4d}  max_kl={kl.max():.3e}  max_abs_diff={diff.max():.3e}  "
          f"max|logit|={np.abs(ref).max():.3f}  worst token={int(np.argmax(kl))}")
    max_kl, max_diff = max(max_kl, float(kl.max())), max(max_diff, float(diff.max()))
    max_logit = max(max_logit, float(np.abs(ref).max()))
  ok = max_kl <= max_kl_limit and max_diff <= atol_fraction * max_logit
  print("PASS" if ok else f"FAIL (limits: max_kl {max_kl_limit:g}, max_abs_diff "
        f"{atol_fraction * max_logit:.3e})")
  print(f"max_kl={max_kl:.6e} max_abs_diff={max_diff:.6e}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
