"""Pictures of a Trace (matplotlib, Agg: no display needed), written as PNG files:

  attention_layer{l}.png   one heatmap per head of layer l's attention probabilities (the heads
                           wrapped into a grid of up to 4 columns, one colour bar for all), query
                           tokens down, key tokens across, labelled with the tokens' text; each
                           image's (audio clip's) soft tokens framed in red (orange) on both axes
  logit_lens.png           the logit lens: for each hidden state (rows: the embeddings, then each
                           layer's output) and position (columns), the top next token under the
                           model's final norm and head, coloured by its probability

Token labels show their spaces (`␣the` is " the", not "the") and escape what no font draws
(`\n`, `\x00`). The layout is matplotlib's constrained layout, which makes room for the titles,
the tick labels and the colour bar instead of clipping them.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Sequence, cast

import numpy as np

from MaxText.data.printable import visible_spaces

if TYPE_CHECKING:
  from matplotlib.axes import Axes

LABEL_SIZE = 9     # points: tick labels and the logit lens's cells
SPAN_COLOURS = {1: ("image", "red"), 3: ("audio", "orange")}    # by mm_token_type_ids


def media_spans(mm_token_type_ids: Sequence[int] | None) -> list[tuple[int, int, int]]:
  """(type id, first, last + 1) of each run of image / audio soft tokens."""
  spans: list[tuple[int, int, int]] = []
  for i, t in enumerate([] if mm_token_type_ids is None else list(map(int, mm_token_type_ids))):
    if t in SPAN_COLOURS and spans and spans[-1][0] == t and spans[-1][2] == i:
      spans[-1] = (t, spans[-1][1], i + 1)
    elif t in SPAN_COLOURS:
      spans.append((t, i, i + 1))
  return spans

def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def attention_heatmaps(attentions: Sequence, layers: Sequence[int], labels: Sequence[str],
                       folder: str, heads: Sequence[int] | None = None,
                       mm_token_type_ids: Sequence[int] | None = None) -> list[str]:
  """One PNG per captured layer (entries None are skipped); returns the paths written.
  `mm_token_type_ids`: the image / audio spans to frame."""
  plt = _pyplot()
  paths = []
  for layer, a_HSS in zip(layers, attentions):
    if a_HSS is None:
      continue
    fig = attention_figure(a_HSS, layer, labels, heads, media_spans(mm_token_type_ids))
    path = os.path.join(folder, f"attention_layer{layer}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths


def attention_figure(a_HSS: np.ndarray, layer: int, labels: Sequence[str],
                     heads: Sequence[int] | None = None,
                     spans: Sequence[tuple[int, int, int]] = ()):
  """The figure of one layer's heads: a grid of heatmaps and one colour bar; `spans` (type id,
  first, end) framed on both axes."""
  plt = _pyplot()
  labels = [visible_spaces(t) for t in labels]
  H, S = a_HSS.shape[0], a_HSS.shape[1]
  names = list(heads) if heads is not None else list(range(H))
  cols = min(H, 4)
  rows = math.ceil(H / cols)
  size = max(3.0, 0.22 * S + 1.2)    # inches per heatmap: room for S labels of LABEL_SIZE
  fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 1.0, size * rows + 0.6),
                           squeeze=False, layout="constrained")
  image = None
  for h in range(rows * cols):
    ax = cast("Axes", axes[h // cols][h % cols])   # (squeeze=False: a 2-D array of Axes)
    if h >= H:
      ax.axis("off")
      continue
    image = ax.imshow(a_HSS[h], vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_title(f"head {names[h]}")
    ax.set_xticks(range(S), labels, rotation=90, fontsize=LABEL_SIZE)
    ax.set_yticks(range(S), labels, fontsize=LABEL_SIZE)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    for t, first, end in spans:
      colour = SPAN_COLOURS[t][1]
      ax.axvspan(first - 0.5, end - 0.5, fill=False, edgecolor=colour, linewidth=1.5)
      ax.axhspan(first - 0.5, end - 0.5, fill=False, edgecolor=colour, linewidth=1.5)
  kinds = sorted({t for t, _, _ in spans})
  framed = "; " + ", ".join(f"{SPAN_COLOURS[t][1]}: {SPAN_COLOURS[t][0]} tokens"
                             for t in kinds) if kinds else ""
  fig.suptitle(f"layer {layer}: attention probabilities (row: query token, column: key "
               f"token{framed})")
  if image is None:
    raise ValueError(f"layer {layer}: no attention heads to plot")
  fig.colorbar(image, ax=axes.ravel().tolist(), label="attention probability", shrink=0.8)
  return fig


def logit_lens(probs_NSV: np.ndarray, row_names: Sequence[str], labels: Sequence[str],
               vocab_text, folder: str) -> str:
  """`probs_NSV`: next-token probabilities of each lens row (hidden state) and position;
  `vocab_text(ids)` gives the tokens' text."""
  plt = _pyplot()
  fig = logit_lens_figure(probs_NSV, row_names, labels, vocab_text)
  path = os.path.join(folder, "logit_lens.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def logit_lens_figure(probs_NSV: np.ndarray, row_names: Sequence[str], labels: Sequence[str],
                      vocab_text):
  plt = _pyplot()
  N, S, _ = probs_NSV.shape
  top_NS = probs_NSV.argmax(-1)
  p_NS = np.take_along_axis(probs_NSV, top_NS[..., None], -1)[..., 0]
  text = [[visible_spaces(t) for t in vocab_text(list(row))] for row in top_NS]
  labels = [visible_spaces(t) for t in labels]
  width = max(max(map(len, labels), default=1), max((len(t[:8]) for r in text for t in r),
                                                      default=1))
  fig, ax = plt.subplots(figsize=(max(5.0, (0.12 * width + 0.4) * S + 3), max(3.0, 0.5 * N + 2)),
                         layout="constrained")
  image = ax.imshow(p_NS, vmin=0.0, vmax=1.0, cmap="Blues", aspect="auto")
  for n in range(N):
    for s in range(S):
      ax.text(s, n, text[n][s][:8], ha="center", va="center", fontsize=LABEL_SIZE,
              color="white" if p_NS[n, s] > 0.6 else "black")
  ax.set_xticks(range(S), labels, rotation=90, fontsize=LABEL_SIZE)
  ax.set_yticks(range(N), row_names, fontsize=LABEL_SIZE)
  ax.set_xlabel("input token (the prediction is for the next one)")
  ax.set_title("logit lens: top next token and its probability (␣ is a space)")
  fig.colorbar(image, ax=ax, label="probability")
  return fig
