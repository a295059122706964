"""The GRPO loop (python -m MaxText.rl.grpo) on a tiny random model, in this process on 8 fake
devices: the reward rises (a dense "share of digits" reward, high learning rate), a run resumed
from its checkpoint ends bit for bit where the uninterrupted one did (samples and prompts are
functions of (seed, step)), bad rewards are counted up to max_bad_rewards then exit 3, and each
bad input is refused with exit 2 naming its culprit before anything compiles."""
import os
import re
import shutil

import jax
import numpy as np
import pytest

from conftest import CACHE_DIR, ROOT, argv, read_metrics
from grpo_helpers import write_prompts
from test_metrics_read import record_saves
from MaxText.rl.grpo import GRPOTrainer
from MaxText.train.loop import run

GRPO_YML = os.path.join(ROOT, "configs", "grpo.yml")
TINY = ["emb_dim=32", "num_decoder_layers=1", "num_query_heads=2", "num_kv_heads=1", "head_dim=16",
        "mlp_dim=64", "vocab_size=264", "max_target_length=16", "max_new_tokens=6",
        "num_generations=4", "prompts_per_step=4", "enable_tensorboard=false",
        "peak_tflops_per_device=1.0", f"jax_cache_dir={CACHE_DIR}", "log_period=1",
        "learning_rate=3e-2", "kl_beta=0.01", "dtype=float32"]   # exact comparisons: fp32


def grpo(out, name, *overrides):
  code, trainer = run(argv(out, name, *overrides, config=GRPO_YML, model=TINY),
                      trainer_class=GRPOTrainer)
  path = os.path.join(str(out), name, "metrics.jsonl")
  rows = read_metrics(os.path.join(str(out), name)) if os.path.exists(path) else []
  return code, rows, trainer


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("grpo")
  prompts = write_prompts(out / "p.jsonl")
  # checkpoints at 14 and 16: test_resume_is_bitwise restarts from 14 (any step before the last
  # would do; a late one leaves the resumed run fewer steps to run again)
  code, rows, trainer = grpo(out, "run", f"prompts={prompts}", "reward=grpo_helpers:digits",
                             "steps=16", "checkpoint_period=14", "max_checkpoints_to_keep=5")
  assert code == 0
  return out, prompts, [r for r in rows if "reward_mean" in r], trainer.final_state


def test_reward_rises(learning_run):
  _, _, rows, _ = learning_run
  assert [r["step"] for r in rows] == list(range(1, 17))
  first = np.mean([r["reward_mean"] for r in rows[:4]])
  last = np.mean([r["reward_mean"] for r in rows[-4:]])
  print(f"digit share: first 4 steps {first:.3f}, last 4 {last:.3f}")
  assert last > first + 0.2, (first, last)
  # on-policy (num_iterations=1): the engine's log-probabilities are the trainer's
  assert max(r["rollout_logprob_diff_max"] for r in rows) < 1e-3
  assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows)
  for key in ("kl", "clip_frac_low", "clip_frac_high", "entropy", "response_length",
              "reward_std", "reward/grpo_helpers:digits", "rollout_time_s", "train_time_s"):
    assert key in rows[-1], key
  assert rows[-1]["kl"] > 0


