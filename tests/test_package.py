"""The package is installed (setup.sh: an editable install of pyproject.toml, --no-deps): the venv's
python imports MaxText's Python API from any directory, and it is this checkout's MaxText. setup.sh
installs through uv with the package sources of pip's configuration (setup_uv.py)."""
import os
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT


def test_maxtext_imports_from_another_directory(tmp_path):
  checkout = os.path.dirname(os.path.realpath(sys.prefix))   # setup.sh's venv is <checkout>/.venv
  if not os.path.isfile(os.path.join(checkout, "setup.sh")):
    pytest.skip(f"this python's environment ({sys.prefix}) is not a checkout's .venv of setup.sh")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run(
      [sys.executable, "-c", "import os, MaxText\nfrom MaxText import inference, inspect\n"
       "print(os.path.realpath(os.path.dirname(MaxText.__file__)))"],
      cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().splitlines()[-1] == os.path.join(checkout, "MaxText")
  assert os.path.isfile(os.path.join(ROOT, "pyproject.toml"))   # what setup.sh installs


def test_setup_uv_hands_pip_configuration_to_uv(tmp_path):
  """setup_uv.py's uv command under a pip configuration of its own, given as PIP_* variables with
  pip's config files off (PIP_CONFIG_FILE=/dev/null: a machine's /etc/pip.conf would otherwise
  add its own settings), as pip reads them."""
  pytest.importorskip("pip")
  env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
  env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="https://mirror.example/simple",
             PIP_EXTRA_INDEX_URL="file:///a/simple file:///b/simple", PIP_FIND_LINKS="/w2 /w3",
             PIP_CONSTRAINT=f"{tmp_path}/c.txt", PIP_TIMEOUT="42.5", PIP_CERT=f"{tmp_path}/ca.pem",
             PIP_PRE="1", PIP_TRUSTED_HOST="mirror.example")
  env["PYTHONDONTWRITEBYTECODE"] = "1"
  run = lambda *extra: subprocess.run(
      [sys.executable, os.path.join(ROOT, "setup_uv.py"), "--print", "/u/uv", "-r", "r.txt"],
      env={**env, **dict(extra)}, capture_output=True, text=True, check=False)
  # Python caching bytecode itself (the variable unset or empty): none compiled at install
  lazy = run(("PYTHONDONTWRITEBYTECODE", ""))
  assert lazy.returncode == 0 and "--compile-bytecode" not in lazy.stdout, lazy.stderr[-2000:]
  done = run()
  assert done.returncode == 0, done.stderr[-2000:]
  command, *variables = done.stdout.strip().splitlines()
  args = shlex.split(command)
  pairs = list(zip(args, args[1:]))
  assert args[:3] == ["/u/uv", "pip", "install"] and args[-2:] == ["-r", "r.txt"]
  assert ("--python", sys.executable) in pairs and "--compile-bytecode" in args
  assert ("--index-strategy", "unsafe-best-match") in pairs   # pip's best version of all indexes
  # pip's main index first (of a version on several indexes, uv takes the first's files)
  assert [v for f, v in pairs if f == "--index"] == ["https://mirror.example/simple",
                                                     "file:///a/simple", "file:///b/simple"]
  assert [v for f, v in pairs if f == "--default-index"] == ["https://mirror.example/simple"]
  assert [v for f, v in pairs if f == "--find-links"] == ["/w2", "/w3"]
  assert [v for f, v in pairs if f == "--constraint"] == [f"{tmp_path}/c.txt"]
  assert [v for f, v in pairs if f == "--allow-insecure-host"] == ["mirror.example"]
  assert ("--prerelease", "allow") in pairs
  assert sorted(variables) == [f"SSL_CERT_FILE={tmp_path}/ca.pem", "UV_HTTP_TIMEOUT=43"]
  # a setting it does not translate stops it, so that setup.sh installs with pip
  done = run(("PIP_PROXY", "http://proxy.example:3128"))
  assert done.returncode != 0 and "proxy" in done.stderr


# Requirements of the packages setup.sh installs with --no-deps (requirements-nodeps.txt) that are
# knowingly not met, with the reason; every other one must be installed, at a version it accepts.
UNMET = {
    # xpk: only its argument parser and system table are imported (tests/xpk_parse.py); its cluster
    # clients are not installed and its pins conflict with ours (requirements.txt)
    "xpk": "*",
    # typepy[datetime] wants python-dateutil<3; 4.0.0 is installed for the rest, and typepy's use
    # of it (parsing a date) works with it
    "typepy": "python-dateutil",
}


def unmet_requirements(dist_names, installed_version):
  """(dist, requirement) pairs among `dist_names`' requirements (extras named by a requirement
  followed, e.g. pytablewriter's typepy[datetime]) that `installed_version(name)` (None: not
  installed) does not satisfy."""
  from importlib import metadata

  from packaging.requirements import Requirement
  from packaging.utils import canonicalize_name
  todo, seen, out = [(canonicalize_name(n), "") for n in dist_names], set(), []
  while todo:
    name, extra = todo.pop()
    if (name, extra) in seen:
      continue
    seen.add((name, extra))
    for text in metadata.requires(name) or []:
      req = Requirement(text)
      if req.marker is not None and not req.marker.evaluate({"extra": extra}):
        continue
      version = installed_version(req.name)
      if version is None or not req.specifier.contains(version, prereleases=True):
        out.append((name, str(req)))
      elif version is not None:
        todo += [(canonicalize_name(req.name), e) for e in req.extras or [""]]
  return out


def _installed(name):
  from importlib import metadata
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def test_every_requirement_of_the_no_deps_packages_is_installed():
  """pip/uv check nothing for a --no-deps install: lm-eval's results table needs pytablewriter ->
  typepy[datetime] -> pytz, and without it `python -m MaxText.lmeval` died at its last line."""
  pytest.importorskip("packaging")
  from packaging.requirements import Requirement
  with open(os.path.join(ROOT, "requirements-nodeps.txt"), encoding="utf-8") as f:
    names = [Requirement(line.strip()).name for line in f if line.strip() and not line.startswith("#")]
  assert "typepy" in names and "lm_eval" in names
  unmet = [(d, r) for d, r in unmet_requirements(names, _installed)
           if UNMET.get(d) not in ("*", Requirement(r).name)]
  assert unmet == []
  # the checker sees a missing one, behind an extra: pytz, typepy[datetime]'s, reached from
  # pytablewriter (whose requirement names the extra)
  without_pytz = lambda n: None if n == "pytz" else _installed(n)
  assert ("typepy", 'pytz>=2018.9; extra == "datetime"') in unmet_requirements(
      ["pytablewriter"], without_pytz)
