"""The memory plan on an accelerator (train/memory.py, train/memory_plan.py): the pre-flight's
estimate against XLA's counts measured on a TPU v5e (the table the activation model was fitted to),
the error margin before refusing, a step XLA refuses to compile (exit 2, one line), a compiled
step never refused there, `remat_policy=auto` and the fastest configuration a refusal names.
Pure arithmetic on abstract states (no compile): the chip's figures are data here."""
import dataclasses
from types import SimpleNamespace

import jax
import pytest

from conftest import BASE_YML, MESH_1, argv
from MaxText.config.load import load_config
from MaxText.train import memory, memory_plan
from MaxText.train.loop import Trainer, run

GiB = 2**30
TPU_LIMIT = 15.75 * GiB   # one v5e's bytes_limit

# (remat_policy, per_device_batch_size, loss_chunk_length, XLA's compiled_step_bytes in GiB or, for
# a compile XLA refused, None): Qwen3-0.6B, seq 2048, bf16 compute, fp32 weights + Adam, splash
# attention (blocks 1024), one TPU v5e; "fused" rows (the fused splash backward) estimate as the rest
TPU_V5E = [("full", 8, 128, 13.77), ("full", 8, 128, 14.02),   # the second: fused backward
           ("full", 8, 512, 14.30), ("full", 16, 128, 17.39),
           ("save_attention", 6, 128, 15.58), ("save_qkv_proj", 4, 128, 15.12),
           ("save_qkv_attention", 4, 128, 15.96), ("save_dot_except_mlp", 4, 128, 16.33),
           ("save_dot_except_mlp_in", 4, 128, 16.33), ("save_attention", 4, 128, 13.37),  # fused
           ("save_matmuls", 8, 128, None), ("save_matmuls", 4, 128, None), ("none", 2, 128, None)]


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory):
  """Qwen3-0.6B's abstract state on one CPU device, its model counted with the chip's attention."""
  cfg = load_config([BASE_YML, "model_name=qwen3-0.6b", "max_target_length=2048", "dtype=bfloat16",
                     "per_device_batch_size=8", "loss_chunk_length=128", *MESH_1,
                     f"base_output_directory={tmp_path_factory.mktemp('q')}"])
  t = Trainer(cfg, jax.devices()[:1])
  t.mcfg = dataclasses.replace(t.mcfg, attention="flash")   # splash on the chip
  return t


def on_tpu(t, **planning) -> memory.MemoryEstimate:
  """`t`'s estimate of a variant as the chip's pre-flight makes it (its limit and allowance)."""
  return dataclasses.replace(t.estimate_with(**planning), available=int(TPU_LIMIT),
                             runtime=memory.RUNTIME_ALLOWANCE_ACCELERATOR, platform="tpu")


def test_state_is_the_measured_runs(qwen3_06b):
  est = on_tpu(qwen3_06b)
  assert est.state / GiB == pytest.approx(8.88, abs=0.005)


@pytest.mark.parametrize("policy,batch,chunk,xla", TPU_V5E)
def test_estimate_within_the_margin_of_xla_on_tpu(qwen3_06b, policy, batch, chunk, xla):
  est = on_tpu(qwen3_06b, remat_policy=policy, batch=batch, loss_chunk=chunk)
  if xla is None:   # XLA refused to compile it: the estimate does not fit either
    assert not est.fits, est.needed / GiB
  else:
    assert abs(est.needed / GiB - xla) <= memory.ERROR_MARGIN * xla, (est.needed / GiB, xla)


# bf16 weights and Adam moments (state 4.44 GiB), save_attention, the fused splash backward:
# (per_device_batch_size, XLA's compiled_step_bytes + the runtime allowance in GiB) from libtpu's
# deviceless v5e compile (equal to the chip's count), 292de0a: `bash benchmarks/tpu_aot.sh --base
# "model_name=qwen3-0.6b max_target_length=2048 dataset_type=synthetic flash_block_q=1024
# flash_block_kv=1024 weight_dtype=bfloat16 flash_fused_bwd=true" --variant "b8:
# remat_policy=save_attention per_device_batch_size=8"`; the estimate counts XLA's copy of the
# attention kernels (no cast lays them out): 9.97 / 10.82 and 7.36 / 8.35 before
TPU_V5E_BF16 = [(8, 10.82), (4, 8.35)]


