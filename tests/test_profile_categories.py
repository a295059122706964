"""benchmarks/profile_step.py and profile_maxtext.py read compiled HLO text and trace events: their
categories, loop detection, trace sums and dot FLOP, on a small synthetic HLO module written the
way XLA:CPU prints one (no jax, no MaxText; milliseconds). The loss's chunk loop is found by what
it computes (the target-logit pick), with or without a shard_map around it (1 device: none)."""
import gzip
import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import profile_maxtext  # noqa: E402
import profile_step  # noqa: E402


def _hlo(prefix: str) -> str:
  """A train step with a layer scan (trip count 4; a matmul, an element-wise op, a kernel
  all-gather, and a nested loop of its own), the loss's chunk loop (trip count 2; the head matmul,
  the target-logit pick, an element-wise op, an all-gather) and, outside the loops, the embedding
  lookup and the optimizer's finiteness check. `prefix`: the loss's jax names above its loop
  ("jit(step)/jvp()/" at 1 device; under a mesh ".../shard_map/")."""
  s, l = "jit(step)/jvp()/while/body", f"{prefix}while/body"
  return f"""HloModule jit_step

%fused_mm (p0: f32[64,32], p1: f32[32,16]) -> f32[64,16] {{
  %p0 = f32[64,32]{{1,0}} parameter(0)
  %p1 = f32[32,16]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[64,16]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="{s}/closed_call/dot_general"}}
}}

%inner_body (a: f32[64,16]) -> f32[64,16] {{
  %a = f32[64,16]{{1,0}} parameter(0)
  ROOT %negate.9 = f32[64,16]{{1,0}} negate(%a), metadata={{op_name="{s}/pallas_call/while/body/neg"}}
}}

%scan_body (t: f32[64,32]) -> f32[64,16] {{
  %t = f32[64,32]{{1,0}} parameter(0)
  %w = f32[32,16]{{1,0}} constant(0)
  %all-gather.3 = f32[32,16]{{1,0}} all-gather(%w), dimensions={{0}}, metadata={{op_name="{s}/all_gather"}}
  %ynn_fusion.1 = f32[64,16]{{1,0}} fusion(%t, %all-gather.3), kind=kCustom, calls=%fused_mm, metadata={{op_name="{s}/closed_call/dot_general"}}
  %inner.1 = f32[64,16]{{1,0}} while(%ynn_fusion.1), condition=%cond, body=%inner_body
  ROOT %wrapped_exp.2 = f32[64,16]{{1,0}} exponential(%inner.1), metadata={{op_name="{s}/closed_call/exp"}}
}}

%fused_pick (q0: f32[8,128], q1: s32[8,1]) -> f32[8,1] {{
  %q0 = f32[8,128]{{1,0}} parameter(0)
  %q1 = s32[8,1]{{1,0}} parameter(1)
  ROOT %gather.4 = f32[8,1]{{1,0}} gather(%q0, %q1), metadata={{op_name="{l}/jit(take_along_axis)/gather"}}
}}

%fused_head (h0: f32[8,16], h1: f32[16,128]) -> f32[8,128] {{
  %h0 = f32[8,16]{{1,0}} parameter(0)
  %h1 = f32[16,128]{{1,0}} parameter(1)
  ROOT %dot.2 = f32[8,128]{{1,0}} dot(%h0, %h1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_name="{l}/dot_general"}}
}}

%loss_body (c: f32[8,16]) -> f32[8,1] {{
  %c = f32[8,16]{{1,0}} parameter(0)
  %k = f32[16,128]{{1,0}} constant(0)
  %ids = s32[8,1]{{1,0}} constant(0)
  %ynn_fusion.5 = f32[8,128]{{1,0}} fusion(%c, %k), kind=kCustom, calls=%fused_head, metadata={{op_name="{l}/dot_general"}}
  %gather_fusion.6 = f32[8,1]{{1,0}} fusion(%ynn_fusion.5, %ids), kind=kLoop, calls=%fused_pick, metadata={{op_name="{l}/jit(take_along_axis)/gather"}}
  %all-gather.7 = f32[16,1]{{1,0}} all-gather(%gather_fusion.6), dimensions={{0}}, metadata={{op_name="{l}/all_gather"}}
  ROOT %wrapped_exp.8 = f32[8,1]{{1,0}} exponential(%gather_fusion.6), metadata={{op_name="{l}/exp"}}
}}

%cond (x: f32[64,16]) -> pred[] {{
  ROOT %constant.0 = pred[] constant(false)
}}

ENTRY %main.1 (x: f32[64,32], table: f32[100,32], g: f32[64,32]) -> f32[8,1] {{
  %x = f32[64,32]{{1,0}} parameter(0)
  %table = f32[100,32]{{1,0}} parameter(1)
  %g = f32[64,32]{{1,0}} parameter(2)
  %gather.10 = f32[64,32]{{1,0}} gather(%table, %x), metadata={{op_name="jit(step)/jvp()/jit(_take)/gather"}}
  %is-finite.11 = pred[64,32]{{1,0}} is-finite(%g), metadata={{op_name="jit(step)/is_finite"}}
  %while.12 = f32[64,16]{{1,0}} while(%gather.10), condition=%cond, body=%scan_body, backend_config={{"known_trip_count":{{"n":"4"}}}}
  %hidden = f32[8,16]{{1,0}} constant(0)
  ROOT %while.13 = f32[8,1]{{1,0}} while(%hidden), condition=%cond, body=%loss_body, backend_config={{"known_trip_count":{{"n":"2"}}}}
}}
"""


