"""The DPO trainer (python -m MaxText.dpo) on a tiny random model, in this process on 8 fake devices:
the preference metrics are logged per step and rise, a run resumed from its checkpoint ends bit for
bit where the uninterrupted one did (the pairs of a step are a function of (seed, step)), SIGTERM
saves and exits 42, gradient accumulation equals one big batch, LoRA's reference is the base (no
copy), ORPO / SimPO hold no reference, chat rows are rendered as transformers renders them with the
response's tokens alone in the loss, and each bad input is refused with its exit status naming the
culprit."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import CACHE_DIR, ROOT, argv, read_metrics
from MaxText.dpo.trainer import DPOTrainer
from MaxText.losses.preference import METRICS
from MaxText.train.loop import run

DPO_YML = os.path.join(ROOT, "configs", "dpo.yml")
TINY = ["emb_dim=32", "num_decoder_layers=1", "num_query_heads=2", "num_kv_heads=1", "head_dim=16",
        "mlp_dim=64", "vocab_size=264", "max_target_length=16", "per_device_batch_size=1",
        "enable_tensorboard=false", "peak_tflops_per_device=1.0", f"jax_cache_dir={CACHE_DIR}",
        "log_period=1", "learning_rate=1e-2", "beta=0.5", "dtype=float32"]   # exact: fp32


def write_pairs(path, n=24, seed=0, bad_line=None):
  rng = np.random.default_rng(seed)
  with open(path, "w", encoding="utf-8") as f:
    for i in range(n):
      a, b = (int(x) for x in rng.integers(0, 30, 2))
      row = {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + i % 3)}
      if bad_line is not None and i + 1 == bad_line:
        del row["chosen"]
      f.write(json.dumps(row) + "\n")
  return str(path)


def dpo(out, name, *overrides):
  code, trainer = run(argv(out, name, *overrides, config=DPO_YML, model=TINY),
                      trainer_class=DPOTrainer)
  path = os.path.join(str(out), name, "metrics.jsonl")
  rows = read_metrics(os.path.join(str(out), name)) if os.path.exists(path) else []
  return code, rows, trainer


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("dpo")
  pairs = write_pairs(out / "p.jsonl")
  code, rows, trainer = dpo(out, "run", f"preferences={pairs}", f"eval_preferences={pairs}",
                            "eval_preferences_period=6", "steps=12", "checkpoint_period=8",
                            "max_checkpoints_to_keep=5")   # saved at 8 (resumed) and 12
  assert code == 0
  return out, pairs, rows, trainer.final_state


def test_the_preference_metrics_are_logged_per_step_and_rise(learning_run):
  _, _, rows, _ = learning_run
  steps = [r for r in rows if "rewards/accuracies" in r]
  assert [r["step"] for r in steps] == list(range(1, 13))
  for r in steps:
    assert set(METRICS) <= set(r) and r["finite"] == 1.0
    assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"],
                                                 abs=1e-6)
  # step 1 starts at the reference: every reward is 0, the loss log 2
  assert steps[0]["rewards/chosen"] == 0 and steps[0]["rewards/accuracies"] == 0
  assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
  evals = [r for r in rows if "eval/rewards/accuracies" in r]
  assert [r["step"] for r in evals] == [0, 6, 12]
  assert evals[0]["eval/rewards/accuracies"] == 0 and evals[0]["eval/pairs"] == 24
  assert evals[-1]["eval/rewards/accuracies"] >= 0.75, evals
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] - 0.1
  assert np.mean([r["loss"] for r in steps[-4:]]) < np.mean([r["loss"] for r in steps[:4]])


def test_resume_is_bitwise(learning_run, tmp_path):
  out, pairs, rows, final = learning_run
  shutil.copytree(out / "run", tmp_path / "run")
  for name in os.listdir(tmp_path / "run" / "checkpoints"):   # resumed from step 8: 4 steps
    if name.isdigit() and int(name) > 8:
      shutil.rmtree(tmp_path / "run" / "checkpoints" / name)
  code, resumed, trainer = dpo(tmp_path, "run", f"preferences={pairs}", "steps=12",
                               "checkpoint_period=8", "max_checkpoints_to_keep=5")
  assert code == 0
  got = {r["step"]: r for r in resumed if "rewards/accuracies" in r}
  for r in rows:
    if "rewards/accuracies" in r and r["step"] > 8:
      for k in ("loss", *METRICS):
        assert got[r["step"]][k] == r[k], (r["step"], k)
  for a, b in zip(jax.tree.leaves(final["params"]), jax.tree.leaves(trainer.final_state["params"])):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_saves_exits_42_and_the_rerun_continues(learning_run, tmp_path, monkeypatch):
  _, pairs, rows, _ = learning_run
  args = (f"preferences={pairs}", "steps=5", "checkpoint_period=100")
  monkeypatch.setenv("MAXTEXT_FAULT", "sigterm_at_step:3")
  code, _, _ = dpo(tmp_path, "run", *args)
  assert code == 42
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["3"]
  monkeypatch.delenv("MAXTEXT_FAULT")
  code, resumed, _ = dpo(tmp_path, "run", *args)
  assert code == 0
  got = {r["step"]: r for r in resumed if "rewards/accuracies" in r}
  assert sorted(got) == [1, 2, 3, 4, 5]
  for want in [r for r in rows if "rewards/accuracies" in r][:5]:   # the uninterrupted run's
    assert got[want["step"]]["loss"] == want["loss"]


@pytest.fixture(scope="module")
def orpo_runs(tmp_path_factory):
  """ORPO, 2 steps of 2 pairs per device, in one batch and in 2 accumulated micro-batches:
  {accumulation steps: (exit code, metrics, trainer)}, the accumulation test's runs and the
  reference-free test's ORPO run."""
  out = tmp_path_factory.mktemp("orpo")
  pairs = write_pairs(out / "p.jsonl")
  return {accum: dpo(out, f"a{accum}", f"preferences={pairs}", "steps=2",
                     f"per_device_batch_size={2 // accum}", f"gradient_accumulation_steps={accum}",
                     "enable_checkpointing=false", "dpo_loss=orpo")
          for accum in (1, 2)}


