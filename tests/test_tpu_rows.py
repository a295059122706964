"""The TPU lane's CPU-checkable parts (no TPU, no network, no training run; milliseconds):
benchmarks/tpu_rows.py reads both trainers' metrics files into medians over the same steps,
benchmarks/maxtext_shims.py makes MaxText's Python 3.12 / jax 0.11 code load on 3.11 / 0.10.2
(on a small fake package laid out like maxtext's), and benchmarks/tpu_prepare.sh resolves its pins
from requirements.txt without the packages the TPU machine must keep its own of."""
import datetime
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import maxtext_shims  # noqa: E402
import tpu_rows  # noqa: E402


def _write_jsonl(path, rows, junk=True):
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    if junk:
      f.write('{"step": 99, "loss"')   # a run killed mid-line


def test_medians_cover_the_same_steps_of_both_trainers(tmp_path):
  # MaxText counts steps from 0, ours from 1: warm-up 2 leaves MaxText's 2, 3, 4 and our 3, 4, 5
  mt = [{"step": float(s), "perf/per_device_tokens_per_sec": 100.0 * (s + 1),
         "perf/per_device_tflops_per_sec": 10.0 * (s + 1), "perf/step_time_seconds": 2.0}
        for s in range(5)]
  ours = [{"step": s, "tokens_per_s": 100.0 * s, "tflops_per_device": 10.0 * s, "mfu": 0.1 * s,
           "step_time_s": 2.0} for s in range(1, 6)]
  ours[3]["tokens_per_s"] = float("nan")                    # a non-finite figure is left out
  ours[4]["tokens_per_s"] = 900.0
  _write_jsonl(tmp_path / "mt.jsonl", mt)
  _write_jsonl(tmp_path / "ours.jsonl", ours)
  m = tpu_rows.summarize(tpu_rows.read_jsonl(str(tmp_path / "mt.jsonl")), trainer="maxtext",
                         warmup=2, peak_tflops=50.0)
  o = tpu_rows.summarize(tpu_rows.read_jsonl(str(tmp_path / "ours.jsonl")), trainer="ours",
                         warmup=2, peak_tflops=50.0)
  assert (m["steps_recorded"], m["steps_used"], o["steps_recorded"], o["steps_used"]) == (5, 3, 5, 3)
  assert m["tokens_per_s_per_device"] == 400.0 and m["tflops_per_s_per_device"] == 40.0
  assert m["mfu"] == pytest.approx(0.8) and m["step_time_s"] == 2.0
  assert m["tflop_per_step_per_device"] == 80.0
  assert o["tokens_per_s"] == 600.0                         # median of 300 and 900 (4's is NaN)
  assert o["tflops_per_s_per_device"] == 40.0 and o["mfu"] == pytest.approx(0.8)
  assert o["mfu_own"] == pytest.approx(0.4)
  none = tpu_rows.summarize([], trainer="ours", warmup=5, peak_tflops=197.0)
  assert none["steps_used"] == 0 and none["tokens_per_s"] is None and none["mfu"] is None


def test_keys_override_the_defaults_in_place():
  keys = tpu_rows.merge_keys({"steps": "12", "jax_cache_dir": ""},
                             ["model_name=qwen3-0.6b", "steps=20", "x=a=b"])
  assert keys == ["steps=20", "jax_cache_dir=", "model_name=qwen3-0.6b", "x=a=b"]
  with pytest.raises(ValueError, match="'steps' is not key=value"):
    tpu_rows.merge_keys({}, ["steps"])


def test_maxtext_first_step_time_from_its_log_stamp():
  launch = datetime.datetime(2026, 12, 6, 23, 59, 50).timestamp()
  log = "I1206 23:59:58.000000 1 x.py:1] other\nI1207 00:00:20.500000 1 metric_logger.py:265] " \
        "completed step: 0, seconds: 9.1, TFLOP/s/device: 0.0\n"
  assert tpu_rows._maxtext_first_step_s(log, launch) == 30.5   # pylint: disable=protected-access
  assert tpu_rows._maxtext_first_step_s("no step", launch) is None


