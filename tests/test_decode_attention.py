"""MaxText/kernels/decode_attention.py (interpreted on the CPU) against the same attention in
float64 NumPy: rows of different live lengths (1, a block boundary, the whole cache), several
cache blocks (a row block's blocks past its longest row are not read), the layer as a traced
scalar, row blocks of 1, 2 and 4 rows, a bf16 cache under fp32 queries."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels.decode_attention import block_rows, decode_attention, fit_block_t

L, B, K, G, T, E = 3, 4, 2, 3, 64, 16


def numpy_attention(q, k, v, layer, lengths, scale):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k[layer], v[layer]))
  out = np.zeros_like(q)
  for b in range(B):
    n = max(int(lengths[b]), 1)
    s = np.einsum("kge,kte->kgt", q[b], k[b, :, :n]) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    out[b] = np.einsum("kgt,kte->kge", p / p.sum(-1, keepdims=True), v[b, :, :n])
  return out


@pytest.mark.parametrize("rows,cache_dtype", [(1, jnp.float32), (2, jnp.bfloat16),
                                              (4, jnp.float32)])
def test_kernel_matches_numpy(rows, cache_dtype):
  rng = np.random.default_rng(rows)
  q = rng.normal(size=(B, K, G, E)).astype(np.float32)
  k, v = (rng.normal(size=(L, B, K, T, E)).astype(np.float32) for _ in range(2))
  k, v = jnp.asarray(k, cache_dtype), jnp.asarray(v, cache_dtype)
  lengths = np.array([1, 16, 17, 64])
  run = jax.jit(lambda q, k, v, layer, n: decode_attention(q, k, v, layer, n, scale=0.25,
                                                           block_t=16, rows=rows))
  with jax.default_matmul_precision("highest"):
    for layer in range(L):   # one program: the layer is traced
      got = np.asarray(run(q, k, v, jnp.int32(layer), lengths))
      want = numpy_attention(q, np.asarray(k, np.float32), np.asarray(v, np.float32), layer,
                             lengths, 0.25)
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_blocks_and_rows_chosen():
  assert fit_block_t(256, 128) == 128 and fit_block_t(48, 128) == 48 and fit_block_t(40, 32) == 40
  assert fit_block_t(96, 64) == 48
  assert block_rows(32, 8) == 8 and block_rows(1, 8) == 1 and block_rows(6, 8) == 6
  assert block_rows(12, 6) == 4 and block_rows(64, 2) == 32 and block_rows(50, 5) == 50
  # the K / V blocks' buffers within KV_BLOCKS_BYTES: Qwen3-0.6B's 64 rows of 128 x 128 bf16 fit;
  # Gemma 4 E4B's global layers (E 512) at batch 16: 16 rows, not 32 (a scoped VMEM OOM on a v5e)
  assert block_rows(32, 8, block_bytes=128 * 128 * 2) == 8
  assert block_rows(16, 2, block_bytes=128 * 512 * 2) == 8
  assert block_rows(16, 2) == 16 and block_rows(1, 2, block_bytes=1 << 30) == 1
  with pytest.raises(ValueError, match="rows=3 does not divide the batch 4"):
    decode_attention(jnp.zeros((B, K, G, E)), jnp.zeros((L, B, K, T, E)),
                     jnp.zeros((L, B, K, T, E)), 0, jnp.ones(B, jnp.int32), scale=1.0, rows=3)


@pytest.mark.parametrize("rows,cache_dtype", [(1, jnp.float32), (2, jnp.bfloat16)])
def test_kernel_stores_the_steps_keys_and_values_then_attends_over_them(rows, cache_dtype):
  """new_kv: each row's new K/V land at its position of the layer's row of the stacks (a row at
  position -1 or T stores nothing), nothing else changes, and the attention sees them."""
  rng = np.random.default_rng(10 + rows)
  q = rng.normal(size=(B, K, G, E)).astype(np.float32)
  k, v = (jnp.asarray(rng.normal(size=(L, B, K, T, E)), cache_dtype) for _ in range(2))
  k_new, v_new = (rng.normal(size=(B, K, E)).astype(np.float32) for _ in range(2))
  lengths = np.array([1, 16, 17, 64])
  layer = 1
  run = jax.jit(lambda q, k, v, wpos: decode_attention(
      q, k, v, jnp.int32(layer), lengths, scale=0.25, block_t=16, rows=rows,
      new_kv=(k_new, v_new, wpos)))
  for wpos in (lengths - 1, np.array([0, -1, 16, T])):
    want_k, want_v = np.array(k, np.float32), np.array(v, np.float32)
    for b in range(B):
      if 0 <= wpos[b] < T:
        want_k[layer, b, :, wpos[b]] = np.asarray(jnp.asarray(k_new[b], cache_dtype), np.float32)
        want_v[layer, b, :, wpos[b]] = np.asarray(jnp.asarray(v_new[b], cache_dtype), np.float32)
    with jax.default_matmul_precision("highest"):
      o, got_k, got_v = run(q, k, v, wpos)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), want_v)
    np.testing.assert_allclose(np.asarray(o), numpy_attention(q, want_k, want_v, layer, lengths,
                                                              0.25), rtol=2e-5, atol=2e-5)


def test_auto_is_the_kernel_on_a_tpu_only():
  """decode_attention=auto (the default): the kernel on a TPU, the einsums on a CPU or GPU (which
  would interpret it); a ModelConfig holds the key resolved for the default backend."""
  from conftest import BASE_YML   # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config   # pylint: disable=import-outside-toplevel
  from MaxText.layers.kv_cache import select_decode_attention  # pylint: disable=import-outside-toplevel
  from MaxText.models.model_config import ModelConfig  # pylint: disable=import-outside-toplevel
  assert [select_decode_attention("auto", p) for p in ("tpu", "cpu", "gpu")] == [
      "pallas", "xla", "xla"]
  assert select_decode_attention("xla", "tpu") == "xla"
  assert select_decode_attention("pallas", "cpu") == "pallas"
  cfg = load_config([BASE_YML])
  assert cfg.decode_attention == "auto"
  assert ModelConfig.from_config(cfg).decode_attention == (
      "pallas" if jax.default_backend() == "tpu" else "xla")
