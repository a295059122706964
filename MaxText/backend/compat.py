"""Every private name this project takes from a library, in one place.

Each has no public equivalent in the pinned versions (requirements.txt); the rest of the package
reaches them only through the functions here, and tests/test_compat.py fails, naming the library
and the name, as soon as an upgrade moves one. Replaced by public APIs (and so not here): orbax's
commit future (`orbax.checkpoint.future`), the cuDNN plug-in probe (`jax._src.lib.cuda_versions`:
a CUDA device is the plug-in), a jitted function's `_cache_size()` (the decoding engine counts its
own traces).
"""
from __future__ import annotations

from typing import Any

# JAX's preemption sync protocol (xla/tsl preemption_sync_manager.cc): on the notice, each process
# writes its last step under this key prefix of the distributed key-value store (holding the lock
# that ReachedSyncPoint needs, so the steps cannot move), waits at a barrier and takes the largest
# + 1 as the sync point. Not an API: the test-only fault injection waits on it (runtime/faults.py).
PREEMPTION_COUNTERS_KEY = "PREEMPTION_CURRENT_COUNTER/"

# (module, attribute) of each private name used, for tests/test_compat.py
PRIVATE_NAMES = (
    ("jax._src.xla_bridge", "backends_are_initialized"),
    ("jax._src.distributed", "global_state"),
    ("qwix._src.core.dot_general_qt", "dot_general_qt"),
    ("qwix._src.core.dot_general_qt", "DotGeneralQtConfig"),
    ("jax._src.compiler", "logger"),
    ("orbax.checkpoint._src.metadata.array_metadata_store", "Store"),
    ("orbax.checkpoint._src.serialization.type_handler_registry", "GLOBAL_TYPE_HANDLER_REGISTRY"),
    ("jax._src.interpreters.mlir", "_lowerings"),
    ("jax._src.interpreters.mlir", "_platform_specific_lowerings"),
    ("jax._src.interpreters.mlir", "_uncacheable_primitives"),
    ("jax._src.interpreters.mlir", "LoweringRuleEntry"),
    ("jax._src.interpreters.mlir", "lower_fun"),
    ("jax._src.core", "jaxprs_in_params"),
)

# The logger JAX's compiler writes each persistent-cache miss's key to (at DEBUG); the test suite's
# profiler (benchmarks/suite_profile.py) reads the keys from it. No public hook carries the key.
COMPILER_LOGGER = "jax._src.compiler"


def backends_started() -> bool:
  """Whether JAX has started its backends (after that, device counts and XLA_FLAGS are fixed).
  JAX has no public query that does not itself start them."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return xla_bridge.backends_are_initialized()


def distributed_client() -> Any | None:
  """The distributed runtime's client of this process (its key-value store), None when
  `jax.distributed` is not initialized. `jax.distributed` exposes no accessor."""
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return distributed.global_state.client


def dot_general_qt(lhs, rhs, dimension_numbers, **config):
  """qwix's quantized-training dot (quantized forward; the backward per `config`, e.g.
  `use_original_residuals=True`: straight-through on the original operands) with a
  `DotGeneralQtConfig(**config)`. qwix exports it only through `quantize_model`'s interception,
  which cannot find this project's reshaped kernels (layers/quant.py)."""
  from qwix._src.core import dot_general_qt as qt  # pylint: disable=import-outside-toplevel
  return qt.dot_general_qt(lhs, rhs, dimension_numbers, qt.DotGeneralQtConfig(**config))


def register_orbax_array_handler(*, use_replica_parallel: bool) -> None:
  """Registers for jax.Array the handler Orbax's registry holds by default (with a store for the
  per-process array metadata: without it no array metadata is written), `use_replica_parallel`
  set as given, without the warning a public `register_type_handler` logs at every override. The
  store's class and the registry are exported only under orbax's `_src`."""
  import jax  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import type_handlers  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint._src.metadata import array_metadata_store  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint._src.serialization import type_handler_registry  # pylint: disable=import-outside-toplevel
  handler = type_handlers.ArrayHandler(array_metadata_store=array_metadata_store.Store(),
                                       use_replica_parallel=use_replica_parallel)
  type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(jax.Array, handler, override=True,
                                                         ignore_warnings=True)


def jax_mlir() -> Any:
  """JAX's MLIR lowering module (`jax._src.interpreters.mlir`): its per-primitive rule tables
  (`_lowerings`, `_platform_specific_lowerings`), `_uncacheable_primitives`, `LoweringRuleEntry`
  and `lower_fun`. benchmarks/cpu_emulate_chip.py swaps a primitive's CPU rule for a perturbed one
  and puts the original back; the public `jax.interpreters.mlir` can register a rule but not read
  or restore one."""
  from jax._src.interpreters import mlir  # pylint: disable=import-outside-toplevel
  return mlir


def jaxprs_in_params(params: Any) -> Any:
  """The jaxprs nested in an equation's parameters (a scan's body, a pjit's, a custom rule's):
  `jax._src.core.jaxprs_in_params`, which the public `jax.extend` does not export."""
  from jax._src import core  # pylint: disable=import-outside-toplevel
  return core.jaxprs_in_params(params)
