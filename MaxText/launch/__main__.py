"""`python -m MaxText.launch`: a config → a GKE workload through XPK (or a JobSet manifest).

    python -m MaxText.launch --cluster C --workload W --docker-image IMAGE \
        (--tpu-type v5p-128 | --device-type h100-80gb-8) [--num-slices N] [--max-restarts R] \
        [--project P] [--zone Z] [--storage NAME ...] [--jobset FILE] [--dry-run] \
        -- configs/base.yml base_output_directory=/mnt/shared/runs key=value ...

Checks the config (and, when the installed xpk knows the accelerator, the mesh and batch against
its device count) and then runs `xpk workload create ...`; `--dry-run` prints that command and
runs nothing. `--jobset FILE` (GPU device types) writes a JobSet manifest for `kubectl apply -f`
instead (`-` prints it). Exit 2 for a bad config or arguments (the message names the key).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from typing import Sequence

from MaxText.config.load import ConfigError
from MaxText.launch import jobset, xpk
from MaxText.runtime.exit_codes import reported


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m MaxText.launch",
                              description="Launch train.py on a GKE cluster with XPK.")
  p.add_argument("--cluster", required=True)
  p.add_argument("--workload", required=True, help="workload name (also the default run_name)")
  p.add_argument("--docker-image", required=True,
                 help="image with this repository at its working directory")
  kind = p.add_mutually_exclusive_group(required=True)
  kind.add_argument("--tpu-type", help="e.g. v5p-128, v6e-256")
  kind.add_argument("--device-type", help="e.g. h100-80gb-8 (GPU), n2-standard-32-4 (CPU)")
  p.add_argument("--num-slices", type=int, default=1)
  p.add_argument("--max-restarts", type=int, default=3,
                 help="restarts after a preemption (exit 42) or a killed process")
  p.add_argument("--project")
  p.add_argument("--zone")
  p.add_argument("--priority")
  p.add_argument("--storage", action="append", default=[],
                 help="xpk storage to attach (the shared base_output_directory)")
  p.add_argument("--jobset", metavar="FILE",
                 help="write a JobSet manifest (GPU node pools) to FILE ('-': print) instead")
  p.add_argument("--volume-claim", help="JobSet: PersistentVolumeClaim holding the runs")
  p.add_argument("--mount-path", help="JobSet: where the claim is mounted in the pod")
  p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
  p.add_argument("config", nargs=argparse.REMAINDER,
                 help="-- configs/base.yml key=value ... (what train.py takes)")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  return reported(lambda: submit(args), (ConfigError,), label="config error")


def submit(args: argparse.Namespace) -> int:
  """Writes the JobSet manifest, or prints (and unless --dry-run runs) the xpk command."""
  config = args.config[1:] if args.config[:1] == ["--"] else args.config
  if not config:
    raise ConfigError("no config given (-- configs/base.yml key=value ...)")
  w = xpk.Workload(cluster=args.cluster, workload=args.workload, docker_image=args.docker_image,
                   config_argv=list(config), tpu_type=args.tpu_type, device_type=args.device_type,
                   num_slices=args.num_slices, max_restarts=args.max_restarts,
                   project=args.project, zone=args.zone, priority=args.priority,
                   storage=tuple(args.storage))
  _, acc = xpk.check(w)
  print(f"# {xpk.describe(w, acc)}", file=sys.stderr)
  if args.jobset:
    if acc is None or acc.kind != "gpu":
      raise ConfigError(f"--jobset is for GPU device types known to the installed xpk "
                        f"(got {args.tpu_type or args.device_type})")
    doc = jobset.manifest(name=w.workload, image=w.docker_image, train_argv=w.train_argv(),
                          num_nodes=xpk.processes(w, acc), gpus_per_node=acc.devices_per_host,
                          gke_accelerator=acc.gke_accelerator, max_restarts=w.max_restarts,
                          volume_claim=args.volume_claim, mount_path=args.mount_path)
    text = jobset.to_yaml(doc)
    if args.jobset == "-" or args.dry_run:
      print(text, end="")
    else:
      with open(args.jobset, "w", encoding="utf-8") as f:
        f.write(text)
      print(f"# wrote {args.jobset}: kubectl apply -f {args.jobset}", file=sys.stderr)
    return 0
  command = xpk.xpk_argv(w)
  print(xpk.shell(command))
  if args.dry_run:
    return 0
  if shutil.which("xpk") is None:
    print("xpk is not on PATH (pip install xpk; it also needs gcloud and kubectl)",
          file=sys.stderr)
    return 1
  return subprocess.run(command, check=False).returncode

if __name__ == "__main__":
  sys.exit(main())
