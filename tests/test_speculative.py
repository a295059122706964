"""Speculative greedy decoding with the MTP head as the drafter (MaxText/decoding/speculative.py):
its output equals plain greedy decoding's, token for token, for the llama family (the cache rolls
back by position) and Qwen3-Next (the linear layers' recurrent state advanced by the accepted
tokens from what the verification kept), with one forward of the main model a round.

The drafter must be right often enough to exercise acceptance and wrong often enough to exercise
rejection: the tiny random models' layers are scaled down so that the next token is mostly a
function of the current one (a bigram map), and the MTP block is made that bigram map exactly
(fc = [I | 0], its layer's outputs zero): drafts are accepted until the context changes the main
model's choice.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import BASE_YML
from decoding_helpers import engine
from MaxText.config.load import load_config
from MaxText.decoding.engine import DecodeError
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params

TINY = ("dtype=float32", "weight_dtype=float32", "emb_dim=32", "num_decoder_layers=2",
        "num_query_heads=2", "num_kv_heads=1", "head_dim=16", "mlp_dim=64", "vocab_size=40",
        "mtp_num_layers=1")
QWEN3_NEXT = ("decoder_block=qwen3_next", "attention_pattern=lf", "linear_num_key_heads=2",
              "linear_num_value_heads=2", "linear_key_head_dim=16", "linear_value_head_dim=16",
              "partial_rotary_factor=0.5")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 11, [20, 5]]


def mcfg_of(family: str) -> ModelConfig:
  return ModelConfig.from_config(load_config(
      [BASE_YML, *TINY, *(QWEN3_NEXT if family == "qwen3_next" else ())]))


def bigram_drafted(params, mixing: float):
  """The decoder's mixer and MLP outputs scaled by `mixing`; the MTP block the bigram drafter.
  Host (NumPy) arrays, as `Engine.place` takes them: no device program per edited leaf."""
  def scale(path, x):
    names = [str(getattr(k, "key", k)) for k in path]
    x = np.asarray(x)
    if names[0] == "mtp":
      if names[1] == "fc":
        D = x.shape[1]
        return np.concatenate([np.eye(D, dtype=x.dtype), np.zeros((D, D), x.dtype)])
      if names[-2] in ("out", "down"):
        return np.zeros_like(x)
      return x
    if len(names) > 1 and names[-2] in ("out", "out_proj", "down"):
      return x * x.dtype.type(mixing)
    return x
  return jax.tree_util.tree_map_with_path(scale, params)


def counting_forwards(monkeypatch, mcfg) -> dict:
  """Counts, while the programs trace, the speculative decoding programs and the main model's
  forwards over decoded tokens (`extend` with prefill=False) in them."""
  from MaxText.decoding.speculative import Speculative
  from MaxText.models.registry import get_family
  counts = {"programs": 0, "forwards": 0}
  model_cls, decode_fn = get_family(mcfg.decoder_block).build, Speculative._decode_fn
  extend = model_cls.extend

  def counted_extend(self, *args, prefill, **kwargs):
    counts["forwards"] += not prefill
    return extend(self, *args, prefill=prefill, **kwargs)

  def counted_decode(self, *args):
    counts["programs"] += 1
    return decode_fn(self, *args)

  monkeypatch.setattr(model_cls, "extend", counted_extend)
  monkeypatch.setattr(Speculative, "_decode_fn", counted_decode)
  return counts


@pytest.mark.parametrize("family,mixing", [("llama", 0.6), ("qwen3_next", 0.6)])
def test_speculative_greedy_equals_plain_greedy(family, mixing, monkeypatch):
  mcfg = mcfg_of(family)
  params = bigram_drafted(init_params(mcfg, 0), mixing)
  plain = engine(mcfg)
  want = plain.generate(plain.place(params), PROMPTS, max_new_tokens=24)
  counts = counting_forwards(monkeypatch, mcfg)
  spec = engine(mcfg, speculative_tokens=3)
  got = spec.generate(spec.place(params), PROMPTS, max_new_tokens=24)
  # one forward of the main model a round, the verification (Qwen3-Next's linear layers advanced
  # by the accepted tokens from what it kept, not run again)
  assert counts["programs"] >= 1 and counts["forwards"] == counts["programs"], counts
  for w, g in zip(want, got):
    assert g.output_ids == w.output_ids
    assert g.finish_reason == w.finish_reason
    np.testing.assert_allclose(g.output_logprobs, w.output_logprobs, atol=1e-5)
  rate = spec.speculative.acceptance_rate()
  assert 0 < rate < 1, rate   # both the accepting and the rejecting paths ran
  # an eos id met in the middle of a row: the row stops there, as plain decoding stops it
  eos = want[0].output_ids[len(want[0].output_ids) // 2]
  want = plain.generate(plain.place(params), PROMPTS, max_new_tokens=24, eos_ids=[eos])
  got = spec.generate(spec.place(params), PROMPTS, max_new_tokens=24, eos_ids=[eos])
  assert [g.output_ids for g in got] == [w.output_ids for w in want]
  assert [g.finish_reason for g in got] == [w.finish_reason for w in want]


def test_speculative_needs_an_mtp_head_and_greedy_decoding():
  from MaxText.decoding.sampling import Sampling
  mcfg = mcfg_of("llama")
  no_mtp = ModelConfig.from_config(load_config([BASE_YML, *TINY[:-1]]))
  with pytest.raises(DecodeError, match="mtp_num_layers=0"):
    engine(no_mtp, speculative_tokens=2)
  spec = engine(mcfg, speculative_tokens=2)
  with pytest.raises(DecodeError, match="temperature=0"):
    spec.generate(None, PROMPTS, max_new_tokens=4, sampling=Sampling(temperature=0.7))


def test_the_benchmarks_agreement_check_tells_a_near_tie_from_an_error():
  """benchmarks/speculative.py on a chip: speculative output may leave plain greedy's only where
  the two chosen tokens' log-probabilities are within NEAR_TIE (float32 ordering a tie another way
  in the verify pass); anything else stops the run."""
  import importlib.util
  import os
  path = os.path.join(os.path.dirname(BASE_YML), "..", "benchmarks", "speculative.py")
  spec = importlib.util.spec_from_file_location("speculative_bench", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  want = [([5, 6, 7], [-0.1, -0.2, -0.3]), ([1, 2], [-1.0, -2.0])]
  assert bench.first_difference(want, want) is None
  tie = [want[0], ([1, 3], [-1.0, -2.0 + bench.NEAR_TIE / 2])]
  d = bench.first_difference(tie, want)
  assert d["prompt"] == 1 and d["token"] == 1 and d["logprob_gap"] <= bench.NEAR_TIE
  wrong = [([5, 9, 7], [-0.1, -1.5, -0.3]), want[1]]
  d = bench.first_difference(wrong, want)
  assert d["prompt"] == 0 and d["token"] == 1 and d["logprob_gap"] > bench.NEAR_TIE
  assert bench.first_difference([([5, 6], [-0.1, -0.2]), want[1]], want)["logprob_gap"] > 1
