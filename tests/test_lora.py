"""LoRA (MaxText/layers/lora.py) on chat SFT: zero-initialised adapters leave every family's
forward exactly as it was; only the adapters train (the base bitwise unchanged after 10 steps, the
optimizer state exactly two moments of the adapters, in bytes); the assistant loss falls; a
prompt token's target is not in the objective; 8 fake devices with gradient accumulation equal 1;
resume is bitwise; checkpoints hold the adapters and a reference to the base (a changed base: exit
4); the pre-flight estimate accepts a qwen3-8b LoRA on 80 GB where full fine-tuning is refused."""
import os

import jax
import numpy as np
import pytest
from flax import traverse_util

import sft_helpers as h
from conftest import BASE_YML, MESH_1, MESH_222
from MaxText.checkpoint.manager import load_params, read_meta, save_params_only
from MaxText.config.load import load_config
from MaxText.data.config import DataConfig
from MaxText.data.pipeline import make_shard_iterator
from MaxText.layers import lora
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params, make_model_def
from MaxText.resolve import lora_base
from MaxText.train import memory
from MaxText.train.loop import Trainer, run

MODEL = ["model_name=qwen3-tiny", "max_target_length=128", "learning_rate=1e-2",
         "warmup_steps=2", "lora_rank=4", "lora_alpha=8"]


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _flat(tree):
  return {"/".join(map(str, k)): v for k, v in traverse_util.flatten_dict(tree).items()}


# Gemma 4 at one layer of each kind (sliding, full, a full layer on the second one's K/V with the
# double-wide MLP), not the tiny file's 10 layers (two blocks of 5, each layer compiled): the
# adapters of every kind, at a third of the file's costliest programs
SHAPE = {"gemma4-tiny": ("num_decoder_layers=3", "attention_pattern=sff", "num_kv_shared_layers=1")}


@pytest.mark.parametrize("model,scan", [("qwen3-tiny", "true"), ("qwen3-moe-tiny", "true"),
                                        ("gemma4-tiny", "true")])
def test_zero_adapters_leave_the_forward_exactly_as_the_base(model, scan):
  shape = SHAPE.get(model, ())
  cfg = load_config([BASE_YML, f"model_name={model}", *shape, "lora_rank=4",
                     f"scan_layers={scan}"])
  with_lora = ModelConfig.from_config(cfg)
  base_cfg = ModelConfig.from_config(load_config([BASE_YML, f"model_name={model}", *shape,
                                                  f"scan_layers={scan}"]))
  params = jax.device_get(init_params(with_lora, 0))   # host arrays: every forward's inputs alike
  adapters, base = lora.split(params)
  assert adapters and all(k.endswith(("lora_a", "lora_b")) for k in _flat(adapters))
  assert all(not np.any(v) for k, v in _flat(adapters).items() if k.endswith("lora_b"))
  assert any(np.any(v) for k, v in _flat(adapters).items() if k.endswith("lora_a"))
  # 24 positions: longer than gemma4-tiny's sliding window (16), so its sliding layers mask
  S = 24
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, S), dtype=np.int32)
  pos = np.broadcast_to(np.arange(S), (2, S))
  seg = np.ones((2, S), np.int32)
  # jitted, as training and decoding run them (eagerly, every op compiles on its own)
  forward = jax.jit(make_model_def(with_lora).apply)
  got = forward(params, tokens, pos, seg)
  want = jax.jit(make_model_def(base_cfg).apply)(base, tokens, pos, seg)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # a non-zero B changes it (the adapters are in the computation)
  bumped = lora.join(jax.tree.map(lambda a: a + np.float32(0.01), adapters), base)
  assert not np.allclose(forward(bumped, tokens, pos, seg), want)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  d = tmp_path_factory.mktemp("lora")
  h.save_chat_tokenizer(d / "tok", h.QWEN3_TAGGED)
  data = h.write_jsonl(d / "chats.jsonl", h.conversations(64))
  cfg = load_config(h.sft_argv(d, "base", *MODEL, "lora_rank=0"))
  base = init_params(ModelConfig.from_config(cfg), 7)
  save_params_only(str(d / "base_ckpt"), base, cfg.as_dict())
  common = [*MODEL, f"dataset_path={data}", f"tokenizer_path={d}/tok/tokenizer.json",
            f"load_parameters_path={d}/base_ckpt/0", "checkpoint_period=9", "steps=10"]
  return d, common, _host(base)


@pytest.fixture(scope="module")
def one_device_run(setup):
  d, common, base = setup
  code, trainer = run(h.sft_argv(d, "one", *common, *MESH_1), devices=jax.devices()[:1])
  assert code == 0
  return trainer, h.conversations  # noqa


def _metrics(d, name):
  from conftest import read_metrics
  return read_metrics(os.path.join(str(d), name))


