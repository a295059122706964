"""The Llama-style model against an independent float64 NumPy forward pass written from the math:
RMSNorm, rotate-half RoPE, GQA causal attention with packed-document masking, SwiGLU, final norm,
untied/tied LM head, optional per-head q/k RMSNorm. Plus packing isolation, scan ≡ unrolled, and
bf16 compute staying close to fp32."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def

D, L, H, K, E, F, V, S = 32, 2, 4, 2, 8, 48, 50, 16
MODEL = [f"emb_dim={D}", f"num_decoder_layers={L}", f"num_query_heads={H}", f"num_kv_heads={K}",
         f"head_dim={E}", f"mlp_dim={F}", f"vocab_size={V}", f"max_target_length={S}",
         "rope_theta=1000.0", "norm_epsilon=1e-5", "init_std=0.5"]


# ---- the NumPy reference ------------------------------------------------------------------------
def rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x, pos, theta):
  """x[B,S,N,E]: channel i < E/2 pairs with i + E/2, rotated by pos * theta^(-2i/E)."""
  e = x.shape[-1]
  freq = theta ** (-np.arange(e // 2, dtype=np.float64) * 2.0 / e)
  ang = pos[:, :, None, None].astype(np.float64) * freq            # [B,S,1,E/2]
  c, s = np.cos(ang), np.sin(ang)
  x1, x2 = x[..., : e // 2], x[..., e // 2:]
  return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def silu(x):
  return x / (1.0 + np.exp(-x))


def attention(q, k, v, seg):
  """q[B,S,H,E], k/v[B,S,K,E]; query head h uses kv head h // (H/K). Position s attends to t <= s
  of the same segment."""
  b, s, h, e = q.shape
  group = h // k.shape[2]
  out = np.zeros_like(q)
  allowed = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((s, s), bool))[None]
  for head in range(h):
    kv = head // group
    scores = np.einsum("bse,bte->bst", q[:, :, head], k[:, :, kv]) / np.sqrt(e)
    scores = np.where(allowed, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    out[:, :, head] = np.einsum("bst,bte->bse", p, v[:, :, kv])
  return out


def layer_params(params, i, scan):
  """Layer i: scanned, the one run of the pattern stack (its one member, stacked over the layers);
  unscanned, decoder/layers/i."""
  if scan:
    return jax.tree.map(lambda a: a[i], params["decoder"]["runs"][0][0])
  return params["decoder"]["layers"][i]


def reference_logits(params, tokens, pos, seg, *, eps, theta, qk_norm, tied, scan):
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = p["embedding"][tokens]
  for i in range(L):
    lp = layer_params(p, i, scan)
    a = lp["attn"]
    h = rms_norm(x, lp["attn_norm"]["scale"], eps)
    q = np.einsum("bsd,dhe->bshe", h, a["query"]["kernel"])
    k = np.einsum("bsd,dke->bske", h, a["key"]["kernel"])
    v = np.einsum("bsd,dke->bske", h, a["value"]["kernel"])
    if qk_norm:
      q = rms_norm(q, a["query_norm"]["scale"], eps)
      k = rms_norm(k, a["key_norm"]["scale"], eps)
    q, k = rope(q, pos, theta), rope(k, pos, theta)
    x = x + np.einsum("bshe,hed->bsd", attention(q, k, v, seg), a["out"]["kernel"])
    m = lp["mlp"]
    h = rms_norm(x, lp["mlp_norm"]["scale"], eps)
    x = x + (silu(h @ m["gate"]["kernel"]) * (h @ m["up"]["kernel"])) @ m["down"]["kernel"]
  x = rms_norm(x, p["final_norm"]["scale"], eps)
  return x @ (p["embedding"].T if tied else p["lm_head"]["kernel"])


# ---- helpers ------------------------------------------------------------------------------------
def random_params(model_def, seed):
  """Parameters of `model_def`'s shapes drawn with NumPy (no per-op compiles, unlike the eager
  `init_params`): N(0, 0.3) matrices, N(0, 0.5) embeddings, norm scales 1 + N(0, 0.3) so that a
  missing or misplaced scale shows."""
  rng = np.random.default_rng(seed)
  def draw(path, s):
    name = path[-1].key
    x = rng.standard_normal(s.shape)
    x = 1.0 + 0.3 * x if name == "scale" else (0.5 if name == "embedding" else 0.3) * x
    return jnp.asarray(x, s.dtype)
  return jax.tree_util.tree_map_with_path(draw, model_def.abstract_params)


@functools.lru_cache(maxsize=None)
def build(*overrides, seed=0):
  """(config, model def, parameters) of MODEL + overrides; cached, as are the compiled forwards."""
  cfg = load_config([BASE_YML, *MODEL, *overrides])
  model_def = make_model_def(ModelConfig.from_config(cfg))
  return cfg, model_def, random_params(model_def, seed)


_JITTED = {}  # id(model_def) → jitted apply (the model defs live in build's cache)


def forward(model_def, params, tokens, pos, seg):
  fn = _JITTED.setdefault(id(model_def), jax.jit(model_def.apply))
  return np.asarray(fn(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int32),
                       jnp.asarray(seg, jnp.int32)))


def rel_err(got, want):
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


DOC1, DOC2 = 5, 7  # packed row: doc 1 at [0,5), doc 2 at [5,12), padding (segment 0) after


def batch():
  """Row 0: one document filling the row. Row 1: two packed documents and padding."""
  rng = np.random.default_rng(42)
  tokens = rng.integers(0, V, size=(2, S))
  pos = np.stack([np.arange(S),
                  np.concatenate([np.arange(DOC1), np.arange(DOC2), np.zeros(S - DOC1 - DOC2, int)])])
  seg = np.stack([np.ones(S, int),
                  np.concatenate([np.full(DOC1, 1), np.full(DOC2, 2), np.zeros(S - DOC1 - DOC2, int)])])
  return tokens, pos, seg


def check_against_reference(*overrides, qk_norm=False, tied=False, scan=True):
  cfg, model_def, params = build(*overrides)
  assert (cfg.use_qk_norm, cfg.tie_word_embeddings, cfg.scan_layers) == (qk_norm, tied, scan)
  assert ("lm_head" in params) == (not tied)
  assert ("query_norm" in layer_params(params, 0, scan)["attn"]) == qk_norm
  tokens, pos, seg = batch()
  got = forward(model_def, params, tokens, pos, seg)
  assert got.dtype == np.float32 and got.shape == (2, S, V)
  want = reference_logits(params, tokens, pos, seg, eps=cfg.norm_epsilon, theta=cfg.rope_theta,
                          qk_norm=qk_norm, tied=tied, scan=scan)
  assert rel_err(got, want) < 1e-4, rel_err(got, want)
  return model_def, params, got


# ---- tests --------------------------------------------------------------------------------------
def test_init_params_match_the_model_def_and_reference():
  cfg, model_def, _ = build()
  params = init_params(ModelConfig.from_config(cfg), 0)
  shapes = lambda t: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), t)
  assert shapes(params) == shapes(model_def.abstract_params)
  assert np.all(np.asarray(params["final_norm"]["scale"]) == 1.0)
  assert abs(float(np.std(params["embedding"])) - cfg.init_std) < 0.1 * cfg.init_std
  q = np.asarray(params["decoder"]["runs"][0][0]["attn"]["query"]["kernel"])
  assert abs(float(np.std(q)) - D ** -0.5) < 0.1 * D ** -0.5
  assert not np.allclose(q[0], q[1])  # each layer gets its own draw
  tokens, pos, seg = batch()
  got = forward(model_def, params, tokens, pos, seg)
  want = reference_logits(params, tokens, pos, seg, eps=cfg.norm_epsilon, theta=cfg.rope_theta,
                          qk_norm=False, tied=False, scan=True)
  assert rel_err(got, want) < 1e-4, rel_err(got, want)


def test_gqa_matches_reference():
  check_against_reference()


def test_qk_norm_matches_reference():
  check_against_reference("use_qk_norm=true", qk_norm=True)


def test_tied_embeddings_match_reference():
  check_against_reference("tie_word_embeddings=true", tied=True)


def test_unrolled_layers_match_reference():
  check_against_reference("scan_layers=false", "use_qk_norm=true", qk_norm=True, scan=False)


def test_reference_is_sensitive():
  """The reference tells apart the variants it is meant to check (so the tests above can fail)."""
  cfg, _, params = build("use_qk_norm=true")
  tokens, pos, seg = batch()
  kw = dict(eps=cfg.norm_epsilon, theta=cfg.rope_theta, qk_norm=True, tied=False, scan=True)
  base = reference_logits(params, tokens, pos, seg, **kw)
  for change in (dict(qk_norm=False), dict(theta=10000.0), dict(tied=True)):
    assert rel_err(reference_logits(params, tokens, pos, seg, **{**kw, **change}), base) > 1e-3
  assert rel_err(reference_logits(params, tokens, pos, np.ones_like(seg), **kw), base) > 1e-3


def test_packed_documents_are_isolated():
  _, model_def, params = build()
  tokens, pos, seg = batch()
  packed = forward(model_def, params, tokens[1:], pos[1:], seg[1:])[0]
  alone1 = forward(model_def, params, tokens[1:, :DOC1], pos[1:, :DOC1], np.ones((1, DOC1), int))[0]
  doc2 = slice(DOC1, DOC1 + DOC2)
  alone2 = forward(model_def, params, tokens[1:, doc2], np.arange(DOC2)[None],
                   np.ones((1, DOC2), int))[0]
  assert rel_err(packed[:DOC1], alone1) < 1e-5
  assert rel_err(packed[doc2], alone2) < 1e-5
  # without the segment ids (one long document, running positions) doc 2 would see doc 1
  merged = forward(model_def, params, tokens[1:], np.arange(S)[None], np.ones((1, S), int))[0]
  assert rel_err(merged[doc2], alone2) > 1e-3


def test_scan_and_unrolled_layers_agree():
  _, scan_def, scan_params = build("use_qk_norm=true")
  cfg, loop_def, loop_params = build("use_qk_norm=true", "scan_layers=false")
  assert not cfg.scan_layers
  stacked = scan_params["decoder"]["runs"][0][0]
  per_layer = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(L)}
  assert jax.tree.structure(per_layer) == jax.tree.structure(loop_params["decoder"]["layers"])
  mapped = {**scan_params, "decoder": {"layers": per_layer}}
  assert jax.tree.structure(mapped) == jax.tree.structure(loop_params)
  tokens, pos, seg = batch()
  a = forward(scan_def, scan_params, tokens, pos, seg)
  b = forward(loop_def, mapped, tokens, pos, seg)
  assert rel_err(b, a) < 1e-5
  # the two layers differ, so a stack that used one layer twice (or swapped them) would show
  swapped = {**mapped, "decoder": {"layers": {0: per_layer[1], 1: per_layer[0]}}}
  assert rel_err(forward(loop_def, swapped, tokens, pos, seg), a) > 1e-3


def test_bf16_compute_is_close_to_fp32():
  _, def32, params = build()
  cfg, def16, params16 = build("dtype=bfloat16")
  assert cfg.dtype == "bfloat16" and cfg.weight_dtype == "float32"
  assert jax.tree.map(lambda a: a.dtype, params16) == jax.tree.map(lambda a: a.dtype, params)
  tokens, pos, seg = batch()
  f32 = forward(def32, params, tokens, pos, seg)
  bf16 = forward(def16, params, tokens, pos, seg)
  assert bf16.dtype == np.float32 and np.all(np.isfinite(bf16))
  diff = np.max(np.abs(bf16 - f32))
  assert diff < 0.05 * np.max(np.abs(f32)), (diff, np.max(np.abs(f32)))
  assert diff > 0  # the compute really ran in bfloat16
