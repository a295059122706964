"""Issue 55: every tool resolves its model as train.py does (MaxText/resolve/architecture.py): the
user's config file, then the Hugging Face folder's (`hf_path`) or the checkpoint's
(`load_parameters_path`) architecture, then the command line. For each tool, through the way it
takes its arguments, a config file's own keys survive, its architecture keys give way to the
model's, and a command-line architecture key that disagrees is refused naming both. The tools
used to restart from configs/base.yml with hf_path (`decode my.yml hf_path=DIR` ran 8 prompts
together and 64 new tokens where my.yml said 3 and 7); one decode runs end to end."""
import json

import jax
import pytest

from conftest import BASE_YML
from MaxText.config.load import ConfigError, load_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# the folder's (and so the checkpoint's) architecture: tests/test_conversion.py's tiny Qwen3
FOLDER_ARCH = {"emb_dim": 64, "num_decoder_layers": 2, "num_query_heads": 4, "num_kv_heads": 2,
               "head_dim": 16, "mlp_dim": 128}
# a config file's architecture keys, all different from the folder's: they give way
FILE_ARCH = {"emb_dim": 128, "num_decoder_layers": 3, "mlp_dim": 256}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """{"hf_path": the tiny Qwen3 folder (with a tokenizer), "load_parameters_path": its
  conversion}: the same architecture both ways."""
  from end_to_end.tiny_hf import save_tiny_tokenizer
  from test_conversion import tiny_qwen3
  from MaxText.checkpoint_conversion import to_maxtext
  root = tmp_path_factory.mktemp("sources")
  folder, ckpt = root / "hf", root / "ckpt"
  tiny_qwen3(folder)
  save_tiny_tokenizer(str(folder))
  assert to_maxtext.main([f"hf_path={folder}", f"output_path={ckpt}"]) == 0
  return {"hf_path": str(folder), "load_parameters_path": str(ckpt)}


def config_file(tmp_path, **keys) -> str:
  """A user's config file: configs/base.yml's keys, then `keys` and FILE_ARCH."""
  path = tmp_path / "my.yml"
  path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in
                            {"base_config": BASE_YML, **FILE_ARCH, **keys}.items()) + "\n")
  return str(path)


def check(cfg, **keys):
  """The config file's `keys` survived; the architecture is the model's, not the file's."""
  assert {k: getattr(cfg, k) for k in keys} == keys
  assert {k: getattr(cfg, k) for k in FOLDER_ARCH} == FOLDER_ARCH
  assert cfg.hf_model_type == "qwen3"


SOURCES = ["hf_path", "load_parameters_path"]
DECODE_KEYS = {"decode_batch_size": 3, "max_new_tokens": 7}


@pytest.mark.parametrize("source", SOURCES)
def test_decode(sources, tmp_path, source):
  """`python -m MaxText.decode my.yml hf_path=DIR`: decode.run checks `argv` for the tool, then
  `inference.load(argv)` resolves it (`resolve_config`)."""
  from MaxText import inference
  argv = [config_file(tmp_path, **DECODE_KEYS), f"{source}={sources[source]}", "seed=3"]
  load_config(argv, tool="decode")
  cfg = inference.resolve_config(argv)
  check(cfg, **DECODE_KEYS, seed=3)
  if source == "hf_path":   # the folder's tokenizer files say the type (none was chosen)
    assert cfg.tokenizer_type == "huggingface"


@pytest.mark.parametrize("source", SOURCES)
def test_python_api(sources, tmp_path, source):
  """`inference.load([my.yml, ...])`: `load_config_for_decoding`, the config and its parameters
  (a folder not read yet, or none: the checkpoint is read by `load`)."""
  from MaxText import inference
  argv = [config_file(tmp_path, **DECODE_KEYS, top_k=5), f"{source}={sources[source]}"]
  cfg, params = inference.load_config_for_decoding(argv)
  check(cfg, **DECODE_KEYS, top_k=5)
  assert isinstance(params, inference.ShardedHF) if source == "hf_path" else params is None


