"""A JobSet manifest for GPU node pools on GKE (`kubectl apply -f`), for clusters run without XPK.

One indexed Job of N pods, one pod per node holding all its GPUs, one `train.py` process per pod:
- the processes find each other through `JAX_COORDINATOR_ADDRESS` (pod 0's stable DNS name, which
  JobSet's headless service gives: `<jobset>-<job>-0-0.<jobset>`, plus the port),
  `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (the pod's completion index), which
  `MaxText/runtime/distributed.py` reads;
- restarts: exit 42 (preempted, saved) and deaths by signal (128-255: killed, or aborted by the
  JAX runtime after a peer died) fail the Job, and JobSet restarts the whole set (up to
  `maxRestarts`), which resumes from the last checkpoint; any other non-zero status (1-5: a bug,
  bad config, data or checkpoint, non-finite loss) fails the JobSet for good, since a restart would
  only repeat it;
- `terminationGracePeriodSeconds` leaves time between SIGTERM and SIGKILL to finish the step,
  save and commit;
- checkpoints go to `base_output_directory`, which must be a volume every pod mounts.
"""
from __future__ import annotations

import re
from typing import Any

from MaxText.config import yaml_io
from MaxText.config.load import ConfigError
from MaxText.runtime.exit_codes import EXIT_PREEMPTED

API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOB_NAME = "workers"
CONTAINER = "train"
PORT = 8476
# exit statuses after which the JobSet is restarted (the rest fail it)
RESTART_STATUSES = (EXIT_PREEMPTED, *range(128, 256))
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?$")


def manifest(*, name: str, image: str, train_argv: list[str], num_nodes: int,
             gpus_per_node: int, gke_accelerator: str, max_restarts: int = 3,
             namespace: str | None = None, volume_claim: str | None = None,
             mount_path: str | None = None, grace_period_s: int = 300) -> dict[str, Any]:
  """The JobSet as a dict (`to_yaml` writes it)."""
  # pod host names are <name>-workers-<job index>-<pod index>: keep them within 63 characters
  if not _DNS_LABEL.match(name) or len(name) > 40:
    raise ConfigError(f"workload name {name!r}: must be a DNS label of at most 40 characters "
                      "(lower-case letters, digits, '-'; starting with a letter)")
  if num_nodes < 1 or gpus_per_node < 1:
    raise ConfigError(f"num_nodes={num_nodes}, gpus_per_node={gpus_per_node}: must be >= 1")
  env = [
      {"name": "JOBSET_NAME", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"}}},
      {"name": "JAX_COORDINATOR_ADDRESS",
       "value": f"$(JOBSET_NAME)-{JOB_NAME}-0-0.$(JOBSET_NAME):{PORT}"},
      {"name": "JAX_NUM_PROCESSES", "value": str(num_nodes)},
      {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {
          "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
  ]
  container: dict[str, Any] = {
      "name": CONTAINER, "image": image, "command": list(train_argv), "env": env,
      "ports": [{"containerPort": PORT, "name": "coordinator"}],
      "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
  }
  pod: dict[str, Any] = {
      "restartPolicy": "Never",
      "terminationGracePeriodSeconds": grace_period_s,
      "nodeSelector": {"cloud.google.com/gke-accelerator": gke_accelerator},
      "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
      "containers": [container],
  }
  if volume_claim:
    if not mount_path:
      raise ConfigError("a volume claim needs its mount path (where base_output_directory lives)")
    container["volumeMounts"] = [{"name": "shared", "mountPath": mount_path}]
    pod["volumes"] = [{"name": "shared", "persistentVolumeClaim": {"claimName": volume_claim}}]
  job = {
      "parallelism": num_nodes, "completions": num_nodes, "completionMode": "Indexed",
      "backoffLimit": 0,
      "podFailurePolicy": {"rules": [{
          "action": "FailJob",
          "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn",
                          "values": list(RESTART_STATUSES)}}]},
      "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}}, "spec": pod},
  }
  metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": name}}
  if namespace:
    metadata["namespace"] = namespace
  return {
      "apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata,
      "spec": {
          "network": {"enableDNSHostnames": True},
          "failurePolicy": {"maxRestarts": max_restarts, "rules": [
              {"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
          "replicatedJobs": [{"name": JOB_NAME, "replicas": 1, "template": {"spec": job}}],
      },
  }


def to_yaml(doc: dict[str, Any]) -> str:
  return yaml_io.safe_dump(doc, sort_keys=False, width=100)
