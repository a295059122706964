"""Our llama family with routed experts against Hugging Face transformers' Qwen3-MoE (the oracle),
through MaxText/models/qwen3_moe/hf_map.py: a tiny random-init `Qwen3MoeForCausalLM` (fp32, eager,
8 experts of width 32, top-2, renormalised), scanned and unrolled. Checks logits (incl. a packed row
against HF per document), the load-balancing loss against HF's, loss and gradients against torch
autograd, both HF layouts (transformers' fused state dict, the hub's per-expert files) in both
directions, an export that transformers loads, and the published configs' sizes."""
import functools
import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import (S, TOL_GRAD, batch, build_hf_model, check_logits,  # noqa: E402
                       compare_grads, hf_loss_and_grads, hf_state, our_loss_and_grads)
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.qwen3_moe import hf_map  # noqa: E402
from MaxText.train.state import make_model_def  # noqa: E402


def our_config(scan: bool = True):
  return load_config([BASE_YML, "model_name=qwen3-moe-tiny", "rope_theta=1000",
                      f"scan_layers={str(scan).lower()}"])


@functools.lru_cache(maxsize=None)
def hf_model():
  return build_hf_model(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                        hf_map.config_to_hf(our_config()))


@functools.lru_cache(maxsize=None)
def ours(scan: bool):
  model = hf_model()
  cfg = replace(our_config(scan), **hf_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(scan)
  mcfg = ModelConfig.from_config(cfg)
  return mcfg, make_model_def(mcfg), hf_map.hf_to_params(hf_state(model), mcfg)


@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_hf(scan):
  mcfg, model_def, params = ours(scan)
  assert not np.any(params["router_bias"])
  check_logits(model_def, params, hf_model(), mcfg.vocab_size)


def test_aux_loss_matches_hf():
  mcfg, model_def, params = ours(True)
  tokens = batch(mcfg.vocab_size)[0][:1]
  with torch.no_grad():
    out = hf_model()(input_ids=torch.tensor(tokens), use_cache=False, output_router_logits=True)
  from MaxText.layers.moe import aux_loss
  _, sown = model_def.apply_with_aux(params, tokens.astype(np.int32), np.arange(S)[None],
                                     np.ones((1, S), np.int32))
  st = sown["moe_stats"]
  assert float(st["counts"].sum()) == mcfg.num_decoder_layers * S * mcfg.num_experts_per_tok
  ours_aux = float(aux_loss(st["counts"], st["probs"], st["tokens"]))
  print(f"aux loss ours={ours_aux:.6f} hf={out.aux_loss.item():.6f}")
  assert abs(ours_aux - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()


def test_loss_and_grads_match_torch_autograd():
  model = hf_model()
  mcfg, model_def, params = ours(True)
  tokens, pos, seg = batch(mcfg.vocab_size)
  targets = np.random.default_rng(1).integers(0, mcfg.vocab_size, size=tokens.shape)
  loss_hf, grads_hf = hf_loss_and_grads(model, tokens, targets)
  loss, grads = our_loss_and_grads(model_def, params, tokens, pos, seg, targets)
  assert abs(loss - loss_hf) / abs(loss_hf) <= TOL_GRAD
  compare_grads(grads, hf_map.hf_to_params(grads_hf, mcfg), frozen=("router_bias",))


@pytest.mark.parametrize("scan", [True, False])
def test_both_hf_layouts_round_trip_exactly(scan, tmp_path):
  sd = hf_state(hf_model())                                # transformers' fused in-memory form
  mcfg, _, params = ours(scan)
  fused = hf_map.params_to_hf(params, mcfg, fused=True)
  assert fused.keys() == sd.keys()
  for k in sd:
    assert np.array_equal(fused[k], sd[k]), k
  hub = dict(hf_map.params_to_hf(params, mcfg))             # the per-expert files
  assert "model.layers.1.mlp.experts.7.up_proj.weight" in hub and not any("gate_up" in k for k in hub)
  F = mcfg.moe_mlp_dim
  np.testing.assert_array_equal(hub["model.layers.1.mlp.experts.7.up_proj.weight"],
                                sd["model.layers.1.mlp.experts.gate_up_proj"][7, F:])
  back = hf_map.hf_to_params(hub, mcfg)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  # what save_pretrained writes is the per-expert form, name for name
  hf_model().save_pretrained(tmp_path / "hub")
  from MaxText.checkpoint_conversion.hf_io import HFTensors
  assert sorted(HFTensors(str(tmp_path / "hub"))) == sorted(hub)
  # a non-zero selection bias cannot be exported
  biased = {**params, "router_bias": np.ones_like(params["router_bias"])}
  with pytest.raises(ValueError, match="router_bias is not zero"):
    hf_map.params_to_hf(biased, mcfg)


def test_published_configs():
  for name, (total_b, active_b) in {"30b-a3b": (30.5, 3.3), "235b-a22b": (235.1, 22.2)}.items():
    cfg = load_config([BASE_YML, f"model_name=qwen3-{name}"])
    mcfg = ModelConfig.from_config(cfg)
    assert hf_map.config_from_hf(hf_map.config_to_hf(cfg)) == {
        k: getattr(cfg, k) for k in hf_map.config_from_hf(hf_map.config_to_hf(cfg))}
    counts = {"/".join(str(k.key) for k in p): math.prod(a.shape) for p, a in
              jax.tree_util.tree_flatten_with_path(make_model_def(mcfg).abstract_params)[0]}
    experts = sum(v for k, v in counts.items() if "/experts/" in k)
    total = (sum(counts.values()) - counts["router_bias"]) / 1e9
    active = total - experts / 1e9 * (1 - mcfg.num_experts_per_tok / mcfg.num_experts)
    assert abs(total - total_b) < 0.02 * total_b, (name, total)
    assert abs(active - active_b) < 0.03 * active_b, (name, active)
  with pytest.raises(ValueError, match="all-sparse"):
    hf_map.config_from_hf({**hf_map.config_to_hf(our_config()), "mlp_only_layers": [0]})


def test_balancing_weight_travels_both_ways_and_into_a_fine_tune(tmp_path):
  """HF's router_aux_loss_coef is our moe_aux_loss_weight (Qwen3MoeConfig's 0.001 when absent),
  written back on export; a fine-tune from a converted checkpoint takes it unless it is set."""
  import json
  import os
  from MaxText.config.from_checkpoint import adopt_checkpoint_architecture
  hub = hf_map.config_to_hf(our_config())
  assert hub["router_aux_loss_coef"] == 0.01 == our_config().moe_aux_loss_weight   # the tiny's
  assert transformers.Qwen3MoeConfig(**hub).router_aux_loss_coef == 0.01
  assert hf_map.config_from_hf({**hub, "router_aux_loss_coef": 0.02})["moe_aux_loss_weight"] == 0.02
  del hub["router_aux_loss_coef"]
  assert hf_map.config_from_hf(hub)["moe_aux_loss_weight"] == 0.001
  assert hf_map.config_to_hf(replace(our_config(), moe_aux_loss_weight=0.02))[
      "router_aux_loss_coef"] == 0.02
  # a checkpoint converted with 0.02 (only its config is read here)
  os.makedirs(tmp_path / "0" / "params")
  os.makedirs(tmp_path / "0" / "meta")
  saved = replace(our_config(), moe_aux_loss_weight=0.02).as_dict()
  (tmp_path / "0" / "meta" / "metadata").write_text(json.dumps({"step": 0, "config": saved}))
  argv = [BASE_YML, f"load_parameters_path={tmp_path}"]
  assert adopt_checkpoint_architecture(load_config(argv), argv).moe_aux_loss_weight == 0.02
  argv.append("moe_aux_loss_weight=0.05")                 # the user's value wins, no error
  assert adopt_checkpoint_architecture(load_config(argv), argv).moe_aux_loss_weight == 0.05
