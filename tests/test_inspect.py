"""MaxText.inspect against Hugging Face transformers (the oracle), on the tiny random-init fp32 models
of the families' parity tests (shared through their cached builders, so nothing is built twice):
  - hidden_states, attentions and logits equal transformers' `output_hidden_states=True,
    output_attentions=True` (eager attention), each row of a ragged batch against HF run on it alone;
  - a subset of layers / heads: the same values, and only those leave the compiled program;
  - interventions (zero-ablate mlp_out.l, a steering vector at resid_post.l, embed_out rows scaled
    by a mask) equal the same edits made with torch forward hooks; an identity intervention at
    every site changes nothing, bit for bit;
  - the logit lens from unembed_weight / final_norm equals transformers' own norm and head;
  - grad at a site equals a central finite difference.
Tolerances: 1e-5 of the largest magnitude of each compared array (fp32 runs of the same
computation in two frameworks: a few ulps per op over a handful of layers)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import test_gemma4_parity as gemma4  # noqa: E402
import test_qwen3_moe_parity as qwen3_moe  # noqa: E402
import test_qwen3_next_parity as qwen3_next  # noqa: E402
import test_qwen3_parity as qwen3  # noqa: E402
from MaxText import inference  # noqa: E402
from MaxText.inspect import Inspector  # noqa: E402

TOL = 1e-5
# name → (test module, its variant arguments); layer l for the interventions; its HF mlp module
FAMILIES = {
    "qwen3": (qwen3, (False,), 1),
    "qwen3_moe": (qwen3_moe, ("dense_first",), 1),
    "gemma4": (gemma4, ("all",), 4),              # sliding / full, kv-shared tail (layers 4, 5), PLE
    "gemma4_moe": (gemma4, ("moe",), 2),
    "qwen3_next": (qwen3_next, ("mixed",), 1),    # linear / full; attentions of layers 1, 3 only
}
ROWS = [[3, 17, 42, 99, 7, 61, 11, 5, 23, 64], [8, 2, 77, 31, 9, 14]]   # a ragged batch


@functools.lru_cache(maxsize=None)
def inspector(family: str, scan: bool = True) -> Inspector:
  module, args, _ = FAMILIES[family]
  cfg = module.our_config(*args, scan)
  _, _, params = module.ours(*args, scan)
  return Inspector(inference.load(cfg, params=params))


def hf(family: str):
  module, args, _ = FAMILIES[family]
  return module.hf_model(*args)


def hf_run(model, ids, **kw):
  with torch.no_grad():
    return model(input_ids=torch.tensor([ids]), use_cache=False, **kw)


def close(got, want, what: str):
  want = np.asarray(want, np.float32)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err, scale = float(np.abs(got - want).max()), max(1.0, float(np.abs(want).max()))
  assert err <= TOL * scale, (what, err, scale)
  return err / scale


@pytest.mark.parametrize("family,scan", [(f, True) for f in FAMILIES] + [("qwen3_next", False)])
def test_trace_matches_transformers(family, scan):
  m = inspector(family, scan)
  trace = m.forward(ROWS, capture={"hidden_states", "attentions", "logits"})
  L = m.num_layers
  assert list(trace.lengths) == [len(r) for r in ROWS] and trace.tokens.shape == (2, len(ROWS[0]))
  worst = 0.0
  for b, ids in enumerate(ROWS):
    n = len(ids)
    out = hf_run(hf(family), ids, output_hidden_states=True, output_attentions=True)
    assert len(trace.hidden_states) == len(out.hidden_states) == L + 1
    for i, (got, want) in enumerate(zip(trace.hidden_states, out.hidden_states)):
      worst = max(worst, close(got[b, :n], want[0], f"hidden_states[{i}] row {b}"))
    assert len(trace.attentions) == len(out.attentions)
    for l, got, want in zip(trace.attention_layers, trace.attentions, out.attentions):
      worst = max(worst, close(got[b, :, :n, :n], want[0], f"attentions layer {l} row {b}"))
    worst = max(worst, close(trace.logits[b, :n], out.logits[0], f"logits row {b}"))
  if family == "qwen3_next":
    assert trace.attention_layers == [1, 3]
  else:
    assert trace.attention_layers == list(range(L))
  print(f"{family} scan={scan}: worst |Δ| / max|x| = {worst:.1e}")


def test_one_sequence_and_a_subset_of_layers_and_heads():
  m = inspector("gemma4")
  ids = ROWS[0]
  full = m.forward(ids)
  assert full.tokens.shape == (len(ids),) and full.logits.shape == (len(ids), m.mcfg.vocab_size)
  part = m.forward(ids, capture=["hidden_states", "attentions"], layers=[3], heads=[1, 0])
  assert [h is not None for h in part.hidden_states] == [True, False, False, False, True, False,
                                                        False]
  np.testing.assert_array_equal(part.hidden_states[4], full.hidden_states[4])
  assert [a is not None for a in part.attentions] == [False, False, False, True, False, False]
  np.testing.assert_array_equal(part.attentions[3], full.attentions[3][[1, 0]])
  assert part.logits is None and not part.sites
  assert set(part.arrays()) == {"token_ids", "hidden_states", "hidden_states_index",
                                "attentions_3", "heads"}


def test_capture_by_site_names_and_globs():
  m = inspector("qwen3_next")
  t = m.forward(ROWS[1], capture=["resid_post.*", "mlp_out.2", "attn_scores.3", "embed_out"])
  L = m.num_layers
  assert set(t.sites) == {*(f"resid_post.{l}" for l in range(L)), "mlp_out.2", "attn_scores.3",
                          "embed_out"}
  full = m.forward(ROWS[1])
  for l in range(L - 1):
    np.testing.assert_array_equal(t.sites[f"resid_post.{l}"], full.hidden_states[l + 1])
  probs = jax.nn.softmax(t.sites["attn_scores.3"], axis=-1)
  np.testing.assert_allclose(probs, full.attentions[1], atol=1e-6)
  with pytest.raises(ValueError, match="attn_pattern.0"):   # layer 0 is a linear layer
    m.forward(ROWS[1], capture=["attn_pattern.0"])
  with pytest.raises(ValueError, match="mlp_in"):
    m.forward(ROWS[1], capture=["mlp_in.0"])


def _hooks(family: str, model, layer: int, steer, mask):
  """The three edits as torch forward hooks: zero the MLP branch of `layer`, add `steer` to its
  output, scale the embedding rows by `mask`."""
  layers = model.model.layers
  mlp = layers[layer].post_feedforward_layernorm if family.startswith("gemma4") else \
      layers[layer].mlp

  def zero(module, args, out):
    return tuple(torch.zeros_like(o) if i == 0 else o for i, o in enumerate(out)) \
        if isinstance(out, tuple) else torch.zeros_like(out)

  def add(module, args, out):
    return (out[0] + steer, *out[1:]) if isinstance(out, tuple) else out + steer

  def scale(module, args, out):
    return out * mask[:, None]

  return [mlp.register_forward_hook(zero), layers[layer].register_forward_hook(add),
          model.model.embed_tokens.register_forward_hook(scale)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_interventions_match_torch_hooks(family):
  m = inspector(family)
  layer = FAMILIES[family][2]
  ids = ROWS[0]
  rng = np.random.default_rng(0)
  steer = rng.normal(size=m.mcfg.emb_dim).astype(np.float32)
  mask = (np.arange(len(ids)) % 3 != 1).astype(np.float32)
  edits = {f"mlp_out.{layer}": lambda x, ctx: jnp.zeros_like(x),
           f"resid_post.{layer}": lambda x, ctx: x + steer,
           "embed_out": lambda x, ctx: x * mask[None, :, None]}
  with m.intervene(edits):
    got = m.forward(ids, capture=["logits"]).logits
  model = hf(family)
  plain = hf_run(model, ids).logits[0].numpy()
  handles = _hooks(family, model, layer, torch.tensor(steer), torch.tensor(mask))
  try:
    want = hf_run(model, ids).logits[0].numpy()
  finally:
    for h in handles:
      h.remove()
  err = close(got, want, "edited logits")
  moved = np.abs(plain - want).max() / np.abs(want).max()
  print(f"{family}: edited |Δ| / max = {err:.1e}; the edits moved the logits by {moved:.2f}")
  assert moved > 100 * TOL


def test_identity_interventions_change_nothing_bitwise():
  m = inspector("gemma4")
  capture = ["logits", "hidden_states", "attentions"]
  plain = m.forward(ROWS, capture=capture)
  ident = lambda x, ctx: x
  every = {"embed_out": ident, "final_norm_out": ident, "logits": ident,
           **{f"{b}.*": ident for b in ("resid_pre", "attn_scores", "attn_pattern", "attn_out",
                                         "mlp_out", "resid_post")},
           "mlp_out.3": ident}
  with m.intervene(every):
    same = m.forward(ROWS, capture=capture)
  np.testing.assert_array_equal(same.logits, plain.logits)
  for a, b in zip(same.hidden_states + same.attentions, plain.hidden_states + plain.attentions):
    np.testing.assert_array_equal(a, b)
