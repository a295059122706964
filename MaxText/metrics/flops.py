"""Analytic training FLOPs for a dense decoder-only transformer.

The model is a Llama/Qwen style decoder: every layer has grouped-query
attention (q, k, v and o projections), a SwiGLU MLP built from
``num_mlp_matrices`` weight matrices (3 for gate/up/down), and RMSNorm
scales; an LM head maps the final hidden state to the vocabulary.

Notation: ``T = global_batch * seq_len`` tokens per step, ``D = emb_dim``,
``H = num_query_heads``, ``K = num_kv_heads``, ``h = head_dim``,
``F = mlp_dim``, ``V = vocab_size``, ``L = num_decoder_layers``, ``S = seq_len``,
``B = global_batch``.

Matmul parameters (weights that take part in a matrix multiply)::

    attention  = D*H*h (q) + 2 * D*K*h (k, v) + H*h*D (o)
    mlp        = num_mlp_matrices * D*F
    lm_head    = D*V          (counted whether or not it is tied)
    N_matmul   = L * (attention + mlp) + lm_head

The embedding lookup is a gather, so it costs no FLOPs; norms, activations,
softmax and the loss are elementwise and are ignored.

Weight FLOPs: a matmul with N parameters costs 2*N FLOPs per token forward
and 4*N backward (gradient w.r.t. inputs and weights), so::

    matmul_flops = 6 * N_matmul * T

Attention-score FLOPs (QK^T and softmax(QK^T)V, which involve no weights),
per layer, forward: ``2 * 2 * B * S * S * H * h``. Forward plus backward is
three times that, and a causal mask is counted as halving it (only the
lower triangle is useful work), the same convention MaxText uses::

    attention_flops = 3 * 4 * B * S^2 * H * h * L   (/ 2 when causal)

    total_flops = matmul_flops + attention_flops

Activation recomputation (remat) is deliberately NOT counted: it is extra
work the hardware does, not useful model FLOPs, so MFU stays comparable
across remat policies.  The result is per step for the whole global batch;
divide by the number of devices for a per-device figure.
"""

from __future__ import annotations

from MaxText.models.model_config import ModelConfig


def matmul_param_count(m: ModelConfig, *, num_mlp_matrices: int = 3) -> int:
  """Parameters that take part in a matmul in the forward pass: q/k/v/o, the MLP matrices and the
  LM head (D*V); not the input embedding table (only gathered from) nor the norm scales."""
  attn = (2 * m.num_query_heads + 2 * m.num_kv_heads) * m.emb_dim * m.head_dim
  mlp = num_mlp_matrices * m.emb_dim * m.mlp_dim
  return m.num_decoder_layers * (attn + mlp) + m.emb_dim * m.vocab_size


def total_param_count(m: ModelConfig, *, num_mlp_matrices: int = 3) -> int:
  """All trainable parameters: matmul weights, the input embedding table unless tied to the head,
  and the RMSNorm scales (two per layer plus the final norm)."""
  norms = (2 * m.num_decoder_layers + 1) * m.emb_dim
  input_embedding = 0 if m.tie_word_embeddings else m.vocab_size * m.emb_dim
  return matmul_param_count(m, num_mlp_matrices=num_mlp_matrices) + norms + input_embedding


def training_flops_per_step(m: ModelConfig, *, seq_len: int, global_batch: int, causal: bool = True,
                            num_mlp_matrices: int = 3) -> dict:
  """Model FLOPs of one training step (forward + backward) over the global batch.

  Returns ``total``, ``matmul`` (6 * matmul_params * tokens), ``attention`` (QK^T and AV, fwd+bwd,
  halved when causal), ``matmul_params``, ``tokens`` and ``tflops`` (= total / 1e12). Tying the LM
  head to the embedding does not change the count: the logits matmul is done either way.
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
  # Per layer, forward: QK^T and AV each cost 2*B*S*S*H*h.
  attention_fwd = 2 * 2 * global_batch * seq_len * seq_len * m.num_query_heads * m.head_dim
  attention = 3.0 * attention_fwd * m.num_decoder_layers
  if causal:
    attention /= 2
  total = matmul + attention
  return {"total": total, "matmul": matmul, "attention": attention, "matmul_params": params,
          "tokens": tokens, "tflops": total / 1e12}
