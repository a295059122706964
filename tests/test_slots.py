"""Continuous batching (MaxText/decoding/slots.py under MaxText/serve/scheduler.py) against the
batch engine, per family (the tiny random models of the decoding parity tests: full attention,
MoE, Gemma 4's sliding rings and KV-shared tail, Qwen3-Next's Gated DeltaNet state), on 8 fake
devices (data x expert x tensor) or one: more requests than slots, of different prompt lengths
and max_tokens, some arriving while others decode (their prompts prefilled in pieces of 8
tokens), and a slot reaching past the shortest cache window, each get the tokens and
log-probabilities `Engine.generate` gives the same prompt alone in its batch (on one device:
`reference`); a sampled request with a seed gets generate's sample for that seed (Qwen3-MoE, on
8 devices); the slots' programs stay within their buckets. Chunked prefill on every
family: prompts longer than Gemma 4's sliding window, in pieces of several lengths (ones that
divide no prompt too), into slots a previous request used, decode as `Engine.generate` decodes
the whole prompts, token for token. Prefix caching: a prompt sharing a system prompt with a
running request (full attention: copied from its row) and a conversation's next turn (every
family: the finished request's own row) decode as without it, counted in /metrics (one `Slots`
per family for these three tests: `family_slots`). Decoding calls run only the busy slots'
rows (3 of 8 through a row bucket of 4, its padding row dropped) and decode as generate does;
`Slots.warm` compiles every decoding program up front."""
import functools
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from decoding_helpers import MESH_1, MESH_8, engine, family_models
from MaxText.decoding.sampling import Sampling
from MaxText.decoding.slots import Slots, row_values
from MaxText.serve.metrics import Metrics
from MaxText.serve.prefix import common_prefix
from MaxText.serve.scheduler import GREEDY, Job, Scheduler

LENGTHS = (3, 11, 6, 20, 2, 41)
NEW = (24, 5, 17, 9, 30, 30)      # the last reaches position 70: past the 64-position window
# the same fp32 numbers summed in another order (another batch, another cache shape; the
# reference's one device against the slots' 8, whose tensor axis splits the contractions): a few
# 1e-6, more where a random model's RMSNorms amplify rounding (Qwen3-Next:
# tests/test_decode_parity.py, whose 8-device tokens equal one device's)
TOL_LOGPROB = 5e-5
SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=3)


@functools.lru_cache(maxsize=None)
def reference(family: str):
  """The oracle of every test of `family`: `Engine.generate` on one device, each prompt alone in
  its batch (batch_size=1) in a cache of 128 positions whatever the request, so the file's
  references decode through a few programs per family (a prefill per prompt bucket, one decoding
  call; greedy and sampled), each compiled once for the file, whichever test or mesh asks. 1 or 8
  devices decode the same tokens (tests/test_decode_parity.py); the slots' own engine is the
  test's. Returns generate(prompts, max_new_tokens, sampling=greedy) -> [Completion]."""
  mcfg, _, params = family_models()[family][1]()
  eng = engine(mcfg, MESH_1, batch_size=1, max_cache_length=128)
  placed = eng.place(params)
  return lambda prompts, n, sampling=Sampling(): eng.generate(placed, prompts, max_new_tokens=n,
                                                               sampling=sampling)


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


# Each family's slots run on one mesh in every test of the file, so that a program one test
# compiled (a prefill or decoding call of the same rows, window and flags) is a cache hit in the
# next: Qwen3 on one device, the others on 8.
MESHES = {"qwen3": MESH_1, "qwen3_moe": MESH_8, "gemma4": MESH_8, "qwen3_next": MESH_8}
# The sampled request on one family: `sampled` changes only `sample_rows` (the logits' filters and
# draw, after the family's model, which traces the same either way), so another family's sampled
# programs would add 5 compiles and no code path. On Qwen3-MoE's 8 devices, the mesh whose
# programs split the logits and the rows' values: one device runs the same jaxpr unsplit.
SAMPLED_FAMILIES = ("qwen3_moe",)


def _placed(family: str, seed: int, mesh=MESH_1):
  """The family's tiny model, a 4-row engine on `mesh`, its placed parameters and a generator."""
  mcfg, _, params = family_models()[family][1]()
  eng = engine(mcfg, mesh, batch_size=4)
  return mcfg, eng, eng.place(params), np.random.default_rng(seed)


