"""Tools take their keys from the schema (MaxText/config/schema.py, MaxText/config/tools.py): every
key says which programs read it; one set away from its default (on the command line or in the
config file the user passed) for a program that does not read it is refused with exit 2 naming it
and the programs that do; the tools' own arguments never re-declare a schema key; every program
answers a bare --help with exit 0; the batch contract is declared once."""
import ast
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import BASE_YML, ROOT
from MaxText.config.load import ConfigError, check_read_by, load_config, model_overlay, models_dir
from MaxText.config.schema import KEYS
from MaxText.config import tools
from MaxText.config.tools import TOOLS

# every program's command line (config/tools.py: PROGRAMS): train.py, and `python -m MaxText.<tool>`
PROGRAMS = {name: command.split()[-1:] if command == "train.py" else ["-m", command.split()[-1]]
            for name, command in tools.PROGRAMS.items()}


def other_value(spec):
  """A valid value of `spec`'s type and range that differs from its default."""
  d = spec.default
  if spec.name == "model_name":
    return "qwen3-tiny"          # a file of configs/models/
  if spec.choices is not None:
    return next(c for c in spec.choices if c != d)
  if spec.type is bool:
    return not d
  if spec.type in (int, float):
    step = spec.type(1)
    up = d + step
    if spec.max is not None and up > spec.max:
      return d - step if spec.type is int else (d + (spec.min or 0.0)) / 2 or spec.max / 2
    return up
  if spec.type is str:
    return d + "x"
  if spec.type is list:
    item = {int: [3], float: [0.5], str: ["data"], None: [["vocab", None]]}[spec.items]
    return item if item != d else item * 2
  raise AssertionError(spec)


def as_text(value):
  return value if isinstance(value, str) else json.dumps(value)


def test_every_key_is_read_by_a_known_program():
  for name, spec in KEYS.items():
    assert spec.tools and spec.tools <= set(TOOLS), name


@pytest.mark.parametrize("name", list(KEYS))
def test_a_key_is_accepted_by_the_programs_that_read_it_and_refused_by_the_others(name):
  """The whole schema: each key set to another valid value, for each program."""
  spec = KEYS[name]
  arg = f"{name}={as_text(other_value(spec))}"
  cfg = load_config([BASE_YML, arg], keep_auto=True)
  assert getattr(cfg, name) != spec.default
  model_keys = frozenset(model_overlay(models_dir(BASE_YML), cfg.model_name)) - {"model_name"} \
      if name == "model_name" else frozenset()
  for tool in TOOLS:
    if tool in spec.tools:
      check_read_by(cfg, tool, model_keys)
    else:
      with pytest.raises(ConfigError) as e:
        check_read_by(cfg, tool, model_keys)
      readers = [TOOLS[t] for t in TOOLS if t in spec.tools]
      assert str(e.value).startswith(f"{name}=") and f"does not read {name}" in str(e.value)
      assert all(r in str(e.value) for r in readers), str(e.value)


def test_a_config_file_the_user_passed_is_checked_too(tmp_path):
  """configs/grpo.yml given to train.py: its GRPO keys are refused (train.py never reads them)."""
  with pytest.raises(ConfigError, match="temperature=1.0: train.py does not read temperature .*"
                     "num_generations=8: train.py does not read num_generations .*MaxText.rl.grpo"):
    load_config([os.path.join(ROOT, "configs", "grpo.yml")], keep_auto=True, tool="train")
  load_config([os.path.join(ROOT, "configs", "grpo.yml")], keep_auto=True, tool="grpo")
  load_config([os.path.join(ROOT, "configs", "sft.yml")], keep_auto=True, tool="train")
  mine = tmp_path / "mine.yml"
  mine.write_text('base_config: "%s"\nprompt_file: "p.txt"\n' % BASE_YML)
  with pytest.raises(ConfigError, match="prompt_file='p.txt': train.py does not read"):
    load_config([str(mine)], keep_auto=True, tool="train")


@pytest.mark.parametrize("model", sorted(f[:-4] for f in os.listdir(os.path.join(
    ROOT, "configs", "models"))))
