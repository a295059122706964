"""The fastest configuration that fits, by the memory pre-flight's estimate (`memory.py`):
`remat_policy=auto`'s choice (`pick_remat`) and what a refusal names (`fastest_fit`).

The remat policies by expected speed, fastest first (`SPEED_ORDER`): the less a policy recomputes
in the backward pass, the faster its step, as measured on one TPU v5e (Qwen3-0.6B, seq 2048, batch
4, tokens/s): save_attention with the fused splash backward 20,177, save_dot_except_mlp 19,612,
save_qkv_attention 19,412, save_qkv_proj 18,547 (full at batch 8, fused: 19,635); none and
save_matmuls recompute least and need the most memory. The named saves (`save_attention`, ...)
name values the llama family's attention and the gated MLP give (layers/saved.py); other families
still run them, saving only what they name, so their choice is among none, save_matmuls and full.

An estimate is asked of `estimate(remat_policy=..., loss_chunk=..., batch=...)` (the Trainer's
`estimate_with`): the run's state and the activations of that variant.
"""
from __future__ import annotations

from typing import Callable

from MaxText.resolve.auto_settings import AUTO_CHUNK_LENGTH, has_logits_head
from MaxText.train.memory import GiB, MemoryEstimate

SPEED_ORDER = ("none", "save_matmuls", "save_dot_except_mlp_in", "save_dot_except_mlp",
               "save_qkv_attention", "save_attention", "save_qkv_proj", "full")
# families whose layers name every value of the named saves
NAMED_SAVES_FAMILIES = frozenset({"llama"})

Estimate = Callable[..., MemoryEstimate]


def policies_of(decoder_block: str) -> tuple[str, ...]:
  """The remat policies worth choosing for a family, fastest first."""
  if decoder_block in NAMED_SAVES_FAMILIES:
    return SPEED_ORDER
  return tuple(p for p in SPEED_ORDER if p in ("none", "save_matmuls", "full"))


def pick_remat(estimate: Estimate, decoder_block: str) -> tuple[str, str]:
  """(the first policy of `policies_of` whose estimate fits, the start-up line's reason); `full`
  (the least memory) when none fits."""
  skipped = []
  for policy in policies_of(decoder_block):
    est = estimate(remat_policy=policy)
    if est.fits:
      faster = (f"; faster ones do not fit: {', '.join(skipped)}" if skipped else "")
      return policy, (f"remat_policy=auto: {policy}, the fastest that fits (~{est.needed / GiB:.2f}"
                      f" of {est.available / GiB:.2f} GiB{faster})")
    skipped.append(f"{policy} ~{est.needed / GiB:.2f} GiB")
  return "full", (f"remat_policy=auto: full, the least memory (no policy's estimate fits: "
                  f"{', '.join(skipped)})")


def fastest_fit(estimate: Estimate, cfg, after: str | None = None) -> str:
  """The fastest variant of this run whose estimate fits, as key=value text ("" when none does):
  the first policy of `policies_of` (those after `after` when given: a lighter one than a policy
  XLA refused) at the user's batch and loss chunk, then with loss chunks of AUTO_CHUNK_LENGTH
  positions (when the family has a separate head and the chunk is the whole sequence or longer),
  then at half the batch, a quarter, ... down to one sequence."""
  policies = policies_of(cfg.decoder_block)
  if after in policies:
    policies = policies[policies.index(after) + 1:]
  chunks: list[int | None] = [None]
  chunk = cfg.loss_chunk_length
  if (has_logits_head(cfg.decoder_block) and cfg.max_target_length > AUTO_CHUNK_LENGTH
      and (chunk <= 0 or chunk > AUTO_CHUNK_LENGTH)):
    chunks.append(AUTO_CHUNK_LENGTH)
  batches: list[int | None] = [None]
  batch = int(cfg.per_device_batch_size)
  while batch > 1:
    batch //= 2
    batches.append(batch)
  for b in batches:
    for c in chunks:
      for policy in policies:
        est = estimate(remat_policy=policy, loss_chunk=c, batch=b)
        if est.fits:
          keys = [f"remat_policy={policy}"]
          keys += [f"loss_chunk_length={c}"] if c is not None else []
          keys += [f"per_device_batch_size={b}"] if b is not None else []
          return f"{' '.join(keys)} (~{est.needed / GiB:.2f} GiB per device)"
  return ""
