"""Qwen3-Next decoder (Hugging Face `qwen3_next`, `Qwen3NextForCausalLM`).

Conventions
  dimension letters: B batch, S query sequence, T key sequence, D model width (emb_dim),
  H query heads, K kv heads (H % K == 0), E head dim, V vocab, L layers.
  Arrays are named by shape (`x_BSD`); parameters carry logical axis names (never mesh axes),
  mapped to the mesh by the `logical_axis_rules` table in configs/base.yml.

Layer i: a token mixer — `attention_pattern` letter l (linear: Gated DeltaNet,
gated_deltanet.py) or f (full: gated attention) — and an MLP: routed experts with a shared expert
behind a sigmoid gate (MaxText/layers/moe.py) when num_experts > 0, i not in mlp_only_layers and
(i + 1) % decoder_sparse_step == 0, else a dense SwiGLU of width mlp_dim.
  x = x + mixer(input_norm(x));   x = x + mlp(post_attention_norm(x))
Every RMSNorm (layer norms, q/k norms, the final norm) is zero-centred: scale 1 + w, w initialised
to 0, normalised and scaled in fp32, cast once. Gated attention: the query projection yields per
head [q (E) | gate (E)]; q/k RMSNorm; RoPE on the first partial_rotary_factor · E channels;
softmax attention; output · sigmoid(gate); o projection. Logits are returned in fp32.

Packed rows: full layers mask by segment ids and take per-document positions; linear layers restart
their conv window and delta-rule state at every document start — a packed row equals its documents
run alone.

The layers run as a pattern stack (MaxText/layers/stack.py), e.g. [linear x 3, full] x 12. MoE
layers carry their routing statistics (returned by `forward_with_aux` as `moe_stats`) and read a
selection bias `router_bias` [MoE layers, E], as in the llama family. Parameter paths:
  scanned    decoder/runs/<run>/<member>/...   (leading axis: the block's repeat)
  unscanned  decoder/layers/<i>/...
With mtp_num_layers > 0 the model also holds the checkpoint's multi-token-prediction block
(`mtp/`: fc [2D, D], pre_fc_norm_embedding, pre_fc_norm_hidden, layers/<j> (a full-attention
layer, its MLP decided as decoder layer j's), norm; zero-centred norms like the rest), laid out as
the released checkpoints' `mtp.*` (hf_map.py). transformers' Qwen3NextForCausalLM never runs it;
our forward is the definition of MaxText/layers/mtp.py (the order vLLM's Qwen3-Next MTP runs:
[embedding | hidden] into fc, the layer, mtp.norm, the shared head), run by the llama lineage's
`mtp_hidden` (training, mtp_loss_scale > 0) and `mtp_extend` (speculative decoding). With
mtp_loss_scale = 0 the block is carried frozen: a fine-tuned model exports the released MTP
weights unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers import sites, stack
from MaxText.layers.attention_ops import attention_op
from MaxText.layers.kv_cache import CacheGroup, KVCache
from MaxText.layers.linear import DenseGeneral, LayerKw
from MaxText.layers.mlp import GatedMLP
from MaxText.layers.moe import RoutedMLP, record
from MaxText.layers.mtp import MTPLayer
from MaxText.layers.norms import RMSNorm
from MaxText.layers.rope import apply_partial_rope
from MaxText.models.llama import model as llama_model
from MaxText.models.model_config import ModelConfig
from MaxText.models.qwen3_next.gated_deltanet import GatedDeltaNet, linear_state
from MaxText.sharding.rules import constrain

LINEAR, FULL = "linear", "full"
DENSE, MOE = "dense", "moe"
ACT_BSD = ("activation_batch", "activation_length", "activation_embed")
ACT_BSHE = ("activation_batch", "activation_length", "activation_heads", None)
ACT_BSKE = ("activation_batch", "activation_length", "activation_kv_heads", None)


@dataclass(frozen=True)
class LayerKind:
  mixer: str   # "linear" | "full"
  mlp: str     # "moe" | "dense"

  def __str__(self) -> str:
    return f"{self.mixer}/{self.mlp}"


def mixer_types(attention_pattern: str, num_layers: int) -> tuple[str, ...]:
  """"linear" or "full" per layer: `attention_pattern` (letters l, f) repeated over the layers."""
  pattern = attention_pattern or "f"
  bad = sorted(set(pattern) - {"l", "f"})
  if bad:
    raise ValueError(f"attention_pattern={attention_pattern!r}: letters must be l (linear) or "
                     f"f (full), got {bad}")
  return tuple(LINEAR if pattern[i % len(pattern)] == "l" else FULL for i in range(num_layers))


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
  return (cfg.num_experts > 0 and i not in cfg.mlp_only_layers
          and (i + 1) % cfg.decoder_sparse_step == 0)


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
  return tuple(LayerKind(m, MOE if is_moe_layer(cfg, i) else DENSE)
               for i, m in enumerate(mixer_types(cfg.attention_pattern, cfg.num_decoder_layers)))


def moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
  return tuple(i for i, kind in enumerate(layer_kinds(cfg)) if kind.mlp == MOE)


def mtp_kind(cfg: ModelConfig, j: int) -> LayerKind:
  """The MTP block's layer j: full attention, its MLP decided as a decoder layer j's."""
  return LayerKind(FULL, MOE if is_moe_layer(cfg, j) else DENSE)


def layer_location(cfg: ModelConfig, i: int) -> tuple[tuple, int | None]:
  """Where HF layer i lives in our params: (path prefix, index on the stacked axis or None)."""
  path, index = stack.location(layer_kinds(cfg), cfg.scan_layers, i)
  return ("decoder", *path), index


def zero_centered_norm(dim: int, cfg: ModelConfig, rngs: nnx.Rngs, **kw) -> RMSNorm:
  return RMSNorm(dim, eps=cfg.norm_epsilon, rngs=rngs, dtype=cfg.compute_dtype,
                 param_dtype=cfg.param_dtype, cast_before_scale=False, zero_centered=True, **kw)


class GatedAttention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H, K, E = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.query = DenseGeneral((D,), (H, 2 * E), ("embed", "heads", "head_dim"), **kw)  # q | gate
    self.key = DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"), **kw)
    self.value = DenseGeneral((D,), (K, E), ("embed", "kv_heads", "head_dim"), **kw)
    self.out = DenseGeneral((H, E), (D,), ("heads", "head_dim", "embed"), **kw)
    self.query_norm = zero_centered_norm(E, cfg, rngs, logical_axis="head_dim")
    self.key_norm = zero_centered_norm(E, cfg, rngs, logical_axis="head_dim")
    self.rope_theta = cfg.rope_theta
    self.rotary_dim = int(E * cfg.partial_rotary_factor)
    self.scale = E ** -0.5
    self.op = attention_op(cfg)
    self.cache = KVCache(K, E, kernel=cfg.decode_attention)

  def _qkv(self, x_BSD, positions_BS):
    """(q, its output gate [B, S, H, E], k, v [B, S, K, E]): q/k normed, partial RoPE."""
    E = self.out.kernel.get_value().shape[1]
    qg_BSH2E = constrain(self.query(x_BSD), ACT_BSHE)
    q_BSHE, gate_BSHE = qg_BSH2E[..., :E], qg_BSH2E[..., E:]
    k_BSKE = constrain(self.key_norm(self.key(x_BSD)), ACT_BSKE)
    v_BSKE = constrain(self.value(x_BSD), ACT_BSKE)
    q_BSHE = apply_partial_rope(self.query_norm(q_BSHE), positions_BS, self.rope_theta,
                                self.rotary_dim)
    k_BSKE = apply_partial_rope(k_BSKE, positions_BS, self.rope_theta, self.rotary_dim)
    return q_BSHE, gate_BSHE, k_BSKE, v_BSKE

  def _output(self, o_BSHE, gate_BSHE):
    o_BSHE = constrain(o_BSHE * jax.nn.sigmoid(gate_BSHE), ACT_BSHE)
    return constrain(self.out(o_BSHE), ACT_BSD)

  def __call__(self, x_BSD, positions_BS, segment_ids_BS):
    q_BSHE, gate_BSHE, k_BSKE, v_BSKE = self._qkv(x_BSD, positions_BS)
    o_BSHE = self.op(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, scale=self.scale)
    return self._output(o_BSHE, gate_BSHE)

  def extend(self, x_BSD, positions_BS, valid_BS, prefill: bool, group: dict | None, index):
    """Decoding, as the llama family's attention: the new K/V stored in row `index` of the cache
    `group` (None: no cache); a prefill attends within the prompts with the training op, a step
    over the cache after its write. Returns (output, group)."""
    q_BSHE, gate_BSHE, k_BSKE, v_BSKE = self._qkv(x_BSD, positions_BS)
    o_BSHE, group = self.cache.extend(group, index, self.op, q_BSHE, k_BSKE, v_BSKE, positions_BS,
                                      valid_BS, prefill=prefill, scale=self.scale)
    return self._output(o_BSHE, gate_BSHE), group


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs):
    kw = LayerKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.input_norm = zero_centered_norm(cfg.emb_dim, cfg, rngs)
    if kind.mixer == LINEAR:
      self.linear_attn, self.attn = GatedDeltaNet(cfg, rngs=rngs), None
    else:
      self.linear_attn, self.attn = None, GatedAttention(cfg, rngs=rngs)
    self.post_attention_norm = zero_centered_norm(cfg.emb_dim, cfg, rngs)
    self.moe = kind.mlp == MOE
    self.mlp = (RoutedMLP(cfg, rngs=rngs) if self.moe else
                GatedMLP(cfg.emb_dim, cfg.mlp_dim, cfg.mlp_activation, **kw))

  def _mlp(self, x_BSD, mask_BS, per_layer):
    """x + MLP(norm(x)), and for a MoE layer its routing statistics (else None)."""
    h_BSD = self.post_attention_norm(x_BSD)
    if self.moe:
      y_BSD, terms = self.mlp(h_BSD, mask_BS, jax.lax.stop_gradient(per_layer["bias"]))  # pyright: ignore[reportCallIssue]
    else:
      y_BSD, terms = self.mlp(h_BSD), None  # pyright: ignore[reportCallIssue] (GatedMLP)
    return constrain(x_BSD + sites.site("mlp_out", y_BSD), ACT_BSD), terms

  def __call__(self, carry, positions_BS, segment_ids_BS, per_layer=None):
    """carry = (x_BSD, moe stats); per_layer (models with MoE layers) = {"moe_layer": this layer's
    row of the statistics, "bias": its selection bias [E]}."""
    x_BSD, stats = carry
    h_BSD = self.input_norm(x_BSD)
    if self.linear_attn is not None:   # (a layer has one of the two)
      a_BSD = self.linear_attn(h_BSD, segment_ids_BS)
    else:
      assert self.attn is not None
      a_BSD = self.attn(h_BSD, positions_BS, segment_ids_BS)
    x_BSD = x_BSD + sites.site("attn_out", a_BSD)
    x_BSD, terms = self._mlp(x_BSD, segment_ids_BS != 0, per_layer)
    if terms is not None:
      assert per_layer is not None, "a MoE layer runs with its per-layer inputs"
      stats = record(stats, per_layer["moe_layer"], *terms)
    return x_BSD, stats

  def extend(self, carry, positions_BS, valid_BS, prefill, per_layer):
    """Decoding: carry = (x_BSD, the cache: groups LINEAR and FULL); per_layer["cache_index"]:
    this layer's row of its group."""
    x_BSD, cache = carry
    h_BSD = self.input_norm(x_BSD)
    name = LINEAR if self.attn is None else FULL
    group = None if cache is None else cache[name]
    if self.linear_attn is not None:   # (a layer has one of the two)
      a_BSD, group = self.linear_attn.extend(h_BSD, valid_BS, prefill, group,
                                             per_layer["cache_index"])
    else:
      assert self.attn is not None
      a_BSD, group = self.attn.extend(h_BSD, positions_BS, valid_BS, prefill, group,
                                      per_layer["cache_index"])
    x_BSD, _ = self._mlp(x_BSD + a_BSD, valid_BS, per_layer)
    return x_BSD, None if cache is None else {**cache, name: group}


