"""The default CPU device count (`train/cpu_devices.py`): one device per usable core when the user
set nothing, and never when a device count or platform was chosen."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from MaxText.train import cpu_devices

PROBE = ("from MaxText.train import cpu_devices; n = cpu_devices.apply_default(); import jax; "
         "print(n, len(jax.devices()), jax.devices()[0].platform)")


@pytest.mark.parametrize("env,chosen", [
    ({}, ""),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4"},
     "XLA_FLAGS"),
    ({"JAX_NUM_CPU_DEVICES": "3"}, "JAX_NUM_CPU_DEVICES"),
    ({"JAX_PLATFORMS": "cpu"}, "JAX_PLATFORMS"),
    ({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, ""),
])
def test_user_choice_from_the_environment(env, chosen):
  got = cpu_devices.user_choice(env, num_cpu_devices=-1, platforms=None)
  assert got.startswith(chosen) if chosen else got == ""


def test_no_change_once_the_backend_runs():
  assert cpu_devices.apply_default({}) is None   # this process already has its 8 test devices


def _probe(**env_extra):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(env_extra)
  out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120, check=True).stdout.split()
  return out


def test_one_device_per_core_when_nothing_is_set():
  want = min(cpu_devices.usable_cores(), cpu_devices.MAX_DEFAULT)
  assert _probe() == [str(want), str(want), "cpu"]


def test_user_count_wins():
  assert _probe(JAX_NUM_CPU_DEVICES="3") == ["None", "3", "cpu"]


def test_user_choice_through_jax_config():
  assert cpu_devices.user_choice({}, num_cpu_devices=2, platforms=None) == "jax_num_cpu_devices"
  assert cpu_devices.user_choice({}, num_cpu_devices=-1, platforms="cpu") == "jax_platforms"
