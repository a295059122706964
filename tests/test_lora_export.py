"""LoRA checkpoints to Hugging Face and back: the merged export (transformers), the PEFT export
(through `peft.PeftModel.from_pretrained` on the transformers base) and our own forward agree
within 1e-4 (fp32) for Qwen3, Qwen3-MoE, Gemma 4 and Qwen3-Next (scanned and not); a PEFT folder imported by
to_maxtext gives back our adapters exactly."""
import json
import os

import jax
import numpy as np
import pytest
from flax import traverse_util

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import BASE_YML  # noqa: E402
from end_to_end.tiny_hf import save_tiny  # noqa: E402
from MaxText.checkpoint.manager import load_params_host, save_params_only  # noqa: E402
from MaxText.checkpoint_conversion import to_huggingface, to_maxtext  # noqa: E402
from MaxText.checkpoint_conversion.to_huggingface import checkpoint_config  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.layers import lora  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import get_hf_map, make_model_def  # noqa: E402

CASES = {"qwen3": ("qwen3-tiny", "true", []),
         "qwen3_moe": ("qwen3-moe-tiny", "false", []),
         "gemma4": ("gemma4-tiny", "true", ["attention_pattern=sf", "num_decoder_layers=6",
                                             "num_kv_shared_layers=2", "sliding_window=4"]),
         # the attention and Gated DeltaNet projections (default targets: test below). Not the
         # shared expert's MLP: peft 0.21 on transformers 5 rewrites every *.gate_proj / up_proj /
         # down_proj target of a qwen2_moe-style model to the fused experts' parameters
         # (peft/utils/transformers_weight_conversion.py), so it drops those adapters on load.
         "qwen3_next": ("qwen3-next-tiny", "true",
                        ["lora_targets=/(attn|linear_attn)/[a-z_]+$"])}

# Qwen3-Next's default targets: the Gated DeltaNet projections (a named axis on each side; their
# fused dimension is not) with attention and the shared expert's MLP; never the router, the
# shared expert's one-value gate, the norms or the head.
NEXT_DEFAULT = {"attn/query", "attn/key", "attn/value", "attn/out", "linear_attn/in_proj_qkvz",
                "linear_attn/in_proj_ba", "linear_attn/out_proj", "mlp/shared/gate",
                "mlp/shared/up", "mlp/shared/down"}


def hf_base(folder, model_name, extra):
  """A random-init transformers model of our tiny config (end_to_end/tiny_hf.py), saved."""
  cfg = load_config([BASE_YML, f"model_name={model_name}",
                     *(e for e in extra if not e.startswith("lora_"))])
  hf_config = dict(get_hf_map(cfg.hf_model_type).config_to_hf(cfg))
  hf_config.pop("architectures", None)
  model_type = hf_config.pop("model_type")
  config_cls = type(transformers.AutoConfig.for_model(model_type)).__name__
  model_cls = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
  save_tiny(str(folder), config_cls, model_cls, **hf_config)


def forward(md, params, tokens):
  """Our logits: one jitted program (eagerly, every op of the model compiles on its own)."""
  B, S = tokens.shape
  pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
  return np.asarray(jax.jit(md.apply)(params, tokens, pos, np.ones((B, S), np.int32)))


def hf_forward(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def close(got, want):
  err = np.max(np.abs(got - want))
  assert err <= 1e-4 * max(1.0, np.max(np.abs(want))), err


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_peft_and_ours_agree(case, tmp_path):
  model_name, scan, extra = CASES[case]
  hf_dir = tmp_path / "hf"
  hf_base(hf_dir, model_name, extra)
  cfg, base = to_maxtext.load_hf(str(hf_dir), [f"scan_layers={scan}"])
  targets = [e.split("=", 1)[1] for e in extra if e.startswith("lora_targets=")]
  cfg = replace(cfg, lora_rank=4, lora_alpha=8.0, lora_targets=(targets or [""])[0])
  md = make_model_def(ModelConfig.from_config(cfg))
  abstract = traverse_util.flatten_dict(lora.split(md.abstract_params)[0])
  rng = np.random.default_rng(1)
  adapters = traverse_util.unflatten_dict(
      {k: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype) for k, s in abstract.items()})
  params = lora.join(adapters, base)
  ckpt = tmp_path / "ckpt"
  save_params_only(str(ckpt), params, cfg.as_dict())
  tokens = rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
  ours = forward(md, params, tokens)
  plain = forward(make_model_def(ModelConfig.from_config(replace(cfg, lora_rank=0))), base, tokens)
  assert np.max(np.abs(ours - plain)) > 1e-2       # the adapters change the model

  merged_dir, peft_dir = tmp_path / "merged", tmp_path / "peft"
  assert to_huggingface.main([f"load_parameters_path={ckpt}", f"output_path={merged_dir}"]) == 0
  close(hf_forward(transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval(), tokens),
        ours)

  assert to_huggingface.main([f"load_parameters_path={ckpt}", f"output_path={peft_dir}",
                              "adapter_format=peft"]) == 0
  assert sorted(os.listdir(peft_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
  with open(peft_dir / "adapter_config.json") as f:
    config = json.load(f)
  assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["target_modules"]
  base_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
  peft = pytest.importorskip("peft")   # here, not at collection: peft imports ~2 s of transformers
  with_peft = peft.PeftModel.from_pretrained(base_hf, str(peft_dir)).eval()
  close(hf_forward(with_peft, tokens), ours)

  # PEFT folder → our checkpoint: the same adapters, the same forward
  back = tmp_path / "back"
  assert to_maxtext.main([f"hf_path={hf_dir}", f"output_path={back}", f"adapter_path={peft_dir}",
                          f"scan_layers={scan}"]) == 0
  back_cfg = checkpoint_config(str(back))
  assert (back_cfg.lora_rank, back_cfg.lora_alpha) == (4, 8.0)
  back_md = make_model_def(ModelConfig.from_config(back_cfg))
  got = load_params_host(str(back), back_md.abstract_params)
  want = traverse_util.flatten_dict(params)
  for k, v in traverse_util.flatten_dict(got).items():
    np.testing.assert_array_equal(v, want[k], err_msg="/".join(map(str, k)))
  close(forward(back_md, got, tokens), ours)


def test_qwen3_next_default_targets():
  cfg = load_config([BASE_YML, "model_name=qwen3-next-tiny", "scan_layers=false", "lora_rank=2"])
  flat = traverse_util.flatten_dict(make_model_def(ModelConfig.from_config(cfg)).abstract_params)
  adapted = {"/".join(map(str, k[:-1])) for k in flat if k[-1] == "lora_a"}
  for i, kind in enumerate(("linear_attn", "linear_attn", "linear_attn", "attn")):
    prefix = f"decoder/layers/{i}/"
    want = {m for m in NEXT_DEFAULT if m.startswith("mlp/") or m.startswith(kind + "/")}
    assert {a[len(prefix):] for a in adapted if a.startswith(prefix)} == want, i
  assert all(a.startswith("decoder/layers/") for a in adapted), adapted


def test_peft_export_of_a_plain_checkpoint_is_refused(tmp_path, capsys):
  hf_base(tmp_path / "hf", "qwen3-tiny", [])
  assert to_maxtext.main([f"hf_path={tmp_path / 'hf'}", f"output_path={tmp_path / 'ck'}"]) == 0
  assert to_huggingface.main([f"load_parameters_path={tmp_path / 'ck'}",
                              f"output_path={tmp_path / 'out'}", "adapter_format=peft"]) == 2
  assert "no LoRA adapters" in capsys.readouterr().err
