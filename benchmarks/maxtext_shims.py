"""Makes MaxText 0.2.5 (installed by benchmarks/tpu_install.sh into its own target, e.g.
/tmp/site-maxtext) run its synthetic-data pre-training on Python 3.11 + jax 0.10.2, where its
metadata asks for Python >= 3.12 and jax >= 0.11.1 (../shared/notes/tpu-v5e.md):

  - PEP 695 `type X = ...` statements (Python 3.12 syntax; kernels/mhc/common.py and api.py) are
    rewritten as plain assignments;
  - `jax.experimental.xla_metadata.must_fuse_call` (new in jax 0.11, used only by its pure-JAX
    flash attention path) falls back to an identity decorator when jax lacks it;
  - the two checkpoint-conversion modules that build transformers >= 5 config objects when
    imported (utils/hf_model_configs.py, imported by its checkpointing module on every run, and
    utils/hf_shape.py) are replaced by ones with empty tables (a synthetic run converts nothing);
  - the packages it imports but a synthetic run never uses (fastapi, uvicorn, huggingface_hub,
    PIL, transformers, tiktoken, sentencepiece, tokenizers, sympy) get empty stub modules in the
    target, each only when it cannot be found on the path the arm runs with.

Idempotent: a second run finds nothing left to rewrite; the stubs of a previous run are removed
first, so a package installed since is no longer hidden.

  PYTHONPATH=/tmp/site-maxtext:/tmp/site python3 benchmarks/maxtext_shims.py /tmp/site-maxtext

Prints one line per change; exits 1 when the target holds no maxtext package.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import sys

STUBS = ("fastapi", "uvicorn", "huggingface_hub", "PIL", "transformers", "tiktoken",
         "sentencepiece", "tokenizers", "sympy")
STUB_LIST = ".maxtext_arm_stubs"   # the stubs this script made, one name a line
STUB_MARK = "# stub by benchmarks/maxtext_shims.py: not used by a synthetic-data run\n"
# A stub package: any name in it (or in any of its submodules) is a class whose attributes are
# such classes and whose calls return one, so imports, subclassing, decorators and module-level
# lookups succeed; nothing real ever comes out of it.
STUB_SOURCE = STUB_MARK + '''import importlib.abc
import importlib.machinery
import sys
import types


class _Absent(type):
  def __getattr__(cls, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return _Absent(name, (), {})

  def __call__(cls, *args, **kwargs):
    return _Absent(cls.__name__, (), {})


def __getattr__(name):
  if name.startswith("__"):
    raise AttributeError(name)
  return _Absent(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  def find_spec(self, fullname, path=None, target=None):
    if fullname.startswith(__name__ + "."):
      return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    return None

  def create_module(self, spec):
    module = types.ModuleType(spec.name)
    module.__path__ = []
    module.__getattr__ = __getattr__
    return module

  def exec_module(self, module):
    pass


sys.meta_path.append(_Finder())
'''
TYPE_ALIAS = re.compile(r"^(\s*)type\s+([A-Za-z_]\w*)\s*=\s*", re.M)
MUST_FUSE = re.compile(r"^from jax\.experimental\.xla_metadata import must_fuse_call\n", re.M)
MUST_FUSE_SHIM = """try:
  from jax.experimental.xla_metadata import must_fuse_call
except ImportError:  # jax < 0.11; shim by benchmarks/maxtext_shims.py: no fusion hint
  def must_fuse_call(*_args, **_kwargs):
    return lambda fn: fn
