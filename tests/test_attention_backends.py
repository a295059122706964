"""The other attention backends behind the `attention` key: JAX's splash kernel (what `flash` runs
on TPU; here in Pallas interpret mode on CPU) and `cudnn` (jax.nn.dot_product_attention; its
argument mapping checked with implementation='xla' on CPU), the platform dispatch, and the
config-time refusals."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from conftest import BASE_YML, MESH_222, train
from test_flash_attention import _compare, _inputs, _ref_attention
from MaxText.config.load import ConfigError, load_config
from MaxText.kernels.splash import fit_block, splash_attention
from MaxText.layers import attention_ops
from MaxText.layers.attention_ops import (attention_problems, cudnn, dot_product_attention,
                                          select_attention)
from MaxText.layers.stack import REMAT_POLICIES
from MaxText.resolve.config_checks import validate

# JAX's kernel (fp32) vs the materialised references, within the tolerance test_flash_attention
# derives from each result's magnitude and reduction length.


def _two_docs(B, S, split):
  return jnp.broadcast_to(jnp.where(jnp.arange(S) < split, 1, 2), (B, S)).astype(jnp.int32)


# ----------------------------------------------------------------------------- splash
@pytest.mark.parametrize("case", ["causal_gqa_segments", "causal_gqa_segments_fused_bwd",
                                  "window_mqa_ragged", "full_mha"])
def test_splash_matches_dot_product_attention(case):
  """Output and dq/dk/dv vs the XLA op: causal GQA with packed documents (blocks 128 of S 256),
  with the separate and the fused backward kernels (`flash_fused_bwd`); a sliding window with
  MQA, a ragged S (200: padded to 256) and a head dim (48) padded to 128; non-causal MHA with one
  256 block."""
  B, S, H, K, E, kw = {
      "causal_gqa_segments": (2, 256, 4, 2, 32, dict(block_q=128, block_kv=128)),
      "causal_gqa_segments_fused_bwd": (2, 256, 4, 2, 32, dict(block_q=128, block_kv=128,
                                                                fused_bwd=True)),
      "window_mqa_ragged": (1, 200, 2, 1, 48, dict(sliding_window=40, block_q=32, block_kv=128)),
      "full_mha": (1, 256, 2, 2, 32, dict(causal=False)),
  }[case]
  q, k, v, do = _inputs(B, S, S, H, K, E, seed=5)
  seg = _two_docs(B, S, 90) if case != "full_mha" else jnp.ones((B, S), jnp.int32)
  scale = E ** -0.5
  ref_kw = {n: kw[n] for n in ("causal", "sliding_window") if n in kw}
  _compare(lambda q, k, v: splash_attention(q, k, v, seg, scale=scale, **kw),
           lambda q, k, v: dot_product_attention(q, k, v, seg, scale=scale, **ref_kw),
           q, k, v, do, segment_ids=seg, scale=scale, **ref_kw)


def test_splash_cross_attention_ragged_lengths():
  """Non-causal S=100 queries over T=72 keys, no segment ids: padded keys are masked by ids the
  wrapper makes itself."""
  B, S, T, H, K, E = 1, 100, 72, 2, 1, 32
  q, k, v, do = _inputs(B, S, T, H, K, E, seed=9)
  _compare(lambda q, k, v: splash_attention(q, k, v, None, scale=E ** -0.5, causal=False),
           lambda q, k, v: _ref_attention(q, k, v, None, scale=E ** -0.5, causal=False),
           q, k, v, do, segment_ids=None, scale=E ** -0.5, causal=False)


def test_splash_unit_scale():
  """Gemma-style scale 1.0 (q pre-scaled so logits stay ~1), no segment ids."""
  B, S, H, K, E = 1, 128, 2, 1, 64
  q, k, v, do = _inputs(B, S, S, H, K, E, seed=6)
  q = q * E ** -0.5
  _compare(lambda q, k, v: splash_attention(q, k, v, None, scale=1.0),
           lambda q, k, v: _ref_attention(q, k, v, None, scale=1.0), q, k, v, do,
           segment_ids=None, scale=1.0)


def test_splash_kernel_cache_is_safe_across_traces():
  """The cached kernel (mask info) built inside one jit is reused by another without leaking."""
  q, k, v, _ = _inputs(1, 128, 128, 2, 2, 32, seed=8)
  f = lambda q, k, v: splash_attention(q, k, v, None, scale=0.2, block_q=128, block_kv=128)
  a = jax.jit(f)(q, k, v)
  b = jax.jit(lambda q, k, v: f(q, k, v) * 1.0)(q, k, v)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_splash_block_fitting():
  assert fit_block(256, 512) == 256          # clipped to the sequence
  assert fit_block(640, 512) == 128          # largest multiple of 128 dividing 640 that is <= 512
  assert fit_block(768, 512) == 384
  assert fit_block(1024, 32) == 128          # below the lane width: 128
  assert fit_block(4096, 1000) == 512


def test_splash_residuals_are_kept_by_save_matmuls(capsys):
  """The save_matmuls policy keeps splash's out / logsumexp (named "splash_residuals" inside the
  kernel's own jit, so they show up as its outputs) for the backward; "full" keeps neither."""
  q, k, v, _ = _inputs(1, 128, 128, 2, 2, 32)
  loss = lambda q, k, v: splash_attention(q, k, v, None, scale=0.2).sum()
  saved = {}
  for policy in ("save_matmuls", "full"):
    print_saved_residuals(jax.checkpoint(loss, policy=REMAT_POLICIES[policy]), q, k, v)
    saved[policy] = [line for line in capsys.readouterr().out.splitlines()
                     if "'_splash_attention'" in line]
  # out [B, H, S, E padded to 128] and logsumexp [B, H, S]
  assert [line.split()[0] for line in saved["save_matmuls"]] == ["f32[1,2,128,128]", "f32[1,2,128]"]
  assert saved["full"] == []


