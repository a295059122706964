"""Where a fresh init's seconds go on a TPU, per model: the program `init_state` runs
(`train/state.py: fresh_program`: the parameters, the step and the optimizer state) under XLA's
default options and under the init's own (`model_def.TPU_INIT_OPTIONS`), each its trace, lowering,
compile and (on the chip) run, the run's parameters compared bit for bit between the two; the
parameters' part and the optimizer state's part compiled alone; then (on the chip, without
--options-only) the init program per random generator (threefry2x32, rbg, unsafe_rbg), under
compile-effort options, one flat draw, and the CPU backend's init placed on the device. Prints
one JSON line per measurement, then all of them.

  python3 benchmarks/tpu_init.py qwen3-tiny qwen3-0.6b      # on the chip (model names of configs/models/)
  bash benchmarks/tpu_aot.sh benchmarks/tpu_init.py --aot qwen3-tiny qwen3-0.6b   # no chip

--aot compiles for one v5e on this machine's CPU (libtpu's deviceless compile, as
benchmarks/tpu_aot.py; nothing runs): the compile is host CPU work, so its seconds here are a
slower host's for the same program (compare the rows with each other). `compile_cpu_s` is the
process's CPU time (steadier than the wall time on a shared machine); `est_mcycles` is XLA's cost
model's sum over the compiled program (a guide to its run time: element-wise fusions run
faster); `largest_window`: the largest fusion window, in tiles (what the options bound);
`same_ops`: the compiled program computes the first row's operations, element by element
(`program_signature`: fusions, windows and layouts aside: the same values); `same_values` (on
the chip): its parameters are the first row's, bit for bit. Key=value words among the model
names override keys for all of them; --reps N repeats the default/init pair N times.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

results: dict = {}


def record(name: str, **values) -> None:
  results[name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in values.items()}
  print(json.dumps({name: results[name]}), flush=True)


class Clock:
  """Wall and process-CPU seconds since the last `lap`."""

  def __init__(self):
    self.wall, self.cpu = time.perf_counter(), time.process_time()

  def lap(self) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = (wall - self.wall, cpu - self.cpu)
    self.wall, self.cpu = wall, cpu
    return out


def estimated_mcycles(compiled) -> float:
  """XLA's estimated cycles summed over the entry computation (millions; 0 where not given)."""
  hlo = compiled.as_text() or ""
  entry = hlo[hlo.find("ENTRY"):] if "ENTRY" in hlo else ""
  return sum(int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', entry)) / 1e6


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_OPERATION = re.compile(r"^(\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)$")


def program_signature(hlo: str) -> str:
  """A compiled program's computation as one digest: each instruction its opcode, shape,
  attributes and operands' digests, fusions inlined (a fused computation's parameters are the
  fusion's operands; a tuple's element is what it holds), names, layouts and tiling, metadata and
  backend configs (fusion windows, estimated cycles) left out. Two programs with one signature
  compute the same operations in the same order on the same shapes, element by element (the same
  values), however XLA cut them into fusions."""
  hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
  hlo = re.sub(r", backend_config=.*$", "", hlo, flags=re.M)
  hlo = re.sub(r"\]\{[^}]*\}", "]", hlo)   # layouts: f32[8]{0:T(1024)} -> f32[8]
  hlo = re.sub(r"/\*.*?\*/", "", hlo)        # comments: /*index=5*/
  computations: dict[str, dict[str, str]] = {}
  roots: dict[str, str] = {}
  entry = current = ""
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = {}
      entry = current if header.group(1) else entry
      continue
    m = _INSTRUCTION.match(line)
    if m and current and line.startswith(" "):
      computations[current][m.group(1)] = m.group(2)
      if line.lstrip().startswith("ROOT "):
        roots[current] = m.group(1)
  memo: dict = {}

  def digest(comp: str, name: str, env: tuple | None):
    key = (comp, name, env)
    if key in memo:
      return memo[key]
    m = _OPERATION.match(computations[comp][name])
    shape, opcode, operands, rest = m.groups() if m else (computations[comp][name], "", "", "")
    args = [digest(comp, a.strip()[1:], env) if a.strip()[1:] in computations[comp] else a.strip()
            for a in operands.split(",")]
    if opcode == "parameter" and env is not None:
      out = env[int(operands)]
    elif opcode == "fusion":
      callee = re.search(r"calls=%([\w.\-]+)", rest)
      out = digest(callee.group(1), roots[callee.group(1)], tuple(args)) if callee else "?"
    elif opcode == "tuple":
      out = tuple(args)
    elif opcode == "get-tuple-element" and isinstance(args[0], tuple):
      index = re.search(r"index=(\d+)", rest)
      out = args[0][int(index.group(1))] if index else "?"
    else:   # a called computation (a reduce's, a loop's) by its own signature
      rest = re.sub(r"%([\w.\-]+)", lambda c: "%" + str(digest(c.group(1), roots[c.group(1)], None))
                    if c.group(1) in roots else c.group(0), rest)
      out = hashlib.sha1(repr((shape, opcode, args, rest)).encode()).hexdigest()[:16]
    memo[key] = out
    return out
  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(limit, 100_000))   # a chain of instructions is a chain of calls
  try:
    return str(digest(entry, roots[entry], None)) if entry in roots else ""
  finally:
    sys.setrecursionlimit(limit)


