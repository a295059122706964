"""Our qwen3_next family against Hugging Face transformers' Qwen3-Next (the oracle), through the
name map of MaxText/models/qwen3_next/hf_map.py. Tiny random-init `Qwen3NextForCausalLM`s (fp32, eager
attention) from configs/models/qwen3-next-tiny.yml:
  moe    [3 Gated DeltaNet + 1 gated attention], every MLP 8 routed experts (top-2, renormalised)
         plus a shared expert behind its sigmoid gate;
  mixed  linear / full alternating, MoE only on layer 1 (decoder_sparse_step=2 and
         mlp_only_layers=[3] make layers 0, 2, 3 dense), top-k weights not renormalised, tied head;
  dense  the moe model's mixers with dense MLPs and every matrix but the embeddings halved: the
         bf16 check. In bf16 a random MoE's routing flips on near ties (transformers' own bf16 run
         is KL 0.57 from its fp32 run on the moe model), so MoE numerics are checked in fp32; the
         dense model is one where transformers' bf16 stays within KL 0.02 of its fp32.
Norm weights and dt_bias are perturbed away from their constant init, and the residual branches'
output projections scaled by 0.3: with the parity builder's 0.2 init the random model's Jacobian
amplifies fp32 rounding (transformers in fp32 is then 2.7e-5 x max|logit| from itself in fp64 on
this batch), and the scaling keeps the check 1e-4 x max|logit| well clear of that.
Checks logits (a packed row against HF run per document), bf16 KL, the load-balancing loss, loss
and every gradient against torch autograd, HF → ours → HF bitwise (both expert layouts, MTP
tensors included), the converters and the published 80B config."""
import functools
import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import (S, TOL_GRAD, batch, build_hf_model, check_logits,  # noqa: E402
                       compare_grads, hf_logits, hf_loss_and_grads, hf_state,
                       kl, our_logits, our_loss_and_grads)
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.qwen3_next import hf_map  # noqa: E402
from MaxText.models.registry import get_family, make_model_def  # noqa: E402

VARIANTS = {
    "moe": (),
    "mixed": ("attention_pattern=lf", "decoder_sparse_step=2", "mlp_only_layers=[3]",
              "norm_topk_prob=false", "tie_word_embeddings=true"),
    "dense": ("num_experts=0", "moe_mlp_dim=0", "shared_expert_mlp_dim=0"),
}
MATRIX_SCALE = {"dense": 0.5}
KINDS = {"moe": ("linear/moe",) * 3 + ("full/moe",),
         "mixed": ("linear/dense", "full/moe", "linear/dense", "full/dense"),
         "dense": ("linear/dense",) * 3 + ("full/dense",)}
RESIDUAL_OUTPUTS = ("down_proj.weight", "experts.down_proj", "o_proj.weight", "out_proj.weight")


def our_config(variant: str = "moe", scan: bool = True, *extra: str):
  return load_config([BASE_YML, "model_name=qwen3-next-tiny", f"scan_layers={str(scan).lower()}",
                      *VARIANTS[variant], *extra])


@functools.lru_cache(maxsize=None)
def hf_model(variant: str = "moe", dtype: str = "float32"):
  model = build_hf_model(transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                         hf_map.config_to_hf(our_config(variant)),
                         perturb=("norm.weight", "dt_bias"))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(RESIDUAL_OUTPUTS):
        p.mul_(0.3)
      if p.ndim >= 2 and not name.startswith(("model.embed_tokens", "lm_head")):
        p.mul_(MATRIX_SCALE.get(variant, 1.0))
  return model if dtype == "float32" else model.to(getattr(torch, dtype))


@functools.lru_cache(maxsize=None)
def ours(variant: str = "moe", scan: bool = True, *extra: str):
  """(ModelConfig from the HF config, model def, params converted from the HF state dict)."""
  model = hf_model(variant)
  cfg = replace(our_config(variant, scan, *extra), **hf_map.config_from_hf(model.config.to_dict()))
  assert cfg == our_config(variant, scan, *extra)   # config_to_hf → HF config → config_from_hf
  mcfg = ModelConfig.from_config(cfg)
  assert tuple(map(str, get_family("qwen3_next").layer_kinds(mcfg))) == KINDS[variant]
  return mcfg, make_model_def(mcfg), hf_map.hf_to_params(hf_state(model), mcfg)