def test_cli_refuses_no_arm_and_too_few_steps(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv(tpu_rows.ARM_PATH_ENV, str(tmp_path))
  assert tpu_rows.main(["maxtext", "--steps", "6", "model_name=x"]) == 2
  assert "no maxtext/configs/base.yml" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    tpu_rows.main(["ours", "--steps", "5"])
  assert e.value.code == 2


def _fake_maxtext(site):
  files = {
      "maxtext/__init__.py": "",
      "maxtext/kernels/mhc/common.py": "import jax\ntype KernelContext = tuple[int, int]\n",
      "maxtext/kernels/attention/jax_flash_attention.py":
          "import jax\nfrom jax.experimental.xla_metadata import must_fuse_call\n"
          "def f(x):\n  return must_fuse_call('1')(lambda y: y + 1)(x)\n",
      "maxtext/checkpoint_conversion/utils/hf_model_configs.py":
          '"""Doc."""\nimport transformers\nHF_MODEL_CONFIGS = {"a": transformers.Cfg(x=1)}\n',
  }
  for rel, text in files.items():
    os.makedirs(os.path.dirname(site / rel), exist_ok=True)
    (site / rel).write_text(text)


def test_shims_make_the_package_load_on_this_python(tmp_path, monkeypatch):
  site = tmp_path / "site"
  _fake_maxtext(site)
  absent = "no_such_pkg_for_the_arm"
  monkeypatch.setattr(maxtext_shims, "STUBS", (absent, "json"))   # json is there: no stub
  done = maxtext_shims.apply(str(site))
  assert done["type aliases"] == ["kernels/mhc/common.py"]
  assert done["must_fuse_call"] == ["kernels/attention/jax_flash_attention.py"]
  assert done["transformers-config modules replaced"] == [
      "checkpoint_conversion/utils/hf_model_configs.py"]
  assert done["stubs"] == [absent] and done["still unparsable on this Python"] == []
  pkg = site / "maxtext"
  assert "KernelContext = tuple[int, int]" in (pkg / "kernels/mhc/common.py").read_text()
  ns: dict = {}
  exec((pkg / "kernels/attention/jax_flash_attention.py").read_text(), ns)  # pylint: disable=exec-used
  assert ns["f"](1) == 2                       # the real must_fuse_call or the identity shim
  ns = {}
  exec((pkg / "checkpoint_conversion/utils/hf_model_configs.py").read_text(), ns)  # pylint: disable=exec-used
  assert ns["HF_MODEL_CONFIGS"] == {}
  assert (pkg / "checkpoint_conversion/utils/hf_model_configs.py.orig").is_file()

  # the stub takes any import, subclassing, call or attribute a module-level use needs
  monkeypatch.syspath_prepend(str(site))
  finders = list(sys.meta_path)
  try:
    code = (f"from {absent} import Image\nimport {absent}.models.auto as auto\n"
            f"import {absent}\nclass P({absent}.ProcessorMixin): pass\n"
            "x = Image.Resampling.BICUBIC\nlog = auto.logging.get_logger('m')\n")
    exec(compile(code, "t", "exec"), {})  # pylint: disable=exec-used
  finally:
    sys.meta_path[:] = finders
    for name in [m for m in sys.modules if m.split(".")[0] == absent]:
      del sys.modules[name]

  # idempotent; a stub gives way to a real package that appears later
  before = {p: p.read_text() for p in pkg.rglob("*.py")}
  real = tmp_path / "real"
  (real / absent).mkdir(parents=True)
  (real / absent / "__init__.py").write_text("")
  monkeypatch.syspath_prepend(str(real))
  again = maxtext_shims.apply(str(site))
  assert all(v == [] for v in again.values()), again
  assert {p: p.read_text() for p in pkg.rglob("*.py")} == before
  assert not (site / absent).exists()


def test_a_package_without_maxtext_is_refused(tmp_path, capsys):
  assert maxtext_shims.main([str(tmp_path)]) == 1
  assert "no maxtext package" in capsys.readouterr().err


def test_prepare_pins_come_from_requirements_and_leave_the_machines_jax_alone():
  p = subprocess.run(["bash", "benchmarks/tpu_prepare.sh", "--pins"], cwd=ROOT,
                     capture_output=True, text=True, check=False)
  assert p.returncode == 0, p.stderr
  pins = p.stdout.split()
  names = {pin.split("==")[0].lower().replace("_", "-") for pin in pins}
  assert all(len(pin.split("==")) == 2 and pin.split("==")[1] for pin in pins), pins
  # tqdm: MaxText.quantization.convert's (the chip's int8 decode rows quantize there)
  assert {"flax", "orbax-checkpoint", "tensorstore", "grain", "qwix", "maxtext", "tqdm"} <= names
  assert any(pin.startswith("tqdm==") for pin in pins[:pins.index("maxtext==0.2.5")]), pins
  assert not names & {"jax", "jaxlib", "numpy", "scipy", "ml-dtypes", "libtpu", "torch",
                      "transformers", "ray", "ruff", "pyright"}
  with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as f:
    required = {line.split("#")[0].strip() for line in f}
  ours = pins[:pins.index("maxtext==0.2.5")]
  assert all(pin in required for pin in ours), set(ours) - required
  assert len(ours) > 30