def test_gradient_accumulation_equals_one_batch(orpo_runs):
  finals = {}
  for accum, (code, rows, trainer) in orpo_runs.items():
    assert code == 0
    finals[accum] = ([r for r in rows if "loss" in r], trainer.final_state["params"])
  (rows1, p1), (rows2, p2) = finals[1], finals[2]
  for a, b in zip(rows1, rows2):
    for k in ("loss", "nll_loss", "grad_norm", *METRICS):
      assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_lora_reference_is_the_base_and_no_copy_is_held(tmp_path):
  pairs = write_pairs(tmp_path / "p.jsonl")
  code, rows, trainer = dpo(tmp_path, "lora", f"preferences={pairs}", "lora_rank=4", "steps=3",
                            "enable_checkpointing=false")
  assert code == 0
  assert trainer.reference is None and trainer.memory_estimate().reference == 0
  steps = [r for r in rows if "loss" in r]
  assert steps[0]["rewards/chosen"] == 0            # the adapters start at zero: policy = base
  assert steps[-1]["rewards/chosen"] != 0           # then the policy moves off the base
  from MaxText.layers import lora   # pylint: disable=import-outside-toplevel
  from MaxText.train.state import init_state   # pylint: disable=import-outside-toplevel
  start = init_state(trainer.mcfg, trainer.cfg.seed, trainer.tx, trainer.shardings)
  for a, b in zip(jax.tree.leaves(lora.split(trainer.final_state["params"])[1]),
                  jax.tree.leaves(lora.split(start["params"])[1])):
    assert np.array_equal(np.asarray(a), np.asarray(b))   # the base is frozen


