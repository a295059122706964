"""Context parallelism with attention=flash (MaxText/layers/context_parallel.py) and Qwen3-Next's
recurrent layers (context_parallel_linear.py) against one device.

- The attention op alone: all_gather and ring over 4 shards, natural and load-balanced layouts,
  GQA, a sliding window and packed documents, forward and gradients against the unsplit kernel;
  the ring's output and log-sum-exp kept by the remat policy's names (no forward recompute).
- Training: 3 steps at context parallelism 2 and 4 (both strategies, each on 2 and on 4 shards,
  every family under one at least: `CASES`) against 1 device, fp32, for the
  default llama, Gemma 4 (full + a KV-shared layer) and Qwen3-Next (linear + full): the
  losses within 1e-5, the first step's gradient norm within 1e-5 relative (later steps' within
  3e-5: their parameters already differ by rounding), the trained parameters within 1e-5. The rows are packed from short documents (a jsonl file of 15 to 60 bytes each: several
  documents a row, segment ids and positions restarting), so documents start, end and cross
  chunk and shard boundaries everywhere.
- Bad combinations exit 2 naming the key.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh

from conftest import train
from MaxText.kernels.flash_attention import flash_attention
from MaxText.layers import context_parallel as cp
from MaxText.sharding.rules import current_context, use_rules

FAMILIES = {
    "llama": (),
    # a full layer, then a full layer on its K/V (Gemma 4's last layer is full): Gemma 4's own
    # code under context parallelism (K = V on the full layer, the shared K/V handed on as they
    # are sharded). A sliding layer is the same op with a window (`sliding_window` passed on by
    # attention_ops as every kernel option), which test_attention_op_equals_the_unsplit_kernel
    # checks on 4 shards, a window crossing chunks, both strategies and layouts; a sliding layer
    # here cost ~40 % more of this case's programs (the costliest in the file) for no path more
    "gemma4": ("model_name=gemma4-tiny", "num_decoder_layers=2", "attention_pattern=f",
               "num_kv_shared_layers=1", "flash_block_q=32", "flash_block_kv=32",
               "learning_rate=3e-4"),
    # one linear then one full layer: each kind under context parallelism (a repeat of the pair
    # runs the same code again, at ~9 CPU s more of this case)
    "qwen3_next": ("model_name=qwen3-next-tiny", "num_decoder_layers=2", "attention_pattern=lf",
                   "linear_chunk_size=16", "num_experts_per_tok=8", "learning_rate=3e-4"),
}
# adam_eps=1: each update is linear in its gradient near zero (with the default 1e-8 a gradient at
# rounding level moves its parameter by a whole learning rate, so steps 2-3 would compare AdamW's
# amplification of fp32 rounding rather than the sharded step)
COMMON = ("steps=3", "log_period=1", "dtype=float32", "attention=flash", "enable_checkpointing=false",
          "ici_fsdp_parallelism=1", "adam_eps=1")
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> str:
  """Short documents: a 64-token row packs several (the byte tokenizer: a token a byte)."""
  r = np.random.default_rng(0)
  path = tmp_path_factory.mktemp("data") / "docs.jsonl"
  words = "the a cat sat on mat and ran far away over hills under skies".split()
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(200):
      text = " ".join(r.choice(words, size=r.integers(3, 12)))[:60]
      f.write(json.dumps({"text": text}) + "\n")
  return str(path)


def _run(tmp_path, family: str, n: int, strategy: str, documents: str):
  return train(tmp_path, f"{family}-{n}-{strategy}", *FAMILIES[family], *COMMON,
               "dataset_type=file", f"dataset_path={documents}",
               f"ici_context_parallelism={n}", f"per_device_batch_size={GLOBAL_BATCH // n}",
               f"context_parallel_strategy={strategy}", devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, documents):
  """One device per family, computed once."""
  runs = {}

  def get(family):
    if family not in runs:
      code, rows, state = _run(tmp_path_factory.mktemp(family), family, 1, "all_gather",
                               documents)
      assert code == 0 and len(rows) == 3
      runs[family] = (rows, jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state["params"]))
    return runs[family]
  return get


# Every (shard count, strategy) pair and every family: not the whole product. The strategy is one
# branch of the shared op (attention_ops passes context_parallel_strategy on to
# flash_context_parallel whatever the family), so a family's own code under context parallelism
# (Gemma 4's K/V handed to a shared layer, Qwen3-Next's recurrent layers,
# context_parallel_linear.py, which never reads the strategy) runs the same under either; the
# strategies' op itself is checked on 4 shards in both layouts, with GQA, a window crossing chunks
# and two documents, by test_attention_op_equals_the_unsplit_kernel. all_gather's code does not
# depend on the shard count beyond array sizes; ring on 4 shards meets every (query chunk, key
# chunk) relation 2 shards do, and more hops; Qwen3-Next's linear layers on 4 shards hand their
# state over 8 chunks (2 shards: 4) by the same scan.
CASES = [("llama", 2, "ring"), ("llama", 4, "all_gather"),
         ("gemma4", 2, "all_gather"), ("qwen3_next", 4, "ring")]


@pytest.mark.parametrize("family,n,strategy", CASES)
def test_training_equals_one_device(tmp_path, reference, documents, family, n, strategy):
  rows1, params1 = reference(family)
  code, rows, state = _run(tmp_path, family, n, strategy, documents)
  assert code == 0
  col = lambda rs, k: np.array([r[k] for r in rs])
  assert col(rows1, "loss")[-1] != col(rows1, "loss")[0]
  np.testing.assert_allclose(col(rows, "loss"), col(rows1, "loss"), rtol=0, atol=1e-5)
  grads, grads1 = col(rows, "grad_norm"), col(rows1, "grad_norm")
  np.testing.assert_allclose(grads[0], grads1[0], rtol=1e-5)   # the same parameters: the gradient
  # steps 2 and 3 start from parameters one step apart by fp32 rounding (Gemma 4's attention
  # scale 1.0 amplifies it most: tests/test_gemma4_train.py)
  np.testing.assert_allclose(grads, grads1, rtol=3e-5)
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state["params"])
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params1)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


N_OP, KW = 4, dict(scale=0.3, causal=True, sliding_window=7, block_q=16, block_kv=16)


def _forward_and_grads(f, do):
  """f's output and the gradients of sum(f * do) with respect to (q, k, v), one program."""
  def both(q, k, v):
    o, vjp = jax.vjp(f, q, k, v)
    return o, vjp(do)
  return jax.jit(both)