@pytest.mark.parametrize("source", SOURCES)
def test_serve(sources, tmp_path, source):
  """`python -m MaxText.serve my.yml hf_path=DIR port=0`: its parser's config argv, resolved."""
  from MaxText import inference
  from MaxText.config import cli
  from MaxText.serve.__main__ import ARGS
  keys = {"max_cache_length": 96, "per_device_batch_size": 2.0}
  args, _, config_argv = cli.parse(
      [config_file(tmp_path, **keys), f"{source}={sources[source]}", "port=0"], ARGS, "",
      tool="serve", config_file=True)
  assert args["port"] == 0 and config_argv[0].endswith("my.yml")
  check(inference.resolve_config(config_argv), **keys)


@pytest.mark.parametrize("source", SOURCES)
def test_lm_eval(sources, tmp_path, source):
  """`lm_eval --model maxtext --model_args config=my.yml,hf_path=DIR` (lm-eval's batch size
  `auto` leaves the file's decode_batch_size)."""
  from MaxText import inference
  from MaxText.lmeval.model import config_argv
  keys = {"decode_batch_size": 3, "max_cache_length": 96}
  argv = config_argv({"config": config_file(tmp_path, **keys), source: sources[source]}, "auto")
  load_config(argv, tool="lm_eval")
  check(inference.resolve_config(argv), **keys)


@pytest.mark.parametrize("source", SOURCES)
def test_inspect(sources, tmp_path, source):
  """`python -m MaxText.inspect my.yml hf_path=DIR prompt=...` (its parser's config argv) and the
  API's `capabilities(config=my.yml, hf_path=DIR)`, which reads no parameter."""
  from MaxText import inference
  from MaxText import inspect as mi
  from MaxText.inspect.__main__ import ARGS
  path = config_file(tmp_path, **DECODE_KEYS, attention="flash")
  _, _, argv = cli_parse([path, f"{source}={sources[source]}", "prompt=hi"], ARGS, "inspect")
  check(inference.resolve_config(argv), **DECODE_KEYS, attention="flash")
  # the model's own attention op (attention="model") is the file's
  caps = mi.capabilities(config=path, attention="model", **{source: sources[source]})
  assert caps.attention_op == "flash" and not caps.attentions


@pytest.mark.parametrize("source", SOURCES)
def test_evaluate(sources, tmp_path, source):
  """`python -m MaxText.evaluate my.yml hf_path=DIR`: `prepare` checks `argv` for the tool, then
  resolves it (`load_config_for_decoding`)."""
  from MaxText import inference
  keys = {"eval_steps": 3, "per_device_batch_size": 2.0, "max_target_length": 32}
  argv = [config_file(tmp_path, **keys), f"{source}={sources[source]}"]
  load_config(argv, tool="evaluate")
  check(inference.load_config_for_decoding(argv)[0], **keys)


def cli_parse(argv, spec, tool):
  from MaxText.config import cli
  return cli.parse(argv, spec, "", tool=tool, config_file=True)


@pytest.mark.parametrize("source", SOURCES)
def test_command_line_architecture_must_agree(sources, tmp_path, source):
  """The command line comes last: an architecture key equal to the model's is taken, one that
  disagrees is refused naming both values, as train.py refuses it."""
  from MaxText import inference
  argv = [config_file(tmp_path), f"{source}={sources[source]}"]
  check(inference.resolve_config([*argv, "emb_dim=64"]))
  with pytest.raises(ConfigError, match=r"emb_dim=128 disagrees with .*emb_dim=64"):
    inference.resolve_config([*argv, "emb_dim=128"])


def test_decode_end_to_end(sources, tmp_path):
  """The issue's reproduction, run: `decode my.yml hf_path=DIR` generates the file's
  max_new_tokens (7, not base.yml's 64; an eos id the model does not reach in 7)."""
  from MaxText import decode
  out = tmp_path / "out.jsonl"
  path = config_file(tmp_path, **DECODE_KEYS, eos_ids=[383])
  assert decode.main([path, f"hf_path={sources['hf_path']}", "prompt_ids=[5, 9, 12]",
                      f"decode_output={out}"]) == 0
  [line] = [json.loads(x) for x in out.read_text().splitlines()]
  assert line["prompt_ids"] == [5, 9, 12]
  assert len(line["output_ids"]) == 7 and line["finish_reason"] == "length", line
  jax.clear_caches()
