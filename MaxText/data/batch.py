"""The batch contract: the arrays every training, evaluation and SFT row holds, declared once.

Each is int32 of length S = max_target_length (a batch: [rows, S]):

* ``inputs``               token ids fed to the model
* ``targets``              next-token labels: ``targets[i]`` follows ``inputs[i]`` in its document
* ``inputs_segmentation``  1, 2, 3, ... per document piece in the row; 0 for padding
* ``inputs_position``      position inside the document piece, restarting at 0 per piece
* ``targets_segmentation`` segment id of the target token; 0 = not in the loss (padding, or in
                           SFT a token outside the assistant turns)

Producers (`packing.py`, `sft.py`, `eval_data.py`) write exactly these keys; consumers (the train
step's shardings, evaluation) read them from here.
"""

BATCH_KEYS = ("inputs", "targets", "inputs_segmentation", "inputs_position",
              "targets_segmentation")
