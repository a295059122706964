"""Multi-controller start-up: the same `train.py` on every host, one process per host, every
device global (`jax.distributed`). Must run before anything touches a device.

Where the three facts come from, first match wins:

| fact | config key | environment |
|---|---|---|
| coordinator (process 0's host:port) | `coordinator_address` | `JAX_COORDINATOR_ADDRESS` (+ `:JAX_COORDINATOR_PORT` when it has no port) |
| process count | `num_processes` (0 = unset) | `JAX_NUM_PROCESSES`, `JAX_PROCESS_COUNT`, `NNODES` |
| this process | `process_id` (-1 = unset) | `JAX_PROCESS_ID`, `NODE_RANK`, `JOB_COMPLETION_INDEX` |

The environment names are the ones our local launcher and JobSet manifest set
(`MaxText/launch/`) and the ones XPK sets on GPU (`NNODES`, `NODE_RANK`) and CPU node pools.
When none says more than one process but the host is one of the environments JAX detects itself
(multi-host Cloud TPU / multi-slice, Slurm with several tasks, Open MPI), `jax.distributed` is
initialised with whatever is known and JAX fills in the rest. Otherwise the run is one process and
nothing is initialised.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax

from MaxText.config.load import ConfigError
from MaxText.config.schema import Config
from MaxText.runtime import stdout_filter

ADDRESS_ENV = "JAX_COORDINATOR_ADDRESS"
PORT_ENV = "JAX_COORDINATOR_PORT"
COUNT_ENV = ("JAX_NUM_PROCESSES", "JAX_PROCESS_COUNT", "NNODES")
ID_ENV = ("JAX_PROCESS_ID", "NODE_RANK", "JOB_COMPLETION_INDEX")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How this process joins the run (None fields: left to JAX's own detection)."""
  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  source: str  # where the facts came from, for the log


def _env_int(env: Mapping[str, str], names: tuple[str, ...], key: str) -> tuple[int | None, str]:
  for name in names:
    value = env.get(name, "").strip()
    if value:
      try:
        return int(value), name
      except ValueError:
        raise ConfigError(f"{key}: environment variable {name}={value!r} is not an integer") \
            from None
  return None, ""


def _auto_detectable(env: Mapping[str, str]) -> str:
  """The name of a multi-process environment JAX detects by itself, or ""."""
  if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return "Cloud TPU"
  if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return "Slurm"
  if env.get("OMPI_MCA_orte_hnp_uri") and int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return "Open MPI"
  return ""


def plan(cfg: Config, env: Mapping[str, str] | None = None) -> Plan | None:
  """The distributed set-up `cfg` and the environment ask for; None for a single process.
  Raises ConfigError naming the key when the facts are incomplete or inconsistent."""
  env = os.environ if env is None else env
  sources = []
  address = cfg.coordinator_address.strip() or None
  if address:
    sources.append("coordinator_address")
  elif env.get(ADDRESS_ENV, "").strip():
    address = env[ADDRESS_ENV].strip()
    sources.append(ADDRESS_ENV)
    if ":" not in address.rsplit("]", 1)[-1] and env.get(PORT_ENV, "").strip():
      address = f"{address}:{env[PORT_ENV].strip()}"
      sources.append(PORT_ENV)
  count: int | None = cfg.num_processes or None
  if count:
    sources.append("num_processes")
  else:
    count, name = _env_int(env, COUNT_ENV, "num_processes")
    sources += [name] if name else []
  pid: int | None = cfg.process_id if cfg.process_id >= 0 else None
  if pid is not None:
    sources.append("process_id")
  else:
    pid, name = _env_int(env, ID_ENV, "process_id")
    sources += [name] if name else []

  if count is None or count == 1:
    detected = _auto_detectable(env) if count is None else ""
    if not detected:
      if pid not in (None, 0):
        raise ConfigError(f"process_id={pid} but the run has one process (num_processes and "
                          f"{', '.join(COUNT_ENV)} unset or 1)")
      return None
    return Plan(address, None, pid, f"JAX's {detected} detection"
                + (f" and {', '.join(sources)}" if sources else ""))
  if count < 1:
    raise ConfigError(f"num_processes={count}: must be at least 1")
  if address is None:
    raise ConfigError(f"coordinator_address: {count} processes need process 0's host:port "
                      f"(set coordinator_address or {ADDRESS_ENV})")
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit():
    raise ConfigError(f"coordinator_address={address!r}: expected host:port (the port can come "
                      f"from {PORT_ENV})")
  if pid is None:
    raise ConfigError(f"process_id: not set for a run of {count} processes (set process_id or one "
                      f"of {', '.join(ID_ENV)})")
  if not 0 <= pid < count:
    raise ConfigError(f"process_id={pid}: must be in [0, {count}) for num_processes={count}")
  return Plan(address, count, pid, ", ".join(sources))


def initialize(cfg: Config, env: Mapping[str, str] | None = None) -> Plan | None:
  """Joins the distributed run `plan` describes (once per Python process; a second call with the
  runtime already up does nothing). Returns the plan (None: single process)."""
  p = plan(cfg, env)
  if p is None or jax.distributed.is_initialized():
    return p
  # CPU hosts (and the tests: several processes on one machine) need cross-process collectives;
  # harmless on GPU/TPU, whose collectives do not use it. Gloo's per-communicator stdout lines
  # are dropped (stdout_filter.py).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  stdout_filter.GLOO.start()
  try:
    jax.distributed.initialize(
        coordinator_address=p.coordinator_address, num_processes=p.num_processes,
        process_id=p.process_id, initialization_timeout=cfg.distributed_init_timeout_s,
        heartbeat_timeout_seconds=cfg.distributed_heartbeat_timeout_s)
  except (RuntimeError, ValueError) as e:  # JaxRuntimeError is a RuntimeError
    first = str(e).strip().split("\n", 1)[0][:300]
    raise ConfigError(
        f"coordinator_address: could not join the distributed run ({p.source}: "
        f"coordinator {p.coordinator_address or 'auto'}, process {p.process_id} of "
        f"{p.num_processes or 'auto'}) within distributed_init_timeout_s="
        f"{cfg.distributed_init_timeout_s}: {type(e).__name__}: {first}") from e
  return p


def shutdown(code: int) -> None:
  """Leaves the distributed run after `main` ends with `code`. After a clean end (0, or 42: every
  process saved the same step) the processes wait for each other, so the coordinator (process 0)
  does not go away while others still talk to it; after an error nothing is awaited (the others
  may be stuck in a collective: they stop at the heartbeat timeout)."""
  if jax.distributed.is_initialized() and code in (0, 42):
    jax.distributed.shutdown()
  stdout_filter.GLOO.stop()
