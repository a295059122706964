"""A config → an XPK workload: the `xpk workload create` command line that runs `train.py` on every
host of a GKE cluster (TPU slices, or GPU/CPU node pools).

What the command carries:
- `--cluster`, `--workload`, `--docker-image` (an image holding this repository at its working
  directory), `--tpu-type` or `--device-type`, `--num-slices`, optional `--project`, `--zone`,
  `--priority`, `--storage` (shared volumes attached with `xpk storage`);
- `--command`: `python3 train.py <config> key=value ...` with `run_name` defaulting to the workload
  name, so a restarted workload resumes its own checkpoints;
- `--restart-on-exit-codes 42 --max-restarts N`: a preempted run (exit 42, `exit_codes.py`) is
  restarted and resumes; XPK also restarts on 127-255 (a process killed by a signal, or aborted by
  the JAX runtime after a peer died); 0-5 end the workload (done, or an error a restart repeats).

The processes find each other without flags: on TPU JAX reads the slice's environment; on GPU XPK
sets `JAX_COORDINATOR_ADDRESS`/`JAX_COORDINATOR_PORT`/`NNODES`/`NODE_RANK`, on CPU node pools
`JAX_COORDINATOR_ADDRESS`/`JAX_PROCESS_COUNT`/`JOB_COMPLETION_INDEX` (plus the port we add), which
`MaxText/runtime/distributed.py` reads. Checkpoints need a path every host shares
(`base_output_directory=gs://BUCKET/runs`, or a mounted bucket or Filestore volume): a relative
path is refused.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import types
from typing import Sequence

from MaxText.config.load import ConfigError, load_config
from MaxText.config.schema import Config
from MaxText.runtime.exit_codes import EXIT_PREEMPTED
from MaxText.storage import paths

CPU_COORDINATOR_PORT = 8476  # CPU node pools: XPK gives the coordinator's host, not a port


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """What XPK's `--tpu-type`/`--device-type` means in hosts and devices."""
  kind: str            # "tpu" | "gpu" | "cpu"
  hosts_per_slice: int
  devices_per_host: int
  gke_accelerator: str  # node label value (GPU: cloud.google.com/gke-accelerator)


def accelerator(tpu_type: str | None, device_type: str | None) -> Accelerator | None:
  """From the installed `xpk` package's own table of system characteristics (None when xpk is not
  installed or does not know the name; the mesh is then not checked here)."""
  name = tpu_type or device_type
  try:
    from xpk.core.system_characteristics import (  # pylint: disable=import-outside-toplevel
        get_system_characteristics_by_device_type)
  except ImportError:
    return None
  system, _ = get_system_characteristics_by_device_type(name)
  if system is None:
    return None
  kind = str(getattr(system.accelerator_type, "name", system.accelerator_type)).lower()
  return Accelerator(kind, int(system.vms_per_slice), int(system.chips_per_vm),
                     str(system.gke_accelerator))


@dataclasses.dataclass
class Workload:
  cluster: str
  workload: str
  docker_image: str
  config_argv: list[str]            # base.yml path, then key=value overrides
  tpu_type: str | None = None
  device_type: str | None = None
  num_slices: int = 1
  max_restarts: int = 3
  project: str | None = None
  zone: str | None = None
  priority: str | None = None
  storage: tuple[str, ...] = ()

  def train_argv(self) -> list[str]:
    """`python3 train.py <config> key=value ...`, with run_name defaulting to the workload."""
    argv = list(self.config_argv)
    if not any(a.startswith("run_name=") for a in argv[1:]):
      argv.append(f"run_name={self.workload}")
    return ["python3", "train.py", *argv]


def check(w: Workload) -> tuple[Config, Accelerator | None]:
  """Loads the config (types, ranges) and, when the accelerator is known, checks the mesh and batch
  against its device count; refuses a checkpoint path the hosts cannot share. ConfigError names
  the key."""
  if bool(w.tpu_type) == bool(w.device_type):
    raise ConfigError("give exactly one of tpu_type=... and device_type=...")
  if w.num_slices < 1:
    raise ConfigError(f"num_slices={w.num_slices}: must be at least 1")
  cfg = load_config(w.train_argv()[2:], tool="train")
  out = os.path.expanduser(cfg.base_output_directory)
  if not paths.is_url(out) and not os.path.isabs(out):
    raise ConfigError(
        f"base_output_directory={cfg.base_output_directory!r}: on a cluster every host must write "
        "checkpoints to one shared path (a bucket, gs://BUCKET/runs; or one mounted with GCS FUSE "
        "or a Filestore volume: xpk storage attach, then storage=NAME); give its URL or absolute "
        "mount path")
  acc = accelerator(w.tpu_type, w.device_type)
  if acc is not None:
    # the devices JAX will see: TPU slices carry slice_index (dcn_* splits them); GPU/CPU hosts
    # form one ici level
    total = acc.hosts_per_slice * acc.devices_per_host * w.num_slices
    per_slice = total // (w.num_slices if acc.kind == "tpu" else 1)
    fake = [types.SimpleNamespace(slice_index=i // per_slice, platform=acc.kind)
            for i in range(total)]
    # the model's checks (jax): here, so that the launcher's --help and its refusals need none
    from MaxText.resolve.config_checks import validate  # pylint: disable=import-outside-toplevel
    validate(cfg, fake)
  return cfg, acc


def processes(w: Workload, acc: Accelerator) -> int:
  """The host processes of the workload: one per host of each slice."""
  return acc.hosts_per_slice * w.num_slices


def xpk_argv(w: Workload) -> list[str]:
  """The `xpk workload create ...` command as an argument list."""
  argv = ["xpk", "workload", "create", "--cluster", w.cluster, "--workload", w.workload,
          "--docker-image", w.docker_image]
  argv += ["--tpu-type", w.tpu_type] if w.tpu_type else ["--device-type", w.device_type]
  argv += ["--num-slices", str(w.num_slices),
           "--command", shlex.join(w.train_argv()),
           "--restart-on-exit-codes", str(EXIT_PREEMPTED),
           "--max-restarts", str(w.max_restarts)]
  for flag, value in (("--project", w.project), ("--zone", w.zone), ("--priority", w.priority)):
    if value:
      argv += [flag, value]
  for name in w.storage:
    argv += ["--storage", name]
  acc = accelerator(w.tpu_type, w.device_type)
  if acc is not None and acc.kind == "cpu":
    argv += ["--env", f"JAX_COORDINATOR_PORT={CPU_COORDINATOR_PORT}"]
  return argv


def shell(argv: Sequence[str]) -> str:
  return shlex.join(argv)


def describe(w: Workload, acc: Accelerator | None) -> str:
  if acc is None:
    return (f"{w.tpu_type or w.device_type} x {w.num_slices} slice(s) (not in the installed xpk's "
            "table: mesh not checked)")
  n = processes(w, acc)
  devices = n * acc.devices_per_host
  return (f"{w.tpu_type or w.device_type} x {w.num_slices} slice(s): {n} host process(es), "
          f"{devices} devices ({acc.devices_per_host} per host); restarts on exit "
          f"{EXIT_PREEMPTED} (preempted, saved) up to {w.max_restarts} times")
