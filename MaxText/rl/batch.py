"""The policy's batch format (MaxText/rl/policy.py): what an outside RL loop hands to `logprobs`,
`reference_logprobs` and `train`, checked, and turned into the arrays the compiled programs take.

One batch is a dict of host arrays (NumPy, or anything `np.asarray` takes), B rows of S tokens:

  key                  shape          dtype          what
  input_ids            [B, S]         integer        prompt + completion, right-padded
  token_mask           [B, S]         0/1 (bool,     1 on the row's real tokens (a prefix of the
                                      int or float)  row), 0 on padding; default: all 1
  generation_mask      [B, S]         0/1            1 on the sampled (completion) tokens — the
                                                     ones that are scored and trained on; default
                                                     (logprobs only): token_mask
  advantages           [B] or [B, S]  float          per row, or per token
  old_logprobs         [B, S]         float          log p of input_ids[:, t] under the policy that
                                                     sampled them (train)
  reference_logprobs   [B, S]         float          the reference's (train with kl_beta > 0;
                                                     absent: the policy computes them)
  sample_weight        [B]            float >= 0     optional: each row's tokens count this much in
                                                     the loss and its token means (0: left out)

Log-probabilities are aligned with the tokens: `logprobs[:, t]` is log p(input_ids[:, t] |
input_ids[:, :t]); position 0 has no prediction, so it is 0 and never trained on, and every
position outside the generation mask is 0. `token_mask` is also the spelling `attention_mask`
(transformers'), taken when `token_mask` is absent.

A bad batch raises `BatchError` (a DataError: exit 3 in a command) naming the key, the shape it
has and the shape expected."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from MaxText.data.errors import DataError

FLOAT_ROWS = ("old_logprobs", "reference_logprobs")
KEYS = ("input_ids", "token_mask", "generation_mask", "advantages", *FLOAT_ROWS, "sample_weight")
ALIASES = {"attention_mask": "token_mask"}


class BatchError(DataError):
  """A policy batch with a missing key, a wrong shape or dtype, or bad values."""


def _expect(name: str, x: np.ndarray, shape: tuple[int, ...], where: str) -> None:
  if x.shape != shape:
    raise BatchError(f"batch[{name!r}]: shape {tuple(x.shape)}, expected {where} = {shape}")


def check(batch: Mapping[str, Any], need: tuple[str, ...]) -> dict[str, np.ndarray]:
  """The batch's arrays, checked (module docstring); `need`: the keys this call requires besides
  input_ids. Unknown keys are refused (a misspelt key is never silently ignored)."""
  if not isinstance(batch, Mapping):
    raise BatchError(f"a batch is a dict of arrays (keys {', '.join(KEYS)}), got "
                     f"{type(batch).__name__}")
  batch = {ALIASES.get(k, k) if ALIASES.get(k) not in batch else k: v for k, v in batch.items()}
  unknown = sorted(set(batch) - set(KEYS))
  if unknown:
    raise BatchError(f"batch: unknown keys {unknown}; a batch has {', '.join(KEYS)}")
  for k in ("input_ids", *need):
    if k not in batch:
      raise BatchError(f"batch[{k!r}] is missing (this call needs "
                       f"{', '.join(('input_ids', *need))})")
  ids = np.asarray(batch["input_ids"])
  if ids.ndim != 2 or 0 in ids.shape:
    raise BatchError(f"batch['input_ids']: shape {tuple(ids.shape)}, expected [B, S] with B, S "
                     ">= 1")
  if not np.issubdtype(ids.dtype, np.integer):
    raise BatchError(f"batch['input_ids']: dtype {ids.dtype}, expected an integer dtype")
  B, S = ids.shape
  out: dict[str, np.ndarray] = {"input_ids": ids.astype(np.int32)}
  for k in ("token_mask", "generation_mask"):
    if k in batch:
      m = np.asarray(batch[k])
      _expect(k, m, (B, S), "[B, S] (input_ids' shape)")
      if not np.isin(m, (0, 1)).all():
        raise BatchError(f"batch[{k!r}]: values other than 0 and 1")
      out[k] = m.astype(np.float32)
  tm = out.setdefault("token_mask", np.ones((B, S), np.float32))
  length = tm.sum(1).astype(np.int64)
  if not (tm == (np.arange(S)[None] < length[:, None])).all():
    bad = int(np.nonzero((tm != (np.arange(S)[None] < length[:, None])).any(1))[0][0])
    raise BatchError(f"batch['token_mask'] row {bad}: not right-padded (the 1s must be a prefix "
                     "of the row)")
  out.setdefault("generation_mask", tm)
  if (out["generation_mask"] > tm).any():
    raise BatchError("batch['generation_mask']: 1 on a padding position (token_mask 0)")
  for k in FLOAT_ROWS:
    if k in batch:
      x = np.asarray(batch[k], np.float32)
      _expect(k, x, (B, S), "[B, S] (input_ids' shape)")
      out[k] = x
  if "advantages" in batch:
    a = np.asarray(batch["advantages"], np.float32)
    if a.shape not in ((B,), (B, S)):
      raise BatchError(f"batch['advantages']: shape {tuple(a.shape)}, expected [B] = {(B,)} or "
                       f"[B, S] = {(B, S)}")
    out["advantages"] = a
  if "sample_weight" in batch:
    w = np.asarray(batch["sample_weight"], np.float32)
    _expect("sample_weight", w, (B,), "[B]")
    if not (np.isfinite(w).all() and (w >= 0).all()):
      raise BatchError("batch['sample_weight']: weights must be finite and >= 0")
    out["sample_weight"] = w
  for k in (*FLOAT_ROWS, "advantages"):
    if k in out and not np.isfinite(out[k]).all():
      raise BatchError(f"batch[{k!r}]: non-finite values")
  return out


def model_arrays(b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The model's [B, S] arrays of a checked batch: `inputs` the tokens, `targets` the next token
  (0 past the end), positions, segments (1 on real tokens), `mask`: the generation mask with
  position 0 cleared, and `weight` [B]: the rows' sample weights (default 1)."""
  ids, tm = b["input_ids"], b["token_mask"]
  B, S = ids.shape
  out = {"inputs": ids, "targets": np.concatenate([ids[:, 1:], np.zeros((B, 1), np.int32)], 1),
         "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy(),
         "segments": tm.astype(np.int32)}
  mask = b["generation_mask"].copy()
  mask[:, 0] = 0.0
  out["mask"] = mask
  out["weight"] = b.get("sample_weight", np.ones((B,), np.float32))
  for k in FLOAT_ROWS:
    out[k] = b.get(k, np.zeros((B, S), np.float32))
  adv = b.get("advantages", np.zeros((B,), np.float32))
  out["advantages"] = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, (B, S)).copy()
  return out
