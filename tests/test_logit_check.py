"""logit_check on a model whose fp32 rounding is large: a tiny Qwen3-Next with weights of std 0.2
(initializer_range=0.2), perturbed norms, 4 layers, a 512-token case. Its logits differ from transformers' fp32 by more
than the fixed float32 limit, because transformers' fp32 is itself that far off the exact values
(its float64 forward); the tool then judges both against float64 and passes ours, whose own error
is of the reference's size — and still fails a checkpoint that really differs."""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from end_to_end.tiny_hf import save_tiny  # noqa: E402
from MaxText import logit_check  # noqa: E402
from MaxText.checkpoint_conversion import to_maxtext  # noqa: E402
from MaxText.runtime.exit_codes import EXIT_CHECK_FAILED  # noqa: E402

QWEN3_NEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, max_position_embeddings=1024,
                  rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.2)


@pytest.fixture(scope="module")
def large_weights(tmp_path_factory):
  w = tmp_path_factory.mktemp("large_weights")
  save_tiny(str(w / "hf"), "Qwen3NextConfig", "Qwen3NextForCausalLM",
            perturb_suffixes=("dt_bias",), **QWEN3_NEXT)
  assert to_maxtext.main([f"hf_path={w / 'hf'}", f"output_path={w / 'ckpt'}"]) == 0
  return w


def float_after(out: str, marker: str) -> float:
  return float(out.split(marker, 1)[1].split()[0].rstrip(",)"))


def test_limits_come_from_the_references_own_error(large_weights, capsys):
  w = large_weights
  base = [f"hf_path={w / 'hf'}", f"load_parameters_path={w / 'ckpt'}"]   # long: 512 tokens
  assert logit_check.main(base) == 0
  out = capsys.readouterr().out
  print(out)
  # the fixed limit is exceeded against transformers' fp32 (so the float64 judgement ran) ...
  assert "over the fixed limits" in out and "judging both against transformers in float64" in out
  assert "PASS against float64" in out
  # ... because transformers' fp32 is itself about that far off the exact values
  lines = [ln for ln in out.splitlines() if "vs float64" in ln]
  assert len(lines) == 3
  ours = max(float_after(ln, "ours max_abs_diff=") for ln in lines)
  ref = max(float_after(ln, "transformers fp32 max_abs_diff=") for ln in lines)
  max_abs = float(out.strip().splitlines()[-1].split("max_abs_diff=")[1])
  assert ref > 0 and ours <= 2 * ref and max_abs <= ours + ref * (1 + 1e-6)
  # limits given on the command line are applied as given, against transformers' fp32
  assert logit_check.main(base + ["atol_fraction=1e-4"]) == EXIT_CHECK_FAILED
  assert "FAIL (limits" in capsys.readouterr().out


def test_a_checkpoint_that_differs_still_fails(large_weights, tmp_path, capsys):
  w = large_weights
  # the HF side's final norm 1 % larger: a real difference, far above either side's rounding
  model = transformers.AutoModelForCausalLM.from_pretrained(w / "hf")
  with torch.no_grad():
    model.model.norm.weight.mul_(1.01)
  model.save_pretrained(tmp_path / "hf")
  config = json.loads((w / "hf" / "config.json").read_text())
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == config["model_type"]
  assert logit_check.main([f"hf_path={tmp_path / 'hf'}", f"load_parameters_path={w / 'ckpt'}",
                           "long_length=32"]) == EXIT_CHECK_FAILED
  out = capsys.readouterr().out
  assert "FAIL against float64" in out
