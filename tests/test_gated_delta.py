"""The gated delta rule (MaxText/layers/gated_delta.py) and the causal conv (layers/causal_conv.py):
the chunked form equals the token-by-token recurrence (values, final state and gradients), both
equal transformers' reference functions run on each packed document alone, gradients stay finite
under decays strong enough to overflow an unmasked exp, the Gated DeltaNet layer's one-token step
reproduces its training forward, speculative decoding's roll-back (the state after any prefix of
the verified tokens, from their writes) equals the recurrence's state, and under a mesh the rule is partitioned per row and head with
no communication."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from MaxText.layers import causal_conv as cc
from MaxText.layers import gated_delta as gd

B, S, H, K, V = 2, 150, 3, 8, 6          # S is not a multiple of either chunk size tested


@jax.jit
def _prepare(q, k, v, g, beta):
  """The rule's inputs from the host draws, in one program (eagerly each op compiles alone)."""
  return (gd.l2_normalize(q) * K ** -0.5, gd.l2_normalize(k), v, g, jax.nn.sigmoid(beta))


def inputs(seed: int = 0, decay_scale: float = 1.0):
  rng = np.random.default_rng(seed)
  q, k = (rng.normal(size=(B, S, H, K)).astype(np.float32) for _ in range(2))
  v = rng.normal(size=(B, S, H, V)).astype(np.float32)
  g = (-decay_scale * np.exp(rng.normal(size=(B, S, H)) - 1.0)).astype(np.float32)
  beta = rng.normal(size=(B, S, H)).astype(np.float32)
  return _prepare(q, k, v, g, beta)


def amax(x) -> float:
  """max |x|, on the host (a jnp reduction outside a jit compiles a program per shape)."""
  return float(np.abs(np.asarray(x, np.float32)).max())


_chunked = jax.jit(gd.chunked_gated_delta_rule, static_argnames="chunk_size")
_recurrent = jax.jit(gd.recurrent_gated_delta_rule)


def packed_segments():
  """Row 0: documents of 40, 60, 50 tokens; row 1: 129 tokens then 21 of padding (id 0)."""
  seg = np.ones((B, S), np.int32)
  seg[0, 40:], seg[0, 100:] = 2, 3
  seg[1, 129:] = 0
  return seg


@pytest.mark.parametrize("chunk", [64, 16])
def test_chunked_equals_token_by_token(chunk):
  q, k, v, g, beta = inputs()
  reset = np.asarray(gd.document_starts(packed_segments()))
  o_tok, s_tok = (np.asarray(x) for x in _recurrent(q, k, v, g, beta, reset))
  o_chk, s_chk = _chunked(q, k, v, g, beta, reset, chunk_size=chunk)
  scale = amax(o_tok)
  assert scale > 0.5
  assert amax(o_chk - o_tok) <= 1e-5 * scale
  assert amax(s_chk - s_tok) <= 1e-5 * amax(s_tok)
  # the resets matter: the same row as one document differs after the first boundary
  one_doc = reset.copy()
  one_doc[:, 1:] = False
  one_doc = np.asarray(_chunked(q, k, v, g, beta, one_doc, chunk_size=chunk)[0])
  assert amax(one_doc[0, 40:] - o_tok[0, 40:]) > 1e-2


def test_strong_decays_lose_no_precision():
  """Decays of a Qwen3-Next layer's scale (log decays down to about -65 a token, the in-chunk
  cumulative sums to about -800): chunked = token by token within 1e-6 of the output's scale, a few
  fp32 ulps. The decays are summed per pair of tokens (segment sums); as differences of cumulative
  sums they lose ~|cum| x 2^-24 (4.5e-6 here)."""
  q, k, v, g, beta = inputs(3, decay_scale=10.0)
  assert np.asarray(g).min() < -50
  reset = np.asarray(gd.document_starts(np.ones((B, S), np.int32)))
  o_tok = np.asarray(_recurrent(q, k, v, g, beta, reset)[0])
  o_chk = np.asarray(_chunked(q, k, v, g, beta, reset, chunk_size=64)[0])
  assert amax(o_chk - o_tok) <= 1e-6 * amax(o_tok)


