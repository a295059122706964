"""Launching on a cluster without one: the rendered `xpk workload create` command is parsed by the
installed xpk's own argument parser, the JobSet manifest is checked as YAML with the fields GKE
needs (and its environment resolved by our own start-up code), and the local launcher's
supervision (a failing child stops the others; first non-zero status) is exercised."""
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import BASE_YML, ROOT
from MaxText.config.load import ConfigError, load_config
from MaxText.launch import __main__ as launch_cli
from MaxText.launch import jobset, local, xpk
from MaxText.runtime import distributed

SHARED = "base_output_directory=/mnt/shared/runs"


def _xpk_parse(*argvs):
  """Each argv (a list starting with "xpk") parsed by xpk's parser: [{"ok", "args", "error"}]."""
  p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "xpk_parse.py")],
                     input=json.dumps([a[1:] for a in argvs]), capture_output=True, text=True,
                     check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout)


def _workload(**kw):
  args = dict(cluster="my-cluster", workload="llama-pretrain", docker_image="gcr.io/proj/maxtext:v1",
              config_argv=[BASE_YML, SHARED, "per_device_batch_size=2", "steps=1000"])
  args.update(kw)
  return xpk.Workload(**args)


def test_rendered_xpk_commands_parse_with_xpks_own_parser():
  tpu = _workload(tpu_type="v5p-128", num_slices=2, max_restarts=5, project="proj",
                  zone="us-east5-a", storage=("ckpts",),
                  config_argv=[BASE_YML, SHARED, "ici_fsdp_parallelism=-1",
                               "dcn_data_parallelism=2", "per_device_batch_size=2"])
  gpu = _workload(device_type="h100-80gb-8", num_slices=4)
  cpu = _workload(device_type="n2-standard-32-4")
  bad = xpk.xpk_argv(_workload(tpu_type="v5p-128"))
  bad[bad.index("v5p-128")] = "v5p-127"  # not a TPU type xpk knows: its parser must say so
  results = _xpk_parse(*(xpk.xpk_argv(w) for w in (tpu, gpu, cpu)), bad)
  assert [r["ok"] for r in results] == [True, True, True, False], results
  assert "v5p-127" in results[3]["error"]
  a = results[0]["args"]
  assert (a["xpk_subcommands"], a["xpk_workload_subcommands"]) == ("workload", "create")
  assert (a["cluster"], a["workload"], a["docker_image"]) == ("my-cluster", "llama-pretrain",
                                                              "gcr.io/proj/maxtext:v1")
  assert (a["tpu_type"], a["device_type"], a["num_slices"]) == ("v5p-128", None, 2)
  assert (a["project"], a["zone"], a["storage"]) == ("proj", "us-east5-a", ["ckpts"])
  assert a["restart_on_exit_codes"] == "42" and int(a["max_restarts"]) == 5
  # the train command survives the round trip and is a valid config for train.py
  train = shlex.split(a["command"])
  assert train[:3] == ["python3", "train.py", BASE_YML]
  assert "dcn_data_parallelism=2" in train and "run_name=llama-pretrain" in train
  cfg = load_config(train[2:])
  assert cfg.run_name == "llama-pretrain" and cfg.dcn_data_parallelism == 2
  g = results[1]["args"]
  assert (g["device_type"], g["tpu_type"], g["num_slices"]) == ("h100-80gb-8", None, 4)
  c = results[2]["args"]
  assert c["env"] == [f"JAX_COORDINATOR_PORT={xpk.CPU_COORDINATOR_PORT}"]  # XPK gives no port


def test_xpk_accelerator_table_and_mesh_check():
  acc = xpk.accelerator("v5p-128", None)
  assert (acc.kind, acc.hosts_per_slice, acc.devices_per_host) == ("tpu", 16, 4)
  assert xpk.accelerator(None, "h100-80gb-8").devices_per_host == 8
  # 2 slices x 64 chips: dcn=2 splits the slices; a mesh that cannot fit is refused (exit 2)
  xpk.check(_workload(tpu_type="v5p-128", num_slices=2,
                      config_argv=[BASE_YML, SHARED, "dcn_data_parallelism=2"]))
  with pytest.raises(ConfigError, match="dcn mesh .* 2 slices"):
    xpk.check(_workload(tpu_type="v5p-128", num_slices=2,
                        config_argv=[BASE_YML, SHARED, "dcn_data_parallelism=4"]))
  with pytest.raises(ConfigError, match="base_output_directory='runs'.*shared path"):
    xpk.check(_workload(tpu_type="v5p-8", config_argv=[BASE_YML]))


