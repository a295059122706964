"""The held-out share of `MaxText.evaluate` and of GPTQ calibration is the one the run behind the
checkpoint held out (MaxText/resolve/held_out.py): evaluating a run that trained with
`eval_split_fraction=0` on a 0.05 share (documents it trained on) is refused with the fix, as is
another share than the run's; `eval_split_fraction=0` evaluates on every document and says the run
trained on them; calibration with another share than the run's is refused; a quantized checkpoint
keeps its run's share; another dataset or a conversion's config is not compared."""
import os

import jax
import pytest

from conftest import BASE_YML, MESH_1, train
from MaxText import evaluate, quantize
from MaxText.config.load import ConfigError, load_config
from MaxText.resolve import held_out

ONE = jax.devices()[:1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{eval_split_fraction: the checkpoints of a 2-step run on the embedded data that used it}."""
  out = tmp_path_factory.mktemp("held_out")
  found = {}
  for share in (0.0, 0.1):
    name = f"share{share}"
    code, _, _ = train(out, name, *MESH_1, "steps=2", "per_device_batch_size=1",
                       f"eval_split_fraction={share}", devices=ONE)
    assert code == 0
    found[share] = str(out / name / "checkpoints")
  return out, found


def evaluate_exit(ckpt, *args):
  out = os.path.dirname(os.path.dirname(ckpt))
  return evaluate.main([BASE_YML, f"load_parameters_path={ckpt}", "eval_steps=1",
                        "per_device_batch_size=1", f"base_output_directory={out}",
                        "run_name=evaluate", *args])


def test_evaluate_refuses_a_share_the_run_trained_on(runs, capsys):
  _, ckpts = runs
  assert evaluate_exit(ckpts[0.0], "eval_split_fraction=0.05") == 2
  err = capsys.readouterr().err
  assert "eval_split_fraction=0.05: the run that wrote load_parameters_path=" in err
  assert "with eval_split_fraction=0, so it read every document of this share" in err
  assert "give eval_dataset_path=" in err
  assert evaluate_exit(ckpts[0.1], "eval_split_fraction=0.05") == 2
  err = capsys.readouterr().err
  assert "is not the one it held out" in err and "set eval_split_fraction=0.1" in err


def test_evaluate_on_the_runs_share_or_everything(runs, capsys):
  _, ckpts = runs
  assert evaluate_exit(ckpts[0.1], "eval_split_fraction=0.1") == 0
  assert "note:" not in capsys.readouterr().out
  assert evaluate_exit(ckpts[0.0]) == 0
  assert "trained on all of them" in capsys.readouterr().out
  assert evaluate_exit(ckpts[0.1]) == 0
  assert "all but its eval_split_fraction=0.1 share" in capsys.readouterr().out


def test_calibration_refuses_another_share(runs, capsys):
  out, ckpts = runs
  code = quantize.main([BASE_YML, f"load_parameters_path={ckpts[0.1]}",
                        f"output_path={out / 'q'}", "method=gptq", "bits=4", "group_size=32",
                        "calibration_steps=1", "per_device_batch_size=1",
                        f"base_output_directory={out}", "run_name=q"])
  assert code == 2
  err = capsys.readouterr().err
  assert "held out eval_split_fraction=0.1" in err and "set eval_split_fraction=0.1" in err


def test_a_quantized_checkpoint_keeps_its_runs_share(runs, capsys):
  """Quantized with a calibration share of its own (0.05, the run's was 0), the checkpoint still
  says what its weights were trained on: evaluating it on that 0.05 share is refused, as for the
  run's own checkpoint (it wrote the command's 0.05, and the evaluation read trained-on text)."""
  out, ckpts = runs
  q = str(out / "q_of_share0")
  assert quantize.main([BASE_YML, f"load_parameters_path={ckpts[0.0]}", f"output_path={q}",
                        "method=rtn", "bits=8", "eval_split_fraction=0.05",
                        f"base_output_directory={out}", "run_name=q"]) == 0
  capsys.readouterr()
  assert held_out.trained_on(q)["eval_split_fraction"] == 0.0
  assert evaluate_exit(q, "eval_split_fraction=0.05") == 2
  assert "with eval_split_fraction=0, so it read every document of this share" in \
      capsys.readouterr().err


def test_another_dataset_is_not_compared(runs, tmp_path):
  _, ckpts = runs
  text = tmp_path / "other.txt"
  text.write_text("other documents\n")
  cfg = load_config([BASE_YML, f"load_parameters_path={ckpts[0.0]}", "dataset_type=file",
                     f"dataset_path={text}", "eval_split_fraction=0.05"])
  assert held_out.run_share(cfg) is None and held_out.check_evaluation(cfg) is None
  same = load_config([BASE_YML, f"load_parameters_path={ckpts[0.0]}", "eval_split_fraction=0.05"])
  with pytest.raises(ConfigError, match="eval_split_fraction=0.05"):
    held_out.check_evaluation(same)


def test_a_conversion_is_not_compared(tmp_path):
  pytest.importorskip("transformers")
  import sft_helpers as h
  from MaxText.checkpoint.manager import hf_source
  from MaxText.checkpoint_conversion import to_maxtext
  h.save_qwen3_chat(tmp_path / "hf")
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ckpt'}"]) == 0
  assert hf_source(str(tmp_path / "ckpt")) == str(tmp_path / "hf")
  cfg = load_config([BASE_YML, f"load_parameters_path={tmp_path / 'ckpt'}",
                     "eval_split_fraction=0.05"])   # its config's data keys are the defaults
  assert held_out.run_share(cfg) is None and held_out.check_evaluation(cfg) is None
