"""The KV cache kinds against a NumPy reference: a sliding-window ring buffer of W slots fed a
prompt longer than W and then one token at a time holds exactly the last W positions and attends
over q - W < k <= q; a full cache over k <= q (its einsums and its Pallas decoding kernel); their memory is O(window) and O(length); Gemma 4
E2B's cache groups (its KV-shared tail stores nothing)."""
import jax
import jax.numpy as jnp
import numpy as np

from conftest import BASE_YML
from MaxText.config.load import load_config
from MaxText.decoding import cache as cache_lib
from MaxText.layers.kv_cache import KVCache
from MaxText.models.model_config import ModelConfig

B, K, G, E, W, T = 2, 2, 2, 8, 4, 32


def reference(q, keys, values, q_pos, window):
  """softmax(q.k / sqrt(E)) v over the keys at positions q - window < p <= q (all p <= q if 0)."""
  out = np.zeros_like(q)
  for b in range(q.shape[0]):
    lo = q_pos[b] - window + 1 if window else 0
    ks, vs = keys[b, lo:q_pos[b] + 1], values[b, lo:q_pos[b] + 1]      # [n, K, E]
    for h in range(q.shape[2]):
      s = ks[:, h // G] @ q[b, 0, h] / np.sqrt(E)
      p = np.exp(s - s.max())
      out[b, 0, h] = (p / p.sum()) @ vs[:, h // G]
  return out


def test_ring_and_full_caches_match_a_reference():
  rng = np.random.default_rng(0)
  keys, values = rng.normal(size=(2, B, T, K, E)).astype(np.float32)
  lengths = np.array([7, 3])          # prompts: one longer than the window, one shorter
  for window, kernel in ((W, "xla"), (0, "xla"), (0, "pallas")):
    kind = KVCache(K, E, window, kernel=kernel)
    specs = kind.arrays(B, T, jnp.float32)
    group = {n: np.full((1, *a.shape), a.fill, a.dtype) for n, a in specs.items()}
    # one program per shape (eagerly every op of a write or an attend compiles alone)
    write = jax.jit(kind.write, static_argnums=1)
    attend = jax.jit(kind.attend, static_argnums=1, static_argnames="scale")
    assert group["k"].shape[3] == (W if window else T)
    S = 8
    pos = np.broadcast_to(np.arange(S), (B, S))
    group = write(group, 0, keys[:, :S], values[:, :S], pos, pos < lengths[:, None])
    for step in range(12):             # then one token per step, each row at its own position
      q_pos = lengths + step
      at = (np.arange(B), q_pos)
      group = write(group, 0, keys[at][:, None], values[at][:, None], q_pos[:, None],
                    np.ones((B, 1), bool))
      if window:   # the ring holds exactly the last W positions
        assert sorted(np.asarray(group["pos"][0, 0]).tolist()) == list(range(q_pos[0] - W + 1,
                                                                            q_pos[0] + 1))
      q = rng.normal(size=(B, 1, K * G, E)).astype(np.float32)
      got = np.asarray(attend(group, 0, q, q_pos[:, None], scale=E ** -0.5))
      np.testing.assert_allclose(got, reference(q, keys, values, q_pos, window), atol=1e-5)


def test_gemma4_e2b_cache_is_rings_plus_full_layers():
  mcfg = ModelConfig.from_config(load_config([BASE_YML, "model_name=gemma4-e2b"]))
  groups = cache_lib.groups(mcfg)
  # 35 layers: 15 with K/V (12 sliding, 3 full); the 20 KV-shared layers store nothing
  assert {n: g.layers for n, g in groups.items()} == {"sliding": 12, "full": 3}
  specs = cache_lib.specs(mcfg, 1, 32768, jnp.bfloat16)
  assert specs["sliding"]["k"].shape == (12, 1, 1, 512, 256)         # the window, not 32k
  assert specs["full"]["k"].shape == (3, 1, 1, 32768, 512)
  assert cache_lib.nbytes(specs) == 2 * (12 * 512 * 256 + 3 * 32768 * 512) * 2 + 12 * 512 * 4
