"""Compares our model's logits with Hugging Face transformers' on the same tokens.

  python -m MaxText.logit_check hf_path=HF_DIR load_parameters_path=CKPT [dtype=float32] \\
      [max_kl=1e-6] [atol_fraction=1e-4] [seed=0] [long_length=512]

`hf_path`, `load_parameters_path`, `dtype` (auto: float32, as in every tool that compares
against a reference) and `seed` (of the random token ids) are config keys (configs/base.yml).
`dtype=bfloat16` runs transformers in bf16 and our model with bf16 compute; its defaults are
`max_kl=0.015` (the bound MaxText's own bf16 checks use) and no |Δlogit| bound.

Cases: a short prompt, a long one (`long_length` tokens, capped at the model's position limit) and
a packed row holding two documents (segment ids + restarting positions), which must equal
transformers run on each document alone. Token ids are drawn from the vocabulary with `seed`.
Prints per-case max per-token KL(HF ‖ ours) and max |Δlogit|; the LAST line is
`max_kl=<x> max_abs_diff=<y>`. Exit 0 only if the largest per-token KL is at most the limit
`max_kl` and max |Δ| ≤ atol_fraction × max|logit|; 6 otherwise (the check failed); 2 on bad
arguments (or a missing folder); 4 on a damaged checkpoint.

In float32 with the default limits, a model whose logits exceed them against transformers' fp32
is judged against the exact values instead: transformers in float64 on the same weights (the
model converted in place after the float32 pass: twice its float32 memory). transformers' fp32
is then only one more fp32 evaluation with its own rounding error, which grows with the weights'
magnitude and the depth; ours passes when its own error against float64 is at most twice the
reference's (|Δlogit|; the two evaluations' errors are of one size, not equal) or within the
fixed limit, and its KL(float64 ‖ ours) at most 4x (KL grows as the square of the logit error)
KL(float64 ‖ transformers' fp32), or within the fixed limit. The report prints both errors and
says which limits it applied. Limits given on the command line are always applied as given,
against transformers at `dtype`.

Examples:
  python -m MaxText.logit_check hf_path=hf_out load_parameters_path=runs/ft/checkpoints
  python -m MaxText.logit_check hf_path=hf_out load_parameters_path=ckpt dtype=bfloat16 seed=3
"""
from __future__ import annotations

import sys

import numpy as np

from MaxText.config import cli
from MaxText.config.load import ConfigError, replace
from MaxText.runtime.exit_codes import EXIT_CHECK_FAILED, EXIT_OK, reported

