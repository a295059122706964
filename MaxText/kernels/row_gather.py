"""Rows of an int8 table [V, D] gathered by a Pallas TPU kernel, without a copy of the table.

Why: on a TPU an int8 array [V, D] is stored in (32, 128) tiles (four rows packed per 32-bit
word), and XLA gathers rows only from (8, 128) tiles: `jnp.take` of one token's row from an int8
vocabulary table copies the WHOLE table into that layout first, in every decoding step (Gemma 4
E4B: its 640 MiB embedding and 2.6 GiB per-layer-input table; `bash benchmarks/tpu_aot.sh decode`
shows the copies). Here each token's aligned block of TILE rows is fetched as it is stored (the
grid's block index from the token ids, scalar-prefetched), and its row selected in VMEM: a token
reads TILE x D bytes, not the table.

`gather_rows(table, tokens)` → float32 levels [*tokens, D] (exact); token ids are clamped to
[0, V). Runs with `interpret=True` on a CPU (tests check it against `jnp.take`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

TILE = 32   # int8 rows per tile of the TPU's (32, 128) int8 layout


def _kernel(tok_ref, table_ref, out_ref):
  r = jax.lax.rem(tok_ref[pl.program_id(0)], TILE)     # the row within the block (ids >= 0)
  rows = table_ref[...].astype(jnp.float32)              # [TILE, D]
  hit = jax.lax.broadcasted_iota(jnp.int32, rows.shape, 0) == r
  out_ref[0] = jnp.sum(jnp.where(hit, rows, 0.0), axis=0, keepdims=True)


def gather_rows(table_VD: jax.Array, tokens: jax.Array, interpret: bool | None = None
                ) -> jax.Array:
  """table[tokens] as float32 [*tokens.shape, D] (module docstring)."""
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  v, d = table_VD.shape
  flat = jnp.clip(tokens.reshape(-1).astype(jnp.int32), 0, v - 1)
  n = flat.shape[0]
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(n,),
      # truncating division: the ids are >= 0 (floor division's lowering wants the chip)
      in_specs=[pl.BlockSpec((TILE, d), lambda i, tok: (jax.lax.div(tok[i], TILE), 0))],
      out_specs=pl.BlockSpec((1, 1, d), lambda i, tok: (i, 0, 0)))
  out = pl.pallas_call(_kernel, grid_spec=spec,
                       out_shape=jax.ShapeDtypeStruct((n, 1, d), jnp.float32),
                       interpret=interpret)(flat, table_VD)
  return out.reshape(*tokens.shape, d)
