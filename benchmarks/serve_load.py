"""The OpenAI-compatible server under load (`python -m MaxText.serve`, continuous batching) against
transformers' continuous batching and static batches on the same weights and requests, side by
side in one run.

  .venv/bin/python benchmarks/serve_load.py [--clients 16] [--requests 2] [--layers 4] [--dim 256]
      [--vocab 8192] [--slots 16] [--repeats 3] [--transformers-cb] [--no-static]
      [--no-transformers] [--server-arg serve_prefill_chunk=64 ...]

The model is Qwen3-shaped, random weights (transformers' init, seed 0), fp32, saved as a Hugging
Face folder without a tokenizer (requests are token ids, so nothing stops at an eos: every
request runs its max_tokens). Requests: seeded, prompt lengths 16-256 tokens, max_tokens 8-128,
greedy. After an untimed warm-up of each phase (its compiles), `--repeats` rounds of:
- solo: one client, the first --clients requests one after another: each one's latency alone;
- 4 clients: the same requests 4 at a time; each request's latency / its solo latency;
- K clients (`--clients`), --requests each, all at once: throughput (generated tokens / wall
  time), time to first token and per-token latency (first to last token / (tokens - 1)), p50 and
  p99, read from the stream (`stream: true`) by the official `openai` async client;
- with --transformers-cb, the same requests through transformers' own continuous batching
  (`init_continuous_batching`, in this process: every request queued at once, each with its
  max_tokens);
so each round's figures share the machine's load. Then, unless --no-static, the same requests as
static batches of K: our engine (`Engine.generate`, in this process) and transformers'
`generate(do_sample=False)` (left-padded, CPU torch): each batch runs to its longest max_tokens;
throughput counts only the tokens the requests asked for.
The server runs in its own process on 127.0.0.1 (a free port), stopped at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def save_model(args, folder: str):
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.Qwen3Config(
      vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.dim * 3,
      num_hidden_layers=args.layers, num_attention_heads=args.dim // 64,
      num_key_value_heads=max(1, args.dim // 128), head_dim=64, max_position_embeddings=1024,
      rms_norm_eps=1e-6, tie_word_embeddings=True,
      **{"rope_theta": 1e6, "attn_implementation": "sdpa"})   # kwargs transformers 5 still takes
  model = transformers.Qwen3ForCausalLM(config).float().eval()
  model.generation_config.eos_token_id = None
  model.save_pretrained(folder)
  return model


def requests_of(args) -> list[tuple[list[int], int]]:
  rng = np.random.default_rng(0)
  n = args.clients * args.requests
  lengths = rng.integers(16, 257, n)
  new = rng.integers(8, 129, n)
  return [(rng.integers(0, args.vocab, int(p)).tolist(), int(m)) for p, m in zip(lengths, new)]


class Server:
  def __init__(self, folder: str, args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "MaxText.serve", os.path.join(ROOT, "configs", "base.yml"),
         f"hf_path={folder}", "dtype=float32", "ici_fsdp_parallelism=1", "port=0",
         f"serve_slots={args.slots}", "max_cache_length=512", "serve_model_name=bench",
         f"serve_queue={4 * args.clients * args.requests}", "serve_chunk=8", "serve_warmup=true",
         *args.server_arg],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.url = None
    self.lines: list[str] = []
    ready = threading.Event()

    def read():
      assert self.proc.stdout is not None
      for line in self.proc.stdout:
        self.lines.append(line)
        found = re.search(r"serving \S+ on (http://\S+) ", line)
        if found:
          self.url = found.group(1)
          ready.set()
      ready.set()
    threading.Thread(target=read, daemon=True).start()
    ready.wait()
    if self.url is None:
      raise SystemExit("the server did not start:\n" + "".join(self.lines[-30:]))

  def stop(self) -> None:
    self.proc.send_signal(signal.SIGTERM)
    self.proc.wait(120)


async def one(client, prompt: list[int], new: int) -> dict:
  t0 = time.perf_counter()
  times, tokens = [], 0
  stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=new,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
  async for chunk in stream:
    if chunk.usage is not None:
      tokens = chunk.usage.completion_tokens
    elif chunk.choices:
      times.append(time.perf_counter())
  end = time.perf_counter()
  per_token = (times[-1] - times[0]) / max(tokens - 1, 1) if len(times) > 1 else 0.0
  return {"ttft": times[0] - t0, "latency": end - t0, "tokens": tokens, "per_token": per_token}


async def run_clients(url: str, reqs, clients: int) -> tuple[list[dict], float]:
  """`reqs` by `clients` concurrent clients (each takes the next request when done)."""
  import openai
  client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
  queue = list(enumerate(reqs))
  out: list[dict | None] = [None] * len(reqs)

  async def worker():
    while queue:
      i, (p, n) = queue.pop(0)
      out[i] = await one(client, p, n)
  t0 = time.perf_counter()
  await asyncio.gather(*(worker() for _ in range(clients)))
  wall = time.perf_counter() - t0
  await client.close()
  return [o for o in out if o is not None], wall


def pct(xs, q) -> float:
  return float(np.percentile(np.asarray(xs), q))


def static_batches(generate, reqs, k: int) -> tuple[float, int]:
  """(seconds, tokens asked for) of `reqs` in batches of k, each run to its longest max_tokens."""
  t0 = time.perf_counter()
  for s in range(0, len(reqs), k):
    batch = reqs[s:s + k]
    generate([p for p, _ in batch], max(n for _, n in batch))
  return time.perf_counter() - t0, sum(n for _, n in reqs)


def transformers_manager(hf, reqs):
  """transformers' continuous-batching manager, started and warmed up (one request)."""
  import transformers
  config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs),
                                         eos_token_id=None, pad_token_id=0)
  manager = hf.init_continuous_batching(generation_config=config)
  manager.start()
  manager.add_request(reqs[0][0], max_new_tokens=2)
  collect(manager, 1)
  return manager


