"""Decoding on an accelerator in ONE process (one process holds the chip): the engine's batch sweep
beside the memory-bandwidth roofline, time to first token, the same sweep with int8 weights, and
the server's scheduler in-process (MaxText/serve/scheduler.py without HTTP: the chip's machine
has no sockets) for concurrent clients.

On the TPU (from the repository root, .whl-tpu/ carried; Qwen3-0.6B, random weights):

  source benchmarks/tpu_install.sh && python3 benchmarks/tpu_decode.py \\
      --set model_name=qwen3-0.6b --out $OUT/decode.json

The scheduler's rows alone (no decode / ttft / int8 part), its programs few enough to compile in
~2 minutes on the chip: the decoding layers scanned (each program compiles 3.5-4.5x faster
than unrolled, deviceless) and decoding calls of at least 4 rows (row buckets 4, 8, 16: a few rows
cost what one does there), so 3 row buckets x 5 cache windows + ~10 prefill programs:

  source benchmarks/tpu_install.sh && python3 benchmarks/tpu_decode.py --batches= --ttft= \\
      --no-int8 --interleave 4 --set model_name=qwen3-0.6b decode_unroll_layers=false \\
      serve_min_rows=4 --out $OUT/serve.json

and the scheduler's ways side by side (--arms; the callback-free arm's programs warmed too):

  source benchmarks/tpu_install.sh && python3 benchmarks/tpu_decode.py --batches= --ttft= \\
      --no-int8 --interleave 4 --arms serial,overlap,lean --set model_name=qwen3-0.6b \\
      decode_unroll_layers=false serve_min_rows=4 --out $OUT/serve_arms.json

On a CPU, a tiny model (what tests/test_tpu_decode_script.py runs, exactly):

  .venv/bin/python benchmarks/tpu_decode.py --batches 2 --prompt 8 --new 4 --ttft 16 \\
      --clients 2 --interleave 2 --requests 2 --request-prompt 4,12 --request-new 2,5 --slots 2 \\
      --repeats 1 --set dtype=float32 max_position_embeddings=64 serve_prefill_chunk=8

Gemma 4 E4B with int8 weights at its real shapes (~11 GB as held: its float32 init does not fit
the chip): --int8-only makes the int8 model on the device array by array (benchmarks/int8_init.py)
and measures it alone (no bfloat16 sweep), its decode and ttft programs first compiled side by
side (one thread per batch and one for the ttft prompts, each row waiting for its own: a
42-layer model's compiles one after another would outlast a chip command's budget):

  source benchmarks/tpu_install.sh && python3 benchmarks/tpu_decode.py --int8-only \\
      --batches 1,16 --ttft 1043 --repeats 2 --no-serve --set model_name=gemma4-e4b \\
      --out $OUT/e4b_int8.json

(add weight_quant_vocab=true to --set for int8 vocabulary tables too: the tied head read in int8,
MaxText/layers/quant_vocab.py; the int8 sweep without --int8-only takes it as well) and on a CPU (tests/test_tpu_decode_script.py runs it, exactly):

  .venv/bin/python benchmarks/tpu_decode.py --int8-only --batches 2 --prompt 8 --new 4 \\
      --ttft '' --no-serve --repeats 1 --set model_name=gemma4-tiny dtype=float32

The model: base.yml with the --set keys, initialised in float32 (seed 0) on the device, then loaded
as the decoding tools load it (`inference.load`, `decode_unroll_layers`: restacked per layer)
with its weights cast on load to --weight-dtype (bfloat16; the compute dtype is the config's
`dtype`, bfloat16 by default here). Greedy, no eos (every request runs its max_new_tokens).

- decode (per --batches): `Engine.generate` of `batch` random prompts of --prompt tokens with
  max_new_tokens = 1 and = --new, the best of --repeats after a warm-up: ms per step =
  (t(new) - t(1)) / (new - 1), tokens/s = batch x (new - 1) / (t(new) - t(1)). Beside it the
  roofline: the bytes a step must read — every parameter array's bytes as held (`nbytes`; of a
  vocabulary table that is not the LM head, an input embedding or Gemma's per-layer input table,
  only the step's tokens' rows: `int8_init.read_bytes`) plus the KV cache's (its whole length:
  the step's attention reads every position of the cache bucket) — over --bandwidth (v5e:
  819e9 B/s); `share` = roofline ms / measured ms. The model row: `params_bytes` held.
- ttft (per --ttft prompt length): one prompt, max_new_tokens = 1 (prefill + the first token).
- int8 (unless --no-int8): the float32 weights quantized by RTN (MaxText/quantization, as
  `python -m MaxText.quantize method=rtn bits=8`; --group-size), the decode sweep again.
- serve (per --clients count): the server's Scheduler over Slots (--slots rows, calls of
  `serve_chunk` steps, prompts prefilled in pieces of `serve_prefill_chunk`), warmed
  (`Slots.warm` and one untimed round), then --requests x max(--clients) seeded requests (prompt
  lengths and max_tokens uniform in --request-prompt / --request-new): first each alone, one
  after another (its solo latency), then by `clients` concurrent clients (each submits its next
  request when its last finishes): per request latency / solo latency (max, median: the 4-client
  goal is max <= 2), aggregate tokens/s (tokens / wall time), time to first token p50 / p99.
  Then per --interleave count the same with one decoding step between two pieces of a prompt
  (the Scheduler's `step_between_pieces`: a piece costs about a step on a TPU, so a long
  prompt's first token need not wait `serve_chunk` steps per piece); the solo latencies are the
  plain scheduler's. --arms: the scheduler's ways, each with its own solo pass (serial: calls one
  after another, as before the overlap; overlap: the next call dispatched before the last one's
  tokens are read back, the server's; lean: overlap without the host callback between steps,
  serve_interrupt=false; default: the config's); per row also engine calls per generated token
  (solo and in the row) and the engine thread's seconds per kind of call. Decoding calls run at
  least `serve_min_rows` rows (--set). Programs
  compiled: by `Slots.warm` (row buckets x cache windows), by the warm-up's rounds (prefill
  programs; a round per clients count, plain and interleaved), and after the warm-up
  (`programs_after_warm`: 0 unless a request met a new program, whose compile then counts in
  its latency).

One JSON object per row on stdout as it is measured (and all of them in --out, rewritten after
each), then Markdown tables; the parts run in this order (decode, ttft, int8, serve: the
scheduler's warm-up compiles the most programs), and a part that fails is an "error" row (exit 1
at the end), not the end of the run. The compilation cache is the config's `jax_cache_dir`, so a
second run on a machine still warm compiles nothing. Progress and the quantizer's lines go to
stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from decode import timed  # noqa: E402  (benchmarks/decode.py: the best of `repeats` runs)

V5E_BANDWIDTH = 819e9


def ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def log(*a) -> None:
  print(*a, file=sys.stderr, flush=True)




def params_bytes(params) -> int:
  import jax
  return int(sum(x.nbytes for x in jax.tree.leaves(params)))


def load(args, cfg, host_f32, weight_bits: int = 0, vocab: bool = False):
  """The model as the decoding tools load it, weights cast to --weight-dtype (int8: RTN levels;
  `vocab`: the vocabulary tables too, weight_quant_vocab)."""
  from MaxText import inference
  from MaxText.config.load import replace
  from MaxText.models.model_config import ModelConfig
  params = host_f32
  if weight_bits:
    from MaxText.quantization import convert
    tgts = convert.targets(ModelConfig.from_config(cfg), cfg.weight_quant_exclude, vocab)
    with contextlib.redirect_stdout(sys.stderr):
      params, _ = convert.quantize_params(host_f32, tgts, "rtn", weight_bits, args.group_size,
                                          progress=False)
    cfg = replace(cfg, weight_bits=weight_bits, weight_group_size=args.group_size,
                  weight_quant_vocab=vocab)
  import jax
  t0 = time.perf_counter()
  model = inference.load(cfg, jax.devices()[:1], params=params, per_layer=True)
  jax.block_until_ready(model.params)
  model.eos_ids = []                        # every request runs its max_new_tokens
  return model, time.perf_counter() - t0


def engine(args, model, batch: int):
  from MaxText.decoding.engine import Engine
  base = model.engine
  return Engine(base.mcfg, base.mesh, base.rules, cache_dtype=model.cfg.cache_dtype,
                batch_size=batch, chunk=args.chunk)


def prompts_of(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
  return np.random.default_rng(seed).integers(0, vocab, (rows, length)).tolist()


def decode_rows(args, model, label: str, engines: dict | None = None) -> list[dict]:
  from MaxText.decoding import cache as cache_lib
  from MaxText.decoding.requests import bucket
  from int8_init import read_bytes
  base = model.engine
  weights = params_bytes(model.params)
  rows = []
  for B in args.batches:
    read = read_bytes(base.layout.def_of(model.params), model.params, B)
    warm = (engines or {}).get(("decode", B))
    eng = warm.get() if warm else engine(args, model, B)
    prompts = prompts_of(B, args.prompt, base.mcfg.vocab_size, B)
    gen = lambda n, eng=eng, prompts=prompts: eng.generate(model.params, prompts,
                                                           max_new_tokens=n)
    t0 = time.perf_counter()
    gen(args.new), gen(1)                   # compiles (one cache length for both)
    compile_s = time.perf_counter() - t0
    t1, _ = timed(lambda: gen(1), args.repeats)
    tn, out = timed(lambda: gen(args.new), args.repeats)
    max_len = eng.cache_length(prompts, args.new)
    kv = cache_lib.nbytes(cache_lib.specs(eng.mcfg, bucket(B), max_len, eng.cache_dtype))
    step_s = (tn - t1) / (args.new - 1)
    roof_s = (read + kv) / args.bandwidth
    rows.append({"kind": "decode", "weights": label, "batch": B, "prompt": args.prompt,
                 "new": args.new, "tokens": sum(len(c.output_ids) for c in out),
                 "ms_per_step": step_s * 1e3, "tokens_per_s": B / step_s,
                 "params_bytes": weights, "read_bytes": read, "kv_bytes": kv,
                 "cache_length": max_len, "bytes_per_step": read + kv, "bandwidth": args.bandwidth,
                 "roofline_ms": roof_s * 1e3, "roofline_tokens_per_s": B / roof_s,
                 "share": roof_s / step_s, "compile_s": compile_s,
                 "warm_s": warm.seconds if warm else None,
                 "first_tokens": out[0].output_ids[:8]})
    emit(args, rows[-1])
  return rows


def ttft_rows(args, model, engines: dict | None = None) -> list[dict]:
  base = model.engine
  warm = (engines or {}).get(("ttft", 1))
  eng = warm.get() if warm else engine(args, model, 1)
  rows = []
  for P in args.ttft:
    row = {"kind": "ttft", "prompt": P}
    if P + 1 > base.mcfg.max_position_embeddings:
      row.update(status=f"skipped: {P} + 1 positions exceed max_position_embeddings "
                 f"({base.mcfg.max_position_embeddings})")
    else:
      prompt = prompts_of(1, P, base.mcfg.vocab_size, P)
      gen = lambda prompt=prompt: eng.generate(model.params, prompt, max_new_tokens=1)
      t0 = time.perf_counter()
      gen()
      compile_s = time.perf_counter() - t0
      t, out = timed(gen, args.repeats)
      row.update(status="ok", ttft_ms=t * 1e3, prefill_tokens_per_s=P / t, compile_s=compile_s,
                 warm_s=warm.seconds if warm else None,
                 tokens=sum(len(c.output_ids) for c in out))
    rows.append(row)
    emit(args, row)
  return rows


def requests(args, vocab: int) -> list[tuple[list[int], int]]:
  rng = np.random.default_rng(0)
  n = args.requests * max(args.clients)
  lo, hi = args.request_prompt
  nlo, nhi = args.request_new
  lengths, new = rng.integers(lo, hi + 1, n), rng.integers(nlo, nhi + 1, n)
  return [(rng.integers(0, vocab, int(p)).tolist(), int(m)) for p, m in zip(lengths, new)]


def run_clients(sched, reqs, clients: int) -> tuple[list[dict], float]:
  """`reqs` by `clients` concurrent clients, each submitting its next request when its last one
  finished (serve_breakdown.closed_loop); per request: latency, time to first token, tokens."""
  from MaxText.serve.scheduler import Job
  from serve_breakdown import closed_loop  # pylint: disable=import-outside-toplevel

  def one(req):
    prompt, new = req
    done = threading.Event()
    got = {"tokens": 0, "first": None, "finish": None}

    def sink(delta):
      if delta.ids and got["first"] is None:
        got["first"] = time.perf_counter()
      got["tokens"] += len(delta.ids)
      if delta.finish_reason is not None:
        got["finish"] = delta.finish_reason
        done.set()
    t0 = time.perf_counter()
    sched.submit([Job(prompt_ids=prompt, max_tokens=new, sink=sink)])
    done.wait()
    end = time.perf_counter()
    return {"latency": end - t0, "ttft": (got["first"] or end) - t0, "tokens": got["tokens"],
            "finish": got["finish"]}

  t0 = time.perf_counter()
  out = closed_loop(reqs, clients, one)
  return out, time.perf_counter() - t0


# the scheduler's ways (--arms): (Scheduler.overlap: the next decoding call dispatched before the
# last one's tokens are read back; a call ends after a step once a request waits: `interrupt`)
ARMS = {"serial": (False, True),    # calls one after another, as before the overlap
        "overlap": (True, True),    # the server's default (serve_interrupt=true)
        "lean": (True, False)}      # serve_interrupt=false: no host callback between steps


def arm_of(sched, slots, arm: str) -> None:
  sched.overlap, early = ARMS[arm]
  slots.interrupt = sched._waits if early else None   # pylint: disable=protected-access


class Calls:
  """The scheduler's engine calls (`Scheduler(on_call=...)`) since `reset`: per kind ("step",
  "prefill", "piece") how many and their seconds on the engine thread."""

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self.count: dict[str, int] = {}
    self.seconds: dict[str, float] = {}

  def __call__(self, kind, _slots, _n, t0, t1) -> None:
    self.count[kind] = self.count.get(kind, 0) + 1
    self.seconds[kind] = self.seconds.get(kind, 0.0) + t1 - t0


def serve_rows(args, model) -> list[dict]:
  from MaxText.decoding.slots import Slots
  from MaxText.serve.scheduler import Scheduler
  cfg = model.cfg
  reqs = requests(args, model.engine.mcfg.vocab_size)
  room = max(len(p) + n for p, n in reqs)
  room = -(-room // 64) * 64
  slots = Slots(model.engine, args.slots, room, chunk=cfg.serve_chunk, min_rows=cfg.serve_min_rows)
  calls = Calls()
  sched = Scheduler(model, slots, queue_size=len(reqs) + 1,
                    prefill_chunk=cfg.serve_prefill_chunk, on_call=calls)
  arms = args.arms or ["overlap" if cfg.serve_interrupt else "lean"]
  sys.setswitchinterval(0.0005)              # the server's (MaxText/serve/__main__.GIL_SWITCH_S)
  t0 = time.perf_counter()
  warmed = 0
  for early in dict.fromkeys(ARMS[a][1] for a in arms):   # with and / or without `interrupt`
    slots.interrupt = sched._waits if early else None     # pylint: disable=protected-access
    warmed += slots.warm(model.params)
  warm_steps_s = time.perf_counter() - t0
  log(f"serve: Slots.warm compiled {warmed} decoding programs in {warm_steps_s:.1f} s")
  sched.start()
  before = slots.compiled_programs()
  for arm in arms:
    arm_of(sched, slots, arm)
    for c, interleaved in [(c, False) for c in sorted({1, *args.clients})] + \
        [(c, True) for c in args.interleave]:              # prefill programs: compiled here
      sched.step_between_pieces = interleaved
      run_clients(sched, reqs, c)
  rounds = slots.compiled_programs() - before
  warm_s = time.perf_counter() - t0
  log(f"serve: warm-up {warm_s:.1f} s, {rounds} programs compiled by its rounds")
  before = slots.compiled_programs()
  rows = []
  for arm in arms:                  # each arm its own solo pass (ARMS: the scheduler's ways)
    arm_of(sched, slots, arm)
    sched.step_between_pieces = False
    calls.reset()
    solo, solo_wall = run_clients(sched, reqs, 1)
    solo_calls = dict(calls.count)
    for c, interleaved in [(c, False) for c in args.clients] + \
        [(c, True) for c in args.interleave]:
      sched.step_between_pieces = interleaved
      calls.reset()
      got, wall = run_clients(sched, reqs, c)
      ratios = [g["latency"] / s["latency"] for g, s in zip(got, solo)]
      ttfts = np.asarray([g["ttft"] for g in got]) * 1e3
      tokens = sum(g["tokens"] for g in got)
      rows.append({"kind": "serve", "clients": c, "step_between_pieces": interleaved,
                   "arm": arm, "requests": len(reqs), "slots": args.slots,
                   "tokens": tokens, "tokens_asked": sum(n for _, n in reqs),
                   "finished": sorted({str(g["finish"]) for g in got}), "wall_s": wall,
                   "tokens_per_s": tokens / wall,
                   "latency_over_solo_max": max(ratios),
                   "latency_over_solo_median": statistics.median(ratios),
                   "ttft_p50_ms": float(np.percentile(ttfts, 50)),
                   "ttft_p99_ms": float(np.percentile(ttfts, 99)),
                   "solo_latency_s": [s["latency"] for s in solo],
                   "solo_ms_per_token": solo_wall / sum(s["tokens"] for s in solo) * 1e3,
                   # engine calls per generated token (solo, and in this row) and the seconds
                   # the engine thread spent per kind (a decoding call's: from its dispatch, or
                   # the end of the one before, to its tokens read back)
                   "solo_calls_per_token": {k: n / sum(s["tokens"] for s in solo)
                                            for k, n in solo_calls.items()},
                   "calls_per_token": {k: n / tokens for k, n in calls.count.items()},
                   "call_seconds": dict(calls.seconds),
                   "slots_min_rows": slots.min_rows, "serve_chunk": slots.chunk,
                   "prefill_chunk": sched.prefill_chunk, "windows": slots.lengths,
                   "warm_programs": warmed, "warm_steps_s": warm_steps_s,
                   "warm_round_programs": rounds, "warm_s": warm_s,
                   # compiled since the warm-up (the solo pass and the rows so far): a request
                   # that waited on a compile is slower than its solo latency by the compile,
                   # not the scheduling; 0 on a fair measure
                   "programs_after_warm": slots.compiled_programs() - before})
      emit(args, rows[-1])
  sched.stop()
  return rows


def emit(args, row: dict) -> None:
  args.rows.append(row)
  print(json.dumps(row), flush=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(args.rows, f, indent=1)


def tables(rows: list[dict]) -> str:
  mib = lambda b: f"{b / 2**20:,.1f}"
  out = ["| weights | batch | tokens/s | ms/step | roofline tokens/s | roofline ms/step | "
         "share | weights MiB + KV MiB read per step |", "|" + "---|" * 8]
  for r in rows:
    if r["kind"] == "error":
      out.insert(0, f"**{r['section']} failed**: {r['error']}\n")
    elif r["kind"] == "decode":
      out.append(f"| {r['weights']} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['ms_per_step']:.2f} | {r['roofline_tokens_per_s']:,.0f} | "
                 f"{r['roofline_ms']:.3f} | {r['share']:.1%} | {mib(r['read_bytes'])} + "
                 f"{mib(r['kv_bytes'])} |")
  out += ["", "| prompt tokens | time to first token ms | prefill tokens/s |", "|---|---|---|"]
  for r in rows:
    if r["kind"] == "ttft":
      out.append(f"| {r['prompt']} | {r['ttft_ms']:.1f} | {r['prefill_tokens_per_s']:,.0f} |"
                 if r["status"] == "ok" else f"| {r['prompt']} | {r['status']} | |")
  out += ["", "| clients | requests | tokens/s | latency / solo: max | median | TTFT p50 ms | "
          "p99 ms |", "|" + "---|" * 7]
  for r in rows:
    if r["kind"] == "serve":
      c = (f"{r['clients']}{', a step between pieces' if r['step_between_pieces'] else ''}"
           f" ({r['arm']})")
      out.append(f"| {c} | {r['requests']} | {r['tokens_per_s']:,.0f} | "
                 f"{r['latency_over_solo_max']:.2f} | {r['latency_over_solo_median']:.2f} | "
                 f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} |")
  # a part that did not run leaves no table (its header and rule lines alone)
  blocks = "\n".join(out).split("\n\n")
  return "\n\n".join(b for b in blocks if len(b.splitlines()) > 2 or b.startswith("**"))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--set", nargs="*", default=[], help="config keys (key=value) of the model")
  ap.add_argument("--weight-dtype", default="bfloat16", help="the weights' dtype once loaded")
  ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
  ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the decode rows")
  ap.add_argument("--new", type=int, default=64, help="new tokens of the decode rows (>= 2)")
  ap.add_argument("--chunk", type=int, default=16, help="decoding steps per engine call")
  ap.add_argument("--ttft", type=ints, default=[128, 1024, 4096], help="prompt lengths")
  ap.add_argument("--no-int8", action="store_true", help="skip the int8-weight sweep")
  ap.add_argument("--int8-only", action="store_true",
                  help="the model made straight in int8 on the device (int8_init.py), no float\n"
                       "model and no bfloat16 sweep: every part runs with int8 weights")
  ap.add_argument("--group-size", type=int, default=128, help="int8: input rows per scale")
  ap.add_argument("--no-serve", action="store_true", help="skip the scheduler's rows")
  ap.add_argument("--clients", type=ints, default=[4, 16], help="concurrent clients per row")
  ap.add_argument("--interleave", type=ints, default=[], help="clients counts measured again "
                  "with one decoding step between two pieces of a prompt (Scheduler "
                  "step_between_pieces)")
  ap.add_argument("--arms", type=lambda t: [a for a in t.split(",") if a], default=[],
                  help="the scheduler's ways measured, in this order (default: the config's):\n"
                  "serial (calls one after another), overlap (the next call dispatched before\n"
                  "the last one's tokens are read back), lean (overlap, serve_interrupt=false)")
  ap.add_argument("--requests", type=int, default=2, help="requests per client of the most")
  ap.add_argument("--request-prompt", type=ints, default=[16, 192], help="min,max prompt tokens "
                  "(beyond serve_prefill_chunk: prefilled in pieces while others decode)")
  ap.add_argument("--request-new", type=ints, default=[8, 64], help="min,max max_tokens")
  ap.add_argument("--slots", type=int, default=16, help="the scheduler's decode slots")
  ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (the best counts)")
  ap.add_argument("--bandwidth", type=float, default=V5E_BANDWIDTH, help="bytes/s of memory")
  ap.add_argument("--out", default="", help="write the rows as JSON here")
  args = ap.parse_args(argv)
  if set(args.arms) - set(ARMS):
    ap.error(f"--arms: {sorted(set(args.arms) - set(ARMS))} not among {sorted(ARMS)}")
  if args.new < 2:
    ap.error("--new must be >= 2 (a step's time is t(new) - t(1))")
  import jax

  from MaxText.config.load import load_config, replace
  from MaxText.models.model_config import ModelConfig
  from MaxText.models.registry import init_params
  args.rows = []
  log(f"devices: {jax.devices()}")
  from MaxText.runtime import compile_cache
  given = {k.split("=", 1)[0] for k in args.set}
  defaults = [k for k in ("dtype=bfloat16",) if k.split("=")[0] not in given]
  cfg = load_config([os.path.join(ROOT, "configs", "base.yml"), *defaults, *args.set])
  log(compile_cache.use(cfg.jax_cache_dir))   # a second run on a warm machine: no compiles
  if args.int8_only:
    return int8_only(args, cfg)
  t0 = time.perf_counter()
  f32 = ModelConfig.from_config(replace(cfg, weight_dtype="float32"))
  host = jax.device_get(init_params(f32, 0))
  log(f"init (float32, then to the host): {time.perf_counter() - t0:.1f} s")
  vocab = cfg.weight_quant_vocab   # the int8 model's choice; the float model's tables are float
  cfg = replace(cfg, weight_dtype=args.weight_dtype, weight_quant_vocab=False)
  model, load_s = load(args, cfg, host)
  emit(args, {"kind": "model", "keys": " ".join(args.set), "weights": args.weight_dtype,
              "dtype": cfg.dtype, "platform": jax.devices()[0].platform, "load_s": load_s,
              "params_bytes": params_bytes(model.params),
              "per_layer": model.engine.layout.is_per_layer(model.params),
              "parameters": int(sum(x.size for x in jax.tree.leaves(host)))})
  section(args, "decode", lambda: decode_rows(args, model, args.weight_dtype))
  section(args, "ttft", lambda: ttft_rows(args, model))
  if not args.no_int8:
    def int8():
      qmodel, load_s = load(args, cfg, host, weight_bits=8, vocab=vocab)
      emit(args, {"kind": "model", "keys": " ".join(args.set), "weights": "int8",
                  "load_s": load_s, "params_bytes": params_bytes(qmodel.params)})
      decode_rows(args, qmodel, "int8")
    section(args, "int8", int8)
  return rest(args, model)


def rest(args, model) -> int:
  """The scheduler's rows (unless --no-serve), the tables; the exit status."""
  if not args.no_serve:
    section(args, "serve", lambda: serve_rows(args, model))
  print(tables(args.rows), flush=True)
  return 1 if any(r["kind"] == "error" for r in args.rows) else 0


