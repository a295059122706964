"""The row pairs of benchmarks/tpu_families.sh (issue 57: every family on one TPU v5e chip, ours
vs MaxText 0.2.5 side by side), with ONE table translating each shared shape or setting into both
trainers' config keys (`KEYS`), so both sides of a pair get the same shapes and settings by
construction, and the translation is testable on a CPU (tests/test_tpu_families.py).

  python3 benchmarks/tpu_family_rows.py plan [--quick] [ROW ...]  # the runs, one a line (below)
  python3 benchmarks/tpu_family_rows.py keys ROW ours|maxtext      # that side's key=value, one a line
  python3 benchmarks/tpu_family_rows.py report --dir OUT --commit HASH --seconds N > OUT/tpu_families.md

Plain Python (no jax): the chip's bare python3 runs it before anything is installed.

A row is `shared` (names of `KEYS` -> one value, written to both sides in each side's key names),
plus what only one side has (`ours_only`, `maxtext_only`: the best settings that side offers,
each said why in `SIDE_NOTES`). Every MaxText row also gets `override_model_config=true` (its
model files' values change only with it). Our pre-flight's plan for these shapes on a v5e
(15.75 GiB, evaluated on a CPU by the test: train/memory.py) is in each row's `note`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field

# shared name -> (our key(s), MaxText 0.2.5's key(s)); a name's value is written to every key of
# both sides. Ours: configs/base.yml + configs/models/<model>.yml; MaxText: its configs/base.yml +
# configs/models/<model>.yml (the wheel's), `base_*` model keys need override_model_config=true.
KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "model": (("model_name",), ("model_name",)),
    "layers": (("num_decoder_layers",), ("base_num_decoder_layers",)),
    "experts": (("num_experts",), ("num_experts",)),
    "experts_per_token": (("num_experts_per_tok",), ("num_experts_per_tok",)),
    "vocab": (("vocab_size",), ("vocab_size",)),
    "kv_shared_layers": (("num_kv_shared_layers",), ("num_kv_shared_layers",)),
    "seq": (("max_target_length",), ("max_target_length",)),
    "batch": (("per_device_batch_size",), ("per_device_batch_size",)),
    "remat": (("remat_policy",), ("remat_policy",)),
    "dtype": (("dtype",), ("dtype",)),
    "weight_dtype": (("weight_dtype",), ("weight_dtype",)),
    # the load-balancing loss (Switch/Qwen form on both sides): HF router_aux_loss_coef
    "aux_loss_weight": (("moe_aux_loss_weight",), ("load_balance_loss_weight",)),
    # tokens per chunk of the chunked gated delta rule (Qwen3-Next's linear layers)
    "linear_chunk": (("linear_chunk_size",), ("gdn_chunk_size",)),
    "attention": (("attention",), ("attention",)),
    # splash blocks: ours one q and one kv block (forward and backward); MaxText each block of
    # its splash kernel's forward, fused dkv backward and dq backward
    "attention_block": (("flash_block_q", "flash_block_kv"),
                        ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
                         "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq",
                         "sa_block_kv_dq")),
    # the splash backward as one fused kernel (dq, dk, dv)
    "fused_attention_bwd": (("flash_fused_bwd",), ("sa_use_fused_bwd_kernel",)),
}

# The widths each side takes from its own model file (not passed: the test checks they agree):
# name -> (our key, MaxText's key in its configs/models/<model>.yml)
WIDTHS: dict[str, tuple[str, str]] = {
    "emb": ("emb_dim", "base_emb_dim"),
    "query_heads": ("num_query_heads", "base_num_query_heads"),
    "kv_heads": ("num_kv_heads", "base_num_kv_heads"),
    "head_dim": ("head_dim", "head_dim"),
    "dense_mlp": ("mlp_dim", "base_mlp_dim"),              # models without experts only
    "expert_mlp": ("moe_mlp_dim", "base_moe_mlp_dim"),
    "global_head_dim": ("global_head_dim", "global_head_dim"),
    "sliding_window": ("sliding_window", "sliding_window_size"),
    "per_layer_input": ("per_layer_input_dim", "hidden_size_per_layer_input"),
    "per_layer_vocab": ("per_layer_input_vocab_size", "vocab_size_per_layer_input"),
    "logit_softcap": ("final_logit_softcap", "final_logits_soft_cap"),
    "linear_key_heads": ("linear_num_key_heads", "gdn_num_key_heads"),
    "linear_value_heads": ("linear_num_value_heads", "gdn_num_value_heads"),
    "linear_key_head_dim": ("linear_key_head_dim", "gdn_key_head_dim"),
    "linear_value_head_dim": ("linear_value_head_dim", "gdn_value_head_dim"),
    "linear_conv": ("linear_conv_kernel_dim", "gdn_conv_kernel_dim"),
    "partial_rotary": ("partial_rotary_factor", "partial_rotary_factor"),
    "norm_topk": ("norm_topk_prob", "norm_topk_prob"),
}

# MaxText's grouped-matmul MoE at its best settings (its configs/base.yml): the megablox GMM
# kernel (`megablox=true`) over tokens sorted by expert (`sparse_matmul=true`), dropless
# (`capacity_factor=-1`); the GMM tiles (m = token rows, k, n) at its defaults, named so a sweep
# changes them here (v5e's MXU is 128x128: every default is a multiple)
MAXTEXT_MOE = {"megablox": "true", "sparse_matmul": "true", "capacity_factor": "-1.0",
               **{f"{w}_tile_{p}_{d}": str(v)
                  for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")
                  for d, v in (("batch_seq", 512), ("embed_dim", 1024), ("mlp_dim", 1024))}}

SIDE_NOTES = {
    "megablox": "MaxText's MoE: the megablox GMM over expert-sorted tokens, dropless; ours: "
                "jax.lax.ragged_dot over expert-sorted copies, dropless (capacity_factor=0)",
    "scan_layers": "MaxText's Gemma 4 E2B/E4B refuses scan_layers=true (its per-layer KV sharing); "
                   "ours scans the 4 sliding + 1 full pattern",
}

COMMON = {"dtype": "bfloat16", "attention": "flash", "fused_attention_bwd": "true"}
MOE16 = {"model": ("qwen3-30b-a3b", "qwen3-30b-a3b"), "layers": 4, "experts": 16,
         "experts_per_token": 4, "vocab": 32768, "seq": 2048, "batch": 4, "remat": "full",
         "weight_dtype": "float32", "aux_loss_weight": 0.001, "attention_block": 1024, **COMMON}

NEXT = {"model": ("qwen3-next-80b-a3b", "qwen3-next-80b-a3b"), "layers": 4, "experts": 16,
        "experts_per_token": 10, "vocab": 32768, "seq": 2048, "batch": 4, "remat": "full",
        "weight_dtype": "float32", "aux_loss_weight": 0.001, "linear_chunk": 64,
        "attention_block": 1024, **COMMON}


@dataclass(frozen=True)
class Row:
  title: str
  shared: dict
  note: str = ""
  ours_only: dict = field(default_factory=dict)
  maxtext_only: dict | None = field(default_factory=dict)   # None: ours alone (no MaxText row)
  timeout_ours: int = 150
  timeout_maxtext: int = 170


ROWS: dict[str, Row] = {
    "moe16": Row(
        "MoE: Qwen3-30B-A3B widths, 4 layers, 16 experts top-4, vocab 32,768, seq 2048, batch 4, "
        "remat full", MOE16, maxtext_only=dict(MAXTEXT_MOE),
        note="pre-flight ~10.9 GiB of 15.75 (state 7.6)"),
    "moe64": Row(
        "MoE, more experts: Qwen3-30B-A3B widths, 2 layers, 64 experts top-8, vocab 32,768, seq "
        "2048, batch 2, remat full",
        {**MOE16, "layers": 2, "experts": 64, "experts_per_token": 8, "batch": 2},
        maxtext_only=dict(MAXTEXT_MOE),
        note="pre-flight ~15.1 GiB of 15.75 (state 11.6: the 64 experts' fp32 weights + Adam); "
             "batch 4 estimates 16.3, over the limit"),
    "gemma4": Row(
        "Gemma 4 E2B widths (head_dim 256 / global 512, window 512, PLE, soft-cap, vocab 262,144), "
        "5 layers (4 sliding + 1 full, no KV sharing), seq 2048, batch 4, remat full, bf16 weights",
        {"model": ("gemma4-e2b", "gemma4-e2b"), "layers": 5, "kv_shared_layers": 0, "seq": 2048,
         "batch": 4, "remat": "full", "weight_dtype": "bfloat16", "attention_block": 512,
         **COMMON},
        maxtext_only={"scan_layers": "false"},
        note="pre-flight ~9.2 GiB of 15.75; fp32 weights + Adam estimate 17.8 (refused): the "
             "vocabulary and per-layer tables alone are 0.74 B parameters"),
    "next2k": Row(
        "Qwen3-Next widths (GDN 16/32 heads of 128, conv 4, gated attention 16/2 x 256, shared "
        "expert), 4 layers (3 GDN + 1 full), 16 experts top-10, vocab 32,768, seq 2048, batch 4, "
        "remat full",
        NEXT,
        maxtext_only=dict(MAXTEXT_MOE), timeout_ours=170, timeout_maxtext=190,
        note="pre-flight ~10.9 GiB of 15.75; 32 experts 14.2, the whole vocabulary (151,936) "
             "19.1 (refused)"),
    "next8k": Row(
        "Qwen3-Next as above at seq 8192, batch 1 (the long row)",
        {**NEXT, "seq": 8192, "batch": 1},
        maxtext_only=dict(MAXTEXT_MOE), timeout_ours=170, timeout_maxtext=190,
        note="pre-flight ~10.9 GiB of 15.75"),
    # ours alone (not in the default list): the fastest remat our plan picks for the MoE row
    "moe16-auto": Row(
        "MoE row as moe16, ours with remat_policy=auto (the plan's fastest fit: none, ~15.7 GiB)",
        {**MOE16, "remat": "auto"}, maxtext_only=None),
    # both sides without remat (not in the default list): each trainer's fastest policy when it
    # fits (ours: what moe16-auto picks; MaxText's: its `none`, whether it fits is the question)
    "moe16-none": Row(
        "MoE row as moe16, remat none on both sides", {**MOE16, "remat": "none"},
        maxtext_only=dict(MAXTEXT_MOE), note="pre-flight ~15.7 GiB of 15.75 (XLA: 15.57)"),
}
DEFAULT_ROWS = ("moe16", "moe64", "gemma4", "next2k", "next8k")
QUICK_ROWS = ("moe16",)


def _values(value, n: int) -> tuple[str, ...]:
  """A shared value for n keys: a (ours, MaxText) pair is one per side; else the same text."""
  return tuple(str(value).lower() if isinstance(value, bool) else str(value) for _ in range(n))


def side_keys(row: Row, side: str) -> list[str]:
  """`key=value` of one side ("ours" | "maxtext") of a row, in a fixed order."""
  if side not in ("ours", "maxtext"):
    raise ValueError(f"side must be 'ours' or 'maxtext', not {side!r}")
  i = 0 if side == "ours" else 1
  if side == "maxtext" and row.maxtext_only is None:
    raise ValueError(f"row {row.title!r} has no MaxText side")
  out = ["override_model_config=true"] if side == "maxtext" else []
  for name, value in row.shared.items():
    if name not in KEYS:
      raise KeyError(f"shared setting {name!r} is not in KEYS")
    keys = KEYS[name][i]
    if isinstance(value, tuple):          # a name that differs between the two (e.g. the model)
      value = value[i]
    out += [f"{k}={v}" for k, v in zip(keys, _values(value, len(keys)))]
  only = row.ours_only if side == "ours" else (row.maxtext_only or {})
  out += [f"{k}={v}" for k, v in only.items()]
  return out


def parse_keys(keys: list[str]) -> dict[str, str]:
  return dict(k.split("=", 1) for k in keys)


def shared_values(keys: dict[str, str], side: str) -> dict[str, tuple[str, ...]]:
  """The shared settings read back from one side's keys (by `KEYS`): name -> the values of its
  keys (absent keys left out). Both sides of a row give the same dict (the test's check)."""
  i = 0 if side == "ours" else 1
  out = {}
  for name, pair in KEYS.items():
    if name == "model":
      continue
    vals = tuple(keys[k] for k in pair[i] if k in keys)
    if vals:
      out[name] = tuple(sorted(set(vals)))
  return out


# ---- the report --------------------------------------------------------------------------------
def _read_record(path: str) -> dict | None:
  try:
    with open(path, encoding="utf-8") as f:
      lines = [ln for ln in f.read().splitlines() if ln.strip()]
    return json.loads(lines[-1]) if lines else None
  except (OSError, ValueError):
    return None


def _fmt(x, spec: str) -> str:
  return "–" if x is None else format(x, spec)


def _memory_line(log_path: str) -> str:
  try:
    with open(log_path, encoding="utf-8", errors="replace") as f:
      text = f.read()
  except OSError:
    return ""
  m = re.search(r"memory per device: the compiled step's buffers ([\d.]+) GiB", text)
  return f"{m.group(1)} GiB" if m else ""


def _cell(rec: dict | None, skipped: str | None) -> tuple[str, float | None]:
  if skipped:
    return f"skipped: {skipped}", None
  if rec is None:
    return "no record", None
  tok = rec.get("tokens_per_s_per_device")
  if rec.get("exit_status") != 0 or not tok:
    tail = str(rec.get("log_tail") or "").strip().splitlines()
    why = tail[-1][:140] if tail else "no step past the warm-up"
    return f"failed (exit {rec.get('exit_status')}): {why}", None
  return (f"{tok:,.0f} tok/s, {_fmt(rec.get('mfu'), '.1%')} MFU, "
          f"{_fmt(rec.get('tflop_per_step_per_device'), '.2f')} TFLOP/step, "
          f"{_fmt(rec.get('step_time_s'), '.3f')} s/step, first step "
          f"{_fmt(rec.get('first_step_s'), '.0f')} s"), tok


def report(folder: str, commit: str, seconds: int) -> str:
  skipped = {}
  for line in _lines(os.path.join(folder, "skipped.txt")):
    name, _, why = line.partition(" ")
    skipped[name] = why
  rows = [r for r in _lines(os.path.join(folder, "rows.txt")) if r in ROWS] or list(DEFAULT_ROWS)
  out = [f"### TPU families: `benchmarks/tpu_families.sh` at {commit} ({seconds} s)", "",
         "| row | MaxText 0.2.5 | ours | ours / MaxText (tokens/s) | our compiled step |",
         "|---|---|---|---|---|"]
  for name in rows:
    row = ROWS[name]
    mt, mt_tok = ("(no MaxText row)", None) if row.maxtext_only is None else _cell(
        _read_record(os.path.join(folder, f"{name}_maxtext.json")), skipped.get(f"{name}/maxtext"))
    ours, ours_tok = _cell(_read_record(os.path.join(folder, f"{name}_ours.json")),
                           skipped.get(f"{name}/ours"))
    ratio = f"**{ours_tok / mt_tok:.2f}×**" if ours_tok and mt_tok else "–"
    out.append(f"| {name}: {row.title} | {mt} | {ours} | {ratio} | "
               f"{_memory_line(os.path.join(folder, f'{name}_ours.log')) or '–'} |")
  out += ["", "Settings (both sides from `benchmarks/tpu_family_rows.py`; synthetic data, cold "
          "compile cache, 12 steps, medians of the steps after the 5th; MFU of 197 TFLOP/s in "
          "each trainer's own FLOP count; tokens/s per device):", ""]
  for name in rows:
    row = ROWS[name]
    out.append(f"- {name} ({row.note}): ours `{' '.join(side_keys(row, 'ours'))}`" + (
        "" if row.maxtext_only is None else
        f"; MaxText `{' '.join(side_keys(row, 'maxtext'))}`"))
  out += ["", "Raw: <row>_maxtext.json/.log, <row>_ours.json/.log (benchmarks/tpu_rows.py records)."]
  return "\n".join(out)


def _lines(path: str) -> list[str]:
  try:
    with open(path, encoding="utf-8") as f:
      return [ln.strip() for ln in f if ln.strip()]
  except OSError:
    return []


def plan(names: list[str]) -> list[str]:
  """The runs of benchmarks/tpu_families.sh, one line each, tab-separated: the row, "title" and
  its title, or the side ("maxtext" before "ours"), its time limit in seconds and its keys (space-
  separated: no value holds a space)."""
  lines = []
  for name in names:
    row = ROWS[name]
    lines.append(f"{name}\ttitle\t{row.title}")
    for side in ("maxtext", "ours"):
      if side == "maxtext" and row.maxtext_only is None:
        continue
      limit = row.timeout_maxtext if side == "maxtext" else row.timeout_ours
      lines.append(f"{name}\t{side}\t{limit}\t{' '.join(side_keys(row, side))}")
  return lines


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("plan")
  r.add_argument("--quick", action="store_true", help="the quick rows when none are named")
  r.add_argument("rows", nargs="*", help=f"default: {' '.join(DEFAULT_ROWS)}")
  k = sub.add_parser("keys")
  k.add_argument("row")
  k.add_argument("side", choices=("ours", "maxtext"))
  p = sub.add_parser("report")
  p.add_argument("--dir", required=True)
  p.add_argument("--commit", default="unknown")
  p.add_argument("--seconds", type=int, default=0)
  args = ap.parse_args(argv)
  if args.cmd == "report":
    print(report(args.dir, args.commit, args.seconds))
    return 0
  names = args.rows if args.cmd == "plan" else [args.row]
  names = names or list(QUICK_ROWS if args.quick else DEFAULT_ROWS)
  bad = [n for n in names if n not in ROWS]
  if bad:
    print(f"tpu_family_rows: no row {bad[0]!r} (rows: {', '.join(ROWS)})", file=sys.stderr)
    return 2
  if args.cmd == "plan":
    print("\n".join(plan(names)))
  elif args.side == "ours" or ROWS[args.row].maxtext_only is not None:
    print("\n".join(side_keys(ROWS[args.row], args.side)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
