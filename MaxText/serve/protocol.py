"""The OpenAI API's request bodies (completions, chat completions) as pydantic models, and their
checks against the served model.

A field of the wrong type, out of range or unknown is refused by pydantic (422, the field's path
named: MaxText/serve/errors.py); a request that is well formed but cannot run on this model (an
unknown model name: 404; an empty prompt, token ids outside the vocabulary, a prompt plus
max_tokens beyond a slot's cache, n x max_tokens beyond `serve_max_tokens`, a penalty we do not
implement set away from 0, an image or audio part that is not a base64 data URL) is refused with
400 naming the field.
Defaults are the OpenAI API's: max_tokens 16 (completions; chat: what the cache leaves),
temperature 1, top_p 1, n 1; top_k (0 = off) and min_p (0 = off) are vLLM's extensions, as
`chat_template_kwargs` (variables of the chat template, as `tools`).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from MaxText.serve import media
from MaxText.serve.errors import ApiError

TOP_LOGPROBS_MAX = 20
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt")


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid")
  include_usage: bool = False


class Sampled(BaseModel):
  """What completions and chat completions share."""
  model_config = ConfigDict(extra="forbid")
  model: StrictStr
  temperature: float = Field(1.0, ge=0)
  top_p: float = Field(1.0, gt=0, le=1)
  top_k: int = Field(0, ge=-1)                 # -1 / 0: off
  min_p: float = Field(0.0, ge=0, le=1)
  n: int = Field(1, ge=1)
  stop: Union[StrictStr, list[StrictStr], None] = None
  seed: Union[StrictInt, None] = None
  stream: bool = False
  stream_options: Union[StreamOptions, None] = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  user: Union[StrictStr, None] = None

  def stops(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

  def check_penalties(self) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(self, name):
        raise ApiError(400, f"{name}={getattr(self, name)}: penalties are not implemented; "
                       f"leave it 0", name)


class CompletionRequest(Sampled):
  prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
  max_tokens: Union[int, None] = Field(16, ge=0)
  logprobs: Union[int, None] = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
  echo: bool = False

  def prompts(self) -> list[str | list[int]]:
    p = self.prompt
    if isinstance(p, str):
      return [p]
    if not p:
      raise ApiError(400, "prompt is an empty list", "prompt")
    if all(isinstance(x, int) for x in p):
      return [list(p)]          # type: ignore[arg-type]  (a list of ints: one prompt of ids)
    return list(p)              # type: ignore[arg-type]


class TextPart(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["text"]
  text: StrictStr


class Message(BaseModel):
  model_config = ConfigDict(extra="allow")     # tool_calls, name, tool_call_id: the template's
  role: StrictStr
  content: Union[StrictStr, list[dict[str, Any]], None] = None


class ChatRequest(Sampled):
  messages: list[Message] = Field(min_length=1)
  max_tokens: Union[int, None] = Field(None, ge=1)
  max_completion_tokens: Union[int, None] = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: Union[int, None] = Field(None, ge=0, le=TOP_LOGPROBS_MAX)
  tools: Union[list[dict[str, Any]], None] = None
  tool_choice: Union[StrictStr, dict[str, Any], None] = None
  chat_template_kwargs: Union[dict[str, Any], None] = None

  def template_messages(self, sampling_rate: int | None = None) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: text parts joined (a message with an image
    or audio part keeps its parts, each decoded from its base64 data URL: MaxText/serve/media.py,
    `sampling_rate` the feature extractor's)."""
    out = []
    for i, m in enumerate(self.messages):
      d = m.model_dump(exclude_none=True)
      if isinstance(m.content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(m.content):
          kind, field = part.get("type"), f"messages[{i}].content[{j}]"
          if kind in media.KINDS:
            parts.append(media.media_part(part, field, sampling_rate))
            continue
          if kind != "text":
            raise ApiError(400, f"{field}.type={kind!r}: text, image_url, input_audio or "
                           f"audio_url", f"{field}.type")
          if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{field}.text must be a string", f"{field}.text")
          parts.append({"type": "text", "text": part["text"]})
        d["content"] = parts if any(p["type"] != "text" for p in parts) else \
            "".join(p["text"] for p in parts)
      out.append(d)
    return out

  def has_media(self) -> bool:
    return any(isinstance(m.content, list) and any(p.get("type") in media.KINDS for p in m.content)
               for m in self.messages)

  def template_variables(self) -> dict[str, Any]:
    """`tools`, `tool_choice` and `chat_template_kwargs` as the template's variables."""
    extra = dict(self.chat_template_kwargs or {})
    for name in RESERVED_TEMPLATE_VARIABLES:
      if name in extra:
        raise ApiError(400, f"chat_template_kwargs.{name}: set by the server",
                       f"chat_template_kwargs.{name}")
    if self.tools is not None:
      extra["tools"] = self.tools
    if self.tool_choice is not None:
      extra["tool_choice"] = self.tool_choice
    return extra

  def new_tokens(self) -> int | None:
    return self.max_completion_tokens or self.max_tokens


def check_prompt(ids: list[int], index: int, vocab: int, room: int, max_tokens: int,
                 field: str) -> None:
  """400 naming `field` when prompt `index` cannot run: empty, ids outside the vocabulary, or
  with `max_tokens` beyond a slot's `room` positions."""
  if not ids:
    raise ApiError(400, f"{field} {index} is empty", field)
  bad = [t for t in ids if not 0 <= t < vocab]
  if bad:
    raise ApiError(400, f"{field} {index} holds token ids outside the vocabulary [0, {vocab}): "
                   f"{bad[:5]}", field)
  if len(ids) >= room:
    raise ApiError(400, f"{field} {index} has {len(ids)} tokens; a slot holds {room} positions "
                   f"(max_cache_length), which must exceed the prompt", field)
  if len(ids) + max_tokens > room:
    raise ApiError(400, f"max_tokens={max_tokens}: prompt {index} ({len(ids)} tokens) + "
                   f"max_tokens overflow a slot's {room} positions; at most "
                   f"{room - len(ids)}", "max_tokens")
