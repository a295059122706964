"""A/B of train-step variants in ONE process: each variant (a set of key=value overrides, and how
many of the process's fake CPU devices it runs on) is compiled once, then their steps are
interleaved round by round, so a shared machine's load hits every variant alike. Per variant:
CPU seconds per step (the process's user + system time over the step, all its threads), wall
seconds per step, CPU-ms per 1k tokens (variants with different global batches compare here),
and tokens/s; medians over the rounds.

  .venv/bin/python benchmarks/ab_step.py --model readme \\
      --variant "fp32 x2: dtype=float32" --variant "bf16 x2: dtype=bfloat16" \\
      --variant "bf16 x1: dtype=bfloat16 devices=1"
  .venv/bin/python benchmarks/ab_step.py --model tiny --variant "whole: loss_chunk_length=0" \\
      --variant "c128: loss_chunk_length=128"

--model readme: configs/base.yml as it is (the README run's model and batch, 8 sequences per
device); tiny: tiny_train.py's reference config (vocab 8192, global batch 8 over the devices);
gemma4, qwen3-next: those families' tiny configs at tiny_train's widths (`FAMILY_MODELS`; Qwen3-Next
dense, without experts).
`devices=N` in a variant: its mesh takes the first N of the process's devices (default all,
--devices). Code per variant (to A/B what no config key selects), changed while the variant is
built, traced and compiled, and put back after, in one of two forms:
  py:module.NAME=value   that module attribute set to a Python literal, e.g. a constant:
                         `py:MaxText.losses.vocab_split.VOCAB_SPLIT_MAX_TOKENS_PER_VOCAB=0`
  patch=FILE             FILE's `apply()` changes any code (e.g. puts back a function as it was
                         before a change) and returns the function that undoes it
(a constant needs no file; a function's other version needs code). The host allocator a training
run sets (`cpu_devices.keep_freed_memory`) is on for every variant; `malloc=glibc` in a variant puts
back glibc's own thresholds while that variant runs (set before each of its rounds). --step grpo: GRPO's optimizer
step (`MaxText/rl/step.py`, policy loss with a KL term) on a rollout batch of the same rows instead
of the training step. Every step runs on the same synthetic batch and waits for its result (this
times the step, not the loop's overlap of host work; see the loop's own read-late figures in
RESULTS.md).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_variant(text: str) -> tuple[str, int | None, list[str], dict[str, object], list[str]]:
  """"label: k=v k=v devices=N py:mod.NAME=1 patch=FILE" → (label, N or None, ["k=v", ...],
  {"mod.NAME": 1}, [FILE, ...])."""
  label, _, keys = text.partition(":")
  items = keys.split()
  devices = [int(k.split("=", 1)[1]) for k in items if k.startswith("devices=")]
  attrs = dict(k[3:].split("=", 1) for k in items if k.startswith("py:"))
  files = [k.split("=", 1)[1] for k in items if k.startswith("patch=")]
  return label.strip(), (devices[-1] if devices else None), \
      [k for k in items if not k.startswith(("devices=", "py:", "patch=", "malloc="))], \
      {k: ast.literal_eval(v) for k, v in attrs.items()}, files


@contextlib.contextmanager
def variant_code(attrs: dict[str, object], files: list[str]):
  """A variant's code changes inside (module docstring), undone after in reverse order: `attrs`
  {"module.NAME": value} set as module attributes, then each of `files` run and its `apply()`
  called (it returns the function that undoes it)."""
  undo = []
  try:
    for dotted, value in attrs.items():
      module_name, _, name = dotted.rpartition(".")
      module = importlib.import_module(module_name)
      if not hasattr(module, name):
        raise SystemExit(f"py:{dotted}: {module_name} has no attribute {name}")
      undo.append(functools.partial(setattr, module, name, getattr(module, name)))
      setattr(module, name, value)
    for path in files:
      scope: dict[str, object] = {"__file__": path, "__name__": "ab_patch"}
      with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), scope)  # pylint: disable=exec-used
      apply = scope["apply"]
      assert callable(apply), f"{path}: apply is not a function"
      undo.append(apply())
    yield
  finally:
    for u in reversed(undo):
      u()


# The other families at about tiny_train's widths (d 256, heads of 64, MLP 1024, vocab 8192,
# seq 256, global batch 8), each with its own layer pattern and features from its tiny config.
FAMILY_MODELS = {
    "gemma4": ["model_name=gemma4-tiny", "global_head_dim=128", "per_layer_input_dim=32",
               "per_layer_input_vocab_size=8192", "sliding_window=128"],
    "qwen3-next": ["model_name=qwen3-next-tiny", "num_experts=0", "moe_mlp_dim=0",
                   "shared_expert_mlp_dim=0", "linear_key_head_dim=64",
                   "linear_value_head_dim=64"],
}


def model_keys(model: str, devices: int) -> list[str]:
  if model == "readme":
    return []
  from tiny_train import GLOBAL_BATCH, REF  # pylint: disable=import-outside-toplevel
  ref = dict(REF)
  if model in FAMILY_MODELS:   # layer counts and kv heads stay the family's tiny config's
    del ref["num_decoder_layers"], ref["num_kv_heads"]
  return [*FAMILY_MODELS.get(model, []), *(f"{k}={v}" for k, v in ref.items()),
          f"per_device_batch_size={GLOBAL_BATCH / devices:g}"]


def synthetic_batch(trainer, seed: int = 0) -> dict:
  """One global batch of random tokens (full-length segments) on the trainer's batch sharding."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  B, S = trainer.global_batch, trainer.cfg.max_target_length
  rng = np.random.default_rng(seed)
  host = {k: rng.integers(1, trainer.mcfg.vocab_size, (B, S)).astype(np.int32)
          for k in ("inputs", "targets")}
  host.update(inputs_segmentation=np.ones((B, S), np.int32),
              targets_segmentation=np.ones((B, S), np.int32),
              inputs_position=np.tile(np.arange(S, dtype=np.int32), (B, 1)))
  return trainer.device_batch(host)


