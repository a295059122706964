"""The private library names behind MaxText/backend/compat.py: each still where the compat module
takes it (a failure names the library, the module and the name that moved), each still doing what
the project relies on, and no private library name used anywhere else in the package."""
import importlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from MaxText.backend import compat


@pytest.mark.parametrize("module,name", compat.PRIVATE_NAMES)
def test_each_private_name_is_still_there(module, name):
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    pytest.fail(f"{module} no longer imports ({e}): MaxText/backend/compat.py needs the new home "
                f"of {module}.{name} or a public replacement")
  assert hasattr(mod, name), (f"{module}.{name} is gone: MaxText/backend/compat.py needs its new "
                              f"home or a public replacement")


def test_backends_started_after_a_device_is_used():
  jax.devices()
  assert compat.backends_started() is True


def test_no_distributed_client_in_a_single_process():
  assert not jax.distributed.is_initialized()
  assert compat.distributed_client() is None


def test_quantized_training_dot_is_close_to_the_float_dot():
  """int8 weights and per-token int8 activations (absmax): a few parts in a thousand of the dot;
  its gradient is the straight-through one of the original operands (`use_original_residuals`)."""
  x = jax.random.normal(jax.random.key(0), (16, 64), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  f = lambda x, w: compat.dot_general_qt(
      x, w, dims, lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, lhs_calibration_method="absmax",
      rhs_calibration_method="absmax", use_original_residuals=True)
  y = f(x, w)
  ref = x @ w
  assert float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))) < 2e-2
  dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1))(x, w)
  dx_ref, dw_ref = jax.grad(lambda x, w: jnp.sum(x @ w), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-5, atol=1e-5)


PRIVATE_USE = re.compile(r"\b(?:jax|jaxlib|flax|orbax|qwix|optax|grain|ocp|nnx|lax)(?:\.\w+)*\._(?!_)\w+"
                         r"|\._cache_size\(")


def test_no_private_library_name_outside_the_compat_module():
  found = []
  for top in ("MaxText", "benchmarks", "tests"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
      for f in files:
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, ROOT)
        if not f.endswith(".py") or rel in ("MaxText/backend/compat.py", "tests/test_compat.py"):
          continue
        with open(path, encoding="utf-8") as fh:
          for i, line in enumerate(fh, 1):
            if PRIVATE_USE.search(line):
              found.append(f"{rel}:{i}: {line.strip()}")
  assert not found, "private library names outside MaxText/backend/compat.py:\n" + "\n".join(found)


def test_one_cpu_process_saves_a_replicated_array_without_cutting_it(tmp_path, monkeypatch):
  """The handler of `compat.register_orbax_array_handler` (MaxText/checkpoint/manager.py's on
  one CPU process): a replicated array on 8 devices is saved without Orbax's replica-parallel
  slicing (a compiled slice program per array shape) and restores equal, its metadata written."""
  from jax.sharding import NamedSharding, PartitionSpec
  from MaxText.checkpoint.manager import load_params, save_params_only
  cuts = []
  real = jax.lax.slice_in_dim
  monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: (cuts.append(a[0].shape),
                                                                real(*a, **k))[1])
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
  x = jax.device_put(np.arange(48, dtype=np.float32).reshape(16, 3),
                     NamedSharding(mesh, PartitionSpec()))
  save_params_only(str(tmp_path / "ckpt"), {"w": x}, {})
  assert cuts == []
  np.testing.assert_array_equal(load_params(str(tmp_path / "ckpt"), None)["w"], np.asarray(x))
  assert any("array_metadatas" in d for d, _, _ in os.walk(tmp_path / "ckpt"))