# ---- numerics -----------------------------------------------------------------------------------
# moe scanned last: the next test's chunked forward is its jitted program (hf_parity._forward)
@pytest.mark.parametrize("variant,scan", [("moe", False), ("mixed", True), ("moe", True)])
def test_logits_match_hf(variant, scan):
  mcfg, model_def, params = ours(variant, scan)
  assert not np.any(params["router_bias"])
  check_logits(model_def, params, hf_model(variant), mcfg.vocab_size)


def test_token_by_token_recurrence_gives_the_same_logits():
  """linear_recurrence=token (the reference scan) against the chunked form, which
  test_logits_match_hf checks against HF on the same batch."""
  mcfg, model_def, params = ours("moe", True)
  _, token_def, _ = ours("moe", True, "linear_recurrence=token")
  tokens, pos, seg = batch(mcfg.vocab_size)
  chunked = our_logits(model_def, params, tokens, pos, seg)
  token = our_logits(token_def, params, tokens, pos, seg)
  assert np.abs(chunked - token).max() <= 1e-4 * np.abs(token).max()


def test_flash_attention_on_the_full_layers():
  """attention=flash (our Pallas kernel; the interpreter on CPU) in the gated-attention layers."""
  mcfg, model_def, params = ours("moe", True, "attention=flash")
  assert mcfg.attention == "flash"
  check_logits(model_def, params, hf_model("moe"), mcfg.vocab_size)


def test_bf16_logits_within_kl():
  """transformers in bf16 against our bf16 compute with bf16 weights: KL ≤ 0.015; and ours in bf16
  is at least as close to the fp32 model as transformers' bf16 run."""
  mcfg, _, params = ours("dense")
  cfg = replace(our_config("dense"), dtype="bfloat16", weight_dtype="bfloat16")
  model_def = make_model_def(ModelConfig.from_config(cfg))
  params = jax.tree.map(lambda a, s: np.asarray(a).astype(s.dtype), params,
                        model_def.abstract_params)
  tokens, pos, seg = batch(mcfg.vocab_size)
  got = our_logits(model_def, params, tokens, pos, seg)
  hf16 = hf_logits(hf_model("dense", "bfloat16"), tokens)
  hf32 = hf_logits(hf_model("dense"), tokens)
  div, ours_err, hf_err = kl(hf16, got).max(), kl(hf32, got).max(), kl(hf32, hf16).max()
  print(f"bf16 max KL vs transformers bf16 {div:.2e}; vs fp32: ours {ours_err:.2e}, "
        f"transformers {hf_err:.2e}")
  assert div <= 0.015 and ours_err <= hf_err


def test_aux_loss_matches_hf():
  mcfg, model_def, params = ours("moe")
  tokens = batch(mcfg.vocab_size)[0][:1]
  with torch.no_grad():
    out = hf_model("moe")(input_ids=torch.tensor(tokens), use_cache=False,
                          output_router_logits=True)
  from MaxText.layers.moe import aux_loss

  def forward_aux(p):   # one jitted program, not op by op
    st = model_def.apply_with_aux(p, tokens.astype(np.int32), np.arange(S, dtype=np.int32)[None],
                                  np.ones((1, S), np.int32))[1]["moe_stats"]
    return aux_loss(st["counts"], st["probs"], st["tokens"])
  ours_aux = float(jax.jit(forward_aux)(params))
  print(f"aux loss ours={ours_aux:.6f} hf={out.aux_loss.item():.6f}")
  assert abs(ours_aux - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()


@pytest.mark.parametrize("variant", ["moe", "mixed"])
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


# ---- the name map -------------------------------------------------------------------------------
def mtp_tensors(variant: str, seed: int = 3) -> dict[str, np.ndarray]:
  """Random `mtp.*` tensors with a released checkpoint's names for this model (one MTP layer: a
  full-attention layer with the MLP of a decoder layer 0), one of them holding signed zeros."""
  with_mtp = ModelConfig.from_config(replace(our_config(variant), mtp_num_layers=1))
  rng = np.random.default_rng(seed)   # host values of the parameters' shapes: no init to compile
  params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype),
                        make_model_def(with_mtp).abstract_params)
  if "router_bias" in params:                # MoE variants; HF has none: zero, as the init
    params["router_bias"] = np.zeros_like(params["router_bias"])
  exported = hf_map.params_to_hf(params, with_mtp)
  out = {k: np.asarray(exported[k]) for k in exported if k.startswith("mtp.")}
  out["mtp.norm.weight"] = np.where(np.arange(with_mtp.emb_dim) % 2, -0.0, out["mtp.norm.weight"]
                                    ).astype(np.float32)
  return out