@functools.lru_cache(maxsize=None)
def family_slots(family: str):
  """(mcfg, engine, placed parameters, slots) of `family` on its mesh (MESHES): one `Slots` of 4
  rows of 128 positions for the joining, pieces and prefix tests, whose decoding calls may end
  early (`interrupt`, a host callback: a program holding one is never in the persistent
  compilation cache, so a new `Slots` would compile those calls again). Each test's scheduler is
  its own (its queue, prefix index, metrics); the rows keep what the previous test left, as a
  server's slots do between requests (a prompt's prefill writes its row's positions anew)."""
  mcfg, eng, params, _ = _placed(family, 0, MESHES[family])
  return mcfg, eng, params, Slots(eng, slots=4, max_len=128, chunk=4)


@pytest.fixture(scope="module", autouse=True)
def _release_family_slots():
  """The slots (their cache rows, engines and parameters) go with this file, not the worker."""
  yield
  family_slots.cache_clear()


@pytest.mark.parametrize("family", list(MESHES))
def test_requests_joining_and_leaving_slots_get_generates_tokens(family, monkeypatch):
  sampled = family in SAMPLED_FAMILIES
  mcfg, eng, params, slots = family_slots(family)
  compiled_before = slots.compiled_programs()
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, mcfg.vocab_size, n).tolist() for n in LENGTHS]
  assert slots.lengths == [64, 96, 128]
  model = SimpleNamespace(params=params, engine=eng, eos_ids=[])
  # one family with a decoding step between two pieces of a prompt (no program of its own)
  between = family == "qwen3"
  calls = []   # decoding calls: (steps made, whether a prompt was in pieces meanwhile)
  scheduler = Scheduler(model, slots, queue_size=16, prefill_chunk=8, step_between_pieces=between,
                        on_call=lambda kind, _s, n, _t0, _t1: kind == "step" and calls.append(
                            (n, bool(scheduler.prefilling))))
  pieces = []
  prefill = slots.prefill
  monkeypatch.setattr(slots, "prefill",
                      lambda *a, **k: pieces.append(k.get("starts")) or prefill(*a, **k))
  follows = []                       # decoding calls dispatched before the last one's tokens came
  follow = slots.follow
  monkeypatch.setattr(slots, "follow", lambda *a: follows.append(1) or follow(*a))
  sinks = [Collected() for _ in range(len(prompts) + 1)]
  jobs = [Job(p, n, s, row=0) for p, n, s in zip(prompts, NEW, sinks)]
  if sampled:
    jobs.append(Job(prompts[1], 16, sinks[-1], temperature=SAMPLED.temperature,
                    top_k=SAMPLED.top_k, top_p=SAMPLED.top_p, min_p=SAMPLED.min_p,
                    seed=SAMPLED.seed, row=0))
  else:
    sinks.pop()
  scheduler.start()
  try:
    scheduler.submit(jobs[:3])
    sinks[0].first.wait()            # the first three decode; the others join while they do
    scheduler.submit(jobs[3:])
    for s in sinks:
      s.done.wait()
  finally:
    scheduler.stop()
  generate = reference(family)
  for p, n, s in zip(prompts, NEW, sinks):
    [want] = generate([p], n)
    assert s.ids == want.output_ids and s.reason == "length"
    np.testing.assert_allclose(s.logprobs, want.output_logprobs, atol=TOL_LOGPROB, rtol=0)
  if sampled:
    [want] = generate([prompts[1]], 16, SAMPLED)
    assert sinks[-1].ids == want.output_ids
    greedy = generate([prompts[1]], 16)[0].output_ids
    assert sinks[-1].ids != greedy    # really sampled
  assert any(pieces)                  # pieces that continue a prompt
  assert follows                      # the scheduler's overlap (Scheduler.overlap)
  if between:                         # while a prompt went in pieces: calls of one step
    assert [n for n, pending in calls if pending] and all(n == 1 for n, pending in calls
                                                          if pending)
  # prefill buckets (rows, piece length, window) and step programs (windows, greedy / sampled),
  # nothing per request (the file's first test on these slots: what they compiled from empty)
  assert slots.compiled_programs() - compiled_before <= 30


PIECE_LENGTHS = (41, 20, 11)      # all longer than Gemma 4's sliding window (4 positions)
PIECE_NEW = 12


