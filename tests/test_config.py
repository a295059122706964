"""Config: base.yml ↔ schema agreement, merge order, type coercion, errors (load and validate),
the CLI's exit-status contract, and the resolved config.yml written into the run directory."""
import dataclasses
import os
import re
import shutil
import subprocess
import sys

import jax
import pytest
import yaml

from conftest import BASE_YML, MESH_1, ROOT, argv, train
from MaxText.config import render, schema, yaml_io
from MaxText.config.load import ConfigError, load_config
from MaxText.config.schema import KEYS, in_base_yml
from MaxText.config.spec import key
from MaxText.resolve.config_checks import validate


def rendered() -> dict:
  """The keys base.yml holds: the common schema's and the repository's families' (a family a test
  registers at run time, tests/test_plugin_family.py, adds keys that base.yml does not render)."""
  return {k: spec for k, spec in KEYS.items() if in_base_yml(k)}


KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:")


# ---- base.yml and the schema ------------------------------------------------------------------
def undocumented_keys(text: str) -> list[str]:
  """Top-level keys of a YAML text that have no comment.

  A key line is documented if it carries an inline `#` comment, if the line right above it is a
  full-line `#` comment (a comment block describing it), or if it continues, without a blank line,
  a documented run of keys of the same family (same name prefix up to the first `_`, e.g. the
  `dcn_*_parallelism` block under the commented `dcn_data_parallelism`)."""
  bad = []
  prev_line, prev_key, prev_documented = "", None, False
  for line in text.splitlines():
    m = KEY_LINE.match(line)
    if m:
      key = m.group(1)
      documented = ("#" in line.split(":", 1)[1]
                    or prev_line.lstrip().startswith("#")
                    or (prev_key is not None and prev_documented
                        and prev_key.split("_")[0] == key.split("_")[0]))
      if not documented:
        bad.append(key)
      prev_key, prev_documented = key, documented
    elif not line.startswith((" ", "\t", "]")) or not line.strip():
      prev_key, prev_documented = None, False  # blank line or comment ends a run of keys
    prev_line = line
  return bad


def test_base_yml_keys_equal_schema_fields():
  with open(BASE_YML, encoding="utf-8") as f:
    raw = yaml.safe_load(f)
  want = rendered()
  assert set(raw) == set(want), (sorted(set(raw) - set(want)), sorted(set(want) - set(raw)))


def test_every_base_yml_key_is_documented():
  with open(BASE_YML, encoding="utf-8") as f:
    text = f.read()
  keys = [m.group(1) for m in map(KEY_LINE.match, text.splitlines()) if m]
  assert set(keys) == set(rendered())  # the line scan sees every key
  assert undocumented_keys(text) == []


def test_base_yml_is_rendered_from_the_schema():
  """configs/base.yml is what `python -m MaxText.config.render` writes (defaults, docs, sections
  all come from MaxText/config/schema.py); a schema edit without a re-render fails here."""
  with open(BASE_YML, encoding="utf-8") as f:
    assert f.read() == render.render(), "configs/base.yml is stale: python -m MaxText.config.render"
  assert render.main(["--check"]) == 0
  raw = yaml.safe_load(render.render())
  assert raw == {k: spec.default for k, spec in rendered().items()}   # parses back to the defaults
  loaded = load_config([BASE_YML], keep_auto=True).as_dict()
  assert {k: loaded[k] for k in raw} == raw
  assert all(loaded[k] == KEYS[k].default for k in set(loaded) - set(raw))   # a plug-in's keys


def test_implementation_tables_match_the_schemas_choices():
  """Where code maps a key's allowed values to implementations, the table has exactly the
  schema's choices (the data package's tables are checked in tests/test_data.py)."""
  from MaxText.config.schema import choices
  from MaxText.layers.attention_ops import ATTENTION_OPS
  from MaxText.layers.mlp import ACTIVATIONS
  from MaxText.layers.moe import RAGGED_ALL_TO_ALL
  from MaxText.layers.stack import REMAT_POLICIES
  from MaxText.train.memory_plan import SPEED_ORDER
  assert set(REMAT_POLICIES) == set(choices("remat_policy")) - {"auto"} == set(SPEED_ORDER)
  assert set(ACTIVATIONS) == set(choices("mlp_activation"))
  assert set(RAGGED_ALL_TO_ALL) == set(choices("moe_dispatch")) - {"auto"}
  assert set(choices("attention")) - {"autoselected"} <= set(ATTENTION_OPS)


