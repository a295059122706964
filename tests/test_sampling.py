"""Sampling: top-k / top-p / min-p (and their combination with a temperature) keep exactly the tokens
transformers' logits warpers keep, never emit a token outside that set, and draw the kept tokens
with the renormalised probabilities (a chi-square test on a fixed distribution, 4000 draws);
seeded sampling is reproducible whatever the batch a prompt lands in; a decoding run over many
prompt lengths compiles a handful of programs (counted)."""
import jax
import numpy as np
import pytest
from scipy import stats

from conftest import BASE_YML
from decoding_helpers import engine
from MaxText.config.load import load_config
from MaxText.decoding.sampling import Sampling, choose, filtered_logits
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROBS = np.array([0.22, 0.17, 0.13, 0.11, 0.09, 0.08, 0.06, 0.05, 0.04, 0.03, 0.015, 0.005])
LOGITS = np.log(PROBS).astype(np.float32) + 1.3      # any shift: a softmax of these is PROBS
DRAWS = 4000
CASES = {
    "top_k": Sampling(temperature=1.0, top_k=4),
    "top_p": Sampling(temperature=1.0, top_p=0.5),
    "min_p": Sampling(temperature=1.0, min_p=0.3),
    "all, hot": Sampling(temperature=1.7, top_k=9, top_p=0.8, min_p=0.1),
    "all, cold": Sampling(temperature=0.6, top_k=6, top_p=0.9, min_p=0.05),
}


def hf_kept(s: Sampling) -> np.ndarray:
  """The tokens transformers' warpers (temperature, top-k, top-p, min-p, in generate's order)
  leave finite."""
  scores = torch.tensor(LOGITS)[None]
  warpers = [transformers.TemperatureLogitsWarper(s.temperature)]
  if s.top_k:
    warpers.append(transformers.TopKLogitsWarper(s.top_k))
  if s.top_p < 1:
    warpers.append(transformers.TopPLogitsWarper(s.top_p))
  if s.min_p:
    warpers.append(transformers.MinPLogitsWarper(s.min_p))
  for w in warpers:
    scores = w(None, scores)
  return torch.isfinite(scores)[0].numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_filters_keep_transformers_set_and_sample_it_faithfully(case):
  s = CASES[case]
  kept = hf_kept(s)
  assert 1 < kept.sum() < len(PROBS)       # a real cut, not everything or one token
  # jitted (eagerly each op of the filters compiles alone); host inputs
  z = np.asarray(jax.jit(filtered_logits, static_argnums=1)(LOGITS[None], s.static,
                                                            s.values()))[0]
  np.testing.assert_array_equal(np.isfinite(z), kept)
  rows = np.arange(DRAWS, dtype=np.int32)
  logits = np.broadcast_to(LOGITS, (DRAWS, len(PROBS)))
  tokens, logprobs = jax.jit(choose, static_argnums=1)(logits, s.static, s.values(), rows,
                                                      np.zeros_like(rows))
  tokens = np.asarray(tokens)
  assert kept[tokens].all()                # never a token outside the set
  # the log-probabilities are those of the unmodified distribution
  np.testing.assert_allclose(np.asarray(logprobs), np.log(PROBS)[tokens], atol=1e-5)
  # the kept tokens come with probability ∝ PROBS^(1/T) (renormalised): chi-square, p > 1e-4
  want = PROBS[kept] ** (1 / s.temperature)
  want = want / want.sum()
  counts = np.bincount(tokens, minlength=len(PROBS))[kept]
  p = stats.chisquare(counts, want * DRAWS).pvalue
  print(f"{case}: kept {np.flatnonzero(kept).tolist()}, chi-square p = {p:.3f}")
  assert p > 1e-4


def test_greedy_takes_the_argmax_and_reports_its_logprob():
  s = Sampling()
  logits = np.stack([LOGITS, LOGITS[::-1]])
  tokens, logprobs = jax.jit(choose, static_argnums=1)(logits, s.static, s.values(),
                                                      np.arange(2, dtype=np.int32),
                                                      np.zeros(2, np.int32))
  assert np.asarray(tokens).tolist() == [0, len(PROBS) - 1]
  np.testing.assert_allclose(np.asarray(logprobs), np.log(PROBS[0]), atol=1e-6)


def test_bad_sampling_values_are_named():
  assert [k for k, _ in Sampling(temperature=-1, top_k=-2, top_p=0, min_p=2).problems()] == \
      ["temperature", "top_k", "top_p", "min_p"]


@pytest.fixture(scope="module")
def tiny():
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny"])
  mcfg = ModelConfig.from_config(cfg)
  eng = engine(mcfg, batch_size=8)
  return eng, eng.place(jax.device_get(init_params(mcfg, 0)))


def prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 384, n).tolist() for n in lengths]


def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
  eng, params = tiny
  ps = prompts((5, 17, 9, 3, 12))
  s = Sampling(temperature=0.9, top_p=0.95, seed=11)
  a = eng.generate(params, ps, max_new_tokens=20, sampling=s)
  b = eng.generate(params, ps, max_new_tokens=20, sampling=s)
  # the same prompts in another order (other batches and buckets), each keeping its row id
  c = eng.generate(params, ps[::-1], max_new_tokens=20, sampling=s, row_ids=range(4, -1, -1))[::-1]
  d = eng.generate(params, ps, max_new_tokens=20, sampling=Sampling(0.9, top_p=0.95, seed=12))
  assert [x.output_ids for x in a] == [x.output_ids for x in b] == [x.output_ids for x in c]
  assert [x.output_ids for x in a] != [x.output_ids for x in d]
  greedy = eng.generate(params, ps, max_new_tokens=20)
  assert [x.output_ids for x in a] != [x.output_ids for x in greedy]


def test_a_decoding_run_compiles_a_handful_of_programs(tiny):
  """11 prompts of 11 lengths, 4 to a batch: 3 prefill buckets (rows 4 x lengths 64, 32, 16) and
  one decoding program; a second request with other lengths in the same buckets compiles none."""
  _, params = tiny
  eng = engine(ModelConfig.from_config(load_config([BASE_YML, "model_name=qwen3-tiny"])),
               batch_size=4)   # a new engine: nothing compiled yet
  lowered = []

  def listener(event, duration, **kwargs):
    if event.endswith("jaxpr_to_mlir_module_duration"):   # one program traced and lowered
      lowered.append(kwargs.get("fun_name", "?"))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    eng.generate(params, prompts((2, 3, 5, 8, 9, 13, 17, 20, 25, 31, 40)), max_new_tokens=12)
    first = len(lowered)
    eng.generate(params, prompts((4, 6, 7, 10, 11, 14, 19, 22, 27, 33, 39), seed=1),
                 max_new_tokens=12)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  print(f"programs lowered: {lowered[:first]}, then {lowered[first:]}")
  assert first == 4 and len(lowered) == first and eng.compiled_programs() == 4
