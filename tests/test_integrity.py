"""Checkpoint integrity: every committed step carries a manifest; a truncated file, deleted metadata
or a flipped byte is refused with exit 4 naming the array or file (or, with checkpoint_fallback,
the previous good step is restored and the bad one set aside); a missing data iterator state is
exit 3; restoring needs target shardings."""
import json
import os
import random
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import MESH_1, argv, train

ONE = dict(devices=jax.devices()[:1])
RUN = ("steps=2", "checkpoint_period=1", "max_checkpoints_to_keep=5", *MESH_1)
RESUME = ("steps=3", "checkpoint_period=1", "max_checkpoints_to_keep=5", *MESH_1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A run with committed steps 1 and 2 (copied per test before being damaged)."""
  out = tmp_path_factory.mktemp("saved")
  code, _, _ = train(out, "src", *RUN, **ONE)
  assert code == 0
  return out / "src"


def _copy(saved, tmp_path, name="run"):
  shutil.copytree(saved, tmp_path / name)
  return tmp_path / name / "checkpoints" / "2"


def _largest_data_file(step_dir, item="params"):
  files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir / item / "ocdbt.process_0" / "d")
           for f in fs]
  return max(files, key=os.path.getsize)


def _flip(path, pos):
  with open(path, "r+b") as f:
    f.seek(pos)
    byte = f.read(1)[0]
    f.seek(pos)
    f.write(bytes([byte ^ 0x10]))


def _resume(tmp_path, capsys, *extra):  # noqa
  code, rows, _ = train(tmp_path, "run", *RESUME, *extra, **ONE)
  out = capsys.readouterr()
  return code, rows, out.out + out.err


def test_checksum_is_mesh_independent_and_catches_every_bit_flip():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from MaxText.checkpoint.checksum import tree_checksums
  x = np.random.default_rng(0).standard_normal((8, 16, 4)).astype(np.float32)
  tree = {"f32": x, "bf16": x.astype(jax.numpy.bfloat16), "i32": np.arange(7, dtype=np.int32)}
  host = tree_checksums(tree)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  for spec in (P("a", "b"), P(None, "a", "b")):
    placed = dict(tree, f32=jax.device_put(x, NamedSharding(mesh, spec)),
                  bf16=jax.device_put(tree["bf16"], NamedSharding(mesh, spec)))
    assert tree_checksums(placed) == host
  small = x[:2, :3, :2].copy()
  base = tree_checksums({"a": small})["a"]
  bits = small.view(np.uint32)
  seen = set()
  for i in range(bits.size):
    for bit in range(32):
      flipped = bits.copy().reshape(-1)
      flipped[i] ^= np.uint32(1 << bit)
      seen.add(tree_checksums({"a": flipped.view(np.float32).reshape(small.shape)})["a"])
  assert len(seen) == bits.size * 32 and base not in seen


def test_checksum_on_the_host_equals_the_one_on_devices():
  """NumPy over the shards in host memory (what CPU runs use) and the one fused XLA pass (what
  GPU/TPU use) give the same sums: every dtype width, bool, a scalar, sharded, replicated and
  partly replicated over 8 devices, computed now or on threads."""
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from MaxText.checkpoint import checksum
  rng = np.random.default_rng(1)
  x = rng.standard_normal((8, 12, 4)).astype(np.float32)
  tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i8": (x * 9).astype(np.int8),
          "u32": rng.integers(0, 2**32, (5, 3), dtype=np.uint64).astype(np.uint32),
          "b": x > 0, "scalar": np.float32(-2.5), "v": x[0, :, 0].copy()}
  host = checksum.tree_checksums(tree)
  assert len(set(host.values())) == len(host)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  for spec in (P("a", "b"), P(None, "b"), P()):
    placed = dict(tree, **{k: jax.device_put(tree[k], NamedSharding(mesh, spec))
                           for k in ("f32", "bf16", "i8", "b")})
    assert checksum.tree_checksums(placed) == host
    assert checksum.start_tree_checksums(placed, background=True)() == host
    on_devices = checksum._start_device(jax.tree.leaves(placed))()   # noqa: SLF001 (the GPU path)
    assert [f"{v:016x}" for v in on_devices] == [host[k] for k in sorted(tree)]


def test_manifests_of_the_former_checksum_still_verify(saved):
  """A manifest without a "checksum" field (written before the weighted sums) is checked with its
  own per-element hash; a kind this version does not know is a problem, not a pass."""
  from MaxText.checkpoint import checksum, manifest
  from MaxText.checkpoint.manager import load_params
  m = manifest.read(str(saved / "checkpoints" / "2"))
  assert m["checksum"] == checksum.KIND
  params = load_params(str(saved / "checkpoints"), None)
  old = {k: v for k, v in m.items() if k != "checksum"}
  old["arrays"] = {k: dict(v, checksum=checksum.legacy_tree_checksums(
      {"params": params}).get(k, v["checksum"])) for k, v in m["arrays"].items()}
  assert old["arrays"] != m["arrays"] and manifest.compare_arrays(old, {"params": params}) == []
  w = params["decoder"]["runs"]["0"]["0"]["mlp"]["up"]["kernel"]
  w[0, 1, 2] = -w[0, 1, 2]
  assert [p.split(":")[0] for p in manifest.compare_arrays(old, {"params": params})] == [
      "params/decoder/runs/0/0/mlp/up/kernel"]
  assert manifest.compare_arrays(dict(m, checksum="crc9"), {"params": params}) == [
      "the manifest's checksums are of an unknown kind 'crc9'"]


def test_array_values_differing_are_found_while_the_step_compiles(saved, tmp_path, capsys):
  """Values that differ from the manifest with every file intact (here: the manifest's checksum
  of one array changed; manifest.json is not among the digested files): the checksums run while
  the train step compiles, and the run exits 4 naming the array before any step trains; with
  checkpoint_fallback the previous step is restored and the step compiles only once."""
  step = _copy(saved, tmp_path)
  path = step / "manifest" / "manifest.json"
  m = json.loads(path.read_text())
  name = "params/decoder/runs/0/0/mlp/up/kernel"
  m["arrays"][name]["checksum"] = f"{int(m['arrays'][name]['checksum'], 16) ^ 1:016x}"
  path.write_text(json.dumps(m))
  code, rows, log = _resume(tmp_path, capsys)
  assert code == 4 and len(rows) == 2                # nothing trained
  assert "compiled the train step" in log and f"{name}: checksum" in log
  assert "(values differ)" in log and "checkpoint step 2 is damaged" in log
  code, rows, log = _resume(tmp_path, capsys, "checkpoint_fallback=true")
  assert code == 0 and "falling back to step 1" in log
  assert log.count("compiled the train step") == 1
  assert [r["step"] for r in rows][-2:] == [2, 3]


def test_manifest_lists_arrays_and_files(saved):
  from MaxText.checkpoint import manifest
  m = manifest.read(str(saved / "checkpoints" / "2"))
  assert m["step"] == 2 and m["config"]["steps"] == 2 and m["code_version"]["git"]
  q = m["arrays"]["params/decoder/runs/0/0/attn/query/kernel"]
  assert q["shape"] == [2, 64, 4, 16] and q["dtype"] == "float32" and len(q["checksum"]) == 16
  assert any(k.startswith("opt_state/") for k in m["arrays"])
  assert {"params/_METADATA", "params/manifest.ocdbt", "meta/metadata",
          "data/shard_0-of-1.json"} <= set(m["files"])


def test_each_process_digests_what_it_wrote(saved):
  """The array data a process wrote is digested by that process (params/files.process_0.json);
  process 0's commit-time files.json holds only the files of the whole step; at a restore with n
  processes each file is verified by exactly one of them."""
  from MaxText.checkpoint import manifest
  step = str(saved / "checkpoints" / "2")
  for item in ("params", "opt_state"):
    with open(os.path.join(step, item, "files.process_0.json"), encoding="utf-8") as f:
      own = json.load(f)
    written = {os.path.relpath(os.path.join(d, n), step)
               for d, _, names in os.walk(os.path.join(step, item)) for n in names}
    assert set(own) == {r for r in written if manifest.writer_of(r) == 0}
    assert any("/ocdbt.process_0/d/" in r for r in own)
  with open(os.path.join(step, "manifest", "files.json"), encoding="utf-8") as f:
    shared = json.load(f)
  assert shared and all(manifest.writer_of(r) is None for r in shared)
  assert "params/files.process_0.json" in shared        # the lists are checked too
  assert manifest.writer_of("opt_state/array_metadatas/process_3") == 3
  for n in (1, 2, 3):
    assert manifest.verifier_of("params/ocdbt.process_5/d/ab", n) == 5 % n
    assert manifest.verifier_of("params/_METADATA", n) == 0


def test_truncated_array_file_exits_4_naming_the_arrays(saved, tmp_path, capsys):
  from MaxText.checkpoint import manifest
  step = _copy(saved, tmp_path)
  victim = _largest_data_file(step)
  os.truncate(victim, os.path.getsize(victim) // 2)
  code, rows, log = _resume(tmp_path, capsys)
  assert code == 4 and len(rows) == 2  # nothing trained
  assert "checkpoint step 2 cannot be read" in log
  named = re.findall(r"(params/[\w/]+): unreadable", log)  # the arrays stored in that file
  arrays = manifest.read(str(step))["arrays"]
  assert named and all(n in arrays for n in named), log
  assert f"{os.path.relpath(victim, step)}: " in log and "truncated" in log


def test_deleted_metadata_exits_4(saved, tmp_path, capsys):
  step = _copy(saved, tmp_path)
  os.remove(step / "params" / "_METADATA")  # Orbax alone would restore without it
  code, _, log = _resume(tmp_path, capsys)
  assert code == 4
  assert "params/_METADATA: missing" in log


def test_flipped_byte_exits_4_and_fallback_restores_previous_step(saved, tmp_path, capsys):
  step = _copy(saved, tmp_path)
  victim = _largest_data_file(step, "opt_state")
  _flip(victim, os.path.getsize(victim) // 3)
  code, _, log = _resume(tmp_path, capsys)
  assert code == 4
  assert "checkpoint step 2" in log and os.path.relpath(victim, step) in log
  # the message says what to do: the older step 1 can be restored instead
  assert "(checkpoint_fallback=true sets this step aside and restores the newest good one of " \
         "the older steps 1)" in log
  # with fallback: step 1 is restored, step 2 set aside, the run finishes and saves 2 and 3 anew
  code, rows, log = _resume(tmp_path, capsys, "checkpoint_fallback=true")
  assert code == 0
  assert "falling back to step 1" in log and "resumed from" in log and log.count("unusable") >= 1
  assert [r["step"] for r in rows][-2:] == [2, 3]
  names = os.listdir(tmp_path / "run" / "checkpoints")
  assert {"1", "2", "3"} <= set(names) and any(n.startswith("2.unusable-") for n in names)


def test_exit_4_says_when_no_older_good_step_exists(monkeypatch):
  """The last step tried is unusable: the message says there is nothing older to fall back to
  (one step) or that every step was unusable (with checkpoint_fallback)."""
  from MaxText.checkpoint.errors import CheckpointError
  from MaxText.checkpoint.manager import RunCheckpoints
  ckpts = object.__new__(RunCheckpoints)
  def damaged(step, *args, **kwargs):
    raise CheckpointError(f"checkpoint step {step} is damaged: params/x: checksum")
  monkeypatch.setattr(ckpts, "restore", damaged)
  monkeypatch.setattr(ckpts, "_set_aside", lambda step: f"{step}.unusable")
  monkeypatch.setattr(ckpts, "all_steps", lambda: [3])
  with pytest.raises(CheckpointError, match=r"step 3 is damaged.*\(no older step to fall back to"):
    ckpts.restore_latest({}, None, verify=True, fallback=False, log=print)
  monkeypatch.setattr(ckpts, "all_steps", lambda: [2, 3])
  with pytest.raises(CheckpointError, match=r"checkpoint_fallback=true .* older steps 2\)"):
    ckpts.restore_latest({}, None, verify=True, fallback=False, log=print)
  with pytest.raises(CheckpointError, match=r"step 2 is damaged.*no older good step exists"):
    ckpts.restore_latest({}, None, verify=True, fallback=True, log=print)


def test_manifest_catches_every_single_byte_flip(saved, tmp_path):
  """Flips at 400 random positions over every file of the step (at least 3 per file): the
  file digests catch all of them; a restore through the manifest refuses each of 4 samples."""
  from MaxText.checkpoint import manifest
  from MaxText.checkpoint.errors import CheckpointError
  from MaxText.checkpoint.manager import HASHED_ITEMS, RunCheckpoints
  from MaxText.config.load import load_config
  from MaxText.train.loop import Trainer
  step = _copy(saved, tmp_path)
  m = manifest.read(str(step))
  assert manifest.verify_files(str(step), m, HASHED_ITEMS) == []
  files = sorted(m["files"])
  rng = random.Random(0)
  picks = [(f, rng.randrange(m["files"][f]["bytes"])) for f in files for _ in range(3)]
  picks += [(f, rng.randrange(m["files"][f]["bytes"]))
            for f in rng.choices(files, weights=[m["files"][f]["bytes"] for f in files],
                                 k=400 - len(picks))]
  for rel, pos in picks:
    _flip(step / rel, pos)
    problems = manifest.verify_files(str(step), m, HASHED_ITEMS)
    assert problems == [f"{rel}: contents changed (sha256 differs)"], (rel, pos)
    _flip(step / rel, pos)  # back
  assert manifest.verify_files(str(step), m, HASHED_ITEMS) == []
  trainer = Trainer(load_config(argv(tmp_path, "run", *RESUME)), jax.devices()[:1])
  ckpts = RunCheckpoints(str(step.parent), max_to_keep=5, async_save=False)
  # the 4 samples, plus a flip in each per-process digest list (read before anything is checked)
  lists = [(f, rng.randrange(m["files"][f]["bytes"])) for f in files
           if re.fullmatch(r".*/files\.process_\d+\.json", f)]
  assert lists
  for rel, pos in rng.sample(picks, 4) + lists:
    _flip(step / rel, pos)
    with pytest.raises(CheckpointError, match="checkpoint step 2"):
      ckpts.restore(2, trainer.abstract, None)
    _flip(step / rel, pos)
  state, _ = ckpts.restore(2, trainer.abstract, None)  # undamaged again: restores and verifies
  ckpts.close()


def test_array_checksums_name_the_array_whose_values_differ(saved):
  from MaxText.checkpoint import manifest
  from MaxText.checkpoint.manager import load_params
  m = manifest.read(str(saved / "checkpoints" / "2"))
  params = load_params(str(saved / "checkpoints"), None)
  assert manifest.compare_arrays(m, {"params": params}) == []
  w = params["decoder"]["runs"]["0"]["0"]["mlp"]["up"]["kernel"]   # Orbax keys: strings
  w[1, 5, 7] = np.nextafter(w[1, 5, 7], np.float32(np.inf))  # one ulp of one element
  problems = manifest.compare_arrays(m, {"params": params})
  assert len(problems) == 1 and problems[0].startswith("params/decoder/runs/0/0/mlp/up/kernel:")


def test_checkpoint_of_another_model_shape_exits_4(saved, tmp_path, capsys):
  _copy(saved, tmp_path)
  code, _, log = _resume(tmp_path, capsys, "mlp_dim=96")
  assert code == 4
  assert "does not fit this model" in log and "params/decoder/runs/0/0/mlp/up/kernel" in log


def test_missing_iterator_state_exits_3(saved, tmp_path, capsys):
  step = _copy(saved, tmp_path)
  os.remove(step / "data" / "shard_0-of-1.json")
  code, rows, log = _resume(tmp_path, capsys)
  assert code == 3 and len(rows) == 2
  assert "no data iterator state" in log and "record 0" in log


def test_iterator_state_of_another_data_config_exits_3(saved, tmp_path, capsys):
  _copy(saved, tmp_path)
  code, _, log = _resume(tmp_path, capsys, "data_shuffle_seed=7")
  assert code == 3
  assert "data_shuffle_seed: saved 0, now 7" in log


def test_restore_needs_target_shardings(saved):
  """A target without shardings would place arrays as on the saving mesh: refused. Host numpy
  (load_params(path, None)) is mesh-free and exact."""
  from MaxText.checkpoint.errors import CheckpointError
  from MaxText.checkpoint.manager import RunCheckpoints, load_params
  from MaxText.config.load import load_config
  from MaxText.train.loop import Trainer
  trainer = Trainer(load_config(argv(saved.parent, "src", *RESUME)), jax.devices()[:1])
  bare = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), trainer.abstract)
  ckpts = RunCheckpoints(str(saved / "checkpoints"), max_to_keep=5, async_save=False)
  with pytest.raises(CheckpointError, match="without target shardings"):
    ckpts.restore(2, bare, None)
  with pytest.raises(CheckpointError, match="without target shardings"):
    ckpts.restore(2, None, None)
  with pytest.raises(CheckpointError, match="without target shardings"):
    load_params(str(saved / "checkpoints"), bare["params"])
  state, _ = ckpts.restore(2, trainer.abstract, None)
  ckpts.close()
  host = load_params(str(saved / "checkpoints"), None)
  for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(state["params"])):
    assert isinstance(a, np.ndarray)
    np.testing.assert_array_equal(a, np.asarray(b))
