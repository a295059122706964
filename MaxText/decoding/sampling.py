"""The next token from the model's logits: greedy, or a sample after temperature and the top-k,
top-p (nucleus) and min-p filters, applied in transformers' order (temperature, top-k, top-p,
min-p), each on the distribution the previous one left.

Conventions: B rows, V vocabulary. Everything runs inside jit on a batch of rows [B, V]. Which
filters run is static (`Sampling.static`); their values are traced (`Sampling.values`), so another
temperature or p does not compile another program.

A sample is the Gumbel-max of the filtered logits with a key per row and step, derived from
(`seed`, the prompt's index in the request, the number of tokens generated before): the same
request gives the same tokens whatever the batch it lands in. The log-probability returned with
each token is under the model's unmodified distribution (log_softmax of the raw logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


@dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0   # 0: greedy
  top_k: int = 0             # 0: off
  top_p: float = 1.0         # 1: off
  min_p: float = 0.0         # 0: off
  seed: int = 0

  def problems(self) -> list[tuple[str, str]]:
    out = []
    if self.temperature < 0:
      out.append(("temperature", f"temperature={self.temperature} must be >= 0 (0 = greedy)"))
    if self.top_k < 0:
      out.append(("top_k", f"top_k={self.top_k} must be >= 0 (0 = off)"))
    if not 0 < self.top_p <= 1:
      out.append(("top_p", f"top_p={self.top_p} must be in (0, 1] (1 = off)"))
    if not 0 <= self.min_p <= 1:
      out.append(("min_p", f"min_p={self.min_p} must be in [0, 1] (0 = off)"))
    return out

  @property
  def static(self) -> tuple[bool, bool, bool, bool]:
    """(greedy, top-k on, top-p on, min-p on): what the compiled program does."""
    greedy = self.temperature == 0
    return (greedy, not greedy and self.top_k > 0, not greedy and self.top_p < 1,
            not greedy and self.min_p > 0)

  def values(self) -> dict[str, np.generic]:
    """The filters' values, as host scalars (arguments of the compiled programs)."""
    return {"temperature": np.float32(self.temperature or 1.0), "top_k": np.int32(self.top_k),
            "top_p": np.float32(self.top_p), "min_p": np.float32(self.min_p),
            "seed": np.uint32(self.seed)}


def filtered_logits(logits_BV: jax.Array, static: tuple, values: dict) -> jax.Array:
  """logits / temperature with -inf outside what top-k, top-p and min-p keep."""
  _, use_top_k, use_top_p, use_min_p = static
  z_BV = logits_BV.astype(jnp.float32) / values["temperature"]
  V = z_BV.shape[-1]
  if use_top_k:
    desc_BV = -jnp.sort(-z_BV, axis=-1)
    k = jnp.clip(values["top_k"], 1, V)
    kth_B1 = jax.lax.dynamic_slice_in_dim(desc_BV, k - 1, 1, axis=-1)
    z_BV = jnp.where(z_BV < kth_B1, NEG_INF, z_BV)
  if use_top_p:
    probs_BV = jax.nn.softmax(z_BV, axis=-1)
    desc_BV = -jnp.sort(-probs_BV, axis=-1)
    before_BV = jnp.cumsum(desc_BV, axis=-1) - desc_BV        # mass of the more likely tokens
    kept_BV = before_BV < values["top_p"]                     # the most likely is always kept
    least_B1 = jnp.min(jnp.where(kept_BV, desc_BV, jnp.inf), axis=-1, keepdims=True)
    z_BV = jnp.where(probs_BV < least_B1, NEG_INF, z_BV)
  if use_min_p:
    probs_BV = jax.nn.softmax(z_BV, axis=-1)
    floor_B1 = values["min_p"] * jnp.max(probs_BV, axis=-1, keepdims=True)
    z_BV = jnp.where(probs_BV < floor_B1, NEG_INF, z_BV)
  return z_BV


def row_keys(seed, rows_B: jax.Array, steps_B: jax.Array) -> jax.Array:
  """One PRNG key per row: (seed, the row's prompt index, tokens it generated before)."""
  base = jax.random.key(seed)
  return jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(base, r), s))(rows_B, steps_B)


def choose(logits_BV: jax.Array, static: tuple, values: dict, rows_B: jax.Array,
           steps_B: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(next token [B] int32, its log-probability under the unmodified distribution [B] fp32)."""
  logits_BV = logits_BV.astype(jnp.float32)
  if static[0]:
    tokens_B = jnp.argmax(logits_BV, axis=-1)
  else:
    z_BV = filtered_logits(logits_BV, static, values)
    keys_B = row_keys(values["seed"], rows_B, steps_B)
    gumbel_BV = jax.vmap(lambda k: jax.random.gumbel(k, z_BV.shape[-1:], jnp.float32))(keys_B)
    tokens_B = jnp.argmax(z_BV + gumbel_BV, axis=-1)
  tokens_B = tokens_B.astype(jnp.int32)
  # log_softmax's arithmetic (x - max) - log(sum(exp(x - max))) for the chosen token only: the
  # same bits, without writing the [B, V] log-probabilities (at batch 32 a 19 MiB pass a step)
  max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
  lse_B = jnp.log(jnp.sum(jnp.exp(logits_BV - max_B1), axis=-1))
  chosen_B = jnp.take_along_axis(logits_BV, tokens_B[:, None], axis=-1)[:, 0]
  return tokens_B, (chosen_B - max_B1[:, 0]) - lse_B
