"""Mixture of experts (MaxText/layers/moe.py): the padded all-to-all against a NumPy model of
`ragged_all_to_all`'s contract, the dropless experts (and capacity mode) against a dense NumPy
reference, expert parallelism 4 x fsdp 2 against one device (losses and gradients) for a
Qwen3-MoE-style model with a dense first layer and unnormalised top-k weights, and the
aux-loss-free bias flattening the expert load."""
import functools
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from conftest import BASE_YML, MESH_1, ROOT, argv, train
from MaxText.config.load import load_config
from MaxText.layers import moe

MOE = ("num_experts=8", "num_experts_per_tok=2", "moe_mlp_dim=32", "moe_aux_loss_weight=0.01")


# ---- the ragged all-to-all contract ------------------------------------------------------------
def ragged_all_to_all_numpy(operand, output, in_off, send, out_off):
  """Reference semantics, all devices at once: device s's rows operand[s][in_off[s,r] : +send[s,r]]
  land in device r's output at out_off[s,r]; everything else keeps output's values."""
  out = [o.copy() for o in output]
  n = len(operand)
  for s in range(n):
    for r in range(n):
      k = send[s, r]
      out[r][out_off[s, r]:out_off[s, r] + k] = operand[s][in_off[s, r]:in_off[s, r] + k]
  return np.stack(out)


def random_layout(rng, n, rows_in, rows_out):
  """Send sizes, gapped input offsets, and receiver-side output offsets that do not overlap."""
  send = rng.integers(0, rows_in // n + 1, size=(n, n))
  in_off = np.zeros((n, n), int)
  for s in range(n):
    pos = 0
    for r in rng.permutation(n):                    # slices in any order, with gaps
      pos += rng.integers(0, 2)
      in_off[s, r] = pos
      pos += send[s, r]
    assert pos <= rows_in
  out_off = np.zeros((n, n), int)
  for r in range(n):
    pos = 0
    for s in rng.permutation(n):
      pos += rng.integers(0, 2)
      out_off[s, r] = pos
      pos += send[s, r]
    assert pos <= rows_out
  return send, in_off, out_off


def test_padded_all_to_all_has_ragged_all_to_all_semantics():
  n, rows_in, rows_out = 4, 24, 40
  mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
  rng = np.random.default_rng(0)

  def per_device(op, out, io, ss, oo, rs):
    return moe.padded_ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0],
                                        axis_name="x")[None]

  # one program for the three trials (the layouts are its arguments)
  padded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
  for trial in range(3):
    send, in_off, out_off = random_layout(rng, n, rows_in, rows_out)
    operand = rng.normal(size=(n, rows_in, 3)).astype(np.float32)
    output = rng.normal(size=(n, rows_out, 3)).astype(np.float32)
    want = ragged_all_to_all_numpy(operand, output, in_off, send, out_off)
    # device s holds row s of each argument; recv_sizes[r, s] = send[s, r]
    args = (operand, output, in_off, send, out_off, send.T.copy())
    got = padded(*(np.asarray(a, np.int32 if a.dtype.kind == "i" else np.float32) for a in args))
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"trial {trial}")


def test_dispatch_selection():
  assert moe.select_dispatch("auto", "cpu") == "padded_all_to_all"
  assert moe.select_dispatch("auto", "gpu") == moe.select_dispatch("auto", "tpu") == "ragged_all_to_all"
  assert moe.RAGGED_ALL_TO_ALL["ragged_all_to_all"] is jax.lax.ragged_all_to_all


# ---- the experts ------------------------------------------------------------------------------
def dense_reference(x, weights, experts, wi, wo, capacity=None):
  """Token by token in float64; with a capacity, an expert takes copies in (token, slot) order."""
  T, k = experts.shape
  F = wo.shape[1]
  y = np.zeros(x.shape, np.float64)
  taken = np.zeros(wi.shape[0], int)
  order = sorted(range(T * k), key=lambda m: (experts.reshape(-1)[m], m))
  kept = set()
  for m in order:
    e = experts.reshape(-1)[m]
    if capacity is None or taken[e] < capacity:
      kept.add(m)
      taken[e] += 1
  for t in range(T):
    for j in range(k):
      if t * k + j not in kept:
        continue
      e = experts[t, j]
      h = x[t].astype(np.float64) @ wi[e]
      g, u = h[:F], h[F:]
      y[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ wo[e])
  return y, T * k - len(kept)


