"""The OpenAI API's answers: a completion's or chat completion's choices gathered from the engine's
deltas (MaxText/serve/scheduler.py), whole or as server-sent-event chunks.

Completions' `logprobs` (when asked, `logprobs=k`): per token its text, its log-probability under
the model's unmodified distribution, the k most likely tokens there ({text: log-probability})
and the text offset; with `echo` the prompt's tokens come first (the first has none: nothing
precedes it). Chat's `logprobs`: per token {token, logprob, bytes, top_logprobs: [...]}.
finish_reason: "stop" (an eos id or a stop string) or "length" (max_tokens).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from MaxText.serve.scheduler import Delta


@dataclass
class Choice:
  """One choice as its deltas arrive."""
  index: int
  text: str = ""
  ids: list[int] = field(default_factory=list)
  logprobs: list[float] = field(default_factory=list)
  top: list[list[tuple[int, float]]] = field(default_factory=list)
  finish_reason: str | None = None
  prompt_logprobs: Any = None
  error: str = ""

  def add(self, d: Delta) -> None:
    self.text += d.text
    self.ids += d.ids
    self.logprobs += d.logprobs
    self.top += d.top
    if d.prompt_logprobs is not None:
      self.prompt_logprobs = d.prompt_logprobs
    if d.finish_reason is not None:
      self.finish_reason = d.finish_reason
      self.error = d.error


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: Any) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class Formatter:
  """Answers for one model; `piece(id)`: a token's text."""

  def __init__(self, model_name: str, piece: Callable[[int], str]):
    self.model_name, self.piece = model_name, piece

  # ---- completions -------------------------------------------------------------------------------
  def completion_logprobs(self, ids: list[int], logprobs: list[float | None],
                          top: list[list[tuple[int, float]] | None], k: int,
                          offset: int = 0) -> dict[str, Any]:
    tokens = [self.piece(t) for t in ids]
    offsets = []
    for t in tokens:
      offsets.append(offset)
      offset += len(t)
    tops: list[dict[str, float] | None] = []
    for row in top:
      if row is None:
        tops.append(None)
        continue
      d: dict[str, float] = {}
      for tid, lp in row[:k]:
        d.setdefault(self.piece(tid), lp)
      tops.append(d)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}

  def echo_part(self, c: Choice, prompt_ids: list[int], k: int | None):
    """(ids, logprobs, top) of the prompt for an echo with logprobs."""
    if k is None or c.prompt_logprobs is None:
      return [], [], []
    lps, top_ids, top_lps = c.prompt_logprobs
    top = [[(int(a), float(b)) for a, b in zip(top_ids[i], top_lps[i])] for i in range(len(lps))]
    return prompt_ids, [None, *(float(x) for x in lps)], [None, *top]

  def completion_choice(self, c: Choice, prompt_ids: list[int], prompt_text: str, echo: bool,
                        k: int | None) -> dict[str, Any]:
    text = (prompt_text if echo else "") + c.text
    logprobs = None
    if k is not None:
      ids, lps, top = self.echo_part(c, prompt_ids, k) if echo else ([], [], [])
      logprobs = self.completion_logprobs(
          [*ids, *c.ids], [*lps, *c.logprobs], [*top, *(c.top or [[]] * len(c.ids))], k)
    return {"index": c.index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason}

  def completion(self, rid: str, choices: list[dict], usage: dict) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": usage}

  # ---- chat --------------------------------------------------------------------------------------
  def chat_logprobs(self, ids: list[int], logprobs: list[float],
                    top: list[list[tuple[int, float]]], k: int) -> dict[str, Any]:
    entry = lambda t, lp: {"token": self.piece(t), "logprob": lp,
                           "bytes": list(self.piece(t).encode("utf-8"))}
    content = []
    for i, (t, lp) in enumerate(zip(ids, logprobs)):
      row = top[i] if i < len(top) else []
      content.append({**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in row[:k]]})
    return {"content": content}

  def chat_choice(self, c: Choice, logprobs: bool, k: int) -> dict[str, Any]:
    return {"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": self.chat_logprobs(c.ids, c.logprobs, c.top, k) if logprobs else None,
            "finish_reason": c.finish_reason}

  def chat(self, rid: str, choices: list[dict], usage: dict) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": usage}

  def chat_chunk(self, rid: str, index: int, delta: dict, finish_reason: str | None = None,
                 logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}

  def completion_chunk(self, rid: str, index: int, text: str, finish_reason: str | None = None,
                       logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}
