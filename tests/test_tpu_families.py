"""benchmarks/tpu_families.sh on a CPU (no TPU, no training run): its dry run lists every row pair,
both sides of a pair carry the same shapes and settings in each trainer's own key names
(benchmarks/tpu_family_rows.py's `KEYS`), our side of each row resolves and our memory pre-flight,
evaluated for one TPU v5e (15.75 GiB), lets it run; MaxText's keys exist in its 0.2.5 configs and
the widths each side reads from its own model file agree (when its wheel is in .whl-tpu/maxtext/,
as benchmarks/tpu_prepare.sh leaves it: skipped without); the report reads the records and says
what was skipped."""
import dataclasses
import glob
import json
import os
import subprocess
import sys
import zipfile

import jax
import pytest
import yaml

from conftest import BASE_YML, MESH_1, ROOT
from MaxText.config.load import load_config
from MaxText.train import memory
from MaxText.train.loop import Trainer

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tpu_family_rows as rows  # noqa: E402

TPU_LIMIT = int(15.75 * 2**30)   # one v5e's bytes_limit


def dry_run(tmp_path, **env) -> dict[tuple[str, str], dict[str, str]]:
  """(row, side) -> that side's keys, from the script's dry run; nothing written."""
  out = tmp_path / "out"
  p = subprocess.run(["bash", "benchmarks/tpu_families.sh", "--dry-run"], cwd=ROOT, text=True,
                     capture_output=True, check=False,
                     env={**os.environ, "PYTHON": sys.executable, "TPU_FAMILIES_OUT": str(out),
                          **env})
  assert p.returncode == 0, p.stderr
  assert not out.exists()
  runs = {}
  for line in p.stdout.splitlines():
    if not line.startswith("[dry-run] ") or "benchmarks/tpu_rows.py" not in line:
      continue
    row, side = line.split()[1:3]
    words = line.split("benchmarks/tpu_rows.py ", 1)[1].split()
    assert words[0] == side
    runs[(row, side)] = rows.parse_keys([w for w in words if "=" in w])
  return runs


def test_quick_dry_run_is_the_moe_pair_with_the_same_shapes_on_both_sides(tmp_path):
  runs = dry_run(tmp_path, TPU_FAMILIES_QUICK="1")
  assert list(runs) == [("moe16", "maxtext"), ("moe16", "ours")]
  ours, mt = runs["moe16", "ours"], runs["moe16", "maxtext"]
  assert (ours["num_decoder_layers"], mt["base_num_decoder_layers"]) == ("4", "4")
  assert ours["model_name"] == mt["model_name"] == "qwen3-30b-a3b"
  for key, want in (("num_experts", "16"), ("num_experts_per_tok", "4"), ("vocab_size", "32768"),
                    ("max_target_length", "2048"), ("per_device_batch_size", "4"),
                    ("remat_policy", "full"), ("dtype", "bfloat16")):
    assert ours[key] == mt[key] == want, key
  assert mt["override_model_config"] == "true" and mt["megablox"] == mt["sparse_matmul"] == "true"
  assert rows.shared_values(ours, "ours") == rows.shared_values(mt, "maxtext")


def test_full_dry_run_translates_every_pair(tmp_path):
  runs = dry_run(tmp_path)
  assert [r for r, side in runs if side == "ours"] == list(rows.DEFAULT_ROWS)
  for name in rows.DEFAULT_ROWS:
    ours, mt = runs[name, "ours"], runs[name, "maxtext"]
    got_ours, got_mt = rows.shared_values(ours, "ours"), rows.shared_values(mt, "maxtext")
    assert got_ours == got_mt, name
    # every shared setting of the row is on both sides, each a single value
    assert set(got_ours) == set(rows.ROWS[name].shared) - {"model"}, name
    assert all(len(v) == 1 for v in got_ours.values()), (name, got_ours)
  assert runs["gemma4", "maxtext"]["scan_layers"] == "false"
  assert runs["next8k", "ours"]["max_target_length"] == "8192"
  assert runs["next8k", "maxtext"]["max_target_length"] == "8192"


def test_an_unknown_row_is_refused(tmp_path):
  p = subprocess.run(["bash", "benchmarks/tpu_families.sh", "--dry-run"], cwd=ROOT, text=True,
                     capture_output=True, check=False,
                     env={**os.environ, "PYTHON": sys.executable, "TPU_FAMILIES_ROWS": "moe16 nope"})
  assert p.returncode == 2 and "no row 'nope'" in p.stderr


def _same(got, want) -> bool:
  """A resolved config value equals the row's (numbers as numbers: per_device_batch_size is a float)."""
  try:
    return float(got) == float(want)
  except (TypeError, ValueError):
    return str(got).lower() == str(want).lower()