def test_documentation_checker_catches_a_bare_key():
  text = ("steps: 3   # number of steps\n"
          "seed: 0\n"                        # bare key after a different family
          "\n# the mesh\nici_data_parallelism: 1\n"
          "ici_fsdp_parallelism: 1\n"        # continues the documented ici_ run
          "\nici_tensor_parallelism: 1\n")   # blank line ended the run
  assert undocumented_keys(text) == ["seed", "ici_tensor_parallelism"]


# ---- merge order and coercion -----------------------------------------------------------------
@pytest.fixture
def configs_dir(tmp_path):
  """A copy of configs/base.yml plus configs/models/foo.yml."""
  d = tmp_path / "configs"
  (d / "models").mkdir(parents=True)
  shutil.copy(BASE_YML, d / "base.yml")
  (d / "models" / "foo.yml").write_text("emb_dim: 128\nnum_decoder_layers: 2\nrope_theta: 5.0e+5\n")
  return d


def test_merge_order_base_then_model_then_command_line(configs_dir):
  base = str(configs_dir / "base.yml")
  plain = load_config([base])
  assert (plain.emb_dim, plain.num_decoder_layers, plain.mlp_dim) == (256, 4, 1024)
  overlay = load_config([base, "model_name=foo"])
  assert overlay.model_name == "foo"
  assert (overlay.emb_dim, overlay.num_decoder_layers, overlay.mlp_dim) == (128, 2, 1024)
  assert overlay.rope_theta == 5.0e5 and isinstance(overlay.rope_theta, float)
  both = load_config([base, "model_name=foo", "emb_dim=32", "mlp_dim=64"])
  assert (both.emb_dim, both.num_decoder_layers, both.mlp_dim) == (32, 2, 64)
  # model_name set in base.yml itself also selects the overlay
  text = (configs_dir / "base.yml").read_text()
  (configs_dir / "base.yml").write_text(text.replace('model_name: "default"', 'model_name: "foo"'))
  assert load_config([base]).emb_dim == 128
  assert load_config([base, "emb_dim=16"]).emb_dim == 16


def test_type_coercion():
  cfg = load_config([BASE_YML, "steps=7", "learning_rate=1e-3", "norm_epsilon=1e-5",
                     "per_device_batch_size=2", "scan_layers=false", "use_qk_norm=true",
                     "warmup_steps=1e1", "run_name=123", "dataset_path=true",
                     'mesh_axes=["fsdp", "data", "context", "expert", "tensor"]',
                     'logical_axis_rules=[["embed", ["fsdp"]], ["mlp", null]]'])
  assert cfg.steps == 7 and type(cfg.steps) is int
  assert cfg.learning_rate == 1e-3 and type(cfg.learning_rate) is float
  assert cfg.norm_epsilon == 1e-5 and type(cfg.norm_epsilon) is float
  assert cfg.per_device_batch_size == 2.0 and type(cfg.per_device_batch_size) is float
  assert cfg.scan_layers is False and cfg.use_qk_norm is True
  assert cfg.warmup_steps == 10 and type(cfg.warmup_steps) is int
  assert cfg.run_name == "123" and cfg.dataset_path == "true"
  assert cfg.mesh_axes == ["fsdp", "data", "context", "expert", "tensor"]
  assert cfg.logical_axis_rules == [["embed", ["fsdp"]], ["mlp", None]]
  # base.yml's own values come out typed as well
  base = load_config([BASE_YML])
  assert type(base.learning_rate) is float and base.learning_rate == 3.0e-3
  assert type(base.per_device_batch_size) is float and type(base.steps) is int
  # the same key twice with the same value is fine
  assert load_config([BASE_YML, "steps=5", "steps=5"]).steps == 5


# ---- load errors --------------------------------------------------------------------------------
def _error(args) -> str:
  with pytest.raises(ConfigError) as e:
    load_config(args)
  return str(e.value)