@pytest.mark.parametrize("tool", ["train", "grpo", "decode", "evaluate", "inspect", "quantize"])
def test_what_a_model_file_sets_is_never_refused(model, tool):
  """A model file describes the model (its balancing weight included), whichever program runs it;
  only what the user sets beyond it is checked."""
  load_config([BASE_YML, f"model_name={model}"], keep_auto=True, tool=tool)
  if tool != "train":
    with pytest.raises(ConfigError, match="sample_period=5: "):
      load_config([BASE_YML, f"model_name={model}", "sample_period=5"], keep_auto=True, tool=tool)


def test_train_py_refuses_hf_path_instead_of_training_a_random_model(tmp_path):
  """issue 38: `train.py configs/base.yml hf_path=/nonexistent/folder` trained a random model and
  exited 0; train.py now reads hf_path (issue 31: the folder read onto the mesh), and a folder
  that is not there is refused before anything starts (before jax is imported: `-X importtime`),
  naming the key and the file."""
  r = subprocess.run([sys.executable, "-X", "importtime", os.path.join(ROOT, "train.py"), BASE_YML,
                      "hf_path=/nonexistent/folder", f"base_output_directory={tmp_path}"],
                     capture_output=True, text=True, cwd=ROOT, check=False)
  assert r.returncode == 2, (r.stdout, r.stderr)
  assert "hf_path: /nonexistent/folder/config.json does not exist" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr
  imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
              if line.startswith("import time:")}
  assert "encodings" in imported and "jax" not in imported
  assert not os.listdir(tmp_path)      # no run directory: nothing was trained


@pytest.fixture(scope="module")
def helps():
  """{program: (exit status, stdout, stderr)} of `<program> --help`, every program at once, with
  `-X importtime` (the imports on stderr)."""
  procs = {name: subprocess.Popen([sys.executable, "-X", "importtime", *p, "--help"], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for name, p in PROGRAMS.items()}
  try:
    outputs = {name: p.communicate() for name, p in procs.items()}
    return {name: (procs[name].returncode, *out) for name, out in outputs.items()}
  finally:
    for p in procs.values():
      p.kill()   # none is left running after a failure or the per-test timeout (pytest.ini)


def test_every_program_answers_a_bare_help_with_exit_0(helps):
  """issue 38: `python -m MaxText.quantize --help` exited 2 (missing output_path). No program
  imports jax to answer it (the model's machinery is imported by the function that runs it;
  rl.grpo, refit and the converters, libraries with jax at their top, answer above those imports:
  `cli.answer_early`)."""
  for name, (code, out, err) in helps.items():
    assert code == 0, (name, err)
    assert out.startswith("usage: "), (name, out[:300])
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines()
                if line.startswith("import time:")}
    assert "encodings" in imported, (name, err[-500:])   # the import log is there
    assert "jax" not in imported, name


def test_every_python_m_entry_point_is_a_program_with_its_help_checked():
  """A module of the package that runs as a program (`if __name__ == "__main__"`) is one of
  PROGRAMS, so the help checks here cover it."""
  mains = set()
  for dirpath, _, files in os.walk(os.path.join(ROOT, "MaxText")):
    for f in (f for f in files if f.endswith(".py")):
      with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
        if 'if __name__ == "__main__"' in fh.read():
          module = os.path.relpath(os.path.join(dirpath, f[:-3]), ROOT).replace(os.sep, ".")
          mains.add(module.removesuffix(".__main__"))
  assert mains == {p[-1] for p in PROGRAMS.values() if p[0] == "-m"}, mains


# a run of spaces inside a line: only before a comment ("    # ..."), or the arguments table's
# column; else it is a docstring's backslash continuation (the next line's indent joined on)
_INNER_SPACES = re.compile(r"\S {5,}[^ #]")
_ARGUMENT_ROW = re.compile(r"^  \S+=<[^>]+> +")