def test_packed_documents_equal_transformers_run_alone():
  """Each document of a packed row against transformers' own recurrent reference on it alone."""
  torch = pytest.importorskip("torch")
  from transformers.models.qwen3_next import modeling_qwen3_next as hf
  rng = np.random.default_rng(1)
  raw = [rng.normal(size=(B, S, H, K)).astype(np.float32) for _ in range(2)]
  v, g, beta = (np.asarray(a) for a in inputs(1)[2:])
  q, k = gd.l2_normalize(raw[0]) * K ** -0.5, gd.l2_normalize(raw[1])
  seg = packed_segments()
  o = np.asarray(_chunked(q, k, v, g, beta, gd.document_starts(seg), chunk_size=64)[0])
  t = lambda a: torch.tensor(np.ascontiguousarray(a))
  worst = 0.0
  for row, docs in ((0, [(0, 40), (40, 100), (100, S)]), (1, [(0, 129), (129, S)])):
    for a, e in docs:
      ref, _ = hf.torch_recurrent_gated_delta_rule(
          t(raw[0][row:row + 1, a:e]), t(raw[1][row:row + 1, a:e]), t(v[row:row + 1, a:e]),
          t(g[row:row + 1, a:e]), t(beta[row:row + 1, a:e]), use_qk_l2norm_in_kernel=True)
      worst = max(worst, float(np.abs(ref.numpy()[0] - o[row, a:e]).max()))
  assert worst <= 1e-5 * np.abs(o).max(), worst


def test_gradients_equal_and_stay_finite():
  """jax.grad through the chunked form equals it through the recurrence; with decays 50x stronger
  (in-chunk cumulative log decays of about -1e3: an unmasked exp(cum_j - cum_i) overflows) the
  gradients stay finite."""
  reset = np.asarray(gd.document_starts(packed_segments()))
  w = np.random.default_rng(2).normal(size=(B, S, H, V)).astype(np.float32)

  def grads(fn, decay_scale):
    loss = lambda *a: jnp.sum(fn(*a, reset)[0] * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*inputs(2, decay_scale))

  chunked = lambda *a: gd.chunked_gated_delta_rule(*a, chunk_size=32)
  for got, want in zip(grads(chunked, 1.0), grads(gd.recurrent_gated_delta_rule, 1.0)):
    assert amax(np.asarray(got) - np.asarray(want)) <= 1e-5 * amax(want)
  strong = grads(chunked, 50.0)
  assert np.asarray(inputs(2, 50.0)[3]).min() < -100
  assert all(np.isfinite(np.asarray(x)).all() for x in strong)


def test_causal_conv_restarts_per_document_and_steps():
  torch = pytest.importorskip("torch")
  from transformers.models.qwen3_next import modeling_qwen3_next as hf
  rng = np.random.default_rng(3)
  W, C = 4, 5
  x = rng.normal(size=(B, S, C)).astype(np.float32)
  w = rng.normal(size=(W, C)).astype(np.float32)
  seg = packed_segments()
  out = np.asarray(jax.jit(cc.causal_conv)(x, w, gd.document_starts(seg)))
  hf_conv = lambda a: hf.causal_conv1d_fn(torch.tensor(a).transpose(1, 2), torch.tensor(w.T),
                                          None).transpose(1, 2).numpy()
  for a, e in [(0, 40), (40, 100), (100, S)]:
    np.testing.assert_allclose(out[0:1, a:e], hf_conv(x[0:1, a:e]), rtol=0, atol=1e-5)
  window, steps = np.zeros((B, W - 1, C), np.float32), []
  step = jax.jit(cc.causal_conv_step)   # one program for the 150 steps (eagerly: one per op)
  for t in range(S):   # row 0's boundaries; the step takes a fresh window at a document start
    if t in (40, 100):
      window = np.zeros_like(window)
    y, window = step(window, x[:, t], w)
    steps.append(np.asarray(y))
  np.testing.assert_allclose(np.stack(steps, 1)[0], out[0], rtol=0, atol=1e-5)


