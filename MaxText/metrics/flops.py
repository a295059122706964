"""Analytic training FLOPs of a decoder-only transformer, layer by layer.

Every layer has attention (q, k, v, o projections; grouped-query) and a gated MLP of
``num_mlp_matrices`` weight matrices (3 for gate/up/down); an LM head maps the final hidden state to
the vocabulary. Per-layer variants come from the generic ModelConfig keys, so any family is counted
the same way: a layer's kind (sliding/full) sets its head width and kv heads; kv-shared layers have
no k/v projections (and a 2x MLP with ``double_wide_mlp_on_shared``); full layers with
``attention_k_eq_v`` have no v projection; per-layer inputs (PLE) add a gate and a projection per
layer plus one model projection D x L*P.

Notation: ``T = global_batch * seq_len`` tokens per step, ``D = emb_dim``, ``H`` query heads, and
per layer ``K`` kv heads and ``E`` head width; ``F = mlp_dim``, ``V = vocab_size``, ``S = seq_len``,
``B = global_batch``.

Matmul parameters (weights that take part in a matrix multiply)::

    attention  = D*H*E (q) + D*K*E (k) + D*K*E (v) + H*E*D (o)      (k/v only where they exist)
    mlp        = num_mlp_matrices * D*F
                 (MoE: only the active experts, k * num_mlp_matrices * D*F_expert, plus the
                 router D*E and a shared expert num_mlp_matrices * D*F_shared + D; plus the
                 dense MLP in families whose experts add to it, e.g. Gemma 4)
    lm_head    = D*V          (counted whether or not it is tied)
    N_matmul   = sum over layers (attention + mlp [+ 2*D*P]) + lm_head [+ D*L*P]

The embedding lookups are gathers, so they cost no FLOPs; norms, activations, softmax and the loss
are elementwise and are ignored.

Weight FLOPs: a matmul with N parameters costs 2*N FLOPs per token forward and 4*N backward
(gradient w.r.t. inputs and weights), so::

    matmul_flops = 6 * N_matmul * T

Attention-score FLOPs (QK^T and softmax(QK^T)V, which involve no weights), per layer, forward:
``2 * 2 * B * pairs * H * E`` with ``pairs = S^2`` query-key pairs; a causal mask is counted as
halving it (MaxText's convention, ``S^2 / 2``) and a sliding window W < S as the pairs it admits
(``S*W - W*(W-1)/2``). Forward plus backward is three times that::

    attention_flops = 3 * sum over layers 4 * B * pairs * H * E

    total_flops = matmul_flops + attention_flops

Activation recomputation (remat) is deliberately NOT counted: it is extra work the hardware does,
not useful model FLOPs, so MFU stays comparable across remat policies. The result is per step for
the whole global batch; divide by the number of devices for a per-device figure.
"""

from __future__ import annotations

from MaxText.models.model_config import ModelConfig


def _layers(m: ModelConfig):
  """(layer type, kv-shared) per layer."""
  first_shared = m.first_kv_shared_layer()
  return [(t, i >= first_shared) for i, t in enumerate(m.layer_types())]


def matmul_param_count(m: ModelConfig, *, num_mlp_matrices: int = 3) -> int:
  """Parameters that take part in a matmul in the forward pass: q/k/v/o, the MLP matrices, the
  PLE projections and the LM head (D*V); not the embedding tables (only gathered from) nor the
  norm scales."""
  from MaxText.models.registry import get_family
  D, H, P = m.emb_dim, m.num_query_heads, m.per_layer_input_dim
  dense_too = m.num_experts and get_family(m.decoder_block).moe_adds_to_dense_mlp
  total = D * m.vocab_size + D * m.num_decoder_layers * P
  for kind, shared in _layers(m):
    E, K = m.head_dim_of(kind), m.kv_heads_of(kind)
    k = 0 if shared else D * K * E
    v = 0 if shared or (kind == "full" and m.attention_k_eq_v) else D * K * E
    wide = 2 if shared and m.double_wide_mlp_on_shared else 1
    mlp = num_mlp_matrices * D * m.mlp_dim * wide if dense_too or not m.num_experts else 0
    if m.num_experts:
      mlp += (m.num_experts_per_tok * num_mlp_matrices * D * m.moe_mlp_dim + D * m.num_experts
              + (num_mlp_matrices * D * m.shared_expert_mlp_dim + D if m.shared_expert_mlp_dim else 0))
    total += 2 * D * H * E + k + v + mlp + 2 * D * P
  return total


def total_param_count(m: ModelConfig, *, num_mlp_matrices: int = 3) -> int:
  """Parameters of a dense model without per-layer variants: matmul weights, the input embedding
  table unless tied to the head, and the RMSNorm scales (two per layer plus the final norm)."""
  norms = (2 * m.num_decoder_layers + 1) * m.emb_dim
  input_embedding = 0 if m.tie_word_embeddings else m.vocab_size * m.emb_dim
  return matmul_param_count(m, num_mlp_matrices=num_mlp_matrices) + norms + input_embedding


def training_flops_per_step(m: ModelConfig, *, seq_len: int, global_batch: int, causal: bool = True,
                            num_mlp_matrices: int = 3) -> dict:
  """Model FLOPs of one training step (forward + backward) over the global batch.

  Returns ``total``, ``matmul`` (6 * matmul_params * tokens), ``attention`` (QK^T and AV, fwd+bwd,
  halved when causal, windowed on sliding layers), ``matmul_params``, ``tokens`` and ``tflops``
  (= total / 1e12). Tying the LM head to the embedding does not change the count: the logits
  matmul is done either way.
  """
  for name in ("emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim",
               "mlp_dim", "vocab_size"):
    if getattr(m, name) <= 0:
      raise ValueError(f"{name} must be positive, got {getattr(m, name)}")
  for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
    if value <= 0:
      raise ValueError(f"{name} must be positive, got {value}")
  params = matmul_param_count(m, num_mlp_matrices=num_mlp_matrices)
  tokens = global_batch * seq_len
  matmul = 6.0 * params * tokens
  S, W = seq_len, m.sliding_window
  attention = 0.0
  for kind, _ in _layers(m):
    pairs = S * S / 2 if causal else S * S
    if kind == "sliding" and 0 < W < S:
      pairs = S * W - W * (W - 1) / 2 if causal else min(S * S, S * (2 * W - 1))
    attention += 3.0 * 4 * global_batch * pairs * m.num_query_heads * m.head_dim_of(kind)
  total = matmul + attention
  return {"total": total, "matmul": matmul, "attention": attention, "matmul_params": params,
          "tokens": tokens, "tflops": total / 1e12}