def test_only_the_adapters_train(setup, one_device_run):
  d, _, base = setup
  trainer, _ = one_device_run
  state = _host(trainer.final_state)
  adapters, frozen = lora.split(state["params"])
  for k, v in _flat(base).items():   # bitwise unchanged after 10 steps
    np.testing.assert_array_equal(_flat(frozen)[k], v, err_msg=k)
  assert set(_flat(frozen)) == set(_flat(base))
  assert all(np.any(v) for k, v in _flat(adapters).items() if k.endswith("lora_b"))
  # optimizer state: AdamW's two moments of the adapters (+ the step counts), nothing else
  nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
  counts = sum(x.nbytes for x in jax.tree.leaves(state["opt_state"]) if x.ndim == 0)
  assert nbytes(state["opt_state"]) == 2 * nbytes(adapters) + counts
  assert counts <= 16 and nbytes(adapters) < nbytes(base) / 10
  losses = [m["loss"] for m in _metrics(d, "one")]
  assert np.mean(losses[-3:]) < np.mean(losses[:2]) - 1.0, losses
  # the run's checkpoint loads for decoding: the LoRA keys come with it (carried)
  from MaxText import inference
  model = inference.load([BASE_YML, f"load_parameters_path={d}/one/checkpoints", *MESH_1],
                         devices=jax.devices()[:1])
  assert (model.cfg.lora_rank, model.cfg.lora_alpha) == (4, 8.0)
  [scores] = model.score([[1, 2, 3]], [[4, 5]])
  assert len(scores) == 2 and np.all(np.isfinite(scores))


def test_eight_devices_with_accumulation_equal_one_and_resume_is_bitwise(setup, one_device_run):
  d, common, _ = setup
  trainer, _ = one_device_run
  code, eight = run(h.sft_argv(d, "eight", *common, *MESH_222, "per_device_batch_size=0.5",
                               "gradient_accumulation_steps=2", "enable_checkpointing=false"))
  assert code == 0
  a = lora.split(eight.final_state["params"])[0]
  q = _flat(a)["decoder/runs/0/0/attn/query/lora_b"]
  assert q.sharding.shard_shape(q.shape) != q.shape     # adapters sharded like their weight
  np.testing.assert_allclose([m["loss"] for m in _metrics(d, "eight")],
                             [m["loss"] for m in _metrics(d, "one")], rtol=0, atol=2e-5)
  for (k, x), y in zip(_flat(_host(a)).items(), _flat(_host(lora.split(
      trainer.final_state["params"])[0])).values()):
    np.testing.assert_allclose(x, y, rtol=0, atol=2e-5, err_msg=k)
  # resume: the run's step-9 checkpoint restored and trained to 10 gives the same bits (one step
  # after the resume point is what resuming can get wrong: the restored state, data position, step)
  import shutil
  shutil.copytree(os.path.join(d, "one"), os.path.join(d, "resumed"))
  shutil.rmtree(os.path.join(d, "resumed", "checkpoints", "10"))
  code, resumed = run(h.sft_argv(d, "resumed", *common, *MESH_1), devices=jax.devices()[:1])
  assert code == 0
  for x, y in zip(jax.tree.leaves(_host(resumed.final_state)),
                  jax.tree.leaves(_host(trainer.final_state))):
    np.testing.assert_array_equal(x, y)


def test_prompt_targets_are_not_in_the_objective(one_device_run):
  # the one-device run's trainer: its data, its initial state (the base + fresh adapters) and the
  # train step it compiled and ran (`compiled`: not traced and lowered again)
  trainer, _ = one_device_run
  cfg = trainer.cfg
  it = make_shard_iterator(DataConfig.from_config(cfg), [0], 1, trainer.global_batch)
  batch = next(it)
  it.close()
  prompt = (batch["targets_segmentation"] == 0) & (batch["inputs_segmentation"] != 0)
  assert prompt.sum() > 100 and (~prompt & (batch["inputs_segmentation"] != 0)).sum() > 50
  changed = dict(batch, targets=np.where(prompt, (batch["targets"] + 7) % 300, batch["targets"]))
  step = trainer.compiled
  out = []
  for b in (batch, changed):
    state, _ = trainer.checkpointed.initial_state(None, None)
    new, metrics = step(state, trainer.device_batch(b))
    out.append((_host(new["params"]), float(metrics["loss"])))
  assert out[0][1] == out[1][1]
  for x, y in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):
    np.testing.assert_array_equal(x, y)
  # an assistant token's target does change it
  answer = np.argwhere(batch["targets_segmentation"] != 0)[0]
  other = dict(batch, targets=batch["targets"].copy())
  other["targets"][tuple(answer)] = (other["targets"][tuple(answer)] + 7) % 300
  state, _ = trainer.checkpointed.initial_state(None, None)
  assert float(step(state, trainer.device_batch(other))[1]["loss"]) != out[0][1]


class _GPU80:
  """A device as memory_stats reports an 80 GB GPU."""
  device_kind, process_index, platform = "NVIDIA H100 80GB HBM3", 0, "gpu"

  def memory_stats(self):
    return {"bytes_limit": 80 * 10**9}