ARGS = {
    "max_kl": cli.Arg(float, None, "largest per-token KL(HF || ours) that passes (float32: 1e-6, "
                      "bfloat16: 0.015)"),
    "atol_fraction": cli.Arg(float, None, "largest |Δlogit| that passes, as a fraction of "
                             "max|logit| (float32: 1e-4, bfloat16: no bound)"),
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
  parsed = cli.parse(argv, ARGS, __doc__, tool="logit_check")
  if parsed is None:
    return 0
  args, given, _ = parsed
  args = {**args, "hf_path": cli.require(given, "hf_path", "the Hugging Face folder (transformers "
                                          "loads it)"),
          "load_parameters_path": cli.require(given, "load_parameters_path", "our checkpoint (a "
                                              "run's checkpoints/, a step, a to_maxtext output)"),
          "dtype": given.dtype, "seed": given.seed}
  if args["dtype"] not in DEFAULT_LIMITS:
    raise ConfigError(f"dtype={args['dtype']!r}: must be one of {', '.join(DEFAULT_LIMITS)}")
  default_kl, default_atol = DEFAULT_LIMITS[args["dtype"]]
  max_kl_limit = default_kl if args["max_kl"] is None else args["max_kl"]
  atol_fraction = default_atol if args["atol_fraction"] is None else args["atol_fraction"]

  import jax
  import torch
  # the Auto class's own module, not transformers' lazy top-level (which names every model)
  from transformers.models.auto.modeling_auto import AutoModelForCausalLM

  from MaxText.checkpoint_conversion.hf_io import read_config
  from MaxText.checkpoint_conversion.to_huggingface import checkpoint_config
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import make_model_def
  from MaxText.resolve import lora_base

  read_config(args["hf_path"])  # refuses auto_map / missing config before transformers reads it
  hf = AutoModelForCausalLM.from_pretrained(
      args["hf_path"], dtype=getattr(torch, args["dtype"]), trust_remote_code=False,
      use_safetensors=True)
  hf.eval()
  cfg = replace(checkpoint_config(args["load_parameters_path"]), dtype=args["dtype"])
  model_def = make_model_def(ModelConfig.from_config(cfg))
  params = lora_base.load_host(args["load_parameters_path"], ModelConfig.from_config(cfg),
                               model_def.abstract_params)

  # jitted: one program per case's length (run eagerly, every op of the model compiles alone)
  apply = jax.jit(model_def.apply)

  def ours(tokens, positions, segments):
    return np.asarray(apply(params, tokens[None], positions[None], segments[None]))[0]

  def theirs(tokens):   # the logits in float64 (exactly the values transformers computed)
    with torch.no_grad():
      return hf(torch.tensor(tokens[None], dtype=torch.long)).logits[0].double().numpy()

  rng = np.random.default_rng(args["seed"])
  vocab = cfg.vocab_size
  long_len = min(args["long_length"], cfg.max_position_embeddings)
  doc_a, doc_b = rng.integers(0, vocab, 40), rng.integers(0, vocab, 24)
  cases = {}   # name -> (the case's documents, our logits of them)
  for name, toks in (("short", rng.integers(0, vocab, 16)), ("long", rng.integers(0, vocab, long_len))):
    toks = toks.astype(np.int32)
    cases[name] = ([toks], ours(toks, np.arange(len(toks), dtype=np.int32),
                                np.ones(len(toks), np.int32)))
  packed = np.concatenate([doc_a, doc_b]).astype(np.int32)
  positions = np.concatenate([np.arange(len(doc_a)), np.arange(len(doc_b))]).astype(np.int32)
  segments = np.concatenate([np.ones(len(doc_a)), 2 * np.ones(len(doc_b))]).astype(np.int32)
  cases["packed"] = ([doc_a.astype(np.int32), doc_b.astype(np.int32)],
                     ours(packed, positions, segments))
  refs = {name: np.concatenate([theirs(d) for d in docs]) for name, (docs, _) in cases.items()}

  max_kl = max_diff = max_logit = 0.0
  for name, (_, got) in cases.items():
    ref = refs[name]
    kl = kl_per_token(ref, got)
    diff = np.abs(ref - got).max(axis=-1)
    print(f"{name:7s} tokens={len(ref):4d}  max_kl={kl.max():.3e}  max_abs_diff={diff.max():.3e}  "
          f"max|logit|={np.abs(ref).max():.3f}  worst token={int(np.argmax(kl))}")
    max_kl, max_diff = max(max_kl, float(kl.max())), max(max_diff, float(diff.max()))
    max_logit = max(max_logit, float(np.abs(ref).max()))
  ok = max_kl <= max_kl_limit and max_diff <= atol_fraction * max_logit
  defaults = args["max_kl"] is None and args["atol_fraction"] is None
  if not ok and args["dtype"] == "float32" and defaults:
    print(f"over the fixed limits (max_kl {max_kl_limit:g}, max_abs_diff "
          f"{atol_fraction * max_logit:.3e}) against transformers' fp32: judging both against "
          f"transformers in float64 (the exact values)")
    hf.config._experts_implementation = "eager"   # grouped_mm has no float64 kernel
    # (transformers' `to` is `@wraps(torch.nn.Module.to)`: its stub reads as the unbound method)
    hf.to(torch.float64)  # pyright: ignore[reportArgumentType]
    ok = judged_against_float64(
        {name: (np.concatenate([theirs(d) for d in docs]), refs[name], got)
         for name, (docs, got) in cases.items()}, max_kl_limit, atol_fraction)
  else:
    print("PASS" if ok else f"FAIL (limits: max_kl {max_kl_limit:g}, max_abs_diff "
          f"{atol_fraction * max_logit:.3e})")
  print(f"max_kl={max_kl:.6e} max_abs_diff={max_diff:.6e}")
  return EXIT_OK if ok else EXIT_CHECK_FAILED


def judged_against_float64(cases: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                           max_kl_limit: float, atol_fraction: float) -> bool:
  """{case: (float64 logits, transformers' fp32 logits, ours)}: prints each case's errors against
  float64 and the verdict; ours passes when no worse than twice transformers' fp32 in |Δlogit|
  (4x in KL), or within the fixed limits."""
  ours_diff = ref_diff = ours_kl = ref_kl = max_logit = 0.0
  for name, (exact, ref, got) in cases.items():
    d_ours, d_ref = float(np.abs(got - exact).max()), float(np.abs(ref - exact).max())
    k_ours, k_ref = float(kl_per_token(exact, got).max()), float(kl_per_token(exact, ref).max())
    print(f"{name:7s} vs float64: ours max_abs_diff={d_ours:.3e} max_kl={k_ours:.3e} | "
          f"transformers fp32 max_abs_diff={d_ref:.3e} max_kl={k_ref:.3e}")
    ours_diff, ref_diff = max(ours_diff, d_ours), max(ref_diff, d_ref)
    ours_kl, ref_kl = max(ours_kl, k_ours), max(ref_kl, k_ref)
    max_logit = max(max_logit, float(np.abs(exact).max()))
  diff_limit = max(atol_fraction * max_logit, 2 * ref_diff)
  kl_limit = max(max_kl_limit, 4 * ref_kl)
  ok = ours_diff <= diff_limit and ours_kl <= kl_limit
  print(f"{'PASS' if ok else 'FAIL'} against float64 (limits from transformers' own fp32 error: "
        f"max_abs_diff {diff_limit:.3e} = max(2 x {ref_diff:.3e}, {atol_fraction:g} x "
        f"max|logit|), max_kl {kl_limit:.3e} = max(4 x {ref_kl:.3e}, {max_kl_limit:g}); ours "
        f"{ours_diff:.3e}, {ours_kl:.3e})")
  return ok

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
