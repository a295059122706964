"""Speculative decoding with the MTP head as the drafter vs plain greedy decoding, side by side in
one run on the same trained weights and prompts (MaxText/decoding/speculative.py).

  .venv/bin/python benchmarks/speculative.py --train RUNS     # trains the tiny model first
  .venv/bin/python benchmarks/speculative.py --checkpoint RUNS/mtp/checkpoints [--k 1,2,3,4]
                                             [--rows 1] [--prompts 8] [--new 128] [--repeats 3]
                                             [--set KEY=VALUE ...] [--out rows.json] [--rerun]

On a TPU (one process at a time holds the chip: train.py's, then this one's; ~2 minutes, most of
it train.py's start-up; the decoding layers scanned: this model's programs compile ~2x faster
than unrolled, deviceless):

  source benchmarks/tpu_install.sh && python3 benchmarks/speculative.py --train /tmp/mtp \\
      --k 2,4 --prompts 4 --repeats 2 --set decode_unroll_layers=false --out $OUT/spec.json

--train runs train.py (the command is printed) on the embedded data (the Python standard
library's source, byte tokenizer): a 12-layer llama-family model (D 128, 4 heads, MLP 512) with
one MTP depth (mtp_num_layers=1, mtp_loss_scale=0.3), 400 steps of 8 x 128 tokens per device
(16 x 128 on 2 CPU devices, 8 x 128 on one chip); --family qwen3_next: an 8-layer Qwen3-Next ([3
Gated DeltaNet + 1 gated attention] x 2, dense MLPs), 300 steps. Decoding runs on one device
(fp32; --set adds config keys), every engine with the same parameters' layout (per layer with
`decode_unroll_layers`, restacked once at load), chunk and cache length (one for both
max_new_tokens, so each engine compiles its prefill and decoding program once).
Prompts: the first 48 bytes of --prompts standard-library modules. Each engine (plain, then
speculative_tokens=k for each k) generates with max_new_tokens = 1 and = --new after an untimed
warm-up; decode tokens/s = rows x (new - 1) / (t(new) - t(1)), the median of --repeats rounds
that interleave the engines (the machine's load moves them alike); CPU seconds of the process
likewise. Speculative outputs are checked equal to plain greedy's, token for token, or up to a
near-tie (the first differing token's log-probability within NEAR_TIE of plain's: float32 on a chip
may order a tie differently in the verify pass; said in the output and the rows' `differs`); any
other difference stops the run (exit 1). --rerun adds, for each k, an engine that rolls the
verification back by running the accepted tokens again (`Speculative.keeps_verified` off: how
Qwen3-Next's linear layers were rolled back before the verification kept their writes; for llama
the same program), A/B in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["emb_dim=128", "num_decoder_layers=12", "num_query_heads=4", "num_kv_heads=4",
         "head_dim=32", "mlp_dim=512", "mtp_num_layers=1"]
TRAIN = ["max_target_length=128", "per_device_batch_size=8", "warmup_steps=20",
         "mtp_loss_scale=0.3", "log_period=10", "sample_at_end=false"]
# --family qwen3_next: [3 Gated DeltaNet + 1 gated attention] x 2, dense MLPs, 300 steps
QWEN3_NEXT = ["model_name=qwen3-next-tiny", "num_decoder_layers=8", "emb_dim=128",
              "num_query_heads=4", "num_kv_heads=2", "head_dim=32", "num_experts=0",
              "moe_mlp_dim=0", "shared_expert_mlp_dim=0", "moe_aux_loss_weight=0", "mlp_dim=512",
              "mtp_num_layers=1"]
PROMPT_BYTES = 48
MODULES = ["argparse", "json/decoder", "csv", "textwrap", "string", "shlex", "glob", "fnmatch",
           "base64", "calendar", "difflib", "heapq", "bisect", "copy", "pprint", "queue"]


def train(runs: str, model: list[str], steps: int) -> str:
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
         f"base_output_directory={runs}", "run_name=mtp", *model, *TRAIN, f"steps={steps}",
         f"checkpoint_period={steps}"]
  print(" ".join(cmd[1:]), flush=True)
  subprocess.run(cmd, check=True)
  return os.path.join(runs, "mtp", "checkpoints")


def prompts(n: int) -> list[bytes]:
  import sysconfig
  lib = sysconfig.get_paths()["stdlib"]
  out = []
  for name in MODULES[:n]:
    path = os.path.join(lib, name + (".py" if os.path.exists(os.path.join(lib, name + ".py"))
                                     else "/__init__.py"))
    with open(path, "rb") as f:
      out.append(f.read()[:PROMPT_BYTES])
  return out


# two tokens whose log-probabilities under the same context differ by at most this are a near-tie,
# which float32 on an accelerator may order differently in a k+1-position verify pass than in a
# one-position step: the same llama-family decoding on the v5e and on the CPU differs by up to
# 7.4e-5 in log-probability (tests/test_tpu_decode.py's chip rows, its transcendentals ~5e-6 off),
# so two passes on the chip differ by about as much; 1e-4 is that bound, as the test's
NEAR_TIE = 1e-4


def first_difference(got: list, want: list) -> dict | None:
  """Where speculative output `got` first leaves plain greedy's `want` ([(ids, logprobs)] per
  prompt): the prompt, the new-token index and the two chosen tokens' log-probability gap (both
  are the argmax of one context's distribution, so a real error shows as a large gap); None when
  they agree token for token."""
  for r, ((ids_g, lp_g), (ids_w, lp_w)) in enumerate(zip(got, want)):
    for i, (a, b) in enumerate(zip(ids_g, ids_w)):
      if a != b:
        return {"prompt": r, "token": i, "logprob_gap": abs(lp_g[i] - lp_w[i])}
    if len(ids_g) != len(ids_w):
      return {"prompt": r, "token": min(len(ids_g), len(ids_w)), "logprob_gap": float("inf")}
  return None


def timed(engine, params, ids, new):
  t, c = time.perf_counter(), time.process_time()
  out = engine.generate(params, ids, max_new_tokens=new)
  return time.perf_counter() - t, time.process_time() - c, out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--train", default="")
  ap.add_argument("--family", default="llama", choices=("llama", "qwen3_next"))
  ap.add_argument("--checkpoint", default="")
  ap.add_argument("--k", default="1,2,3,4")
  ap.add_argument("--rows", type=int, default=1)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--set", nargs="*", default=[], help="config keys (key=value) for decoding")
  ap.add_argument("--out", default="", help="write the table's rows as JSON here")
  ap.add_argument("--rerun", action="store_true",
                  help="also each k rolled back by a second forward (module docstring)")
  args = ap.parse_args()
  model_keys = MODEL if args.family == "llama" else QWEN3_NEXT
  checkpoint = (train(args.train, model_keys, 400 if args.family == "llama" else 300)
                if args.train else args.checkpoint)
  from MaxText import inference
  from MaxText.decoding.engine import Engine
  import jax
  # one cache length for max_new_tokens 1 and --new (the prompts: <= 48 bytes and a bos): each
  # engine's prefill and decoding programs compile once, not once per length (device time)
  room = 64 * -(-(PROMPT_BYTES + 1 + args.new) // 64)
  model = inference.load([os.path.join(ROOT, "configs/base.yml"), *model_keys,
                          f"load_parameters_path={checkpoint}", "dtype=float32",
                          "ici_fsdp_parallelism=1", f"decode_batch_size={args.rows}",
                          f"max_cache_length={room}", *args.set],
                         devices=jax.devices()[:1], per_layer=True)   # restacked once, here
  ids = [model.encode(p.decode()) for p in prompts(args.prompts)]
  base = model.engine
  engines = {(0, False): base}   # (k, rolled back by a re-run)
  for k in map(int, args.k.split(",")):   # the plain engine's layout, chunk and cache length
    for rerun in (False, True) if args.rerun else (False,):
      e = engines[k, rerun] = Engine(base.mcfg, base.mesh, base.rules, cache_dtype="float32",
                                     batch_size=args.rows, max_cache_length=room,
                                     chunk=base.chunk, speculative_tokens=k,
                                     unroll_layers=base.unroll_layers)
      if rerun:
        assert e.speculative is not None
        e.speculative.keeps_verified = False    # read when its programs trace (none yet)
  want = None
  differs = {}
  for k, e in engines.items():   # warm-up: every program compiled; outputs compared
    timed(e, model.params, ids, 1)
    _, _, out = timed(e, model.params, ids, args.new)
    got = [(o.output_ids, o.output_logprobs) for o in out]
    want = want or got
    differs[k] = first_difference(got, want)
    if differs[k] is not None and differs[k]["logprob_gap"] > NEAR_TIE:
      raise SystemExit(f"speculative_tokens={k[0]}, re-run={k[1]}: output differs from plain "
                       f"greedy decoding at {differs[k]}: not a near-tie (log-probability gap > "
                       f"{NEAR_TIE})")
    if e.speculative is not None:
      e.speculative.stats.update(drafted=0, accepted=0)
  for i in range(min(2, len(ids))):
    print(f"prompt {i}: {model.text(ids[i])!r}\n  greedy: {model.text(want[i][0])!r}")
  wall = {k: [] for k in engines}
  cpu = {k: [] for k in engines}
  for _ in range(args.repeats):
    for k, e in engines.items():
      w1, c1, _ = timed(e, model.params, ids, 1)
      wn, cn, _ = timed(e, model.params, ids, args.new)
      tokens = len(ids) * (args.new - 1)
      wall[k].append(tokens / max(wn - w1, 1e-9))
      cpu[k].append((cn - c1) / tokens * 1000)
  near = {k: d for k, d in differs.items() if d is not None}
  print(f"\n{len(ids)} prompts, {args.rows} per batch, {args.new} new tokens each, greedy; "
        + (f"outputs identical to plain greedy decoding up to a near-tie: {near}" if near else
           "outputs identical to plain greedy decoding for every k"))
  print("| decoding | acceptance rate | tokens per step | decode tokens/s | vs plain | "
        "CPU ms per token | vs plain |")
  print("|---|---|---|---|---|---|---|")
  plain_w, plain_c = statistics.median(wall[0, False]), statistics.median(cpu[0, False])
  rows = []
  for (k, rerun), e in engines.items():
    w, c = statistics.median(wall[k, rerun]), statistics.median(cpu[k, rerun])
    if e.speculative is None:
      name, rate, per = "plain greedy", "–", "1"
    else:
      s = e.speculative.stats
      name = f"speculative, k={k}" + (", re-run roll-back" if rerun else "")
      rate = f"{e.speculative.acceptance_rate():.3f}"
      rounds = s["drafted"] / k
      per = f"{(s['accepted'] + rounds) / max(rounds, 1):.2f}"
    print(f"| {name} | {rate} | {per} | {w:,.0f} | {w / plain_w:.2f}x | {c:.2f} | "
          f"{plain_c / c:.2f}x |")
    rows.append({"k": k, "rerun": rerun, "acceptance_rate": None if e.speculative is None else float(rate),
                 "tokens_per_step": float(per), "decode_tokens_per_s": w,
                 "speedup": w / plain_w, "cpu_ms_per_token": c,
                 "platform": jax.devices()[0].platform, "prompts": len(ids), "rows": args.rows,
                 "new": args.new, "keys": " ".join(args.set), "differs": differs[k, rerun]})
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