def test_layer_step_reproduces_the_training_forward():
  """The Gated DeltaNet layer's decoding step (conv window + delta-rule state), fed one token at a
  time and reset at a document start, gives the training forward's outputs on a packed row."""
  from flax import nnx
  from MaxText.config.load import load_config
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.qwen3_next.gated_deltanet import GatedDeltaNet
  from conftest import BASE_YML
  mcfg = ModelConfig.from_config(load_config([BASE_YML, "model_name=qwen3-next-tiny",
                                              "linear_chunk_size=8"]))
  # built in one program: eagerly each initializer's ops compile alone
  layer = nnx.jit(lambda: GatedDeltaNet(mcfg, rngs=nnx.Rngs(params=0)))()
  T, boundary = 21, 13
  # host arrays, one jitted forward: run eagerly, each op (and each token's slice) compiles alone
  x = np.random.default_rng(0).normal(size=(2, T, mcfg.emb_dim)).astype(np.float32)
  seg = np.where(np.arange(T) < boundary, 1, 2)[None].repeat(2, 0).astype(np.int32)
  want = jax.jit(lambda x, seg: nnx.merge(*nnx.split(layer))(x, seg))(x, seg)
  state, got = layer.init_state(2), []
  step = jax.jit(lambda s, xt: nnx.merge(*nnx.split(layer)).step(xt, s))
  for t in range(T):
    if t == boundary:
      state = layer.init_state(2)
    y, state = step(state, x[:, t])
    got.append(np.asarray(y))
  got = np.stack(got, 1)
  assert amax(got - np.asarray(want)) <= 1e-5 * amax(want)
  assert state["delta"].shape == (2, mcfg.linear_num_value_heads, mcfg.linear_key_head_dim,
                                  mcfg.linear_value_head_dim)


def numpy_states(state, k, v, g, beta):
  """The gated delta rule token by token in NumPy (float64): the state before each token and after
  the last, [S + 1, B, H, K, V]."""
  state, out = state.astype(np.float64), [state.astype(np.float64)]
  for t in range(k.shape[1]):
    state = state * np.exp(g[:, t])[..., None, None]
    delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t][..., None]
    state = state + k[:, t][..., :, None] * delta[..., None, :]
    out.append(state)
  return np.stack(out)


def test_state_after_every_verified_prefix_equals_the_recurrence():
  """Speculative decoding keeps a verification's writes, not its states: `state_after` folds the
  first m tokens' writes (the chunked rule's, over several chunks and a padded one) into the state
  they continued, equal to the NumPy recurrence's state after m tokens for every m = 0..S."""
  T = 5
  q, k, v, g, beta = (np.asarray(a)[:, :T] for a in inputs(5))
  state = np.random.default_rng(5).normal(size=(B, H, K, V)).astype(np.float32)
  want = numpy_states(state, *(x.astype(np.float64) for x in (k, v, g, beta)))
  _, final, writes = jax.jit(lambda *a: gd.chunked_gated_delta_writes(
      *a, np.zeros((B, T), bool), chunk_size=2, initial_state_BHKV=state))(q, k, v, g, beta)
  after = jax.jit(gd.state_after)
  assert amax(np.asarray(final) - want[T]) <= 1e-5 * amax(want[T])
  for m in range(T + 1):
    kept = np.array([m, T - m], np.int32)
    got = np.asarray(after(state, k, writes, g, kept))
    for b in range(B):
      assert amax(got[b] - want[kept[b], b]) <= 1e-5 * amax(want[kept[b], b]), (m, b)


