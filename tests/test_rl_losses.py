"""The RL loss (MaxText/rl/losses.py) against a torch implementation of the same formulas written
here (the way a torch RL trainer computes them): value and gradient w.r.t. the log-probabilities for
every KL estimator x aggregation x clip setting, with masks; the group advantages against NumPy;
the chunked log-prob gather's value and gradient against the whole one; and the gradient of the
loss w.r.t. a tiny model's parameters against transformers + the torch loss on the same weights."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from hf_parity import build_hf_model, compare_grads, hf_state  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.losses.chunked import chunked_target_log_probs  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.llama import qwen3_hf_map as hf_map  # noqa: E402
from MaxText.models.registry import init_params, make_model_def  # noqa: E402
from MaxText.rl import losses  # noqa: E402
from MaxText.rl.step import token_logprobs  # noqa: E402

B, T = 6, 10
CLIPS = {"symmetric": dict(epsilon_low=0.2, epsilon_high=0.2),
         "clip-higher": dict(epsilon_low=0.2, epsilon_high=0.28),
         "dual-clip": dict(epsilon_low=0.2, epsilon_high=0.2, dual_clip=1.5)}


# ---- the torch reference ------------------------------------------------------------------------
def torch_policy_loss(logp, old, ref, adv, mask, *, epsilon_low, epsilon_high, dual_clip=None,
                      beta=0.0, kl_estimator="k3", aggregation="token-mean",
                      max_response_len=None, importance_sampling="token"):
  adv = adv[:, None] if adv.dim() == 1 else adv
  log_ratio = logp - old.detach()
  if importance_sampling == "sequence":   # GSPO, as TRL's importance_sampling_level="sequence"
    log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
  ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
  pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high))
  if dual_clip is not None:
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
  diff = logp - ref
  kl = {"k1": diff, "k2": 0.5 * diff ** 2, "k3": torch.exp(-diff) + diff - 1}[kl_estimator]
  loss = pg + beta * kl
  per_row, count = (loss * mask).sum(-1), mask.sum(-1)
  if aggregation == "token-mean":
    return per_row.sum() / count.sum()
  rows = (count > 0)
  if aggregation == "seq-mean-token-mean":
    per_row = per_row[rows] / count[rows]
  elif aggregation == "seq-mean-token-sum":
    per_row = per_row[rows]
  else:
    per_row = per_row[rows] / (max_response_len or logp.shape[-1])
  return per_row.mean()


def inputs(seed=0, per_token_adv=False):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.05, 4.0, (B, T)).astype(np.float32)
  old = (logp + rng.normal(0, 0.35, (B, T))).astype(np.float32)   # ratios on both sides of clips
  ref = (logp + rng.normal(0, 0.5, (B, T))).astype(np.float32)
  adv = rng.normal(0, 1.0, (B, T) if per_token_adv else (B,)).astype(np.float32)
  mask = np.zeros((B, T), np.float32)
  for b, n in enumerate([T, 7, 3, 1, 0, 5]):     # a full row, short ones and a row without tokens
    mask[b, T - n if b % 2 else 0:][:n] = 1.0
  return logp, old, ref, adv, mask


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


CASES = list(itertools.product(losses.KL_ESTIMATORS, losses.AGGREGATIONS, CLIPS))


@pytest.mark.parametrize("estimator,aggregation,clip", CASES)
def test_loss_and_grad_equal_torch(estimator, aggregation, clip):
  logp, old, ref, adv, mask = inputs()
  kw = dict(CLIPS[clip], beta=0.05, kl_estimator=estimator, aggregation=aggregation,
            max_response_len=16 if aggregation == "seq-mean-token-scale" else None)

  def ours(lp):
    return losses.policy_loss(lp, old, ref, adv, mask, **kw)

  (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logp))
  t = {k: torch.tensor(v, dtype=torch.float64) for k, v in
       dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask).items()}
  t["logp"].requires_grad_(True)
  want = torch_policy_loss(t["logp"], t["old"], t["ref"], t["adv"], t["mask"], **kw)
  want.backward()
  want_grad = t["logp"].grad.numpy()
  # fp32 against float64: a few ulps of each term, summed over at most B*T terms
  assert abs(float(loss) - want.item()) <= 1e-6 * max(1.0, abs(want.item())), (float(loss), want)
  assert rel(grad, want_grad) <= 1e-6, rel(grad, want_grad)
  assert np.all(np.asarray(grad)[mask == 0] == 0)           # masked tokens get no gradient
  # the inputs exercise the clips: some tokens clipped on each side, some not
  ratio = np.exp(logp - old)[mask > 0]
  assert (ratio < 0.8).any() and (ratio > 1.28).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
  assert 0 < float(metrics["clip_frac_low"]) < 1 and 0 < float(metrics["clip_frac_high"]) < 1
  assert float(metrics["ratio_min"]) == pytest.approx(ratio.min(), rel=1e-6)
  assert float(metrics["kl"]) == pytest.approx(
      float(losses.kl_penalty(logp, ref, estimator)[mask > 0].mean()), rel=1e-5)


@pytest.mark.parametrize("aggregation,clip", list(itertools.product(losses.AGGREGATIONS, CLIPS)))
def test_gspo_sequence_ratio_loss_and_grad_equal_torch(aggregation, clip):
  """GSPO (importance_sampling="sequence"): one ratio per row, exp of its masked mean log-ratio,
  clipped as a whole; rows shifted so that some are clipped below, some above, some not."""
  logp, old, ref, adv, mask = inputs(seed=5)
  shift = np.array([0.6, -0.6, -0.2, -0.4, 0.0, 0.5], np.float32)[:, None]   # per-row drift
  old = (old - shift).astype(np.float32)
  kw = dict(CLIPS[clip], beta=0.05, aggregation=aggregation, importance_sampling="sequence",
            max_response_len=16 if aggregation == "seq-mean-token-scale" else None)
  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: losses.policy_loss(lp, old, ref, adv, mask, **kw), has_aux=True)(
          jnp.asarray(logp))
  t = {k: torch.tensor(v, dtype=torch.float64) for k, v in
       dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask).items()}
  t["logp"].requires_grad_(True)
  want = torch_policy_loss(t["logp"], t["old"], t["ref"], t["adv"], t["mask"], **kw)
  want.backward()
  assert abs(float(loss) - want.item()) <= 1e-6 * max(1.0, abs(want.item())), (float(loss), want)
  assert rel(grad, t["logp"].grad.numpy()) <= 1e-6
  seq_ratio = np.exp((((logp - old) * mask).sum(-1) / np.maximum(mask.sum(-1), 1)))[mask.sum(-1) > 0]
  assert (seq_ratio < 0.8).any() and (seq_ratio > 1.3).any() and \
      ((seq_ratio > 0.8) & (seq_ratio < 1.2)).any()
  assert float(metrics["ratio_min"]) == pytest.approx(seq_ratio.min(), rel=1e-5)
  assert float(metrics["ratio_max"]) == pytest.approx(seq_ratio.max(), rel=1e-5)
  token = losses.policy_loss(jnp.asarray(logp), old, ref, adv, mask,
                             **{**kw, "importance_sampling": "token"})[0]
  assert abs(float(token) - float(loss)) > 1e-3   # the sequence ratio is not the token one


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_per_token_advantages_and_no_kl(beta):
  logp, old, ref, adv, mask = inputs(seed=3, per_token_adv=True)
  kw = dict(epsilon_low=0.2, epsilon_high=0.3, beta=beta, aggregation="seq-mean-token-mean")
  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: losses.policy_loss(lp, old, ref if beta else None, adv, mask, **kw),
      has_aux=True)(jnp.asarray(logp))
  t = {k: torch.tensor(v, dtype=torch.float64) for k, v in
       dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask).items()}
  t["logp"].requires_grad_(True)
  want = torch_policy_loss(t["logp"], t["old"], t["ref"], t["adv"], t["mask"], **kw)
  want.backward()
  assert abs(float(loss) - want.item()) <= 1e-6 * max(1.0, abs(want.item()))
  assert rel(grad, t["logp"].grad.numpy()) <= 1e-6
  assert ("kl" in metrics) == bool(beta)


def test_on_policy_ratio_is_one_and_the_clamp_keeps_the_loss_finite():
  logp, _, ref, adv, mask = inputs()
  _, m = losses.policy_loss(logp, logp, ref, adv, mask)
  assert float(m["ratio_mean"]) == 1.0 and float(m["clip_frac_low"]) == 0 == float(m["clip_frac_high"])
  far = logp + 200.0   # exp(200) overflows fp32 without the clamp
  loss, grad = jax.value_and_grad(lambda lp: losses.policy_loss(lp, logp, ref, -np.abs(adv), mask,
                                                                dual_clip=None)[0])(far)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
  with pytest.raises(ValueError, match="dual_clip"):
    losses.policy_loss(logp, logp, ref, adv, mask, dual_clip=0.5)
  with pytest.raises(ValueError, match="kl_estimator"):
    losses.policy_loss(logp, logp, ref, adv, mask, kl_estimator="k4")


# ---- advantages ---------------------------------------------------------------------------------
def test_group_advantages_against_numpy():
  rng = np.random.default_rng(0)
  G = 4
  r = rng.normal(size=(3, G)).astype(np.float32)
  r[1] = 0.7                                         # a group without signal
  got = {e: np.asarray(losses.group_advantages(r.reshape(-1), G, e)).reshape(3, G)
         for e in losses.ADVANTAGE_ESTIMATORS}
  mean, std = r.mean(1, keepdims=True), r.std(1, ddof=1, keepdims=True)
  np.testing.assert_allclose(got["grpo"][[0, 2]], ((r - mean) / (std + 1e-4))[[0, 2]], rtol=1e-5)
  assert np.all(got["grpo"][1] == 0)
  np.testing.assert_allclose(got["drgrpo"], r - mean, atol=1e-6)
  loo = np.stack([r[:, i] - np.delete(r, i, axis=1).mean(1) for i in range(G)], 1)
  np.testing.assert_allclose(got["rloo"], loo, atol=1e-6)


def test_grpo_group_of_two_with_equal_rewards_is_zero_not_nan():
  # groups of 2: equal rewards (std 0), rewards equal up to rounding, and a real difference
  r = np.array([1.0, 1.0, 0.1 + 0.2, 0.3, 0.0, 1.0], np.float32)
  adv = np.asarray(losses.group_advantages(r, 2, "grpo"))
  assert np.all(np.isfinite(adv))
  assert np.all(adv[:4] == 0)
  assert adv[4] < 0 < adv[5]
  with pytest.raises(ValueError, match="group_size=1"):
    losses.group_advantages(r, 1)


# ---- the log-prob gather --------------------------------------------------------------------------
MODEL = ["emb_dim=32", "num_decoder_layers=1", "num_query_heads=2", "num_kv_heads=1", "head_dim=8",
         "mlp_dim=48", "vocab_size=300", "max_target_length=24", "init_std=0.5"]


def test_chunked_gather_value_and_gradient_equal_the_plain_gather():
  mcfg = ModelConfig.from_config(load_config([BASE_YML, *MODEL]))
  model_def = make_model_def(mcfg)
  params = init_params(mcfg, 0)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 300, (2, 24)).astype(np.int32)
  targets = rng.integers(0, 300, (2, 24)).astype(np.int32)
  pos = np.broadcast_to(np.arange(24, dtype=np.int32), (2, 24))
  seg = np.ones((2, 24), np.int32)
  w = rng.normal(size=(2, 24)).astype(np.float32)

  def weighted(p, chunk):
    hidden, _ = model_def.apply_hidden(p, tokens, pos, seg)
    if chunk:
      logp = chunked_target_log_probs(model_def.head, p, hidden, targets, chunk)
    else:   # the plain gather: the whole [B, T, V] log-softmax
      logp_BTV = jax.nn.log_softmax(model_def.head(p, hidden), axis=-1)
      logp = jnp.take_along_axis(logp_BTV, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(w * logp), logp

  grad = jax.jit(jax.value_and_grad(weighted, has_aux=True), static_argnums=1)
  (v0, lp0), g0 = grad(params, 0)
  (v1, lp1), g1 = grad(params, 7)          # 4 chunks, the last one padded
  np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp0), rtol=1e-6, atol=1e-6)
  for (path, a), b in zip(jax.tree.leaves_with_path(g0), jax.tree.leaves(g1)):
    assert rel(b, a) < 1e-6, (jax.tree_util.keystr(path), rel(b, a))


def test_chunked_gather_does_not_hold_the_fp32_logits():
  """The gradient of the policy loss through the chunked gather (GRPO's step) keeps one chunk's
  fp32 logits at a time: with V = 16384 the whole-sequence version's temporary memory exceeds
  the chunked one's by most of the [B, S, V] fp32 logits."""
  V, S = 16384, 256
  keys = dict(kv.split("=", 1) for kv in [*MODEL, f"vocab_size={V}", f"max_target_length={S}"])
  mcfg = ModelConfig.from_config(load_config([BASE_YML, *(f"{k}={v}" for k, v in keys.items())]))
  model_def = make_model_def(mcfg)
  params = model_def.abstract_params   # lowered and compiled only: the shapes, no values
  z = np.zeros((2, S), np.int32)
  batch = {"inputs": z, "targets": z, "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (2, S)),
           "segments": z + 1}
  f32 = np.zeros((2, S), np.float32)

  def temp_bytes(chunk):
    def loss(p):
      logp = token_logprobs(model_def, p, batch, chunk)
      return losses.policy_loss(logp, f32, f32, jnp.ones(2), f32 + 1, beta=0.1)[0]
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = 2 * S * V * 4
  whole, chunked = temp_bytes(0), temp_bytes(S // 8)
  assert whole > logits_bytes
  assert whole - chunked > 0.75 * logits_bytes, (whole, chunked, logits_bytes)


# ---- the loss's gradient w.r.t. a model's parameters, against transformers ------------------------
@functools.lru_cache(maxsize=None)
def tiny_qwen3():
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny", "rope_theta=1000", "scan_layers=true"])
  model = build_hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                         hf_map.config_to_hf(cfg))
  cfg = replace(cfg, **hf_map.config_from_hf(model.config.to_dict()))
  mcfg = ModelConfig.from_config(cfg)
  return model, mcfg, make_model_def(mcfg), hf_map.hf_to_params(hf_state(model), mcfg)


def test_loss_gradient_wrt_parameters_equals_transformers_plus_torch_loss():
  model, mcfg, model_def, params = tiny_qwen3()
  S = 12
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, mcfg.vocab_size, (3, S + 1))
  inputs_, targets = tokens[:, :-1], tokens[:, 1:]
  mask = np.zeros((3, S), np.float32)
  mask[0, 4:] = 1
  mask[1, 6:10] = 1
  mask[2, 2:] = 1
  with torch.no_grad():
    logits = model(input_ids=torch.tensor(inputs_), use_cache=False).logits.double()
    lp_now = torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[..., None])[..., 0]
  old = (lp_now.numpy() + rng.normal(0, 0.3, (3, S))).astype(np.float32)
  ref = (lp_now.numpy() + rng.normal(0, 0.3, (3, S))).astype(np.float32)
  adv = np.array([1.2, -0.7, -1.5], np.float32)
  kw = dict(epsilon_low=0.2, epsilon_high=0.28, dual_clip=2.0, beta=0.1, kl_estimator="k3",
            aggregation="seq-mean-token-mean")

  model.zero_grad()
  logits = model(input_ids=torch.tensor(inputs_), use_cache=False).logits
  lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(targets)[..., None])[..., 0]
  want = torch_policy_loss(lp, torch.tensor(old), torch.tensor(ref), torch.tensor(adv),
                           torch.tensor(mask), **kw)
  want.backward()
  want_grads = hf_map.hf_to_params({k: p.grad.numpy().copy() for k, p in model.named_parameters()},
                                   mcfg)

  pos, seg = np.broadcast_to(np.arange(S), (3, S)), np.ones((3, S), np.int32)

  def loss_fn(p):
    hidden, _ = model_def.apply_hidden(p, jnp.asarray(inputs_, jnp.int32), jnp.asarray(pos),
                                       jnp.asarray(seg))
    logp = chunked_target_log_probs(model_def.head, p, hidden, jnp.asarray(targets, jnp.int32), 5)
    return losses.policy_loss(logp, old, ref, adv, mask, **kw)[0]

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  assert abs(float(loss) - want.item()) <= 1e-4 * max(1.0, abs(want.item()))
  compare_grads(grads, want_grads)