def collect(manager, n: int) -> int:
  """Tokens made by the next `n` finished requests of `manager`."""
  made = {}
  while len(made) < n:
    r = manager.get_result(timeout=3600)
    if r is None:
      raise RuntimeError("transformers' continuous-batching manager stopped")
    if r.is_finished():
      made[r.request_id] = len(r.generated_tokens)
  return sum(made.values())


def transformers_cb(manager, reqs) -> tuple[float, int]:
  """(seconds, tokens) of `reqs` through transformers' continuous-batching manager, all queued
  at once."""
  t0 = time.perf_counter()
  for p, n in reqs:
    manager.add_request(p, max_new_tokens=n)
  made = collect(manager, len(reqs))
  return time.perf_counter() - t0, made


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--clients", type=int, default=16)
  ap.add_argument("--requests", type=int, default=2, help="requests per client")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=1,
                  help="rounds of (solo, 4 clients, K clients, transformers' continuous "
                  "batching), interleaved so each round's figures share the machine's load")
  ap.add_argument("--no-transformers", action="store_true")
  ap.add_argument("--no-static", action="store_true", help="skip the static-batch rows")
  ap.add_argument("--transformers-cb", action="store_true",
                  help="also transformers' continuous-batching manager (slow on a CPU)")
  ap.add_argument("--server-arg", action="append", default=[],
                  help="another key=value for the server (repeatable)")
  args = ap.parse_args()
  reqs = requests_of(args)
  folder = tempfile.mkdtemp(prefix="serve_load_")
  hf = save_model(args, folder)
  server = Server(folder, args)
  manager = transformers_manager(hf, reqs) if args.transformers_cb else None
  rounds = []
  try:
    solo_reqs = reqs[:args.clients]
    for clients in (1, 4, args.clients):     # warm-up: each phase's programs compile
      asyncio.run(run_clients(server.url, solo_reqs, clients))
    for _ in range(args.repeats):
      solo, _ = asyncio.run(run_clients(server.url, solo_reqs, 1))
      four, _ = asyncio.run(run_clients(server.url, solo_reqs, 4))
      many, wall = asyncio.run(run_clients(server.url, reqs, args.clients))
      seconds, made = transformers_cb(manager, reqs) if manager is not None else (0.0, 0)
      rounds.append({"ratios": [f["latency"] / s["latency"] for f, s in zip(four, solo)],
                     "many": many, "tps": sum(r["tokens"] for r in many) / wall,
                     "cb": made / seconds if seconds else None})
      print(f"round {len(rounds)}: server {rounds[-1]['tps']:.1f} tokens/s"
            + (f", transformers continuous batching {rounds[-1]['cb']:.1f}" if seconds else "")
            + f"; 4 clients: worst latency / solo {max(rounds[-1]['ratios']):.2f}, median "
            f"{float(np.median(rounds[-1]['ratios'])):.2f}; load average "
            f"{os.getloadavg()[0]:.1f}", flush=True)
  finally:
    server.stop()
    if manager is not None:
      manager.stop()
  rows = []
  many = [r for rd in rounds for r in rd["many"]]
  rows.append(("server, continuous batching", [rd["tps"] for rd in rounds],
               pct([r["ttft"] for r in many], 50), pct([r["ttft"] for r in many], 99),
               pct([r["per_token"] for r in many], 50), pct([r["per_token"] for r in many], 99)))
  if manager is not None:
    rows.append(("transformers continuous batching (init_continuous_batching)",
                 [rd["cb"] for rd in rounds], None, None, None, None))
  if not args.no_static:
    import jax
    from MaxText import inference
    model = inference.load([os.path.join(ROOT, "configs", "base.yml"), f"hf_path={folder}",
                            "dtype=float32", "ici_fsdp_parallelism=1", "max_cache_length=512",
                            f"decode_batch_size={args.clients}"], jax.devices()[:1])
    ours = lambda ps, n: model.generate(ps, max_new_tokens=n, temperature=0.0)
    static_batches(ours, reqs, args.clients)                                   # warm-up
    seconds, asked = static_batches(ours, reqs, args.clients)
    rows.append(("our engine, static batches", [asked / seconds], None, None, None, None))
    if not args.no_transformers:
      import torch

      def theirs(ps, n):
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.no_grad():
          hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                      min_new_tokens=n, pad_token_id=0)
      static_batches(theirs, reqs[:args.clients], args.clients)               # warm-up
      seconds, asked = static_batches(theirs, reqs, args.clients)
      rows.append(("transformers generate, static batches", [asked / seconds], None, None, None,
                   None))
  print(f"{len(reqs)} requests ({args.clients} clients x {args.requests}), prompts "
        f"{min(len(p) for p, _ in reqs)}-{max(len(p) for p, _ in reqs)} tokens, max_tokens "
        f"{min(n for _, n in reqs)}-{max(n for _, n in reqs)}; Qwen3-shaped {args.layers} layers, "
        f"d {args.dim}, vocab {args.vocab}, fp32; {args.slots} slots; {len(rounds)} round(s)")
  print("| | tokens/s (per round) | TTFT p50 | TTFT p99 | per-token p50 | per-token p99 |")
  print("|---|---|---|---|---|---|")
  ms = lambda x: "" if x is None else f"{1000 * x:.0f} ms"
  for name, tps, *lat in rows:
    print(f"| {name} | {' / '.join(f'{t:.1f}' for t in tps)} | "
          + " | ".join(ms(x) for x in lat) + " |")
  for i, rd in enumerate(rounds):
    print(f"round {i + 1}, 4 clients: latency / solo latency per request: max "
          f"{max(rd['ratios']):.2f}, median {float(np.median(rd['ratios'])):.2f}"
          + (f"; server / transformers CB throughput {rd['tps'] / rd['cb']:.2f}x"
             if rd["cb"] else ""))
  shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
  main()