def test_cli_dry_run_prints_and_runs_nothing(monkeypatch, capsys):
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran something"))
  code = launch_cli.main(["cluster=c1", "workload=w1", "docker_image=img:1", "tpu_type=v5p-8",
                          "dry_run=true", "--", BASE_YML, SHARED])
  out, err = capsys.readouterr()
  assert code == 0 and out.startswith("xpk workload create --cluster c1 --workload w1")
  assert "--restart-on-exit-codes 42" in out and "1 host process(es), 4 devices" in err
  code = launch_cli.main(["cluster=c1", "workload=w1", "docker_image=img:1", "tpu_type=v5p-8",
                          "dry_run=true", "--", BASE_YML, SHARED, "ici_tensor_parallelism=3"])
  assert code == 2 and "ici parallelism" in capsys.readouterr().err
  # the launcher's own arguments are key=value too; a train.py config key before -- is refused
  code = launch_cli.main(["cluster=c1", "workload=w1", "docker_image=img:1", "tpu_type=v5p-8",
                          "steps=3", "--", BASE_YML, SHARED])
  assert code == 2 and "unknown argument 'steps'" in capsys.readouterr().err
  # what train.py does not read is refused as train.py refuses it
  code = launch_cli.main(["cluster=c1", "workload=w1", "docker_image=img:1", "tpu_type=v5p-8",
                          "dry_run=true", "--", BASE_YML, SHARED, "prompt_file=p.txt"])
  assert code == 2 and "train.py does not read prompt_file" in capsys.readouterr().err


def test_jobset_manifest_is_what_gke_needs(tmp_path):
  path = tmp_path / "jobset.yaml"
  code = launch_cli.main(["cluster=c1", "workload=llama-gpu",
                          "docker_image=us-docker.pkg.dev/p/r/maxtext:1", "device_type=h100-80gb-8",
                          "num_slices=4", "max_restarts=7", f"jobset={path}",
                          "volume_claim=runs-pvc", "mount_path=/mnt/shared", "--", BASE_YML,
                          SHARED])
  assert code == 0
  doc = yaml.safe_load(path.read_text())
  assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
  assert doc["metadata"]["name"] == "llama-gpu"
  spec = doc["spec"]
  assert spec["failurePolicy"]["maxRestarts"] == 7
  assert spec["network"]["enableDNSHostnames"] is True
  (rjob,) = spec["replicatedJobs"]
  job = rjob["template"]["spec"]
  assert job["parallelism"] == job["completions"] == 4 and job["completionMode"] == "Indexed"
  assert job["backoffLimit"] == 0
  (rule,) = job["podFailurePolicy"]["rules"]
  assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "NotIn"
  restart = set(rule["onExitCodes"]["values"])
  assert 42 in restart and {134, 137} <= restart and not {0, 1, 2, 3, 4, 5} & restart
  assert len(restart) <= 255  # the API's limit on the list
  pod = job["template"]["spec"]
  assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 60
  assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
  (c,) = pod["containers"]
  assert c["name"] == rule["onExitCodes"]["containerName"]
  assert c["image"] == "us-docker.pkg.dev/p/r/maxtext:1"
  assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
  assert c["command"][:3] == ["python3", "train.py", BASE_YML] and "run_name=llama-gpu" in c["command"]
  assert c["volumeMounts"][0]["mountPath"] == "/mnt/shared"
  assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "runs-pvc"
  # the pod environment, as Kubernetes expands it for pod 3, is what our start-up code reads
  env = {e["name"]: e for e in c["env"]}
  pod_env = {"JOBSET_NAME": "llama-gpu", "JAX_PROCESS_ID": "3",
             "JAX_NUM_PROCESSES": env["JAX_NUM_PROCESSES"]["value"]}
  pod_env["JAX_COORDINATOR_ADDRESS"] = env["JAX_COORDINATOR_ADDRESS"]["value"].replace(
      "$(JOBSET_NAME)", "llama-gpu")
  assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
      "metadata.annotations['batch.kubernetes.io/job-completion-index']"
  plan = distributed.plan(load_config([BASE_YML]), pod_env)
  assert plan.coordinator_address == f"llama-gpu-{jobset.JOB_NAME}-0-0.llama-gpu:{jobset.PORT}"
  assert (plan.num_processes, plan.process_id) == (4, 3)
  with pytest.raises(ConfigError, match="DNS label"):
    jobset.manifest(name="Bad_Name", image="i", train_argv=["x"], num_nodes=1, gpus_per_node=1,
                    gke_accelerator="a")


