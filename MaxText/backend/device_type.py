"""`Device`, the type of `jax.Device` in annotations. jax binds `jax.Device` to a class of its
compiled extension (jaxlib), which ships no stubs, so a type checker reads the name as a variable
(pyright's reportInvalidTypeForm). For annotations only (the modules that use it have postponed
annotations): `Any` to the checker and at run time, so importing it imports no jax (a program's
`--help` answers without jax: tests/test_tool_keys.py)."""
from __future__ import annotations

from typing import Any

Device = Any
