"""Full fine-tuning vs LoRA (rank 16) of the same model on this CPU, side by side: peak RSS of a
whole train.py run (runs interleaved), step time of the two compiled steps called alternately in
one process (median; on a busy machine the alternation keeps the noise alike, where separate runs
do not); and the trainer's pre-flight memory estimate (parameters + gradients + optimizer state
+ activations + runtime per device) of qwen3-8b full vs LoRA on one 80 GB GPU, fp32 and bf16
weights (computed from the abstract state: nothing is allocated).

Model: d_model 512, 4 layers, 8 heads of 64 (kv 8), SwiGLU mlp 2048, vocab 8192, seq 128, batch
4, synthetic data, 1 device (about 25M parameters), computing as train.py does by default
(dtype=auto: bfloat16, fp32 weights; the runs' config.yml says, and the output prints it). LoRA:
rank 16, alpha 32, the default targets (every attention and MLP projection).

  .venv/bin/python benchmarks/lora.py [--repeats 2] [--steps 12]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_train import run, summarise  # noqa: E402  (same measuring as the reference benchmark)
import yaml  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = {"emb_dim": 512, "num_decoder_layers": 4, "num_query_heads": 8, "num_kv_heads": 8,
         "head_dim": 64, "mlp_dim": 2048, "vocab_size": 8192, "max_target_length": 128}


def cmd(out: str, name: str, steps: int, extra: list[str]) -> list[str]:
  keys = [f"{k}={v}" for k, v in MODEL.items()] + [
      "per_device_batch_size=4", "ici_fsdp_parallelism=1", "dataset_type=synthetic",
      f"steps={steps}", "enable_checkpointing=false", "enable_tensorboard=false", "jax_cache_dir=",
      "sample_at_end=false", f"base_output_directory={out}", f"run_name={name}"]
  return [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs/base.yml"),
          *keys, *extra]


class _GPU80:
  device_kind, process_index, platform = "80 GB GPU", 0, "gpu"

  def memory_stats(self):
    return {"bytes_limit": 80 * 10**9}


def preflight() -> None:
  sys.path.insert(0, ROOT)
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.layers import lora  # pylint: disable=import-outside-toplevel
  from MaxText.train import memory  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  gib = 2**30
  print("\n| qwen3-8b on one 80 GB GPU | weights | params GiB | grads GiB | optimizer GiB | "
        "needed GiB | verdict |")
  print("|---|---|---|---|---|---|---|")
  for weights in ("float32", "bfloat16"):
    for name, extra in (("full fine-tuning", []), ("LoRA rank 16", ["lora_rank=16"])):
      cfg = load_config([os.path.join(ROOT, "configs/base.yml"), "model_name=qwen3-8b",
                         "ici_fsdp_parallelism=1", f"weight_dtype={weights}",
                         f"base_output_directory={tempfile.gettempdir()}", *extra],
                        keep_auto=True)   # as train.py resolves it
      t = Trainer(cfg, jax.devices()[:1])
      est = memory.estimate(t.abstract, [_GPU80()], t.activation_bytes(), trained=
                            lora.split(t.abstract["params"])[0] if extra else None)
      verdict = "accepted" if memory.check_fits(est) is None else "refused (exit 2)"
      print(f"| {name} | {weights} | {est.params / gib:.2f} | {est.grads / gib:.3f} | "
            f"{est.optimizer / gib:.3f} | {est.needed / gib:.2f} | {verdict} |")
  print(f"(compute {t.cfg.dtype}, loss in chunks of {t.cfg.loss_chunk_length or 'the whole'} "
        f"positions, {t.cfg.max_target_length} tokens x {t.global_batch} rows)")


def step_times(repeats: int) -> dict[str, list[float]]:
  """Seconds per step of the two compiled train steps, called alternately on one batch."""
  sys.path.insert(0, ROOT)
  import time  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.data.config import DataConfig  # pylint: disable=import-outside-toplevel
  from MaxText.data.pipeline import make_shard_iterator  # pylint: disable=import-outside-toplevel
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  steps = {}
  trainer = None
  for kind, extra in KINDS:
    argv = cmd(tempfile.gettempdir(), "timing", 1, extra)[2:]
    trainer = Trainer(load_config(argv, keep_auto=True), jax.devices()[:1])   # as train.py
    it = make_shard_iterator(DataConfig.from_config(trainer.cfg), [0], 1, trainer.global_batch)
    batch = trainer.device_batch(next(it))
    it.close()
    steps[kind] = [trainer.compile_step(), trainer.checkpointed.initial_state(None, None)[0], batch]
  times: dict[str, list[float]] = {kind: [] for kind in steps}
  for i in range(repeats + 1):
    for kind, s in steps.items():
      t0 = time.perf_counter()
      s[1], metrics = s[0](s[1], s[2])
      float(metrics["loss"])
      if i:   # the first call of each warms up
        times[kind].append(time.perf_counter() - t0)
  print(f"alternating steps: compute {trainer.cfg.dtype}, weights {trainer.cfg.weight_dtype}")
  return times


def compile_seconds(log_path: str) -> float:
  """train.py's "compiled the train step in X s" line."""
  with open(log_path, encoding="utf-8") as f:
    return next(float(line.split(" in ")[1].split()[0]) for line in f
                if line.startswith("compiled the train step in "))


KINDS = (("full fine-tuning", []), ("LoRA rank 16", ["lora_rank=16", "lora_alpha=32"]))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--first-step", type=int, default=4, help="median over steps >= this")
  ap.add_argument("--repeats", type=int, default=2, help="interleaved repetitions of every run")
  ap.add_argument("--timed-steps", type=int, default=10, help="alternating timed steps of each")
  ap.add_argument("--out", default="", help="work directory (default: a temporary one)")
  args = ap.parse_args()
  out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="lora_bench_")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  results: dict[str, list[dict]] = {}
  for rep in range(args.repeats):
    for kind, extra in KINDS:
      name = f"{'lora' if extra else 'full'}-{rep}"
      log_path = os.path.join(out, f"{name}.log")
      os.makedirs(out, exist_ok=True)
      code, rss, _, _ = run(cmd(out, name, args.steps, extra), env, log_path)
      if code != 0:
        print(f"{kind}: exit {code}; see {log_path}", file=sys.stderr)
        return 1
      s = summarise("ours", os.path.join(out, name), args.first_step, 1)
      s["rss_gib"], s["compile_s"] = rss, compile_seconds(log_path)
      with open(os.path.join(out, name, "config.yml"), encoding="utf-8") as f:
        saved = yaml.safe_load(f)
      results.setdefault(kind, []).append(s)
      print(f"  {kind:17s} {s['step_s']:.3f} s/step, peak RSS {rss:.2f} GiB (compute "
            f"{saved['dtype']}, weights {saved['weight_dtype']})", flush=True)
  times = step_times(args.timed_steps)
  print("\n| run | step s (alternating, median) | step s (own run, median) | compile s | "
        "peak RSS GiB |")
  print("|---|---|---|---|---|")
  for kind, rs in results.items():
    med = lambda k, rs=rs: statistics.median(r[k] for r in rs)
    print(f"| {kind} | {statistics.median(times[kind]):.3f} | {med('step_s'):.3f} | "
          f"{med('compile_s'):.1f} | {med('rss_gib'):.2f} |")
  preflight()
  return 0


if __name__ == "__main__":
  sys.exit(main())
