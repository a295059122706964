"""Our llama family against Hugging Face transformers' Qwen3 (the oracle), through the name map of
MaxText/models/qwen3/hf_map.py: tiny random-init `Qwen3ForCausalLM` (fp32, eager attention, GQA 4/2,
head_dim 32, perturbed norm weights), untied and tied, scanned and unrolled layers. Checks logits
(incl. a packed row against HF run per document), the exact state-dict round trip, loss and
gradients against torch autograd, the config maps, and the published configs' parameter counts."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.qwen3 import hf_map  # noqa: E402
from MaxText.train.state import make_model_def  # noqa: E402

S, DOC1 = 12, 5          # row 0: one document of S tokens; row 1: documents [0, DOC1) and [DOC1, S)
THETA = 1000.0           # small θ so that every channel pair rotates visibly at positions < S
TOL_LOGIT, TOL_KL, TOL_GRAD = 1e-4, 1e-6, 1e-4


def our_config(tied: bool, scan: bool):
  return load_config([BASE_YML, "model_name=qwen3-tiny", f"rope_theta={THETA}",
                      f"tie_word_embeddings={str(tied).lower()}", f"scan_layers={str(scan).lower()}"])


@functools.lru_cache(maxsize=None)
def hf_model(tied: bool):
  """A random-init HF Qwen3 built from config_to_hf(our tiny config); norm weights perturbed."""
  cfg = transformers.Qwen3Config(**hf_map.config_to_hf(our_config(tied, True)),
                                 initializer_range=0.2, attn_implementation="eager")
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(cfg).float().eval()
  assert model.config._attn_implementation == "eager"
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
  return model


def hf_state(model) -> dict[str, np.ndarray]:
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@functools.lru_cache(maxsize=None)
def ours(tied: bool, scan: bool):
  """(ModelConfig from the HF config, model def, params converted from the HF state dict)."""
  model = hf_model(tied)
  cfg = replace(our_config(tied, scan), **hf_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(tied, scan)  # config_to_hf → Qwen3Config → config_from_hf is lossless
  mcfg = ModelConfig.from_config(cfg)
  return mcfg, make_model_def(mcfg), hf_map.hf_to_params(hf_state(model), mcfg)


def batch():
  rng = np.random.default_rng(0)
  V = our_config(False, True).vocab_size
  tokens = rng.integers(0, V, size=(2, S))
  pos = np.stack([np.arange(S), np.concatenate([np.arange(DOC1), np.arange(S - DOC1)])])
  seg = np.stack([np.ones(S, int), np.concatenate([np.full(DOC1, 1), np.full(S - DOC1, 2)])])
  return tokens, pos, seg


def documents():
  """(row, slice) of every document of the batch — what HF runs one at a time."""
  return [(0, slice(0, S)), (1, slice(0, DOC1)), (1, slice(DOC1, S))]


def hf_logits(model, tokens) -> np.ndarray:
  out = np.zeros((*tokens.shape, model.config.vocab_size), np.float32)
  with torch.no_grad():
    for row, sl in documents():
      ids = torch.tensor(tokens[row:row + 1, sl])
      out[row, sl] = model(input_ids=ids, use_cache=False).logits[0].numpy()
  return out


def our_logits(model_def, params, tokens, pos, seg) -> np.ndarray:
  fn = jax.jit(model_def.apply)
  return np.asarray(fn(params, *(jnp.asarray(a, jnp.int32) for a in (tokens, pos, seg))))


def kl(p_logits, q_logits) -> np.ndarray:
  """Per-token KL(p || q) in float64."""
  lp = p_logits.astype(np.float64)
  lq = q_logits.astype(np.float64)
  lp = lp - np.log(np.sum(np.exp(lp - lp.max(-1, keepdims=True)), -1, keepdims=True)) - lp.max(-1, keepdims=True)
  lq = lq - np.log(np.sum(np.exp(lq - lq.max(-1, keepdims=True)), -1, keepdims=True)) - lq.max(-1, keepdims=True)
  return np.sum(np.exp(lp) * (lp - lq), axis=-1)


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_hf(tied, scan):
  mcfg, model_def, params = ours(tied, scan)
  assert ("lm_head" in params) == (not tied)
  norms = [v for k, v in hf_state(hf_model(tied)).items() if k.endswith("norm.weight")]
  assert all(np.abs(n - 1.0).max() > 0.1 for n in norms)   # scales are not all ones
  tokens, pos, seg = batch()
  got = our_logits(model_def, params, tokens, pos, seg)
  want = hf_logits(hf_model(tied), tokens)
  scale = np.abs(want).max()
  assert scale > 1.0
  err, div = np.abs(got - want).max(), kl(want, got).max()
  print(f"tied={tied} scan={scan}: max|Δlogit|={err:.2e} (max|logit|={scale:.2f}) max KL={div:.2e}")
  assert err <= TOL_LOGIT * scale, (err, scale)
  assert div <= TOL_KL, div
  # the packed row alone: each document equals HF run on that document by itself
  for row, sl in documents()[1:]:
    assert np.abs(got[row, sl] - want[row, sl]).max() <= TOL_LOGIT * scale
  # and it is a real test: one long document (running positions, no segments) would not match
  merged = our_logits(model_def, params, tokens[1:], np.arange(S)[None], np.ones((1, S), int))
  assert np.abs(merged[0, DOC1:] - want[1, DOC1:]).max() > 100 * TOL_LOGIT * scale


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scan", [True, False])
def test_state_dict_round_trip_is_exact(tied, scan):
  sd = hf_state(hf_model(tied))
  mcfg, model_def, params = ours(tied, scan)
  shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), t)
  assert shapes(params) == shapes(model_def.abstract_params)
  back = hf_map.params_to_hf(params, mcfg, tied_lm_head=True)
  assert back.keys() == sd.keys()
  for k in sd:
    assert back[k].dtype == sd[k].dtype and np.array_equal(back[k], sd[k]), k
  assert sorted(hf_map.hf_names(mcfg, tied_lm_head=True)) == sorted(sd)
  saved = hf_map.params_to_hf(params, mcfg)               # the save_pretrained form
  assert ("lm_head.weight" in saved) == (not tied)
  if scan:  # stacked [L, ...] kernels hold layer i at index i
    q = params["decoder"]["layers"]["attn"]["query"]["kernel"]
    D, H, E = mcfg.emb_dim, mcfg.num_query_heads, mcfg.head_dim
    w1 = sd["model.layers.1.self_attn.q_proj.weight"]     # [H*E, D], row h*E + e
    np.testing.assert_array_equal(q[1, :, 2, 3], w1[2 * E + 3])
    assert q.shape == (mcfg.num_decoder_layers, D, H, E)


def test_hf_to_params_is_strict():
  sd = hf_state(hf_model(False))
  mcfg = ours(False, True)[0]
  missing = dict(sd)
  del missing["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match="lacks model.layers.1.mlp.up_proj.weight"):
    hf_map.hf_to_params(missing, mcfg)
  with pytest.raises(ValueError, match="no place"):
    hf_map.hf_to_params({**sd, "model.layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)}, mcfg)
  bad = {**sd, "model.norm.weight": np.ones(65, np.float32)}
  with pytest.raises(ValueError, match="model.norm.weight"):
    hf_map.hf_to_params(bad, mcfg)
  tied_sd = hf_state(hf_model(True))
  tied_sd["lm_head.weight"] = tied_sd["lm_head.weight"] + 1.0
  with pytest.raises(ValueError, match="differs"):
    hf_map.hf_to_params(tied_sd, ours(True, True)[0])


def test_loss_and_grads_match_torch_autograd():
  tied, scan = False, True
  model = hf_model(tied)
  mcfg, model_def, params = ours(tied, scan)
  tokens, pos, seg = batch()
  targets = np.random.default_rng(1).integers(0, mcfg.vocab_size, size=tokens.shape)

  # torch: every document on its own; mean cross-entropy over all 2*S tokens
  model.zero_grad()
  total = 0.0
  for row, sl in documents():
    logits = model(input_ids=torch.tensor(tokens[row:row + 1, sl]), use_cache=False).logits[0]
    total = total + torch.nn.functional.cross_entropy(
        logits, torch.tensor(targets[row, sl]), reduction="sum")
  loss_hf = total / tokens.size
  loss_hf.backward()
  grads_hf = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}
  grads_hf = hf_map.hf_to_params(grads_hf, mcfg)  # the same name map carries the grads

  def loss_fn(p):
    logits = model_def.apply(p, *(jnp.asarray(a, jnp.int32) for a in (tokens, pos, seg)))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1))

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  loss_hf = loss_hf.item()
  rel = abs(float(loss) - loss_hf) / abs(loss_hf)
  print(f"loss ours={float(loss):.6f} hf={loss_hf:.6f} rel={rel:.1e}")
  assert rel <= TOL_GRAD
  worst = 0.0
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    want = functools.reduce(lambda t, k: t[k.key], path, grads_hf)
    name = "/".join(str(k.key) for k in path)
    scale = np.abs(want).max()
    assert scale > 0, name
    err = np.abs(np.asarray(g) - want).max() / scale
    worst = max(worst, err)
    assert err <= TOL_GRAD, (name, err)
  print(f"max grad error (relative to each tensor's max |grad|) = {worst:.1e}")


# the Qwen/Qwen3-0.6B config.json as published on the Hub (transformers 4.51 form)
QWEN3_0_6B_HUB = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

# model-card parameter counts (billions): total, non-embedding
PUBLISHED = {"0.6b": (0.6, 0.44), "1.7b": (1.7, 1.4), "4b": (4.0, 3.6), "8b": (8.2, 6.95),
             "14b": (14.8, 13.2), "32b": (32.8, 31.2)}


def test_published_configs():
  hub = hf_map.config_from_hf(QWEN3_0_6B_HUB)
  cfg = load_config([BASE_YML, "model_name=qwen3-0.6b"])
  assert {k: getattr(cfg, k) for k in hub} == hub
  assert hf_map.config_from_hf(transformers.Qwen3Config(**QWEN3_0_6B_HUB).to_dict()) == hub
  for name, (total_b, non_emb_b) in PUBLISHED.items():
    cfg = load_config([BASE_YML, f"model_name=qwen3-{name}"])
    mcfg = ModelConfig.from_config(cfg)
    assert hf_map.config_from_hf(hf_map.config_to_hf(cfg)) == {k: getattr(cfg, k) for k in hub}
    counts = {"/".join(str(k.key) for k in p): math.prod(a.shape) for p, a in
              jax.tree_util.tree_flatten_with_path(make_model_def(mcfg).abstract_params)[0]}
    total = sum(counts.values()) / 1e9
    non_emb = total - (counts["embedding"] + counts.get("lm_head/kernel", 0)) / 1e9
    assert abs(total - total_b) < 0.05 * total_b + 0.01, (name, total)
    assert abs(non_emb - non_emb_b) < 0.05 * non_emb_b, (name, non_emb)
  with pytest.raises(ValueError, match="rope type"):
    hf_map.config_from_hf({**QWEN3_0_6B_HUB, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
  with pytest.raises(ValueError, match="sliding"):
    hf_map.config_from_hf({**QWEN3_0_6B_HUB, "use_sliding_window": True})
