"""What a decoding step of the server's engine costs at 1, 2, 4, ... busy rows: the ratio that
bounds how much slower a request gets when others decode beside it (serve_load.py's "4 clients,
latency / solo").

  .venv/bin/python benchmarks/serve_step.py [--layers 4] [--dim 256] [--vocab 8192]
      [--rows 1 2 4] [--position 200] [--repeats 30] [--set key=value ...]

serve_load.py's model (Qwen3-shaped, random weights, fp32) in this process on one device, the
server's `Slots` (16 slots of 512, calls of 8 steps, `interrupt` set as the scheduler sets it);
4 prompts of `--position` tokens prefilled, then decoding calls of every `--rows` count,
interleaved over `--repeats` rounds (the same state each time, so every call makes its 8 steps at
the same cache window). Printed per row count: wall and process CPU ms per step (medians), and
the ratio to one row. XLA's own settings (e.g. XLA_FLAGS) apply as for any process.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SLOTS, MAX_LEN, CHUNK = 16, 512, 8


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
  ap.add_argument("--position", type=int, default=200, help="prompt tokens before the steps")
  ap.add_argument("--repeats", type=int, default=30)
  ap.add_argument("--set", nargs="*", default=[], help="config keys for the model's load")
  args = ap.parse_args()
  if max(args.rows) > SLOTS or args.position + CHUNK * 2 > MAX_LEN:
    ap.error(f"--rows at most {SLOTS}, --position below {MAX_LEN - 2 * CHUNK}")
  import jax
  from serve_load import save_model
  from MaxText import inference
  from MaxText.decoding.slots import Slots, row_values
  folder = tempfile.mkdtemp(prefix="serve_step_")
  save_model(args, folder)
  model = inference.load([os.path.join(ROOT, "configs", "base.yml"), f"hf_path={folder}",
                          "dtype=float32", "ici_fsdp_parallelism=1", f"max_cache_length={MAX_LEN}",
                          *args.set], jax.devices()[:1])
  slots = Slots(model.engine, SLOTS, MAX_LEN, chunk=CHUNK)
  slots.interrupt = lambda: False           # asked between steps, as the scheduler does
  n = max(args.rows)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, args.vocab, args.position).tolist() for _ in range(n)]
  greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}
  slots.prefill(model.params, prompts, list(range(n)), [0] * n, [greedy] * n, 0)
  sampling = row_values([], SLOTS)

  def state(rows: int) -> dict[str, np.ndarray]:
    st = {"token": np.zeros(SLOTS, np.int32), "position": np.zeros(SLOTS, np.int32),
          "count": np.zeros(SLOTS, np.int32), "max_new": np.full(SLOTS, MAX_LEN, np.int32),
          "done": np.ones(SLOTS, bool), "row": np.zeros(SLOTS, np.int32)}
    st["position"][:rows], st["done"][:rows], st["token"][:rows] = args.position, False, 5
    return st

  for rows in args.rows:                    # compiles: none in the rounds
    for _ in range(2):
      slots.step(model.params, state(rows), [], sampling, 0)
  wall: dict[int, list[float]] = {r: [] for r in args.rows}
  cpu: dict[int, list[float]] = {r: [] for r in args.rows}
  for _ in range(args.repeats):
    for rows in args.rows:
      t, c = time.perf_counter(), time.process_time()
      slots.step(model.params, state(rows), [], sampling, 0)
      wall[rows].append((time.perf_counter() - t) / CHUNK)
      cpu[rows].append((time.process_time() - c) / CHUNK)
  one = np.median(wall[args.rows[0]])
  print(f"{args.layers} layers, d {args.dim}, vocab {args.vocab}, fp32; position "
        f"{args.position}; load {os.getloadavg()[0]:.1f}")
  for rows in args.rows:
    w = np.median(wall[rows])
    print(f"  {rows:2d} rows: {1000 * w:6.3f} ms per step (CPU {1000 * np.median(cpu[rows]):6.3f}),"
          f" {w / one:4.2f}x {args.rows[0]} row{'s' if args.rows[0] > 1 else ''}")


if __name__ == "__main__":
  main()
