"""Gemma 4's vision tower (Hugging Face `Gemma4VisionModel`): image patches → soft tokens.

Conventions
  N images, P patches per image (the processor pads every image to its patch budget), C = 3·p·p
  values per patch (p = vision_patch_size), Dv the tower's width (vision_emb_dim), Hv / Kv its
  query / kv heads, Ev its head width, Fv its MLP width, M = P / k² soft tokens per image
  (k = vision_pooling_kernel). Arrays are named by shape (`x_NPD`).

Inputs are the processor's tensors by transformers' names:
  pixel_values        [N, P, C]  float in [0, 1] (the processor only rescales by 1/255)
  image_position_ids  [N, P, 2]  int: each patch's (x, y) on the image's patch grid; -1 pads
The tower, as transformers computes it:
  x = patch_proj(2·(pixels − 0.5)) + pos_table[0][x] + pos_table[1][y]   (0 on padding patches)
  vision_layers × { h = x + post_attn_norm(attn(attn_norm(x)))
                   x = h + post_mlp_norm(mlp(mlp_norm(h))) }
      attention over the image's real patches (both ways), q/k RMSNorm with scale, scale-free v
      norm, scale 1, 2-D RoPE: channels [0, Ev/2) rotate by the patch's x, [Ev/2, Ev) by its y,
      each half as a head of width Ev/2 (θ = vision_rope_theta); MLP down(gelu_tanh(gate)·up)
  pooled = mean over each k×k block of the patch grid (fp32) · sqrt(Dv)
  (vision_standardize) pooled = (pooled − std_bias) · std_scale   (fp32; frozen buffers in HF)
With `vision_clipped_linears` every projection clamps its input and output to bounds carried with
its weights (`input_min`, `input_max`, `output_min`, `output_max`: frozen, ±inf by default).

The tower returns `(soft_NMDv, valid_NM)`: one row per k×k block of the patch grid, row-major
(block (bx, by) is row bx + (w/k)·by for a grid w patches wide), valid where a real patch falls in
it — an image of h × w patches fills its first (h/k)·(w/k) rows. The multimodal embedder
(towers.py) projects them to the text width. Its layers are a pattern stack of one kind (scanned
with `scan_layers`); parameters:
  vision/patch_proj/kernel [C, Dv]        vision/pos_table [2, vision_position_embedding_size, Dv]
  vision/encoder/runs/0/0/... (scanned; leading axis: layer) or vision/encoder/layers/<i>/...
  vision/std_bias, vision/std_scale [Dv]  (vision_standardize)
Logical axes of its own ("vision_embed", "vision_heads", "vision_kv_heads", "vision_mlp"; the rules
table shards them as the text model's embed / heads / kv_heads / mlp); the images ride
"activation_vision_batch" (the data axes, when the image count divides them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import stack
from MaxText.layers.activations import gelu_tanh
from MaxText.layers.attention_ops import attention_op
from MaxText.layers.linear import DenseGeneral, LayerKw
from MaxText.layers.norms import RMSNorm
from MaxText.layers.rope import apply_rope
from MaxText.models.model_config import ModelConfig
from MaxText.sharding.rules import constrain

ACT_NPD = ("activation_vision_batch", None, "activation_embed")
ACT_NPHE = ("activation_vision_batch", None, "activation_heads", None)
ACT_NPF = ("activation_vision_batch", None, "activation_mlp")
VISION_KIND = "vision"    # the one layer kind of the tower's pattern stack


def has_vision(cfg: ModelConfig) -> bool:
  return cfg.vision_layers > 0


def soft_tokens_per_image(cfg: ModelConfig, patches: int) -> int:
  """M: the rows the tower returns per image of `patches` (padded) patches."""
  return patches // cfg.vision_pooling_kernel ** 2


def layer_location(cfg: ModelConfig, i: int) -> tuple[tuple, int | None]:
  """Where HF vision layer i lives in our params: (path prefix, index on the stacked axis)."""
  path, index = stack.location((VISION_KIND,) * cfg.vision_layers, cfg.scan_layers, i)
  return ("vision", "encoder", *path), index


class _ClippedKw(LayerKw):
  clipped: bool   # (ClippedDense's)


class ClippedDense(DenseGeneral):
  """A projection that clamps its input and output to bounds carried with its weights (frozen:
  no gradient reaches them); with `clipped=False` a plain `DenseGeneral`."""

  def __init__(self, *args, clipped: bool, **kwargs):
    super().__init__(*args, **kwargs)
    dtype = kwargs["param_dtype"]
    self.clipped = clipped
    if clipped:
      for name, value in (("input_min", -jnp.inf), ("input_max", jnp.inf),
                          ("output_min", -jnp.inf), ("output_max", jnp.inf)):
        setattr(self, name, nnx.Param(jnp.full((), value, dtype), logical_axes=()))

  def _bound(self, name: str, x):
    return jax.lax.stop_gradient(getattr(self, name)[...]).astype(x.dtype)

  def __call__(self, x, out_dtype=None):
    if not self.clipped:
      return super().__call__(x, out_dtype)
    x = x.astype(self.dtype)
    x = jnp.clip(x, self._bound("input_min", x), self._bound("input_max", x))
    y = super().__call__(x, out_dtype)
    return jnp.clip(y, self._bound("output_min", y), self._bound("output_max", y))


def rope_2d(x_NPHE, positions_NP2, theta: float):
  """Axial RoPE: the first half of each head rotated by the x position, the second by y, each
  half as a head of its own width (transformers' `apply_multidimensional_rope`)."""
  E = x_NPHE.shape[-1]
  half = 2 * (E // 4)
  return jnp.concatenate([apply_rope(x_NPHE[..., :half], positions_NP2[..., 0], theta),
                          apply_rope(x_NPHE[..., half:2 * half], positions_NP2[..., 1], theta)],
                         axis=-1)


class VisionAttention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H, K, E = (cfg.vision_emb_dim, cfg.vision_num_heads, cfg.vision_num_kv_heads,
                  cfg.vision_head_dim)
    kw = _ClippedKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
                    clipped=cfg.vision_clipped_linears)
    norm = functools.partial(RMSNorm, E, eps=cfg.vision_norm_epsilon, logical_axis="head_dim",
                             cast_before_scale=False, rngs=rngs, dtype=cfg.compute_dtype,
                             param_dtype=cfg.param_dtype)
    self.query = ClippedDense((D,), (H, E), ("vision_embed", "vision_heads", "head_dim"), **kw)
    self.key = ClippedDense((D,), (K, E), ("vision_embed", "vision_kv_heads", "head_dim"), **kw)
    self.value = ClippedDense((D,), (K, E), ("vision_embed", "vision_kv_heads", "head_dim"), **kw)
    self.out = ClippedDense((H, E), (D,), ("vision_heads", "head_dim", "vision_embed"), **kw)
    self.query_norm, self.key_norm, self.value_norm = norm(), norm(), norm(use_scale=False)
    self.theta = cfg.vision_rope_theta
    self.op = attention_op(cfg)

  def __call__(self, x_NPD, positions_NP2, valid_NP):
    q = rope_2d(constrain(self.query_norm(self.query(x_NPD)), ACT_NPHE), positions_NP2, self.theta)
    k = rope_2d(self.key_norm(self.key(x_NPD)), positions_NP2, self.theta)
    v = self.value_norm(self.value(x_NPD))
    # real patches attend to every real patch of their image (segment 1); padding only to padding
    o_NPHE = self.op(q, k, v, valid_NP.astype(jnp.int32), scale=1.0, causal=False)
    return constrain(self.out(constrain(o_NPHE, ACT_NPHE)), ACT_NPD)


class VisionMLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, F = cfg.vision_emb_dim, cfg.vision_mlp_dim
    kw = _ClippedKw(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
                    clipped=cfg.vision_clipped_linears)
    self.gate = ClippedDense((D,), (F,), ("vision_embed", "vision_mlp"), **kw)
    self.up = ClippedDense((D,), (F,), ("vision_embed", "vision_mlp"), **kw)
    self.down = ClippedDense((F,), (D,), ("vision_mlp", "vision_embed"), **kw)

  def __call__(self, x_NPD):
    gate = self.gate(x_NPD)
    h_NPF = constrain(gelu_tanh(gate.astype(jnp.float32)).astype(gate.dtype)
                      * self.up(x_NPD), ACT_NPF)
    return self.down(h_NPF)


class VisionLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    norm = functools.partial(RMSNorm, cfg.vision_emb_dim, eps=cfg.vision_norm_epsilon,
                             cast_before_scale=False, rngs=rngs, dtype=cfg.compute_dtype,
                             param_dtype=cfg.param_dtype)
    self.attn_norm, self.post_attn_norm = norm(), norm()
    self.attn = VisionAttention(cfg, rngs=rngs)
    self.mlp_norm, self.post_mlp_norm = norm(), norm()
    self.mlp = VisionMLP(cfg, rngs=rngs)

  def __call__(self, x_NPD, positions_NP2, valid_NP):
    x_NPD = x_NPD + self.post_attn_norm(self.attn(self.attn_norm(x_NPD), positions_NP2, valid_NP))
    x_NPD = x_NPD + self.post_mlp_norm(self.mlp(self.mlp_norm(x_NPD)))
    return constrain(x_NPD, ACT_NPD)


class VisionTower(nnx.Module):
  """`tower(pixel_values_NPC, image_position_ids_NP2) -> (soft_NMDv fp32, valid_NM)`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, p = cfg.vision_emb_dim, cfg.vision_patch_size
    self.cfg = cfg
    self.patch_proj = DenseGeneral((3 * p * p,), (D,), (None, "vision_embed"), rngs=rngs,
                                   dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype)
    self.pos_table = nnx.Param(jnp.ones((2, cfg.vision_position_embedding_size, D),
                                        cfg.param_dtype), logical_axes=(None, None, "vision_embed"))
    self.encoder = stack.PatternStack(lambda kind, r: VisionLayer(cfg, rngs=r),
                                      (VISION_KIND,) * cfg.vision_layers, scan=cfg.scan_layers,
                                      remat_policy=cfg.remat_policy, rngs=rngs)
    if cfg.vision_standardize:
      self.std_bias = nnx.Param(jnp.zeros((D,), cfg.param_dtype), logical_axes=("norm",))
      self.std_scale = nnx.Param(jnp.ones((D,), cfg.param_dtype), logical_axes=("norm",))

  def _embed(self, pixels_NPC, positions_NP2, valid_NP):
    x_NPD = self.patch_proj(2.0 * (pixels_NPC.astype(jnp.float32) - 0.5))
    table = self.pos_table[...]
    at = jnp.maximum(positions_NP2, 0)
    pos_NPD = jnp.take(table[0], at[..., 0], axis=0) + jnp.take(table[1], at[..., 1], axis=0)
    return constrain(x_NPD + jnp.where(valid_NP[..., None], pos_NPD, 0).astype(x_NPD.dtype),
                     ACT_NPD)

  def _pool(self, x_NPD, positions_NP2, valid_NP):
    """Mean over each k×k block of the patch grid (fp32), blocks row-major over the grid:
    (pooled [N, M, Dv], valid [N, M]: blocks a real patch falls in)."""
    N, P, _ = x_NPD.shape
    k = self.cfg.vision_pooling_kernel
    M = P // (k * k)
    x32 = jnp.where(valid_NP[..., None], x_NPD.astype(jnp.float32), 0.0)
    if M == P:
      return x32, valid_NP
    at = jnp.maximum(positions_NP2, 0)
    width_N = jnp.max(at[..., 0], axis=-1) + 1
    block_NP = at[..., 0] // k + (width_N // k)[:, None] * (at[..., 1] // k)
    weights_NPM = jax.nn.one_hot(block_NP, M, dtype=jnp.float32) / (k * k)
    pooled_NMD = jnp.einsum("npm,npd->nmd", weights_NPM, x32,
                            precision=jax.lax.Precision.HIGHEST)
    hit_NM = jnp.any((weights_NPM > 0) & valid_NP[..., None], axis=1)
    return pooled_NMD, hit_NM

  def __call__(self, pixel_values_NPC, image_position_ids_NP2):
    cfg = self.cfg
    positions_NP2 = image_position_ids_NP2.astype(jnp.int32)
    valid_NP = jnp.any(positions_NP2 != -1, axis=-1)
    x_NPD = self._embed(pixel_values_NPC, positions_NP2, valid_NP)
    x_NPD = self.encoder(x_NPD, positions_NP2, valid_NP)
    pooled_NMD, valid_NM = self._pool(x_NPD, positions_NP2, valid_NP)
    pooled_NMD = pooled_NMD * jnp.float32(cfg.vision_emb_dim ** 0.5)
    if cfg.vision_standardize:
      bias = jax.lax.stop_gradient(self.std_bias[...]).astype(jnp.float32)
      scale = jax.lax.stop_gradient(self.std_scale[...]).astype(jnp.float32)
      pooled_NMD = (pooled_NMD - bias) * scale
    return pooled_NMD.astype(cfg.compute_dtype), valid_NM
