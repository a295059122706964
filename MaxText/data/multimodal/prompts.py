"""Where a prompt's images and clips go, before the processor expands them
(MaxText/data/multimodal/processor.py):

  - chat messages: each {"type": "image"} / {"type": "audio"} content part is one, in order (its
    "image" / "audio" / "url" / "path" the source; a part without one takes the next of the
    images / clips given with the prompt); the chat template writes its placeholder token;
  - a text prompt rendered as chat (chat=true): one user message, its images, then its clips,
    then the text;
  - a text prompt or token ids: where they hold the placeholder tokens (one per image / clip),
    else the images' and then the clips' placeholders go first (after the bos token).
Media given with a call are per prompt: a list of lists, or, for a call of one prompt, its list
(or one image / clip).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Sequence

import numpy as np

from MaxText.data.errors import DataError
from MaxText.data.multimodal.processor import media_of_messages

TENSOR_NAMES = {"image": ("pixel_values", "image_position_ids"),
                "audio": ("input_features", "input_features_mask")}
# the processor's other tensors: the prompts themselves, checked against the ids the model runs
PROMPT_TENSORS = ("input_ids", "attention_mask", "mm_token_type_ids")


def _is_one(x: Any) -> bool:
  """An image or a clip (not a list of them)."""
  return isinstance(x, (str, os.PathLike, np.ndarray)) or hasattr(x, "getbands")


def per_prompt(value: Any, n: int, what: str) -> list[list[Any]]:
  """`value` (images or clips of a call of `n` prompts; module docstring) as one list per prompt."""
  if value is None:
    return [[] for _ in range(n)]
  if _is_one(value):
    value = [value]
  if not isinstance(value, (list, tuple)):
    raise DataError(f"{what}: expected a list, got {type(value).__name__}")
  if all(isinstance(v, (list, tuple)) for v in value) and value:
    if len(value) != n:
      raise DataError(f"{what}: {len(value)} lists for {n} prompts")
    return [list(v) for v in value]
  if n != 1:
    raise DataError(f"{what}: with {n} prompts give one list per prompt")
  return [list(value)]


def fill_messages(messages: Sequence[dict], images: list, clips: list
                  ) -> tuple[Sequence[dict], list, list]:
  """(the messages with each source-less image / audio part given the next of `images` / `clips`,
  the images, the clips in order); DataError when the counts do not match."""
  found_images, found_clips = media_of_messages(messages)
  given = {"image": list(images), "audio": list(clips)}
  for kind, found in (("image", found_images), ("audio", found_clips)):
    empty = sum(1 for f in found if f is None)
    if empty != len(given[kind]):
      raise DataError(f"the messages hold {empty} {kind} part(s) without a source but "
                      f"{len(given[kind])} {kind} input(s) came with them")
  if not (images or clips):
    return messages, found_images, found_clips
  out = copy.copy(list(messages))
  pending = {k: iter(v) for k, v in given.items()}
  for i, message in enumerate(out):
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, (list, tuple)):
      continue
    parts = []
    for part in content:
      kind = part.get("type") if isinstance(part, dict) else None
      if kind in given and not any(k in part for k in ("image", "audio", "url", "path",
                                                       "base64")):
        part = {**part, kind: next(pending[kind])}
      parts.append(part)
    out[i] = {**message, "content": parts}
  found_images, found_clips = media_of_messages(out)
  return out, found_images, found_clips


def user_message(text: str, images: list, clips: list) -> list[dict]:
  """A text prompt with media as one chat message (module docstring)."""
  if not (images or clips):
    return [{"role": "user", "content": text}]
  parts = [{"type": "image", "image": m} for m in images]
  parts += [{"type": "audio", "audio": m} for m in clips]
  return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def with_placeholders(ids: list[int], n_images: int, n_clips: int, image_id: int | None,
                      audio_id: int | None, bos_id: int | None) -> list[int]:
  """`ids`, with the placeholders of its media put first (after bos) when it holds none."""
  if any(t is not None and t in ids for t in (image_id, audio_id)):
    return ids
  lead = [t for t, n in ((image_id, n_images), (audio_id, n_clips)) if t is not None
          for _ in range(n)]
  if not lead:
    return ids
  start = 1 if ids and bos_id is not None and ids[0] == bos_id else 0
  return [*ids[:start], *lead, *ids[start:]]


def split_tensors(tensors: dict[str, np.ndarray], ids: Sequence[Sequence[int]],
                  counts: dict[str, list[int]], token_ids: dict[str, int | None]
                  ) -> list[dict[str, np.ndarray]]:
  """The processor's own tensors of a call (transformers' names, images and clips in prompt
  order) cut per prompt: each prompt takes the next images (clips) whose soft tokens (`counts`)
  add up to its image (audio) tokens. DataError when they do not."""
  out: list[dict[str, np.ndarray]] = [{} for _ in ids]
  for kind, names in TENSOR_NAMES.items():
    given = [n for n in names if n in tensors]
    if not given:
      continue
    if len(given) != 2:
      raise DataError(f"{' and '.join(names)} come together (got only {given[0]})")
    soft, start = counts[kind], 0
    token = token_ids[kind]
    for row, prompt in enumerate(ids):
      want = list(prompt).count(token) if token is not None else 0
      take, total = 0, 0
      while total < want and start + take < len(soft):
        total += soft[start + take]
        take += 1
      if total != want:
        raise DataError(f"prompt {row} holds {want} {kind} tokens but the {kind} tensors give "
                        f"{total} soft tokens to it (soft tokens per {kind}: {soft})")
      if take:
        out[row].update({n: np.asarray(tensors[n])[start:start + take] for n in names})
      start += take
    if start != len(soft):
      raise DataError(f"{len(soft) - start} {kind} input(s) of the tensors are left over: the "
                      f"prompts hold fewer {kind} tokens")
  return out


def prompt_rows(given: dict[str, Any]) -> list[list[int]]:
  """The rows of the processor's `input_ids`, each without its padding (`attention_mask` 0)."""
  ids = np.atleast_2d(np.asarray(given["input_ids"]))
  mask = np.atleast_2d(np.asarray(given.get("attention_mask", np.ones(ids.shape, np.int64))))
  if mask.shape != ids.shape:
    raise DataError(f"attention_mask has shape {list(mask.shape)} but input_ids "
                    f"{list(ids.shape)}")
  return [[int(t) for t, m in zip(row, keep) if m] for row, keep in zip(ids, mask)]