def test_flash_on_tpu_runs_splash_in_the_sharded_train_step(tmp_path, monkeypatch):
  """attention=flash resolved as on a TPU (splash, interpret mode) inside the sharded step on 8
  devices (batch over data/fsdp, heads over tensor through shard_map) trains like dot_product."""
  base = ("steps=5", "enable_checkpointing=false", *MESH_222)
  _, ref, _ = train(tmp_path, "xla", *base, "attention=dot_product")
  real, splash_op, traced = attention_ops.select_attention, attention_ops.splash, []
  monkeypatch.setattr(attention_ops, "select_attention", lambda name, platform: real(name, "tpu"))
  monkeypatch.setitem(attention_ops.ATTENTION_OPS, "splash",
                      lambda *a, **kw: traced.append(1) or splash_op(*a, **kw))
  code, got, _ = train(tmp_path, "splash", *base, "attention=flash")
  assert code == 0 and len(got) == 5 and traced
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- cudnn
@pytest.mark.parametrize("H,K,window", [(4, 2, None), (4, 1, 24)])
def test_cudnn_argument_mapping_with_xla_implementation(H, K, window):
  """The cudnn op's call (is_causal, local_window_size, segment-id mask, scale, GQA) run through
  implementation='xla' equals our dot-product op, outputs and gradients."""
  B, S, E = 2, 64, 32
  q, k, v, do = _inputs(B, S, S, H, K, E, seed=7)
  seg = jnp.stack([_two_docs(1, S, 40)[0], jnp.where(jnp.arange(S) < 50, 1, 0)])  # + padding tail
  scale = 0.3
  _compare(lambda q, k, v: cudnn(q, k, v, seg, scale=scale, sliding_window=window,
                                 implementation="xla"),
           lambda q, k, v: dot_product_attention(q, k, v, seg, scale=scale, sliding_window=window),
           q, k, v, do, segment_ids=seg, scale=scale, sliding_window=window)