@functools.partial(jax.jit, static_argnames=("k", "capacity"))
def _route_and_experts(x, logits, wi, wo, *, k, capacity):
  """Routing then the local experts, one program (not op by op)."""
  w, e, probs = moe.route(logits, k, renormalize=True)
  got, dropped = moe.experts_local(x, w, e, wi, wo, jax.nn.silu, capacity)
  return w, e, probs, got, dropped


def _experts_case():
  """(tokens x [T, D], router logits [T, E], wi [E, D, 2F], wo [E, F, D], k): 12 tokens, 4 experts
  of width 6, top-2, seeded."""
  rng = np.random.default_rng(0)
  T, D, E, F, k = 12, 8, 4, 6, 2
  x = rng.normal(size=(T, D)).astype(np.float32)
  logits = rng.normal(size=(T, E)).astype(np.float32)
  wi = (0.3 * rng.normal(size=(E, D, 2 * F))).astype(np.float32)
  wo = (0.3 * rng.normal(size=(E, F, D))).astype(np.float32)
  return x, logits, wi, wo, k


@pytest.mark.parametrize("capacity", [None, 2])
def test_dropless_experts_match_dense_reference(capacity):
  x, logits, wi, wo, k = _experts_case()
  w, e, probs, got, dropped = _route_and_experts(x, logits, wi, wo, k=k, capacity=capacity)
  want, want_dropped = dense_reference(x, np.asarray(w), np.asarray(e), wi, wo, capacity)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert int(dropped) == want_dropped and (want_dropped > 0) == (capacity is not None)
  # routing: top-k of the softmax, renormalised
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  np.testing.assert_allclose(np.asarray(probs), p, rtol=1e-6)
  top = np.argsort(-p, axis=1)[:, :k]
  assert np.array_equal(np.sort(np.asarray(e), 1), np.sort(top, 1))
  np.testing.assert_allclose(np.asarray(w).sum(1), 1.0, rtol=1e-6)


