"""The fresh init's program per random generator, on this process's default device (a TPU: what
`param_init_rng` chooses between): per model, its trace, compile and run seconds under threefry2x32,
rbg and unsafe_rbg, and the CPU backend's init then placed on the device (the default and the
unoptimised CPU compile). Prints one JSON line per measurement, then all of them.

  python3 benchmarks/tpu_init.py qwen3-tiny qwen3-0.6b      # model names of configs/models/
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(models: list[str]) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.models import model_def as md  # pylint: disable=import-outside-toplevel
  from MaxText.models.model_config import ModelConfig  # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import get_family  # pylint: disable=import-outside-toplevel
  from MaxText.resolve import auto_settings  # pylint: disable=import-outside-toplevel

  results = {}

  def record(name: str, **values) -> None:
    results[name] = {k: round(v, 3) for k, v in values.items()}
    print(json.dumps({name: results[name]}), flush=True)

  for model in models:
    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
      cfg = load_config([os.path.join(ROOT, "configs/base.yml"), f"model_name={model}",
                         f"param_init_rng={impl}"], keep_auto=True)
      mcfg = ModelConfig.from_config(auto_settings.for_training(cfg).cfg)
      build = get_family(mcfg.decoder_block).build
      t0 = time.perf_counter()
      lowered = jax.jit(lambda b=build, m=mcfg: md.init_traced(b, m, 0)).lower()
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      jax.block_until_ready(compiled())
      record(f"{model} {impl} on {jax.devices()[0].platform}", trace=t1 - t0, compile=t2 - t1,
             run=time.perf_counter() - t2)
    # the same rbg program under XLA's compile-effort options (what the chip's compile costs)
    cfg = load_config([os.path.join(ROOT, "configs/base.yml"), f"model_name={model}",
                       "param_init_rng=rbg"], keep_auto=True)
    mcfg = ModelConfig.from_config(auto_settings.for_training(cfg).cfg)
    for name, options in (("backend_opt0", {"xla_backend_optimization_level": 0}),
                          ("effort-1", {"exec_time_optimization_effort": -1.0}),
                          ("llvm_fast", {"xla_llvm_disable_expensive_passes": True})):
      t0 = time.perf_counter()
      try:
        lowered = jax.jit(lambda b=build, m=mcfg: md.init_traced(b, m, 0)).lower()
        t1 = time.perf_counter()
        compiled = lowered.compile(compiler_options=options)
        t2 = time.perf_counter()
        jax.block_until_ready(compiled())
        record(f"{model} rbg {name}", trace=t1 - t0, compile=t2 - t1,
               run=time.perf_counter() - t2)
      except Exception as e:  # pylint: disable=broad-except
        print(json.dumps({f"{model} rbg {name}": f"failed: {str(e)[:200]}"}), flush=True)
    # one draw for every parameter (what a flat init would compile): normal of the total size,
    # cut into the parameters' shapes
    shapes = [x.shape for x in jax.tree.leaves(jax.eval_shape(
        lambda b=build, m=mcfg: md.init_traced(b, m, 0)))]
    total = sum(int(np.prod(s)) for s in shapes)

    def flat(key, shapes=tuple(shapes), total=total):
      v = jax.random.normal(key, (total,), jnp.float32)
      out, o = [], 0
      for s in shapes:
        n = int(np.prod(s))
        out.append(0.02 * v[o:o + n].reshape(s))
        o += n
      return out
    for impl in ("rbg", "unsafe_rbg"):
      t0 = time.perf_counter()
      lowered = jax.jit(flat).lower(jax.random.key(0, impl=impl))
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      jax.block_until_ready(compiled(jax.random.key(0, impl=impl)))
      record(f"{model} flat {impl} ({len(shapes)} arrays)", trace=t1 - t0, compile=t2 - t1,
             run=time.perf_counter() - t2)
    cfg = load_config([os.path.join(ROOT, "configs/base.yml"), f"model_name={model}",
                       "param_init_rng=threefry2x32"], keep_auto=True)
    mcfg = ModelConfig.from_config(auto_settings.for_training(cfg).cfg)
    cpu = jax.devices("cpu")[0]
    for name, options in (("default", None), ("unoptimised", md._UNOPTIMISED)):  # pylint: disable=protected-access
      t0 = time.perf_counter()
      with jax.default_device(cpu):
        lowered = jax.jit(md.init_traced, static_argnums=(0, 1)).lower(build, mcfg, 0)
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        t1 = time.perf_counter()
        params = jax.block_until_ready(compiled(0))
      t2 = time.perf_counter()
      jax.block_until_ready(jax.device_put(params, jax.devices()[0]))
      record(f"{model} threefry on the CPU ({name} compile), then placed", compile=t1 - t0,
             run=t2 - t1, place=time.perf_counter() - t2)
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:] or ["qwen3-tiny"]))