@pytest.mark.parametrize("loss", ["orpo", "simpo"])
def test_reference_free_losses_hold_no_reference(tmp_path, loss, request):
  if loss == "orpo":     # the accumulation test's ORPO run (2 micro-batches of 1 pair per device)
    code, rows, trainer = request.getfixturevalue("orpo_runs")[2]
  else:
    pairs = write_pairs(tmp_path / "p.jsonl")
    code, rows, trainer = dpo(tmp_path, loss, f"preferences={pairs}", f"dpo_loss={loss}",
                              "steps=2", "enable_checkpointing=false")
  assert code == 0
  assert trainer.reference is None and trainer.memory_estimate().reference == 0
  first = [r for r in rows if "loss" in r][0]
  assert first["rewards/chosen"] == pytest.approx(0.5 * first["logps/chosen"], rel=1e-6)
  assert ("nll_loss" in first) == (loss == "orpo")
  # without LoRA a reference-based loss does hold a copy of the parameters
  from MaxText.config.load import replace   # pylint: disable=import-outside-toplevel
  ref_trainer = DPOTrainer(replace(trainer.cfg, dpo_loss="ipo"))
  assert ref_trainer.memory_estimate().reference > 0


def test_precomputed_reference_equals_the_frozen_copy_and_is_read_back(learning_run, tmp_path,
                                                                       capsys):
  """precompute_ref_log_probs: the reference's sums computed once (no copy held, none counted)
  give the frozen copy's steps and held-out metrics; reference_logps reads them back from that
  run's folder; a folder computed for other pairs exits 3 naming reference_logps."""
  out, pairs, rows, _ = learning_run
  args = (f"preferences={pairs}", f"eval_preferences={pairs}", "steps=4",
          "enable_checkpointing=false")
  code, pre, trainer = dpo(tmp_path, "pre", *args, "precompute_ref_log_probs=true")
  assert code == 0
  assert trainer.reference is None and trainer.memory_estimate().reference == 0
  folder = tmp_path / "pre" / "reference_logps"
  assert sorted(os.listdir(folder)) == ["eval_preferences.jsonl", "preferences.jsonl"]
  code, read, _ = dpo(tmp_path, "read", *args, f"reference_logps={folder}")
  assert code == 0
  want = {(r["step"], k): v for r in rows for k, v in r.items()
          if r["step"] <= 4 and (k in ("loss", *METRICS) or k.startswith("eval/"))}
  for got_rows in (pre, read):
    got = {(r["step"], k): v for r in got_rows for k, v in r.items() if (r["step"], k) in want}
    assert got.keys() == want.keys() and len(want) > 8 * 4
    for key, v in want.items():
      assert got[key] == pytest.approx(v, abs=1e-6), key
  other = write_pairs(tmp_path / "other.jsonl", n=20, seed=5)
  code, _, _ = dpo(tmp_path, "bad", f"preferences={other}", "steps=1",
                   "enable_checkpointing=false", f"reference_logps={folder}")
  err = capsys.readouterr().err
  assert code == 3 and f"reference_logps={folder}: preferences.jsonl" in err, err


def test_packed_pairs_equal_padded_pairs(tmp_path):
  """preference_packing: a pair's two sequences in one row (half the rows) give the padded rows'
  losses, metrics and held-out metrics, with a frozen reference and with gradient accumulation."""
  pairs = write_pairs(tmp_path / "p.jsonl")
  args = (f"preferences={pairs}", f"eval_preferences={pairs}", "steps=3", "max_target_length=24",
          "gradient_accumulation_steps=2", "enable_checkpointing=false")
  code, padded, _ = dpo(tmp_path, "padded", *args)
  assert code == 0
  code, packed, trainer = dpo(tmp_path, "packed", *args, "preference_packing=true")
  assert code == 0 and trainer.global_batch == trainer.pairs
  keys = lambda r: [k for k in r if k in ("loss", "grad_norm", *METRICS) or k.startswith("eval/")]
  want = {(r["step"], k): r[k] for r in padded for k in keys(r)}
  got = {(r["step"], k): r[k] for r in packed for k in keys(r)}
  assert got.keys() == want.keys() and len(want) > 3 * 8
  for key, v in want.items():
    if key[1].endswith("accuracies") and abs(want[(key[0], key[1][:-10] + "margins")]) < 1e-4:
      continue   # the policy is the reference: the sign of rounding noise
    assert got[key] == pytest.approx(v, abs=1e-5), key


