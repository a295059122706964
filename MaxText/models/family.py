"""The family interface: everything generic code (the trainer, the step, the metrics, the config
checks, the converters) may know about a model family. A family is a folder
`MaxText/models/<family>/` whose `family.py` defines `FAMILY = Family(...)`, plus one line in
`MaxText/models/registry.py`; generic code never names a family or one of its parameters.

A family's module (`build(mcfg, rngs)`) is called as `model(tokens_BS, positions_BS,
segment_ids_BS) -> logits_BSV` (fp32) and `model.forward_with_aux(...) -> (logits_BSV, aux)`; `aux`
is whatever the family's `aux_terms` read (e.g. routing statistics), `{}` for most models.

A family that decodes (MaxText/decoding/) declares its per-layer decoding state in
`decode_cache(mcfg) -> {group name: layers.kv_cache.CacheGroup}` (full-attention K/V, a sliding
window's ring buffer, a recurrence's state, ...; a layer that reads another layer's cache stores
nothing) and its module has
  `extend(tokens_BS, positions_BS, valid_BS, cache, *, prefill) -> (hidden_BSD, cache)`
      new tokens (`valid_BS`: the real ones of right-padded rows) → final-norm hidden states and
      the cache with them; `prefill`: prompts at positions 0..S-1 over an empty cache (or None:
      no cache, for scoring), else one token per row at its own position
  `logits(hidden_BSD) -> logits_BSV`   the head (fp32)
  `head_params() -> ((path...), ...)`  the parameters `logits` reads, by path in the parameter
                                       dict (the chunked losses take their gradient by this name)
The cache is the dict of groups of arrays the decoding code allocated from `decode_cache`, each
stacked on a leading axis of the group's layers; the model reads and writes its layers' rows.

A family that implements `mtp_num_layers` (the MTP block, MaxText/layers/mtp.py) also returns its
depths' hidden states from `forward_with_aux(..., mtp=True)` as aux["mtp_hidden"] [depths, B, S, D]
(the loss: MaxText/losses/mtp.py) and has
  `mtp_extend(tokens_BS, hidden_BSD, positions_BS, valid_BS, cache, *, prefill, depth)
      -> (hidden_BSD, cache)`  one MTP layer in decoding (speculative drafting), its own cache group
and a cache kind that rolls back by position says so (`rolls_back_by_position`, layers/kv_cache.py).

A family that supports `weight_quant_vocab` (int8 vocabulary tables, layers/quant_vocab.py) reads
its own vocabulary tables ([V, D] parameters of the module whose first axis is "vocab") through
`quant_vocab.rows` / `logits` / `head_params`, which serve the float and the int8 form alike.

A multimodal family's module also takes `media=` — its encoder towers' inputs, a dict of arrays by
the processor's names (Gemma 4: MaxText/models/gemma4/towers.py) — in `forward_with_aux` and in
`extend(prefill=True)`; generic code hands it through as it is (`ModelDef.apply*` keywords, the
decoding engine's prefill).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Hashable, Mapping, Protocol

from flax import nnx

from MaxText.config.schema import KEYS, MODEL_KEYS, default
from MaxText.layers.kv_cache import CacheGroup
from MaxText.metrics.flops import FlopCount
from MaxText.models.model_config import ModelConfig

Problems = list[tuple[str, str]]   # [(config key, what is wrong)]
MEDIA = ("image", "audio")         # what `Family.media` may name

# Model keys every transformer family is expected to honour (a family adds its own features to
# these in `supports`; any model key it does not list is refused when set away from its default).
COMMON_KEYS = frozenset({
    "decoder_block", "vocab_size", "emb_dim", "num_decoder_layers", "num_query_heads",
    "num_kv_heads", "head_dim", "mlp_dim", "norm_epsilon", "rope_theta", "max_position_embeddings",
    "init_std", "dtype", "weight_dtype", "scan_layers", "remat_policy", "attention",
    "flash_block_q", "flash_block_kv", "flash_fused_bwd", "decode_attention"})
# Model keys generic code applies to any family's module (models/model_def.py: LoRA adapters,
# quantized projections, the generator of a fresh init, the hot path and matmul precision its
# layers are traced at, the dtype of the logits its loss reads).
GENERIC_KEYS = frozenset({"param_init_rng", "lora_rank", "lora_alpha", "lora_targets",
                          "quantization",
                          "quantization_exclude", "weight_bits", "weight_group_size",
                          "weight_quant_exclude", "hot_path", "matmul_precision",
                          "logits_dtype", "context_parallel_strategy"})
# Routed experts as MaxText/layers/moe.py implements them (with the balancing terms of
# `moe.MoETerms`).
ROUTED_EXPERT_KEYS = frozenset({
    "num_experts", "num_experts_per_tok", "moe_mlp_dim", "norm_topk_prob", "capacity_factor",
    "moe_dispatch", "moe_matmul", "moe_matmul_tiles", "moe_aux_loss_weight",
    "router_bias_update_rate"})


class StepWatch(Protocol):
  """A family's host-side view of each step's metrics (Python floats), for the run's log."""

  def progress(self, metrics: dict) -> str:
    """Its part of the progress line ("" for none)."""
    ...

  def update(self, step: int, metrics: dict) -> str | None:
    """A warning to log after `step`, or None."""
    ...


