"""Parses command lines with the installed xpk package's own argument parser (run as a script, so
the stand-ins below never enter the test process).

stdin: a JSON list of argument lists (without the leading "xpk"); stdout: a JSON list of
{"ok": bool, "args": {...} | None, "error": str}.

xpk's parser modules import its command implementations, which import cloud client libraries
(google-cloud-*, kubernetes, docker, requests) that xpk is installed without (requirements.txt).
Parsing never calls them, so each such module that is not installed (some are, for the object
store: google-cloud-storage, google-api-core, requests) is replaced by an empty
stand-in at import time; xpk's argparse definitions themselves (flags, types, choices, name
validators) are the real ones.
"""
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import sys
import types

_CLIENT_LIBS = ("google.api_core", "google.cloud", "kubernetes", "docker", "requests",
                "cloud_accelerator_diagnostics")


class _Anything(type):
  def __getattr__(cls, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return _Anything(name, (Exception,), {})


class _StandIn(types.ModuleType):
  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    value = _Anything(name, (Exception,), {})
    setattr(self, name, value)
    return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  def __init__(self, roots):
    self.roots = roots

  def find_spec(self, name, path, target=None):
    if not any(name == r or name.startswith(r + ".") for r in self.roots):
      return None
    # an installed module is the real one (google-cloud-storage is installed, its namespace
    # `google.cloud` then too, but not the other google-cloud clients xpk imports)
    if importlib.machinery.PathFinder.find_spec(name, path) is not None:
      return None
    return importlib.machinery.ModuleSpec(name, self, is_package=True)

  def create_module(self, spec):
    return _StandIn(spec.name)

  def exec_module(self, module):
    module.__path__ = []


def xpk_parser():
  import argparse  # pylint: disable=import-outside-toplevel
  sys.meta_path.insert(0, _Finder(list(_CLIENT_LIBS)))
  from xpk.parser.core import set_parser  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(prog="xpk")
  set_parser(parser)
  return parser


def main() -> None:
  parser = xpk_parser()
  out = []
  for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
      with contextlib.redirect_stderr(err):
        ns = parser.parse_args(argv)
      out.append({"ok": True, "args": {k: v for k, v in vars(ns).items()
                                       if isinstance(v, (str, int, float, bool, list, type(None)))},
                  "error": ""})
    except SystemExit:
      out.append({"ok": False, "args": None, "error": err.getvalue()})
  json.dump(out, sys.stdout)


if __name__ == "__main__":
  main()
