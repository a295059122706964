"""DPO's preference pairs: a .jsonl file read and tokenized once, each pair as two padded rows
(prompt + chosen, prompt + rejected) whose loss mask is the response's tokens, and the pairs of
each step chosen as a function of (seed, step) only — a resumed run takes the same pairs with
nothing saved (the order of MaxText/rl/prompts.py: epoch e visits the pairs in the permutation
seeded by (seed, e)).

A line is {"prompt": ..., "chosen": ..., "rejected": ...}:
  * text: the prompt's tokens (the tokenizer's bos first when `add_bos`), then the response's and
    the tokenizer's eos (tokenized on their own, as TRL tokenizes prompt and completion);
  * chat (TRL's conversational format): `prompt` a list of messages (or a string: one user
    message), `chosen` / `rejected` lists of assistant messages (or strings: one each); the
    conversation prompt + response is rendered with the tokenizer's chat template (or
    `chat_template_path`) as SFT renders it (MaxText/data/sft.py) and the response's assistant
    tokens (with the template's end of turn) are the loss mask.
The rows of a pair are one sequence each (padded to max_target_length), or with `packed` one row
holding both (`preference_packing`): prompt + chosen as segment 1, prompt + rejected as segment 2
(positions restart; attention stays within a segment), half the rows when the pair fits
max_target_length. A line that is no JSON object, lacks `prompt`, `chosen` or `rejected`, or whose
prompt + response (packed: both sequences together) does not fit is a DataError naming the file,
the line and the field (exit 3).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from MaxText.data import sft
from MaxText.data.errors import DataError
from MaxText.rl.prompts import epoch_order

FIELDS = ("prompt", "chosen", "rejected")
ROW_KEYS = ("inputs", "targets", "positions", "segments", "mask", "real")
TOKEN_KEYS = ("inputs", "targets", "positions", "segments")
SIDES = ("chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class PreferenceSet:
  """The pairs of a file as [P, S] arrays per side ("chosen", "rejected"): inputs, targets,
  positions, segments (1 on the sequence's tokens), mask (1 on the response's targets), real (1 on
  every target of the sequence: ORPO's cross-entropy). Packed: the token arrays under "packed"
  (both sequences of a pair in one row) and per side only mask and real, over that row."""
  path: str
  lines: list[int]
  sides: dict[str, dict[str, np.ndarray]]

  def __len__(self) -> int:
    return len(self.lines)

  def for_step(self, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of the pairs of step `step` (1-based)."""
    n = len(self.lines)
    return [int(epoch_order(n, seed, k // n)[k % n])
            for k in range((step - 1) * per_step, step * per_step)]

  def take(self, idx: list[int]) -> dict[str, dict[str, np.ndarray]]:
    return {side: {k: v[idx] for k, v in arrays.items()} for side, arrays in self.sides.items()}


class Encoder:
  """Tokenizes a row's (prompt, response) into (token ids, response mask)."""

  def __init__(self, tokenizer: Any, add_bos: bool, chat_format_fn):
    self.tokenizer, self.add_bos = tokenizer, add_bos
    self._chat_format_fn, self._fmt = chat_format_fn, None

  def chat_format(self) -> sft.ChatFormat:
    if self._fmt is None:
      self._fmt = self._chat_format_fn()
    return self._fmt

  def text(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
    tok = self.tokenizer
    bos = [tok.bos_id] if self.add_bos and tok.bos_id is not None else []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    p, r = bos + list(tok.encode(prompt)), list(tok.encode(response)) + eos
    return p + r, [0] * len(p) + [1] * len(r)

  def chat(self, prompt: list[dict], response: list[dict]) -> tuple[list[int], list[int]]:
    fmt = self.chat_format()
    messages = sft.messages_of({"messages": [*prompt, *response]})
    text, spans = fmt.render_with_spans(messages)
    before = sum(m["role"] == "assistant" for m in prompt)   # the prompt's own assistant turns
    enc = self.tokenizer.impl.encode(text, add_special_tokens=False)
    mask = sft.assistant_token_mask(enc.offsets, spans[before:], len(text))
    return list(enc.ids), [int(m) for m in mask]

  def pair_side(self, row: dict, side: str) -> tuple[list[int], list[int]]:
    prompt, response = row["prompt"], row[side]
    if isinstance(prompt, str) and isinstance(response, str):
      return self.text(prompt, response)
    as_list = lambda x, role: [{"role": role, "content": x}] if isinstance(x, str) else x
    prompt, response = as_list(prompt, "user"), as_list(response, "assistant")
    if not isinstance(prompt, list) or not isinstance(response, list):
      raise DataError("prompt and responses must be text or lists of chat messages")
    if not response or any(not isinstance(m, dict) or m.get("role") != "assistant"
                           for m in response):
      raise DataError(f"`{side}` must hold assistant messages only")
    return self.chat(prompt, response)


def row_arrays(ids: list[int], mask: list[int], seq: int, pad_id: int) -> dict[str, np.ndarray]:
  """One sequence → a padded row: inputs ids[:-1], targets ids[1:], the response's targets in
  `mask`, every target in `real`."""
  n = len(ids) - 1
  out: dict[str, np.ndarray] = {k: np.zeros(seq, np.int32)
                                for k in ("inputs", "targets", "positions", "segments")}
  out["inputs"][:] = pad_id
  out["targets"][:] = pad_id
  out["inputs"][:n], out["targets"][:n] = ids[:-1], ids[1:]
  out["positions"][:n] = np.arange(n)
  out["segments"][:n] = 1
  out["mask"] = np.zeros(seq, np.float32)
  out["mask"][:n] = mask[1:]
  out["real"] = out["segments"].astype(np.float32)
  return out


def packed_row(chosen: dict[str, np.ndarray], rejected: dict[str, np.ndarray], seq: int,
               pad_id: int) -> dict[str, dict[str, np.ndarray]]:
  """A pair's two padded rows (`row_arrays`) → one row, chosen's targets first (segment 1), then
  rejected's (segment 2, positions from 0): {"packed": token arrays, "chosen": {mask, real},
  "rejected": {mask, real}} with the sides' masks over the packed row."""
  nc, nr = int(chosen["segments"].sum()), int(rejected["segments"].sum())
  out = {k: np.zeros(seq, np.int32) for k in TOKEN_KEYS}
  out["inputs"][:] = pad_id
  out["targets"][:] = pad_id
  sides = {s: {k: np.zeros(seq, np.float32) for k in ("mask", "real")} for s in SIDES}
  for (start, n), row, side, seg in (((0, nc), chosen, "chosen", 1),
                                     ((nc, nr), rejected, "rejected", 2)):
    for k in ("inputs", "targets", "positions"):
      out[k][start:start + n] = row[k][:n]
    out["segments"][start:start + n] = seg
    for k in ("mask", "real"):
      sides[side][k][start:start + n] = row[k][:n]
  return {"packed": out, **sides}


def read_preferences(path: str, key: str, encoder: Encoder, seq: int, pad_id: int,
                     packed: bool = False) -> PreferenceSet:
  """Reads and tokenizes `path` (config key `key`); DataError naming the line and the field.
  `packed`: both sequences of a pair in one row (module docstring)."""
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise DataError(f"{key}={path}: no such file")
  lines, sides, rows = [], {"chosen": [], "rejected": []}, []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{key}={path} line {n}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e})") from None
      if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
      for field in FIELDS:
        if field not in row or row[field] in (None, "", []):
          raise DataError(f"{where}: missing field `{field}` (a preference row holds "
                          f"{', '.join(FIELDS)}; it has {', '.join(sorted(map(str, row)))})")
      for side in sides:
        try:
          ids, mask = encoder.pair_side(row, side)
        except DataError as e:
          raise DataError(f"{where}, field `{side}`: {e}") from None
        if len(ids) - 1 > seq:
          raise DataError(f"{where}, field `{side}`: prompt + response are {len(ids)} tokens, more "
                          f"than max_target_length + 1 = {seq + 1}; raise max_target_length or "
                          "shorten the row")
        if not any(mask[1:]):
          raise DataError(f"{where}, field `{side}`: the response has no token")
        sides[side].append(row_arrays(ids, mask, seq, pad_id))
      if packed:
        c, r = sides["chosen"].pop(), sides["rejected"].pop()
        total = int(c["segments"].sum() + r["segments"].sum())
        if total > seq:
          raise DataError(f"{where}: packed, prompt + chosen and prompt + rejected are {total} "
                          f"positions, more than max_target_length = {seq}; raise "
                          "max_target_length or set preference_packing=false")
        rows.append(packed_row(c, r, seq, pad_id))
      lines.append(n)
  if not lines:
    raise DataError(f"{key}={path}: no preference pairs in the file")
  if packed:
    stacked = {part: {k: np.stack([r[part][k] for r in rows]) for k in rows[0][part]}
               for part in ("packed", *SIDES)}
  else:
    stacked = {side: {k: np.stack([r[k] for r in rows_]) for k in ROW_KEYS}
               for side, rows_ in sides.items()}
  return PreferenceSet(path, lines, stacked)