# ---- DAPO: dynamic sampling and overlong shaping ---------------------------------------------------
def test_overlong_penalty_is_dapos_piecewise_formula():
  """DAPO (Yu et al. 2025, eq. 13): 0 for |y| <= L_max - L_cache, (L_max - L_cache - |y|) / L_cache
  up to L_max, -1 beyond."""
  L_max, L_cache = 16, 4
  lengths = np.arange(0, 20)
  want = [0.0 if n <= L_max - L_cache else (L_max - L_cache - n) / L_cache if n <= L_max else -1.0
          for n in lengths]
  np.testing.assert_allclose(losses.overlong_penalty(lengths, L_max, L_cache), want, atol=1e-12)


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_dynamic_sampling_equals_the_loss_over_the_informative_groups_only(aggregation):
  """Masking out the groups whose rewards are all equal gives the loss (value and gradient) of the
  batch without those groups, computed by the torch reference on the kept rows alone."""
  logp, old, ref, _, mask = inputs(seed=7)
  rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], np.float32)   # groups of 2: one all-equal
  keep = losses.informative_rows(rewards, 2)
  assert keep.tolist() == [False, False, True, True, False, False]
  adv = np.asarray(losses.group_advantages(rewards, 2))
  kw = dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.05, aggregation=aggregation,
            max_response_len=16 if aggregation == "seq-mean-token-scale" else None)
  dropped = mask * keep[:, None]
  (loss, _), grad = jax.value_and_grad(
      lambda lp: losses.policy_loss(lp, old, ref, adv, dropped, **kw), has_aux=True)(
          jnp.asarray(logp))
  t = {k: torch.tensor(v[keep], dtype=torch.float64) for k, v in
       dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask).items()}
  t["logp"].requires_grad_(True)
  want = torch_policy_loss(t["logp"], t["old"], t["ref"], t["adv"], t["mask"], **kw)
  want.backward()
  assert abs(float(loss) - want.item()) <= 1e-6 * max(1.0, abs(want.item())), (float(loss), want)
  assert rel(np.asarray(grad)[keep], t["logp"].grad.numpy()) <= 1e-6
  assert not np.asarray(grad)[~keep].any()
  whole = losses.policy_loss(jnp.asarray(logp), old, ref, adv, mask, **kw)[0]
  assert abs(float(whole) - float(loss)) > 1e-4   # without dropping, the equal groups dilute it
