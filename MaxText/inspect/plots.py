"""Pictures of a Trace (matplotlib, Agg: no display needed), written as PNG files:

  attention_layer{l}.png   one heatmap per head of layer l's attention probabilities, query tokens
                           down, key tokens across, labelled with the tokens' text
  logit_lens.png           the logit lens: for each hidden state (rows: the embeddings, then each
                           layer's output) and position (columns), the top next token under the
                           model's final norm and head, coloured by its probability
"""
from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def printable(text: str) -> str:
  """A token's text as a label: control characters (and others no font draws) escaped."""
  return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def attention_heatmaps(attentions: Sequence, layers: Sequence[int], labels: Sequence[str],
                       folder: str, heads: Sequence[int] | None = None) -> list[str]:
  """One PNG per captured layer (entries None are skipped); returns the paths written."""
  plt = _pyplot()
  paths = []
  for layer, a_HSS in zip(layers, attentions):
    if a_HSS is None:
      continue
    H, S = a_HSS.shape[0], a_HSS.shape[1]
    labels = [printable(t) for t in labels]
    names = list(heads) if heads is not None else list(range(H))
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    size = max(3.0, 0.35 * S)
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for h in range(rows * cols):
      ax = axes[h // cols][h % cols]
      if h >= H:
        ax.axis("off")
        continue
      ax.imshow(a_HSS[h], vmin=0.0, vmax=1.0, cmap="viridis")
      ax.set_title(f"layer {layer} head {names[h]}")
      ax.set_xticks(range(S), labels, rotation=90, fontsize=7)
      ax.set_yticks(range(S), labels, fontsize=7)
      ax.set_xlabel("key")
      ax.set_ylabel("query")
    fig.tight_layout()
    path = os.path.join(folder, f"attention_layer{layer}.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths.append(path)
  return paths


def logit_lens(probs_NSV: np.ndarray, row_names: Sequence[str], labels: Sequence[str],
               vocab_text, folder: str) -> str:
  """`probs_NSV`: next-token probabilities of each lens row (hidden state) and position;
  `vocab_text(ids)` gives the tokens' text."""
  plt = _pyplot()
  N, S, _ = probs_NSV.shape
  top_NS = probs_NSV.argmax(-1)
  p_NS = np.take_along_axis(probs_NSV, top_NS[..., None], -1)[..., 0]
  text = [[printable(t) for t in vocab_text(list(row))] for row in top_NS]
  labels = [printable(t) for t in labels]
  fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * S + 2), max(3.0, 0.45 * N + 1.5)))
  image = ax.imshow(p_NS, vmin=0.0, vmax=1.0, cmap="Blues", aspect="auto")
  for n in range(N):
    for s in range(S):
      ax.text(s, n, text[n][s][:8], ha="center", va="center", fontsize=7,
              color="white" if p_NS[n, s] > 0.6 else "black")
  ax.set_xticks(range(S), labels, rotation=90, fontsize=7)
  ax.set_yticks(range(N), row_names, fontsize=7)
  ax.set_xlabel("input token (the prediction is for the next one)")
  ax.set_title("logit lens: top next token and its probability")
  fig.colorbar(image, ax=ax, label="probability")
  fig.tight_layout()
  path = os.path.join(folder, "logit_lens.png")
  fig.savefig(path, dpi=80)
  plt.close(fig)
  return path
