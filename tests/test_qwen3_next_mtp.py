"""Qwen3-Next's MTP block on a released checkpoint's layout (`mtp.*`): our forward of depth 1
(MaxText/layers/mtp.py: [pre_fc_norm_embedding(emb(x_{t+1})) | pre_fc_norm_hidden(h_t)] → fc →
the MTP decoder layer → mtp.norm → the shared head) equals the same computation assembled from
transformers' own Qwen3-Next modules (Qwen3NextRMSNorm, Qwen3NextDecoderLayer with the mtp.layers.0
weights, the model's rotary embedding, embedding and head), the order vLLM's Qwen3-Next MTP runs —
transformers' Qwen3NextForCausalLM itself ignores mtp.* when loading. The layout's bitwise round
trip is tests/test_qwen3_next_parity.py: test_hf_state_round_trips_bitwise_with_mtp."""
from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_parity import hf_state  # noqa: E402
from test_qwen3_next_parity import hf_model, mtp_tensors, our_config  # noqa: E402
from MaxText.config.load import replace  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.qwen3_next import hf_map  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402

S = 12


def torch_mtp(model, mtp: dict, tokens: np.ndarray):
  """(depth 1's final-norm hidden [1, S-1, D], its logits) from transformers' modules."""
  from transformers.models.qwen3_next import modeling_qwen3_next as m
  config = copy.deepcopy(model.config)
  config._attn_implementation = "sdpa"   # a causal mask when none is given
  full = config.layer_types.index("full_attention")
  layer = m.Qwen3NextDecoderLayer(config, full).eval()
  layer.load_state_dict({k[len("mtp.layers.0."):]: torch.tensor(v) for k, v in mtp.items()
                         if k.startswith("mtp.layers.0.")})
  D, eps = config.hidden_size, config.rms_norm_eps
  norms = {}
  for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    norms[name] = m.Qwen3NextRMSNorm(D, eps=eps)
    norms[name].weight.data = torch.tensor(mtp[f"mtp.{name}.weight"])
  fc = torch.nn.Linear(2 * D, D, bias=False)
  fc.weight.data = torch.tensor(mtp["mtp.fc.weight"])
  ids = torch.tensor(tokens)
  with torch.no_grad():
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]   # positions 0..S-2
    e = model.model.embed_tokens(ids[:, 1:])                                     # tokens 1..S-1
    u = fc(torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)], -1))
    position_ids = torch.arange(S - 1)[None]
    u = layer(u, position_embeddings=model.model.rotary_emb(u, position_ids),
              position_ids=position_ids)
    out = norms["norm"](u)
    return out.numpy(), model.lm_head(out).numpy()


def test_mtp_depth_one_matches_transformers_modules():
  model = hf_model("dense")
  mtp = mtp_tensors("dense")
  rng = np.random.RandomState(0)
  for k in mtp:   # norms away from their zero init, so a swapped norm would show
    if "norm" in k:
      mtp[k] = (0.3 * rng.randn(*mtp[k].shape)).astype(np.float32)
  from_hf = {**hf_map.config_from_hf(model.config.to_dict()), "mtp_num_layers": 1}
  mcfg = ModelConfig.from_config(replace(our_config("dense"), **from_hf, mtp_loss_scale=0.1))
  model_def = make_model_def(mcfg)
  params = hf_map.hf_to_params({**hf_state(model), **mtp}, mcfg)
  tokens = rng.randint(0, mcfg.vocab_size, (1, S))
  want_h, want_logits = torch_mtp(model, mtp, tokens)

  @jax.jit   # one program (run eagerly, each op of the model compiles alone)
  def mtp_depth_one(params, tokens):
    _, aux = model_def.apply_with_aux(params, tokens, np.arange(S)[None],
                                      np.ones((1, S), np.int32), mtp=True)
    return aux["mtp_hidden"][0], model_def.head(params, aux["mtp_hidden"][0])

  got_h, got_logits = (np.asarray(x)[:, :-1]   # the last position has no token ahead
                       for x in mtp_depth_one(params, tokens.astype(np.int32)))
  np.testing.assert_allclose(got_h, want_h, atol=2e-5 * np.abs(want_h).max())
  np.testing.assert_allclose(got_logits, want_logits, atol=2e-5 * np.abs(want_logits).max())