# ---- expert parallelism -----------------------------------------------------------------------
EP = ("per_device_batch_size=1", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
# Qwen3-MoE with mlp_only_layers=[0] and norm_topk_prob=false: layer 0 dense, layers 1-2 MoE
DENSE_FIRST = ("num_decoder_layers=3", "mlp_only_layers=[0]", "norm_topk_prob=false",
               "use_qk_norm=true")


def test_expert_parallel_equals_one_device(tmp_path):
  """EP 4 x fsdp 2 on 8 devices against one device, two training steps on the same batches, for
  a model with a dense first layer (a run of its own in the pattern stack) and
  norm_topk_prob=false: the same losses (cross-entropy + weighted aux loss), and the same Adam
  moments for every parameter (mu and nu are running sums of each step's gradients: equal moments
  = equal gradients: the first step's at the init, the second's after an update); the experts'
  weights and their moments are split over `expert`."""
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import get_family
  mcfg = ModelConfig.from_config(load_config(argv(tmp_path, "one", *MOE, *DENSE_FIRST)))
  assert get_family(mcfg.decoder_block).layer_kinds(mcfg) == ("dense", "moe", "moe")
  steps = ("steps=2", "enable_checkpointing=false")
  _, one, s1 = train(tmp_path, "one", *MOE, *DENSE_FIRST, *MESH_1, *steps,
                     devices=jax.devices()[:1])
  _, eight, s8 = train(tmp_path, "eight", *MOE, *DENSE_FIRST, *EP, *steps)
  assert [r["batch_checksum"] for r in eight] == [r["batch_checksum"] for r in one]
  np.testing.assert_allclose([r["loss"] for r in eight], [r["loss"] for r in one], rtol=0,
                             atol=1e-5)
  assert all(r["moe_dropped"] == 0 for r in eight)
  # router_bias_update_rate unset: training (the default learning rate) leaves the selection bias
  # at zero (test_router_bias_flattens_expert_load: with the rate set, it moves)
  for s in (s1, s8):
    assert not np.any(np.asarray(jax.device_get(s["params"]["router_bias"])))
  assert {"moe_load_max_over_mean/layer_1", "moe_load_max_over_mean/layer_2"} <= set(eight[0])
  assert "moe_load_max_over_mean/layer_0" not in eight[0]             # the dense layer has none
  adam1, adam8 = (jax.device_get(s["opt_state"][1][0]) for s in (s1, s8))
  dense, routed = adam1.mu["decoder"]["runs"][0][0]["mlp"], adam1.mu["decoder"]["runs"][1][0]["mlp"]
  assert "gate" in dense and "experts" in routed
  mu1, mu8 = jax.tree.leaves(adam1.mu), jax.tree.leaves(adam8.mu)
  nu1, nu8 = jax.tree.leaves(adam1.nu), jax.tree.leaves(adam8.nu)
  assert len(mu1) == len(mu8) == len(nu1) > 10
  assert sum(np.abs(m).max() > 0 for m in mu1) == len(mu1) - 1     # all but the router bias
  # fp32 rounding of sums over another device split: ~100 eps of each leaf's magnitude (measured
  # 1e-7..1e-6 of it); a wrong gradient anywhere is off by far more
  for a, b in [*zip(mu1, mu8), *zip(nu1, nu8)]:
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
  wi = s8["params"]["decoder"]["runs"][1][0]["mlp"]["experts"]["wi"]
  assert "expert" in str(wi.sharding.spec[1])                   # [L, E, D, 2F]: E over `expert`
  assert wi.sharding.shard_shape(wi.shape)[1] == wi.shape[1] // 4
  mu = s8["opt_state"][1][0].mu["decoder"]["runs"][1][0]["mlp"]["experts"]["wi"]
  assert mu.sharding.shard_shape(mu.shape)[1] == mu.shape[1] // 4


def test_router_bias_flattens_expert_load(tmp_path, capsys):
  """With the weights frozen (learning_rate=0), only the selection bias moves: the max/mean
  expert load of the skewed byte-level text falls. Without the bias the frozen router keeps ~3.1
  of a worst-possible 4.0: the progress line shows it and the run warns, once (20 steps: a warning
  repeated every PATIENCE = 10 steps would come again at step 20). The bias takes the last five
  steps' mean load to ~0.66 of the frozen router's (0.67 in 30 steps)."""
  run = ("steps=20", "learning_rate=0", "enable_checkpointing=false", "log_period=10")
  _, fixed, _ = train(tmp_path, "fixed", *MOE, *MESH_1, *run, devices=jax.devices()[:1])
  out = capsys.readouterr().out
  assert re.search(r"^step 10/20 \| .* \| expert load 3\.\d\d \|", out, re.M), out[-3000:]
  warnings = re.findall(r"^warning: expert load collapsed: moe_load_max_over_mean above 2.00 for "
                        r"10 steps up to step 10 .*moe_aux_loss_weight=0.01, "
                        r"router_bias_update_rate=0\. Raise moe_aux_loss_weight", out, re.M)
  assert len(warnings) == 1, out[-3000:]             # once per collapse
  _, biased, state = train(tmp_path, "biased", *MOE, *MESH_1, *run,
                           "router_bias_update_rate=0.01", devices=jax.devices()[:1])
  load = lambda rows: np.array([r["moe_load_max_over_mean"] for r in rows])
  assert load(fixed)[0] == load(biased)[0] > 1.3                      # same start, skewed
  assert load(biased)[-5:].mean() < 0.8 * load(fixed)[-5:].mean()     # flattened
  assert np.abs(np.asarray(jax.device_get(state["params"]["router_bias"]))).max() > 0
  # without router_bias_update_rate the bias stays zero however the weights train:
  # test_expert_parallel_equals_one_device asserts it of its runs


def test_shared_expert_adds_its_sigmoid_gated_output():
  """RoutedMLP with a shared expert = routed experts + shared(x) * sigmoid(x . w_gate)."""
  from flax import nnx
  from MaxText.models.model_config import ModelConfig
  cfg = ModelConfig.from_config(load_config([BASE_YML, "emb_dim=16", *MOE[:3],
                                             "shared_expert_mlp_dim=24"]))
  x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype(np.float32)
  mask = np.ones((2, 5), bool)

  @jax.jit
  def outputs(x):
    """The layer built and run in one program (not op by op)."""
    layer = moe.RoutedMLP(cfg, rngs=nnx.Rngs(params=0))
    y, _ = layer(x, mask)
    shared, gate = layer.shared, layer.shared_gate
    assert shared is not None and gate is not None
    layer.shared = layer.shared_gate = None
    routed, _ = layer(x, mask)
    return y, routed, shared(x), gate(x)

  with nnx.use_eager_sharding(False):
    y, routed, shared_x, gate_x = outputs(x)
  gated = np.asarray(shared_x) / (1 + np.exp(-np.asarray(gate_x)))
  assert np.abs(gated).max() > 1e-3
  np.testing.assert_allclose(np.asarray(y), np.asarray(routed) + gated, rtol=1e-5, atol=1e-6)


# ---- config checks before anything compiles -------------------------------------------------------
def test_expert_shards_that_do_not_divide_the_experts_exit_2_before_compiling(tmp_path, capsys):
  """Explicit num_experts, and num_experts taken from a load_parameters_path checkpoint (only its
  config is read: the refusal comes before any parameter is loaded)."""
  import json
  import os
  from MaxText.config.load import ConfigError
  from MaxText.resolve.config_checks import validate
  ep = ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=1")
  with pytest.raises(ConfigError, match=r"ici_expert_parallelism=4 x dcn_expert_parallelism=1: "
                                        r"4 expert shards do not divide num_experts=6$"):
    validate(load_config([BASE_YML, "num_experts=6", "moe_mlp_dim=32", *ep]), jax.devices())
  with pytest.raises(ConfigError, match="capacity_factor=1.5 is a single-shard comparison mode"):
    validate(load_config([BASE_YML, "num_experts=8", "moe_mlp_dim=32", "capacity_factor=1.5", *ep]),
             jax.devices())
  ckpt = tmp_path / "ckpt" / "0"
  os.makedirs(ckpt / "params")
  os.makedirs(ckpt / "meta")
  saved = load_config(argv(tmp_path, "src", *MOE[1:], "num_experts=6")).as_dict()
  (ckpt / "meta" / "metadata").write_text(json.dumps({"step": 0, "config": saved}))
  code, _, _ = train(tmp_path, "ft", *ep, f"load_parameters_path={tmp_path / 'ckpt'}")
  out, err = capsys.readouterr()
  assert code == 2
  assert "do not divide num_experts=6 (taken from the checkpoint at load_parameters_path=" in err
  assert "compiled" not in out and "loaded parameters" not in out


def test_collapse_watch_warns_once_per_collapse():
  from MaxText.metrics.moe_load import PATIENCE, CollapseWatch
  watch = CollapseWatch(8, 2, balancing="moe_aux_loss_weight=0", advice="Raise it")   # worst 4.0
  series = [1.5] * 3 + [3.9] * (PATIENCE + 5) + [1.2] * 2 + [3.9] * PATIENCE
  said = [(i + 1, w) for i, x in enumerate(series)
          if (w := watch.update(i + 1, {"moe_load_max_over_mean": x}))]
  assert [s for s, _ in said] == [3 + PATIENCE, 3 + PATIENCE + 5 + 2 + PATIENCE]
  assert said[0][1].endswith("(now 3.90; 4.00 = every token on the same 2 experts); balancing: "
                            "moe_aux_loss_weight=0. Raise it")
  assert CollapseWatch(8, 2, balancing="", advice="").update(1, {"loss": 1.0}) is None   # no key


def test_every_shipped_moe_config_balances_its_experts():
  names = [f[:-4] for f in os.listdir(os.path.join(ROOT, "configs", "models")) if f.endswith(".yml")]
  moe_configs = [c for c in (load_config([BASE_YML, f"model_name={n}"]) for n in names)
                 if c.num_experts]
  assert len(moe_configs) >= 4
  for cfg in moe_configs:
    assert cfg.moe_aux_loss_weight > 0 or cfg.router_bias_update_rate > 0, cfg.model_name


# ---- the grouped matmul: megablox (JAX's Pallas TPU kernel, interpreted here) -------------------
def test_megablox_grouped_matmul_equals_ragged_dot_values_and_gradients():
  """`moe_matmul=megablox`: the kernel's products and its own VJP (gmm / tgmm) against
  `jax.lax.ragged_dot` in float32 at highest precision; rows past the groups' total (an
  expert-parallel receive buffer's padding) are zeros with a zero gradient, as ragged_dot's."""
  rng = np.random.default_rng(1)
  M, K, N = 24, 16, 40
  sizes = jax.numpy.asarray([5, 0, 9, 6], jax.numpy.int32)   # 20 of 24 rows
  x = rng.normal(size=(M, K)).astype(np.float32)
  w = rng.normal(size=(4, K, N)).astype(np.float32)
  g = rng.normal(size=(M, N)).astype(np.float32)
  loss = lambda dot: lambda x, w: (dot(x, w) * g).sum()
  ref = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
  mb = lambda x, w: moe.megablox_dot(x, w, sizes, tiles=(512, 1024, 1024))
  with jax.default_matmul_precision("highest"):
    want, got = ref(x, w), mb(x, w)
    want_g = jax.grad(loss(ref), (0, 1))(x, w)
    got_g = jax.grad(loss(mb), (0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[20:] == 0)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
  assert np.all(np.asarray(got_g[0])[20:] == 0)


def test_megablox_experts_match_the_dense_reference():
  x, logits, wi, wo, k = _experts_case()
  w, e, _ = moe.route(jax.numpy.asarray(logits), k, renormalize=True)
  dot = moe.FloatExperts(matmul="megablox").ragged_dot
  with jax.default_matmul_precision("highest"):
    got, dropped = moe.experts_local(x, w, e, wi, wo, jax.nn.silu, None, dot)
  want, _ = dense_reference(x, np.asarray(w), np.asarray(e), wi, wo, None)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert int(dropped) == 0
  cfg = load_config([BASE_YML, "model_name=qwen3-moe-tiny", "moe_matmul=megablox",
                     "moe_matmul_tiles=[256,512,512]"])
  from MaxText.models.model_config import ModelConfig  # pylint: disable=import-outside-toplevel
  mcfg = ModelConfig.from_config(cfg)
  assert (mcfg.moe_matmul, tuple(mcfg.moe_matmul_tiles)) == ("megablox", (256, 512, 512))
  assert moe.select_matmul("auto") == "ragged_dot"


def test_token_copies_move_by_gathers_with_the_gathers_transposes():
  """The dispatch (x[order // k]) and the permutation (x[perm]) of the routed copies: values as
  the plain gathers, and gradients as autodiff's scatter-add transposes give them (NumPy the
  oracle for the inverse permutation), without a scatter in the gradient's program."""
  T, k, D = 6, 3, 5
  rng = np.random.default_rng(0)
  experts = rng.integers(0, 4, size=(T, k))
  order = jax.numpy.asarray(np.argsort(experts.reshape(-1), kind="stable").astype(np.int32))
  inv = moe.inverse_permutation(order)
  np.testing.assert_array_equal(np.asarray(inv), np.argsort(np.asarray(order)))
  x = jax.numpy.asarray(rng.standard_normal((T, D)), jax.numpy.float32)
  g = jax.numpy.asarray(rng.standard_normal((T * k, D)), jax.numpy.float32)

  def pullback(f, *args):
    y, vjp = jax.vjp(f, *args)
    return y, vjp(g)[0]

  y, dx = pullback(lambda x: moe._dispatch_rows(x, order, inv), x)
  y_ref, dx_ref = pullback(lambda x: x[order // k], x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-6, atol=1e-6)
  rows = jax.numpy.asarray(rng.standard_normal((T * k, D)), jax.numpy.float32)
  z, drows = pullback(lambda r: moe.permute_rows(r, inv, order), rows)
  z_ref, drows_ref = pullback(lambda r: jax.numpy.zeros_like(r).at[order].set(r), rows)
  np.testing.assert_array_equal(np.asarray(z), np.asarray(z_ref))
  np.testing.assert_array_equal(np.asarray(drows), np.asarray(drows_ref))
  program = jax.jit(lambda x: jax.vjp(lambda x: moe._dispatch_rows(x, order, inv), x)[1](g)
                    ).lower(x).as_text()
  assert "scatter" not in program
