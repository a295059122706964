"""Our gemma4 family against Hugging Face transformers' Gemma 4 text model (the oracle), through the
name map of MaxText/models/gemma4/hf_map.py. Tiny random-init `Gemma4ForCausalLM` (fp32, eager
attention) in two variants:
  moe    the 26B-A4B shape: routed experts (router scale, per-expert scale) added to the MLP;
  all    every feature on: sliding + full layers (pattern "sf", window 4 < the sequence), global
         head width and kv heads, K = V, proportional partial RoPE, a kv-shared tail with a
         double-wide MLP, per-layer inputs (PLE), soft-capped logits, tied head;
  plain  separate V projections, no sharing, no PLE, no soft-cap, untied head, pattern "ssf".
Norm weights and every `layer_scalar` are perturbed away from 1. Checks logits (incl. a packed row
against HF run per document), bf16 KL, the exact state-dict round trip, the scan layout, strictness,
hub-checkpoint extras (shared layers' K/V, multimodal prefix), loss and gradients against torch
autograd, the config maps and the published configs' parameter counts."""
import functools
import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import (TOL_GRAD, batch, build_hf_model, check_logits,  # noqa: E402
                       check_round_trip, compare_grads, hf_logits, hf_loss_and_grads, hf_state,
                       kl, our_logits, our_loss_and_grads)
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.models.gemma4 import hf_map  # noqa: E402
from MaxText.layers.stack import plan_runs  # noqa: E402
from MaxText.models.gemma4.model import layer_kinds  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402

VARIANTS = {
    "all": ["attention_pattern=sf", "num_decoder_layers=6", "num_kv_shared_layers=2",
            "sliding_window=4"],
    "plain": ["attention_pattern=ssf", "num_decoder_layers=3", "sliding_window=4",
              "attention_k_eq_v=false", "global_num_kv_heads=0", "num_kv_shared_layers=0",
              "double_wide_mlp_on_shared=false", "per_layer_input_dim=0",
              "per_layer_input_vocab_size=0", "final_logit_softcap=0", "tie_word_embeddings=false"],
    # the 26B-A4B shape: routed experts added to every layer's dense MLP, K = V, no PLE or sharing
    "moe": ["attention_pattern=sf", "num_decoder_layers=4", "sliding_window=4",
            "num_kv_shared_layers=0", "double_wide_mlp_on_shared=false", "per_layer_input_dim=0",
            "per_layer_input_vocab_size=0", "num_experts=4", "num_experts_per_tok=2",
            "moe_mlp_dim=24"],
}


def our_config(variant: str, scan: bool = True, *extra: str):
  return load_config([BASE_YML, "model_name=gemma4-tiny", *VARIANTS[variant],
                      f"scan_layers={str(scan).lower()}", *extra])


@functools.lru_cache(maxsize=None)
def hf_model(variant: str, dtype: str = "float32"):
  """A random-init HF Gemma 4 built from config_to_hf(our tiny config); norms and layer scalars
  perturbed."""
  model = build_hf_model(transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
                         hf_map.config_to_hf(our_config(variant)),
                         perturb=("norm.weight", "router.scale", "per_expert_scale"),
                         perturb_buffers=("layer_scalar",))
  return model if dtype == "float32" else model.to(getattr(torch, dtype))


