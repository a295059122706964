"""Single-byte flips in a committed checkpoint: what Orbax alone does with them, what the manifest
does; and what verification costs. Prints the tables of benchmarks/RESULTS.md.

  .venv/bin/python benchmarks/checkpoint_faults.py [--flips 400] [--out /tmp/ckpt_faults] [--cost]

1. Trains a tiny model 2 steps (1 CPU device) and, for `--flips` random (file, byte) positions over
   every file of step 2 (at least 2 per file), flips one bit and restores step 2 twice: with Orbax
   alone (the `params` and `opt_state` items onto their target shardings) and through
   `RunCheckpoints.restore` (manifest verified). Outcomes: Orbax raised / returned different values
   / returned identical values; ours refused (exit 4) or not.
2. `--cost`: save (until committed), restore and resume (restore + compiling the train step, from
   the compilation cache, as a rerun does) of a >= 2 GB checkpoint with and without verification:
   the checksums' and digests' share of the save time, the restore and resume times with
   `checkpoint_verify` true and false (alternating), and the array checksums alone next to the
   per-element hash they replace.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from MaxText.checkpoint import manifest  # noqa: E402
from MaxText.checkpoint.checksum import legacy_tree_checksums, tree_checksums  # noqa: E402
from MaxText.checkpoint.errors import CheckpointError  # noqa: E402
from MaxText.checkpoint.manager import HASHED_ITEMS, RunCheckpoints  # noqa: E402
from MaxText.config.load import load_config  # noqa: E402
from MaxText.train.loop import Trainer, run, setup_jax  # noqa: E402
from MaxText.train.state import init_state  # noqa: E402

TINY = ["emb_dim=64", "num_decoder_layers=2", "num_query_heads=4", "num_kv_heads=2", "head_dim=16",
        "mlp_dim=128", "vocab_size=264", "max_target_length=64", "per_device_batch_size=8",
        "warmup_steps=2", "enable_tensorboard=false", "peak_tflops_per_device=1.0",
        "ici_fsdp_parallelism=1", "checkpoint_period=1", "dataset_type=synthetic"]
# 201 M parameters: 2.25 GiB of params + Adam moments (fp32)
BIG = ["emb_dim=2048", "num_decoder_layers=2", "mlp_dim=8192", "num_query_heads=16",
       "num_kv_heads=16", "head_dim=128", "vocab_size=16384", "max_target_length=64",
       "per_device_batch_size=1", "ici_fsdp_parallelism=1"]


def argv(out: str, name: str, keys: list[str], *extra: str) -> list[str]:
  return [os.path.join(ROOT, "configs/base.yml"), *keys, f"base_output_directory={out}",
          f"run_name={name}", *extra]


def flip(path: str, pos: int) -> None:
  with open(path, "r+b") as f:
    f.seek(pos)
    byte = f.read(1)[0]
    f.seek(pos)
    f.write(bytes([byte ^ 0x04]))


def kind(rel: str) -> str:
  item, rest = rel.split("/", 1)
  if item in ("meta", "data"):
    return f"{item} JSON"
  return f"{item} array data" if "/d/" in f"/{rest}" else f"{item} metadata ({rest.split('/')[0]})"


def flip_sweep(out: str, flips: int) -> None:
  code, trainer = run(argv(out, "src", TINY, "steps=2"), devices=jax.devices()[:1])
  assert code == 0
  step = os.path.join(out, "src", "checkpoints", "2")
  saved = manifest.read(step)
  abstract = {k: trainer.abstract[k] for k in ("params", "opt_state")}
  with ocp.StandardCheckpointer() as c:
    reference = {k: tree_checksums(c.restore(os.path.join(step, k), abstract[k]), prefix=k)
                 for k in abstract}
  ckpts = RunCheckpoints(os.path.dirname(step), max_to_keep=5, async_save=False)
  files = sorted(saved["files"])
  rng = random.Random(0)
  picks = [(f, rng.randrange(saved["files"][f]["bytes"])) for f in files for _ in range(2)]
  weights = [saved["files"][f]["bytes"] for f in files]
  picks += [(f, rng.randrange(saved["files"][f]["bytes"]))
            for f in rng.choices(files, weights=weights, k=max(0, flips - len(picks)))]
  table = collections.Counter()
  for rel, pos in picks:
    path = os.path.join(step, rel)
    flip(path, pos)
    item = rel.split("/")[0]
    orbax = "n/a (not an array item)"
    if item in abstract:
      try:
        with ocp.StandardCheckpointer() as c:
          got = tree_checksums(c.restore(os.path.join(step, item), abstract[item]), prefix=item)
        orbax = "returned different values" if got != reference[item] else "returned identical values"
      except Exception:  # pylint: disable=broad-except
        orbax = "raised"
    try:
      ckpts.restore(2, trainer.abstract, None)
      ours = "restored"
    except CheckpointError:
      ours = "refused (exit 4)"
    flip(path, pos)
    table[(kind(rel), orbax, ours)] += 1
  ckpts.close()
  print(f"\n{len(picks)} single-bit flips over {len(files)} files of a committed step\n")
  print("| file | flips | Orbax alone | ours (`checkpoint_verify=true`) |")
  print("|---|---|---|---|")
  for (k, orbax, ours), n in sorted(table.items()):
    print(f"| {k} | {n} | {orbax} | {ours} |")


@contextlib.contextmanager
def _unverified_saves():
  """Benchmark only: saves without the manifest's array checksums and file digests (a baseline)."""
  saved = manifest.build, manifest.write_own_digests, manifest.file_digests
  manifest.build = lambda step, arrays, config, **_: lambda: {"format": manifest.FORMAT}
  manifest.write_own_digests = lambda *_: None
  manifest.file_digests = lambda *_: {}
  try:
    yield
  finally:
    manifest.build, manifest.write_own_digests, manifest.file_digests = saved


