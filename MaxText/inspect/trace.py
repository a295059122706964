"""The result of an inspected forward pass: NumPy arrays only (no JAX, no torch), the layout of
transformers' `output_hidden_states=True, output_attentions=True`.

  tokens            [S] token ids ([B, S] for a batch; rows right-padded, see `lengths`)
  hidden_states     L + 1 entries [S, D]: entry 0 the embedding output (the first layer's input),
                    entry i the output of layer i - 1, the last one after the final norm — as
                    transformers gives it (its `capture_outputs` replaces the last layer's output
                    with `last_hidden_state`, the same for Qwen3, Qwen3-MoE, Gemma 4, Qwen3-Next);
                    None for entries not asked for (`layers=`), as transformers does for a subset
  attentions        one entry [H, S, S] per layer with softmax attention (`attention_layers`:
                    every layer, or only the full-attention layers of Qwen3-Next), probabilities
                    of the dot-product path; None where not asked for; H the heads asked for
  logits            [S, V] fp32
  sites             any other captured site by name ("resid_post.3", "mlp_out.0", ...)
  mm_token_type_ids with images or audio: [S] (or [B, S]) per position 0 text, 1 image, 2 video,
                    3 audio soft token, as transformers' processor gives them (`token_types()`:
                    their names); None for a text prompt
  image_grids       with images: each image's patch grid (rows, columns) before pooling, in
                    order (a list per row for a batch)
  encoding          a single prompt's `Encoding` (MaxText/inspect/encoding.py: text, token strings,
                    token types, chat turns), None for a batch of ids
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOKEN_TYPES = ("text", "image", "video", "audio")     # by mm_token_type_ids


@dataclass
class Trace:
  tokens: np.ndarray
  hidden_states: list | None = None
  attentions: list | None = None
  attention_layers: list[int] = field(default_factory=list)
  logits: np.ndarray | None = None
  sites: dict[str, np.ndarray] = field(default_factory=dict)
  lengths: np.ndarray | None = None          # batched: the real tokens of each row
  heads: tuple[int, ...] | None = None       # the heads of `attentions` (None: all)
  mm_token_type_ids: np.ndarray | None = None
  image_grids: list | None = None
  encoding: Any = None                       # encoding.Encoding of a single prompt

  def token_types(self) -> np.ndarray:
    """Each position's kind ("text", "image", "video", "audio"), shaped like `tokens`."""
    types = np.zeros(np.shape(self.tokens), np.int32) if self.mm_token_type_ids is None \
        else self.mm_token_type_ids
    return np.asarray(TOKEN_TYPES, dtype=object)[types]

  def arrays(self) -> dict[str, np.ndarray]:
    """The npz layout of the CLI: `token_ids`, `hidden_states` [L+1, S, D] (only the captured
    entries, then with `hidden_states_index`), `attentions_{l}` [H, S, S], `logits` [S, V],
    `mm_token_type_ids` [S] and `image_grids` [I, 2] with images or audio, and every other
    captured site under its name."""
    out = {"token_ids": self.tokens}
    if self.hidden_states is not None:
      index = [i for i, h in enumerate(self.hidden_states) if h is not None]
      out["hidden_states"] = np.stack([self.hidden_states[i] for i in index])
      if len(index) != len(self.hidden_states):
        out["hidden_states_index"] = np.asarray(index)
    for layer, a in zip(self.attention_layers, self.attentions or []):
      if a is not None:
        out[f"attentions_{layer}"] = a
    if self.logits is not None:
      out["logits"] = self.logits
    if self.lengths is not None:
      out["lengths"] = self.lengths
    if self.heads is not None:
      out["heads"] = np.asarray(self.heads)
    if self.mm_token_type_ids is not None:
      out["mm_token_type_ids"] = self.mm_token_type_ids
    if self.image_grids and not isinstance(self.image_grids[0], list):
      out["image_grids"] = np.asarray(self.image_grids, np.int64).reshape(-1, 2)
    out.update(self.sites)
    return out

  def save(self, path: str) -> None:
    np.savez(path, allow_pickle=False, **self.arrays())   # (numbers only: never a pickle)
