"""Our llama family as Hugging Face's Llama (the oracle: transformers' `LlamaForCausalLM`), through
MaxText/models/llama/hf_map.py — the architecture of the default model of configs/base.yml (no q/k
norm). Tiny random-init models (fp32, eager attention, GQA 4/2, perturbed norm weights), untied and
tied, scanned and unrolled: logits (incl. a packed row against HF per document), the exact
state-dict round trip, loss and gradients against torch autograd, and the config maps."""
import jax

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import (TOL_GRAD, batch, check_logits, check_round_trip,  # noqa: E402
                       compare_grads, hf_loss_and_grads, hf_state, our_loss_and_grads)
from test_qwen3_parity import hf_model, our_config, ours  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.models.llama import hf_map  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import hf_model_type_for, make_model_def  # noqa: E402

ARCH = "llama"


@pytest.mark.parametrize("tied,scan", [(False, True), (True, False)])
def test_logits_match_hf(tied, scan):
  mcfg, model_def, params = ours(tied, scan, ARCH)
  assert ("lm_head" in params) == (not tied)
  check_logits(model_def, params, hf_model(tied, ARCH), mcfg.vocab_size)


@pytest.mark.parametrize("tied,scan", [(False, True), (True, False)])
def test_state_dict_round_trip_is_exact(tied, scan):
  mcfg, model_def, params = ours(tied, scan, ARCH)
  check_round_trip(hf_map, mcfg, model_def, params, hf_state(hf_model(tied, ARCH)))
  assert not any("norm.weight" in k and ("q_" in k or "k_" in k) for k in hf_map.hf_names(mcfg))


def test_loss_and_grads_match_torch_autograd():
  model = hf_model(False, ARCH)
  mcfg, model_def, params = ours(False, True, ARCH)
  tokens, pos, seg = batch(mcfg.vocab_size)
  targets = np.random.default_rng(1).integers(0, mcfg.vocab_size, size=tokens.shape)
  loss_hf, grads_hf = hf_loss_and_grads(model, tokens, targets)
  _, grads_exact = hf_loss_and_grads(model, tokens, targets, float64=True)
  loss, grads = our_loss_and_grads(model_def, params, tokens, pos, seg, targets)
  assert abs(loss - loss_hf) / abs(loss_hf) <= TOL_GRAD
  compare_grads(grads, hf_map.hf_to_params(grads_hf, mcfg),
                exact_tree=hf_map.hf_to_params(grads_exact, mcfg))


def test_configs():
  # the default model of configs/base.yml is a Llama, and an export picks that type for it
  default = ModelConfig.from_config(load_config([BASE_YML]))
  assert hf_model_type_for(default) == "llama"
  assert hf_model_type_for(replace(load_config([BASE_YML]), use_qk_norm=True)) == "qwen3"
  hf = hf_map.config_to_hf(default)
  assert hf_map.config_from_hf(transformers.LlamaConfig(**hf).to_dict()) == {
      **{k: getattr(default, k) for k in hf_map.config_from_hf(hf) if k != "hf_model_type"},
      "hf_model_type": "llama"}
  # LlamaConfig's defaults for missing fields: head_dim = hidden / heads, K = H, 2048 positions
  minimal = {"model_type": "llama", "vocab_size": 100, "hidden_size": 96, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4}
  keys = hf_map.config_from_hf(minimal)
  assert (keys["head_dim"], keys["num_kv_heads"], keys["max_position_embeddings"]) == (24, 4, 2048)
  for bad, says in (({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type"),
                    ({"attention_bias": True}, "bias"), ({"mlp_bias": True}, "bias"),
                    ({"pretraining_tp": 2}, "pretraining_tp"), ({"hidden_act": "gelu"}, "silu")):
    with pytest.raises(ValueError, match=says):
      hf_map.config_from_hf({**minimal, **bad})
  for change, says in ((dict(use_qk_norm=True), "neither"), (dict(num_query_heads=5, num_kv_heads=5),
                                                              "multiple of num_query_heads"),
                       (dict(mlp_activation="gelu_tanh"), "silu")):
    with pytest.raises(ValueError, match=says):
      hf_map.config_to_hf(replace(load_config([BASE_YML]), **change))


def test_the_default_model_exports_as_llama_and_imports_back(tmp_path):
  """A checkpoint of the default model (hf_model_type "" in configs/base.yml) exports as a
  `llama` folder transformers loads with the same logits, and converts back to the same params."""
  from MaxText.checkpoint.manager import load_params_host, save_params_only
  from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
  cfg = replace(our_config(False, True, ARCH), hf_model_type="")
  mcfg = ModelConfig.from_config(cfg)
  model_def = make_model_def(mcfg)
  params = ours(False, True, ARCH)[2]
  save_params_only(str(tmp_path / "ckpt"), params, cfg.as_dict())
  assert to_huggingface.main([f"load_parameters_path={tmp_path / 'ckpt'}",
                              f"output_path={tmp_path / 'hf'}"]) == 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert type(hf).__name__ == "LlamaForCausalLM"
  tokens = batch(mcfg.vocab_size)[0]
  with torch.no_grad():
    theirs = hf(torch.tensor(tokens)).logits.numpy()
  S = tokens.shape[1]
  mine = np.asarray(model_def.apply(params, tokens, np.broadcast_to(np.arange(S), tokens.shape),
                                    np.ones_like(tokens)))
  assert np.abs(mine - theirs).max() <= 1e-4 * np.abs(theirs).max()
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'back'}"]) == 0
  back = load_params_host(str(tmp_path / "back"), model_def.abstract_params)
  for a, b in zip(*(jax.tree.leaves(t) for t in (back, params))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