@pytest.mark.parametrize("batch,xla", TPU_V5E_BF16)
def test_bf16_weights_within_the_margin_of_xla(tmp_path, batch, xla):
  cfg = load_config([BASE_YML, "model_name=qwen3-0.6b", "max_target_length=2048", "dtype=bfloat16",
                     "weight_dtype=bfloat16", "loss_chunk_length=128", "attention=flash",
                     "remat_policy=save_attention", f"per_device_batch_size={batch}", *MESH_1,
                     f"base_output_directory={tmp_path}"])
  est = on_tpu(Trainer(cfg, jax.devices()[:1]))
  assert est.state / GiB == pytest.approx(4.44, abs=0.005)
  assert abs(est.needed / GiB - xla) <= memory.ERROR_MARGIN * xla, (est.needed / GiB, xla)


def test_accelerator_refuses_only_beyond_the_margin():
  est = memory.MemoryEstimate(params=0, grads=0, optimizer=0, available=10 * GiB, source="t",
                              activations=int(10.5 * GiB), runtime=0, platform="tpu")
  assert not est.fits and memory.check_fits(est) is None       # XLA decides
  over = dataclasses.replace(est, activations=int(11.5 * GiB))
  assert "more than the estimate's 10% margin" in memory.check_fits(over)
  assert memory.check_fits(dataclasses.replace(est, platform="cpu")) is not None


def test_a_compiled_step_is_not_refused_on_an_accelerator():
  analysis = SimpleNamespace(argument_size_in_bytes=9 * GiB, temp_size_in_bytes=8 * GiB,
                             output_size_in_bytes=9 * GiB, alias_size_in_bytes=9 * GiB)
  compiled = SimpleNamespace(memory_analysis=lambda: analysis)
  device = lambda platform: SimpleNamespace(
      platform=platform, device_kind="fake", process_index=0,
      memory_stats=lambda: {"bytes_limit": int(TPU_LIMIT)})
  line, problem = memory.check_compiled(compiled, [device("tpu")])
  assert problem is None and "17.00 GiB" in line and "tight" in line
  assert memory.check_compiled(compiled, [device("cpu")])[1] is not None


def test_refusal_names_the_fastest_configuration_that_fits(qwen3_06b):
  def fastest(batch, chunk=128, after=None):
    return memory_plan.fastest_fit(
        lambda **kw: on_tpu(qwen3_06b, remat_policy=kw["remat_policy"],
                            batch=kw.get("batch") or batch, loss_chunk=kw.get("loss_chunk") or chunk),
        dataclasses.replace(qwen3_06b.cfg, per_device_batch_size=batch, loss_chunk_length=chunk),
        after=after)
  # at batch 4 the named saves that ran on the chip fit (save_dot_except_mlp_in: XLA 16.33 GiB, and
  # it ran); save_matmuls, faster, did not compile (16.39 GiB)
  assert fastest(4).startswith("remat_policy=save_dot_except_mlp_in (")
  # after a policy XLA refused: the next lighter one that fits
  assert fastest(4, after="save_dot_except_mlp_in").startswith("remat_policy=save_dot_except_mlp (")
  assert fastest(6).startswith("remat_policy=save_attention (")    # ran: XLA 15.58 GiB
  assert fastest(16).startswith("remat_policy=save_attention per_device_batch_size=8 (")
  # the whole sequence's logits (4.6 GiB at batch 4) do not fit with any policy: chunks then do
  assert fastest(4, chunk=0).startswith("remat_policy=save_dot_except_mlp_in loss_chunk_length=128 (")


