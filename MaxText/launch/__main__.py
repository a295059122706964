"""`python -m MaxText.launch`: a config → a GKE workload through XPK (or a JobSet manifest).

    python -m MaxText.launch cluster=C workload=W docker_image=IMAGE \\
        (tpu_type=v5p-128 | device_type=h100-80gb-8) [num_slices=N] [max_restarts=R] \\
        [project=P] [zone=Z] [storage=NAME,...] [jobset=FILE] [dry_run=true] \\
        -- configs/base.yml base_output_directory=/mnt/shared/runs key=value ...

Checks the config (what train.py takes, after `--`: keys train.py does not read are refused) and,
when the installed xpk knows the accelerator, the mesh and batch against its device count; then
runs `xpk workload create ...`; `dry_run=true` prints that command and runs nothing.
`jobset=FILE` (GPU device types) writes a JobSet manifest for `kubectl apply -f` instead (`-`
prints it). Exit 2 for a bad config or arguments (the message names the key).

Examples:
  python -m MaxText.launch cluster=my-cluster workload=llama docker_image=gcr.io/p/maxtext:v1 \\
      tpu_type=v5p-128 num_slices=2 storage=ckpts dry_run=true -- configs/base.yml \\
      base_output_directory=/gcs/my-bucket/runs
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any, Sequence

from MaxText.config import cli
from MaxText.config.load import ConfigError
from MaxText.launch import jobset, xpk
from MaxText.runtime.exit_codes import EXIT_CONFIG, reported

ARGS = {
    "cluster": cli.Arg(help="the GKE cluster"),
    "workload": cli.Arg(help="workload name (also the default run_name)"),
    "docker_image": cli.Arg(help="image with this repository at its working directory"),
    "tpu_type": cli.Arg(str, "", "e.g. v5p-128, v6e-256 (or device_type)"),
    "device_type": cli.Arg(str, "", "e.g. h100-80gb-8 (GPU), n2-standard-32-4 (CPU)"),
    "num_slices": cli.Arg(int, 1, "slices (hosts groups joined over DCN)"),
    "max_restarts": cli.Arg(int, 3, "restarts after a preemption (exit 42) or a killed process"),
    "project": cli.Arg(str, "", "GCP project (\"\": gcloud's)"),
    "zone": cli.Arg(str, "", "GCP zone (\"\": gcloud's)"),
    "priority": cli.Arg(str, "", "xpk workload priority (\"\": xpk's)"),
    "storage": cli.Arg(cli.names, (), "xpk storage to attach, comma-separated (the shared "
                       "base_output_directory)"),
    "jobset": cli.Arg(str, "", "write a JobSet manifest (GPU node pools) to FILE ('-': print) "
                      "instead"),
    "volume_claim": cli.Arg(str, "", "JobSet: PersistentVolumeClaim holding the runs"),
    "mount_path": cli.Arg(str, "", "JobSet: where the claim is mounted in the pod"),
    "dry_run": cli.Arg(cli.boolean, False, "print what would run, run nothing"),
}


def main(argv: Sequence[str] | None = None) -> int:
  own, config = cli.split_command(sys.argv[1:] if argv is None else argv)

  def run() -> int:
    args = cli.parse_own(own, ARGS, __doc__, program="launch")
    return 0 if args is None else submit(args, config)
  return reported(run, (ConfigError,))


def submit(args: dict[str, Any], config: list[str]) -> int:
  """Writes the JobSet manifest, or prints (and unless dry_run runs) the xpk command."""
  if not config:
    raise ConfigError("no config given (-- configs/base.yml key=value ...)")
  w = xpk.Workload(cluster=args["cluster"], workload=args["workload"],
                   docker_image=args["docker_image"], config_argv=list(config),
                   tpu_type=args["tpu_type"] or None, device_type=args["device_type"] or None,
                   num_slices=args["num_slices"], max_restarts=args["max_restarts"],
                   project=args["project"] or None, zone=args["zone"] or None,
                   priority=args["priority"] or None, storage=tuple(args["storage"]))
  _, acc = xpk.check(w)
  print(f"# {xpk.describe(w, acc)}", file=sys.stderr)
  if args["jobset"]:
    if acc is None or acc.kind != "gpu":
      raise ConfigError(f"jobset is for GPU device types known to the installed xpk "
                        f"(got {args['tpu_type'] or args['device_type']})")
    doc = jobset.manifest(name=w.workload, image=w.docker_image, train_argv=w.train_argv(),
                          num_nodes=xpk.processes(w, acc), gpus_per_node=acc.devices_per_host,
                          gke_accelerator=acc.gke_accelerator, max_restarts=w.max_restarts,
                          volume_claim=args["volume_claim"] or None,
                          mount_path=args["mount_path"] or None)
    text = jobset.to_yaml(doc)
    if args["jobset"] == "-" or args["dry_run"]:
      print(text, end="")
    else:
      with open(args["jobset"], "w", encoding="utf-8") as f:
        f.write(text)
      print(f"# wrote {args['jobset']}: kubectl apply -f {args['jobset']}", file=sys.stderr)
    return 0
  command = xpk.xpk_argv(w)
  print(xpk.shell(command))
  if args["dry_run"]:
    return 0
  if shutil.which("xpk") is None:
    print("config error: xpk is not on PATH (pip install xpk; it also needs gcloud and kubectl)",
          file=sys.stderr)
    return EXIT_CONFIG
  return subprocess.run(command, check=False).returncode

if __name__ == "__main__":
  sys.exit(main())