def test_unknown_key_suggests_the_close_one():
  msg = _error([BASE_YML, "stepz=3"])
  assert "'stepz'" in msg and "did you mean" in msg and "'steps'" in msg
  msg = _error([BASE_YML, "learning_rat=0.1"])
  assert "'learning_rat'" in msg and "'learning_rate'" in msg
  assert "did you mean" not in _error([BASE_YML, "zzzzzz=1"])


@pytest.mark.parametrize("arg,key", [
    ("steps=abc", "steps"), ("steps=1.5", "steps"), ("scan_layers=maybe", "scan_layers"),
    ("scan_layers=1", "scan_layers"), ("learning_rate=fast", "learning_rate"),
    ("mesh_axes=data", "mesh_axes"),
])
def test_wrong_type(arg, key):
  msg = _error([BASE_YML, arg])
  assert msg.startswith(f"{key}=") and "expected" in msg


@pytest.mark.parametrize("arg,key,says", [
    ("steps=0", "steps", ">= 1"), ("steps=-1", "steps", ">= 1"),
    ("dtype=float8", "dtype", "must be one of"), ("learning_rate=-1", "learning_rate", ">= 0"),
    ("norm_epsilon=0", "norm_epsilon", "> 0"), ("adam_b1=1.5", "adam_b1", "<= 1"),
])
def test_out_of_range(arg, key, says):
  msg = _error([BASE_YML, arg])
  assert msg.startswith(f"{key}=") and says in msg


def test_same_key_twice_with_different_values():
  msg = _error([BASE_YML, "steps=3", "emb_dim=8", "steps=4"])
  assert "steps" in msg and "'3'" in msg and "'4'" in msg


def test_argument_without_equals_sign():
  msg = _error([BASE_YML, "steps"])
  assert "'steps'" in msg and "key=value" in msg


def test_model_file_can_start_from_another(configs_dir):
  """`base_model: foo` in a model file: foo's keys, then the file's own (gemma4 = gemma4-e2b)."""
  models = configs_dir / "models"
  (models / "bar.yml").write_text('base_model: "foo"\nmlp_dim: 96\n')
  base = str(configs_dir / "base.yml")
  bar = load_config([base, "model_name=bar"])
  assert (bar.emb_dim, bar.num_decoder_layers, bar.mlp_dim, bar.model_name) == (128, 2, 96, "bar")
  assert bar.rope_theta == 5.0e5
  from MaxText.config.load import explicit_keys
  assert explicit_keys([base, "model_name=bar"]) == {"model_name", "emb_dim", "num_decoder_layers",
                                                     "rope_theta", "mlp_dim"}
  (models / "loop.yml").write_text('base_model: "loop2"\n')
  (models / "loop2.yml").write_text('base_model: "loop"\n')
  assert "base_model loops (loop -> loop2 -> loop)" in _error([base, "model_name=loop"])
  (models / "orphan.yml").write_text('base_model: "nope"\n')
  msg = _error([base, "model_name=orphan"])
  assert "model_name='nope' (base_model of orphan.yml)" in msg
  shipped = load_config([BASE_YML, "model_name=gemma4"])
  assert shipped.as_dict() == {**load_config([BASE_YML, "model_name=gemma4-e2b"]).as_dict(),
                               "model_name": "gemma4"}


def test_list_keys_check_their_items():
  assert load_config([BASE_YML, "mlp_only_layers=[0, 2]"]).mlp_only_layers == [0, 2]
  msg = _error([BASE_YML, 'mlp_only_layers=["a"]'])
  assert msg.startswith("mlp_only_layers=") and "list of int" in msg


def test_unknown_model_name(configs_dir):
  msg = _error([str(configs_dir / "base.yml"), "model_name=nope"])
  assert "model_name='nope'" in msg and "nope.yml" in msg and "foo" in msg


@pytest.mark.parametrize("name", ["../evil", "sub/foo", "..", ".hidden", "/abs/evil", "a\\b"])
def test_model_name_with_a_path_is_refused(configs_dir, name):
  """model_name only names files of configs/models/: a path is refused even if the file exists."""
  (configs_dir / "evil.yml").write_text("emb_dim: 8\n")       # configs/evil.yml, outside models/
  (configs_dir / "models" / "sub").mkdir()
  (configs_dir / "models" / "sub" / "foo.yml").write_text("emb_dim: 8\n")
  msg = _error([str(configs_dir / "base.yml"), f"model_name={name}"])
  assert msg.startswith(f"model_name={name!r}") and "no path separators" in msg