def test_categories_find_the_loss_loop_with_and_without_a_shard_map():
  for prefix in ("jit(step)/jvp()/", "jit(step)/jvp()/shard_map/"):   # 1 device; a mesh
    info = profile_step.op_info(_hlo(prefix))
    assert info["wrapped_exp.8"][0] == profile_step.LOSS_LOOP, prefix
    assert info["negate.9"][0] == info["wrapped_exp.2"][0] == profile_step.SCAN
    assert info["gather.10"][0] == ""
    got = {n: profile_step.category(n, info.get(n)) for n in (
        "ynn_fusion.1", "wrapped_exp.2", "all-gather.3", "ynn_fusion.5", "wrapped_exp.8",
        "all-gather.7", "gather.10", "is-finite.11", "negate.9")}
    assert got == {
        "ynn_fusion.1": "layer scan: weight matmuls, forward (and remat)",
        "wrapped_exp.2": "layer scan: element-wise (norms, RoPE, SiLU, converts)",
        "all-gather.3": "layer scan: collectives (kernel gathers, gradient all-reduce)",
        "ynn_fusion.5": "loss + LM head: the chunk loop",
        "wrapped_exp.8": "loss + LM head: the chunk loop",
        "all-gather.7": "collectives outside the layer scan (loss, head, embedding, metrics)",
        "gather.10": "embedding lookup and its gradient",
        "is-finite.11": "optimizer (clip, AdamW, non-finite guard)",
        "negate.9": "layer scan: element-wise (norms, RoPE, SiLU, converts)"}, prefix
  assert profile_step.category("launch", None) == "runtime (launch, arguments)"


def test_trace_sums_per_step_and_rendezvous_apart(tmp_path):
  events = [{"ph": "X", "name": "ynn_fusion.1", "dur": 3e5}, {"ph": "X", "name": "ynn_fusion.1",
            "dur": 3e5}, {"ph": "X", "name": "RendezvousWait", "dur": 6e5},
            {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 9e6},   # contains the ops
            {"ph": "M", "name": "thread_name", "args": {"name": "x"}}]
  os.makedirs(tmp_path / "plugins")
  with gzip.open(tmp_path / "plugins" / "a.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  times, waited = profile_step.op_times(str(tmp_path))
  assert dict(times) == {"ynn_fusion.1": 0.6 / profile_step.STEPS}
  assert waited == 0.6 / profile_step.STEPS


def test_maxtext_categories_and_dot_flop_with_trip_counts():
  hlo = _hlo("jit(step)/jvp()/")
  info, lines = profile_step.op_info(hlo), profile_maxtext.instruction_lines(hlo)
  cat = lambda n: profile_maxtext.mt_category(n, info.get(n), lines.get(n, ""), vocab=128)
  assert cat("all-gather.3") == "layer scan: collectives (kernel gathers, gradient all-reduce)"
  assert cat("ynn_fusion.1") == "layer scan: weight matmuls, forward (and remat)"
  assert cat("gather.10") == "embedding lookup and its gradient"
  assert cat("is-finite.11") == "optimizer (clip, AdamW, non-finite guard)"
  flops = profile_maxtext.dot_flops(hlo)
  # each dot: 2 x output size x contracted size, times the trip counts of its loops
  assert flops == {"ynn_fusion.1": 2.0 * 64 * 16 * 32 * 4, "ynn_fusion.5": 2.0 * 8 * 128 * 16 * 2}
