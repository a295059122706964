"""The config views as the type checker reads them (MaxText/config/views_generated.py, rendered
from the schema by `python -m MaxText.config.render`): the checked-in file is current, its classes
have exactly the fields and defaults of the classes that run, and pyright, reading them, reports a
misspelled key and passes the right one."""
import dataclasses
import json
import os
import subprocess
import sys
import typing

from conftest import ROOT
from MaxText.config import render, schema, views_generated, views_source
from MaxText.config.schema import KEYS, Config, in_base_yml
from MaxText.data.config import DataConfig
from MaxText.models.model_config import ModelConfig

REGENERATE = "python -m MaxText.config.render"


def test_checked_in_views_are_what_the_schema_renders():
  with open(views_source.VIEWS_PY, encoding="utf-8") as f:
    assert f.read() == views_source.source(), (
        f"MaxText/config/views_generated.py is stale: run {REGENERATE}")
  assert render.main(["--check"]) == 0


def _fields(cls) -> dict:
  """name → default (a list default's factory called) of a dataclass, for the repository's keys."""
  out = {}
  for f in dataclasses.fields(cls):
    if in_base_yml(f.name):
      out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
  return out


def test_generated_classes_have_the_fields_of_the_running_ones():
  """Each view's generated class has the running view's fields (names, order, defaults) and the
  schema's types (list keys as tuples); `FamilyKeys` the fields the families add to `Config`."""
  running = {cls.__name__: cls for cls, _ in schema._VIEWS}
  assert set(running) == set(views_source.VIEWS) == {"ModelConfig", "DataConfig"}
  assert running["ModelConfig"] is ModelConfig and running["DataConfig"] is DataConfig
  for name, (role, names) in views_source.VIEWS.items():
    typed = getattr(views_generated, f"{name}Keys")
    assert list(_fields(typed)) == [k for k in names if in_base_yml(k)]
    assert _fields(typed) == _fields(running[name])
    assert all(getattr(KEYS[k], role) for k in _fields(typed))
    hints = typing.get_type_hints(typed)
    for k in _fields(typed):
      spec = KEYS[k]
      assert (typing.get_origin(hints[k]) or hints[k]) is (tuple if spec.type is list
                                                           else spec.type), k
  family = _fields(views_generated.FamilyKeys)
  assert list(family) == [k for k, s in KEYS.items() if s.family and in_base_yml(k)]
  assert len(family) > 10
  assert family == {k: v for k, v in _fields(Config).items() if k in family}
  hints = typing.get_type_hints(views_generated.FamilyKeys)
  assert all((typing.get_origin(hints[k]) or hints[k]) is KEYS[k].type for k in family)


PROBE = '''\
from MaxText.config.schema import Config
from MaxText.data.config import DataConfig
from MaxText.models.model_config import ModelConfig


def read(cfg: Config, mcfg: ModelConfig, dcfg: DataConfig) -> tuple:
  width: int = mcfg.emb_dim
  length: int = dcfg.max_target_length
  layers: int = cfg.vision_layers          # a family's key (gemma4/keys.py), a field of Config
  built: ModelConfig = ModelConfig.from_config(cfg)
  return (width, length, layers, built,
          mcfg.emb_dimm,                   # line 12: misspelled
          dcfg.max_target_lenght,          # line 13: misspelled
          cfg.vision_layerz)               # line 14: misspelled
'''


def test_pyright_reports_a_misspelled_key(tmp_path):
  """One pyright run on a small file that reads the views: an error on each misspelled key's
  line and none on the right ones (pyright's basic mode, as the repository's pyrightconfig.json
  runs it)."""
  (tmp_path / "probe.py").write_text(PROBE)
  (tmp_path / "pyrightconfig.json").write_text(json.dumps({
      "include": ["probe.py"], "typeCheckingMode": "basic", "pythonVersion": "3.11",
      "extraPaths": [ROOT], "venvPath": ROOT, "venv": ".venv"}))
  pyright = os.path.join(os.path.dirname(sys.executable), "pyright")
  out = subprocess.run([pyright, "--outputjson", "-p", str(tmp_path / "pyrightconfig.json")],
                       capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"})
  report = json.loads(out.stdout)
  errors = {(d["range"]["start"]["line"] + 1, d.get("rule")) for d in report["generalDiagnostics"]
            if d["severity"] == "error"}
  assert errors == {(12, "reportAttributeAccessIssue"), (13, "reportAttributeAccessIssue"),
                    (14, "reportAttributeAccessIssue")}, report["generalDiagnostics"]
  messages = " ".join(d["message"] for d in report["generalDiagnostics"])
  assert all(f'"{k}"' in messages for k in ("emb_dimm", "max_target_lenght", "vision_layerz"))