def test_resume_is_bitwise(learning_run, tmp_path):
  out, prompts, rows, final = learning_run
  shutil.copytree(out / "run", tmp_path / "run")
  for name in os.listdir(tmp_path / "run" / "checkpoints"):
    if name.isdigit() and int(name) > 14:
      shutil.rmtree(tmp_path / "run" / "checkpoints" / name)
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["14"]
  code, resumed, trainer = grpo(tmp_path, "run", f"prompts={prompts}",
                                "reward=grpo_helpers:digits", "steps=16", "checkpoint_period=14",
                                "max_checkpoints_to_keep=5")
  assert code == 0
  resumed = {r["step"]: r for r in resumed if "reward_mean" in r}
  for r in rows[14:]:
    assert resumed[r["step"]]["reward_mean"] == r["reward_mean"]
    assert resumed[r["step"]]["loss"] == r["loss"]
  for a, b in zip(jax.tree.leaves(final["params"]), jax.tree.leaves(trainer.final_state["params"])):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bad_rewards_are_counted_then_exit_3(tmp_path, capsys):
  prompts = write_prompts(tmp_path / "p.jsonl")
  code, rows, _ = grpo(tmp_path, "bad", f"prompts={prompts}",
                       "reward=grpo_helpers:digits,grpo_helpers:flaky", "steps=2",
                       "max_bad_rewards=10", "enable_checkpointing=false")
  err = capsys.readouterr().err
  assert code == 3, err[-2000:]
  assert "bad reward (1/10 allowed, max_bad_rewards): grpo_helpers:flaky " in err
  assert re.search(r"grpo_helpers:flaky raised ValueError: cannot score row (\d+) on \S+p.jsonl "
                   r"line (\d+)", err)
  assert "grpo_helpers:flaky returned str 'yes', not a number" in err
  assert "more than max_bad_rewards=10" in err
  assert "line" in err and "p.jsonl" in err


@pytest.mark.parametrize("overrides,expected", [
    (["num_generations=1"], "num_generations=1: GRPO's advantages are relative"),
    (["reward=no_such_package.rewards:score"], "module 'no_such_package.rewards' does not import"),
    (["reward=grpo_helpers:no_such_function"], "has no function 'no_such_function'"),
    (["reward="], "GRPO needs at least one reward function"),
    (["max_new_tokens=6", "LONG"], "line 9: the prompt has 12 tokens, more than the 10 allowed "
                                   "(max_target_length=16 - max_new_tokens=6)"),
    (["temperature=0"], "temperature=0 decodes greedily"),
    (["overlong_buffer=7"], "overlong_buffer=7 exceeds max_new_tokens=6"),
    (["dynamic_sampling_rounds=2"], "dynamic_sampling_rounds resamples the groups"),
    (["microbatch_size=5"], "microbatch_size=5 does not divide the rollout batch's 16 rows"),
    (["gradient_accumulation_steps=2"], "set microbatch_size (rows per micro-batch) instead"),
    (["rollout_placement=separate", "router_bias_update_rate=0.01", "num_experts=4",
      "num_experts_per_tok=2", "moe_mlp_dim=32"],
     "a Hugging Face model has no router selection bias to ship"),
])
def test_bad_input_exits_2_naming_the_culprit(tmp_path, capsys, overrides, expected):
  prompts = write_prompts(tmp_path / "p.jsonl", long_line=11 if "LONG" in overrides else None)
  overrides = [o for o in overrides if o != "LONG"]
  code, _, _ = grpo(tmp_path, "x", f"prompts={prompts}", "reward=grpo_helpers:digits", *overrides)
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert expected in err, err[-2000:]


def test_two_processes_equal_one(learning_run, tmp_path):
  """2 processes x 4 fake devices (loopback, gloo) against the 1 x 8 run above: the same
  completions (rewards equal) and losses within 1e-5 over the first 2 steps (step 2's rollout and
  loss come from the parameters step 1's update left on both processes)."""
  import sys   # pylint: disable=import-outside-toplevel
  from MaxText.launch import local   # pylint: disable=import-outside-toplevel
  _, prompts, rows, _ = learning_run
  command = argv(tmp_path, "mp", f"prompts={prompts}", "reward=grpo_helpers:digits", "steps=2",
                 "enable_checkpointing=false", config=GRPO_YML, model=TINY)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
  result = local.launch([sys.executable, "-m", "MaxText.rl.grpo", *command], 2,
                        devices_per_process=4,
                        log_dir=str(tmp_path / "logs"), cwd=ROOT, env=env, timeout_s=400)
  logs = "".join((tmp_path / "logs" / f"process_{i}.{s}").read_text()
                 for i in (0, 1) for s in ("out", "err"))
  assert result.status == 0, logs[-4000:]
  assert "distributed: 2 processes, 8 devices" in logs
  mp = [r for r in read_metrics(tmp_path / "mp") if "reward_mean" in r]
  assert [r["step"] for r in mp] == [1, 2]
  assert mp[1]["kl"] > 0   # step 2's policy is step 1's update, no longer the reference
  for got, want in zip(mp, rows[:2]):
    assert got["reward_mean"] == want["reward_mean"]
    assert got["reward_std"] == want["reward_std"]
    assert abs(got["loss"] - want["loss"]) <= 1e-5, (got["loss"], want["loss"])


