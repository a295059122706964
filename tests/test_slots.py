"""Continuous batching (MaxText/decoding/slots.py under MaxText/serve/scheduler.py) against the batch
engine, per family (the tiny random models of the decoding parity tests: full attention, MoE,
Gemma 4's sliding rings and KV-shared tail, Qwen3-Next's Gated DeltaNet state), on 8 fake
devices (data x expert x tensor) or one: more requests than slots, of different prompt lengths and
max_tokens, some arriving while others decode (their prompts prefilled in pieces of 8 tokens where
the family's cache is full attention only), and a slot reaching past the shortest cache window,
each get the tokens and log-probabilities `Engine.generate` gives the same prompt alone in its
batch; a sampled request with a seed gets generate's sample for that seed; the slots' programs
stay within their buckets."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from decoding_helpers import MESH_1, MESH_8, engine, family_models
from MaxText.decoding.sampling import Sampling
from MaxText.decoding.slots import Slots
from MaxText.serve.scheduler import Job, Scheduler

LENGTHS = (3, 11, 6, 20, 2, 41)
NEW = (24, 5, 17, 9, 30, 30)      # the last reaches position 70: past the 64-position window
# the same fp32 numbers summed in another order (another batch, another cache shape): a few 1e-6,
# more where a random model's RMSNorms amplify rounding (Qwen3-Next: tests/test_decode_parity.py)
TOL_LOGPROB = 5e-5
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3)


class Collected:
  """A job's deltas: its tokens, log-probabilities, finish reason; `first` and `done` events."""

  def __init__(self):
    self.ids, self.logprobs, self.reason = [], [], None
    self.first, self.done = threading.Event(), threading.Event()

  def __call__(self, d):
    self.ids += d.ids
    self.logprobs += d.logprobs
    self.first.set()
    if d.finish_reason is not None:
      self.reason = d.finish_reason
      self.done.set()


@pytest.mark.parametrize("family,mesh,chunkable", [
    ("qwen3", MESH_1, True), ("qwen3_moe", MESH_8, True),
    ("gemma4", MESH_8, False), ("qwen3_next", MESH_8, False)])   # sliding rings; a recurrence
def test_requests_joining_and_leaving_slots_get_generates_tokens(family, mesh, chunkable):
  mcfg, _, params = family_models()[family][1]()
  eng = engine(mcfg, mesh, batch_size=4)
  params = eng.place(params)
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, mcfg.vocab_size, n).tolist() for n in LENGTHS]
  slots = Slots(eng, slots=4, max_len=128, chunk=4)
  assert slots.lengths == [64, 96, 128] and slots.chunkable == chunkable
  model = SimpleNamespace(params=params, engine=eng, eos_ids=[])
  scheduler = Scheduler(model, slots, queue_size=16, prefill_chunk=8)
  pieces = []
  prefill = slots.prefill
  slots.prefill = lambda *a, **k: pieces.append(k.get("starts")) or prefill(*a, **k)
  sinks = [Collected() for _ in range(len(prompts) + 1)]
  jobs = [Job(p, n, s, row=0) for p, n, s in zip(prompts, NEW, sinks)]
  jobs.append(Job(prompts[1], 16, sinks[-1], temperature=SAMPLED.temperature, top_k=SAMPLED.top_k,
                  top_p=SAMPLED.top_p, min_p=SAMPLED.min_p, seed=SAMPLED.seed, row=0))
  scheduler.start()
  try:
    scheduler.submit(jobs[:3])
    sinks[0].first.wait()            # the first three decode; the others join while they do
    scheduler.submit(jobs[3:])
    for s in sinks:
      s.done.wait()
  finally:
    scheduler.stop()
  for p, n, s in zip(prompts, NEW, sinks):
    [want] = eng.generate(params, [p], max_new_tokens=n)
    assert s.ids == want.output_ids and s.reason == "length"
    np.testing.assert_allclose(s.logprobs, want.output_logprobs, atol=TOL_LOGPROB, rtol=0)
  [want] = eng.generate(params, [prompts[1]], max_new_tokens=16, sampling=SAMPLED)
  assert sinks[-1].ids == want.output_ids
  greedy = eng.generate(params, [prompts[1]], max_new_tokens=16)[0].output_ids
  assert sinks[-1].ids != greedy      # really sampled
  assert any(pieces) == chunkable     # pieces that continue a prompt, only where they can
  # prefill buckets (rows, piece length, window) and step programs (windows, greedy / sampled),
  # nothing per request
  assert slots.compiled_programs() <= 30
