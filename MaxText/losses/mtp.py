"""The multi-token-prediction loss (MaxText/layers/mtp.py): depth k's hidden state at position t
predicts the token k+1 ahead, targets[t + k], through the model's shared head.

A position counts for depth k when targets[t + k] is a real target of the same packed document
(targets_segmentation[t + k] != 0 and inputs_segmentation[t + k] == inputs_segmentation[t]).
Per depth the loss is a sum over those tokens (the token loss's chunked or whole-sequence
cross-entropy, no z-loss); the train step adds

    mtp_loss_scale / depths · Σ_k nll_sum_k

to the summed cross-entropy it divides by the step's token count (DeepSeek-V3's λ/D Σ_k L_k,
each depth's sum taken over the step's tokens), and logs `mtp_loss` = the mean over depths of
each depth's own per-token cross-entropy (nll_sum_k / its tokens) with `mtp_loss/depth_k`.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from MaxText.layers.mtp import shifted
from MaxText.losses.chunked import chunked_cross_entropy_sums
from MaxText.models.family import AuxTerms, StepWatch
from MaxText.models.model_def import ModelDef


def depth_targets(micro: dict, k: int) -> tuple[jax.Array, jax.Array]:
  """(the targets depth k predicts at each position [B, S], which of them count [B, S])."""
  seg_BS = micro["inputs_segmentation"]
  mask_BS = ((shifted(micro["targets_segmentation"], k) != 0)
             & (shifted(seg_BS, k, fill=-1) == seg_BS))
  return shifted(micro["targets"], k), mask_BS


def mtp_sums(model_def: ModelDef, params, hidden_KBSD: jax.Array, micro: dict, *,
             chunk: int) -> tuple[jax.Array, jax.Array]:
  """(cross-entropy sum per depth [K], counted tokens per depth [K]) of the depths' final-norm
  hidden states [K, B, S, D] through the model's head (chunk by chunk when `chunk` > 0)."""
  nll, count = [], []
  for j in range(hidden_KBSD.shape[0]):
    targets_BS, mask_BS = depth_targets(micro, j + 1)
    s, _, n = chunked_cross_entropy_sums(model_def.head, params, hidden_KBSD[j], targets_BS,
                                         mask_BS, 0.0, chunk, model_def.logical_axes)
    nll.append(s)
    count.append(n)
  return jnp.stack(nll), jnp.stack(count)


@dataclass(frozen=True)
class _Watch:
  """The MTP loss on the progress line, before the family's own part (`inner`)."""
  inner: StepWatch | None = None

  def progress(self, metrics: dict) -> str:
    own = f"mtp {metrics['mtp_loss']:.4f}" if "mtp_loss" in metrics else ""
    theirs = self.inner.progress(metrics) if self.inner is not None else ""
    return " | ".join(p for p in (own, theirs) if p)

  def update(self, step: int, metrics: dict) -> str | None:
    return self.inner.update(step, metrics) if self.inner is not None else None


@dataclass(frozen=True)
class MTPTerms:
  """The MTP loss as the step's auxiliary terms (models/family.py: AuxTerms), around the family's
  own (`inner`, e.g. routed experts' balancing; None: none). Reads aux["mtp_sums"]
  (losses/token_loss.py puts it there)."""
  scale: float
  depths: int
  inner: AuxTerms | None = None

  def loss(self, aux: dict):
    nll_K, n_K = aux["mtp_sums"]
    extra, sums = (jnp.float32(0.0), {}) if self.inner is None else self.inner.loss(aux)
    return (extra + self.scale / self.depths * jnp.sum(nll_K),
            {**sums, "mtp_nll": nll_K, "mtp_tokens": n_K})

  def update(self, params: dict, sums: dict) -> dict:
    return params if self.inner is None else self.inner.update(params, sums)

  def metrics(self, sums: dict, tokens) -> dict:
    per_depth = sums["mtp_nll"] / jnp.maximum(sums["mtp_tokens"], 1.0)
    out = {} if self.inner is None else dict(self.inner.metrics(sums, tokens))
    out["mtp_loss"] = jnp.mean(per_depth)
    out.update({f"mtp_loss/depth_{k + 1}": per_depth[k] for k in range(self.depths)})
    return out

  def watch(self):
    return _Watch(None if self.inner is None else self.inner.watch())


def with_mtp(inner: AuxTerms | None, scale: float, depths: int) -> AuxTerms | None:
  """The step's auxiliary terms: the family's, plus the MTP loss when it is trained."""
  return MTPTerms(scale, depths, inner) if scale > 0 and depths > 0 else inner
