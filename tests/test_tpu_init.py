"""The init program's compile options per platform (`model_def.init_compiler_options`: a TPU's
small fusion windows, a small model's unoptimised CPU compile), benchmarks/tpu_init.py's HLO
readers, and its documented deviceless command run exactly as written where libtpu's wheel is in
.libtpu-aot/ (skipped elsewhere, as tests/test_tpu_aot.py's): the init program compiled for a v5e
under XLA's default options and the init's, the same operations with smaller windows."""
import json
import os
import re
import shlex
import sys

import jax
import pytest

from aot_helpers import documented_command, needs_libtpu, run_documented
from conftest import ROOT
from MaxText.models import model_def as md
from MaxText.models.registry import get_family, init_options
from tests.test_init_rng import _mcfg

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tpu_init  # noqa: E402


def test_init_options_follow_the_platform_the_program_runs_on():
  mcfg = _mcfg("model_name=qwen3-tiny")
  assert init_options(mcfg, "cpu") == {"xla_backend_optimization_level": 0}   # small: unoptimised
  assert init_options(mcfg, "tpu") == md.TPU_INIT_OPTIONS == {"xla_tpu_scoped_vmem_limit_kib": 2048}
  assert init_options(mcfg, "gpu") is None
  assert init_options(mcfg) == init_options(mcfg, "cpu")   # this process's default device
  # a CPU model above the size where optimising its init pays off: XLA's default
  big = _mcfg("model_name=qwen3-0.6b")
  assert md._param_count(get_family(big.decoder_block).build, big) >= md.CPU_UNOPTIMISED_INIT_PARAMS  # pylint: disable=protected-access
  assert init_options(big, "cpu") is None and init_options(big, "tpu") == md.TPU_INIT_OPTIONS