def decode_in_pieces(slots: Slots, params, prompts, piece: int, new: int, where: list[int]):
  """Greedy tokens of `prompts` and their log-probabilities in slots `where`, each prompt prefilled `piece` tokens per call
  (first pieces together, continuing ones together), the slots whose prompt is in decoding
  between those calls, as the scheduler interleaves them."""
  n = slots.slots
  state = {"token": np.zeros(n, np.int32), "position": np.zeros(n, np.int32),
           "count": np.zeros(n, np.int32), "max_new": np.ones(n, np.int32),
           "done": np.ones(n, bool), "row": np.zeros(n, np.int32)}
  done, out, lps = [0] * len(prompts), [[] for _ in prompts], [[] for _ in prompts]
  calls = 0
  while any(len(o) < new for o in out):
    todo = [i for i, p in enumerate(prompts) if done[i] < len(p)]
    for first, idx in ((True, [i for i in todo if not done[i]]),
                       (False, [i for i in todo if done[i]])):
      if not idx:
        continue
      calls += not first
      ids, lp, _, _ = slots.prefill(params, [prompts[i][done[i]:done[i] + piece] for i in idx],
                                    [where[i] for i in idx], [0] * len(idx),
                                    [GREEDY] * len(idx), 0,
                                    starts=None if first else [done[i] for i in idx])
      for b, i in enumerate(idx):
        done[i] = min(done[i] + piece, len(prompts[i]))
        if done[i] == len(prompts[i]):
          s = where[i]
          out[i].append(int(ids[b]))
          lps[i].append(float(lp[b]))
          state["token"][s], state["position"][s], state["count"][s] = ids[b], done[i], 1
          state["max_new"][s], state["done"][s] = new, False
    if not state["done"].all():
      state, got = slots.step(params, state, [], row_values([GREEDY] * n, n), 0)
      state = {k: np.array(v) for k, v in state.items()}
      for i, s in enumerate(where):
        keep = got["tokens"][s] >= 0
        out[i] += got["tokens"][s][keep].tolist()
        lps[i] += got["logprobs"][s][keep].tolist()
  assert calls >= -(-max(map(len, prompts)) // piece) - 1   # really in pieces
  return out, lps


@pytest.mark.parametrize("family", ["gemma4", "qwen3_next", "qwen3"])
def test_prompts_prefilled_in_pieces_decode_as_whole_prompts(family, monkeypatch):
  mcfg, _, params, slots = family_slots(family)
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, mcfg.vocab_size, n).tolist() for n in PIECE_LENGTHS]
  want = reference(family)(prompts, PIECE_NEW)
  # decoding calls that may end early, as under the scheduler (never asked to here): the
  # joining-and-leaving test's programs (test_decoding_calls_run_only_... keeps the other kind)
  monkeypatch.setattr(slots, "interrupt", lambda: False)
  # pieces of 3 and 7 divide no prompt; 16 is the first prompt bucket (11 goes whole). Each round
  # moves the prompts one slot on: what the previous round left in a slot is another prompt's
  for turn, piece in enumerate((3, 7, 16)):
    where = [(i + turn) % slots.slots for i in range(len(prompts))]
    got, lps = decode_in_pieces(slots, params, prompts, piece, PIECE_NEW, where)
    assert got == [w.output_ids for w in want], piece
    np.testing.assert_allclose(np.array(lps), [w.output_logprobs for w in want],
                               atol=TOL_LOGPROB, rtol=0, err_msg=f"pieces of {piece}")


@pytest.mark.parametrize("family", ["qwen3", "gemma4", "qwen3_next"])
def test_a_cached_prefix_is_reused_and_decodes_as_without_it(family, monkeypatch):
  mcfg, eng, params, slots = family_slots(family)
  rng = np.random.default_rng(7)
  draw = lambda n: rng.integers(0, mcfg.vocab_size, n).tolist()
  system = draw(24)
  a, b = system + draw(5), system + draw(9)
  metrics = Metrics()
  model = SimpleNamespace(params=params, engine=eng, eos_ids=[])
  scheduler = Scheduler(model, slots, queue_size=8, metrics=metrics, prefill_chunk=8, prefix_min=4)
  starts, copies = [], []
  prefill, copy = slots.prefill, slots.copy
  monkeypatch.setattr(slots, "prefill",
                      lambda *a, **k: starts.append(k.get("starts")) or prefill(*a, **k))
  monkeypatch.setattr(slots, "copy", lambda *a: copies.append(a) or copy(*a))
  sa, sb, sc = Collected(), Collected(), Collected()
  scheduler.start()
  try:
    scheduler.submit([Job(a, 40, sa)])     # to position 69: past the 64-position window
    sa.first.wait()                        # b arrives while a decodes: their system prompt shared
    scheduler.submit([Job(b, 10, sb)])
    sa.done.wait()
    sb.done.wait()
    # a conversation's next turn: a, its answer (but the last token, never fed back) and more
    c = a + sa.ids[:-1] + draw(6)
    scheduler.submit([Job(c, 8, sc)])
    sc.done.wait()
  finally:
    scheduler.stop()
  for prompt, n, sink in ((a, 40, sa), (b, 10, sb), (c, 8, sc)):
    [want] = reference(family)([prompt], n)
    assert sink.ids == want.output_ids
    np.testing.assert_allclose(sink.logprobs, want.output_logprobs, atol=TOL_LOGPROB, rtol=0)
  positional = family == "qwen3"             # full attention: any common prefix of a row
  assert slots.positional == positional
  shared = common_prefix(a, b)
  value = metrics.registry.get_sample_value
  assert value("maxtext_prefix_hits_total") == 1 + positional
  assert value("maxtext_prefix_tokens_total") == len(a) + 39 + positional * shared
  # b: a's row copied into a free slot while a runs; c: a's own slot, free by then
  assert copies == ([(0, 1)] if positional else [])
  # c's prefill began after a's turn; b's after the system prompt where reused, else at 0 (its
  # pieces then: what is left over of 8 first, len(b) % 8, then pieces of 8)
  assert len(b) % 8 and shared % 8 != len(b) % 8
  assert [len(a) + 39] in starts and ([shared] in starts) == positional
  assert ([len(b) % 8] in starts) != positional


