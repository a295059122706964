"""Training samples (MaxText/train/samples.py) on a tiny model, one device: the text comes from
the parameters it is given (other parameters or another seed: another text; the same: the same),
greedy picks the forward pass's argmax at each position, and the default prompt is the start of a
held-out document."""
import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from MaxText.config.load import load_config
from MaxText.data import sources
from MaxText.data.tokenizers import make_tokenizer
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def
from MaxText.sharding.mesh import create_mesh
from MaxText.sharding.rules import parse_rules
from MaxText.train.samples import Sampler, sample_prompt

NEW = 12


def sampler(*overrides: str) -> Sampler:
  cfg = load_config([BASE_YML, *TINY, "ici_fsdp_parallelism=1", f"max_new_tokens={NEW}",
                     *overrides])
  mesh = create_mesh(cfg, jax.devices()[:1])
  return Sampler(cfg, ModelConfig.from_config(cfg), mesh,
                 parse_rules(cfg.logical_axis_rules, cfg.mesh_axes), make_tokenizer("byte"))


@pytest.fixture(scope="module")
def params():
  mcfg = sampler().mcfg
  return [init_params(mcfg, seed) for seed in (0, 1)]


def continuation(text: str) -> str:
  head, _, body = text.partition("\n  continued by the model:\n")
  assert body and head.startswith("sample after step"), text
  return body


def test_a_sample_is_drawn_from_the_params_it_is_given(params):
  s = sampler()
  first = s.text(7, params[0])
  assert first.startswith("sample after step 7 (temperature 0.8, top-k 40, seed 0, ")
  assert "  prompt (the first 32 tokens of the first training document):\n  | " in first
  assert s.text(7, params[0]) == first                                  # seeded: reproducible
  assert continuation(s.text(7, params[1])) != continuation(first)      # other parameters
  assert continuation(sampler("seed=3").text(7, params[0])) != continuation(first)   # other seed


def test_greedy_takes_the_forward_passes_argmax(params):
  s = sampler("sample_temperature=0", "eos_ids=-5")     # no eos: all NEW tokens
  assert s.text(1, params[1]).startswith(f"sample after step 1 (greedy, {NEW} tokens, length)")
  prompt, _, done = s.generate(params[1])
  ids = np.asarray(prompt + done.output_ids, np.int32)[None]
  n = ids.shape[1]
  logits = np.asarray(make_model_def(s.mcfg).apply(params[1], ids, np.arange(n)[None],
                                                   np.ones_like(ids)))[0]
  picked = logits[len(prompt) - 1:n - 1]
  chosen = picked[np.arange(NEW), done.output_ids]
  # the cached decode and the whole-sequence forward round differently: near-ties may differ by ulps
  np.testing.assert_array_less(picked.max(-1) - chosen, 1e-4 * np.abs(picked).max())


def test_the_default_prompt_starts_a_held_out_document():
  tokenizer = make_tokenizer("byte")
  cfg = sampler("eval_split_fraction=0.05").cfg
  ids, where = sample_prompt(cfg, tokenizer)
  held_out = sources.document_dataset("embedded", eval_split_fraction=0.05, split="eval")[0]
  first = sources.document_dataset("embedded")[0]
  assert held_out != first
  assert where == "the first 32 tokens of a held-out document"
  assert ids == [tokenizer.bos_id] + tokenizer.encode(held_out)[:32]
  assert sample_prompt(sampler("prompt=def ").cfg, tokenizer) == \
      ([tokenizer.bos_id] + tokenizer.encode("def "), "prompt")


def test_control_bytes_are_printed_escaped(params):
  """A byte model's text may hold NUL or escape bytes: printed escaped, the log stays text (grep
  would call it binary)."""
  s = sampler("prompt_ids=1,3,30,100")      # byte ids: NUL, ESC, "a"
  text = s.text(2, params[0])
  assert "  | \\x00\\x1ba" in text
  assert not any(ord(ch) < 32 and ch != "\n" for ch in text), repr(text)