def test_cudnn_refuses_a_window_without_causal():
  q, k, v, _ = _inputs(1, 16, 16, 2, 2, 16)
  with pytest.raises(ValueError, match="needs causal"):
    cudnn(q, k, v, None, scale=1.0, causal=False, sliding_window=4, implementation="xla")


def _config_error(*overrides):
  with pytest.raises(ConfigError) as e:
    validate(load_config([BASE_YML, *overrides]), jax.devices())
  return str(e.value)


def test_cudnn_refused_at_validation_on_cpu():
  msg = _config_error("attention=cudnn", "dtype=bfloat16")
  assert msg.startswith("attention:") and "NVIDIA GPU with cuDNN" in msg and "'cpu'" in msg


def test_cudnn_checks_on_a_gpu_device(monkeypatch):
  """dtype and head-dim limits (as cuDNN's own checks) on a stand-in CUDA device."""
  gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0",
                              client=types.SimpleNamespace(platform_version="cuda 12080"))
  def check(device=gpu, dtype="bfloat16", head_dims=(128,)):
    return attention_problems("cudnn", "cudnn", device=device, dtype=dtype,
                              head_dims=list(head_dims), sequence_sharded=False)

  assert check() == []
  assert "float32" in check(dtype="float32")[0][1]
  assert "[512]" in check(head_dims=(256, 512))[0][1]
  ampere = types.SimpleNamespace(**{**vars(gpu), "compute_capability": "8.0"})
  assert "up to 128" in check(device=ampere, head_dims=(256,))[0][1]
  rocm = types.SimpleNamespace(**{**vars(gpu),
                                  "client": types.SimpleNamespace(platform_version="rocm 6.2")})
  assert "NVIDIA" in check(device=rocm)[0][1]


# ----------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("name,platform,op", [
    ("flash", "tpu", "splash"), ("autoselected", "tpu", "splash"), ("flash", "gpu", "flash"),
    ("autoselected", "gpu", "flash"), ("autoselected", "cpu", "dot_product"),
    ("flash", "cpu", "flash"), ("cudnn", "gpu", "cudnn"), ("dot_product", "tpu", "dot_product"),
])
def test_select_attention(name, platform, op):
  assert select_attention(name, platform) == op
  assert op in attention_ops.ATTENTION_OPS


def test_a_sharded_sequence_takes_flash_and_refuses_splash_and_cudnn():
  """Context parallelism runs with our flash kernel (tests/test_context_parallel.py) and with
  dot_product; splash (TPU) and cuDNN run whole sequences per shard and are refused."""
  for attention in ("flash", "dot_product"):
    validate(load_config([BASE_YML, f"attention={attention}", "ici_fsdp_parallelism=4",
                          "ici_context_parallelism=2", "per_device_batch_size=1"]), jax.devices())
  for resolved in ("splash", "cudnn"):
    problems = attention_ops.attention_problems("flash", resolved, device=jax.devices()[0],
                                                dtype="bfloat16", head_dims=[16],
                                                sequence_sharded=True)
    assert any("context parallelism" in msg for _, msg in problems)


def test_splash_backward_blocks_cap_wide_heads():
  """Heads wider than one lane tile run the backward in blocks of at most 512 rows (fitted to the
  length), so its scoped VMEM fits at head_dim 256 / 512 (module docstring of kernels/splash.py);
  128-wide heads keep the forward's blocks."""
  from MaxText.kernels import splash
  assert splash.backward_block(1024, 128, 2048) == 1024
  assert splash.backward_block(1024, 256, 2048) == 512
  assert splash.backward_block(1024, 512, 2048) == 512
  assert splash.backward_block(1024, 256, 1152) == 384     # fitted: 512 does not divide 1152
  assert splash.backward_block(256, 512, 2048) == 256