@pytest.fixture(scope="module")
def attention_case():
  """4 shards' inputs (GQA: 4 query heads on 2 kv heads; two documents a row) and the unsplit
  kernel's outputs and gradients, computed once for every strategy and layout."""
  B, S, H, K, E = 2, 64, 4, 2, 8
  r = np.random.default_rng(0)
  q, k, v = (jnp.asarray(r.normal(size=(B, S, h, E)), jnp.float32) for h in (H, K, K))
  seg = jnp.asarray(np.stack([np.r_[np.ones(20), 2 * np.ones(44)],
                              np.r_[np.ones(37), 2 * np.ones(27)]]).astype(np.int32))
  do = jnp.asarray(r.normal(size=(B, S, H, E)), jnp.float32)
  want, want_grads = _forward_and_grads(lambda q, k, v: flash_attention(q, k, v, seg, **KW),
                                        do)(q, k, v)
  return (q, k, v, seg, do), (want, want_grads)


def _split(seg, strategy: str, balanced: bool):
  """(q, k, v) -> `flash_context_parallel`'s output over N_OP shards, back in sequence order."""
  n = N_OP
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(1, n), ("data", "context"))
  rules = (("activation_batch", ("data",)), ("activation_length", ("context",)))
  there = (lambda x: cp.to_balanced(x, n)) if balanced else (lambda x: x)
  back = (lambda x: cp.from_balanced(x, n)) if balanced else (lambda x: x)

  def f(q, k, v):
    with use_rules(mesh, rules), cp.balanced_layout(balanced):
      ctx = current_context()
      assert ctx is not None
      o = cp.flash_context_parallel(there(q), there(k), there(v), there(seg), ctx=ctx,
                                    strategy=strategy, batch="data", heads=None, kv_heads=None,
                                    **KW)
    return back(o)
  return f


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("strategy", cp.STRATEGIES)
def test_attention_op_equals_the_unsplit_kernel(attention_case, strategy, balanced):
  """4 shards, either layout, GQA (4 query heads on 2 kv heads), a window of 7 (crossing chunks of
  8), two documents; outputs and gradients of q, k, v against `flash_attention` on one array."""
  (q, k, v, seg, do), (want, want_grads) = attention_case
  got, grads = _forward_and_grads(_split(seg, strategy, balanced), do)(q, k, v)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
  for g, ref in zip(grads, want_grads):
    np.testing.assert_allclose(g, ref, rtol=0, atol=2e-6)


def test_ring_residuals_are_named_for_remat(attention_case, capsys):
  """The ring's merged output and log-sum-exp carry the flash kernel's names, so the remat policy
  that keeps those (save_matmuls) keeps them, and the backward pass does not run the ring's
  forward again (traced only)."""
  (q, k, v, seg, _), _ = attention_case
  f = _split(seg, "ring", False)
  saved = {}
  for key, policy in (("names", jax.checkpoint_policies.save_only_these_names("flash_out",
                                                                              "flash_lse")),
                      ("nothing", jax.checkpoint_policies.nothing_saveable)):
    print_saved_residuals(jax.checkpoint(lambda q, k, v: f(q, k, v).sum(), policy=policy), q, k, v)
    saved[key] = capsys.readouterr().out
  # inside shard_map the names do not show; its outputs kept for the backward pass do: o [B, S, H, E]
  # and the fp32 lse ([b, H, 2C] a shard, stacked over the 4 shards)
  kept = [line.split()[0] for line in saved["names"].splitlines() if "output of shard_map" in line]
  assert sorted(kept) == ["f32[2,64,4,8]", "f32[8,4,16]"]
  assert "output of shard_map" not in saved["nothing"]


def test_balanced_order_round_trips():
  x = jnp.arange(2 * 16).reshape(2, 16)
  order = cp.balance_order(16, 2)
  assert list(order[:8]) == [0, 1, 2, 3, 12, 13, 14, 15]      # shard 0: chunks 0 and 3
  np.testing.assert_array_equal(cp.from_balanced(cp.to_balanced(x, 2), 2), x)


@pytest.mark.parametrize("overrides,key", [
    (("max_target_length=60",), "max_target_length=60"),      # 60 % (2 x 4) != 0
    (("context_parallel_strategy=ulysses",), "context_parallel_strategy"),
])
def test_bad_combinations_exit_2(tmp_path, capsys, overrides, key):
  code, _, _ = train(tmp_path, "bad", *COMMON, "ici_context_parallelism=4",
                     "per_device_batch_size=1", *overrides, devices=jax.devices()[:4])
  assert code == 2
  assert key in capsys.readouterr().err