class AuxTerms(Protocol):
  """A family's training terms beyond the cross-entropy, computed from `forward_with_aux`'s aux.

  The step calls `loss` per micro-batch, adds its first result to the summed cross-entropy (so it
  must be a sum over tokens, like that) and sums the second over micro-batches; after the
  optimizer update it calls `update` (changes outside the gradient) and `metrics`. The trainer
  calls `watch` once per run and hands it every step's metrics.
  """

  def loss(self, aux: dict) -> tuple[Any, dict]:
    """(addition to the summed loss, sums to accumulate over micro-batches)."""
    ...

  def update(self, params: dict, sums: dict) -> dict:
    """The parameters after the changes the family makes outside the gradient."""
    ...

  def metrics(self, sums: dict, tokens: Any) -> dict[str, Any]:
    """Scalars for metrics.jsonl (`tokens`: the unmasked tokens of the step)."""
    ...

  def watch(self) -> StepWatch:
    """A fresh host-side watcher of the run's metrics (progress-line part, warnings)."""
    ...


def routed_expert_problems(mcfg: ModelConfig, keys: frozenset[str]) -> Problems:
  """A family's checks of its routed-expert `keys`: without experts none may be set, with them the
  experts must have a width and k <= E."""
  if not mcfg.num_experts:
    return [(k, f"{k}={getattr(mcfg, k)!r} needs num_experts > 0") for k in sorted(keys)
            if k != "num_experts" and not is_default(mcfg, k)]
  problems = []
  if mcfg.moe_mlp_dim < 1:
    problems.append(("moe_mlp_dim", "num_experts > 0 needs moe_mlp_dim >= 1"))
  if mcfg.num_experts_per_tok > mcfg.num_experts:
    problems.append(("num_experts_per_tok", f"{mcfg.num_experts_per_tok} experts per token out "
                                            f"of num_experts={mcfg.num_experts}"))
  return problems


def dense_layer_problems(mcfg: ModelConfig, moe_layers: tuple[int, ...],
                         keys: tuple[str, ...]) -> Problems:
  """Checks of the keys (`keys`) that keep some layers of a MoE model dense: `mlp_only_layers`
  inside the model, and at least one MoE layer left (`moe_layers`) when num_experts > 0."""
  problems = []
  outside = [i for i in mcfg.mlp_only_layers if not 0 <= i < mcfg.num_decoder_layers]
  if outside:
    problems.append(("mlp_only_layers", f"layers {outside} are outside the model's "
                                         f"{mcfg.num_decoder_layers} layers"))
  if mcfg.num_experts and not moe_layers:
    problems.append(("num_experts", f"num_experts={mcfg.num_experts} but no layer is a MoE layer "
                     f"({', '.join(f'{k}={getattr(mcfg, k)!r}' for k in keys)})"))
  return problems


def mtp_problems(mcfg: ModelConfig) -> Problems:
  """Checks of a family that implements the MTP block (MaxText/layers/mtp.py): a loss scale needs
  depths to train."""
  if mcfg.mtp_loss_scale > 0 and not mcfg.mtp_num_layers:
    return [("mtp_loss_scale", f"mtp_loss_scale={mcfg.mtp_loss_scale:g} trains the "
                               "multi-token-prediction block, but mtp_num_layers=0 (set "
                               "mtp_num_layers >= 1)")]
  return []