def test_every_programs_help_is_clean_text_with_usage_and_exit_statuses(helps):
  """issue 58: `MaxText.decode --help` held a NUL byte (a non-raw docstring's \\x00), four usage
  lines long runs of spaces (backslash continuations of non-raw docstrings), and only train.py had
  a usage line and its exit statuses. Every program's help: text without control characters (but
  newline and tab), no such runs, the usage line of its command, and a paragraph of its exit
  statuses from the contract (README "Exit status"; a check that failed: 6, never 1)."""
  contract = {0, 2, 3, 4, 5, 6, 42, 130, 143}
  for name, (_, out, _) in helps.items():
    bad = sorted({hex(ord(c)) for c in out if (ord(c) < 32 and c not in "\n\t") or ord(c) == 127})
    assert not bad, (name, bad)
    for line in out.splitlines():
      assert not _INNER_SPACES.search(_ARGUMENT_ROW.sub("", line)), (name, line)
    command = tools.PROGRAMS[name]
    assert out.startswith(f"usage: {command} {tools.SYNOPSIS[name]}\n       {command} --help\n"), \
        (name, out[:300])
    paragraph = " ".join(out.split("\n\nexit status: ", 1)[1].split("\n\n", 1)[0].split())
    listed = {int(n) for n in re.findall(r"(?:^|, |; |/ )(\d+) ", paragraph)}
    assert {0, 2} <= listed <= contract, (name, listed, paragraph)
    if name in tools.TRAINERS:
      assert {3, 4, 5, 42, 130, 143} <= listed, (name, paragraph)


TOOL_MODULES = ["MaxText.logit_check", "MaxText.quantize", "MaxText.refit", "MaxText.inspect.__main__",
                "MaxText.checkpoint_conversion.to_maxtext",
                "MaxText.checkpoint_conversion.to_huggingface", "MaxText.launch.__main__",
                "MaxText.launch.local", "MaxText.serve.__main__"]


@pytest.mark.parametrize("module", TOOL_MODULES)
def test_no_tool_argument_re_declares_a_schema_key(module):
  """A tool's own arguments are what is not a config key; a config key has one declaration and one
  default, the schema's (logit_check's dtype had its own, float32 against the schema's auto)."""
  args = importlib.import_module(module).ARGS
  assert not set(args) & set(KEYS), sorted(set(args) & set(KEYS))


def _package_sources():
  """(path, parsed module) of every file of the MaxText package."""
  for dirpath, _, files in os.walk(os.path.join(ROOT, "MaxText")):
    for f in (f for f in files if f.endswith(".py")):
      path = os.path.join(dirpath, f)
      with open(path, encoding="utf-8") as fh:
        yield path, ast.parse(fh.read())


def test_the_batch_contract_is_declared_once():
  declared = []
  for path, tree in _package_sources():
    declared += [os.path.relpath(path, ROOT) for node in ast.walk(tree)
                 if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "BATCH_KEYS" for t in node.targets)]
  assert declared == [os.path.join("MaxText", "data", "batch.py")], declared


def test_one_command_line_style_no_argparse():
  """Every program, the launchers included, takes key=value (MaxText/config/cli.py)."""
  users = []
  for path, tree in _package_sources():
    if any(isinstance(n, ast.Import) and any(a.name == "argparse" for a in n.names)
           or isinstance(n, ast.ImportFrom) and n.module == "argparse" for n in ast.walk(tree)):
      users.append(os.path.relpath(path, ROOT))
  assert users == [], users


@pytest.mark.parametrize("program", ["train", "logit_check"])
def test_help_into_a_reader_that_stopped_is_no_traceback(program):
  """`<program> --help | grep -q usage`: a reader that has stopped reading (here: the pipe's read
  end closed before the program starts) makes the help's write fail, which is no error (it was a
  BrokenPipeError traceback)."""
  read_end, write_end = os.pipe()
  os.close(read_end)
  try:
    p = subprocess.run([sys.executable, *PROGRAMS[program], "--help"], cwd=ROOT, stdout=write_end,
                       stderr=subprocess.PIPE, text=True, check=False)
  finally:
    os.close(write_end)
  assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
