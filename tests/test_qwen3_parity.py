"""Our llama family against Hugging Face transformers' Qwen3 (the oracle), through the name map of
MaxText/models/llama/qwen3_hf_map.py: tiny random-init `Qwen3ForCausalLM` (fp32, eager attention, GQA 4/2,
head_dim 32, perturbed norm weights), untied and tied, scanned and unrolled layers. Checks logits
(incl. a packed row against HF run per document), the exact state-dict round trip, loss and
gradients against torch autograd, the config maps, and the published configs' parameter counts."""
import functools
import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import (TOL_GRAD, batch, build_hf_model, check_logits,  # noqa: E402
                       check_round_trip, compare_grads, hf_loss_and_grads, hf_state,
                       our_loss_and_grads)
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.llama import hf_map as llama_map  # noqa: E402
from MaxText.models.llama import qwen3_hf_map as hf_map  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402

THETA = 1000.0           # small θ so that every channel pair rotates visibly at positions < S


# architecture → (its name map, transformers' config and model classes, our tiny config of it);
# tests/test_llama_parity.py runs the Llama one (the default model's architecture: no q/k norm)
ARCHS = {
    "qwen3": (hf_map, "Qwen3Config", "Qwen3ForCausalLM", ["model_name=qwen3-tiny"]),
    "llama": (llama_map, "LlamaConfig", "LlamaForCausalLM",
              ["emb_dim=64", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2",
               "head_dim=16", "mlp_dim=128", "max_position_embeddings=512", "hf_model_type=llama"]),
}


def our_config(tied: bool, scan: bool, arch: str = "qwen3"):
  return load_config([BASE_YML, *ARCHS[arch][3], f"rope_theta={THETA}",
                      f"tie_word_embeddings={str(tied).lower()}", f"scan_layers={str(scan).lower()}"])


@functools.lru_cache(maxsize=None)
def hf_model(tied: bool, arch: str = "qwen3"):
  """A random-init HF model built from config_to_hf(our tiny config); norm weights perturbed."""
  name_map, config_class, model_class, _ = ARCHS[arch]
  return build_hf_model(getattr(transformers, config_class), getattr(transformers, model_class),
                        name_map.config_to_hf(our_config(tied, True, arch)))


@functools.lru_cache(maxsize=None)
def ours(tied: bool, scan: bool, arch: str = "qwen3"):
  """(ModelConfig from the HF config, model def, params converted from the HF state dict)."""
  model, name_map = hf_model(tied, arch), ARCHS[arch][0]
  cfg = replace(our_config(tied, scan, arch), **name_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(tied, scan, arch)  # config_to_hf → HF config → config_from_hf: lossless
  mcfg = ModelConfig.from_config(cfg)
  return mcfg, make_model_def(mcfg), name_map.hf_to_params(hf_state(model), mcfg)


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_hf(tied, scan):
  mcfg, model_def, params = ours(tied, scan)
  assert ("lm_head" in params) == (not tied)
  norms = [v for k, v in hf_state(hf_model(tied)).items() if k.endswith("norm.weight")]
  assert all(np.abs(n - 1.0).max() > 0.1 for n in norms)   # scales are not all ones
  check_logits(model_def, params, hf_model(tied), mcfg.vocab_size)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scan", [True, False])
def test_state_dict_round_trip_is_exact(tied, scan):
  sd = hf_state(hf_model(tied))
  mcfg, model_def, params = ours(tied, scan)
  check_round_trip(hf_map, mcfg, model_def, params, sd)
  saved = hf_map.params_to_hf(params, mcfg)               # the save_pretrained form
  assert ("lm_head.weight" in saved) == (not tied)
  if scan:  # stacked [L, ...] kernels hold layer i at index i
    q = params["decoder"]["runs"][0][0]["attn"]["query"]["kernel"]
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
  tokens, pos, seg = batch(mcfg.vocab_size)
  targets = np.random.default_rng(1).integers(0, mcfg.vocab_size, size=tokens.shape)
  loss_hf, grads_hf = hf_loss_and_grads(model, tokens, targets)
  _, grads_exact = hf_loss_and_grads(model, tokens, targets, float64=True)
  loss, grads = our_loss_and_grads(model_def, params, tokens, pos, seg, targets)
  rel = abs(loss - loss_hf) / abs(loss_hf)
  print(f"loss ours={loss:.6f} hf={loss_hf:.6f} rel={rel:.1e}")
  assert rel <= TOL_GRAD
  compare_grads(grads, hf_map.hf_to_params(grads_hf, mcfg),  # the name map carries the grads
                exact_tree=hf_map.hf_to_params(grads_exact, mcfg))


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