def grpo_step(trainer):
  """GRPO's optimizer step (`MaxText/rl/step.py: make_update` with the GRPO loss and a reference
  KL term) on the trainer's model, optimizer and mesh, compiled for a rollout batch of the global
  batch's rows; and that batch (random tokens, every token after the first a completion token,
  random advantages)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from MaxText.rl.batch import model_arrays  # pylint: disable=import-outside-toplevel
  from MaxText.rl.step import (  # pylint: disable=import-outside-toplevel
      batch_shardings, grpo_loss, jit_update, make_update)
  cfg, (B, S) = trainer.cfg, (trainer.global_batch, trainer.cfg.max_target_length)
  shardings = batch_shardings(trainer.mesh, trainer.rules, B, S)
  step = make_update(trainer.model_def, trainer.tx, mesh=trainer.mesh, rules=trainer.rules,
                     lr_schedule=trainer.lr_schedule, chunk=cfg.loss_chunk_length,
                     adapters_only=trainer.adapters_only,
                     loss_fn=grpo_loss(dict(beta=0.04), use_reference=True), micro_batches=1,
                     aux_terms=None)
  rng = np.random.default_rng(0)
  host = model_arrays({
      "input_ids": rng.integers(1, trainer.mcfg.vocab_size, (B, S)).astype(np.int32),
      "token_mask": np.ones((B, S), np.float32), "generation_mask": np.ones((B, S), np.float32),
      "old_logprobs": np.full((B, S), -9.0, np.float32),
      "reference_logprobs": np.full((B, S), -9.0, np.float32),
      "advantages": rng.normal(size=B).astype(np.float32)})
  batch = {k: jax.device_put(v, shardings[k]) for k, v in host.items()}
  return jit_update(step, trainer.shardings, shardings, trainer.mesh).lower(
      trainer.abstract, batch).compile(), batch


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--variant", action="append", required=True,
                  help='"label: key=value ... [devices=N] [py:module.NAME=literal] [patch=FILE]" (repeat)')
  ap.add_argument("--model", choices=("readme", "tiny", *FAMILY_MODELS), default="readme")
  ap.add_argument("--devices", type=int, default=2, help="fake CPU devices of the process")
  ap.add_argument("--step", choices=("train", "grpo"), default="train",
                  help="the training step, or GRPO's step on a rollout batch of the same rows")
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
  args = ap.parse_args()
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ["JAX_PLATFORMS"] = "cpu"
  from MaxText.runtime import cpu_devices  # pylint: disable=import-outside-toplevel
  cpu_devices.apply_xla_defaults()   # the XLA:CPU schedule a training run compiles with
  cpu_devices.keep_freed_memory()    # and its host allocator
  pools = cpu_devices.apply_thread_pools(args.devices)   # and its XLA:CPU pools (issue 38)
  print(cpu_devices.scheduler_note(True) + (f"; XLA:CPU pools of {pools} threads" if pools else ""),
        flush=True)

  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  from MaxText.train.state import init_state  # pylint: disable=import-outside-toplevel

  work = tempfile.mkdtemp(prefix="ab_step_")
  runs = []
  for text in args.variant:
    label, n, keys, attrs, files = parse_variant(text)
    keep = "malloc=glibc" not in text.split()
    devices = jax.devices()[:n or args.devices]
    given = {k.split("=", 1)[0] for k in keys}   # a variant's keys replace the model's
    base = [k for k in model_keys(args.model, len(devices)) if k.split("=", 1)[0] not in given]
    cfg = load_config([os.path.join(ROOT, "configs/base.yml"), *base,
                       "jax_cache_dir=", f"base_output_directory={work}", "run_name=ab", *keys],
                      keep_auto=True)   # auto values as a training run resolves them
    with variant_code(attrs, files):   # the code this variant traces
      trainer = Trainer(cfg, devices)
      if args.step == "grpo":
        compiled, batch = grpo_step(trainer)
      else:
        compiled, batch = trainer.compile_step(), synthetic_batch(trainer)
    cfg = trainer.cfg
    state = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings)
    cpu_devices.keep_freed_memory(keep=keep)
    for _ in range(2):   # warm-up
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    runs.append(dict(label=label, cfg=cfg, compiled=compiled, state=state, batch=batch,
                     tokens=trainer.global_batch * cfg.max_target_length, n=len(devices), keep=keep,
                     cpu=[], wall=[], faults=[], loss=float(metrics["loss"])))
    print(f"compiled {label}: {len(devices)} device(s), dtype {cfg.dtype}, "
          f"loss_chunk_length {cfg.loss_chunk_length}, {runs[-1]['tokens']} tokens per step",
          flush=True)

  load0 = os.getloadavg()[0]
  for _ in range(args.rounds):
    for r in runs:
      cpu_devices.keep_freed_memory(keep=r["keep"])
      c0, w0 = time.process_time(), time.perf_counter()
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      for _ in range(args.steps):
        r["state"], metrics = r["compiled"](r["state"], r["batch"])
        jax.block_until_ready(metrics)
      r["cpu"].append((time.process_time() - c0) / args.steps)
      r["wall"].append((time.perf_counter() - w0) / args.steps)
      r["faults"].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / args.steps)
      r["last_loss"] = float(metrics["loss"])
  print(f"\n{args.rounds} rounds x {args.steps} {args.step} steps, model {args.model}, "
        f"{args.devices} fake devices in the process; load average {load0:.2f} -> "
        f"{os.getloadavg()[0]:.2f}\n")
  base = statistics.median(runs[0]["cpu"]) * 1e6 / runs[0]["tokens"]
  print("| variant | devices | CPU-s per step | wall s per step | tokens per step | CPU-ms per 1k "
        "tokens | vs first | tokens/s (wall) | minor page faults per step | loss first -> last |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in runs:
    cpu, wall = statistics.median(r["cpu"]), statistics.median(r["wall"])
    per_k = cpu * 1e6 / r["tokens"]
    print(f"| {r['label']} | {r['n']} | {cpu:.3f} | {wall:.3f} | {r['tokens']} | {per_k:.1f} | "
          f"{per_k / base:.3f} | {r['tokens'] / wall:,.0f} | {statistics.median(r['faults']):,.0f} | "
          f"{r['loss']:.9g} -> "
          f"{r['last_loss']:.9g} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
