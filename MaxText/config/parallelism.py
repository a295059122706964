"""The sizes of the mesh axes from the `ici_*` / `dcn_*` parallelism keys: plain arithmetic on the
config's values (sharding/mesh.py lays the devices out; the process platform reads the sizes
before any device exists)."""
from __future__ import annotations

import math
from typing import Sequence

from MaxText.config.load import ConfigError
from MaxText.config.schema import parallelism_key


def fill_parallelism(values: Sequence[int], total: int, level: str, axes: Sequence[str]) -> list[int]:
  """Replaces the single -1 in `values` so that the product equals `total`."""
  values = list(values)

  def key(i: int) -> str:
    return parallelism_key(level, axes[i])

  unit = "devices per slice" if level == "ici" else "slices"
  for i, v in enumerate(values):
    if v == 0 or v < -1:
      raise ConfigError(f"{key(i)}={v}: must be a positive size or -1")
  holes = [i for i, v in enumerate(values) if v == -1]
  if len(holes) > 1:
    names = ", ".join(key(i) for i in holes)
    raise ConfigError(f"at most one {level} parallelism may be -1, got -1 for {names}")
  known = math.prod(v for v in values if v != -1)
  if holes:
    if total % known:
      fixed = " x ".join(f"{key(i)}={v}" for i, v in enumerate(values) if v != -1 and v != 1)
      raise ConfigError(f"{level} parallelism: {fixed or 'the fixed sizes'} = {known} does not "
                        f"divide the {total} {unit}, so {key(holes[0])}=-1 cannot take the rest")
    values[holes[0]] = total // known
  if math.prod(values) != total:
    detail = " x ".join(f"{key(i)}={v}" for i, v in enumerate(values))
    raise ConfigError(f"{level} mesh {detail} = {math.prod(values)}, but there are {total} {unit}")
  return values