@pytest.mark.parametrize("scan", [True, False])
def test_hf_state_round_trips_bitwise_with_mtp(scan, tmp_path):
  """transformers' fused state dict and the hub's per-expert files, each with a released
  checkpoint's mtp.* tensors: HF → ours → HF gives every tensor back bit for bit."""
  mcfg, model_def, params = ours("moe", scan)
  sd = hf_state(hf_model("moe"))
  shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), t)
  assert shapes(params) == shapes(model_def.abstract_params)
  fused = hf_map.params_to_hf(params, mcfg, fused=True)
  assert fused.keys() == sd.keys()
  assert all(fused[k].dtype == sd[k].dtype and fused[k].tobytes() == sd[k].tobytes() for k in sd)
  assert sorted(hf_map.hf_names(mcfg)) == sorted(hf_map.params_to_hf(params, mcfg))
  mtp = mtp_tensors("moe")
  assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in mtp and "mtp.fc.weight" in mtp
  hub = {**dict(hf_map.params_to_hf(params, mcfg)), **mtp}
  assert hf_map.config_from_tensor_names(hub) == {"mtp_num_layers": 1}
  with_mtp = ModelConfig.from_config(replace(our_config("moe", scan), mtp_num_layers=1))
  ours_mtp = hf_map.hf_to_params(hub, with_mtp)
  back = hf_map.params_to_hf(ours_mtp, with_mtp)
  assert sorted(back) == sorted(hub)
  for k in hub:
    assert back[k].dtype == hub[k].dtype and back[k].tobytes() == hub[k].tobytes(), k
  # without room for them, MTP tensors are an error, never dropped
  with pytest.raises(ValueError, match="no place in our model.*mtp.fc.weight"):
    hf_map.hf_to_params(hub, mcfg)
  # what save_pretrained writes is the per-expert form, name for name
  hf_model("moe").save_pretrained(tmp_path / "hub")
  from MaxText.checkpoint_conversion.hf_io import HFTensors
  assert sorted(HFTensors(str(tmp_path / "hub"))) == sorted(hf_map.params_to_hf(params, mcfg))


def test_conv_channels_regroup_per_key_head():
  """HF's conv1d rows (all q | all k | all v) land in our per-key-head layout [W, Hk, q|k|v]."""
  mcfg, _, params = ours("moe", False)
  hf_w = hf_state(hf_model("moe"))["model.layers.0.linear_attn.conv1d.weight"][:, 0]   # [C, W]
  ours_w = np.asarray(params["decoder"]["layers"][0]["linear_attn"]["conv"])          # [W, Hk, X]
  Hk, Dk, Dv = mcfg.linear_num_key_heads, mcfg.linear_key_head_dim, mcfg.linear_value_head_dim
  G = mcfg.linear_num_value_heads // Hk
  np.testing.assert_array_equal(ours_w[:, 1, :Dk], hf_w[Dk:2 * Dk].T)                 # q, head 1
  np.testing.assert_array_equal(ours_w[:, 1, Dk:2 * Dk], hf_w[Hk * Dk + Dk:Hk * Dk + 2 * Dk].T)
  v0 = 2 * Hk * Dk + G * Dv                                                            # v, head 1
  np.testing.assert_array_equal(ours_w[:, 1, 2 * Dk:], hf_w[v0:v0 + G * Dv].T)


