"""Single-byte flips in a committed checkpoint: what Orbax alone does with them, what the manifest
does; and what verification costs. Prints the tables of RELIABILITY.md.

  .venv/bin/python benchmarks/checkpoint_faults.py [--flips 400] [--out /tmp/ckpt_faults] [--cost]

1. Trains a tiny model 2 steps (1 CPU device) and, for `--flips` random (file, byte) positions over
   every file of step 2 (at least 2 per file), flips one bit and restores step 2 twice: with Orbax
   alone (the `params` and `opt_state` items onto their target shardings) and through
   `RunCheckpoints.restore` (manifest verified). Outcomes: Orbax raised / returned different values
   / returned identical values; ours refused (exit 4) or not.
2. `--cost`: save (until committed) and restore of a >= 2 GB checkpoint with and without
   verification: the digests' share of the save time, and the restore time with
   `checkpoint_verify` true and false.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from MaxText.checkpoint import manifest  # noqa: E402
from MaxText.checkpoint.checksum import tree_checksums  # noqa: E402
from MaxText.checkpoint.errors import CheckpointError  # noqa: E402
from MaxText.checkpoint.manager import HASHED_ITEMS, RunCheckpoints  # noqa: E402
from MaxText.config.load import load_config  # noqa: E402
from MaxText.train.loop import Trainer, run  # noqa: E402
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


def _timed(fn, seconds: list):
  def wrapper(*args, **kwargs):
    t = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      seconds.append(time.perf_counter() - t)
  return wrapper


def cost(out: str, repeats: int = 2) -> None:
  """Save (until committed) and restore of a >= 2 GB checkpoint (params + Adam state), with and
  without verification; the digests' share of the save is timed inside the save."""
  trainer = Trainer(load_config(argv(out, "big", BIG)), jax.devices()[:1])
  state = init_state(trainer.mcfg, 0, trainer.tx, trainer.shardings)
  size = sum(x.nbytes for x in jax.tree.leaves(state))
  digest_s: list[float] = []
  manifest.write_own_digests = _timed(manifest.write_own_digests, digest_s)
  manifest.file_digests = _timed(manifest.file_digests, digest_s)
  ckpts = RunCheckpoints(os.path.join(out, "big", "checkpoints"), max_to_keep=repeats + 1,
                         async_save=True)
  saves = []
  for step in range(1, repeats + 1):
    before = len(digest_s)
    t = time.perf_counter()
    ckpts.save(step, state, None, trainer.cfg.as_dict())
    ckpts.wait()
    saves.append((time.perf_counter() - t, sum(digest_s[before:])))
  del state
  restores = {False: [], True: []}
  checksum_s: list[float] = []
  manifest.compare_arrays = _timed(manifest.compare_arrays, checksum_s)
  for _ in range(repeats):
    for verify in (False, True):
      before = len(checksum_s)
      t = time.perf_counter()
      restored, _ = ckpts.restore(repeats, trainer.abstract, None, verify=verify)
      jax.block_until_ready(restored)
      restores[verify].append((time.perf_counter() - t, sum(checksum_s[before:])))
      del restored
  ckpts.close()
  step_dir = os.path.join(out, "big", "checkpoints", str(repeats))
  t = time.perf_counter()
  manifest.verify_files(step_dir, manifest.read(step_dir), HASHED_ITEMS)
  files_s = time.perf_counter() - t
  save, digests = min(saves)
  (off, _), (on, sums) = min(restores[False]), min(restores[True])
  print(f"\ncheckpoint of {size / 2**30:.2f} GiB (params + Adam state; {' '.join(BIG[:3])}), 1 CPU "
        f"device, {os.cpu_count()} cores, best of {repeats}")
  print("| | s | verification | share |\n|---|---|---|---|")
  print(f"| save, until committed | {save:.2f} | file digests {digests:.2f} s | "
        f"{100 * digests / save:.0f}% |")
  print(f"| restore, checkpoint_verify=false | {off:.2f} | | |")
  print(f"| restore, checkpoint_verify=true | {on:.2f} | +{on - off:.2f} s | "
        f"{100 * (on - off) / off:.0f}% |")
  print(f"| of which file checks (beside the read) | | +{on - off - sums:.2f} s | "
        f"{100 * (on - off - sums) / off:.0f}% |")
  print(f"| of which array checksums (after the read) | | +{sums:.2f} s | {100 * sums / off:.0f}% |")
  print(f"file checks alone (not overlapped) {files_s:.2f} s")


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
