"""Shared pieces of the per-family parity tests against Hugging Face transformers (the oracle):
a batch with one plain row and one packed row, HF run per document, our logits, per-token KL, and
loss + gradients on both sides (torch autograd vs jax.grad) compared parameter by parameter."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

S, DOC1 = 12, 5          # row 0: one document of S tokens; row 1: documents [0, DOC1) and [DOC1, S)
TOL_LOGIT, TOL_KL, TOL_GRAD = 1e-4, 1e-6, 1e-4


def batch(vocab: int):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, size=(2, S))
  pos = np.stack([np.arange(S), np.concatenate([np.arange(DOC1), np.arange(S - DOC1)])])
  seg = np.stack([np.ones(S, int), np.concatenate([np.full(DOC1, 1), np.full(S - DOC1, 2)])])
  return tokens, pos, seg


def documents():
  """(row, slice) of every document of the batch — what HF runs one at a time."""
  return [(0, slice(0, S)), (1, slice(0, DOC1)), (1, slice(DOC1, S))]


def build_hf_model(config_cls, model_cls, config: dict, *, perturb=("norm.weight",),
                   perturb_buffers=()):
  """A random-init HF model (fp32, eager attention, seed 0) from `config`; parameters (and
  buffers) whose names end with `perturb` (`perturb_buffers`) are set to 1 + 0.3 N(0, 1), so that a
  scale and its `1 + w` variant, or a forgotten factor, cannot look alike."""
  import torch
  cfg = config_cls(**config, initializer_range=0.2, attn_implementation="eager")
  torch.manual_seed(0)
  model = model_cls(cfg).float().eval()
  assert model.config._attn_implementation == "eager"
  with torch.no_grad():
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
      if name.endswith(perturb) or (perturb_buffers and name.endswith(perturb_buffers)):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
  return model


def check_round_trip(hf_map, mcfg, model_def, params, sd) -> None:
  """Our params have the model's shapes and dtypes; params_to_hf gives back every HF tensor of
  `sd` exactly (the head included even when tied), and hf_names lists exactly those names."""
  shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), t)
  assert shapes(params) == shapes(model_def.abstract_params)
  back = hf_map.params_to_hf(params, mcfg, tied_lm_head=True)
  assert back.keys() == sd.keys()
  for k in sd:
    assert back[k].dtype == sd[k].dtype and np.array_equal(back[k], sd[k]), k
  assert sorted(hf_map.hf_names(mcfg, tied_lm_head=True)) == sorted(sd)


def hf_state(model) -> dict[str, np.ndarray]:
  return {k: v.detach().float().numpy().copy() if v.dtype.is_floating_point else v.numpy().copy()
          for k, v in model.state_dict().items()}


def hf_logits(model, tokens) -> np.ndarray:
  import torch
  out = np.zeros((*tokens.shape, model.config.vocab_size), np.float32)
  with torch.no_grad():
    for row, sl in documents():
      ids = torch.tensor(tokens[row:row + 1, sl])
      out[row, sl] = model(input_ids=ids, use_cache=False).logits[0].float().numpy()
  return out


_FORWARD: list = [None, None]   # (model def, its jitted apply): the last one asked for


def _forward(model_def):
  """model_def.apply jitted, the same jitted function again for the same model def (by identity):
  check_logits' second call and a later test's forward of the same model reuse its trace and
  lowering. One kept: a test file's models are not all held alive."""
  if _FORWARD[0] is not model_def:
    _FORWARD[:] = [model_def, jax.jit(model_def.apply)]
  return _FORWARD[1]


def our_logits(model_def, params, tokens, pos, seg) -> np.ndarray:
  fn = _forward(model_def)
  return np.asarray(fn(params, *(jnp.asarray(a, jnp.int32) for a in (tokens, pos, seg))))


