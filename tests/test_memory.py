"""The pre-flight memory estimate: exact per-device bytes, and a model that cannot fit is refused
with the numbers before anything is allocated or compiled."""
import dataclasses
import math
import re
import subprocess
import sys

import jax

from conftest import BASE_YML, MESH_1, ROOT, argv
from MaxText.config.load import load_config
from MaxText.train import memory
from MaxText.train.loop import Trainer


def test_estimate_counts_sharded_bytes_exactly(tmp_path):
  one = Trainer(load_config(argv(tmp_path, "m1", *MESH_1)), jax.devices()[:1])
  eight = Trainer(load_config(argv(tmp_path, "m8", "ici_fsdp_parallelism=8")))
  e1, e8 = memory.estimate(one.abstract, one.devices), memory.estimate(eight.abstract, eight.devices)
  n_params = sum(x.size for x in jax.tree.leaves(one.abstract["params"]))
  assert e1.params == 4 * n_params                       # fp32, unsharded
  assert e1.optimizer == 2 * e1.params + 8               # AdamW mu + nu, + 2 int32 step counts
  assert e8.params < e1.params / 4                       # most bytes split 8 ways over fsdp
  assert memory.check_fits(e1) is None


def test_a_model_too_big_for_the_host_is_refused_with_numbers():
  big = ["emb_dim=16384", "num_decoder_layers=96", "mlp_dim=65536", "num_query_heads=128",
         "num_kv_heads=8", "head_dim=128", "vocab_size=131072", "ici_fsdp_parallelism=1",
         "per_device_batch_size=1"]
  p = subprocess.run([sys.executable, "train.py", BASE_YML, *big], cwd=ROOT, capture_output=True,
                     text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert p.returncode == 2, p.stderr[-2000:]
  assert "does not fit" in p.stderr and "GiB needed per device" in p.stderr
  assert "ici_fsdp_parallelism" in p.stderr and "weight_dtype=bfloat16" in p.stderr
  assert "compiled" not in p.stdout   # the trainer's line after compiling the step


def test_refusal_suggests_what_would_fit(monkeypatch, capsys):
  """Gemma 4 E2B with bfloat16 weights on devices of 2 GiB: bfloat16 is not suggested again; the
  device count the whole state needs and the family's configs that fit are named (and do fit)."""
  from MaxText.train.loop import run
  monkeypatch.setattr(memory, "available_bytes_per_device", lambda devices: (2 * 2**30, "test"))
  args = [BASE_YML, "model_name=gemma4", "weight_dtype=bfloat16", "per_device_batch_size=1",
          "max_target_length=256"]
  code, _ = run(args)
  err = capsys.readouterr().err
  assert code == 2 and "the model does not fit" in err
  assert "weight_dtype=bfloat16" not in err.split("What would fit:")[1]
  m = re.search(r"the state \(([\d.]+) GiB in all\) split over at least (\d+) devices with "
                r"2.00 GiB each \(([\d.]+) GiB of it left after activations and runtime\)", err)
  # the printed figures are rounded to 0.01 GiB
  lo, hi = (float(m.group(1)) - 0.005) / (float(m.group(3)) + 0.005), \
      (float(m.group(1)) + 0.005) / (float(m.group(3)) - 0.005)
  assert m and math.ceil(lo) <= int(m.group(2)) <= math.ceil(hi), err
  named = re.findall(r"model_name=([\w-]+) \(([\d.]+) (MiB|GiB) per device\)", err)
  assert {n for n, _, _ in named} == {"gemma4-tiny", "gemma4-moe-tiny", "gemma4-mm-tiny"}, err
  assert all(float(size) <= (2 if unit == "GiB" else 2048) for _, size, unit in named)
  # fp32 weights: bfloat16 is suggested with the devices it would need (halving alone is too little).
  # The family's presets were sized above (each preset's abstract model traced, most of this test's
  # time): this refusal's own advice is the point here, so they are not sized again
  from MaxText.train import loop
  monkeypatch.setattr(loop, "family_models_that_fit", lambda *_a: [])
  code, _ = run([*args[:2], *args[3:]])
  err = capsys.readouterr().err
  m = re.search(r"split over at least (\d+) devices with 2.00 GiB each \([^)]*\) \((\d+) with "
                r"weight_dtype=bfloat16\)", err)
  assert code == 2 and m and int(m.group(2)) == math.ceil(int(m.group(1)) / 2), err
  assert "weight_dtype=bfloat16 (about" not in err


def test_bfloat16_is_suggested_when_halving_fits(tmp_path, monkeypatch, capsys):
  """Room for 0.7 of the state next to the activations and runtime: halving the state fits, and
  so does the state split over 2 devices."""
  from MaxText.train.loop import run
  args = argv(tmp_path, "r", *MESH_1)
  est = Trainer(load_config(args), jax.devices()[:1]).memory_estimate()
  available = est.activations + est.runtime + int(0.7 * est.state)
  monkeypatch.setattr(memory, "available_bytes_per_device", lambda d: (available, "test"))
  code, _ = run(args, devices=jax.devices()[:1])
  err = capsys.readouterr().err
  halved = est.needed - est.state / 2
  assert code == 2 and f"weight_dtype=bfloat16 (about {halved / 2**30:.2f} GiB per device)" in err
  assert "split over at least 2 devices" in err


def test_bfloat16_weights_are_counted_for_the_dtypes_that_run_holds(tmp_path):
  """The bf16-weights proposal's estimate is that run's abstract state: parameters and gradients
  halve; the AdamW moments halve with them at moment_dtype=auto and stay float32 when set so. The
  advice names that run's figure, and not a halved one, when the moments stay."""
  n = None
  for moments, optimizer_ratio in (("auto", 2), ("float32", 1)):
    f32 = Trainer(load_config(argv(tmp_path, "m", *MESH_1, f"moment_dtype={moments}")),
                  jax.devices()[:1])
    est = f32.memory_estimate()
    bf16 = f32.with_weight_dtype("bfloat16").memory_estimate()
    n = n or sum(x.size for x in jax.tree.leaves(f32.abstract["params"]))
    assert (est.params, bf16.params, bf16.grads) == (4 * n, 2 * n, 2 * n)
    assert bf16.optimizer - 8 == (est.optimizer - 8) // optimizer_ratio   # + the step counts
    assert f32.cfg.weight_dtype == "float32"   # the run itself is left as it was
    room = est.activations + est.runtime + est.state - 1   # one byte short of fitting
    fits = dataclasses.replace(est, available=room)
    said = memory.advice(fits, f32.abstract, [], None, memory.Alternative(
        "weight_dtype=bfloat16", dataclasses.replace(bf16, available=room), 0))
    assert f"weight_dtype=bfloat16 (about {bf16.needed / 2**30:.2f} GiB per device)" in said
