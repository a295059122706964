"""The tools' one key=value parser (MaxText/config/cli.py): -h/--help prints the usage with
examples and exits 0; an unknown, missing, repeated or mistyped argument exits 2 naming it."""
import pytest

from MaxText import logit_check, quantize
from MaxText.checkpoint_conversion import to_huggingface, to_maxtext
from MaxText.config import render


@pytest.mark.parametrize("tool,args", [(to_maxtext, ("hf_path=", "output_path=")),
                                       (to_huggingface, ("load_parameters_path=", "max_shard_gb=")),
                                       (logit_check, ("hf_path=", "dtype=", "seed=")),
                                       (quantize, ("output_path=", "method="))])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_examples(tool, args, flag, capsys):
  assert tool.main([flag]) == 0
  out = capsys.readouterr().out
  assert "Examples:" in out and "python -m MaxText." in out
  for arg in args:
    assert arg.replace("=", "=<") in out, (arg, out)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_render_help_prints_its_usage_and_changes_nothing(flag, capsys):
  assert render.main([flag]) == 0
  assert "python -m MaxText.config.render --check" in capsys.readouterr().out


@pytest.mark.parametrize("tool,argv,says", [
    (to_huggingface, ["load_parameters_path=x", "output_path=y", "max_shard=2"],
     "unknown argument(s): max_shard"),
    (to_huggingface, ["output_path=y"], "missing argument(s): load_parameters_path=..."),
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