def kl(p_logits, q_logits) -> np.ndarray:
  """Per-token KL(p || q) in float64."""
  def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), -1, keepdims=True))
  lp, lq = log_softmax(p_logits), log_softmax(q_logits)
  return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def check_logits(model_def, params, hf_model, vocab: int, *, tol_logit=TOL_LOGIT, tol_kl=TOL_KL):
  """Our logits on the batch against HF run per document; returns (max |Δ|, max KL)."""
  tokens, pos, seg = batch(vocab)
  got = our_logits(model_def, params, tokens, pos, seg)
  want = hf_logits(hf_model, tokens)
  scale = np.abs(want).max()
  assert scale > 1.0
  err, div = float(np.abs(got - want).max()), float(kl(want, got).max())
  print(f"max|Δlogit|={err:.2e} (max|logit|={scale:.2f}) max KL={div:.2e}")
  assert err <= tol_logit * scale, (err, scale)
  assert div <= tol_kl, div
  # it is a real test: the packed row run as one long document would not match (run as both rows
  # of a batch of the same [2, S] shape: the program above, not a second one to compile)
  merged = our_logits(model_def, params, tokens[[1, 1]], np.broadcast_to(np.arange(S), (2, S)),
                      np.ones((2, S), int))
  assert np.abs(merged[0, DOC1:] - want[1, DOC1:]).max() > 100 * TOL_LOGIT * scale
  return err, div


def hf_loss_and_grads(model, tokens, targets, *, float64: bool = False
                      ) -> tuple[float, dict[str, np.ndarray]]:
  """Mean cross-entropy over all tokens, every document run on its own; grads by HF name. With
  `float64`, a float64 copy of the model computes them (the exact values both fp32 sides are
  judged against; the model itself is left as it is)."""
  import copy
  import torch
  if float64:
    model = copy.deepcopy(model).double()
    if getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0):
      model.set_experts_implementation("eager")   # torch's grouped_mm has no float64 kernel
  model.zero_grad()
  total = 0.0
  for row, sl in documents():
    logits = model(input_ids=torch.tensor(tokens[row:row + 1, sl]), use_cache=False).logits[0]
    total = total + torch.nn.functional.cross_entropy(
        logits, torch.tensor(targets[row, sl]), reduction="sum")
  loss = total / tokens.size
  loss.backward()
  return loss.item(), {k: p.grad.numpy().copy() for k, p in model.named_parameters()}


def our_loss_and_grads(model_def, params, tokens, pos, seg, targets):
  def loss_fn(p):
    logits = model_def.apply(p, *(jnp.asarray(a, jnp.int32) for a in (tokens, pos, seg)))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1))
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  return float(loss), grads


def compare_grads(grads, want_tree, *, frozen: tuple[str, ...] = (), exact_tree=None) -> float:
  """Each of our gradients against the reference's (relative to that tensor's max |grad|).
  Parameters whose path ends with one of `frozen` (HF buffers) must have exactly zero gradient.

  With `exact_tree` (the reference's gradients in float64, `hf_loss_and_grads(float64=True)`) both
  fp32 sides are judged against the exact values: ours may be off them by TOL_GRAD or by twice the
  reference's own fp32 error on that tensor, whichever is larger. A flat TOL_GRAD against the fp32
  reference alone does not hold on every CPU: a gradient that is a sum with much cancellation
  (Qwen3-Next's first norm scale, through the gated delta rule) carries each side's reduction
  order amplified by that cancellation, and the order is the CPU's (its matmul blocking, its
  vector width). The reference's own error is measured, not ours, so a bug of ours cannot widen
  the bound; twice it leaves room for our own order on a CPU where ours is the noisier one."""
  worst = 0.0
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    name = "/".join(str(k.key) for k in path)
    g = np.asarray(g, np.float64)
    if name.endswith(frozen):
      assert not np.any(g), name
      continue
    want = np.asarray(functools.reduce(lambda t, k: t[k.key], path, want_tree), np.float64)
    scale = np.abs(want).max()
    assert scale > 0, name
    if exact_tree is None:
      err, tol = np.abs(g - want).max() / scale, TOL_GRAD
    else:
      exact = np.asarray(functools.reduce(lambda t, k: t[k.key], path, exact_tree), np.float64)
      err = np.abs(g - exact).max() / scale
      tol = max(TOL_GRAD, 2 * np.abs(want - exact).max() / scale)
    worst = max(worst, err)
    assert err <= tol, (name, err, tol)
  print(f"max grad error (relative to each tensor's max |grad|) = {worst:.1e}")
  return worst
