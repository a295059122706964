"""The config's auto values (`MaxText/resolve/auto_settings.py`): dtype=auto is bfloat16 compute when
training and float32 in the tools; loss_chunk_length=-1 chunks the loss when the family has a
separate LM head, the vocabulary is large against the width and the sequence is longer than one
chunk; only a chunk the user set is refused for a family without that head."""
import jax
import pytest

from conftest import BASE_YML, MESH_1, argv, read_metrics
from MaxText.config.load import ConfigError, load_config, resolve_dtype
from MaxText.resolve import auto_settings
from MaxText.resolve.config_checks import validate
from MaxText.train import loop

C = auto_settings.AUTO_CHUNK_LENGTH
BIG_VOCAB = f"vocab_size={auto_settings.AUTO_CHUNK_VOCAB_RATIO * 256}"   # base.yml: emb_dim 256


def test_dtype_auto_is_bf16_for_training_and_fp32_for_the_tools():
  given = load_config([BASE_YML], keep_auto=True)
  assert given.dtype == "auto" and given.weight_dtype == "float32"
  assert load_config([BASE_YML]).dtype == "float32"                  # the tools (parity in fp32)
  assert resolve_dtype(given, training=True).dtype == "bfloat16"
  assert auto_settings.for_training(given).cfg.dtype == "bfloat16"
  for dtype in ("float32", "bfloat16", "float16"):                    # a set dtype is kept
    cfg = load_config([BASE_YML, f"dtype={dtype}"], keep_auto=True)
    assert auto_settings.for_training(cfg).cfg.dtype == \
        load_config([BASE_YML, f"dtype={dtype}"]).dtype == dtype


@pytest.mark.parametrize("keys,expected", [
    ((f"max_target_length={2 * C}", BIG_VOCAB), C),         # llama: has `logits`, longer than C
    ((f"max_target_length={2 * C}",), 0),                    # base.yml: vocabulary 1.5 x the width
    ((f"max_target_length={2 * C}", "vocab_size=2047"), 0),  # just under 8 x the width
    ((f"max_target_length={C}", BIG_VOCAB), 0),              # one chunk would be the whole
    ((f"max_target_length={2 * C}", BIG_VOCAB, "loss_chunk_length=0"), 0),
    ((f"max_target_length={2 * C}", "loss_chunk_length=32"), 32),
])
def test_loss_chunk_auto(keys, expected):
  cfg = load_config([BASE_YML, *keys])
  assert auto_settings.loss_chunk(cfg) == expected
  assert auto_settings.for_training(cfg).cfg.loss_chunk_length == expected


def test_resolved_once_with_the_keys_left_at_auto():
  """`for_training` records which keys were auto (the mesh line says so only for those) and hands
  a resolution back unchanged (train.py's run() resolves once; the Trainer takes that)."""
  given = load_config([BASE_YML, f"max_target_length={2 * C}", BIG_VOCAB], keep_auto=True)
  training = auto_settings.for_training(given)
  assert training.auto == {"dtype", "matmul_precision", "loss_chunk_length"}
  assert (training.cfg.dtype, training.cfg.loss_chunk_length) == ("bfloat16", C)
  assert training.cfg.matmul_precision == "default"
  assert auto_settings.for_training(training) is training
  assert auto_settings.describe(training) == (
      f"compute bfloat16 (dtype=auto; dtype=float32 for full precision), matmul precision "
      f"default (matmul_precision=auto), weights float32; loss in chunks of {C} positions "
      f"(loss_chunk_length=-1: auto)")
  explicit = auto_settings.for_training(load_config(
      [BASE_YML, f"max_target_length={2 * C}", BIG_VOCAB, "dtype=bfloat16",
       f"loss_chunk_length={C}", "matmul_precision=default"], keep_auto=True))
  assert explicit.auto == set() and explicit.cfg == training.cfg
  assert auto_settings.describe(explicit) == (
      f"compute bfloat16, matmul precision default, weights float32; loss in chunks of {C} "
      f"positions")


def test_loss_chunk_length_range():
  """-1 is auto, 0 the whole sequence; a family without a separate head: tests/test_plugin_family.py
  (auto → whole sequence, a set chunk refused)."""
  assert auto_settings.has_logits_head("llama") and auto_settings.has_logits_head("gemma4")
  validate(load_config([BASE_YML, f"max_target_length={2 * C}", *MESH_1]), jax.devices()[:1])
  with pytest.raises(ConfigError, match=r"loss_chunk_length=-2: must be >= -1"):
    load_config([BASE_YML, "loss_chunk_length=-2"])


def test_training_with_auto_values(tmp_path, capsys, monkeypatch):
  """A run with dtype=auto and loss_chunk_length=-1 at a sequence of two chunks: it computes in
  bf16 with chunks of C (printed with the mesh), writes them to config.yml, and its loss falls.
  The config checks see the config the run trains with (one resolution, not one per reader)."""
  checked, check = [], loop.check_config
  monkeypatch.setattr(loop, "check_config", lambda cfg, devices: checked.append(cfg) or
                      check(cfg, devices))
  code, trainer = loop.run(argv(tmp_path, "auto", "dtype=auto", f"max_target_length={2 * C}",
                                "vocab_size=512",          # 8 x the tiny width 64
                                "per_device_batch_size=1", "steps=6", "learning_rate=3e-3",
                                "enable_checkpointing=false"))
  rows, state = read_metrics(tmp_path / "auto"), trainer.final_state
  out = capsys.readouterr().out
  assert code == 0 and len(rows) == 6
  assert checked == [trainer.cfg]
  assert trainer.training.auto == {"dtype", "matmul_precision", "loss_chunk_length"}
  assert (f"compute bfloat16 (dtype=auto; dtype=float32 for full precision), matmul precision "
          f"default (matmul_precision=auto), weights float32; loss in chunks of {C} positions "
          f"(loss_chunk_length=-1: auto)") in out
  saved = (tmp_path / "auto" / "config.yml").read_text()
  assert 'dtype: bfloat16' in saved and f"loss_chunk_length: {C}" in saved
  assert jax.tree.leaves(state["params"])[0].dtype == "float32"      # fp32 master weights
  assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, [r["loss"] for r in rows]
