"""Reward functions and a prompt file for the GRPO tests (imported by name: reward=grpo_helpers:…;
the tests folder is on sys.path in pytest, and on PYTHONPATH for the multi-process launch)."""
import json
import zlib


def digits(prompt, completion, row):
  """The share of the completion's characters that are digits: a dense signal a random model can
  climb."""
  del prompt, row
  return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def even_ids_only(prompt, completion, row):
  """0 for the prompts of odd id (their groups' rewards all equal: DAPO drops or resamples them),
  else a deterministic value of the completion's text in [0, 1)."""
  del prompt
  return 0.0 if row["id"] % 2 else (zlib.crc32(completion.encode()) % 97) / 97


def flaky(prompt, completion, row):
  """Raises on odd rows, returns a string on rows divisible by 4: two kinds of bad reward."""
  del prompt, completion
  if row["id"] % 2:
    raise ValueError(f"cannot score row {row['id']}")
  return "yes" if row["id"] % 4 == 0 else 1.0


def write_prompts(path, n=8, long_line=None):
  """n prompts "<i>:" with an id; `long_line`: a prompt of that many characters as line n + 1."""
  with open(path, "w", encoding="utf-8") as f:
    for i in range(n):
      f.write(json.dumps({"prompt": f"{i}:", "id": i, "answer": str(i)}) + "\n")
    if long_line:
      f.write(json.dumps({"prompt": "x" * long_line, "id": n}) + "\n")
  return str(path)