def test_layer_keeps_any_verified_prefix_without_running_it_again():
  """A Gated DeltaNet layer verifying S tokens (`LinearState.verifying`, then `keep_verified` with
  each row's accepted count) leaves the conv window and delta-rule state that the accepted tokens'
  one-token steps leave, and the verification's outputs are the steps' outputs."""
  from flax import nnx
  from MaxText.config.load import load_config
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.qwen3_next.gated_deltanet import GatedDeltaNet, linear_state
  from conftest import BASE_YML
  mcfg = ModelConfig.from_config(load_config([BASE_YML, "model_name=qwen3-next-tiny",
                                              "linear_chunk_size=8"]))
  layer = nnx.jit(lambda: GatedDeltaNet(mcfg, rngs=nnx.Rngs(params=0)))()
  kind, rows, T, before = linear_state(mcfg), 4, 4, 3
  x = np.random.default_rng(6).normal(size=(rows, before + T, mcfg.emb_dim)).astype(np.float32)
  kept = np.array([0, 1, 3, T], np.int32)

  @jax.jit
  def run(x, kept):
    model = nnx.merge(*nnx.split(layer))
    state, steps = model.init_state(rows), []
    for t in range(before + T):    # the steps: a state to continue, then the tokens one by one
      y, state = model.step(x[:, t], state)
      steps.append((y, state))
    start = steps[before - 1][1]
    group = kind.verifying({name: a[None] for name, a in start.items()}, T)
    y, group = model.extend(x[:, before:], np.ones((rows, T), bool), False, group, 0)
    return y, kind.keep_verified(group, kept), steps

  y, got, steps = run(x, kept)
  want_y = np.stack([np.asarray(s[0]) for s in steps[before:]], 1)
  assert amax(np.asarray(y) - want_y) <= 1e-5 * amax(want_y)
  for b, m in enumerate(kept):
    want = steps[before - 1 + m][1]
    for name in ("conv", "delta"):
      w = np.asarray(want[name])[b]
      assert amax(np.asarray(got[name])[0, b] - w) <= 1e-5 * amax(w), (name, b, m)
  assert set(got) == {"conv", "delta"}


def test_rule_partitions_without_communication_and_refuses_a_sharded_sequence():
  from MaxText.sharding.rules import parse_rules, use_rules
  q, k, v, g, beta = inputs(4)
  seg = packed_segments()
  want = jax.jit(lambda *a: gd.gated_delta_rule(*a, chunk_size=32))(q, k, v, g, beta, seg)
  devices = np.asarray(jax.devices()[:8])
  rules = parse_rules([["activation_batch", ["data"]], ["activation_heads", ["tensor"]],
                       ["activation_length", ["context"]]], ["data", "context", "tensor"])
  mesh = jax.sharding.Mesh(devices[:6].reshape(2, 1, 3), ("data", "context", "tensor"),
                           axis_types=(AxisType.Auto,) * 3)       # batch 2-way, heads 3-way
  x_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "tensor"))
  placed = [jax.device_put(a, x_sh) for a in (q, k, v, g, beta)] + [
      jax.device_put(seg, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))]

  def loss(q, k, v, g, beta, seg):
    with use_rules(mesh, rules):
      return jnp.sum(gd.gated_delta_rule(q, k, v, g, beta, seg, chunk_size=32) ** 2)

  with jax.set_mesh(mesh):
    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    hlo = fwd_bwd.lower(*placed).compile().as_text()
    with use_rules(mesh, rules):
      o = jax.jit(lambda *a: gd.gated_delta_rule(*a, chunk_size=32))(*placed)
  np.testing.assert_allclose(np.asarray(o), np.asarray(want), rtol=0, atol=1e-6)
  assert o.sharding.shard_shape(o.shape) == (B // 2, S, H // 3, V)
  # per row and head: forward and backward partitioned with no communication but the loss's sum
  collectives = [op for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")
                 if op in hlo]
  reduces = [line for line in hlo.splitlines() if "all-reduce(" in line]
  assert not collectives and reduces and all("f32[] all-reduce(" in r for r in reduces), (
      collectives, reduces)
  cp = jax.sharding.Mesh(devices[:4].reshape(1, 2, 2), ("data", "context", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
  with jax.set_mesh(cp), use_rules(cp, rules), pytest.raises(ValueError, match="context"):
    jax.jit(lambda *a: gd.gated_delta_rule(*a, chunk_size=32))(
        *(np.asarray(x)[:, :148] for x in (q, k, v, g, beta, seg)))   # host slices: no programs