def test_the_default_platform_is_the_default_devices(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert md.default_platform() == "tpu"
  with jax.default_device(jax.devices("cpu")[0]):   # e.g. the chip's tests' CPU init
    assert md.default_platform() == "cpu"
  with jax.default_device("cpu"):
    assert md.default_platform() == "cpu"


HLO_A = '''
%fused_computation.7 (param_0.1: u32[8]) -> f32[8] {
  %param_0.1 = u32[8]{0:T(1024)} parameter(0)
  %shift.2 = u32[8]{0:T(1024)} shift-right-logical(%param_0.1, %c.3), metadata={op_name="a"}
  ROOT %mul.4 = f32[8]{0:T(1024)} multiply(%shift.2, %c.5)
}

ENTRY %main.9 () -> f32[2,4] {
  %fusion.1 = f32[8]{0:T(1024)} fusion(%rng.2), kind=kLoop, calls=%fused_computation.7, backend_config={"window_config":{"output_window_bounds":["8"],"estimated_cycles":"100"}}
  ROOT %copy.3 = f32[2,4]{1,0:T(2,128)} copy(%fusion.1)
}
'''


UNFUSED = '''
ENTRY %main.9 () -> f32[2,4] {
  %s = u32[8]{0} shift-right-logical(%rng.2, %c.3)
  %m = f32[8]{0} multiply(%s, %c.5)
  ROOT %copy.3 = f32[2,4]{1,0:T(2,128)} copy(%m)
}
'''


def test_program_signature_leaves_out_windows_layouts_names_and_metadata_not_operations():
  renamed = (HLO_A.replace("%fused_computation.7", "%fused_computation.3")
             .replace("mul.4", "mul.9").replace("shift.2", "s.1").replace("param_0.1", "p.7")
             .replace('["8"]', '["1"]').replace('"100"', '"900"')
             .replace("{0:T(1024)}", "{0:T(256)}").replace(', metadata={op_name="a"}', ""))
  signature = tpu_init.program_signature(HLO_A)
  assert signature and tpu_init.program_signature(renamed) == signature
  # the fusion's operands in another order, its parameters renumbered to match; another kind
  swapped = (HLO_A.replace("(param_0.1: u32[8])", "(q: f32[], param_0.1: u32[8])")
             .replace("parameter(0)", "parameter(1)").replace("fusion(%rng.2)", "fusion(%z, %rng.2)")
             .replace("kind=kLoop", "kind=kInput"))
  assert tpu_init.program_signature(swapped) == signature
  assert tpu_init.program_signature(UNFUSED) == signature   # however XLA fused it
  for changed in (HLO_A.replace("multiply(", "add("), HLO_A.replace("f32[2,4]", "f32[4,2]"),
                  HLO_A.replace("(%shift.2, %c.5)", "(%c.5, %shift.2)"),   # operands' order
                  HLO_A.replace("%c.3), metadata", "%c.4), metadata")):
    assert tpu_init.program_signature(changed) != signature, changed


class _Compiled:
  def __init__(self, text):
    self.text = text

  def as_text(self):
    return self.text


def test_largest_window_and_estimated_cycles_read_the_backend_configs():
  two = HLO_A.replace('"estimated_cycles":"100"}}', '"estimated_cycles":"100"}}\n  %fusion.5 = '
                      'f32[8] fusion(%a), backend_config={"window_config":{"output_window_bounds":'
                      '["3","5"],"estimated_cycles":"2000000"}}')
  assert tpu_init.largest_window(_Compiled(two)) == 15
  assert tpu_init.estimated_mcycles(_Compiled(two)) == pytest.approx(2.0001)
  assert tpu_init.largest_window(_Compiled("HloModule m")) == 0


def _documented_command() -> str:
  return documented_command("bash benchmarks/tpu_aot.sh benchmarks/tpu_init.py")


def test_the_documented_command_is_in_the_docs():
  assert shlex.split(_documented_command())[3:] == ["--aot", "qwen3-tiny"]


@needs_libtpu
def test_the_documented_command_compiles_the_init_for_a_v5e_with_smaller_windows():
  p = run_documented(_documented_command())
  assert p.returncode == 0, p.stderr[-3000:]
  rows = json.loads(p.stdout.strip().splitlines()[-1])
  default = rows["qwen3-tiny fresh init, default (rep 0)"]
  init = rows["qwen3-tiny fresh init, init options (rep 0)"]
  assert default["options"] == {} and init["options"] == md.TPU_INIT_OPTIONS
  assert init["same_ops"] is True                                   # the same operations
  assert 0 < init["largest_window"] < default["largest_window"]    # in smaller windows
  assert {"parameters", "optimizer state"} == {
      re.match(r"qwen3-tiny (.*) alone", k).group(1) for k in rows if " alone" in k}


VMEM_OOM = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of memory in memory space "
            "vmem while allocating on stack for %rng-bit-generator = u32[556032]{0:T(1024)} "
            "rng-bit-generator(%custom-call). Scoped allocation with size 2.12M and limit 2.00M "
            "exceeded scoped vmem limit by 124.0K.")   # a v5e's, under other effort options


def test_an_init_a_tpu_cannot_fit_in_the_scoped_vmem_is_made_again_with_xlas_defaults():
  made = []

  def make(options):
    made.append(options)

    def call(x):
      if options:
        raise jax.errors.JaxRuntimeError(VMEM_OOM)
      return x + 1
    return call
  assert md.with_init_options(make, dict(md.TPU_INIT_OPTIONS), 1) == 2
  assert made == [md.TPU_INIT_OPTIONS, None]
  # another failure (the HBM), or other options (a CPU's), are not tried again
  def out_of_hbm(options):
    def call():
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    return call
  with pytest.raises(jax.errors.JaxRuntimeError, match="HBM"):
    md.with_init_options(out_of_hbm, dict(md.TPU_INIT_OPTIONS))
  with pytest.raises(jax.errors.JaxRuntimeError, match="vmem"):
    md.with_init_options(make, {"xla_backend_optimization_level": 0}, 1)
