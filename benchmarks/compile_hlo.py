"""Where our train step's compile goes, per family: its size before and after XLA's passes (lines
of StableHLO and of optimized HLO, loops, fusions, custom calls) and the seconds and CPU seconds of
lowering and of XLA's compile, in this process (no persistent cache), for benchmarks/compile_time.py's
config of each family (extra key=value pairs override it).

    .venv/bin/python benchmarks/compile_hlo.py qwen3-next [linear_chunk_size=32] [--dump DIR]

`while` counts the loops left in the optimized program (a scanned layer stack and its backward stay
one loop each; an unrolled loop would show as many more fusions instead); `--dump` writes both
texts."""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_time  # noqa: E402  (this folder)
from MaxText.runtime import cpu_devices  # noqa: E402

cpu_devices.apply_xla_defaults()   # the schedule train.py sets, before the backends start

import jax  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.config.load import load_config  # noqa: E402
from MaxText.data.batch import BATCH_KEYS  # noqa: E402
from MaxText.resolve import auto_settings  # noqa: E402
from MaxText.train.loop import Trainer  # noqa: E402
from MaxText.train.step import jit_train_step, make_train_step  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("family", choices=list(compile_time.FAMILIES))
  ap.add_argument("keys", nargs="*", help="key=value overrides")
  ap.add_argument("--dump", default="", help="a folder for the StableHLO and optimized HLO texts")
  args = ap.parse_args()
  argv = [os.path.join(compile_time.ROOT, "configs/base.yml"), *compile_time.OURS_COMMON,
          *compile_time.FAMILIES[args.family][0], "dataset_type=synthetic", "jax_cache_dir=",
          "enable_checkpointing=false", *args.keys]
  tr = Trainer(auto_settings.for_training(load_config(argv, keep_auto=True, tool="train")),
               jax.devices()[:1])
  cfg = tr.cfg
  step_fn = make_train_step(tr.model_def, tr.tx, mesh=tr.mesh, rules=tr.rules,
                            grad_accum=cfg.gradient_accumulation_steps,
                            z_loss_weight=cfg.z_loss_weight, lr_schedule=tr.lr_schedule,
                            aux_terms=tr.aux_terms, loss_chunk_length=cfg.loss_chunk_length,
                            adapters_only=tr.adapters_only)
  jitted = jit_train_step(step_fn, tr.shardings, tr.batch_sharding, tr.mesh)
  batch = {k: jax.ShapeDtypeStruct((tr.global_batch, cfg.max_target_length), np.int32,
                                   sharding=tr.batch_sharding) for k in BATCH_KEYS}
  t0, c0 = time.perf_counter(), time.process_time()
  lowered = jitted.lower(tr.abstract, batch)
  t1, c1 = time.perf_counter(), time.process_time()
  # the options train.py compiles its step with (loop.py: LLVM's level on the CPU tuned path)
  compiled = lowered.compile(compiler_options=cpu_devices.step_compiler_options(
      tr.devices[0].platform, cfg.hot_path))
  t2, c2 = time.perf_counter(), time.process_time()
  stablehlo, optimized = lowered.as_text(), compiled.as_text() or ""
  ops = collections.Counter(re.findall(r"\s(while|fusion|custom-call)\(", optimized))
  print(f"{args.family}: trace + lower {t1 - t0:.1f} s ({c1 - c0:.1f} CPU-s), XLA compile "
        f"{t2 - t1:.1f} s ({c2 - c1:.1f} CPU-s) | StableHLO {stablehlo.count(chr(10)):,} lines, "
        f"{stablehlo.count('stablehlo.while')} loops | optimized HLO {optimized.count(chr(10)):,} "
        f"lines, {ops['while']} loops, {ops['fusion']:,} fusions, {ops['custom-call']} custom calls "
        f"| load {os.getloadavg()[0]:.1f}")
  if args.dump:
    os.makedirs(args.dump, exist_ok=True)
    for name, text in (("stablehlo", stablehlo), ("optimized", optimized)):
      with open(os.path.join(args.dump, f"{args.family}.{name}.txt"), "w", encoding="utf-8") as f:
        f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