def test_sigterm_saves_exits_42_and_the_rerun_continues_the_same_run(learning_run, tmp_path,
                                                                      monkeypatch):
  _, prompts, rows, _ = learning_run
  args = (f"prompts={prompts}", "reward=grpo_helpers:digits", "steps=5", "checkpoint_period=100")
  monkeypatch.setenv("MAXTEXT_FAULT", "sigterm_at_step:3")
  code, first, _ = grpo(tmp_path, "run", *args)
  assert code == 42
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["3"]
  monkeypatch.delenv("MAXTEXT_FAULT")
  code, resumed, _ = grpo(tmp_path, "run", *args)
  assert code == 0
  got = {r["step"]: r for r in resumed if "reward_mean" in r}
  assert sorted(got) == [1, 2, 3, 4, 5]
  for want in rows[:5]:   # the uninterrupted run's first 5 steps
    assert got[want["step"]]["reward_mean"] == want["reward_mean"]
    assert got[want["step"]]["loss"] == want["loss"]


@pytest.mark.skipif(not os.environ.get("MAXTEXT_SLOW_TESTS"),
                    reason="minutes of CPU: set MAXTEXT_SLOW_TESTS=1 (benchmarks/RESULTS.md has "
                    "the full run's figures)")
@pytest.mark.timeout(2400)   # minutes of CPU: over pytest.ini's per-test limit
def test_the_toy_task_recipe_raises_the_held_out_reward(tmp_path):
  """end_to_end/grpo_addition.py (the README's GRPO toy task, on its shipped prompt files),
  shortened: supervised warm-up on addition answers that carry a remark 60% of the time, then
  GRPO with the exact-answer reward; the held-out prompts' greedy reward rises.

  The margin is the rise chance cannot give: each greedy reward is the mean of 64 held-out
  prompts' 0/1 rewards, whose spread is sqrt(p (1 - p) / 64) at a share p; the difference of two
  such means has the root sum of both squared, and a rise of 4 of those (one-sided probability
  3e-5 under no change) is demanded. The sampled reward (8 samples of each prompt, correlated
  within a prompt: 64 effective draws too) moves less in so few steps and is not asserted on."""
  import json   # pylint: disable=import-outside-toplevel
  import math   # pylint: disable=import-outside-toplevel
  import subprocess   # pylint: disable=import-outside-toplevel
  import sys   # pylint: disable=import-outside-toplevel
  out = subprocess.run([sys.executable, os.path.join(ROOT, "end_to_end", "grpo_addition.py"),
                        "--out", str(tmp_path), "--sft-steps", "200", "--grpo-steps", "50"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
  result = json.loads(out.stdout[out.stdout.index("{"):])
  p0, p1 = result["eval_reward_greedy_before"], result["eval_reward_greedy_after"]
  spread = math.sqrt((p0 * (1 - p0) + p1 * (1 - p1)) / 64)
  print(f"held-out greedy reward {p0:.3f} -> {p1:.3f}; demanded rise 4 x {spread:.3f}")
  assert p1 - p0 > 4 * spread, result


def test_lora_reference_is_the_base_without_a_copy():
  """With LoRA the reference log-probabilities are the base model's: the same parameters with the
  adapters zeroed (step.base_only) give the model without adapters exactly."""
  from conftest import BASE_YML   # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config   # pylint: disable=import-outside-toplevel
  from MaxText.layers import lora   # pylint: disable=import-outside-toplevel
  from MaxText.models.model_config import ModelConfig   # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import init_params, make_model_def   # pylint: disable=import-outside-toplevel
  from MaxText.rl.step import base_only, token_logprobs   # pylint: disable=import-outside-toplevel
  keys = [BASE_YML, *[k for k in TINY if k.split("=")[0] in ("emb_dim", "num_decoder_layers",
                                                             "num_query_heads", "num_kv_heads",
                                                             "head_dim", "mlp_dim", "vocab_size")]]
  with_lora = ModelConfig.from_config(load_config([*keys, "lora_rank=4"]))
  plain = ModelConfig.from_config(load_config(keys))
  params = init_params(with_lora, 0)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.device_put(rng.normal(0, 0.5, x.shape).astype(x.dtype))   # no program
      if lora.is_adapter(tuple(k.key for k in p)) else x, params)
  batch = {"inputs": rng.integers(0, 264, (2, 12)).astype(np.int32),
           "targets": rng.integers(0, 264, (2, 12)).astype(np.int32),
           "positions": np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12)),
           "segments": np.ones((2, 12), np.int32)}
  lora_def, plain_def = make_model_def(with_lora), make_model_def(plain)
  # each model's forward one jitted program (the LoRA one run on both parameter sets)
  lora_logprobs = jax.jit(lambda p: token_logprobs(lora_def, p, batch, 0))
  adapted = lora_logprobs(params)
  ref = lora_logprobs(jax.jit(base_only)(params))
  base = jax.jit(lambda p: token_logprobs(plain_def, p, batch, 0))(lora.split(params)[1])
  np.testing.assert_allclose(np.asarray(ref), np.asarray(base), rtol=0, atol=1e-6)
  assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-3   # the adapters do change it