@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2", "JAX_COORDINATOR_PORT": "6002", "NNODES": "2",
      "NODE_RANK": "1"}, ("10.0.0.2:6002", 2, 1)),                       # XPK on GPU
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "3", "JOB_COMPLETION_INDEX": "2"},
     ("h:1", 3, 2)),                                                       # XPK on CPU
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, (None, None, None)),     # JAX detects Slurm
])
def test_distributed_plan_from_environment(env, want):
  plan = distributed.plan(load_config([BASE_YML]), env)
  got = None if plan is None else (plan.coordinator_address, plan.num_processes, plan.process_id)
  assert got == want


@pytest.mark.parametrize("overrides, env, message", [
    (["num_processes=2", "process_id=0"], {}, "coordinator_address: 2 processes need"),
    (["num_processes=2", "coordinator_address=host"], {"JAX_PROCESS_ID": "0"}, "host:port"),
    (["num_processes=2", "coordinator_address=h:1"], {}, "process_id: not set"),
    (["num_processes=2", "coordinator_address=h:1", "process_id=2"], {}, r"process_id=2: must be in \[0, 2\)"),
    (["process_id=1"], {}, "process_id=1 but the run has one process"),
    ([], {"NNODES": "two"}, "num_processes: environment variable NNODES='two'"),
])
def test_distributed_plan_errors_name_the_key(overrides, env, message):
  with pytest.raises(ConfigError, match=message):
    distributed.plan(load_config([BASE_YML, *overrides]), env)


def test_local_launcher_stops_the_others_and_returns_the_first_failure(tmp_path):
  """Child 1 fails (status 3) at once; child 0 would sleep for a minute: it is killed after the
  grace period and the launcher returns 3. Each child sees its own process id."""
  script = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); "
            "print(os.environ['JAX_COORDINATOR_ADDRESS'], os.environ['JAX_NUM_PROCESSES'], i, "
            "os.environ['XLA_FLAGS'], flush=True); "
            "time.sleep(0.5) if i else time.sleep(60); sys.exit(3 if i else 0)")
  result = local.launch(["python3", "-c", script], 2, devices_per_process=4, grace_s=1,
                        log_dir=str(tmp_path))
  # child 0 exiting by SIGKILL, not with its own 0 a minute later, is the launcher's doing
  assert result.status == 3 and result.killed == [0]
  assert [(e.process_id, e.status) for e in result.exits] == [(1, 3), (0, 128 + 9)]
  for i in (0, 1):
    addr, n, pid, flags = (tmp_path / f"process_{i}.out").read_text().split(maxsplit=3)
    assert addr.startswith("127.0.0.1:") and (n, pid) == ("2", str(i))
    # the suite's own flags (tests/conftest.py) kept, its device count replaced
    kept = [f for f in os.environ["XLA_FLAGS"].split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    assert flags.split() == [*kept, "--xla_force_host_platform_device_count=4"]
  ok = local.launch(["python3", "-c", "pass"], 2, grace_s=1)
  assert ok.status == 0 and not ok.killed


def test_local_launcher_command_line_is_key_value(tmp_path, capsys):
  """processes=N devices_per_process=D log_dir=DIR -- the command; its status is the children's."""
  script = "import os; print(os.environ['JAX_NUM_PROCESSES'], os.environ['JAX_PROCESS_ID'])"
  assert local.main(["processes=2", "devices_per_process=2", f"log_dir={tmp_path}", "--",
                     "python3", "-c", script]) == 0
  assert (tmp_path / "process_1.out").read_text().split() == ["2", "1"]
  assert local.main(["processes=2", "--", "python3", "-c", "import sys; sys.exit(3)"]) == 3
  assert local.main(["num_processes=2", "--", "python3", "-c", "pass"]) == 2
  assert "unknown argument 'num_processes'" in capsys.readouterr().err
  assert local.main(["processes=2"]) == 2
  assert "no command given" in capsys.readouterr().err
