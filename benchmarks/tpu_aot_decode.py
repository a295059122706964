"""The decoding engine's programs compiled for a TPU v5e on THIS machine's CPU, no chip (libtpu's
deviceless compile, as benchmarks/tpu_aot.py does for the train step): per row (batch, cache
length, weights), the jitted decoding call that benchmarks/tpu_decode.py times — `Engine._decode`,
`chunk` greedy steps in a `while_loop`, parameters per layer (`decode_unroll_layers`), the cache
donated — and optionally the prefill. Printed per row: XLA's `memory_analysis()` of the program,
the bytes a step must read (every weight — of a vocabulary table not the head's, the rows of the
step's tokens: int8_init.read_bytes — + the whole KV cache: the roofline of tpu_decode.py) and
its time at --bandwidth, XLA's estimated cycles of one step (the loop body's ops; a guide, not a
timing: element-wise fusions are estimated ~2-5x slower than they run) by kind, and with --top N
the step's N costliest operations (summed over layers). Device time is scarce; this costs none.

  bash benchmarks/tpu_aot.sh decode --set model_name=qwen3-0.6b --batches 1,8,32,64 --top 8

(`tpu_aot.sh decode ...` runs this file with the libtpu it downloads once into .libtpu-aot/.)
--weights int8 compiles the RTN int8 model (`weight_bits=8`, as tpu_decode.py's int8 sweep; with
`--set weight_quant_vocab=true` its vocabulary tables are int8 too);
--prefill also compiles the prefill of one batch of --prompt tokens; --hlo-dir keeps each
program's optimized HLO; --out writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tpu_aot import emit, finish, tpu_devices  # noqa: E402

MiB = 2**20
V5E_BANDWIDTH = 819e9
V5E_HZ = 1.5e9          # the TensorCore's clock: estimated cycles → microseconds
GREEDY = (True, False, False, False)


def ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def computations(hlo: str) -> dict[str, list[str]]:
  """The optimized HLO's computations by name: their instruction lines."""
  out: dict[str, list[str]] = {}
  name = None
  for line in hlo.splitlines():
    head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name = head.group(1)
      out[name] = []
    elif name is not None and line.startswith("  "):
      out[name].append(line)
  return out


def loop_body(hlo: str) -> str:
  """The decoding loop's body: the largest `while` body of the program (its steps), as text."""
  comps = computations(hlo)
  bodies = re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo)
  if not bodies:
    return hlo
  return "\n".join(max((comps.get(b, []) for b in bodies), key=len))


def op_kind(line: str) -> str:
  """A costed instruction's kind: the fusion's kind, else its opcode."""
  m = re.search(r" = (?:\(.*?\)|\S+) ([\w-]+)\(", line)
  opcode = m.group(1) if m else "?"
  if opcode == "fusion":
    k = re.search(r"kind=(\w+)", line)
    return k.group(1) if k else "fusion"
  return opcode


def cycles_by_kind(body: str) -> dict[str, float]:
  """XLA's estimated kcycles of the body's instructions summed per kind (kLoop: element-wise,
  kOutput: a matmul with its output fusion, copy, custom-call, ...)."""
  out: dict[str, float] = {}
  for line in body.splitlines():
    c = re.search(r'"estimated_cycles":"(\d+)"', line)
    if c:
      k = op_kind(line)
      out[k] = out.get(k, 0.0) + int(c.group(1)) / 1e3
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cycles_by_op(body: str, n: int) -> list[dict]:
  """The body's n costliest groups of instructions: those of one jax operation (its op_name less
  the loop's prefix) and kind, with their summed kcycles and count (28 layers: 28 of each)."""
  groups: dict[tuple[str, str], list] = {}
  for line in body.splitlines():
    c = re.search(r'"estimated_cycles":"(\d+)"', line)
    if c:
      name = re.search(r'op_name="([^"]*)"', line)
      op = re.sub(r"^jit\(\w+\)/(while/body/)?", "", name.group(1)) if name else "?"
      g = groups.setdefault((op, op_kind(line)), [0.0, 0, ""])
      g[0] += int(c.group(1)) / 1e3
      g[1] += 1
      shape = re.search(r" = (\(.*?\)|\S+) ", line)
      g[2] = g[2] or (re.sub(r"\{[^}]*\}", "", shape.group(1)) if shape else "")
  rows = [{"jax_op": op, "kind": kind, "kcycles": v[0], "count": v[1], "shape": v[2][:60]}
          for (op, kind), v in groups.items()]
  return sorted(rows, key=lambda r: -r["kcycles"])[:n]


