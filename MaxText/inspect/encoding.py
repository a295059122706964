"""A prompt as the model reads it, with what an analyzer selects positions by: `Encoding`.

  ids          the token ids the forward runs (image / audio placeholders expanded)
  text         the rendered text (a chat's template output; the prompt itself otherwise)
  offsets      per token (start, end) in `text` (the tokenizer's offsets), None for tokens the
               text does not hold (a bos the tokenizer adds, image / audio soft tokens)
  tokens       per token its text: text[start:end], else the token decoded alone
  token_types  per token 0 text, 1 image, 2 video, 3 audio (`type_names()`: their names)
  image_grids  each image's patch grid (rows, columns) before pooling, in order
  spans        the chat's turns: Span(role, message index, first token, end token) covering the
               message's text as the template wrote it (role headers excluded; of a message with
               parts, from its first text part to its last; its images are `select(kind=...)`)

`select(role=...)` / `select(kind=...)` give a boolean mask over positions ("the assistant's
tokens", "the image tokens"). A Trace of an encoded prompt carries its Encoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from MaxText.data.multimodal import prompts as media_prompts
from MaxText.data.tokenizers import HFTokenizer, token_label
from MaxText.inference import InferenceModel, Prepared
from MaxText.inspect.trace import TOKEN_TYPES


@dataclass(frozen=True)
class Span:
  role: str
  message: int      # index in the messages
  start: int        # first token
  end: int          # one past the last token


@dataclass
class Encoding:
  ids: list[int]
  text: str
  offsets: list[tuple[int, int] | None]
  tokens: list[str]
  token_types: np.ndarray
  image_grids: list[tuple[int, int]] = field(default_factory=list)
  spans: list[Span] = field(default_factory=list)

  def __len__(self) -> int:
    return len(self.ids)

  def type_names(self) -> np.ndarray:
    return np.asarray(TOKEN_TYPES, dtype=object)[self.token_types]

  def select(self, role: str | None = None, kind: str | None = None) -> np.ndarray:
    """A [len] boolean mask: the tokens of every turn of `role` and/or of type `kind`."""
    mask = np.ones(len(self.ids), bool)
    if role is not None:
      by_role = np.zeros(len(self.ids), bool)
      for s in self.spans:
        if s.role == role:
          by_role[s.start:s.end] = True
      mask &= by_role
    if kind is not None:
      if kind not in TOKEN_TYPES:
        raise ValueError(f"kind={kind!r}: one of {TOKEN_TYPES}")
      mask &= self.token_types == TOKEN_TYPES.index(kind)
    return mask


def align(text_ids: Sequence[int], text_offsets: Sequence[tuple[int, int]],
          ids: Sequence[int]) -> list[tuple[int, int] | None]:
  """Offsets for `ids` (the text's ids with tokens inserted: a bos, expanded placeholders): each
  text token keeps its offsets, in order; an inserted token has None."""
  out: list[tuple[int, int] | None] = []
  i = 0
  for t in ids:
    if i < len(text_ids) and int(t) == int(text_ids[i]):
      lo, hi = text_offsets[i]
      out.append((lo, hi))
      i += 1
    else:
      out.append(None)
  if i != len(text_ids):
    raise ValueError(f"the prompt's ids do not hold its text's {len(text_ids)} tokens in order "
                     f"(matched {i})")
  return out


def _texts(content: Any) -> list[str]:
  """A message's text: its content string, or the text of its parts."""
  if isinstance(content, str):
    return [content]
  if isinstance(content, (list, tuple)):
    return [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
  return []


def message_spans(messages: Sequence[dict], text: str,
                  offsets: Sequence[tuple[int, int] | None]) -> list[Span]:
  """Each message's content located in the rendered `text`, in order (templates write the
  messages in order), as the token range of the tokens overlapping it; a message whose content
  the template did not write verbatim (nor stripped) has no span."""
  spans, cursor = [], 0
  starts = np.asarray([o[0] if o is not None else -1 for o in offsets])
  ends = np.asarray([o[1] if o is not None else -1 for o in offsets])
  for i, m in enumerate(messages):
    pieces = [p for p in _texts(m.get("content")) if p]
    found = []
    for p in pieces:
      at = text.find(p, cursor)
      if at < 0 and p.strip():
        p = p.strip()
        at = text.find(p, cursor)
      if at < 0:
        found = []
        break
      found.append((at, at + len(p)))
      cursor = at + len(p)
    if not found:
      continue
    a, b = found[0][0], found[-1][1]
    hit = np.nonzero((starts < b) & (ends > a) & (ends > starts))[0]
    if len(hit):
      spans.append(Span(str(m.get("role")), i, int(hit[0]), int(hit[-1]) + 1))
  return spans


def encode(inf: InferenceModel, prompt: Any, *, images=None, audio=None, chat: bool | None = None,
           tools=None, template_kwargs=None, tensors=None) -> tuple[Encoding, Prepared]:
  """(the Encoding of one prompt, the Prepared the model runs: ids, media tensors)."""
  if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
    prompt = {"messages": list(prompt)}
  if isinstance(prompt, dict) and "messages" in prompt and (tools or template_kwargs):
    prompt = {**prompt, "tools": tools, "chat_template_kwargs": template_kwargs}
  prepared = inf.prepare([prompt], images=images, audio=audio, chat=chat, **(tensors or {}))
  ids = prepared.ids[0]
  chat = inf.cfg.chat if chat is None else chat
  messages = None
  if isinstance(prompt, dict) and "messages" in prompt:
    messages = prompt["messages"]
    text = inf.chat_text(messages, *inf.chat_options(prompt))
  elif isinstance(prompt, dict) and "prompt" in prompt or isinstance(prompt, str):
    text = prompt if isinstance(prompt, str) else prompt["prompt"]
    if chat:
      messages = media_prompts.user_message(
          text, media_prompts.per_prompt(images, 1, "images")[0],
          media_prompts.per_prompt(audio, 1, "audio")[0])
      text = inf.chat_text(messages)
  else:
    text = inf.text(ids) or ""
  tok = inf.tokenizer
  from_text = not (isinstance(prompt, (list, tuple, np.ndarray)) or
                   isinstance(prompt, dict) and "prompt_ids" in prompt)
  offsets: list = [None] * len(ids)
  if isinstance(tok, HFTokenizer) and text and from_text:
    encoded = tok.impl.encode(text, add_special_tokens=False)
    offsets = align(encoded.ids, encoded.offsets, ids)
  tokens = [text[o[0]:o[1]] if o is not None else token_text(tok, t)
            for o, t in zip(offsets, ids)]
  types = np.asarray(prepared.mm_token_type_ids[0] if prepared.mm_token_type_ids
                     else np.zeros(len(ids)), np.int32)
  spans = message_spans(messages, text, offsets) if messages else []
  grids = [(rows, cols) for rows, cols in prepared.image_grids[0]] if prepared.image_grids else []
  return Encoding(list(ids), text, offsets, tokens, types, grids, spans), prepared


def token_text(tok, t: int) -> str:
  """A token's own text (special tokens by name), `<id>` without a tokenizer
  (tokenizers.token_label)."""
  return token_label(tok, t)
