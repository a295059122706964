"""Attention kernels side by side: forward and forward+backward time, achieved TFLOP/s and the
compiler's temporary-memory figure, for our Pallas flash kernel vs `jax.nn.dot_product_attention`
(XLA, and cuDNN where the platform has it), causal, GQA.

  .venv/bin/python benchmarks/attention.py                       # GPU: S = 1k … 32k, bf16
  .venv/bin/python benchmarks/attention.py --seqs 256,512 --reps 2   # CPU (kernel interpreted)

FLOPs are model FLOPs: forward 4·B·S²·H·E / 2 (causal), forward+backward 3× that. The bf16
matmul peak is measured on the same device (a large square matmul) and each kernel's fwd+bwd
rate is reported as a fraction of it. Memory is `compiled.memory_analysis().temp_size_in_bytes`
(the scratch the compiled program needs; the S×S score matrix shows up there for XLA).
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


def timed(fn, *args, reps: int) -> tuple[float, int]:
  compiled = jax.jit(fn).lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes if compiled.memory_analysis() else -1
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times), temp


def matmul_peak_tflops(dtype, n: int, reps: int) -> float:
  a = jnp.ones((n, n), dtype)
  t, _ = timed(lambda x, y: x @ y, a, a, reps=reps)
  return 2 * n**3 / t / 1e12


def impls(platform: str, block: int):
  out = {"ours": lambda q, k, v: flash_attention(q, k, v, None, scale=q.shape[-1] ** -0.5,
                                                 causal=True, block_q=block, block_kv=block)}
  out["xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                           implementation="xla")
  if platform == "gpu":
    out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                               implementation="cudnn")
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--kv-heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--block", type=int, default=128)
  ap.add_argument("--reps", type=int, default=10)
  args = ap.parse_args()
  dtype = jnp.dtype(args.dtype)
  platform = jax.default_backend()
  peak = matmul_peak_tflops(dtype, 8192 if platform != "cpu" else 1024, args.reps)
  print(f"{jax.devices()[0].device_kind}: measured {args.dtype} matmul peak {peak:.3g} TFLOP/s")
  print("| S | kernel | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | % of matmul peak | temp MiB (fwd+bwd) |")
  print("|---|---|---|---|---|---|---|")
  B, H, K, E = args.batch, args.heads, args.kv_heads, args.head_dim
  for S in map(int, args.seqs.split(",")):
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(key[0], (B, S, H, E), dtype)
    k = jax.random.normal(key[1], (B, S, K, E), dtype)
    v = jax.random.normal(key[2], (B, S, K, E), dtype)
    fwd_flops = 4 * B * S * S * H * E / 2
    results = {}
    for name, fn in impls(platform, args.block).items():
      try:
        t_fwd, _ = timed(fn, q, k, v, reps=args.reps)
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32))
        t_all, temp = timed(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, reps=args.reps)
      except Exception as e:  # noqa: BLE001 — e.g. out of memory for XLA at long S
        print(f"| {S} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | | |")
        continue
      tflops = 3 * fwd_flops / t_all / 1e12
      results[name] = t_all
      print(f"| {S} | {name} | {1e3 * t_fwd:.2f} | {1e3 * t_all:.2f} | {tflops:.3g} | "
            f"{100 * tflops / peak:.0f}% | {temp / 2**20:.0f} |", flush=True)
    if "ours" in results and "cudnn" in results:
      print(f"|   | ours / cudnn throughput | | {results['cudnn'] / results['ours']:.2f}× | | | |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
