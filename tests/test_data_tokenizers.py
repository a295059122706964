"""MaxText.data with trained tokenizers (transformers' fast tokenizers, SentencePiece): through the
pipeline, their special tokens read as transformers reads them and never guessed, and the
tokenizer type taken from the path (tests/test_data.py: the rest of the data pipeline)."""

import json

import pytest

from MaxText.data import DataError, make_data_iterator, tokenizers, validate_data_config

from end_to_end import tiny_hf
from test_data import make_cfg, write_jsonl

CORPUS = tiny_hf.CORPUS


def test_hf_tokenizer_through_pipeline(tmp_path):
  transformers = pytest.importorskip("transformers")
  tiny_hf.save_tiny_tokenizer(tmp_path)
  tok_path = tmp_path / "tokenizer.json"
  write_jsonl(tmp_path / "data.jsonl", CORPUS[:4])

  hf = tokenizers.make_tokenizer("huggingface", str(tok_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert (hf.pad_id, hf.bos_id, hf.eos_id) == (theirs.pad_token_id, theirs.bos_token_id,
                                               theirs.eos_token_id) == (0, 1, 2)
  assert hf.encode(CORPUS[0]) == theirs.encode(CORPUS[0], add_special_tokens=False)
  assert hf.decode(hf.encode(CORPUS[0])) == CORPUS[0]
  cfg = make_cfg(dataset_type="file", dataset_path=str(tmp_path / "data.jsonl"),
                 tokenizer_type="huggingface", tokenizer_path=str(tok_path), shuffle=False,
                 packing=False, max_target_length=32, vocab_size=hf.vocab_size)
  it = make_data_iterator(cfg, 0, 1, 2)
  batch = next(it)
  row = batch["inputs"][0][batch["inputs_segmentation"][0] > 0]
  assert row[0] == hf.bos_id
  assert hf.decode(row[1:]) == CORPUS[0]
  assert batch["targets"][0][len(row) - 1] == hf.eos_id
  assert batch["inputs"].max() < hf.vocab_size
  with pytest.raises(DataError, match=f"tokenizer has {hf.vocab_size} ids but vocab_size=10"):
    make_data_iterator(make_cfg(**{**vars(cfg), "vocab_size": 10}), 0, 1, 2)


def _token_files(folder, config=None, special_map=None):
  tiny_hf.trained_tokenizer().save(str(folder / "tokenizer.json"))
  if config is not None:
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
  if special_map is not None:
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map))


ADDED = {"added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False,
                                           "rstrip": False, "normalized": False,
                                           "single_word": False}
                                  for i, t in enumerate(tiny_hf.SPECIALS)}}


@pytest.mark.parametrize("config,special_map", [
    ({"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>",
                                       "special": True}}, None),   # older transformers
    ({"bos_token": "<s>", "eos_token": "</s>", "pad_token": None}, {"eos_token": "<|eos|>",
                                                                    "pad_token": "<pad>"}),
    ({**ADDED, "bos_token": "<s>", "eos_token": "</s>"}, {"eos_token": "<|eos|>"}),
    ({"eos_token": "</s>"}, None),
], ids=["config_only", "map_overrides_config", "map_ignored_with_added_tokens_decoder",
        "no_bos"])
