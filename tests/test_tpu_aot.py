"""benchmarks/tpu_aot.py: its HLO reader and variant keys on any machine; the command
docs/performance.md gives, run exactly as written, where libtpu's wheel is already in .libtpu-aot/
(tpu_aot.sh downloads ~140 MB there on first use, which CI does not do: skipped there)."""
import os
import re
import sys


from aot_helpers import documented_command, needs_libtpu, run_documented
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tpu_aot  # noqa: E402
from tpu_step import variants  # noqa: E402

HLO = '''
  %fusion.1 = bf16[8,16]{1,0:T(8,128)(2,1)} fusion(%a), kind=kLoop, calls=%c1, metadata={op_name="jit(step)/mul"}, backend_config={"window_config":{"estimated_cycles":"1200"}}
  %fusion.2 = (f32[8]{0}, bf16[8,16]{1,0}) fusion(%b), kind=kOutput, calls=%c2, metadata={op_name="jit(step)/dot_general"}, backend_config={"window_config":{"estimated_cycles":"90000"}}
  %copy.3 = bf16[8,16]{1,0} copy(%fusion.1)
'''


def test_costliest_ops_reads_array_and_tuple_shaped_ops():
  ops = tpu_aot.costliest_ops(HLO, 5)
  assert [(o["op"], o["kcycles"], o["jax_op"]) for o in ops] == [
      ("fusion.2", 90.0, "jit(step)/dot_general"), ("fusion.1", 1.2, "jit(step)/mul")]
  assert ops[0]["shape"].startswith("(f32[8]")


def test_a_variants_keys_replace_the_bases():
  got = variants("model_name=qwen3-tiny remat_policy=full per_device_batch_size=8",
                 ["qkv: remat_policy=save_qkv_attention logits_dtype=bfloat16", "plain:"])
  assert got == [("qkv", ["model_name=qwen3-tiny", "per_device_batch_size=8",
                          "remat_policy=save_qkv_attention", "logits_dtype=bfloat16"]),
                 ("plain", ["model_name=qwen3-tiny", "remat_policy=full",
                            "per_device_batch_size=8"])]


@needs_libtpu
def test_the_documented_command_compiles_the_step_for_a_v5e():
  p = run_documented(documented_command("bash benchmarks/tpu_aot.sh"))
  assert p.returncode == 0, p.stderr[-3000:]
  row = re.search(r"^\| full \| full \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+)% \|", p.stdout, re.M)
  assert row, p.stdout[-2000:]
  assert abs(float(row.group(3))) <= 10.0, row.group(0)    # the pre-flight within 10 % of XLA's
  assert len(re.findall(r"k cycles ", p.stdout)) == 3, p.stdout[-2000:]   # --top 3
