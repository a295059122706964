"""The tools' one key=value parser (MaxText/config/cli.py): -h/--help prints the usage with
examples and exits 0; an unknown, missing, repeated or mistyped argument exits 2 naming it."""
import pytest

from MaxText import logit_check, quantize
from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
from MaxText.config import render


@pytest.mark.parametrize("tool,args,keys", [
    (to_maxtext, ("output_path=",), ("hf_path", "scan_layers", "weight_dtype")),
    (to_huggingface, ("output_path=", "max_shard_gb="), ("load_parameters_path", "hf_model_type")),
    (logit_check, ("max_kl=",), ("hf_path", "load_parameters_path", "dtype", "seed"))])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_examples(tool, args, keys, flag, capsys):
  """The tool's own arguments, then the config keys it reads with the schema's default."""
  assert tool.main([flag]) == 0
  out = capsys.readouterr().out
  assert "Examples:" in out and "python -m MaxText." in out
  for arg in args:
    assert arg.replace("=", "=<") in out, (arg, out)
  for key in keys:
    assert f"\n  {key} = " in out, (key, out)
  assert "\n  learning_rate = " not in out     # a key it does not read is not offered


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_quantize_help_alone_prints_its_usage(flag, capsys):
  assert quantize.main([flag]) == 0
  out = capsys.readouterr().out
  assert "python -m MaxText.quantize configs/base.yml" in out and "output_path=<" in out, out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_render_help_prints_its_usage_and_changes_nothing(flag, capsys):
  assert render.main([flag]) == 0
  assert "python -m MaxText.config.render --check" in capsys.readouterr().out


@pytest.mark.parametrize("tool,argv,says", [
    (to_huggingface, ["load_parameters_path=x", "output_path=y", "max_shard=2"],
     "unknown argument 'max_shard'"),
    (to_huggingface, ["load_parameters_path=x", "output_path=y", "max_shard=2"],
     "did you mean 'max_shard_gb'"),
    (to_huggingface, ["output_path=y"], "load_parameters_path: the checkpoint"),
    (to_huggingface, ["load_parameters_path=x", "output_path=y", "dtype=bfloat16"],
     "dtype: python -m MaxText.checkpoint_conversion.to_huggingface does not read dtype"),
    (logit_check, ["hf_path=x", "load_parameters_path=y", "steps=3"],
     "does not read steps (it is read by train.py, python -m MaxText.rl.grpo"),
    (to_huggingface, ["load_parameters_path=x", "output_path=y", "max_shard_gb=big"],
     "max_shard_gb='big': expected float"),
    (to_maxtext, ["hf_path=x", "output_path=y", "scan_layer=false"], "did you mean 'scan_layers'"),
    (to_maxtext, ["hf_path=x", "hf_path=z", "output_path=y"], "hf_path is given twice"),
    (to_maxtext, ["hf_path"], "'hf_path' is not key=value"),
    (logit_check, ["hf_path=x", "load_parameters_path=y", "seed=one"], "seed='one': expected int"),
    (logit_check, ["hf_path=x", "load_parameters_path=y", "dtype=float16"], "dtype='float16'"),
])
def test_bad_arguments_exit_2_naming_them(tool, argv, says, capsys):
  assert tool.main(argv) == 2
  assert says in capsys.readouterr().err