class Transformer(llama_model.Transformer):
  """`__call__(tokens_BS, positions_BS, segment_ids_BS) -> logits_BSV` (fp32). The embedding
  lookup, the forward, the LM head and the MoE layers' per-layer inputs are the Llama lineage's;
  the layers (through the parent's hooks), the zero-centred final norm, the MTP block's layers
  and the decoding cache are this family's."""

  kinds_of = staticmethod(layer_kinds)
  moe_layers_of = staticmethod(moe_layers)
  attention_group = FULL

  def new_mtp_layer(self, cfg: ModelConfig, j: int, rngs: nnx.Rngs) -> MTPLayer:
    return DecoderLayer(cfg, mtp_kind(cfg, j), rngs=rngs)

  def new_layer(self, cfg: ModelConfig, kind, rngs: nnx.Rngs) -> nnx.Module:
    return DecoderLayer(cfg, kind, rngs=rngs)

  def new_final_norm(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return zero_centered_norm(cfg.emb_dim, cfg, rngs)

  # ---- decoding (MaxText/decoding/; the family interface: extend, logits) ------
  def extend(self, tokens_BS, positions_BS, valid_BS, cache, *, prefill: bool):
    """Decoding: new tokens at `positions_BS` (`valid_BS`: the real ones of right-padded rows) →
    (final-norm hidden states [B, S, D], the cache with their state; None: no cache). `prefill`:
    the prompts (positions 0..S-1) over an empty cache; else one token per row."""
    cfg = self.cfg
    xs = {"cache_index": jnp.asarray(cache_rows(cfg)), **self._moe_inputs()}
    x_BSD, cache = self.decoder((self._embed(tokens_BS), cache), positions_BS, valid_BS, prefill,
                                xs=xs, method="extend")
    return self.final_norm(x_BSD), cache


def cache_rows(cfg: ModelConfig) -> np.ndarray:
  """Each layer's row in its decoding cache group (the linear layers' LINEAR, the full ones' FULL)."""
  kinds = mixer_types(cfg.attention_pattern, cfg.num_decoder_layers)
  return np.array([kinds[:i].count(kind) for i, kind in enumerate(kinds)], np.int32)


def decode_cache(cfg: ModelConfig) -> dict[str, CacheGroup]:
  """Linear layers keep their conv window and delta-rule state (LINEAR), full layers their K/V
  (FULL); one row per layer of the kind; the MTP block's layers theirs (MTP)."""
  kinds = mixer_types(cfg.attention_pattern, cfg.num_decoder_layers)
  groups = {LINEAR: CacheGroup(linear_state(cfg), kinds.count(LINEAR)),
            FULL: CacheGroup(KVCache(cfg.num_kv_heads, cfg.head_dim, kernel=cfg.decode_attention), kinds.count(FULL))}
  return {**{name: group for name, group in groups.items() if group.layers},
          **llama_model.mtp_cache(cfg)}