def test_preflight_accepts_qwen3_8b_lora_where_full_fine_tuning_is_refused(tmp_path):
  est = {}
  for name, extra in (("full", []), ("lora", ["lora_rank=16"])):
    cfg = load_config([BASE_YML, "model_name=qwen3-8b", "ici_fsdp_parallelism=1",
                       f"base_output_directory={tmp_path}", *extra])
    t = Trainer(cfg, jax.devices()[:1])
    est[name] = memory.estimate(t.abstract, [_GPU80()], t.activation_bytes(), trained=
                                lora.split(t.abstract["params"])[0] if extra else None)
  full, lo = est["full"], est["lora"]
  assert memory.check_fits(full) is not None and memory.check_fits(lo) is None
  assert lo.params > full.params > 30 * 10**9           # the fp32 base, plus the adapters
  assert lo.grads == lo.params - full.params            # gradients: the adapters only
  assert lo.optimizer < 2 * lo.grads + 64               # two moments of the adapters


def test_bad_lora_targets_exit_2(tmp_path, capsys):
  code, _ = run([BASE_YML, *MESH_1, "lora_rank=4", "lora_targets=nothing_matches",
                 f"base_output_directory={tmp_path}"], devices=jax.devices()[:1])
  assert code == 2 and "lora_targets='nothing_matches'" in capsys.readouterr().err


def _du(path) -> int:
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
             for f in files)


def test_checkpoints_hold_the_adapters_and_a_reference_to_the_base(setup, one_device_run):
  d, _, base = setup
  step = os.path.join(str(d), "one", "checkpoints", "10")
  saved = _flat(load_params(step))            # host arrays, whatever the checkpoint holds
  assert saved and all(k.endswith(("lora_a", "lora_b")) for k in saved), sorted(saved)[:4]
  ref = read_meta(step)["lora_base"]
  assert ref["path"] == os.path.join(str(d), "base_ckpt", "0") and ref["init_seed"] is None
  assert ref["fingerprint"] == lora_base.fingerprint(base)
  # the params item is a small fraction of the base's
  assert _du(os.path.join(step, "params")) * 5 < _du(os.path.join(str(d), "base_ckpt", "0",
                                                                "params"))


def test_a_changed_base_is_refused_with_exit_4(setup, one_device_run, capsys):
  """The base checkpoint replaced by another model: resume, decoding and export each refuse the
  LoRA checkpoint with a CheckpointError / exit 4 naming the base; with the base back, it loads."""
  import shutil
  from MaxText import inference
  from MaxText.checkpoint.errors import CheckpointError
  from MaxText.checkpoint_conversion import to_huggingface
  d, common, _ = setup
  base_dir = os.path.join(str(d), "base_ckpt")
  os.rename(base_dir, base_dir + ".orig")
  try:
    cfg = load_config(h.sft_argv(d, "base", *MODEL, "lora_rank=0"))
    save_params_only(base_dir, init_params(ModelConfig.from_config(cfg), 8), cfg.as_dict())
    ckpt = os.path.join(str(d), "one", "checkpoints")
    with pytest.raises(CheckpointError, match="base model that has changed"):
      inference.load([BASE_YML, f"load_parameters_path={ckpt}", *MESH_1],
                     devices=jax.devices()[:1])
    assert to_huggingface.main([f"load_parameters_path={ckpt}",
                                f"output_path={d}/changed_export"]) == 4
    assert "base_ckpt/0" in capsys.readouterr().err
    shutil.copytree(os.path.join(str(d), "one"), os.path.join(str(d), "changed"))
    shutil.rmtree(os.path.join(str(d), "changed", "checkpoints", "10"))
    code, _ = run(h.sft_argv(d, "changed", *common, *MESH_1), devices=jax.devices()[:1])
    assert code == 4
  finally:
    shutil.rmtree(base_dir, ignore_errors=True)
    os.rename(base_dir + ".orig", base_dir)
  assert to_huggingface.main([f"load_parameters_path={ckpt}",
                              f"output_path={d}/restored_export"]) == 0


def test_lora_from_the_random_init_references_its_seed(setup, tmp_path):
  """No load_parameters_path: the base is the random init, referenced by its seed; the checkpoint
  exports (the base made again and checked against its fingerprint). The run's keys but the base
  are the other runs' here: its train step is theirs (compiled once)."""
  from MaxText.checkpoint_conversion import to_huggingface
  _, common, _ = setup
  fresh = [k for k in common if not k.startswith("load_parameters_path=")]
  assert len(fresh) == len(common) - 1
  # only the last step's checkpoint (the one read here): checkpoint_period is no part of the step
  code, _ = run(h.sft_argv(tmp_path, "fresh", *fresh, "checkpoint_period=10", *MESH_1),
                devices=jax.devices()[:1])
  assert code == 0
  step = os.path.join(str(tmp_path), "fresh", "checkpoints", "10")
  ref = read_meta(step)["lora_base"]
  assert ref["path"] == "" and ref["init_seed"] == 0
  assert all(k.endswith(("lora_a", "lora_b")) for k in _flat(load_params(step)))
  assert to_huggingface.main([f"load_parameters_path={step}", f"output_path={tmp_path}/out"]) == 0