def check_prompt_tensors(given: dict[str, Any], ids: Sequence[Sequence[int]],
                         types: Sequence[Sequence[int]] | None) -> None:
  """The processor's `input_ids`, `attention_mask` and `mm_token_type_ids` (`given`, [B, S] or
  [S], padding where `attention_mask` is 0) against the prompts the model runs: `ids` (expanded)
  and their `types` (transformers' mm_token_type_ids; None: text only, all 0). DataError naming
  the tensor and row that differ."""
  shapes = {n: np.atleast_2d(np.asarray(v)).shape for n, v in given.items()}
  for name, shape in shapes.items():
    if len(shape) != 2 or shape[0] != len(ids):
      raise DataError(f"{name} has shape {list(shape)}: {len(ids)} row(s) expected, one per "
                      "prompt")
  if len(set(shapes.values())) > 1:
    raise DataError(f"the processor's tensors differ in shape: {shapes}")
  width = next(iter(shapes.values()))[1]
  mask = np.atleast_2d(np.asarray(given.get("attention_mask", np.ones((len(ids), width)))))
  for i, row in enumerate(ids):
    keep = mask[i].astype(bool)
    if int(keep.sum()) != len(row):
      raise DataError(f"attention_mask row {i} keeps {int(keep.sum())} positions but prompt {i} "
                      f"is {len(row)} tokens")
    want = {"input_ids": list(row),
            "mm_token_type_ids": list(types[i]) if types is not None else [0] * len(row)}
    for name, expected in want.items():
      if name in given:
        got = [int(t) for t in np.atleast_2d(np.asarray(given[name]))[i][keep]]
        if got != expected:
          at = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
          raise DataError(f"{name} row {i} differs from prompt {i} at position {at} ({got[at]}, "
                          f"the prompt's ids give {expected[at]})")