def test_special_tokens_are_read_as_transformers_reads_them(tmp_path, config, special_map):
  transformers = pytest.importorskip("transformers")
  config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
  _token_files(tmp_path, config, special_map)
  ours = tokenizers.make_tokenizer("auto", str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
  assert ours.pad_id == (theirs.pad_token_id if theirs.pad_token_id is not None else 0)


def test_special_tokens_are_never_guessed(tmp_path):
  """A bare tokenizer.json whose vocabulary holds [CLS]/[SEP] and <s>/</s>: no bos/eos, so
  add_bos/add_eos refuse, naming the setting and the files that set it."""
  _token_files(tmp_path)
  tok = tokenizers.make_tokenizer("auto", str(tmp_path / "tokenizer.json"))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, None, 0)
  cfg = make_cfg(tokenizer_type="auto", tokenizer_path=str(tmp_path), vocab_size=300)
  with pytest.raises(DataError, match=r'add_bos=true but the tokenizer .* has no bos_token \(neither '
                                      r'tokenizer_config.json nor special_tokens_map.json next to '
                                      r'it sets "bos_token"; set it there, or set add_bos=false\)'):
    validate_data_config(cfg)
  with pytest.raises(DataError, match="add_eos=true .* no eos_token"):
    validate_data_config(make_cfg(**{**vars(cfg), "add_bos": False}))
  assert validate_data_config(make_cfg(**{**vars(cfg), "add_bos": False, "add_eos": False}))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<BOS>"}))
  with pytest.raises(DataError, match=r"tokenizer_config.json names bos_token='<BOS>', which is "
                                      r"not in the vocabulary"):
    tokenizers.make_tokenizer("auto", str(tmp_path))


def test_tokenizer_type_comes_from_the_path(tmp_path):
  resolve = tokenizers.resolve
  (tmp_path / "hf").mkdir()
  _token_files(tmp_path / "hf")
  (tmp_path / "sp").mkdir()
  (tmp_path / "sp" / "spm.model").write_bytes(b"\0")
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "README.md").write_text("x")
  hf_file, sp_file = str(tmp_path / "hf" / "tokenizer.json"), str(tmp_path / "sp" / "spm.model")
  assert resolve("auto", "")[:2] == ("byte", "")
  assert resolve("auto", hf_file)[:2] == ("huggingface", hf_file)
  assert "inferred from the file name: huggingface" in resolve("auto", hf_file)[2]
  assert resolve("auto", str(tmp_path / "hf"))[:2] == ("huggingface", hf_file)
  assert resolve("auto", str(tmp_path / "sp"))[:2] == ("sentencepiece", sp_file)
  assert resolve("huggingface", str(tmp_path / "hf"))[:2] == ("huggingface", hf_file)
  with pytest.raises(DataError, match=r"tokenizer_path '.*empty' is a directory without "
                                      r"tokenizer.json or one \*.model file \(it holds: README.md\)"):
    resolve("auto", str(tmp_path / "empty"))
  with pytest.raises(DataError, match=r"tokenizer_type='sentencepiece' contradicts tokenizer_path="
                                      r"'.*tokenizer.json', which is a huggingface file"):
    resolve("sentencepiece", hf_file)
  with pytest.raises(DataError, match="tokenizer_type='byte' .* contradicts tokenizer_path="):
    resolve("byte", hf_file)
  (tmp_path / "vocab.bin").write_bytes(b"\0")
  with pytest.raises(DataError, match="cannot tell the tokenizer type from the file name"):
    resolve("auto", str(tmp_path / "vocab.bin"))
  assert resolve("sentencepiece", str(tmp_path / "vocab.bin"))[:2] == (
      "sentencepiece", str(tmp_path / "vocab.bin"))


def test_sentencepiece_tokenizer_through_pipeline(tmp_path):
  import sentencepiece as spm

  text = tmp_path / "train.txt"
  text.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
  spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"),
                                 vocab_size=60, model_type="bpe", pad_id=3,
                                 minloglevel=2)
  model = str(tmp_path / "sp.model")
  sp = tokenizers.make_tokenizer("sentencepiece", model)
  assert (sp.vocab_size, sp.pad_id, sp.bos_id, sp.eos_id) == (60, 3, 1, 2)
  assert sp.decode(sp.encode(CORPUS[1])) == CORPUS[1]
  cfg = make_cfg(dataset_type="file", dataset_path=str(text), tokenizer_type="sentencepiece",
                 tokenizer_path=model, max_target_length=16, vocab_size=64, shuffle=False)
  batch = next(make_data_iterator(cfg, 0, 1, 2))
  expected = [1] + sp.encode(text.read_text(encoding="utf-8"))
  assert batch["inputs"][0].tolist() == expected[:16]
  assert batch["targets"][0].tolist() == expected[1:17]
