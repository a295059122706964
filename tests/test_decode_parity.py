"""Decoding against the oracles, per family (tiny random HF models, fp32): greedy decoding of a batch
of prompts of different lengths equals transformers' generate(do_sample=False) of the same batch
(left-padded, as transformers batches) token for token for 48 new tokens (Gemma 4 with a sliding window of 4, far shorter than prompt + completion, and a
KV-shared tail); where the two differ the test demands a near-tie (top-2 logit gap < 1e-5 in
transformers' own logits). output_logprobs equal a teacher-forced forward of prompt + completion
(our training forward, and transformers' up to the parity tolerance), `score` equals the same, and
8 fake devices (data x expert x tensor) give the tokens of 1.

The log-probability tolerances come from the exact values: transformers in float64 on the same
weights (`exact_logprobs`). The decoding path and the teacher-forced forward are fp32 evaluations
of the same numbers, with the same magnitudes and reduction lengths summed in other orders (the
cache's shapes, the bucket's padding, the CPU's vector width: AVX2 and AVX-512 split the same dot
products differently, and so do XLA and torch). The size of such an evaluation's error is
measured on transformers' own fp32 forward, independent of our code: e_ref, its largest
|logprob - exact| over every position and vocabulary entry of the test's sequences (S x V
values). Our forward (over the same S x V) and the decode's reported log-probabilities (its N
chosen tokens) must each be within 2 e_ref of the exact values (one evaluation's error is not
another's, but of its size; a bug would be far outside), and |decode - forward| within 2 e, e our
forward's own error (the triangle inequality); against transformers' fp32, 2 e_ref + e_ref. A
floor of 1e-5 keeps each bound above a few fp32 ulps of the least likely entries'
log-probabilities (tens in magnitude), 1e-4 against transformers. A random model's output
RMSNorms amplify rounding, so e_ref is larger for some shapes (Gemma 4 MoE, Qwen3-Next)."""
import functools

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from decoding_helpers import (MESH_8, engine, family_models, hf_greedy,  # noqa: E402
                              hf_next_logits, log_softmax)

NEW = 48
PROMPT_LENGTHS = (3, 11, 6)
NEAR_TIE = 1e-5      # top-2 logit gap below which fp32 rounding may pick either token
TOL_LOGPROB = 1e-5   # floor: cached decoding vs the teacher-forced forward (other sum order)
TOL_HF_LOGPROB = 1e-4


