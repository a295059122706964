"""`Device`, the type of `jax.Device` in annotations. jax binds `jax.Device` to a class of its
compiled extension (jaxlib), which ships no stubs, so a type checker reads the name as a variable
(pyright's reportInvalidTypeForm). Here it is that class at run time and `Any` for the checker."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
  Device = Any
else:
  Device = jax.Device