@functools.lru_cache(maxsize=None)
def ours(variant: str, scan: bool, *extra: str):
  """(ModelConfig from the HF config, model def, params converted from the HF state dict)."""
  model = hf_model(variant)
  cfg = replace(our_config(variant, scan, *extra), **hf_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(variant, scan, *extra)  # config_to_hf → HF config → config_from_hf
  mcfg = ModelConfig.from_config(cfg)
  return mcfg, make_model_def(mcfg), hf_map.hf_to_params(hf_state(model), mcfg)


# ---- numerics -----------------------------------------------------------------------------------
# Every variant scanned; unscanned, "all" alone: the unscanned stack (one parameter tree per layer,
# the kv-shared tail, PLE per layer) is the same code for every variant, and "all" takes every
# branch of it that "plain" and "moe" take (their layers are the scanned runs' modules; the name
# map's unscanned layouts of all three: test_state_dict_round_trip_is_exact)
@pytest.mark.parametrize("variant,scan", [(v, True) for v in VARIANTS] + [("all", False)])
def test_logits_match_hf(variant, scan):
  mcfg, model_def, params = ours(variant, scan)
  sd = hf_state(hf_model(variant))
  scalars = [v for k, v in sd.items() if k.endswith("layer_scalar")]
  assert len(scalars) == mcfg.num_decoder_layers and all(abs(s[0] - 1) > 1e-3 for s in scalars)
  check_logits(model_def, params, hf_model(variant), mcfg.vocab_size)


def test_features_are_live():
  """Each Gemma 4 feature changes the logits (so the parity above covers it)."""
  mcfg, model_def, params = ours("all", True)
  tokens, pos, seg = batch(mcfg.vocab_size)
  base = our_logits(model_def, params, tokens, pos, seg)
  for override in ("sliding_window=64", "global_rope_fraction=1.0", "final_logit_softcap=0",
                   "attention_scale=0.5"):
    key, value = override.split("=")
    cfg = replace(our_config("all"), **{key: type(getattr(mcfg, key))(float(value))})
    other = make_model_def(ModelConfig.from_config(cfg))
    assert np.abs(our_logits(other, params, tokens, pos, seg) - base).max() > 1e-3, override


def test_bf16_logits_within_kl():
  """transformers in bf16 against our bf16 compute with bf16 weights: KL ≤ 0.015."""
  mcfg, _, params = ours("all", True)
  cfg = replace(our_config("all"), dtype="bfloat16", weight_dtype="bfloat16")
  model_def = make_model_def(ModelConfig.from_config(cfg))
  params = jax.tree.map(lambda a, s: np.asarray(a).astype(s.dtype), params, model_def.abstract_params)
  tokens, pos, seg = batch(mcfg.vocab_size)
  got = our_logits(model_def, params, tokens, pos, seg)
  want = hf_logits(hf_model("all", "bfloat16"), tokens)
  div = kl(want, got).max()
  print(f"bf16 max KL = {div:.2e}")
  assert div <= 0.015


@pytest.mark.parametrize("variant", ["all", "moe"])
def test_loss_and_grads_match_torch_autograd(variant):
  model = hf_model(variant)
  mcfg, model_def, params = ours(variant, True)
  tokens, pos, seg = batch(mcfg.vocab_size)
  targets = np.random.default_rng(1).integers(0, mcfg.vocab_size, size=tokens.shape)
  loss_hf, grads_hf = hf_loss_and_grads(model, tokens, targets)
  _, grads_exact = hf_loss_and_grads(model, tokens, targets, float64=True)
  # layer_scalar is a buffer in HF (no gradient): ours is frozen, its gradient must be exactly 0
  for g in (grads_hf, grads_exact):
    g.update({k: np.zeros_like(v) for k, v in hf_state(model).items()
              if k.endswith("layer_scalar")})
  loss, grads = our_loss_and_grads(model_def, params, tokens, pos, seg, targets)
  rel = abs(loss - loss_hf) / abs(loss_hf)
  print(f"loss ours={loss:.6f} hf={loss_hf:.6f} rel={rel:.1e}")
  assert rel <= TOL_GRAD
  compare_grads(grads, hf_map.hf_to_params(grads_hf, mcfg), frozen=("layer_scalar", "router_bias"),
                exact_tree=hf_map.hf_to_params(grads_exact, mcfg))


# ---- the name map -------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scan", [True, False])
def test_state_dict_round_trip_is_exact(variant, scan):
  mcfg, model_def, params = ours(variant, scan)
  check_round_trip(hf_map, mcfg, model_def, params, hf_state(hf_model(variant)))


def test_scan_layout():
  """Non-shared layers "sfsf" scan as 2 blocks of (s, f); the shared tail "sf" as 1 block; layer i
  of HF sits at (run, member, repeat) — e.g. layer 3 (full) is run 0, member 1, repeat 1."""
  mcfg, _, params = ours("all", True)
  runs = plan_runs(layer_kinds(mcfg))
  assert [(r.start, len(r.block), r.repeats) for r in runs] == [(0, 2, 2), (4, 2, 1)]
  q = params["decoder"]["runs"][0][1]["attn"]["query"]["kernel"]
  w3 = hf_state(hf_model("all"))["model.layers.3.self_attn.q_proj.weight"]   # [H*E, D]
  E = mcfg.global_head_dim
  assert q.shape == (2, mcfg.emb_dim, mcfg.num_query_heads, E)
  np.testing.assert_array_equal(q[1, :, 2, 3], w3[2 * E + 3])
  shared = params["decoder"]["runs"][1][0]["attn"]
  assert "key" not in shared and "value" not in shared                  # kv-shared: no K/V
  full = params["decoder"]["runs"][0][1]["attn"]
  assert "key" in full and "value" not in full                          # K = V on full layers


def test_hf_to_params_is_strict_and_accepts_hub_extras():
  sd = hf_state(hf_model("all"))
  mcfg = ours("all", True)[0]
  missing = dict(sd)
  del missing["model.layers.1.self_attn.k_proj.weight"]
  with pytest.raises(ValueError, match="lacks model.layers.1.self_attn.k_proj.weight"):
    hf_map.hf_to_params(missing, mcfg)
  with pytest.raises(ValueError, match="no place.*layers.1.self_attn.v_proj"):  # K = V layer
    hf_map.hf_to_params({**sd, "model.layers.1.self_attn.v_proj.weight": np.zeros((32, 64))}, mcfg)
  bad = {**sd, "model.per_layer_projection_norm.weight": np.ones(9, np.float32)}
  with pytest.raises(ValueError, match="model.per_layer_projection_norm.weight"):
    hf_map.hf_to_params(bad, mcfg)
  want = hf_map.hf_to_params(sd, mcfg)
  # hub checkpoints keep K/V weights on the kv-shared layers (4, 5): ignored, as transformers does
  hub = {**sd, "model.layers.4.self_attn.k_proj.weight": np.zeros((32, 64), np.float32),
         "model.layers.5.self_attn.k_norm.weight": np.ones(32, np.float32)}
  jax.tree.map(np.testing.assert_array_equal, hf_map.hf_to_params(hub, mcfg), want)
  # a multimodal checkpoint: text weights under model.language_model., towers skipped
  mm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
        for k, v in sd.items()}
  mm["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.zeros((4, 4))
  mm["model.embed_vision.embedding_projection.weight"] = np.zeros((4, 4))
  jax.tree.map(np.testing.assert_array_equal, hf_map.hf_to_params(mm, mcfg), want)


# ---- configs ------------------------------------------------------------------------------------
# google/gemma-4-E2B text_config in the hub form (global_head_dim, explicit layer_types)
E2B_HUB = {
    "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536,
    "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8,
    "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional",
                                           "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144, "attention_k_eq_v": False, "num_kv_shared_layers": 20,
    "enable_moe_block": False, "use_double_wide_mlp": True, "attention_bias": False,
}

# model-card parameter counts of the text decoder (billions): all, and all but the PLE table
# (the "effective" size of the E models; their 5.1B / 8B totals also count vision and audio)
PUBLISHED = {"e2b": (4.6, 2.3), "e4b": (7.5, 4.5), "31b": (30.7, 30.7)}


def test_published_configs():
  ours_e2b = load_config([BASE_YML, "model_name=gemma4-e2b"])
  from_hub = hf_map.config_from_hf(E2B_HUB)
  assert {k: getattr(ours_e2b, k) for k in from_hub} == from_hub
  # the same model through transformers' own config class (per_layer_config form) ...
  hf_dict = transformers.Gemma4TextConfig(**E2B_HUB).to_dict()
  assert hf_map.config_from_hf(hf_dict) == from_hub
  # ... inside a multimodal config, and back through config_to_hf
  assert hf_map.config_from_hf({"model_type": "gemma4", "text_config": E2B_HUB}) == from_hub
  assert hf_map.config_from_hf(hf_map.config_to_hf(ours_e2b)) == from_hub
  assert load_config([BASE_YML, "model_name=gemma4"]) == replace(ours_e2b, model_name="gemma4")
  for name, (total_b, effective_b) in PUBLISHED.items():
    cfg = load_config([BASE_YML, f"model_name=gemma4-{name}"])
    assert hf_map.config_from_hf(hf_map.config_to_hf(cfg)) == {
        k: getattr(cfg, k) for k in hf_map.config_from_hf(hf_map.config_to_hf(cfg))}
    counts = {"/".join(str(k.key) for k in p): math.prod(a.shape) for p, a in
              jax.tree_util.tree_flatten_with_path(
                  make_model_def(ModelConfig.from_config(cfg)).abstract_params)[0]}
    total = sum(counts.values()) / 1e9
    effective = total - counts.get("ple_embedding", 0) / 1e9
    assert abs(total - total_b) < 0.03 * total_b, (name, total)
    assert abs(effective - effective_b) < 0.04 * effective_b, (name, effective)
  # 26B-A4B: 25.2B in the text decoder, 3.8B active (8 of 128 experts)
  cfg = load_config([BASE_YML, "model_name=gemma4-26b-a4b"])
  leaves = jax.tree_util.tree_flatten_with_path(
      make_model_def(ModelConfig.from_config(cfg)).abstract_params)[0]
  total = sum(math.prod(a.shape) for p, a in leaves if "router_bias" not in str(p)) / 1e9
  experts = sum(math.prod(a.shape) for p, a in leaves if "experts" in str(p)) / 1e9
  assert abs(total - 25.2) < 0.3 and abs(total - experts * 120 / 128 - 3.8) < 0.1, total


def test_config_refusals():
  with pytest.raises(ValueError, match=r"enable_moe_block=true but \['top_k_experts'"):
    hf_map.config_from_hf({**E2B_HUB, "enable_moe_block": True, "num_experts": 8})
  with pytest.raises(ValueError, match="gemma4_text"):
    hf_map.config_from_hf({**E2B_HUB, "model_type": "gemma3_text"})
  with pytest.raises(ValueError, match="bidirectional"):
    hf_map.config_from_hf({**E2B_HUB, "use_bidirectional_attention": "all"})
  # without layer_types transformers' default applies: full every 6th layer and the last
  no_types = {k: v for k, v in E2B_HUB.items() if k != "layer_types"}
  no_types["num_hidden_layers"] = 8
  assert hf_map.config_from_hf(no_types)["attention_pattern"] == "sssssfsf"