def test_model_yml_with_unknown_key(configs_dir):
  (configs_dir / "models" / "bad.yml").write_text("emb_dimm: 64\n")
  msg = _error([str(configs_dir / "base.yml"), "model_name=bad"])
  assert "'emb_dimm'" in msg and "bad.yml" in msg and "'emb_dim'" in msg


def test_model_yml_with_bad_value(configs_dir):
  (configs_dir / "models" / "bad.yml").write_text("num_decoder_layers: 0\n")
  msg = _error([str(configs_dir / "base.yml"), "model_name=bad"])
  assert msg.startswith("num_decoder_layers=0")


def test_base_yml_missing_a_schema_key(tmp_path):
  text = open(BASE_YML, encoding="utf-8").read()
  lines = [ln for ln in text.splitlines() if not ln.startswith("seed:")]
  assert len(lines) == len(text.splitlines()) - 1
  (tmp_path / "base.yml").write_text("\n".join(lines) + "\n")
  msg = _error([str(tmp_path / "base.yml")])
  assert "lacks keys" in msg and "seed" in msg


def test_base_yml_with_an_extra_key(tmp_path):
  (tmp_path / "base.yml").write_text(open(BASE_YML, encoding="utf-8").read() + "stepss: 3\n")
  msg = _error([str(tmp_path / "base.yml")])
  assert "'stepss'" in msg and "'steps'" in msg


# ---- validate(cfg, devices) ---------------------------------------------------------------------
def _validate_error(*overrides: str) -> str:
  cfg = load_config([BASE_YML, *overrides])
  with pytest.raises(ConfigError) as e:
    validate(cfg, jax.devices())
  return str(e.value)