@pytest.mark.parametrize("name", list(rows.ROWS))
def test_our_side_resolves_and_the_v5e_pre_flight_lets_it_run(tmp_path, name):
  row = rows.ROWS[name]
  keys = rows.side_keys(row, "ours")
  cfg = load_config([BASE_YML, *MESH_1, f"base_output_directory={tmp_path}",
                     "dataset_type=synthetic", *keys], keep_auto=True)
  for setting, value in row.shared.items():   # the model file did not win over the row's keys
    if setting == "model":
      continue
    for key in rows.KEYS[setting][0]:
      assert _same(getattr(cfg, key), value), (setting, key, getattr(cfg, key))
  trainer = Trainer(cfg, jax.devices()[:1])
  est = dataclasses.replace(trainer.estimate_with(), available=TPU_LIMIT,
                            runtime=memory.RUNTIME_ALLOWANCE_ACCELERATOR, platform="tpu")
  assert memory.check_fits(est) is None, memory.check_fits(est)
  assert est.fits, est.needed / 2**30


def _maxtext_configs():
  wheels = glob.glob(os.path.join(ROOT, ".whl-tpu", "maxtext", "maxtext-*.whl"))
  if not wheels:
    pytest.skip("no MaxText wheel in .whl-tpu/maxtext (bash benchmarks/tpu_prepare.sh)")
  return zipfile.ZipFile(wheels[0])


def test_maxtext_keys_exist_in_its_configs():
  with _maxtext_configs() as z:
    base = yaml.safe_load(z.read("maxtext/configs/base.yml"))
    models = {n for n in z.namelist() if n.startswith("maxtext/configs/models/")}
  for name, row in rows.ROWS.items():
    if row.maxtext_only is None:
      continue
    keys = rows.parse_keys(rows.side_keys(row, "maxtext"))
    assert f"maxtext/configs/models/{keys['model_name']}.yml" in models, name
    unknown = sorted(k for k in keys if k not in base)
    assert not unknown, (name, unknown)


def test_the_widths_of_both_model_files_agree(tmp_path):
  """What each side reads from its own model file (not passed as keys) is the same model."""
  with _maxtext_configs() as z:
    for name, row in rows.ROWS.items():
      if row.maxtext_only is None:
        continue
      ours_model, mt_model = row.shared["model"]
      mt = yaml.safe_load(z.read(f"maxtext/configs/models/{mt_model}.yml"))
      cfg = load_config([BASE_YML, f"base_output_directory={tmp_path}",
                         *rows.side_keys(row, "ours")], keep_auto=True)
      compared = []
      for width, (ours_key, mt_key) in rows.WIDTHS.items():
        if mt_key not in mt or (width == "dense_mlp" and cfg.num_experts):
          continue
        assert _same(getattr(cfg, ours_key), mt[mt_key]), (name, width, getattr(cfg, ours_key),
                                                           mt[mt_key])
        compared.append(width)
      assert {"emb", "query_heads", "kv_heads", "head_dim"} <= set(compared), (name, compared)


def test_report_gives_the_ratio_and_what_was_skipped(tmp_path):
  (tmp_path / "rows.txt").write_text("moe16\ngemma4\n")
  rec = {"exit_status": 0, "tokens_per_s_per_device": 30000.0, "mfu": 0.25,
         "tflop_per_step_per_device": 12.38, "step_time_s": 0.27, "first_step_s": 60.0}
  (tmp_path / "moe16_maxtext.json").write_text(json.dumps(rec) + "\n")
  (tmp_path / "moe16_ours.json").write_text(json.dumps({**rec, "tokens_per_s_per_device": 39000.0}))
  (tmp_path / "moe16_ours.log").write_text("memory per device: the compiled step's buffers 11.20 GiB "
                                           "+ runtime ~0.25 GiB of 15.75 GiB available\n")
  (tmp_path / "gemma4_maxtext.json").write_text(json.dumps(
      {"exit_status": 1, "log_tail": "a\nRESOURCE_EXHAUSTED: out of memory\n"}))
  (tmp_path / "skipped.txt").write_text("gemma4/ours 40 s left of the 520 s budget\n")
  text = rows.report(str(tmp_path), "abc1234", 500)
  moe = next(ln for ln in text.splitlines() if ln.startswith("| moe16:"))
  assert "**1.30×**" in moe and "30,000 tok/s" in moe and "11.20 GiB" in moe
  gemma = next(ln for ln in text.splitlines() if ln.startswith("| gemma4:"))
  assert "failed (exit 1): RESOURCE_EXHAUSTED: out of memory" in gemma
  assert "skipped: 40 s left of the 520 s budget" in gemma and "| – |" in gemma
  assert "abc1234" in text and "load_balance_loss_weight=0.001" in text
