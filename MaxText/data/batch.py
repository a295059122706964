"""The batch contract: the arrays every training, evaluation and SFT row holds, declared once.

Each is int32 of length S = max_target_length (a batch: [rows, S]):

* ``inputs``               token ids fed to the model
* ``targets``              next-token labels: ``targets[i]`` follows ``inputs[i]`` in its document
* ``inputs_segmentation``  1, 2, 3, ... per document piece in the row; 0 for padding
* ``inputs_position``      position inside the document piece, restarting at 0 per piece
* ``targets_segmentation`` segment id of the target token; 0 = not in the loss (padding, or in
                           SFT a token outside the assistant turns)

Producers (`packing.py`, `sft.py`, `eval_data.py`) write exactly these keys; consumers (the train
step's shardings, evaluation) read them from here. SFT rows with images or audio also hold their
media slots (`media_rows.py`); `row_specs` gives every key a row holds with its shape and dtype.
"""
from __future__ import annotations

from typing import Any

import numpy as np

BATCH_KEYS = ("inputs", "targets", "inputs_segmentation", "inputs_position",
              "targets_segmentation")

# the media slots an SFT row with images / audio holds (media_rows.py), by transformers' names
MEDIA_KEYS = ("pixel_values", "image_position_ids", "input_features", "input_features_mask")


def row_specs(seq_len: int, media: dict[str, tuple[tuple[int, ...], Any]] | None = None
              ) -> dict[str, tuple[tuple[int, ...], Any]]:
  """{key: (per-row shape, dtype)}: the token arrays, then any media slots (MediaSlots.specs)."""
  return {**{k: ((seq_len,), np.int32) for k in BATCH_KEYS}, **(media or {})}