@pytest.mark.parametrize("budget", ["huge", "between", "none fits"])
def test_auto_picks_the_fastest_policy_that_fits(tmp_path, monkeypatch, budget):
  args = argv(tmp_path, "auto", "remat_policy=auto", "dtype=bfloat16", *MESH_1)
  plain = Trainer(load_config(args, keep_auto=True), jax.devices()[:1])   # resolved against the host's memory
  needed = {p: plain.estimate_with(own=False, remat_policy=p).needed
            for p in memory_plan.SPEED_ORDER}
  assert needed["none"] > needed["save_matmuls"] > needed["save_attention"] > needed["full"]
  available = {"huge": 2**50, "between": (needed["save_attention"] + needed["save_qkv_attention"])
               // 2, "none fits": needed["full"] - 1}[budget]
  monkeypatch.setattr(memory, "available_bytes_per_device", lambda d: (available, "test"))
  t = Trainer(load_config(args, keep_auto=True), jax.devices()[:1])
  chosen = t.cfg.remat_policy
  assert t.mcfg.remat_policy == chosen and "remat_policy" in t.training.auto
  assert "remat_policy=auto: " + chosen in t.training.remat_note
  if budget == "none fits":
    assert chosen == "full" and "the least memory" in t.training.remat_note
  else:   # it fits, and every faster policy does not
    faster = memory_plan.SPEED_ORDER[:memory_plan.SPEED_ORDER.index(chosen)]
    assert needed[chosen] <= available and all(needed[p] > available for p in faster)
    assert chosen == ("none" if budget == "huge" else "save_attention")


def test_xla_refusing_the_compile_is_a_config_error(tmp_path, monkeypatch, capsys):
  def refuse(self):
    raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
                       "memory space hbm. Used 21.20G of 15.75G hbm. Exceeded hbm capacity by "
                       "5.45G.\n\nTotal hbm usage >= 21.45G:\n    reserved 263.00M\n")
  monkeypatch.setattr(Trainer, "compile_step", refuse)
  code, _ = run(argv(tmp_path, "oom", "dataset_type=synthetic", *MESH_1),
                devices=jax.devices()[:1])
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if "does not fit" in line]
  assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
  assert "Used 21.20G of 15.75G hbm" in lines[0] and "the pre-flight estimated" in lines[0]
  assert "remat_policy=" in lines[0]   # the lighter configuration that fits


def test_auto_compiles_the_next_lighter_policy_when_xla_refuses_its_choice(tmp_path, monkeypatch,
                                                                            capsys):
  """remat_policy=auto whose choice XLA refuses (the estimate under XLA's count, as moe64's
  save_matmuls: 15.46 estimated, XLA 16.49 of 15.75): the next lighter policy is compiled and the
  run trains; a policy the user named is refused (exit 2, the test above)."""
  tried = []
  real = Trainer.compile_step

  def refuse_the_first(self):
    tried.append(self.cfg.remat_policy)
    assert self.mcfg.remat_policy == self.cfg.remat_policy   # the model rebuilt with it
    if len(tried) == 1:
      raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
                         "in memory space hbm. Used 16.49G of 15.75G hbm.")
    return real(self)
  monkeypatch.setattr(Trainer, "compile_step", refuse_the_first)
  monkeypatch.setattr(memory, "available_bytes_per_device", lambda d: (2**50, "test"))
  code, trainer = run(argv(tmp_path, "auto-oom", "remat_policy=auto", "dataset_type=synthetic",
                           "steps=1", *MESH_1), devices=jax.devices()[:1])
  captured = capsys.readouterr()
  printed = captured.out + captured.err
  lighter = memory_plan.policies_of(trainer.cfg.decoder_block)
  assert code == 0, printed[-2000:]
  assert tried == [lighter[0], lighter[1]] and trainer.cfg.remat_policy == lighter[1]
  assert f"XLA refused {lighter[0]} (Used 16.49G of 15.75G hbm)" in printed, printed[-2000:]
  assert f"remat_policy=auto: {lighter[1]}, the next lighter" in trainer.training.remat_note