def test_converters_round_trip_with_mtp(tmp_path):
  """to_maxtext counts the MTP layers from the folder's tensors and keeps them; to_huggingface
  writes every tensor back bit for bit, and transformers reloads the export (ignoring mtp.*) with
  the same logits."""
  from safetensors.numpy import load_file, save_file
  from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
  model = hf_model("mixed")
  model.save_pretrained(tmp_path / "hf")
  mcfg = ours("mixed")[0]
  tensors = {**load_file(tmp_path / "hf" / "model.safetensors"), **mtp_tensors("mixed")}
  assert "mtp.layers.0.mlp.up_proj.weight" in tensors        # the mixed model's layer 0 is dense
  save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  assert to_huggingface.main([f"load_parameters_path={tmp_path / 'ckpt'}",
                              f"output_path={tmp_path / 'out'}"]) == 0
  back = load_file(tmp_path / "out" / "model.safetensors")
  assert sorted(back) == sorted(tensors)
  assert all(back[k].tobytes() == tensors[k].tobytes() for k in tensors)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager").eval()
  assert reloaded.config.num_nextn_predict_layers == 1 and reloaded.config.mlp_only_layers == [3]
  tokens = torch.tensor(batch(mcfg.vocab_size)[0])
  with torch.no_grad():
    np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy())


# ---- configs ------------------------------------------------------------------------------------
def test_published_config_and_counts():
  """qwen3-next-80b-a3b: the model card's 80B in total (79B without the embedding and head) and
  3B active per token (10 of 512 experts; the shared expert, attention and DeltaNet layers)."""
  cfg = load_config([BASE_YML, "model_name=qwen3-next-80b-a3b"])
  assert hf_map.config_from_hf(hf_map.config_to_hf(cfg)) == {
      k: getattr(cfg, k) for k in hf_map.config_from_hf(hf_map.config_to_hf(cfg))}
  mcfg = ModelConfig.from_config(cfg)
  assert get_family("qwen3_next").problems(mcfg) == []
  counts = {"/".join(str(k.key) for k in p): math.prod(a.shape) for p, a in
            jax.tree_util.tree_flatten_with_path(make_model_def(mcfg).abstract_params)[0]}
  experts = sum(v for k, v in counts.items() if "/experts/" in k)
  total = sum(v for k, v in counts.items() if k != "router_bias")
  embeddings = counts["embedding"] + counts["lm_head/kernel"]
  active_non_embedding = (total - embeddings - experts * (1 - 10 / 512))
  print(f"total {total / 1e9:.2f}B, non-embedding {(total - embeddings) / 1e9:.2f}B, active "
        f"(non-embedding) {active_non_embedding / 1e9:.2f}B")
  assert abs(total / 1e9 - 80) < 0.01 * 80
  assert abs((total - embeddings) / 1e9 - 79) < 0.01 * 79
  assert abs(active_non_embedding / 1e9 - 3) < 0.1 * 3
  # the FLOPs count sees the same active weights (plus the LM head); its token mixing is 12
  # causal attention layers (quadratic in S) and 36 chunked gated delta rules (linear in S: per
  # token and value head C·(3·Dk + 2·Dv) + 6·Dk·Dv = 139,264 FLOPs at C = 64, Dk = Dv = 128)
  flops = get_family("qwen3_next").flops(mcfg, 4096, True)
  assert abs(flops.matmul_params - (active_non_embedding + counts["lm_head/kernel"])) < 1e-3 * total
  mixing = lambda S: get_family("qwen3_next").flops(mcfg, S, True).attention_per_sequence
  attention = lambda S: 12 * 4 * (S * S / 2) * 16 * 256
  assert mixing(4096) - attention(4096) == 36 * 4096 * 32 * 139_264
  assert mixing(8192) - attention(8192) == 2 * (mixing(4096) - attention(4096))
