"""The command-line tools' one exit-status mapping (MaxText/runtime/exit_codes.py: reported): bad
input → exit 2, bad data → 3, a damaged checkpoint → 4, each with one line naming it, never a
traceback; and no `python -m MaxText.*` tool keeps its own copy of that try/except."""
import ast
import pathlib

import pytest

from MaxText import logit_check
from MaxText.checkpoint.errors import CheckpointError
from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError
from MaxText.launch import __main__ as launch_cli
from MaxText.runtime.exit_codes import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA, EXIT_OK, reported

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "MaxText"


def _raise(e: Exception):
  def run() -> int:
    raise e
  return run


@pytest.mark.parametrize("error,kwargs,code,line", [
    (ConfigError("steps: bad"), {}, EXIT_CONFIG, "config error: steps: bad"),
    (KeyError("w"), {}, EXIT_CONFIG, "config error: 'w'"),
    (DataError("row 3"), {"data": (DataError,)}, EXIT_DATA, "data error: row 3"),
    (CheckpointError("params/x changed"), {}, EXIT_CHECKPOINT, "checkpoint error: params/x changed"),
    (FileNotFoundError("ckpt"), {"checkpoint": (FileNotFoundError,)}, EXIT_CHECKPOINT,
     "checkpoint error: ckpt"),
    (ConfigError("no config"), {"label": "bad request"}, EXIT_CONFIG, "bad request: no config"),
])
def test_reported_maps_each_error_to_its_status_and_one_line(error, kwargs, code, line, capsys):
  assert reported(_raise(error), (ConfigError, KeyError), **kwargs) == code
  assert capsys.readouterr().err == line + "\n"


def test_reported_passes_the_status_through_and_bugs_stay_tracebacks(capsys):
  assert reported(lambda: EXIT_OK, (ConfigError,)) == EXIT_OK
  assert reported(lambda: 7, (ConfigError,)) == 7
  with pytest.raises(DataError):              # not declared as data by this tool: not swallowed
    reported(_raise(DataError("x")), (ConfigError,))
  with pytest.raises(ZeroDivisionError):
    reported(_raise(ZeroDivisionError()), (ConfigError,), data=(DataError,))
  assert capsys.readouterr().err == ""


def _cli_modules() -> list[pathlib.Path]:
  return sorted(p for p in PACKAGE.rglob("*.py")
                if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8"))


def _own_exit_mappings(path: pathlib.Path) -> list[int]:
  """Lines of `except ...:` blocks that return an exit status themselves (a literal or EXIT_*)."""
  lines = []
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.ExceptHandler):
      for sub in ast.walk(node):
        if isinstance(sub, ast.Return) and (
            (isinstance(sub.value, ast.Constant) and isinstance(sub.value.value, int))
            or (isinstance(sub.value, ast.Name) and sub.value.id.startswith("EXIT_"))):
          lines.append(node.lineno)
  return lines


def test_no_tool_keeps_its_own_copy_of_the_mapping():
  clis = _cli_modules()
  names = {p.relative_to(PACKAGE).as_posix() for p in clis}
  assert {"decode.py", "evaluate.py", "quantize.py", "logit_check.py", "refit.py",
          "checkpoint_conversion/to_maxtext.py", "launch/__main__.py"} <= names, names
  copies = {p.relative_to(PACKAGE).as_posix(): _own_exit_mappings(p) for p in clis}
  assert not {k: v for k, v in copies.items() if v}, copies


def test_logit_check_missing_folder_is_exit_2_not_a_traceback(tmp_path, capsys):
  code = logit_check.main([f"hf_path={tmp_path / 'none'}", f"load_parameters_path={tmp_path}"])
  assert code == EXIT_CONFIG
  err = capsys.readouterr().err
  assert err.startswith("config error: ") and "config.json does not exist" in err


def test_launch_without_a_config_is_a_config_error(capsys):
  code = launch_cli.main(["cluster=c1", "workload=w1", "docker_image=img:1", "tpu_type=v5p-8",
                          "dry_run=true", "--"])
  assert code == EXIT_CONFIG
  assert capsys.readouterr().err.startswith("config error: no config given")