def test_validate_accepts_good_configs():
  assert len(jax.devices()) == 8
  for overrides in ([], ["ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                         "ici_tensor_parallelism=2", "per_device_batch_size=0.5"],
                    ["per_device_batch_size=1", "max_target_length=8192"]):
    validate(load_config([BASE_YML, *overrides]), jax.devices())  # raises on failure


def test_validate_mesh_product():
  msg = _validate_error("ici_fsdp_parallelism=3")
  assert "ici_fsdp_parallelism=3" in msg and "8" in msg
  # on CPU the message says how to get more (fake) devices
  assert "--xla_force_host_platform_device_count=N" in msg and "8 cpu devices" in msg
  msg = _validate_error("ici_tensor_parallelism=3", "ici_data_parallelism=1")
  assert "ici_tensor_parallelism=3 = 3 does not divide the 8 devices" in msg
  assert "ici_fsdp_parallelism=-1" in msg and "xla_force_host_platform_device_count" in msg


def test_validate_two_minus_one():
  msg = _validate_error("ici_data_parallelism=-1")
  assert "ici_data_parallelism" in msg and "ici_fsdp_parallelism" in msg


def test_validate_batch_not_divisible_over_data_parallel_axes():
  msg = _validate_error("per_device_batch_size=0.5")  # micro batch 4 over fsdp 8
  assert "per_device_batch_size" in msg and "4" in msg and "8-way" in msg


def test_validate_non_integer_global_batch():
  msg = _validate_error("per_device_batch_size=0.3", "ici_fsdp_parallelism=1",
                        "ici_tensor_parallelism=8")
  assert "per_device_batch_size=0.3" in msg and "whole number" in msg


def test_validate_sequence_longer_than_positions():
  msg = _validate_error("max_target_length=1024", "max_position_embeddings=512")
  assert "max_target_length=1024" in msg and "max_position_embeddings=512" in msg


def test_validate_sequence_not_divisible_over_context():
  msg = _validate_error("ici_fsdp_parallelism=1", "ici_context_parallelism=8",
                        "max_target_length=100")
  assert "max_target_length=100" in msg and "context" in msg


def test_validate_heads_not_multiple_of_kv_heads():
  msg = _validate_error("num_query_heads=4", "num_kv_heads=3")
  assert msg.startswith("num_kv_heads") and "num_query_heads=4" in msg


def test_validate_unknown_decoder_block():
  msg = _validate_error("decoder_block=gpt")
  assert "decoder_block='gpt'" in msg and "llama" in msg


@pytest.mark.parametrize("overrides,says", [
    # a key the family does not implement, set away from its default: refused automatically
    (("attention_pattern=sf", "sliding_window=8"), "attention_pattern='sf' is not supported by "
                                                   "decoder_block=llama"),
    (("model_name=gemma4-tiny", "first_k_dense_layers=1"), "first_k_dense_layers=1 is not "
                                                           "supported by decoder_block=gemma4"),
    (("mlp_only_layers=[0]",), "mlp_only_layers=(0,) needs num_experts > 0"),
    (("num_experts=4", "moe_mlp_dim=8", "first_k_dense_layers=4"), "no layer is a MoE layer"),
    # the Hugging Face architecture must be one of the family's, and able to hold the model
    (("hf_model_type=gemma4_text",), "hf_model_type='gemma4_text' is not an architecture of "
                                     "decoder_block=llama"),
    (("hf_model_type=qwen3",), "qwen3 needs use_qk_norm=true"),
    (("hf_model_type=llama", "use_qk_norm=true"), "Llama has neither"),
    (("hf_model_type=qwen3_moe", "use_qk_norm=true", "num_experts=4", "moe_mlp_dim=8",
      "shared_expert_mlp_dim=8"), "no shared expert"),
])
def test_validate_family_refusals(overrides, says):
  msg = _validate_error(*overrides)
  assert says in msg, msg


def test_validate_accepts_the_shipped_architectures():
  for overrides in (["hf_model_type=llama"], ["hf_model_type=qwen3", "use_qk_norm=true"],
                    ["model_name=qwen3-moe-tiny", "mlp_only_layers=[0]", "decoder_sparse_step=1"],
                    ["model_name=gemma4-tiny"], ["model_name=gemma4"]):
    validate(load_config([BASE_YML, "per_device_batch_size=1", *overrides]), jax.devices())


def test_validate_rule_with_unknown_mesh_axis():
  msg = _validate_error('logical_axis_rules=[["embed", ["fsdp", "pipeline"]]]')
  assert "logical_axis_rules" in msg and "'pipeline'" in msg


# ---- CLI contract -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_runs():
  """The bad command lines, run concurrently (each pays the imports once). JAX logs every
  computation it compiles (JAX_LOG_COMPILES), so "before compiling" is read off the log."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1")
  cases = {"unknown_key": ["stepz=3"],
           "missing_data": ["dataset_type=file", "dataset_path=/nonexistent"],
           "cudnn_on_cpu": ["attention=cudnn", "dtype=bfloat16"]}
  procs = {name: subprocess.Popen([sys.executable, *(["-X", "importtime"] if name == "unknown_key"
                                                     else []), "train.py", "configs/base.yml",
                                   *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
           for name, args in cases.items()}
  out = {}
  try:
    for name, p in procs.items():
      stdout, stderr = p.communicate()
      out[name] = (p.returncode, stdout, stderr)
  finally:
    for p in procs.values():
      p.kill()   # none is left running after the per-test timeout (pytest.ini)
  return out


@pytest.mark.parametrize("case,expected", [
    ("unknown_key", ("'stepz'", "'steps'")),
    ("missing_data", ("/nonexistent", "dataset_path")),
    ("cudnn_on_cpu", ("attention=cudnn needs an NVIDIA GPU", "'cpu'")),
])
def test_cli_config_error_exits_2_before_compiling(cli_runs, case, expected):
  code, stdout, stderr = cli_runs[case]
  assert code == 2, (stdout, stderr)
  for piece in expected:
    assert piece in stderr, (piece, stderr)
  assert "compiled" not in stdout
  assert "Compiling" not in stderr, stderr   # JAX compiled nothing at all
  if case == "unknown_key":   # refused before jax is imported (-X importtime: the imports)
    imported = {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines()
                if line.startswith("import time:")}
    assert "encodings" in imported and "jax" not in imported


# ---- config.yml in the run directory ------------------------------------------------------------
def test_resolved_config_written_to_run_dir(tmp_path):
  overrides = (*MESH_1, "steps=1", "enable_checkpointing=false", "per_device_batch_size=2",
               "learning_rate=1e-3", "seed=7")
  code, rows, _ = train(tmp_path, "cfgrun", *overrides, devices=jax.devices()[:1])
  assert code == 0 and len(rows) == 1
  with open(tmp_path / "cfgrun" / "config.yml", encoding="utf-8") as f:
    written = yaml.safe_load(f)
  assert written["steps"] == 1 and written["enable_checkpointing"] is False
  assert written["learning_rate"] == 1e-3 and written["seed"] == 7
  assert written["emb_dim"] == 64 and written["run_name"] == "cfgrun"
  assert written["per_device_batch_size"] == 2.0 and written["ici_fsdp_parallelism"] == 1
  # as loaded, with the tokenizer resolved (tokenizer_type=auto without a path: byte) and the
  # loss chunk (-1: auto; the whole sequence of 64 here)
  assert written == {**load_config(argv(tmp_path, "cfgrun", *overrides)).as_dict(),
                     "tokenizer_type": "byte", "loss_chunk_length": 0}


@pytest.mark.parametrize("arg", ["learning_rate=nan", "per_device_batch_size=inf",
                                 "norm_epsilon=.nan", "adam_b1=-.inf"])
def test_non_finite_floats_are_refused(arg):
  with pytest.raises(ConfigError, match=arg.split("=")[0]):
    load_config([BASE_YML, arg])


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["configs/base.yml", "steps=3", "--help"]])
def test_help_prints_usage_examples_and_every_key_train_reads(args):
  p = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                     check=False)
  assert p.returncode == 0 and p.stderr == "", p.stderr
  assert p.stdout.startswith("usage: train.py CONFIG.yml [key=value ...]")
  assert "examples:" in p.stdout and "exit status:" in p.stdout
  shown = {m.group(1): m.group(2) for m in re.finditer(r"^  (\w+) = (.*)$", p.stdout, re.M)}
  # (a new process: a family a test registered here is not in it)
  assert set(shown) == {k for k, spec in rendered().items() if "train" in spec.tools}
  assert "hf_path" in shown and "num_generations" not in shown   # read by train.py; refused
  assert shown["steps"].startswith("300    # optimizer steps")
  assert shown["logical_axis_rules"].startswith("[...]    # logical axis -> mesh axes")


def test_a_family_key_the_schema_already_has_is_refused():
  """A family's `Keys` (schema.add_keys) may not redeclare a key of the common schema or of
  another family, nor may a family declare two sets of keys; a field made without key(...) is not
  a key."""
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Clash:
    emb_dim: int = key(8, "the width again", min=1, model=True)
    per_layer_input_dim: int = key(0, "Gemma 4's again", min=0, model=True)

  with pytest.raises(ValueError, match=r"emb_dim \(from the common schema\), "
                     r"per_layer_input_dim \(from gemma4\)"):
    schema.add_keys("clash_test", Clash)
  assert "clash_test" not in {s.family for s in KEYS.values()}
  from MaxText.models.gemma4.keys import Keys
  schema.add_keys("gemma4", Keys)                                    # the same class: nothing

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Other:
    gemma4_extra: int = key(0, "a second set", min=0, model=True)

  with pytest.raises(ValueError, match="family 'gemma4' already declared its keys"):
    schema.add_keys("gemma4", Other)

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Plain:
    plain_field: int = 0

  with pytest.raises(ValueError, match="Plain.plain_field is not declared with key"):
    schema.add_keys("plain_test", Plain)


def test_yaml_io_is_the_safe_loader_in_c_with_safe_loads_values():
  """The configs' YAML goes through libyaml (PyYAML's wheels have it) and reads and writes as
  `yaml.safe_load` / `yaml.safe_dump` do; a Python tag is refused as by the safe loader."""
  assert yaml.__with_libyaml__ and yaml_io.SAFE_LOADER is yaml.CSafeLoader
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "configs")) for f in fs
           if f.endswith(".yml")]
  assert len(files) > 10
  for path in files:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    assert yaml_io.safe_load(text) == yaml.safe_load(text), path
  cfg = load_config([BASE_YML, "model_name=gemma4-tiny"]).as_dict()
  assert yaml_io.safe_dump(cfg, sort_keys=False) == yaml.safe_dump(cfg, sort_keys=False)
  with pytest.raises(yaml.YAMLError):
    yaml_io.safe_load("!!python/object/apply:os.getcwd []")