"""
HF_CONFIG_MODULES = {   # module -> the names other modules import from it
    "checkpoint_conversion/utils/hf_model_configs.py": ("HF_MODEL_CONFIGS",),
    "checkpoint_conversion/utils/hf_shape.py": ("HF_SHAPE",)}
HF_REPLACED = "# replaced by benchmarks/maxtext_shims.py"


def rewrite_type_aliases(pkg: str) -> list[str]:
  """`type X = ...` -> `X = ...` in every module of the package; the files changed."""
  changed = []
  for root, _, files in os.walk(pkg):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(root, name)
      with open(path, encoding="utf-8") as f:
        text = f.read()
      new = TYPE_ALIAS.sub(r"\1\2 = ", text)
      if new != text:
        with open(path, "w", encoding="utf-8") as f:
          f.write(new)
        changed.append(os.path.relpath(path, pkg))
  return changed


def shim_must_fuse_call(pkg: str) -> list[str]:
  changed = []
  for root, _, files in os.walk(pkg):
    for name in files:
      path = os.path.join(root, name)
      if not name.endswith(".py"):
        continue
      with open(path, encoding="utf-8") as f:
        text = f.read()
      new = MUST_FUSE.sub(lambda _: MUST_FUSE_SHIM, text)   # the shim's own line is indented
      if new != text:
        with open(path, "w", encoding="utf-8") as f:
          f.write(new)
        changed.append(os.path.relpath(path, pkg))
  return changed


def replace_hf_config_modules(pkg: str) -> list[str]:
  """The modules that build transformers >= 5 config objects when imported (imported by its
  checkpointing module on every run, used only to convert checkpoints): replaced by ones whose
  tables are empty; the original stays beside it as .py.orig."""
  changed = []
  for rel, names in HF_CONFIG_MODULES.items():
    path = os.path.join(pkg, rel)
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8") as f:
      text = f.read()
    if text.startswith(HF_REPLACED):
      continue
    os.replace(path, path + ".orig")
    body = "".join(f"{n} = {{}}\n" for n in names)
    with open(path, "w", encoding="utf-8") as f:
      f.write(f"{HF_REPLACED}: the original ({os.path.basename(rel)}.orig) builds transformers\n"
              "# >= 5 config objects at import; a synthetic-data run converts no checkpoint.\n"
              + body)
    changed.append(rel)
  return changed


def make_stubs(target: str) -> list[str]:
  """Empty packages in `target` for the unused imports that cannot be found otherwise."""
  listing = os.path.join(target, STUB_LIST)
  if os.path.isfile(listing):   # a previous run's stubs: gone, so they do not hide a real one
    with open(listing, encoding="utf-8") as f:
      for name in f.read().split():
        shutil.rmtree(os.path.join(target, name), ignore_errors=True)
    os.remove(listing)
  importlib.invalidate_caches()
  made = []
  for name in STUBS:
    if importlib.util.find_spec(name) is not None:
      continue
    os.makedirs(os.path.join(target, name))
    with open(os.path.join(target, name, "__init__.py"), "w", encoding="utf-8") as f:
      f.write(STUB_SOURCE)
    made.append(name)
  with open(listing, "w", encoding="utf-8") as f:
    f.write("".join(n + "\n" for n in made))
  return made


def unparsable(pkg: str) -> list[str]:
  """Modules this Python cannot parse (newer syntax left): reported, not fatal (a synthetic run
  imports only some of them)."""
  bad = []
  for root, _, files in os.walk(pkg):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        with open(path, encoding="utf-8") as f:
          try:
            ast.parse(f.read(), path)
          except SyntaxError:
            bad.append(os.path.relpath(path, pkg))
  return sorted(bad)


def apply(target: str) -> dict[str, list[str]]:
  pkg = os.path.join(target, "maxtext")
  if not os.path.isfile(os.path.join(pkg, "__init__.py")):
    raise FileNotFoundError(f"no maxtext package in {target} (install .whl-tpu/maxtext first)")
  return {"type aliases": rewrite_type_aliases(pkg),
          "must_fuse_call": shim_must_fuse_call(pkg),
          "transformers-config modules replaced": replace_hf_config_modules(pkg),
          "stubs": make_stubs(target),
          "still unparsable on this Python": unparsable(pkg)}


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print("usage: python3 benchmarks/maxtext_shims.py TARGET_DIR", file=sys.stderr)
    return 2
  try:
    done = apply(argv[0])
  except FileNotFoundError as e:
    print(f"maxtext_shims: {e}", file=sys.stderr)
    return 1
  for what, items in done.items():
    print(f"[maxtext_shims] {what}: {', '.join(items) if items else '-'}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
