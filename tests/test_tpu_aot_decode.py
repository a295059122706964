"""benchmarks/tpu_aot_decode.py: its HLO reader (the decoding loop's body, cycles per kind and per
operation) on any machine; the command docs/performance.md gives, run exactly as written, where
libtpu's wheel is already in .libtpu-aot/ (tpu_aot.sh downloads it on first use, which CI does not
do: skipped there)."""
import json
import os
import sys


from aot_helpers import documented_command, needs_libtpu, run_documented
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tpu_aot_decode  # noqa: E402

HLO = '''
%body.1 (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %fusion.1 = bf16[8,16]{1,0:T(8,128)(2,1)} fusion(%a), kind=kLoop, calls=%c1, metadata={op_name="jit(_decode_fn)/while/body/mul"}, backend_config={"window_config":{"estimated_cycles":"1200"}}
  %fusion.2 = (f32[8]{0}, bf16[8,16]{1,0}) fusion(%b), kind=kOutput, calls=%c2, metadata={op_name="jit(_decode_fn)/while/body/dot_general"}, backend_config={"window_config":{"estimated_cycles":"90000"}}
  %fusion.3 = (f32[8]{0}, bf16[8,16]{1,0}) fusion(%c), kind=kOutput, calls=%c2, metadata={op_name="jit(_decode_fn)/while/body/dot_general"}, backend_config={"window_config":{"estimated_cycles":"10000"}}
  %copy.3 = bf16[8,16]{1,0} copy(%fusion.1), backend_config={"estimated_cycles":"500"}
}

ENTRY %main (x: bf16[8,16]) -> bf16[8,16] {
  %fusion.9 = bf16[8,16]{1,0} fusion(%x), kind=kLoop, calls=%c9, backend_config={"window_config":{"estimated_cycles":"777777"}}
  %while.1 = (s32[], bf16[8,16]) while(%t), condition=%cond.1, body=%body.1
}
'''


def test_the_step_is_the_loop_body_summed_per_kind_and_operation():
  body = tpu_aot_decode.loop_body(HLO)
  assert "fusion.9" not in body and "fusion.2" in body     # the prefix outside the loop is not
  assert tpu_aot_decode.cycles_by_kind(body) == {"kOutput": 100.0, "kLoop": 1.2, "copy": 0.5}
  ops = tpu_aot_decode.cycles_by_op(body, 2)
  assert [(o["jax_op"], o["kind"], o["kcycles"], o["count"]) for o in ops] == [
      ("dot_general", "kOutput", 100.0, 2), ("mul", "kLoop", 1.2, 1)]


@needs_libtpu
def test_the_documented_command_compiles_the_decoding_step_for_a_v5e():
  p = run_documented(documented_command("bash benchmarks/tpu_aot.sh decode", "qwen3-tiny"))
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
  assert [(r["weights"], r["batch"]) for r in rows] == [("bfloat16", 2), ("int8", 2)], rows
  for r in rows:
    # the cache is donated and updated in place: XLA aliases all of it (tiles padded), output to
    # input (without the donation: nothing)
    assert r["memory"]["alias_mib"] >= r["kv_mib"] > 0, r
    assert r["step_kcycles"] > 0 and r["prefill"]["kcycles_by_kind"], r
  assert p.stdout.count("k cycles ") == 2 * 3, p.stdout[-2000:]   # --top 3, per row


@needs_libtpu
def test_the_documented_command_compiles_the_pallas_decoding_kernel_for_a_v5e():
  """decode_attention=pallas: Mosaic compiles the kernel inside the decoding step (a tiny model)."""
  p = run_documented(documented_command("bash benchmarks/tpu_aot.sh decode",
                                        "decode_attention=pallas"))
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
  assert [(r["status"], r["batch"]) for r in rows] == [("ok", 2)], rows
  assert rows[0]["memory"]["alias_mib"] >= rows[0]["kv_mib"] > 0, rows   # the cache in place
