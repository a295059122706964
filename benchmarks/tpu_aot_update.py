"""The train step's optimizer update alone — the gradients divided by the token count, their norm,
the non-finite guard and the fused AdamW (train/update.py `guarded_update`, train/optimizer.py) —
compiled for a TPU v5e on this machine's CPU as benchmarks/tpu_aot.py compiles the whole step, for
a model's real parameter tree (gradients in the parameters' dtype, as the backward pass gives
them), in seconds rather than the step's minutes. Per parameter shape: how many passes XLA makes
that write parameters or moments of that shape, per parameter (1: one pass writes the parameter
and both moments; 2: the moments are recomputed and written by a second pass), and their
estimated cycles; then the whole update's.

  bash benchmarks/tpu_aot.sh benchmarks/tpu_aot_update.py "model_name=qwen3-tiny weight_dtype=bfloat16"

One device: no ZeRO-1 (the update on one device's part of the moments is the same expression).
"""
from __future__ import annotations

import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_INSTR = re.compile(r'\s*(?:ROOT )?%[\w.\-]+ = (\(.*?\)|\S+) fusion\(.*?"estimated_cycles":"(\d+)"')
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def writing_passes(hlo: str) -> list[tuple[list[tuple[int, ...]], int]]:
  """The entry computation's fusions: (the shapes of the arrays each writes, its estimated
  cycles)."""
  entry = hlo[hlo.index("\nENTRY"):]
  out = []
  for line in entry.splitlines():
    m = _INSTR.match(line)
    if m:
      shapes = [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(m.group(1))]
      out.append((shapes, int(m.group(2))))
  return out


def passes_per_shape(hlo: str, param_shapes: list[tuple[int, ...]]) -> dict:
  """shape → (parameters of that shape, passes writing arrays of it per parameter, their
  estimated cycles)."""
  leaves = collections.Counter(param_shapes)
  writes, cycles = collections.Counter(), collections.Counter()
  for shapes, c in writing_passes(hlo):
    for shape in set(shapes) & set(leaves):
      writes[shape] += 1
      cycles[shape] += c
  return {s: (n, writes[s] / n, cycles[s]) for s, n in leaves.items()}


def main() -> int:
  import tpu_aot  # pylint: disable=import-outside-toplevel
  if len(sys.argv) != 2:
    raise SystemExit('usage: bash benchmarks/tpu_aot.sh benchmarks/tpu_aot_update.py "key=value ..."')
  devices = tpu_aot.tpu_devices()
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.layers import lora  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  from MaxText.train.update import guarded_update  # pylint: disable=import-outside-toplevel
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), "jax_cache_dir=",
                     "base_output_directory=/tmp/tpu_aot", "run_name=tpu_aot",
                     *sys.argv[1].split()], keep_auto=True)
  trainer = Trainer(cfg, devices)
  split = lora.split if trainer.adapters_only else (lambda p: (p, {}))
  params, param_shardings = split(trainer.abstract["params"])[0], split(
      trainer.shardings["params"])[0]
  scalar = jax.ShapeDtypeStruct((), jnp.float32)

  def update(params, opt_state, grads, loss, divisor):
    grads = jax.tree.map(lambda g: g / divisor, grads)   # as train/update.py's step
    return guarded_update(trainer.tx, grads, opt_state, params, loss)

  replicated = jax.sharding.NamedSharding(trainer.mesh, jax.sharding.PartitionSpec())
  opt_shardings = trainer.shardings["opt_state"]
  jitted = jax.jit(update, donate_argnums=(0, 1),
                   in_shardings=(param_shardings, opt_shardings, param_shardings, replicated,
                                 replicated),
                   out_shardings=(param_shardings, opt_shardings, replicated, replicated))
  hlo = jitted.lower(params, trainer.abstract["opt_state"], params, scalar,
                     scalar).compile().as_text() or ""
  rows = passes_per_shape(hlo, [tuple(p.shape) for p in jax.tree.leaves(params)])
  print("| parameter shape | parameters | writing passes per parameter | est. kcycles |")
  print("|---|---|---|---|")
  for shape, (n, per, c) in sorted(rows.items(), key=lambda r: -r[1][2]):
    print(f"| {list(shape)} | {n} | {per:g} | {c / 1e3:.0f} |")
  total = sum(c for _, c in writing_passes(hlo))
  print(f"update: {total / 1e6:.2f}M estimated cycles")
  return 0


if __name__ == "__main__":
  sys.exit(main())