def _no_problems(mcfg: ModelConfig) -> Problems:
  return []


def _no_aux_terms(mcfg: ModelConfig) -> AuxTerms | None:
  return None


def _head_dim(mcfg: ModelConfig) -> tuple[int, ...]:
  return (mcfg.head_dim,)


def _nothing_frozen(mcfg: ModelConfig) -> tuple[str, ...]:
  return ()


def _no_activation_bytes(mcfg: ModelConfig, sequences: float, seq_len: int) -> int:
  return 0


def _text_only(mcfg: ModelConfig) -> frozenset[str]:
  return frozenset()


@dataclass(frozen=True)
class Family:
  """A model family, as generic code sees it."""
  name: str                                                     # its decoder_block value
  build: Callable[..., nnx.Module]                              # build(mcfg, *, rngs)
  supports: frozenset[str]                                      # the model keys it implements
  layer_kinds: Callable[[ModelConfig], tuple[Hashable, ...]]    # one per layer (str() for logs)
  flops: Callable[[ModelConfig, int, bool], FlopCount]          # (mcfg, seq_len, causal)
  check: Callable[[ModelConfig], Problems] = _no_problems       # cross-key checks of its own
  attention_head_dims: Callable[[ModelConfig], tuple[int, ...]] = _head_dim
  aux_terms: Callable[[ModelConfig], AuxTerms | None] = _no_aux_terms
  # top-level parameters carried but never trained (the optimizer leaves them bitwise unchanged)
  frozen: Callable[[ModelConfig], tuple[str, ...]] = _nothing_frozen
  # False: its layers need whole sequences per shard (a recurrence), so a sequence sharded over
  # the context axis is refused at config time
  context_parallel: bool = True
  # (mcfg, sequences per device, seq_len) → activation bytes per device the pre-flight memory
  # check adds to the state (e.g. recurrent states kept for the backward pass); heads are
  # counted whole (a tensor-parallel mesh divides them as it multiplies the sequences)
  activation_bytes: Callable[[ModelConfig, float, int], int] = _no_activation_bytes
  # the inputs besides token ids its model takes, of MEDIA ("image": pixel_values and
  # image_position_ids; "audio": input_features and input_features_mask, transformers' names and
  # layouts, as MaxText/data/multimodal/processor.py makes them); its module's `extend` (prefill
  # and scoring) and `forward_with_aux` then take `media={name: array}` (a call's images and clips
  # in prompt order, the prompts holding their expanded placeholder tokens). Empty: text only, and
  # an image or a clip for it is refused (exit 2)
  media: Callable[[ModelConfig], frozenset[str]] = _text_only
  # its decoding cache groups (module docstring); None: the family does not decode
  decode_cache: Callable[[ModelConfig], Mapping[str, CacheGroup]] | None = None
  # Hugging Face model_type → its name map (a module with hf_to_params, params_to_hf,
  # config_from_hf, config_to_hf); an export with hf_model_type="" takes the first that fits
  hf_maps: Mapping[str, ModuleType] = field(default_factory=dict)
  # the model keys only this family reads: a frozen dataclass of `config.spec.key(...)` fields
  # (its folder's keys.py: `Keys`), composed into the one schema (`schema.add_keys`: by the
  # family table for the repository's families, by `registry.register` for others); they are
  # supported without being listed in `supports`
  keys: type | None = None

  def own_keys(self) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(self.keys)) if self.keys else frozenset()

  def __post_init__(self):
    unknown = sorted(set(self.supports) - set(MODEL_KEYS) - self.own_keys())
    if unknown:
      raise ValueError(f"family {self.name!r} supports keys that are not model keys of the "
                       f"schema: {unknown}")

  def problems(self, mcfg: ModelConfig) -> Problems:
    """Every model key it does not implement that `mcfg` sets away from the schema's default,
    then its own checks."""
    refused = [(k, f"{k}={getattr(mcfg, k)!r} is not supported by decoder_block={self.name} "
                   f"(it implements {k} only at {KEYS[k].default!r}, the default)")
               for k in MODEL_KEYS
               if k not in self.supports | self.own_keys() | GENERIC_KEYS
               and not is_default(mcfg, k)]
    return refused + self.check(mcfg)


def is_default(mcfg: Any, key: str) -> bool:
  value, want = getattr(mcfg, key), default(key)
  return list(value) == want if isinstance(want, list) else value == want