def test_lora_run_trains_the_adapters_only_over_several_passes(tmp_path):
  """A LoRA run of two passes per rollout batch, resumed from its checkpoint: the adapters train,
  the base stays. Its ratios are GSPO's (importance_sampling=sequence, one clipped ratio per
  completion): on the second (off-policy) pass they move off 1, through the GRPO loop (the token
  ratios' off-policy pass: tests/test_rl_policy.py's micro-batch test, tests/test_rl_losses.py)."""
  prompts = write_prompts(tmp_path / "p.jsonl")
  keys = (f"prompts={prompts}", "reward=grpo_helpers:digits", "lora_rank=4", "num_iterations=2",
          "importance_sampling=sequence", "checkpoint_period=1")
  assert grpo(tmp_path, "lora", *keys, "steps=1")[0] == 0
  # its checkpoint holds the adapters and a reference to the base (resolve/lora_base.py)
  from MaxText.checkpoint.manager import read_meta   # pylint: disable=import-outside-toplevel
  from MaxText.resolve import lora_base   # pylint: disable=import-outside-toplevel
  step1 = tmp_path / "lora" / "checkpoints" / "1"
  assert read_meta(str(step1))[lora_base.META_KEY]["init_seed"] is not None
  code, rows, trainer = grpo(tmp_path, "lora", *keys, "steps=2")   # resumes from step 1
  assert code == 0
  assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
  assert rows[-1]["kl"] > 0          # the reference (the base under the adapters) differs now
  assert rows[-1]["optimizer_steps"] == 4
  # the second pass over a rollout batch is off-policy: its ratios move away from 1
  assert rows[-1]["ratio_max"] > 1.0 or rows[-1]["ratio_min"] < 1.0
  from MaxText.layers import lora   # pylint: disable=import-outside-toplevel
  from MaxText.train.state import init_state   # pylint: disable=import-outside-toplevel
  base_now = lora.split(trainer.final_state["params"])[1]
  start = init_state(trainer.mcfg, trainer.cfg.seed, trainer.tx, trainer.shardings)   # as the run
  base_init = lora.split(start["params"])[1]
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(lora.split(trainer.final_state["params"])[0]),
      jax.tree.leaves(lora.split(start["params"])[0])))   # the adapters did train
  for a, b in zip(jax.tree.leaves(base_now), jax.tree.leaves(base_init)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_example_rewards():
  from MaxText.rl import example_rewards as ex   # pylint: disable=import-outside-toplevel
  row = {"answer": "46"}
  assert ex.exact_answer("12+34=", "46", row) == 1.0
  assert ex.exact_answer("12+34=", " 46\nmore text", row) == 1.0    # the first line, stripped
  assert ex.exact_answer("12+34=", "46 ok", row) == 0.0
  assert ex.exact_answer("12+34=", "4", row) == 0.0
  with pytest.raises(KeyError, match="answer"):
    ex.exact_answer("p", "46", {})
  assert ex.format_check("p", "-12", {}) == 1.0
  assert ex.format_check("p", "12\n\n", {}) == 1.0
  assert ex.format_check("p", "12 ok", {}) == 0.0
  assert ex.format_check("p", "12\nthen more", {}) == 0.0
  assert ex.format_check("p", "<a>yes</a>", {"format": r"<a>\w+</a>"}) == 1.0


def _trainer(tmp_path, *overrides):
  from MaxText.config.load import load_config
  from MaxText.resolve.config_checks import check_config
  prompts = write_prompts(tmp_path / "p.jsonl")
  command = argv(tmp_path, "grpo", f"prompts={prompts}", "reward=grpo_helpers:digits",
                 *overrides, config=GRPO_YML, model=TINY)
  cfg = load_config(command)
  return command, GRPOTrainer(cfg, tokenizer=check_config(cfg, jax.devices()))


def test_memory_preflight_counts_the_decoding_cache_and_the_reference_copy(tmp_path):
  """The engine's cache of a rollout batch (rows x cache length x layers x kv heads x head dim,
  K and V, this device's share) and, with kl_beta > 0 and no LoRA, a second copy of the
  parameters; without the KL term no copy."""
  from MaxText.train import memory
  _, t = _trainer(tmp_path, "num_decoder_layers=2", "num_kv_heads=2", "num_query_heads=2")
  est = t.memory_estimate()
  rows, S = 4 * 4, 16                                  # prompts_per_step x num_generations
  itemsize = t.engine.cache_dtype.itemsize
  assert est.decode_cache == 2 * 2 * rows * S * 2 * 16 * itemsize // 8   # K+V, L, rows/8 devices
  assert est.reference == est.params == memory.per_device_bytes(t.abstract["params"]) > 0
  assert est.needed == est.state + max(est.activations, est.decode_cache) + est.runtime
  _, t0 = _trainer(tmp_path, "kl_beta=0")
  assert t0.memory_estimate().reference == 0


def test_a_decoding_cache_over_the_device_memory_is_refused(tmp_path, capsys, monkeypatch):
  """A config whose rollout cache alone exceeds the device's memory: exit 2 before anything
  compiles, naming the cache and the keys that shrink it."""
  from MaxText.train import memory
  big = ("num_decoder_layers=16", "remat_policy=full", "num_kv_heads=8", "num_query_heads=8", "head_dim=64",
         "max_target_length=64", "prompts_per_step=8", "num_generations=8")
  command, t = _trainer(tmp_path, *big)
  est = t.memory_estimate()
  assert est.decode_cache > est.activations      # the cache, not the step, is what is large
  monkeypatch.setattr(memory, "available_bytes_per_device",
                      lambda devices: (est.decode_cache // 2, "a test device"))
  code, _ = run(command, trainer_class=GRPOTrainer)
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert "the decoding cache between steps" in err and "a smaller decoding cache" in err
  for key in ("prompts_per_step=8", "num_generations=8", "max_target_length=64"):
    assert key in err, err[-2000:]
  assert "Traceback" not in err


def test_lora_head_log_probs_split_over_the_vocabulary():
  """Adapters on the LM head: the vocabulary-split log-probs (MaxText/losses/lora_head.py: x W +
  z B with [x, z] = [h, s hA], a head whose weights all have the vocabulary axis) equal the
  unsplit head's, values and the adapters' gradients, where the split would not apply to the
  LoRA'd head as it is; neither program gathers the head's W whole."""
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from conftest import BASE_YML   # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config   # pylint: disable=import-outside-toplevel
  from MaxText.layers import lora   # pylint: disable=import-outside-toplevel
  from MaxText.models.model_config import ModelConfig   # pylint: disable=import-outside-toplevel
  from MaxText.models.registry import init_params, make_model_def   # pylint: disable=import-outside-toplevel
  from MaxText.losses.lora_head import head_for_log_probs   # pylint: disable=import-outside-toplevel
  from MaxText.rl.step import token_logprobs   # pylint: disable=import-outside-toplevel
  from MaxText.sharding.mesh import create_mesh   # pylint: disable=import-outside-toplevel
  from MaxText.sharding.rules import parse_rules, tree_shardings, use_rules   # pylint: disable=import-outside-toplevel
  from MaxText.losses.vocab_split import vocab_split_plan   # pylint: disable=import-outside-toplevel
  keys = [BASE_YML, *[k for k in TINY if k.split("=")[0] in ("emb_dim", "num_decoder_layers",
                                                             "num_query_heads", "num_kv_heads",
                                                             "head_dim", "mlp_dim", "vocab_size")],
          "lora_rank=4", "lora_targets=lm_head|query", "ici_fsdp_parallelism=8"]
  cfg = load_config(keys)
  mcfg = ModelConfig.from_config(cfg)
  model_def = make_model_def(mcfg)
  params = init_params(mcfg, 0)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(   # adapters away from their zero init
      lambda p, x: jax.device_put(rng.normal(0, 0.3, x.shape).astype(x.dtype))   # no program
      if lora.is_adapter(tuple(k.key for k in p)) else x, params)
  assert "lora_b" in params["lm_head"]
  N, S, chunk = 8, 12, 4   # 96 tokens <= V = 264 = 8 x 33: the vocabulary split's conditions
  batch = {"inputs": rng.integers(0, 264, (N, S)).astype(np.int32),
           "targets": rng.integers(0, 264, (N, S)).astype(np.int32),
           "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (N, S)),
           "segments": np.ones((N, S), np.int32)}
  w = rng.normal(size=(N, S)).astype(np.float32)

  def weighted(adapters, base, chunk_):   # (the weighted sum, the log-probs themselves)
    lp_ = token_logprobs(model_def, lora.join(adapters, base), batch, chunk_)
    return jnp.sum(w * lp_), lp_

  grad = jax.value_and_grad(weighted, has_aux=True)
  adapters, base = lora.split(params)
  (ref_v, ref_lp), ref_g = jax.jit(grad, static_argnums=2)(adapters, base, 0)   # whole, unsplit
  mesh = create_mesh(cfg, jax.devices()[:8])
  rules = parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)
  traced = {}

  def fold(params_, hidden):   # traced only (its shapes): which head the split would use
    with use_rules(mesh, rules):
      traced["plan"] = vocab_split_plan(model_def.head, params_, model_def.logical_axes, hidden,
                                        chunk)
      folded = head_for_log_probs(model_def, params_, hidden, chunk)
    traced["head"] = folded[0]
    return folded[3]
  folded_hidden = jax.eval_shape(fold, params, jax.ShapeDtypeStruct((N, S, cfg.emb_dim),
                                                                    jnp.float32))
  assert traced["plan"] is None
  assert traced["head"] is not model_def.head and folded_hidden.shape == (N, S, cfg.emb_dim + 4)
  shardings = tree_shardings(model_def.logical_axes, model_def.abstract_params, mesh, rules)
  params = jax.device_put(jax.device_get(params), shardings)   # from host: no slicing program

  def split(p):
    with use_rules(mesh, rules):
      return token_logprobs(model_def, p, batch, chunk)

  def split_grad(a, b):
    with use_rules(mesh, rules):
      return grad(a, b, chunk)

  from test_loss import rel   # pylint: disable=import-outside-toplevel
  compiled = jax.jit(split).lower(params).compile()   # one compile: run, and its HLO read
  lp = compiled(params)
  assert rel(lp, ref_lp) < 1e-6, rel(lp, ref_lp)
  hlo = compiled.as_text() or ""   # the head's slices only, never gathered
  gathered = set(re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", hlo))
  assert gathered and not {"f32[32,264]", "f32[36,264]", "f32[4,264]"} & gathered, gathered
  compiled_grad = jax.jit(split_grad).lower(*lora.split(params)).compile()
  (v, _), g = compiled_grad(*lora.split(params))
  # nor is W [32, 264] (or a [W; B] [36, 264]) gathered for its gradient: it leaves the split in
  # W's own layout (B [4, 264] is replicated by the rules, so its gradient is gathered whole)
  hlo = compiled_grad.as_text() or ""
  gathered = set(re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(", hlo))
  assert gathered and not {"f32[32,264]", "f32[36,264]"} & gathered, gathered
  # the weighted sum (weights of both signs) cancels: 1e-6 of the sum of its terms' sizes, and
  # the gradients, sums of the same terms' derivatives, 1e-6 times that cancellation factor
  size = float(np.sum(np.abs(w.astype(np.float64) * np.asarray(ref_lp, np.float64))))
  assert abs(float(v) - float(ref_v)) < 1e-6 * size   # on host: no eager programs
  tol = 1e-6 * max(1.0, size / abs(float(ref_v)))
  for (path, a), b in zip(jax.tree.leaves_with_path(ref_g), jax.tree.leaves(g)):
    assert rel(b, a) < tol, (jax.tree_util.keystr(path), rel(b, a), tol)


class GRPOTimeline(GRPOTrainer):
  """Records the order of the updates' dispatches, the rows' reads and the checkpoint saves."""

  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.events = record_saves(self)

  def dispatch(self, state, batch):
    self.events.append(f"dispatch {batch[1]['step']}")
    return super().dispatch(state, batch)

  def loop_parts(self, *a):
    parts = super().loop_parts(*a)
    read = parts.rows.row

    def row(metrics):
      self.events.append(f"read {metrics[2]['step']}")
      return read(metrics)
    parts.rows.row = row
    return parts


def test_metrics_are_read_one_step_late_as_in_pretraining(learning_run, tmp_path, capsys):
  """GRPO runs in the one loop (train/step_loop.py): step N's row is read after step N+1's
  rollout and updates were dispatched, and before a save; the rows are those of the run that
  read each step at once (the learning run's first steps, bit for bit)."""
  _, prompts, rows, _ = learning_run
  code, trainer = run(argv(tmp_path, "late", f"prompts={prompts}", "reward=grpo_helpers:digits",
                           "steps=5", "checkpoint_period=2", config=GRPO_YML, model=TINY),
                      trainer_class=GRPOTimeline)
  assert code == 0
  assert trainer.events == [
      "dispatch 1", "dispatch 2", "read 1", "read 2", "save 2",
      "dispatch 3", "dispatch 4", "read 3", "read 4", "save 4",
      "dispatch 5", "read 5", "save 5"]
  late = [r for r in read_metrics(tmp_path / "late") if "reward_mean" in r]
  assert [r["step"] for r in late] == [1, 2, 3, 4, 5]
  for got, want in zip(late, rows[:5]):
    assert (got["loss"], got["reward_mean"], got["kl"]) == \
        (want["loss"], want["reward_mean"], want["kl"])
  assert "step 1/5 | reward" in capsys.readouterr().out


def test_a_failed_evaluation_after_the_last_step_keeps_its_checkpoint(tmp_path, capsys,
                                                                      monkeypatch):
  prompts = write_prompts(tmp_path / "p.jsonl")
  real, calls = GRPOTrainer.evaluate, []

  def evaluate(self, params):   # the one before the first step works, the one after the last not
    calls.append(1)
    if len(calls) > 1:
      raise RuntimeError("forced evaluation failure")
    return real(self, params)
  monkeypatch.setattr(GRPOTrainer, "evaluate", evaluate)
  code, _, _ = grpo(tmp_path, "evalfail", f"prompts={prompts}", f"eval_prompts={prompts}",
                    "reward=grpo_helpers:digits", "steps=2")
  err = capsys.readouterr().err
  assert code == 0, err[-2000:]
  assert len(calls) == 2 and os.path.isdir(tmp_path / "evalfail" / "checkpoints" / "2")
  assert ("warning: the evaluation after step 2 failed and was skipped (RuntimeError: forced "
          "evaluation failure)") in err


def test_dapo_dynamic_sampling_and_overlong_shaping_are_logged(tmp_path):
  prompts = write_prompts(tmp_path / "p.jsonl")
  code, rows, _ = grpo(tmp_path, "dapo", f"prompts={prompts}", "reward=grpo_helpers:digits",
                       "dynamic_sampling=true", "overlong_buffer=3", "steps=2",
                       "enable_checkpointing=false")
  assert code == 0
  steps = [r for r in rows if "reward_mean" in r]
  assert len(steps) == 2
  for r in steps:
    assert 0 <= r["groups_dropped"] <= 4 and r["groups_dropped"] == int(r["groups_dropped"])
    assert -1.0 <= r["overlong_penalty_mean"] <= 0.0
  assert any(r["overlong_penalty_mean"] < 0 for r in steps)   # 6 new tokens, buffer 3: some pay


def test_dapo_resampling_replaces_the_groups_of_equal_rewards(tmp_path):
  """dynamic_sampling_rounds: the groups of equal rewards are generated again from other prompts
  (counted), and fewer groups are dropped than without resampling on the same rollout."""
  prompts = write_prompts(tmp_path / "p.jsonl")
  args = (f"prompts={prompts}", "reward=grpo_helpers:even_ids_only", "dynamic_sampling=true",
          "steps=1", "enable_checkpointing=false")
  code, rows, _ = grpo(tmp_path, "drop", *args)
  assert code == 0
  dropped = [r for r in rows if "reward_mean" in r][0]["groups_dropped"]
  code, rows, _ = grpo(tmp_path, "resample", *args, "dynamic_sampling_rounds=3")
  assert code == 0
  r = [r for r in rows if "reward_mean" in r][0]
  assert r["groups_resampled"] >= dropped > 0, (dropped, r)   # the odd ids' groups
  assert r["groups_dropped"] < dropped
  assert r["groups_resampled"] == int(r["groups_resampled"])


def test_rollout_groups_are_replaced_in_place():
  import numpy as np_   # pylint: disable=import-outside-toplevel,reimported
  from MaxText.rl import rollout as rl   # pylint: disable=import-outside-toplevel
  mk = lambda base, n: rl.Rollout({"input_ids": base + np_.arange(n * 3).reshape(n, 3)},
                                  base + np_.zeros((n, 3)), base + np_.zeros((n, 2)),
                                  base + np_.arange(n, dtype=float), base + np_.ones(n),
                                  base + np_.zeros(n))
  old, new = mk(0, 6), mk(100, 2)   # 3 groups of 2; group 1 replaced by new's only group
  got = rl.replace_groups(old, [1], new, 2)
  assert got.rewards.tolist() == [0, 1, 100, 101, 4, 5]
  assert got.arrays["input_ids"][2:4].tolist() == new.arrays["input_ids"].tolist()
  assert got.rewards_NF.shape == (6, 2) and got.rewards_NF[2:4].min() == 100
  assert old.rewards.tolist() == [0, 1, 2, 3, 4, 5]   # the input unchanged


def test_memory_preflight_counts_one_micro_batch_of_activations(tmp_path):
  """With microbatch_size the update's activations are one micro-batch's: fewer than the whole
  rollout batch's."""
  _, whole = _trainer(tmp_path)
  _, micro = _trainer(tmp_path, "microbatch_size=4")
  assert micro.micro_batches() == 4 and whole.micro_batches() == 1
  assert micro.memory_estimate().activations < whole.memory_estimate().activations