def int8_only(args, cfg) -> int:
  """--int8-only: the int8 model made on the device array by array (int8_init.py), loaded as
  the decoding tools load a quantized checkpoint; decode, ttft and serve with it."""
  import jax

  from int8_init import params as int8_params
  from MaxText import inference
  from MaxText.config.load import replace
  from MaxText.models.model_config import ModelConfig
  cfg = replace(cfg, weight_dtype=args.weight_dtype, weight_bits=8,
                weight_group_size=args.group_size)
  t0 = time.perf_counter()
  params, count = int8_params(ModelConfig.from_config(cfg), 0, layers=cfg.decode_unroll_layers)
  jax.block_until_ready(params)
  init_s = time.perf_counter() - t0
  log(f"init (int8, per array on the device): {init_s:.1f} s")
  t0 = time.perf_counter()
  model = inference.load(cfg, jax.devices()[:1], params=params, per_layer=True)
  del params
  model.eos_ids = []                        # every request runs its max_new_tokens
  emit(args, {"kind": "model", "keys": " ".join(args.set), "weights": "int8", "dtype": cfg.dtype,
              "platform": jax.devices()[0].platform, "init_s": init_s,
              "load_s": time.perf_counter() - t0, "params_bytes": params_bytes(model.params),
              "per_layer": model.engine.layout.is_per_layer(model.params),
              "parameters": count, "memory": device_memory()})
  engines = warm_parallel(args, model)
  section(args, "decode", lambda: decode_rows(args, model, "int8", engines))
  section(args, "ttft", lambda: ttft_rows(args, model, engines))
  return rest(args, model)


