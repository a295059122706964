"""issue 58: the same mistake gets the same contract in every trainer. A data file that does not
exist, named by a config key, is a config error (exit 2, README "Exit status": the key names it),
printed as one "config error: " line — in train.py, SFT (configs/sft.yml), DPO, distillation and
GRPO alike (DPO read it as bad data, exit 3) — and the refused run leaves no run directory behind
(it left an empty `runs/<run_name>/`). Each refusal comes before anything compiles, so the trainers'
own `main` runs here in-process."""
import os

import pytest

from conftest import BASE_YML, CACHE_DIR, ROOT, argv

CONFIGS = os.path.join(ROOT, "configs")
# architecture keys only: every trainer reads them (conftest.TINY sets keys DPO and GRPO refuse)
MODEL = ["emb_dim=32", "num_decoder_layers=1", "num_query_heads=2", "num_kv_heads=1",
         "head_dim=16", "mlp_dim=64", "vocab_size=264", "max_target_length=16", "dtype=float32",
         f"jax_cache_dir={CACHE_DIR}"]


def _trainer(name: str):
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  if name == "dpo":
    from MaxText.dpo.trainer import DPOTrainer  # pylint: disable=import-outside-toplevel
    return DPOTrainer
  if name == "distill":
    from MaxText.distill.trainer import DistillTrainer  # pylint: disable=import-outside-toplevel
    return DistillTrainer
  if name == "grpo":
    from MaxText.rl.grpo import GRPOTrainer  # pylint: disable=import-outside-toplevel
    return GRPOTrainer
  return Trainer


@pytest.mark.parametrize("trainer,config,key,extra", [
    ("train", BASE_YML, "dataset_path", ["dataset_type=file"]),
    ("sft", os.path.join(CONFIGS, "sft.yml"), "dataset_path", []),
    ("distill", BASE_YML, "dataset_path", ["dataset_type=file", "teacher_path=TEACHER"]),
    ("dpo", os.path.join(CONFIGS, "dpo.yml"), "preferences", []),
    ("grpo", os.path.join(CONFIGS, "grpo.yml"), "prompts", ["reward=grpo_helpers:digits",
                                                             "max_new_tokens=6"]),
])
def test_a_missing_data_file_is_exit_2_with_one_config_error_line_and_no_run_dir(
    tmp_path, capsys, trainer, config, key, extra):
  from MaxText.train.loop import main  # pylint: disable=import-outside-toplevel
  missing = tmp_path / "no_such_data.jsonl"
  out = tmp_path / "runs"
  extra = [e.replace("TEACHER", str(tmp_path / "teacher")) for e in extra]
  code = main(argv(out, "run", *extra, f"{key}={missing}", config=config, model=MODEL),
              trainer_class=_trainer(trainer))
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert "Traceback" not in err
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"config error: {key}") and str(missing) in last, err[-2000:]
  assert not out.exists(), list(out.rglob("*"))   # nor an empty runs/run/
