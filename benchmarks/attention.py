"""Attention kernels side by side: forward and forward+backward time, achieved TFLOP/s against a
measured bf16 matmul peak, and the compiled programs' memory, for our kernel vs
`jax.nn.dot_product_attention` (implementation='xla', and 'cudnn' where the platform has it),
causal, GQA, over sequence lengths and typical head shapes.

"ours" is what `attention=flash` runs on the platform: our Pallas kernel (Triton on NVIDIA GPUs,
the Pallas interpreter on CPU) or, on TPU, JAX's splash kernel (`MaxText/kernels/splash.py`).

  .venv/bin/python benchmarks/attention.py --out attention.md   # GPU/TPU: S = 1k … 32k, 3 shapes
  .venv/bin/python benchmarks/attention.py                      # CPU: a reduced matrix, ~1 min

Shapes are H/K/E = query heads / kv heads / head dim: 32/8/128 (Llama 3 8B, Qwen3 8B), 64/8/128
(Llama 3 70B), 16/8/256 (Gemma-style 256-wide heads; cuDNN's limit on Hopper). Batch 1, bf16.

FLOPs are model FLOPs of the visible (query, key) pairs: forward 4·B·H·E·pairs (causal: pairs =
S(S+1)/2), forward+backward 3× that (the kernels' recomputation of the scores is not counted).
The bf16 matmul peak is the best of square matmuls on the same device; each fwd+bwd rate is given
as a fraction of it. Memory comes from `compiled.memory_analysis()` of the fwd+bwd program:
"temp" is its scratch (the S×S scores show up there for XLA), "peak" = arguments + outputs + temp
− aliased. At S ≥ 4k the table is followed by ours / cuDNN fwd+bwd throughput and the issue's
target (≥ 1.0×); a kernel that fails to compile or run (e.g. XLA out of memory at long S, cuDNN
with head dim > 256) gets a "failed" row.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from MaxText.kernels import flash_attention  # noqa: E402
from MaxText.kernels.splash import splash_attention  # noqa: E402

FULL_SEQS = "1024,2048,4096,8192,16384,32768"
FULL_SHAPES = "32/8/128,64/8/128,16/8/256"
CPU_SEQS, CPU_SHAPES = "256,512", "4/2/64"
TARGET_S, TARGET_RATIO = 4096, 1.0


def timed(fn, *args, reps: int) -> tuple[float, dict]:
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  sizes = {}
  if mem is not None:
    sizes["temp"] = mem.temp_size_in_bytes
    sizes["peak"] = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                     - mem.alias_size_in_bytes)
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times), sizes


def matmul_peak_tflops(dtype, sizes, reps: int) -> float:
  best = 0.0
  for n in sizes:
    a = jnp.ones((n, n), dtype)
    t, _ = timed(lambda x, y: x @ y, a, a, reps=reps)
    best = max(best, 2 * n**3 / t / 1e12)
  return best


def impls(platform: str, block_q: int, block_kv: int) -> dict:
  scale = lambda q: q.shape[-1] ** -0.5
  if platform == "tpu":
    ours = lambda q, k, v: splash_attention(q, k, v, None, scale=scale(q), causal=True,
                                            block_q=block_q, block_kv=block_kv)
  else:
    ours = lambda q, k, v: flash_attention(q, k, v, None, scale=scale(q), causal=True,
                                           block_q=block_q, block_kv=block_kv)
  out = {"ours": ours,
         "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="xla")}
  if platform == "gpu":
    out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                               implementation="cudnn")
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seqs", default=None, help=f"default: {FULL_SEQS} (CPU: {CPU_SEQS})")
  ap.add_argument("--shapes", default=None, help=f"H/K/E,...; default: {FULL_SHAPES} (CPU: {CPU_SHAPES})")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--block-q", type=int, default=128)
  ap.add_argument("--block-kv", type=int, default=128)
  ap.add_argument("--reps", type=int, default=None, help="timed runs per program (default 10, CPU 2)")
  ap.add_argument("--out", default=None, help="also write the markdown to this file")
  args = ap.parse_args()
  platform = jax.default_backend()
  cpu = platform == "cpu"
  seqs = [int(s) for s in (args.seqs or (CPU_SEQS if cpu else FULL_SEQS)).split(",")]
  shapes = [tuple(int(x) for x in s.split("/")) for s in (args.shapes or
                                                        (CPU_SHAPES if cpu else FULL_SHAPES)).split(",")]
  reps = args.reps or (2 if cpu else 10)
  dtype = jnp.dtype(args.dtype)
  lines: list[str] = []

  def emit(line: str = "") -> None:
    print(line, flush=True)
    lines.append(line)

  peak = matmul_peak_tflops(dtype, (1024,) if cpu else (4096, 8192, 16384), reps)
  emit(f"{jax.devices()[0].device_kind} ({platform}), jax {jax.__version__}: measured "
       f"{args.dtype} matmul peak {peak:.4g} TFLOP/s; B={args.batch}, causal, blocks "
       f"{args.block_q}/{args.block_kv}, median of {reps}")
  emit()
  emit("| H/K/E | S | kernel | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | "
       "% of matmul peak | temp MiB | peak MiB |")
  emit("|---|---|---|---|---|---|---|---|---|---|")
  ratios = []
  B = args.batch
  stats = jax.devices()[0].memory_stats() or {}   # an accelerator's memory; CPUs report none
  limit_gib = stats.get("bytes_limit", 0) / 2**30
  for H, K, E in shapes:
    for S in seqs:
      key = jax.random.split(jax.random.PRNGKey(0), 3)
      q = jax.random.normal(key[0], (B, S, H, E), dtype)
      k = jax.random.normal(key[1], (B, S, K, E), dtype)
      v = jax.random.normal(key[2], (B, S, K, E), dtype)
      fwd_flops = 4 * B * H * E * S * (S + 1) / 2
      times = {}
      for name, fn in impls(platform, args.block_q, args.block_kv).items():
        scores_gib = 3 * 4 * B * H * S * S / 2**30     # XLA's fp32 scores, probabilities, dS
        if name == "xla" and limit_gib and scores_gib > limit_gib / 2:
          emit(f"| {H}/{K}/{E} | {S} | {name} | skipped: its S×S fp32 scores (~{scores_gib:.0f} "
               f"GiB) exceed half the device's {limit_gib:.0f} GiB | | | | | | |")
          continue
        try:
          t_fwd, _ = timed(fn, q, k, v, reps=reps)
          loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32))
          t_all, mem = timed(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, reps=reps)
        except Exception as e:  # noqa: BLE001 — out of memory, unsupported shape, ...
          emit(f"| {H}/{K}/{E} | {S} | {name} | failed: {type(e).__name__}: "
               f"{' '.join(str(e).split())[:90]} | | | | | | |")
          continue
        times[name] = t_all
        tf_fwd, tf_all = fwd_flops / t_fwd / 1e12, 3 * fwd_flops / t_all / 1e12
        mib = lambda key: f"{mem[key] / 2**20:.0f}" if key in mem else "n/a"
        emit(f"| {H}/{K}/{E} | {S} | {name} | {1e3 * t_fwd:.2f} | {1e3 * t_all:.2f} | "
             f"{tf_fwd:.3g} | {tf_all:.3g} | {100 * tf_all / peak:.0f}% | {mib('temp')} | "
             f"{mib('peak')} |")
      if "ours" in times and "cudnn" in times:
        ratio = times["cudnn"] / times["ours"]
        emit(f"| {H}/{K}/{E} | {S} | ours / cudnn fwd+bwd throughput | | **{ratio:.2f}×** | | | | | |")
        if S >= TARGET_S:
          ratios.append((H, K, E, S, ratio))
  emit()
  if platform != "gpu":
    emit(f"No cuDNN on {platform}: the ≥ {TARGET_RATIO:.1f}× cuDNN target (S ≥ {TARGET_S}) is not "
         f"checked here.")
  elif not ratios:
    emit(f"cuDNN ran at no S ≥ {TARGET_S}: the target is not checked.")
  else:
    worst = min(ratios, key=lambda r: r[-1])
    ok = all(r[-1] >= TARGET_RATIO for r in ratios)
    emit(f"Target ours ≥ {TARGET_RATIO:.1f}× cuDNN fwd+bwd throughput at S ≥ {TARGET_S}: "
         f"{'MET' if ok else 'NOT MET'} over {len(ratios)} cases (worst {worst[-1]:.2f}× at "
         f"H/K/E {worst[0]}/{worst[1]}/{worst[2]}, S {worst[3]}).")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