def prompts(vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(7)
  return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def forward_logprobs(model_def, params, seqs: list[np.ndarray], width: int) -> list[np.ndarray]:
  """log_softmax of the training forward of each sequence, all in one batch padded to `width`
  (segment 0 after each): [len(seq), V] per sequence."""
  tokens = np.zeros((len(seqs), width), np.int32)
  segments = np.zeros((len(seqs), width), np.int32)
  for i, seq in enumerate(seqs):
    tokens[i, :len(seq)], segments[i, :len(seq)] = seq, 1
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
  logits = np.asarray(jax.jit(model_def.apply)(params, tokens, positions, segments))   # one program
  return [log_softmax(logits[i, :len(seq)]) for i, seq in enumerate(seqs)]


def exact_logprobs(hf, seqs: list[np.ndarray]) -> list[np.ndarray]:
  """log_softmax of transformers' forward in float64 (a copy of `hf`): the exact values up to
  ~1e-15, against which any fp32 evaluation's own rounding error is measured."""
  import copy
  hf64 = copy.deepcopy(hf).double()
  hf64.config._experts_implementation = "eager"   # grouped_mm has no float64 kernel
  with torch.no_grad():
    return [log_softmax(hf64(torch.tensor(s[None], dtype=torch.long), use_cache=False)
                        .logits[0].numpy()) for s in seqs]


@functools.lru_cache(maxsize=None)
def one_device(family: str):
  """(mcfg, model def, the 4-row Engine on one device, its placed parameters), shared by the
  file's tests of `family`, so its decoding programs are traced and compiled once."""
  mcfg, model_def, params = family_models()[family][1]()
  eng = engine(mcfg, batch_size=4)
  return mcfg, model_def, eng, eng.place(params)


def first_difference(a: list[int], b: list[int]) -> int | None:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma4", "gemma4_moe", "qwen3_next"])
def test_greedy_equals_transformers_generate(family):
  hf = family_models()[family][0]()
  mcfg, model_def, eng, params = one_device(family)
  ps = prompts(mcfg.vocab_size)
  got = eng.generate(params, ps, max_new_tokens=NEW)
  seqs = [np.asarray(p + c.output_ids, np.int32) for p, c in zip(ps, got)]
  forwards = forward_logprobs(model_def, params, seqs, 64)
  errors = [np.abs(np.asarray(c.output_logprobs) - f[np.arange(len(p) - 1, len(s) - 1),
                                                       c.output_ids]).max()
            for p, c, s, f in zip(ps, got, seqs, forwards)]
  # each fp32 evaluation's own error against the exact (float64) values, over all S x V entries:
  # transformers' (the yardstick, independent of our code) and our forward's
  exact = exact_logprobs(hf, seqs)
  with torch.no_grad():
    theirs = [log_softmax(hf(torch.tensor(s[None], dtype=torch.long), use_cache=False)
                          .logits[0].numpy()) for s in seqs]
  e_ref = max(np.abs(t - x).max() for t, x in zip(theirs, exact))
  e = max(np.abs(f - x).max() for f, x in zip(forwards, exact))
  bound = max(TOL_LOGPROB, 2 * e_ref)   # what an fp32 evaluation of these numbers may be off by
  print(f"{family}: vs float64: max |logprob error| transformers fp32 {e_ref:.1e}, "
        f"our forward {e:.1e} (bound {bound:.1e})")
  assert e <= bound
  tol = max(TOL_LOGPROB, 2 * e)
  for p, c, seq, err, want in zip(ps, got, seqs, errors, hf_greedy(hf, ps, NEW)):
    assert len(c.output_ids) == NEW and c.finish_reason == "length"
    j = first_difference(c.output_ids, want)
    if j is not None:   # only a near-tie may differ: show it from transformers' own logits
      top2 = np.sort(hf_next_logits(hf, p + want[:j]))[-2:]
      print(f"{family}: prompt of {len(p)} differs at new token {j}, top-2 gap {top2[1] - top2[0]:.1e}")
      assert top2[1] - top2[0] < NEAR_TIE, (j, c.output_ids[j], want[j])
    # the reported log-probabilities: a teacher-forced forward of prompt + completion
    at = (np.arange(len(p) - 1, len(seq) - 1), c.output_ids)
    logprobs = np.asarray(c.output_logprobs)
    off = np.abs(logprobs - exact[ps.index(p)][at]).max()
    print(f"{family}: prompt of {len(p)}: |logprob - forward| {err:.1e} (tolerance {tol:.1e}), "
          f"|logprob - float64| {off:.1e} (bound {bound:.1e})")
    assert err < tol and off <= bound
    hf_at = theirs[ps.index(p)][at]   # transformers' fp32: within both errors
    assert np.abs(logprobs - hf_at).max() < max(TOL_HF_LOGPROB, bound + e_ref)
  scores = eng.score(params, ps, [c.output_ids for c in got])
  for c, s in zip(got, scores):
    assert s.shape == (NEW,) and np.abs(s - np.asarray(c.output_logprobs)).max() < tol


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4"])
def test_eight_devices_give_the_tokens_of_one(family):
  _, _, params = family_models()[family][1]()
  mcfg, _, one, one_params = one_device(family)
  ps = prompts(mcfg.vocab_size)
  eight = engine(mcfg, MESH_8, batch_size=4)
  placed = eight.place(params)
  sharded = [x for x in jax.tree.leaves(placed) if not x.sharding.is_fully_replicated]
  assert sharded   # the parameters are really split over the mesh
  a = one.generate(one_params, ps, max_new_tokens=24)
  b = eight.generate(placed, ps, max_new_tokens=24)
  for x, y in zip(a, b):
    assert x.output_ids == y.output_ids
    assert np.abs(np.asarray(x.output_logprobs) - np.asarray(y.output_logprobs)).max() < TOL_LOGPROB


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_the_pallas_decoding_kernel_gives_the_tokens_of_the_einsums(family):
  """`decode_attention=pallas` (MaxText/kernels/decode_attention.py, interpreted on the CPU):
  Gemma 4's full layers on the kernel beside its sliding layers on the einsums; prompts of
  different lengths, so each row's live length differs."""
  import dataclasses
  mcfg, _, one, params = one_device(family)
  ps = prompts(mcfg.vocab_size)
  pallas = engine(dataclasses.replace(mcfg, decode_attention="pallas"), batch_size=4)
  a = one.generate(params, ps, max_new_tokens=12)
  b = pallas.generate(params, ps, max_new_tokens=12)
  for x, y in zip(a, b):
    assert x.output_ids == y.output_ids
    assert np.abs(np.asarray(x.output_logprobs) - np.asarray(y.output_logprobs)).max() < TOL_LOGPROB


def test_the_plain_paths_decoding_step_gives_the_tokens_of_the_tuned_one():
  """XLA's plain hot path (GPU / TPU) with the kernel, as a TPU decodes: its decoding step's
  projections as 2-D matmuls (`DenseGeneral.flat`) and the kernel storing the step's K/V, against
  the CPU's tuned path with the einsums."""
  import dataclasses
  mcfg, _, one, params = one_device("qwen3")
  ps = prompts(mcfg.vocab_size)
  plain = engine(dataclasses.replace(mcfg, decode_attention="pallas", hot_path="plain"),
                 batch_size=4)
  for x, y in zip(one.generate(params, ps, max_new_tokens=12),
                  plain.generate(params, ps, max_new_tokens=12)):
    assert x.output_ids == y.output_ids
    assert np.abs(np.asarray(x.output_logprobs) - np.asarray(y.output_logprobs)).max() < TOL_LOGPROB
