"""Our llama family with routed experts against Hugging Face transformers' Qwen3-MoE (the oracle),
through MaxText/models/llama/qwen3_moe_hf_map.py: tiny random-init `Qwen3MoeForCausalLM`s (fp32, eager,
8 experts of width 32, top-2), scanned and unrolled — all layers sparse and renormalised, a dense
first layer (`mlp_only_layers`) with unnormalised top-k weights, and every other layer dense
(`decoder_sparse_step=2`). Checks logits (incl. a packed row against HF per document), the
load-balancing loss against HF's, loss and every gradient against torch autograd, both HF layouts
(transformers' fused state dict, the hub's per-expert files) in both directions, HF → ours → HF
through the converters, and the published configs' sizes."""
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
from MaxText.models.llama import qwen3_moe_hf_map as hf_map  # noqa: E402
from MaxText.models.registry import get_family, make_model_def  # noqa: E402


VARIANTS = {
    "sparse": (),
    # layer 0 dense (its MLP of width mlp_dim), layers 1-2 MoE; top-k weights not renormalised
    "dense_first": ("num_decoder_layers=3", "mlp_only_layers=[0]", "norm_topk_prob=false"),
    # layers 1 and 3 MoE ((i + 1) % 2 == 0), 0 and 2 dense
    "sparse_step": ("num_decoder_layers=4", "decoder_sparse_step=2", "norm_topk_prob=false"),
}
KINDS = {"sparse": ("moe", "moe"), "dense_first": ("dense", "moe", "moe"),
         "sparse_step": ("dense", "moe", "dense", "moe")}


def our_config(variant: str = "sparse", scan: bool = True):
  return load_config([BASE_YML, "model_name=qwen3-moe-tiny", "rope_theta=1000",
                      f"scan_layers={str(scan).lower()}", *VARIANTS[variant]])


@functools.lru_cache(maxsize=None)
def hf_model(variant: str = "sparse"):
  return build_hf_model(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                        hf_map.config_to_hf(our_config(variant)))


@functools.lru_cache(maxsize=None)
def ours(variant: str = "sparse", scan: bool = True):
  model = hf_model(variant)
  cfg = replace(our_config(variant, scan), **hf_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(variant, scan)
  mcfg = ModelConfig.from_config(cfg)
  assert get_family("llama").layer_kinds(mcfg) == KINDS[variant]
  return mcfg, make_model_def(mcfg), hf_map.hf_to_params(hf_state(model), mcfg)


# Unrolled once, on dense_first: its MoE layers take the unrolled path as sparse's would, and its
# dense layer 0 with them (sparse unrolled would add no code path, only a compile).
@pytest.mark.parametrize("variant,scan", [("sparse", True), ("dense_first", True),
                                          ("dense_first", False), ("sparse_step", True)])
def test_logits_match_hf(variant, scan):
  mcfg, model_def, params = ours(variant, scan)
  assert not np.any(params["router_bias"])
  assert params["router_bias"].shape == (KINDS[variant].count("moe"), mcfg.num_experts)
  check_logits(model_def, params, hf_model(variant), mcfg.vocab_size)


# dense_first: the MoE layers' statistics (scanned, as sparse's) and the dense layer left out of
# them (the count of copies); all-MoE sparse would add no code path, only a compile.
@pytest.mark.parametrize("variant", ["dense_first"])
def test_aux_loss_matches_hf(variant):
  mcfg, model_def, params = ours(variant)
  tokens = batch(mcfg.vocab_size)[0][:1]
  with torch.no_grad():
    out = hf_model(variant)(input_ids=torch.tensor(tokens), use_cache=False,
                            output_router_logits=True)
  from MaxText.layers.moe import aux_loss

  @jax.jit
  def copies_and_aux(params, tokens, pos, seg):
    """The forward and the loss on its statistics, one program (not op by op)."""
    _, sown = model_def.apply_with_aux(params, tokens, pos, seg)
    st = sown["moe_stats"]   # over the MoE layers only, as HF's router logits
    return st["counts"].sum(), aux_loss(st["counts"], st["probs"], st["tokens"])
  copies, ours_aux = copies_and_aux(params, tokens.astype(np.int32), np.arange(S)[None],
                                    np.ones((1, S), np.int32))
  assert float(copies) == KINDS[variant].count("moe") * S * mcfg.num_experts_per_tok
  ours_aux = float(ours_aux)
  print(f"aux loss ours={ours_aux:.6f} hf={out.aux_loss.item():.6f}")
  assert abs(ours_aux - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()


@pytest.mark.parametrize("variant", ["sparse", "dense_first", "sparse_step"])
def test_loss_and_grads_match_torch_autograd(variant):
  model = hf_model(variant)
  mcfg, model_def, params = ours(variant)
  tokens, pos, seg = batch(mcfg.vocab_size)
  targets = np.random.default_rng(1).integers(0, mcfg.vocab_size, size=tokens.shape)
  loss_hf, grads_hf = hf_loss_and_grads(model, tokens, targets)
  _, grads_exact = hf_loss_and_grads(model, tokens, targets, float64=True)
  loss, grads = our_loss_and_grads(model_def, params, tokens, pos, seg, targets)
  assert abs(loss - loss_hf) / abs(loss_hf) <= TOL_GRAD
  compare_grads(grads, hf_map.hf_to_params(grads_hf, mcfg), frozen=("router_bias",),
                exact_tree=hf_map.hf_to_params(grads_exact, mcfg))


@pytest.mark.parametrize("scan", [True, False])
def test_both_hf_layouts_round_trip_exactly(scan, tmp_path):
  sd = hf_state(hf_model())                                # transformers' fused in-memory form
  mcfg, _, params = ours("sparse", scan)
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
  # our DeepSeek-style first_k_dense_layers is written as Qwen3-MoE's mlp_only_layers
  dense3 = replace(our_config(), num_decoder_layers=4, first_k_dense_layers=2, mlp_only_layers=[3])
  assert hf_map.config_to_hf(dense3)["mlp_only_layers"] == [0, 1, 3]
  with pytest.raises(ValueError, match="no shared expert"):
    hf_map.config_to_hf(replace(our_config(), shared_expert_mlp_dim=16))


def test_dense_first_layer_round_trips_through_the_converters(tmp_path):
  """HF → ours → HF with `to_maxtext` and `to_huggingface`: transformers reloads the export, and
  its logits equal the original model's within 1e-4 of their largest magnitude; the export keeps
  the dense first layer and norm_topk_prob=false."""
  from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
  model = hf_model("dense_first")
  model.save_pretrained(tmp_path / "hf")
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  assert to_huggingface.main([f"load_parameters_path={tmp_path / 'ckpt'}",
                              f"output_path={tmp_path / 'out'}"]) == 0
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  assert back.config.mlp_only_layers == [0] and back.config.norm_topk_prob is False
  assert type(back.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"
  tokens = torch.tensor(batch(model.config.vocab_size)[0])
  with torch.no_grad():
    want, got = model(tokens).logits.numpy(), back(tokens).logits.numpy()
  assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_balancing_weight_travels_both_ways_and_into_a_fine_tune(tmp_path):
  """HF's router_aux_loss_coef is our moe_aux_loss_weight (Qwen3MoeConfig's 0.001 when absent),
  written back on export; a fine-tune from a converted checkpoint takes it unless it is set."""
  import json
  import os
  from MaxText.resolve.from_checkpoint import adopt_checkpoint_architecture
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
