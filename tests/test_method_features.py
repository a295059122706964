"""issue 55: no training method silently ignores a feature key. For each method (train.py's
pre-training, SFT with configs/sft.yml, distillation, DPO, GRPO) and each feature (LoRA, ZeRO-1,
pipeline stages, the MoE router-bias update, gradient accumulation) the combination is either
honoured by the method's step or refused before anything compiles: exit 2 and one "config error:"
line naming the key and the method (docs/fine-tuning.md, "Methods and features").

A refused pair runs the trainer's own `main` in-process (the refusal comes before any compile, as
in tests/test_missing_data_file.py). An honoured pair is checked at config time only: the config
loads for the method's tool, `validate` (the mesh, pipeline and model checks `main` runs) passes on
the suite's 8 devices, and the method's own cross-key refusals name no key of the feature. That the
honoured pairs also train correctly is the business of the method's own tests: LoRA
(tests/test_lora.py, test_dpo.py, test_distill.py, test_rl_policy.py), ZeRO-1 (tests/test_zero.py;
DPO and GRPO run it by default on the suite's 8-device data axis), pipeline stages
(tests/test_pipeline.py), the router-bias update (tests/test_moe*.py, test_distill.py,
test_rl_policy.py), gradient accumulation (tests/test_train_step.py, test_dpo.py, test_distill.py).
"""
import os

import pytest

from conftest import BASE_YML, CACHE_DIR, ROOT, argv

CONFIGS = os.path.join(ROOT, "configs")
# two layers: two pipeline stages divide them (a one-layer model is refused for that first)
MODEL = ["emb_dim=32", "num_decoder_layers=2", "num_query_heads=2", "num_kv_heads=1",
         "head_dim=16", "mlp_dim=64", "vocab_size=264", "max_target_length=16", "dtype=float32",
         f"jax_cache_dir={CACHE_DIR}"]

METHODS = ("train", "sft", "distill", "dpo", "grpo")
FEATURES = {
    "lora": ["lora_rank=4"],
    "zero1": ["shard_optimizer_over_data=true"],
    "pipeline": ["ici_pipeline_parallelism=2"],
    "router_bias": ["num_experts=4", "num_experts_per_tok=2", "moe_mlp_dim=32",
                    "router_bias_update_rate=0.001"],
    "grad_accum": ["gradient_accumulation_steps=2"],
}
# (method, feature) -> (the key the refusal names, the method as the line names it)
REFUSED = {
    ("distill", "pipeline"): ("ici_pipeline_parallelism", "distillation"),
    ("dpo", "pipeline"): ("ici_pipeline_parallelism", "DPO"),
    ("grpo", "pipeline"): ("ici_pipeline_parallelism", "GRPO"),
    ("dpo", "router_bias"): ("router_bias_update_rate", "DPO"),
    ("grpo", "grad_accum"): ("gradient_accumulation_steps", "GRPO"),
}
PAIRS = [(m, f) for m in METHODS for f in FEATURES]


def _method(name: str, tmp_path) -> tuple[type, str, list[str]]:
  """(trainer class, config file, the overrides that give it data) of a method."""
  from MaxText.train.loop import Trainer  # pylint: disable=import-outside-toplevel
  text = tmp_path / "text.txt"
  text.write_text("12+7=19\n" * 20)
  if name == "dpo":
    from MaxText.dpo.trainer import DPOTrainer  # pylint: disable=import-outside-toplevel
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n' * 4)
    return DPOTrainer, os.path.join(CONFIGS, "dpo.yml"), [f"preferences={prefs}"]
  if name == "distill":
    from MaxText.distill.trainer import DistillTrainer  # pylint: disable=import-outside-toplevel
    return DistillTrainer, BASE_YML, ["dataset_type=file", f"dataset_path={text}",
                                      f"teacher_path={tmp_path / 'teacher'}"]
  if name == "grpo":
    from MaxText.rl.grpo import GRPOTrainer  # pylint: disable=import-outside-toplevel
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 4)
    return GRPOTrainer, os.path.join(CONFIGS, "grpo.yml"), [
        f"prompts={prompts}", "reward=grpo_helpers:digits", "max_new_tokens=6"]
  if name == "sft":
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"prompt": "1+1=", "completion": "2"}\n' * 4)
    return Trainer, os.path.join(CONFIGS, "sft.yml"), [f"dataset_path={chats}"]
  return Trainer, BASE_YML, ["dataset_type=file", f"dataset_path={text}"]


def _own_refusals(name: str, cfg) -> list[tuple[str, str]]:
  # pylint: disable=import-outside-toplevel
  if name == "dpo":
    from MaxText.dpo.trainer import dpo_problems
    return dpo_problems(cfg)
  if name == "distill":
    from MaxText.distill.trainer import distill_problems
    return distill_problems(cfg)
  if name == "grpo":
    from MaxText.rl.grpo import grpo_problems
    return grpo_problems(cfg)
  return []   # pre-training and SFT: train/step.py, which every feature here plugs into


@pytest.mark.parametrize("method,feature", [p for p in PAIRS if p in REFUSED])
def test_a_feature_the_method_does_not_run_is_exit_2_naming_key_and_method(
    tmp_path, capsys, method, feature):
  from MaxText.train.loop import main  # pylint: disable=import-outside-toplevel
  trainer, config, data = _method(method, tmp_path)
  out = tmp_path / "runs"
  code = main(argv(out, "run", *data, *FEATURES[feature], config=config, model=MODEL),
              trainer_class=trainer)
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert "Traceback" not in err
  key, named = REFUSED[(method, feature)]
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"config error: {key}") and named in last, err[-2000:]
  assert not out.exists(), list(out.rglob("*"))


@pytest.mark.parametrize("method,feature", [p for p in PAIRS if p not in REFUSED])
def test_a_feature_the_method_runs_is_not_refused_at_config_time(tmp_path, method, feature):
  import jax  # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config  # pylint: disable=import-outside-toplevel
  from MaxText.resolve.config_checks import validate  # pylint: disable=import-outside-toplevel
  trainer, config, data = _method(method, tmp_path)
  args = argv(tmp_path / "runs", "run", *data, *FEATURES[feature], config=config, model=MODEL)
  cfg = load_config(args, keep_auto=True, tool=trainer.tool)
  validate(cfg, jax.devices())
  keys = {k.split("=")[0] for k in FEATURES[feature]}
  assert not [p for p in _own_refusals(method, cfg) if p[0] in keys]
