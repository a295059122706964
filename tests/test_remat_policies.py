"""The named remat policies (layers/stack.py: save_qkv_proj, save_dot_except_mlp, ...) keep what they
name across the layer scan and nothing more, and leave the gradient unchanged: a one-layer tiny
Qwen3 in float32 on the plain hot path (as on a TPU), the values the scan saves for the backward
read from `print_saved_residuals` (tracing only), the gradient against remat_policy=none's."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def

S, D, H, K, E = 16, 64, 4, 2, 32   # qwen3-tiny's widths
Q_, KV_, DD_ = f"[1,1,{S},{H},{E}]", f"[1,1,{S},{K},{E}]", f"[1,1,{S},{D}]"
# what the scan saves per policy beyond what every policy keeps (shapes, stacked over the 1 layer):
# q / k / v projections, the attention output projection and the MLP's down projection ([S, D])
EXTRA = {"full": [], "save_qkv_proj": [Q_, KV_, KV_], "save_dot_except_mlp": [Q_, KV_, KV_, DD_]}


@pytest.fixture(scope="module")
def tiny():
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny", "num_decoder_layers=1", "dtype=float32",
                     "attention=dot_product", "hot_path=plain"])
  mcfg = ModelConfig.from_config(cfg)
  assert (mcfg.emb_dim, mcfg.num_query_heads, mcfg.num_kv_heads, mcfg.head_dim) == (D, H, K, E)
  batch = (jnp.asarray(np.arange(S)[None] % 50 + 1, jnp.int32), jnp.arange(S)[None],
           jnp.ones((1, S), jnp.int32))
  return mcfg, init_params(mcfg, 0), batch


def _loss(mcfg, policy, batch):
  model_def = make_model_def(dataclasses.replace(mcfg, remat_policy=policy))
  return lambda p: jnp.sum(model_def.apply(p, *batch) ** 2) * 1e-3


def _scan_saves(mcfg, policy, params, batch, capsys) -> list[str]:
  print_saved_residuals(_loss(mcfg, policy, batch), params)
  lines = capsys.readouterr().out.splitlines()
  return sorted(line.split()[0][3:] for line in lines if "output of scan" in line)


@pytest.mark.parametrize("policy", [p for p in EXTRA if p != "full"])
def test_a_named_policy_saves_what_it_names(tiny, policy, capsys):
  mcfg, params, batch = tiny
  full = _scan_saves(mcfg, "full", params, batch, capsys)
  got = _scan_saves(mcfg, policy, params, batch, capsys)
  assert sorted(full + EXTRA[policy]) == got, (full, got)


def test_named_policies_leave_the_gradient_unchanged(tiny):
  mcfg, params, batch = tiny
  want = jax.jit(jax.grad(_loss(mcfg, "none", batch)))(params)
  for policy in ("save_qkv_attention", "save_dot_except_mlp_in"):
    got = jax.jit(jax.grad(_loss(mcfg, policy, batch)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), got, want)