def _stats(xs: list[float]) -> str:
  return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def _share(on: list[float], off: list[float], base: list[float]) -> str:
  """The median of the paired differences (runs alternate) over the median of `base`."""
  extra = statistics.median(a - b for a, b in zip(on, off))
  return f"{extra:+.2f} s | {100 * extra / statistics.median(base):.0f}%"


def cost(out: str, repeats: int = 5) -> None:
  """Save (until committed), restore, and resume (restore + compiling the train step from the
  persistent compilation cache, as a rerun does) of a >= 2 GB checkpoint (params + Adam state),
  with and without verification, the two alternating (the machine may be shared): the median
  of the paired differences is the verification's cost."""
  load = os.getloadavg()
  cfg = load_config(argv(out, "big", BIG, f"jax_cache_dir={os.path.join(out, 'jax_cache')}"))
  setup_jax(cfg)
  trainer = Trainer(cfg, jax.devices()[:1])
  state = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings)
  size = sum(x.nbytes for x in jax.tree.leaves(state))
  elements = sum(x.size for x in jax.tree.leaves(state))
  arrays = {"params": state["params"], "opt_state": state["opt_state"]}
  jax.block_until_ready(arrays)
  t = time.perf_counter()
  tree_checksums(arrays)
  sums_s = time.perf_counter() - t
  t = time.perf_counter()
  legacy_tree_checksums(arrays)
  legacy_s = time.perf_counter() - t
  ckpts = {verify: RunCheckpoints(os.path.join(out, "big", name), max_to_keep=2, async_save=True)
           for verify, name in ((True, "checkpoints"), (False, "unverified"))}
  saves = {False: [], True: []}
  save_cpu = {False: [], True: []}   # CPU seconds of all this process's threads
  for step in range(1, repeats + 1):
    for verify in (False, True):
      with contextlib.nullcontext() if verify else _unverified_saves():
        t, cpu = time.perf_counter(), time.process_time()
        ckpts[verify].save(step, state, None, trainer.cfg.as_dict())
        ckpts[verify].wait()
        saves[verify].append(time.perf_counter() - t)
        save_cpu[verify].append(time.process_time() - cpu)
  ckpts[False].close()
  del state, arrays
  trainer.compile_step()   # fills the compilation cache, as the run that saved did
  restores = {False: [], True: []}
  restore_cpu = {False: [], True: []}   # CPU seconds of all this process's threads
  resumes = {False: [], True: []}
  for _ in range(repeats):
    for verify in (False, True):
      t, cpu = time.perf_counter(), time.process_time()
      restored, _ = ckpts[True].restore(repeats, trainer.abstract, None, verify=verify)
      jax.block_until_ready(restored)
      restores[verify].append(time.perf_counter() - t)
      restore_cpu[verify].append(time.process_time() - cpu)
      del restored
    for verify in (False, True):
      t = time.perf_counter()   # what a rerun does: compile while the checksums run, or after
      restored, _ = ckpts[True].restore(repeats, trainer.abstract, None, verify=verify,
                                        meanwhile=trainer.compile_step if verify else None)
      if not verify:
        trainer.compile_step()
      jax.block_until_ready(restored)
      resumes[verify].append(time.perf_counter() - t)
      del restored
  ckpts[True].close()
  step_dir = os.path.join(out, "big", "checkpoints", str(repeats))
  t = time.perf_counter()
  manifest.verify_files(step_dir, manifest.read(step_dir), HASHED_ITEMS)
  files_s = time.perf_counter() - t
  print(f"\ncheckpoint of {size / 2**30:.2f} GiB, {elements / 1e6:.0f} M elements (params + Adam "
        f"state; {' '.join(BIG[:3])}), 1 CPU device, {os.cpu_count()} cores; {repeats} runs each, "
        f"with and without verification alternating; load average {load[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after")
  print("| | s: median (range) | verification: median paired difference | share |")
  print("|---|---|---|---|")
  print(f"| save until committed, without checksums and digests | {_stats(saves[False])} | | |")
  print(f"| save until committed, verified | {_stats(saves[True])} | "
        f"{_share(saves[True], saves[False], saves[False])} of the save |")
  print(f"| save's CPU time (all threads), without | {_stats(save_cpu[False])} | | |")
  print(f"| save's CPU time, verified | {_stats(save_cpu[True])} | "
        f"{_share(save_cpu[True], save_cpu[False], save_cpu[False])} of its CPU time |")
  print(f"| restore, checkpoint_verify=false | {_stats(restores[False])} | | |")
  print(f"| restore, checkpoint_verify=true | {_stats(restores[True])} | "
        f"{_share(restores[True], restores[False], restores[False])} of the restore |")
  print(f"| restore's CPU time (all threads), verify=false | {_stats(restore_cpu[False])} | | |")
  print(f"| restore's CPU time, verify=true | {_stats(restore_cpu[True])} | "
        f"{_share(restore_cpu[True], restore_cpu[False], restore_cpu[False])} of its CPU time |")
  print(f"| resume = restore + compile (cached), verify=false | {_stats(resumes[False])} | | |")
  print(f"| resume, verify=true (checksums while compiling) | {_stats(resumes[True])} | "
        f"{_share(resumes[True], resumes[False], restores[False])} of the restore |")
  print(f"array checksums alone: {sums_s:.2f} s ({1e9 * sums_s / elements:.2f} ns per element; "
        f"the per-element hash they replace: {legacy_s:.2f} s); file checks alone {files_s:.2f} s")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--flips", type=int, default=400)
  parser.add_argument("--out", default="/tmp/checkpoint_faults")
  parser.add_argument("--cost", action="store_true", help="only the save/restore cost (>= 2 GB)")
  args = parser.parse_args()
  shutil.rmtree(args.out, ignore_errors=True)
  if not args.cost:
    flip_sweep(args.out, args.flips)
  cost(args.out)


if __name__ == "__main__":
  main()