def largest_window(compiled) -> int:
  """The largest fusion window of a compiled TPU program (the product of a fusion's
  `output_window_bounds`, in tiles: what one iteration of its loop holds; 0 where not given)."""
  return max((math.prod(int(b) for b in re.findall(r'"(\d+)"', m)) for m in re.findall(
      r'"output_window_bounds":\[([^\]]*)\]', compiled.as_text() or "")), default=0)


@contextlib.contextmanager
def tpu_options(options: dict):
  """`model_def.TPU_INIT_OPTIONS` replaced by `options` (the init's programs built inside
  compile with them)."""
  from MaxText.models import model_def as md  # pylint: disable=import-outside-toplevel
  saved = md.TPU_INIT_OPTIONS
  md.TPU_INIT_OPTIONS = options
  try:
    yield
  finally:
    md.TPU_INIT_OPTIONS = saved


def trainer_for(model: str, keys: list[str], devices):
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  cfg = load_config([os.path.join(ROOT, "configs/base.yml"), "jax_cache_dir=",
                     f"base_output_directory={tempfile.mkdtemp(prefix='tpu_init_')}",
                     "run_name=tpu_init", f"model_name={model}", *keys], keep_auto=True)
  return Trainer(cfg, devices)


def option_rows(model: str, keys: list[str], devices, run: bool, reps: int) -> None:
  """The fresh init's program under XLA's default options and the init's (module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from MaxText.models import model_def as md  # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import init_options, init_params_traced  # pylint: disable=import-outside-toplevel
  from MaxText.train.state import fresh_program, platform_of, trained  # pylint: disable=import-outside-toplevel

  trainer = trainer_for(model, keys, devices)
  mcfg, tx, shardings = trainer.mcfg, trainer.tx, trainer.shardings
  # one compile first: libtpu's one-time start-up (its symbol table) is no program's
  jax.jit(lambda: jnp.zeros((8,)), out_shardings=shardings["step"]).lower().compile()
  choices = (("default", {}), ("init options", dict(md.TPU_INIT_OPTIONS)))
  first: dict = {}
  for rep in range(reps):
    for label, options in choices:
      clock = Clock()
      with tpu_options(options):   # a new function: traced, lowered and compiled anew
        used = init_options(mcfg, platform_of(shardings))   # what init_state compiles with
        program = fresh_program(mcfg, 0, tx, shardings, used)
        traced = program.trace()
        trace = clock.lap()
        lowered = traced.lower()
        lower = clock.lap()
        compiled = lowered.compile()
        comp = clock.lap()
      row = {"options": used,
             "trace_s": trace[0], "lower_s": lower[0], "compile_s": comp[0],
             "compile_cpu_s": comp[1], "est_mcycles": estimated_mcycles(compiled),
             "largest_window": largest_window(compiled)}
      ops = program_signature(compiled.as_text())
      if rep == 0 and label == choices[0][0]:
        first["ops"] = ops
      else:
        row["same_ops"] = ops == first["ops"]
      if run:
        state = jax.block_until_ready(compiled())
        row["run_s"] = clock.lap()[0]
        row["init_s"] = row["trace_s"] + row["lower_s"] + row["compile_s"] + row["run_s"]
        params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state["params"]))]
        del state
        if rep == 0 and label == choices[0][0]:
          first["params"] = params
        else:   # the same bits whatever the options (the init's values are its generator's)
          row["same_values"] = all(np.array_equal(a, b) for a, b in
                                   zip(first["params"], params, strict=True))
      record(f"{model} fresh init, {label} (rep {rep})", **row)
  # the two parts compiled alone (with the init's options): what each costs of the program
  adapters_only = bool(mcfg.lora_rank)
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),   # noqa: E731
                               trained(trainer.model_def.abstract_params, adapters_only))
  parts = {
      "parameters": (lambda: init_params_traced(mcfg, 7), shardings["params"]),
      "optimizer state": (lambda: {"step": jnp.zeros((), jnp.int32), "opt_state": tx.init(zeros())},
                          {"step": shardings["step"], "opt_state": shardings["opt_state"]}),
  }
  for name, (fn, out) in parts.items():
    clock = Clock()
    lowered = jax.jit(fn, out_shardings=out, compiler_options=init_options(mcfg, platform_of(shardings))).lower()
    lower = clock.lap()
    compiled = lowered.compile()
    comp = clock.lap()
    record(f"{model} {name} alone, init options", options=init_options(mcfg, platform_of(shardings)),
           trace_and_lower_s=lower[0],
           compile_s=comp[0], compile_cpu_s=comp[1], est_mcycles=estimated_mcycles(compiled))


def generator_rows(model: str) -> None:
  """The init program per random generator on this process's default device, compile-effort
  options, one flat draw, and the CPU's init placed on the device (the figures RESULTS cites)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.models import model_def as md  # pylint: disable=import-outside-toplevel
  from MaxText.models.model_config import ModelConfig  # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import get_family  # pylint: disable=import-outside-toplevel
  from MaxText.resolve import auto_settings  # pylint: disable=import-outside-toplevel

  def model_config(impl: str):
    cfg = load_config([os.path.join(ROOT, "configs/base.yml"), f"model_name={model}",
                       f"param_init_rng={impl}"], keep_auto=True)
    return ModelConfig.from_config(auto_settings.for_training(cfg).cfg)

  build = get_family(model_config("rbg").decoder_block).build
  for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
    mcfg = model_config(impl)
    t0 = time.perf_counter()
    lowered = jax.jit(lambda b=build, m=mcfg: md.init_traced(b, m, 0)).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled())
    record(f"{model} {impl} on {jax.devices()[0].platform}", trace=t1 - t0, compile=t2 - t1,
           run=time.perf_counter() - t2)
  # the same rbg program under XLA's compile-effort options (what the chip's compile costs)
  mcfg = model_config("rbg")
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
      record(f"{model} rbg {name}", trace=t1 - t0, compile=t2 - t1, run=time.perf_counter() - t2)
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
  mcfg = model_config("threefry2x32")
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


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("models", nargs="*", default=["qwen3-tiny"],
                  help="model names of configs/models/ (key=value words: overrides for all)")
  ap.add_argument("--aot", action="store_true",
                  help="compile for a v5e on this CPU, nothing run (through tpu_aot.sh)")
  ap.add_argument("--options-only", action="store_true",
                  help="on the chip: only the default/init-options rows")
  ap.add_argument("--reps", type=int, default=1, help="default/init pairs per model")
  args = ap.parse_args(argv)
  keys = [w for w in args.models if "=" in w]
  models = [w for w in args.models if "=" not in w] or ["qwen3-tiny"]
  if args.aot:
    import tpu_aot  # pylint: disable=import-outside-toplevel
    devices = tpu_aot.tpu_devices()
  else:
    import jax  # pylint: disable=import-outside-toplevel
    devices = jax.devices()
  for model in models:
    option_rows(model, keys, devices, run=not args.aot, reps=args.reps)
    if not (args.aot or args.options_only):
      generator_rows(model)
  print(json.dumps(results))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