def memory(compiled) -> dict[str, float]:
  m = compiled.memory_analysis()
  if m is None:
    return {}
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")
  return {k.replace("_size_in_bytes", "_mib"): getattr(m, k) / MiB for k in keys if hasattr(m, k)}


def build(args, devices, weights: str):
  """(cfg, Engine factory) of the model with --set keys, weights `weights` (bfloat16 | int8 |
  float32), on the chip's (compile-only) devices."""
  from MaxText.config.load import load_config, replace  # pylint: disable=import-outside-toplevel
  from MaxText.resolve.config_checks import validate  # pylint: disable=import-outside-toplevel
  keys = [f"dtype={args.dtype}", *args.set]
  keys += ["weight_dtype=bfloat16", "weight_bits=8", f"weight_group_size={args.group_size}"] \
      if weights == "int8" else [f"weight_dtype={weights}"]
  cfg = load_config([os.path.join(ROOT, "configs", "base.yml"), "jax_cache_dir=", *keys])
  validate(replace(cfg, max_target_length=min(cfg.max_target_length,
                                              cfg.max_position_embeddings)), devices)
  return cfg


def abstract(tree, shardings=None):
  import jax  # pylint: disable=import-outside-toplevel
  if shardings is None:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def compile_row(args, devices, weights: str, B: int, T: int) -> dict:
  """One row: the decoding call (and with --prefill the prefill) for `B` rows, cache length `T`."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  from MaxText.decoding import cache as cache_lib  # pylint: disable=import-outside-toplevel
  from MaxText.decoding.engine import MAX_EOS_IDS, Engine  # pylint: disable=import-outside-toplevel
  from MaxText.decoding.sampling import Sampling  # pylint: disable=import-outside-toplevel
  from MaxText.models.model_config import ModelConfig  # pylint: disable=import-outside-toplevel
  from MaxText.sharding.mesh import create_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.sharding.rules import parse_rules  # pylint: disable=import-outside-toplevel
  cfg = build(args, devices, weights)
  eng = Engine(ModelConfig.from_config(cfg), create_mesh(cfg, devices),
               parse_rules(cfg.logical_axis_rules, cfg.mesh_axes), cache_dtype=cfg.cache_dtype,
               batch_size=B, chunk=args.chunk, unroll_layers=cfg.decode_unroll_layers)
  if eng.unroll_layers:
    params = abstract(eng.layout.unscanned_def.abstract_params, eng.run_shardings)
  else:
    params = abstract(eng.model_def.abstract_params, eng.param_shardings)
  specs = cache_lib.specs(eng.mcfg, B, T, eng.cache_dtype)
  from MaxText.sharding.rules import logical_to_spec  # pylint: disable=import-outside-toplevel
  cache = {g: {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
      eng.mesh, logical_to_spec(a.logical_axes, a.shape, eng.rules, eng.mesh)))
      for k, a in arrays.items()} for g, arrays in specs.items()}
  whole = NamedSharding(eng.mesh, PartitionSpec())
  host = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=whole)
  state = {"token": np.zeros(B, np.int32), "position": np.zeros(B, np.int32),
           "count": np.zeros(B, np.int32), "done": np.zeros(B, bool),
           "row": np.zeros(B, np.int32)}
  values = Sampling().values()
  args_abs = (params, cache, *jax.tree.map(host, (state, np.zeros(MAX_EOS_IDS, np.int32),
                                                  np.int32(0), values)))
  from int8_init import read_bytes  # pylint: disable=import-outside-toplevel
  param_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                    for a in jax.tree.leaves(params))
  read = read_bytes(eng.layout.def_of(params), params, B)
  kv_bytes = cache_lib.nbytes(specs)
  row = {"weights": weights, "batch": B, "cache_length": T, "chunk": args.chunk,
         "params_mib": param_bytes / MiB, "read_mib": read / MiB, "kv_mib": kv_bytes / MiB,
         "roofline_ms": (read + kv_bytes) / args.bandwidth * 1e3}
  t0 = time.perf_counter()
  lowered = eng._decode.lower(*args_abs, static=GREEDY)   # pylint: disable=protected-access
  compiled = lowered.compile()
  row["compile_s"] = time.perf_counter() - t0
  row["memory"] = memory(compiled)
  hlo = compiled.as_text() or ""
  body = loop_body(hlo)
  kinds = cycles_by_kind(body)
  row["step_kcycles"] = sum(kinds.values())
  row["step_est_ms"] = row["step_kcycles"] * 1e3 / V5E_HZ * 1e3
  row["kcycles_by_kind"] = kinds
  row["top_ops"] = cycles_by_op(body, args.top) if args.top else []
  save(args, f"decode_{weights}_b{B}_t{T}", hlo)
  if args.prefill:
    S = args.prompt
    toks = jax.tree.map(host, (np.zeros((B, S), np.int32), np.ones(B, np.int32),
                               np.zeros(B, np.int32), values, {}))
    t0 = time.perf_counter()
    pre = eng._prefill.lower(params, *toks, static=GREEDY,   # pylint: disable=protected-access
                             max_len=T).compile()
    phlo = pre.as_text() or ""
    row["prefill"] = {"prompt": S, "compile_s": time.perf_counter() - t0, "memory": memory(pre),
                      "kcycles_by_kind": cycles_by_kind(phlo)}
    save(args, f"prefill_{weights}_b{B}_s{S}_t{T}", phlo)
  return row


def save(args, name: str, hlo: str) -> None:
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
    with open(os.path.join(args.hlo_dir, name + ".hlo.txt"), "w", encoding="utf-8") as f:
      f.write(hlo)


def table(rows: list[dict]) -> str:
  out = ["| weights | batch | cache | weights read + KV MiB | roofline ms/step | est. ms/step | "
         "est. kcycles/step by kind | args / temp MiB |", "|" + "---|" * 8]
  for r in rows:
    if r.get("status") != "ok":
      out.append(f"| {r['weights']} | {r['batch']} | {r['cache_length']} | "
                 f"{r.get('status')}: {r.get('error', '')[:120]} | | | | |")
      continue
    kinds = ", ".join(f"{k} {v:,.0f}" for k, v in list(r["kcycles_by_kind"].items())[:4])
    m = r["memory"]
    out.append(f"| {r['weights']} | {r['batch']} | {r['cache_length']} | "
               f"{r['read_mib']:,.1f} + {r['kv_mib']:,.1f} | {r['roofline_ms']:.3f} | "
               f"{r['step_est_ms']:.3f} | {kinds} | {m.get('argument_mib', 0):,.1f} / "
               f"{m.get('temp_mib', 0):,.1f} |")
  return "\n".join(out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--set", nargs="*", default=[], help="config keys (key=value) of the model")
  ap.add_argument("--dtype", default="bfloat16", help="the compute dtype (tpu_decode.py's)")
  ap.add_argument("--weights", default="bfloat16", help="bfloat16 | float32 | int8, comma-separated")
  ap.add_argument("--group-size", type=int, default=128, help="int8: input rows per scale")
  ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
  ap.add_argument("--cache-length", type=int, default=256,
                  help="cache positions (tpu_decode.py: prompt 128 + 64 new → bucket 256)")
  ap.add_argument("--chunk", type=int, default=16, help="decoding steps per engine call")
  ap.add_argument("--prefill", action="store_true", help="also compile the prefill")
  ap.add_argument("--prompt", type=int, default=128, help="--prefill: prompt tokens")
  ap.add_argument("--top", type=int, default=0, help="list each step's N costliest ops")
  ap.add_argument("--bandwidth", type=float, default=V5E_BANDWIDTH, help="bytes/s of memory")
  ap.add_argument("--hlo-dir", default="", help="keep each program's optimized HLO here")
  ap.add_argument("--out", default="", help="write the rows as JSON here")
  args = ap.parse_args(argv)
  devices = tpu_devices()
  rows = []
  for weights in args.weights.split(","):
    for B in args.batches:
      try:
        row = {"status": "ok", **compile_row(args, devices, weights, B, args.cache_length)}
      except Exception as e:  # noqa: BLE001 — a program that does not compile is a result
        row = {"weights": weights, "batch": B, "cache_length": args.cache_length,
               "status": "compile failed", "error": str(e).splitlines()[0][:300]}
      emit(row, rows, args.out,
           lambda op: f"    {op['kcycles']:9.1f}k cycles  x{op['count']:<3d} {op['kind']:9s} "
                      f"{op['shape'][:44]:44s} {op['jax_op'][-60:]}")
  return finish(rows, table(rows))


if __name__ == "__main__":
  sys.exit(main())
