"""Supervised fine-tuning data (MaxText/data/sft.py): the chat rendering and the assistant-token
mask equal transformers' apply_chat_template (its return_assistant_tokens_mask on a template with
{% generation %} blocks; the same template without the blocks through our prefix rendering) for a
Qwen3-style and a Gemma-style template; rows keep conversations whole with the mask as
targets_segmentation; bad records and over-long conversations are counted; no template → exit 2
naming chat_template_path; training: the assistant loss falls and a prompt token's target is not
in the objective."""
import os

import jax
import numpy as np
import pytest

import sft_helpers as h
from conftest import MESH_1
from MaxText.config.load import load_config
from MaxText.data import sft, tokenizers
from MaxText.data.config import DataConfig
from MaxText.data.errors import DataError
from MaxText.data.pipeline import make_shard_iterator

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_YML = os.path.join(ROOT, "configs", "sft.yml")
TEMPLATES = {"qwen3": h.QWEN3_TAGGED, "gemma": h.GEMMA_TAGGED}


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
  out = {}
  for name, template in TEMPLATES.items():
    folder = tmp_path_factory.mktemp(f"tok_{name}")
    h.save_chat_tokenizer(folder, template)
    out[name] = str(folder)
  return out


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_mask_equals_transformers_assistant_mask(tok_dirs, name):
  hf = transformers.AutoTokenizer.from_pretrained(tok_dirs[name])
  tok = tokenizers.HFTokenizer(os.path.join(tok_dirs[name], "tokenizer.json"))
  tagged = sft.ChatFormat.for_tokenizer(os.path.join(tok_dirs[name], "tokenizer.json"))
  plain = sft.ChatFormat(h.untagged(TEMPLATES[name]), tagged.tokens)
  assert tagged.tagged and not plain.tagged and plain.end_of_turn
  checked = 0
  for record in h.conversations(12):
    messages = sft.messages_of(record)
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    for fmt in (tagged, plain):
      ids, mask = sft.tokenize_chat(fmt, tok, messages)
      assert ids.tolist() == list(want["input_ids"])
      assert mask.tolist() == list(want["assistant_masks"])
    assert sum(want["assistant_masks"]) > 0 and 0 in want["assistant_masks"]
    checked += sum(m["role"] == "assistant" for m in messages) > 1
  assert checked >= 3   # multi-turn conversations among them


def test_records_refused():
  for bad, why in [({"text": "x"}, "needs `messages`"),
                   ({"messages": [{"role": "wizard", "content": "x"}]}, "role 'wizard'"),
                   ({"messages": [{"role": "user", "content": "x"}]}, "no assistant"),
                   ({"messages": []}, "non-empty"), ([1, 2], "JSON object")]:
    with pytest.raises(DataError, match=why):
      sft.messages_of(bad)
  assert sft.messages_of({"prompt": "a", "completion": "b"}) == [
      {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def _dcfg(tok_dir, data, **changes):
  args = [SFT_YML, f"dataset_path={data}", f"tokenizer_path={tok_dir}/tokenizer.json",
          "vocab_size=320", "shuffle=false", *(f"{k}={v}" for k, v in changes.items())]
  return DataConfig.from_config(load_config(args))


def test_rows_keep_conversations_whole_with_the_assistant_mask(tok_dirs, tmp_path, capfd):
  records = h.conversations(16)
  long = {"messages": [{"role": "user", "content": "hello how are you"},
                       {"role": "assistant", "content": " ".join(h.WORDS * 2)}]}
  bad = ['{"messages": [{"role": "wizard", "content": "x"}]}', "{not json", '{"text": "x"}']
  data = h.write_jsonl(tmp_path / "chats.jsonl", records[:8] + [long] + bad + records[8:])
  tok = tokenizers.HFTokenizer(os.path.join(tok_dirs["qwen3"], "tokenizer.json"))
  fmt = sft.ChatFormat.for_tokenizer(os.path.join(tok_dirs["qwen3"], "tokenizer.json"))
  S = 96
  want = [sft.tokenize_chat(fmt, tok, sft.messages_of(r)) for r in records]
  want = {ids[:-1].tobytes(): (ids, mask) for ids, mask in want}
  long_ids, long_mask = sft.tokenize_chat(fmt, tok, long["messages"])
  for overlong, n_long in (("drop", 0), ("truncate", 1)):
    it = make_shard_iterator(_dcfg(tok_dirs["qwen3"], data, max_target_length=S,
                                   max_bad_records=100, sft_overlong=overlong), [0], 1, 4)
    seen = set()   # conversations cut out of the rows by segment id (first-fit packing reorders)
    for _ in range(12):
      batch = next(it)
      for r in range(batch["inputs"].shape[0]):
        seg = batch["inputs_segmentation"][r]
        for s in range(1, seg.max() + 1):
          at = seg == s
          assert np.array_equal(batch["inputs_position"][r][at], np.arange(at.sum()))
          inputs, targets = batch["inputs"][r][at], batch["targets"][r][at]
          loss = batch["targets_segmentation"][r][at]
          assert set(np.unique(loss)) <= {0, s}
          if n_long and np.array_equal(inputs, long_ids[:S]):   # truncated to its first S pairs
            ids, mask = long_ids[:S + 1], long_mask[:S + 1]
          else:
            ids, mask = want[inputs.tobytes()]
          assert np.array_equal(targets, ids[1:]) and np.array_equal(loss != 0, mask[1:] != 0)
          seen.add(inputs.tobytes())
        assert (batch["targets_segmentation"][r][seg == 0] == 0).all()
    state = str(it.get_state()["shards"]["0"])
    it.close()
    assert len(seen) == len(records) + n_long
    assert ("'dropped': 0" in state) == bool(n_long) and ("'truncated': 0" in state) != bool(n_long)
  err = capfd.readouterr().err
  assert "dropped 1 conversation" in err and "truncated 1 conversation" in err
  assert "skipped bad record 3/100" in err and "role 'wizard'" in err


def test_sft_train_errors(tmp_path, capsys):
  from MaxText.train.loop import run
  data = h.write_jsonl(tmp_path / "chats.jsonl", h.conversations(8))
  notemplate = tmp_path / "plain"
  h.save_chat_tokenizer(notemplate, None)
  one = jax.devices()[:1]
  common = [*MESH_1, "steps=2", f"dataset_path={data}", f"tokenizer_path={notemplate}/tokenizer.json"]
  code, _ = run(h.sft_argv(tmp_path, "a", *common), devices=one)
  err = capsys.readouterr().err
  assert code == 2 and "chat_template_path=FILE" in err and "no chat template" in err
  (tmp_path / "t.jinja").write_text(h.QWEN3_TAGGED)
  bad = h.write_jsonl(tmp_path / "bad.jsonl", ['{"messages": 1}'] * 40)
  code, _ = run(h.sft_argv(tmp_path, "b", *common, f"chat_template_path={tmp_path}/t.jinja",
                           f"dataset_path={bad}", "max_bad_records=2"), devices=one)
  assert code == 3 and "more than max_bad_records=2" in capsys.readouterr().err
  # plain-text records given to sft=true: refused at line 1 before compiling, naming the way back
  plain = h.write_jsonl(tmp_path / "plain.jsonl", ['{"text": "just text"}'] * 4)
  code, _ = run(h.sft_argv(tmp_path, "c", *common, f"chat_template_path={tmp_path}/t.jinja",
                           f"dataset_path={plain}"), devices=one)
  out, err = capsys.readouterr()
  assert code == 3 and f"{plain} line 1: a chat record needs `messages`" in err, err
  assert "a plain-text record: those are read with sft=false" in err and "compiled" not in out