@pytest.mark.parametrize("overrides,code_,expected", [
    (("preferences={bad}",), 3, r"line 3: missing field `chosen`"),
    (("preferences={missing}",), 2, r"config error: preferences=.*nope.jsonl: no such file"),
    (("preferences={good}", "label_smoothing=0.1"), 2, "label_smoothing: .*robust and simpo"),
    (("preferences={good}", "dpo_loss=robust", "label_smoothing=0.5"), 2, "label_smoothing"),
    ((), 2, "preferences: DPO needs"),
    (("preferences={good}", "z_loss_weight=0.1"), 2, "z_loss_weight: the preference losses"),
    (("preferences={good}", "temperature=1.0"), 2, "temperature=1.0: python -m MaxText.dpo does "
                                                   "not read temperature"),
    (("preferences={good}", "dpo_loss=orpo", "precompute_ref_log_probs=true"), 2,
     "precompute_ref_log_probs: dpo_loss=orpo has no reference"),
    (("preferences={good}", "preference_packing=true"), 3,
     r"line \d+: packed, prompt \+ chosen and prompt \+ rejected are 1\d positions"),
    (("preferences={long}",), 3, r"line 1, field `chosen`: prompt \+ response are .* tokens"),
])
def test_bad_input_is_refused_naming_the_culprit(tmp_path, capsys, overrides, code_, expected):
  import re   # pylint: disable=import-outside-toplevel
  files = {"bad": write_pairs(tmp_path / "bad.jsonl", bad_line=3),
           "good": write_pairs(tmp_path / "good.jsonl"), "missing": str(tmp_path / "nope.jsonl")}
  (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "1+1=" * 5, "chosen": "2",
                                                   "rejected": "3"}) + "\n")
  files["long"] = str(tmp_path / "long.jsonl")
  code, _, _ = dpo(tmp_path, "bad", *(o.format(**files) for o in overrides))
  err = capsys.readouterr().err
  assert code == code_, err
  assert re.search(expected, err), err
  assert "Traceback" not in err


def test_chat_rows_render_as_transformers_and_mask_the_response_only(tmp_path):
  from sft_helpers import save_qwen3_chat   # pylint: disable=import-outside-toplevel
  from MaxText.data import sft   # pylint: disable=import-outside-toplevel
  from MaxText.data.tokenizers import make_tokenizer   # pylint: disable=import-outside-toplevel
  from MaxText.dpo.data import Encoder, read_preferences   # pylint: disable=import-outside-toplevel
  hf_tok = save_qwen3_chat(tmp_path)
  tok = make_tokenizer("huggingface", str(tmp_path))
  prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hey"}, {"role": "user", "content": "two plus two"}]
  rows = [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "four"}],
           "rejected": "five"}]
  (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  enc = Encoder(tok, False, lambda: sft.ChatFormat.for_tokenizer(str(tmp_path)))
  got = read_preferences(str(tmp_path / "p.jsonl"), "preferences", enc, 96, 0)
  for side, answer in (("chosen", "four"), ("rejected", "five")):
    want = hf_tok.apply_chat_template(prompt + [{"role": "assistant", "content": answer}],
                                      tokenize=False)
    want_ids = hf_tok(want, add_special_tokens=False)["input_ids"]
    a = {k: v[0] for k, v in got.sides[side].items()}
    n = int(a["segments"].sum())
    assert [int(a["inputs"][0]), *a["targets"][:n].tolist()] == want_ids
    # the response = what the template writes after the prompt's generation prompt (as TRL splits
    # prompt and completion): Qwen3's empty think block, the answer, the end of turn — not "hey"
    prefix = hf_tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert want.startswith(prefix)
    in_loss = hf_tok.decode(a["targets"][a["mask"] > 0].tolist())
    assert in_loss == want[len(prefix):].rstrip(), in_loss
    assert in_loss.endswith(f"{answer}<|im_end|>") and "hey" not in in_loss
