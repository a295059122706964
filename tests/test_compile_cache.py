"""The persistent compilation cache of the tools (`jax_cache_dir`, runtime/compile_cache.py) and
their start-up lines, through the real command line: `python -m MaxText.decode` names the cache's
folder, says where its seconds went up to the first answer and how many of its programs came
from the cache. The same config twice: the second run loads every program from the cache and
answers the same tokens; a config that changes the programs (a longer KV cache) compiles afresh,
with no stale program loaded: its tokens are those of the in-process API on that config."""
import json
import os
import re
import subprocess
import sys

import jax
import pytest

from conftest import BASE_YML, ROOT, xla_flags
from MaxText import inference
from MaxText.checkpoint.manager import save_params_only
from MaxText.config.load import load_config
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import init_params
from MaxText.runtime import compile_cache

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random qwen3-tiny checkpoint (byte tokenizer) with 64 positions."""
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny", "max_position_embeddings=64",
                     "max_target_length=64"])
  path = str(tmp_path_factory.mktemp("ckpt") / "c")
  save_params_only(path, jax.device_get(init_params(ModelConfig.from_config(cfg), 0)), cfg.as_dict())
  return path


def decode(tmp_path, checkpoint, name, *keys):
  """One `python -m MaxText.decode` on one CPU device: (stderr, the output ids)."""
  out = tmp_path / f"{name}.jsonl"
  # the suite's compile flags without its device count (tests/conftest.py: xla_flags)
  env = dict(os.environ, XLA_FLAGS=xla_flags(None))
  # every program written to the cache, however fast it compiles (not a wall-clock condition)
  env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=ROOT,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  r = subprocess.run([sys.executable, "-m", "MaxText.decode", BASE_YML,
                      f"load_parameters_path={checkpoint}", f"jax_cache_dir={tmp_path / 'cache'}",
                      "prompt_ids=" + ",".join(map(str, PROMPT)), "max_new_tokens=6",
                      f"decode_output={out}", *keys],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
  assert r.returncode == 0, r.stderr
  return r.stderr, json.loads(out.read_text().splitlines()[0])["output_ids"]


def programs(stderr):
  """(programs handed to XLA while answering, of them from the cache) from the start-up line."""
  m = re.search(r"start-up [\d.]+ s to the first answer: imports [\d.]+ \| config [\d.]+ \| "
                r"model [\d.]+ \| answer [\d.]+ \(compile [\d.]+ s: (\d+) programs?, (\d+) from the "
                r"cache\)", stderr)
  assert m, stderr
  return int(m[1]), int(m[2])


def test_decode_cache_reused_for_the_same_config_and_never_for_a_changed_one(tmp_path, checkpoint):
  cache = tmp_path / "cache"
  first, ids = decode(tmp_path, checkpoint, "first")
  assert f"compilation cache {cache} (jax_cache_dir;" in first
  compiled, hits = programs(first)
  assert compiled >= 1 and hits == 0
  entries = set(os.listdir(cache))
  assert entries

  again, ids_again = decode(tmp_path, checkpoint, "again")
  assert programs(again) == (compiled, compiled)        # every program from the cache
  assert ids_again == ids
  assert set(os.listdir(cache)) == entries

  longer, ids_longer = decode(tmp_path, checkpoint, "longer", "max_cache_length=48")
  compiled_longer, hits_longer = programs(longer)
  assert hits_longer < compiled_longer                  # the changed programs compiled afresh
  assert set(os.listdir(cache)) > entries                # and were written next to the others
  model = inference.load([BASE_YML, f"load_parameters_path={checkpoint}", "max_cache_length=48"],
                         jax.devices()[:1])
  [want] = model.generate([PROMPT], max_new_tokens=6)
  assert ids_longer == want.output_ids


def test_cache_off_and_its_line():
  assert compile_cache.use("") == 'compilation cache off (jax_cache_dir="")'


def test_compile_meter_counts_programs():
  with compile_cache.CompileMeter() as m:
    jax.jit(lambda x: x * 3 + 1).lower(jax.ShapeDtypeStruct((7, 5), "float32")).compile()
  assert m.programs == 1 and m.seconds > 0
  # from the suite's cache or not, depending on how long it took to compile the first time
  assert re.fullmatch(r"compile [\d.]+ s: 1 program, [01] from the cache", m.text())