def test_decoding_calls_run_only_the_busy_rows_and_warm_compiles_them_all():
  """Three busy slots of 8 go through a row bucket of 4 (one padding row, dropped) and decode as
  `Engine.generate` does; `warm` compiles every row bucket's decoding program up front, so the
  calls compile none; with `min_rows` the buckets below it are gone."""
  mcfg, eng, params, rng = _placed("qwen3", 3)
  slots = Slots(eng, slots=8, max_len=64, chunk=4)
  assert slots.step_rows(np.array([5])).tolist() == [5]
  assert slots.step_rows(np.array([6, 1, 3])).tolist() == [6, 1, 3, 8]
  assert slots.step_rows(np.arange(5)).tolist() == list(range(8))
  assert slots.warm(params) == 4          # rows 1, 2, 4, 8 x the one window (64)
  assert slots.warm(params) == 0
  compiled = []
  step = slots.step

  def counted(*a, **k):
    before = slots.compiled_programs()
    out = step(*a, **k)
    compiled.append(slots.compiled_programs() - before)
    return out
  slots.step = counted
  prompts = [rng.integers(0, mcfg.vocab_size, n).tolist() for n in (5, 9, 13)]
  got, lps = decode_in_pieces(slots, params, prompts, 16, PIECE_NEW, [6, 1, 3])
  want = reference("qwen3")(prompts, PIECE_NEW)
  assert got == [w.output_ids for w in want]
  np.testing.assert_allclose(np.array(lps), [w.output_logprobs for w in want], atol=TOL_LOGPROB,
                             rtol=0)
  assert compiled and not any(compiled)
  # calls dispatched one after another from the device's state (`follow`), none read back before
  # the last went (the scheduler's overlap): the same tokens; a row done stays done; no compile
  before = slots.compiled_programs()
  first, first_lp, _, _ = slots.prefill(params, prompts, [6, 1, 3], [0] * 3, [GREEDY] * 3, 0)
  state = {"token": np.zeros(8, np.int32), "position": np.zeros(8, np.int32),
           "count": np.ones(8, np.int32), "max_new": np.full(8, PIECE_NEW, np.int32),
           "done": np.ones(8, bool), "row": np.zeros(8, np.int32)}
  for i, s in enumerate([6, 1, 3]):
    state["token"][s], state["position"][s], state["done"][s] = first[i], len(prompts[i]), False
  calls = [slots.launch(params, state, [], row_values([GREEDY] * 8, 8), 0)]
  while len(calls) < 4:            # 11 steps make the 12 tokens: 4 calls of 4, the last idle
    calls.append(slots.follow(params, calls[-1]))
  outs = [slots.collect(c) for c in calls]
  assert all(busy.tolist() == [1, 3, 6] for busy, _, _ in outs)
  for i, s in enumerate([6, 1, 3]):
    b = [1, 3, 6].index(s)
    tokens = [int(first[i])] + [t for _, _, o in outs for t in o["tokens"][b] if t >= 0]
    lps = [float(first_lp[i])] + [x for _, _, o in outs for t, x in zip(o["tokens"][b],
                                                                         o["logprobs"][b]) if t >= 0]
    assert tokens == want[i].output_ids
    np.testing.assert_allclose(lps, want[i].output_logprobs, atol=TOL_LOGPROB, rtol=0)
    assert (outs[-1][2]["tokens"][b] == -1).all() and outs[-1][1]["done"][b]
    assert outs[-1][1]["count"][b] == PIECE_NEW
  assert slots.compiled_programs() == before
  # serve_min_rows 3: calls of at least 4 rows (a power of two), the row buckets 4 and 8
  few = Slots(eng, slots=8, max_len=64, chunk=4, min_rows=3)
  assert few.step_rows(np.array([5])).tolist() == [5, 8, 8, 8]
  assert few.step_rows(np.array([6, 1, 3, 0, 2])).tolist() == list(range(8))
  assert few.warm(params) == 2