class Warming:
  """An engine whose first calls run in a thread of their own (`warm_parallel`); `get()` waits
  for them and returns the engine, `seconds` they took."""

  def __init__(self, eng, calls):
    self.eng, self.seconds = eng, 0.0
    self.thread = threading.Thread(target=self._run, args=(calls,), daemon=True)
    self.thread.start()

  def _run(self, calls):
    t0 = time.perf_counter()
    try:
      for call in calls:
        call(self.eng)
    except Exception:  # noqa: BLE001 — the row meets it again and reports it
      traceback.print_exc()
    self.seconds = time.perf_counter() - t0

  def get(self):
    self.thread.join()
    return self.eng


def warm_parallel(args, model) -> dict:
  """The decode and ttft rows' programs compiled side by side: one thread per batch (its prefill,
  then its decoding loop) and one for the ttft prompts, each running its first calls (XLA's
  compiles of a 42-layer model take minutes one after another; the host's cores run them at
  once). Each row waits for its own thread only (a row's `warm_s`: its thread's seconds;
  `compile_s`: what was left), so the first rows are out while later programs compile."""
  vocab, positions = model.engine.mcfg.vocab_size, model.engine.mcfg.max_position_embeddings
  gen = lambda B, P, seed, n: lambda eng: eng.generate(
      model.params, prompts_of(B, P, vocab, seed), max_new_tokens=n)
  engines = {("decode", B): Warming(engine(args, model, B), [gen(B, args.prompt, B, args.new)])
             for B in args.batches}
  ttft = [gen(1, P, P, 1) for P in args.ttft if P + 1 <= positions]
  if ttft:
    engines[("ttft", 1)] = Warming(engine(args, model, 1), ttft)
  return engines


def device_memory() -> dict:
  """The device's memory statistics in bytes (bytes_in_use, peak, limit), where it keeps them."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def section(args, name: str, fn) -> None:
  """Runs one part; its failure (e.g. out of memory) is a row, and the next part runs."""
  t0 = time.perf_counter()
  log(f"== {name}")
  try:
    fn()
  except Exception as e:  # noqa: BLE001 — a part that fails is a result
    traceback.print_exc()
    emit(args, {"kind": "error", "section": name, "error": f"{type(e).__name__}: {e}"[:400]})
  log(f"== {name}: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  sys.exit(main())
