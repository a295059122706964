"""The layers of Gemma 4's audio tower (a conformer, HF `Gemma4AudioLayer`): clipped projections,
the feed-forward block, chunked local attention with relative positions and a logit cap, the light
convolution, and the conformer layer made of them. The tower itself (subsampling, the layer stack,
the output projection, the embedder into the text width) is MaxText/models/gemma4/audio.py.

Conventions
  dimension letters: B clips, T frames (after subsampling), D tower width (audio_hidden_size),
  H heads, E head width (D / H), N chunks, C frames per chunk (audio_chunk_size), W keys per
  chunk's context (C + context_left - 1 + context_right), R relative positions (W // 2 + 1).
  Parameters carry the tower's own logical axes (audio_embed, audio_mlp, audio_heads) for the
  rules table.

One conformer layer (x [B, T, D]; clip = clamp to ± audio_gradient_clipping):
  x = ff1(x)                                   ff(x) = x + w * norm(clip(down(act(up(norm(clip x))))))
  x = x + norm(clip(attn(norm(clip x))))       w = audio_residual_weight
  x = lconv(x)                                 lconv(x) = x + end(act(norm(clip(dwconv(glu(start(norm x)))))))
  x = norm(clip(ff2(x)))
Norms are RMSNorm with a plain scale in HF's cast order (fp32, cast once); the light
convolution's take `audio_norm_epsilon`, all others 1e-6 (as transformers builds them).

Attention (fp32 inside, as transformers): q = q_proj(x) · E^-½/ln 2 · softplus(per_dim_scale),
k = k_proj(x) · ln(1 + e)/ln 2. Queries are cut into chunks of C; chunk n attends to the W keys
from n·C - (context_left - 1) on (zero padded at both ends). Logits = q·k + q·r (r: the relative
key projection of a sinusoidal table of R positions, aligned by Transformer-XL's relative shift,
written as transformers writes it so that any chunk/context geometry gives its values), capped
c·tanh(logits/c); a key outside the sequence or the clip's valid frames, or at a distance outside
[0, context_left - 2] behind (or up to context_right ahead of) the query, gets `audio_invalid_logit`.
"""
from __future__ import annotations

import math
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers.activations import tanh
from MaxText.layers.linear import DenseGeneral, param
from MaxText.layers.mlp import ACTIVATIONS
from MaxText.layers.norms import RMSNorm
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import constrain

ACT_BTD = ("activation_batch", None, "activation_embed")
ACT_BTF = ("activation_batch", None, "activation_mlp")
HF_NORM_EPS = 1e-6   # the conformer's norms built without an eps (transformers' default)


def _kw(cfg: ModelConfig, rngs: nnx.Rngs) -> dict:
  return dict(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)


def clip_value(cfg: ModelConfig, dtype) -> float:
  """± the conformer's activation clamp (no wider than the dtype holds, as transformers)."""
  return min(float(cfg.audio_gradient_clipping), float(jnp.finfo(dtype).max))


def _clip(x: jax.Array, bound: float) -> jax.Array:
  return jnp.clip(x, -bound, bound)


class ClippedDense(DenseGeneral):
  """HF `Gemma4ClippableLinear`: with `clipped`, the input is clamped to [input_min, input_max]
  before the matmul and the output to [output_min, output_max] after it. The four bounds are
  scalars from the checkpoint (±inf when initialised), carried but never differentiated."""

  BOUNDS = ("input_min", "input_max", "output_min", "output_max")

  def __init__(self, in_shape, out_shape, logical_axes, *, clipped: bool, rngs: nnx.Rngs,
               dtype, param_dtype):
    super().__init__(in_shape, out_shape, logical_axes, rngs=rngs, dtype=dtype,
                     param_dtype=param_dtype)
    self.clipped = clipped
    if clipped:
      for name in self.BOUNDS:
        value = -np.inf if name.endswith("min") else np.inf
        setattr(self, name, nnx.Param(jnp.full((), value, param_dtype), logical_axes=()))

  def _bounds(self, low: str, high: str, dtype) -> tuple[jax.Array, jax.Array]:
    return tuple(jax.lax.stop_gradient(getattr(self, n)[...]).astype(dtype) for n in (low, high))

  def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
    if not self.clipped:
      return super().__call__(x, out_dtype)
    x = jnp.clip(x, *self._bounds("input_min", "input_max", x.dtype))
    y = super().__call__(x, out_dtype)
    return jnp.clip(y, *self._bounds("output_min", "output_max", y.dtype))


