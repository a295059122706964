"""benchmarks/tpu_aot.py (and tpu_aot_update.py): its HLO reader and variant keys on any machine;
the commands docs/performance.md gives, run exactly as written, where libtpu's wheel is already in .libtpu-aot/
(tpu_aot.sh downloads ~140 MB there on first use, which CI does not do: skipped there)."""
import os
import re
import sys


from aot_helpers import documented_command, needs_libtpu, run_documented
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tpu_aot  # noqa: E402
import tpu_aot_update  # noqa: E402
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


LOOP_HLO = """
%fused_computation.1 (p: f32[8]) -> f32[8] {
  %fusion.9 = f32[8]{0} fusion(%p), kind=kLoop, backend_config={"estimated_cycles":"7"}
}

%called (p: f32[8]) -> f32[8] {
  %fusion.5 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.1, backend_config={"window_config":{"estimated_cycles":"1"}}
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %fusion.3 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation.1, backend_config={"window_config":{"estimated_cycles":"10"}}
  %call.4 = f32[8]{0} call(%fusion.3), to_apply=%called
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %constant.1 = s32[] constant(3)
  ROOT %compare.2 = pred[] compare(%i, %constant.1), direction=LT
}

%branch (p: f32[8]) -> f32[8] {
  %fusion.7 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_computation.1, backend_config={"window_config":{"estimated_cycles":"1000"}}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %fusion.1 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1, backend_config={"window_config":{"estimated_cycles":"100"}}
  %while.2 = (s32[], f32[8]) while(%tuple.1), condition=%cond, body=%body, metadata={op_name="jit(step)/while"}
  %conditional.3 = f32[8]{0} conditional(%p, %a, %a), branch_computations={%branch, %branch}
}
"""


def test_program_cycles_counts_a_loop_body_per_trip():
  # the entry's 100, the body's 10 and its call's 1 three times (the condition's constant), no
  # conditional branch and no instruction inside a fused computation
  assert tpu_aot.program_cycles(LOOP_HLO) == 100 + 3 * (10 + 1)


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


UPDATE_HLO = """
%fused_computation.1 (p: bf16[4,8]) -> bf16[4,8] {
  %fusion.9 = bf16[4,8]{1,0} fusion(%p), kind=kLoop, backend_config={"estimated_cycles":"7"}
}

ENTRY %main (a: bf16[4,8], b: bf16[8]) -> bf16[4,8] {
  %fusion.1 = (bf16[4,8]{1,0:T(8,128)}, bf16[4,8]{1,0}, bf16[4,8]{1,0}) fusion(%a), kind=kLoop, backend_config={"window_config":{"estimated_cycles":"300"}}
  %fusion.2 = bf16[4,8]{1,0} fusion(%a), kind=kLoop, backend_config={"window_config":{"estimated_cycles":"200"}}
  %fusion.3 = (bf16[8]{0}, bf16[8]{0}, bf16[8]{0}) fusion(%b), kind=kLoop, backend_config={"window_config":{"estimated_cycles":"50"}}
  %fusion.4 = f32[] fusion(%a), kind=kLoop, backend_config={"window_config":{"estimated_cycles":"40"}}
  %copy.5 = bf16[4,8]{1,0} copy(%fusion.2), backend_config={"window_config":{"estimated_cycles":"9"}}
}
"""


def test_update_passes_are_counted_per_parameter_of_a_shape():
  # two [4, 8] parameters: fusion.1 and .2 write that shape (the entry's only: fused computations
  # and the copy are not passes), one per parameter; the [8] one has fusion.3's; [2] none
  got = tpu_aot_update.passes_per_shape(UPDATE_HLO, [(4, 8), (8,), (4, 8), (2,)])
  assert got == {(4, 8): (2, 1.0, 500), (8,): (1, 1.0, 50), (2,): (1, 0.0, 0)}


@needs_libtpu
def test_the_documented_update_is_one_pass_per_parameter_with_bf16_weights():
  p = run_documented(documented_command("bash benchmarks/tpu_aot.sh benchmarks/tpu_aot_update.py"))
  assert p.returncode == 0, p.stderr[-3000:]
  rows = re.findall(r"^\| (\[[\d, ]*\]) \| (\d+) \| ([\d.]+) \| (\d+) \|$", p.stdout, re.M)
  assert len(rows) >= 5, p.stdout[-2000:]   # qwen3-tiny's parameter shapes
  assert all(float(per) == 1.0 for _, _, per, _ in rows), p.stdout   # two before through_stored
