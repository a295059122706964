"""Analytic training FLOPs, from the two numbers a model family counts for its own layers
(`Family.flops` in MaxText/models/<family>/family.py) — this module knows no family:

  matmul_params            weights a token meets in a matrix multiply on the forward pass: every
                           layer's projections and MLP as that layer really has them (a sliding or
                           kv-shared layer's own shapes, MoE: only the k active experts plus the
                           router), per-layer extras, and the LM head D*V (counted whether or not
                           it is tied: the logits matmul is done either way). Embedding lookups
                           are gathers and cost nothing; norms, activations, softmax and the loss
                           are elementwise and are ignored.
  attention_per_sequence   FLOPs of the token mixing without weights of one sequence on the
                           forward pass, summed over the layers. Softmax attention: the scores
                           (QK^T and softmax(QK^T)V), 4 * pairs * H * E per layer, `pairs` the
                           query-key pairs it admits (`attention_pairs`: S^2 / 2 causal —
                           MaxText's convention — or what a sliding window W leaves,
                           S*W - W*(W-1)/2). Linear attention (the chunked gated delta rule):
                           `gated_delta_flops`, linear in S.

A matmul with N weights costs 2*N FLOPs per token forward and 4*N backward, and the attention
scores cost twice their forward FLOPs backward, so per step of `global_batch` sequences of
`seq_len` tokens (T tokens):

    matmul_flops    = 6 * matmul_params * T
    attention_flops = 3 * global_batch * attention_per_sequence
    towers_flops    = global_batch * towers_per_sequence   (a multimodal family's encoders)
    total           = matmul_flops + attention_flops + towers_flops

Activation recomputation (remat) is deliberately NOT counted: it is extra work the hardware does,
not useful model FLOPs, so MFU stays comparable across remat policies. The result is per step for
the whole global batch; divide by the number of devices for a per-device figure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlopCount:
  matmul_params: int
  attention_per_sequence: float
  # a step's FLOPs per sequence outside its tokens' layers, counted as given (an encoder tower's
  # forward over the media a sequence carries, and its backward when it is trained)
  towers_per_sequence: float = 0.0


def attention_pairs(seq_len: int, *, window: int = 0, causal: bool = True) -> float:
  """Query-key pairs one sequence's attention computes: all S^2, causal S^2 / 2, or with a
  sliding window W < S (keys q-W < k <= q) S*W - W*(W-1)/2 (non-causal: S*(2W-1), at most S^2)."""
  S, W = seq_len, window
  if 0 < W < S:
    return S * W - W * (W - 1) / 2 if causal else min(S * S, S * (2 * W - 1))
  return S * S / 2 if causal else S * S


def attention_score_flops(pairs: float, heads: int, head_dim: int) -> float:
  """QK^T and PV of one layer, forward: 2 matmuls of 2 FLOPs per pair, head and channel."""
  return 4 * pairs * heads * head_dim


def gated_delta_flops(seq_len: int, heads: int, key_dim: int, value_dim: int, chunk: int) -> float:
  """The chunked gated delta rule (MaxText/layers/gated_delta.py) of one layer over one sequence,
  forward, no weights. Per token and (value) head: inside its chunk of C tokens the causal half
  (C/2 pairs) of q·kᵀ and βk·kᵀ (2·K each per pair), of (q kᵀ)·v' (2·V) and of the triangular
  solve for [v | k] (2·(K + V)); across chunks the three state products — read by w, read by q,
  the update kᵀv' — 2·K·V each: C·(3K + 2V) + 6·K·V."""
  C = min(chunk, seq_len)
  return seq_len * heads * (C * (3 * key_dim + 2 * value_dim) + 6 * key_dim * value_dim)


def attention_params(emb_dim: int, heads: int, kv_heads: int, head_dim: int, *, keys: bool = True,
                     values: bool = True) -> int:
  """q and o projections, and the k / v projections where the layer has them."""
  D, E = emb_dim, head_dim
  return 2 * D * heads * E + (D * kv_heads * E if keys else 0) + (D * kv_heads * E if values else 0)


def gated_mlp_params(emb_dim: int, mlp_dim: int) -> int:
  """gate, up and down."""
  return 3 * emb_dim * mlp_dim


def training_flops_per_step(count: FlopCount, *, seq_len: int, global_batch: int) -> dict:
  """Model FLOPs of one training step (forward + backward) over the global batch: `total`,
  `matmul`, `attention`, `matmul_params`, `tokens` and `tflops` (= total / 1e12)."""
  for name, value in (("seq_len", seq_len), ("global_batch", global_batch),
                      ("matmul_params", count.matmul_params)):
    if value <= 0:
      raise ValueError(f"{name} must be positive, got {value}")
  tokens = global_batch * seq_len
  matmul = 6.0 * count.matmul_params * tokens
  attention = 3.0 * global_batch * count.attention_per_sequence
  towers = global_batch * count.towers_per_sequence
  total = matmul + attention + towers
  return {"total": total, "matmul": matmul, "attention": attention, "towers": towers,
          "matmul_params": count.matmul_params, "tokens": tokens, "tflops": total / 1e12}