def _norm(cfg: ModelConfig, rngs: nnx.Rngs, eps: float = HF_NORM_EPS) -> RMSNorm:
  return RMSNorm(cfg.audio_hidden_size, eps=eps, cast_before_scale=False, **_kw(cfg, rngs))


class FeedForward(nnx.Module):
  """HF `Gemma4AudioFeedForward`: D → 4D → D, pre and post norm, the residual scaled."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, kw = cfg.audio_hidden_size, _kw(cfg, rngs)
    clipped = cfg.audio_clipped_linears
    self.pre_norm, self.post_norm = _norm(cfg, rngs), _norm(cfg, rngs)
    self.up = ClippedDense((D,), (4 * D,), ("audio_embed", "audio_mlp"), clipped=clipped, **kw)
    self.down = ClippedDense((4 * D,), (D,), ("audio_mlp", "audio_embed"), clipped=clipped, **kw)
    self.act = ACTIVATIONS[cfg.audio_activation]
    self.residual_weight = float(cfg.audio_residual_weight)
    self.clip = clip_value(cfg, cfg.compute_dtype)

  def __call__(self, x_BTD):
    h_BTF = constrain(self.act(self.up(self.pre_norm(_clip(x_BTD, self.clip)))), ACT_BTF)
    h_BTD = self.post_norm(_clip(self.down(h_BTF), self.clip))
    return constrain(x_BTD + h_BTD * jnp.asarray(self.residual_weight, h_BTD.dtype), ACT_BTD)


def relative_positions(cfg: ModelConfig) -> np.ndarray:
  """HF `Gemma4AudioRelPositionalEncoding`: [R, D] = [sin | cos] of positions W//2 … 0 over
  D/2 timescales from 1 to 10⁴ (fp32)."""
  D, W = cfg.audio_hidden_size, context_width(cfg)
  n = D // 2
  increment = math.log(10000.0) / max(n - 1, 1)
  inv = np.exp(np.arange(n, dtype=np.float32) * np.float32(-increment)).astype(np.float32)
  t = np.arange(W // 2, -1, -1, dtype=np.float32)[:, None] * inv[None, :]
  return np.concatenate([np.sin(t), np.cos(t)], axis=-1).astype(np.float32)


def context_width(cfg: ModelConfig) -> int:
  """W: the keys one chunk of queries sees."""
  return cfg.audio_chunk_size + cfg.audio_context_left - 1 + cfg.audio_context_right


def chunk_mask(cfg: ModelConfig, valid_BT: jax.Array) -> jax.Array:
  """[B, N, C, W] bool: query c of chunk n may attend to key w of its context (module doc)."""
  B, T = valid_BT.shape
  C, past, ahead = cfg.audio_chunk_size, cfg.audio_context_left - 1, cfg.audio_context_right
  N, W = -(-T // C), context_width(cfg)
  q_NC = (np.arange(N) * C)[:, None] + np.arange(C)[None, :]
  kv_NW = (np.arange(N) * C - past)[:, None] + np.arange(W)[None, :]
  dist_NCW = q_NC[:, :, None] - kv_NW[:, None, :]
  window = ((dist_NCW >= 0) & (dist_NCW < past)) | ((dist_NCW < 0) & (-dist_NCW < ahead))
  inside = (q_NC < T)[:, :, None] & ((kv_NW >= 0) & (kv_NW < T))[:, None, :]
  valid_BNW = jnp.take(valid_BT, np.clip(kv_NW, 0, T - 1), axis=1)
  return jnp.asarray(window & inside)[None] & valid_BNW[:, :, None, :]


class ChunkedAttention(nnx.Module):
  """HF `Gemma4AudioAttention` (module doc)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H = cfg.audio_hidden_size, cfg.audio_num_heads
    E, kw, clipped = D // H, _kw(cfg, rngs), cfg.audio_clipped_linears
    proj = ("audio_embed", "audio_heads", "head_dim")
    self.query = ClippedDense((D,), (H, E), proj, clipped=clipped, **kw)
    self.key = ClippedDense((D,), (H, E), proj, clipped=clipped, **kw)
    self.value = ClippedDense((D,), (H, E), proj, clipped=clipped, **kw)
    self.out = ClippedDense((H, E), (D,), ("audio_heads", "head_dim", "audio_embed"),
                            clipped=clipped, **kw)
    self.relative_key = DenseGeneral((D,), (H, E), proj, **kw)
    self.per_dim_scale = nnx.Param(jnp.zeros((E,), cfg.param_dtype), logical_axes=("head_dim",))
    self.q_scale = E ** -0.5 / math.log(2)
    self.k_scale = math.log(1 + math.e) / math.log(2)
    self.cap, self.invalid = float(cfg.audio_logit_cap), float(cfg.audio_invalid_logit)
    self.C, self.past = cfg.audio_chunk_size, cfg.audio_context_left - 1
    self.ahead, self.W = cfg.audio_context_right, context_width(cfg)

  def _contexts(self, x_BTHE, N: int):
    """[B, N, W, H, E]: the W keys (or values) of each chunk's context, zero padded."""
    pad = ((0, 0), (self.past, self.ahead + self.C - 1), (0, 0), (0, 0))
    x_pad = jnp.pad(x_BTHE, pad)
    idx_NW = (np.arange(N) * self.C)[:, None] + np.arange(self.W)[None, :]
    return x_pad[:, idx_NW]

  def _rel_shift(self, x_BHNCR):
    """Transformer-XL's shift as transformers writes it: [.., C, R] → [.., C, W]."""
    B, H, N, C, R = x_BHNCR.shape
    x = jnp.pad(x_BHNCR, ((0, 0),) * 4 + ((0, self.W + 1 - R),))
    x = x.reshape(B, H, N, C * (self.W + 1))[..., : C * self.W]
    return x.reshape(B, H, N, C, self.W)

  def __call__(self, x_BTD, positions_RD, mask_BNCW):
    B, T, _ = x_BTD.shape
    C, N = self.C, mask_BNCW.shape[1]
    f32 = jnp.float32
    q_BTHE = self.query(x_BTD).astype(f32) * self.q_scale * jax.nn.softplus(
        self.per_dim_scale[...].astype(f32))
    k_BTHE = self.key(x_BTD).astype(f32) * self.k_scale
    v_BTHE = self.value(x_BTD).astype(f32)
    q_BNCHE = jnp.pad(q_BTHE, ((0, 0), (0, N * C - T), (0, 0), (0, 0))).reshape(
        B, N, C, *q_BTHE.shape[2:])
    k_BNWHE, v_BNWHE = self._contexts(k_BTHE, N), self._contexts(v_BTHE, N)
    r_RHE = self.relative_key(positions_RD.astype(x_BTD.dtype)).astype(f32)
    hi = jax.lax.Precision.HIGHEST
    ac_BHNCW = jnp.einsum("bnche,bnwhe->bhncw", q_BNCHE, k_BNWHE, precision=hi)
    bd_BHNCR = jnp.einsum("bnche,rhe->bhncr", q_BNCHE, r_RHE, precision=hi)
    logits = ac_BHNCW + self._rel_shift(bd_BHNCR)
    logits = tanh(logits / self.cap) * self.cap
    logits = jnp.where(mask_BNCW[:, None], logits, self.invalid)
    probs = jax.nn.softmax(logits, axis=-1)
    o_BNCHE = jnp.einsum("bhncw,bnwhe->bnche", probs, v_BNWHE, precision=hi)
    o_BTHE = o_BNCHE.reshape(B, N * C, *o_BNCHE.shape[3:])[:, :T]
    return constrain(self.out(o_BTHE.astype(x_BTD.dtype)), ACT_BTD)


