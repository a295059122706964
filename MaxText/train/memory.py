"""Pre-flight memory check: will the parameters, gradients and optimizer state fit per device?

Counted per device from the actual shardings (so fsdp/tensor sharding is credited exactly):
parameters + one gradient copy + the optimizer state, plus the activations a family knows it must
keep (`Family.activation_bytes`, e.g. recurrent states of linear-attention layers). Other
activations are not counted (they depend on remat and fusion); the check only refuses runs that
cannot fit even without them, before anything is allocated or compiled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import psutil

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
  params: int          # bytes per device
  grads: int
  optimizer: int
  available: int       # bytes per device
  source: str          # where `available` came from
  activations: int = 0  # the family's known activations (bytes per device)

  @property
  def needed(self) -> int:
    return self.params + self.grads + self.optimizer + self.activations


def _per_device_bytes(abstract: Any) -> int:
  total = 0
  for leaf in jax.tree.leaves(abstract):
    shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shard) * leaf.dtype.itemsize
  return total


def available_bytes_per_device(devices: Sequence[jax.Device]) -> tuple[int, str]:
  stats = None
  try:
    stats = devices[0].memory_stats()
  except Exception:  # noqa: BLE001 — some backends do not implement memory_stats
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{devices[0].device_kind} memory limit"
  # CPU: all local devices share the host's RAM
  local = max(1, sum(1 for d in devices if d.process_index == jax.process_index()))
  return psutil.virtual_memory().available // local, f"host RAM available / {local} local devices"


def estimate(abstract_state: dict, devices: Sequence[jax.Device],
             activations: int = 0) -> MemoryEstimate:
  params = _per_device_bytes(abstract_state["params"])
  available, source = available_bytes_per_device(devices)
  return MemoryEstimate(params=params, grads=params,
                        optimizer=_per_device_bytes(abstract_state["opt_state"]),
                        available=available, source=source, activations=activations)


def check_fits(est: MemoryEstimate, advice: str = "") -> str | None:
  """None when the state fits; otherwise the message to stop with (ending with `advice`, what
  would fit, when given)."""
  if est.needed <= est.available:
    return None
  known = (f" + the model's known activations {est.activations / GiB:.2f} GiB"
           if est.activations else "")
  return (f"the model does not fit: parameters {est.params / GiB:.2f} GiB + gradients "
          f"{est.grads / GiB:.2f} GiB + optimizer state {est.optimizer / GiB:.2f} GiB{known} = "
          f"{est.needed / GiB:.2f} GiB needed per device, {est.available / GiB:.2f} GiB available "
          f"({est.source}), before {'other ' if known else ''}activations. " + (advice or (
              "Shard the state over more devices (ici_fsdp_parallelism / ici_tensor_parallelism, "
              "or more hosts), use weight_dtype=bfloat16, or pick a smaller model.")))


def advice(est: MemoryEstimate, abstract_state: dict, weight_dtype: str,
           smaller: list[tuple[str, int]]) -> str:
  """What would fit: bfloat16 weights (when they are not already and halving fits), the number of
  devices of this size the whole state needs when split over all of them (fsdp; also with
  bfloat16 weights), and the configs of the same family that fit here as they are (`smaller`:
  [(model_name, bytes needed per device)])."""
  total = 2 * _bytes(abstract_state["params"]) + _bytes(abstract_state["opt_state"])
  devices = lambda nbytes: math.ceil(nbytes / max(est.available, 1))
  halve = weight_dtype != "bfloat16"   # params, gradients and Adam moments all follow it
  ways = []
  halved = (est.needed - est.activations) / 2 + est.activations   # the state halves, not these
  if halve and halved <= est.available:
    ways.append(f"weight_dtype=bfloat16 (about {halved / GiB:.2f} GiB per device)")
  ways.append(f"the state ({total / GiB:.2f} GiB in all) split over at least {devices(total)} "
              f"devices with {est.available / GiB:.2f} GiB each" +
              (f" ({devices(total / 2)} with weight_dtype=bfloat16)" if halve else "") +
              " (ici_fsdp_parallelism, or more hosts)")
  if smaller:
    ways.append("a smaller model of this family: " + ", ".join(
        f"model_name={name} ({_size(needed)} per device)" for name, needed in smaller))
  else:
    ways.append("no other model of this family in configs/models/ fits here either")
  return "What would fit: " + "; or ".join(ways) + "."


def _size(nbytes: int) -> str:
  return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 100 else f"{nbytes / 2**20:.1f} MiB"


def _bytes(tree: Any) -> int:
  return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