class LightConv(nnx.Module):
  """HF `Gemma4AudioLightConv1d`: norm, D → 2D, GLU, a depthwise causal convolution of
  `audio_conv_kernel_size` (kernel in HF's [D, 1, K] layout), clamp, norm, act, D → D, residual."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, K, kw = cfg.audio_hidden_size, cfg.audio_conv_kernel_size, _kw(cfg, rngs)
    clipped = cfg.audio_clipped_linears
    self.pre_norm = _norm(cfg, rngs, cfg.audio_norm_epsilon)
    self.conv_norm = _norm(cfg, rngs, cfg.audio_norm_epsilon)
    self.start = ClippedDense((D,), (2 * D,), ("audio_embed", None), clipped=clipped, **kw)
    self.end = ClippedDense((D,), (D,), (None, "audio_embed"), clipped=clipped, **kw)
    self.conv = param(rngs, (D, 1, K), ("audio_embed", None, None), std=K ** -0.5,
                      dtype=cfg.param_dtype)
    self.act = ACTIVATIONS[cfg.audio_activation]
    self.clip = clip_value(cfg, cfg.compute_dtype)
    self.dtype = cfg.compute_dtype

  def __call__(self, x_BTD):
    h = self.start(self.pre_norm(x_BTD))
    a_BTD, g_BTD = jnp.split(h, 2, axis=-1)
    h_BTD = a_BTD * jax.nn.sigmoid(g_BTD)
    w_KD = self.conv[...][:, 0, :].T.astype(self.dtype)
    K, T = w_KD.shape[0], h_BTD.shape[1]
    h_pad = jnp.pad(h_BTD, ((0, 0), (K - 1, 0), (0, 0)))
    # (`sum` starts from the int 0, which typeshed keeps in its result: 0 + an array is the array)
    y_BTD = cast(jax.Array, sum(h_pad[:, k:k + T] * w_KD[k] for k in range(K)))
    y_BTD = self.act(self.conv_norm(_clip(y_BTD, self.clip)))
    return constrain(x_BTD + self.end(y_BTD), ACT_BTD)


class ConformerLayer(nnx.Module):
  """HF `Gemma4AudioLayer` (module doc); called by the pattern stack as
  `layer(x_BTD, positions_RD, mask_BNCW) -> x_BTD`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.ff1, self.ff2 = FeedForward(cfg, rngs=rngs), FeedForward(cfg, rngs=rngs)
    self.attn = ChunkedAttention(cfg, rngs=rngs)
    self.lconv = LightConv(cfg, rngs=rngs)
    self.attn_norm, self.post_attn_norm = _norm(cfg, rngs), _norm(cfg, rngs)
    self.out_norm = _norm(cfg, rngs)
    self.clip = clip_value(cfg, cfg.param_dtype)

  def __call__(self, x_BTD, positions_RD, mask_BNCW):
    x_BTD = self.ff1(x_BTD)
    a_BTD = self.attn(self.attn_norm(_clip(x_BTD, self.clip)), positions_RD, mask_BNCW)
    x_BTD = x_BTD + self.post_attn_norm(_clip(a_BTD, self.clip))
    x_BTD = self.ff2(self.lconv(x_BTD))
    return constrain(self.out_norm(_clip(x_BTD, self.clip)), ACT_BTD)
