"""Hugging Face Qwen3 (`model_type: qwen3`, `Qwen3ForCausalLM`) ↔ our `llama` family.

The name map is data (`GLOBAL_RULES`, `LAYER_RULES`): one row per parameter, read in both
directions by `hf_to_params` / `params_to_hf`. Config keys map through `config_from_hf` /
`config_to_hf`.

Layouts. HF `nn.Linear.weight` is `[out, in]` with the head axis folded into `out` (or `in`) as
`h * E + e` (HF `.view(..., -1, head_dim)`); our kernels are `[*in, *out]` (`DenseGeneral`). So
`kernel = W.T.reshape(*in_shape, *out_shape)` and `W = kernel.reshape(prod(in), prod(out)).T`:
  q_proj [H*E, D] ↔ attn/query/kernel [D, H, E]      o_proj [D, H*E] ↔ attn/out/kernel [H, E, D]
  k_proj, v_proj [K*E, D] ↔ [D, K, E]                 gate/up_proj [F, D] ↔ [D, F]; down [D, F] ↔ [F, D]
  lm_head [V, D] ↔ lm_head/kernel [D, V]             embed_tokens [V, D] = embedding [V, D]
Norm scales are copied as they are (Qwen3 RMSNorm is plain `w`, init 1 — same as ours).
Per-layer rows name `model.layers.{i}.…`; with `scan_layers=true` our parameter carries a leading
`[L]` axis (the HF tensors of layers 0..L-1 stacked), otherwise it lives at `decoder/layers/<i>/…`.

Tied embeddings: our params have no `lm_head`; HF's `state_dict()` still lists `lm_head.weight`
(the same tensor as `model.embed_tokens.weight`) while `save_pretrained` drops it. `hf_to_params`
accepts it when it equals the embedding; `params_to_hf(..., tied_lm_head=True)` writes it.

Numerics checked against transformers 5.24 (tests/test_qwen3_parity.py): RMSNorm normalises in fp32,
casts to the activation dtype, then multiplies by the weight (ours too); RoPE is rotate-half with
fp32 angles (ours too). Differences that only show outside fp32 or at long positions: HF casts
cos/sin to the activation dtype and rotates in that dtype (ours rotates in fp32 and casts once), and
HF computes `inv_freq = 1 / base**(2i/E)` where ours computes `base**(-2i/E)` (may differ by 1 ulp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from MaxText.models.model_config import ModelConfig


@dataclass(frozen=True)
class Rule:
  ours: str                # "/"-joined path (per-layer rules: under one decoder layer)
  hf: str                  # HF tensor name; "{i}" is the layer index
  in_rank: int | None = None  # None: same array; n: nn.Linear [out, in] ↔ kernel [*in (n dims), *out]


GLOBAL_RULES: tuple[Rule, ...] = (
    Rule("embedding", "model.embed_tokens.weight"),
    Rule("final_norm/scale", "model.norm.weight"),
    Rule("lm_head/kernel", "lm_head.weight", in_rank=1),
)

LAYER_RULES: tuple[Rule, ...] = (
    Rule("attn_norm/scale", "model.layers.{i}.input_layernorm.weight"),
    Rule("attn/query/kernel", "model.layers.{i}.self_attn.q_proj.weight", in_rank=1),
    Rule("attn/key/kernel", "model.layers.{i}.self_attn.k_proj.weight", in_rank=1),
    Rule("attn/value/kernel", "model.layers.{i}.self_attn.v_proj.weight", in_rank=1),
    Rule("attn/out/kernel", "model.layers.{i}.self_attn.o_proj.weight", in_rank=2),
    Rule("attn/query_norm/scale", "model.layers.{i}.self_attn.q_norm.weight"),
    Rule("attn/key_norm/scale", "model.layers.{i}.self_attn.k_norm.weight"),
    Rule("mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
    Rule("mlp/gate/kernel", "model.layers.{i}.mlp.gate_proj.weight", in_rank=1),
    Rule("mlp/up/kernel", "model.layers.{i}.mlp.up_proj.weight", in_rank=1),
    Rule("mlp/down/kernel", "model.layers.{i}.mlp.down_proj.weight", in_rank=1),
)

TIED_HEAD = "lm_head.weight"
# Non-parameter buffers older checkpoints may carry.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---- the two transforms (one rule, two directions) ----------------------------------------------
def _to_ours(w: np.ndarray, shape: tuple[int, ...], rule: Rule) -> np.ndarray:
  if rule.in_rank is None:
    want = shape
  else:
    want = (math.prod(shape[rule.in_rank:]), math.prod(shape[: rule.in_rank]))
  if tuple(w.shape) != tuple(want):
    raise ValueError(f"{rule.hf}: HF shape {tuple(w.shape)}, expected {want} for {rule.ours} {shape}")
  return w if rule.in_rank is None else w.T.reshape(shape)


def _to_hf(k: np.ndarray, rule: Rule) -> np.ndarray:
  if rule.in_rank is None:
    return k
  return np.ascontiguousarray(k.reshape(math.prod(k.shape[: rule.in_rank]), -1).T)


# ---- the plan: every parameter of the model def with its rule ------------------------------------
def _flat(tree: Mapping, prefix: tuple = ()) -> dict[tuple, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, (*prefix, k)))
    else:
      out[(*prefix, k)] = v
  return out


def _unflat(flat: Mapping[tuple, Any]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


def _plan(mcfg: ModelConfig) -> Iterator[tuple[tuple, Rule, list[int] | None, Any]]:
  """(our path, rule, layer indices — None for global / [i] unscanned / all for stacked, spec)."""
  from MaxText.train.state import make_model_def
  if mcfg.decoder_block != "llama":
    raise ValueError(f"Qwen3 maps onto decoder_block=llama, not {mcfg.decoder_block!r}")
  specs = _flat(make_model_def(mcfg).abstract_params)
  L = mcfg.num_decoder_layers
  rows = []
  for rule in GLOBAL_RULES:
    rows.append((tuple(rule.ours.split("/")), rule, None))
  for rule in LAYER_RULES:
    sub = tuple(rule.ours.split("/"))
    if mcfg.scan_layers:
      rows.append((("decoder", "layers", *sub), rule, list(range(L))))
    else:
      rows.extend((("decoder", "layers", i, *sub), rule, [i]) for i in range(L))
  covered = set()
  for path, rule, layers in rows:
    if path in specs:          # lm_head (untied only), q/k norms (use_qk_norm only)
      covered.add(path)
      yield path, rule, layers, specs[path]
  missing = sorted("/".join(map(str, p)) for p in set(specs) - covered)
  if missing:
    raise ValueError(f"no HF name for our parameters: {missing}")


def hf_names(mcfg: ModelConfig, *, tied_lm_head: bool = False) -> list[str]:
  """Every HF tensor name the model of `mcfg` maps to."""
  names = [r.hf.format(i=i) for _, r, layers, _ in _plan(mcfg) for i in (layers or [None])]
  return names + ([TIED_HEAD] if tied_lm_head and mcfg.tie_word_embeddings else [])


def hf_to_params(hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig) -> dict:
  """HF state dict (NumPy arrays) → our pure-dict params, in `mcfg.weight_dtype`. Strict: a missing
  tensor, a wrong shape or an HF tensor left over raises ValueError."""
  # names only: `hf_state` may be a lazy mapping (HFTensors) that reads a tensor when indexed,
  # so only one HF tensor (or one parameter's layers) is held at a time
  hf = {k for k in hf_state if not k.endswith(IGNORED_SUFFIXES)}
  used: set[str] = set()

  def take(name: str) -> np.ndarray:
    if name not in hf:
      raise ValueError(f"HF state lacks {name}")
    used.add(name)
    return np.asarray(hf_state[name])

  flat = {}
  for path, rule, layers, spec in _plan(mcfg):
    if layers is None:
      value = _to_ours(take(rule.hf), spec.shape, rule)
    elif mcfg.scan_layers:
      value = np.stack([_to_ours(take(rule.hf.format(i=i)), spec.shape[1:], rule) for i in layers])
    else:
      value = _to_ours(take(rule.hf.format(i=layers[0])), spec.shape, rule)
    flat[path] = np.asarray(value, dtype=spec.dtype)
  if mcfg.tie_word_embeddings and TIED_HEAD in hf:
    if not np.array_equal(np.asarray(hf_state[TIED_HEAD]),
                          np.asarray(hf_state["model.embed_tokens.weight"])):
      raise ValueError(f"tie_word_embeddings=true but {TIED_HEAD} differs from the embedding")
    used.add(TIED_HEAD)
  extra = sorted(set(hf) - used)
  if extra:
    raise ValueError(f"HF tensors with no place in our model: {extra}")
  return _unflat(flat)


def params_to_hf(params: Mapping, mcfg: ModelConfig, *, tied_lm_head: bool = False
                 ) -> Mapping[str, np.ndarray]:
  """Our pure-dict params → HF state dict of NumPy arrays (dtype kept), as a lazy mapping: each HF
  tensor is made when it is read, so an exporter holds one at a time. With tied embeddings
  `lm_head.weight` is left out (as `save_pretrained` does) unless `tied_lm_head`."""
  flat = _flat(params)
  where: dict[str, tuple[np.ndarray, Rule, int | None]] = {}
  for path, rule, layers, spec in _plan(mcfg):
    if path not in flat:
      raise ValueError(f"params lack {'/'.join(map(str, path))}")
    value = flat[path]
    if tuple(value.shape) != tuple(spec.shape):
      raise ValueError(f"{'/'.join(map(str, path))}: shape {value.shape}, expected {spec.shape}")
    if layers is None:
      where[rule.hf] = (value, rule, None)
    elif mcfg.scan_layers:
      where.update((rule.hf.format(i=i), (value, rule, i)) for i in layers)
    else:
      where[rule.hf.format(i=layers[0])] = (value, rule, None)
  if tied_lm_head and mcfg.tie_word_embeddings:
    where[TIED_HEAD] = where["model.embed_tokens.weight"]
  return _LazyHF(where)


class _LazyHF(Mapping):
  def __init__(self, where: dict[str, tuple[Any, Rule, int | None]]):
    self._where = where

  def __getitem__(self, name: str) -> np.ndarray:
    value, rule, layer = self._where[name]
    value = np.asarray(value if layer is None else value[layer])
    out = _to_hf(value, rule)
    return out if out is not value else value.copy()

  def __iter__(self):
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)


# ---- config --------------------------------------------------------------------------------------
def _rope_theta(hf: Mapping[str, Any]) -> float:
  """transformers 5 keeps θ in `rope_parameters`; 4.x configs have top-level `rope_theta` and
  `rope_scaling`. Only plain (unscaled, full-rotary) RoPE is supported."""
  rope = dict(hf.get("rope_parameters") or {})
  for src in (rope, dict(hf.get("rope_scaling") or {})):
    kind = src.get("rope_type", src.get("type", "default"))
    if kind != "default":
      raise ValueError(f"rope type {kind!r} is not supported (only default RoPE)")
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"partial_rotary_factor={partial} is not supported")
  theta = rope.get("rope_theta", hf.get("rope_theta"))
  return float(10000.0 if theta is None else theta)  # Qwen3Config's default θ


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """HF Qwen3 config (config.json / `Qwen3Config.to_dict()`) → our config keys. Missing optional
  fields take `Qwen3Config`'s defaults (head_dim 128, K = H, untied, eps 1e-6, 32768 positions)."""
  hf = dict(hf_config)
  if hf.get("model_type", "qwen3") != "qwen3":
    raise ValueError(f"model_type={hf.get('model_type')!r}: this map is for 'qwen3'")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"hidden_act={hf['hidden_act']!r}: only silu is supported")
  if hf.get("attention_bias", False):
    raise ValueError("attention_bias=true is not supported (our projections have no bias)")
  if hf.get("use_sliding_window", False):
    raise ValueError("use_sliding_window=true is not supported")
  H = int(hf["num_attention_heads"])
  return {
      "decoder_block": "llama",
      "vocab_size": int(hf["vocab_size"]),
      "emb_dim": int(hf["hidden_size"]),
      "num_decoder_layers": int(hf["num_hidden_layers"]),
      "num_query_heads": H,
      "num_kv_heads": int(hf.get("num_key_value_heads") or H),
      "head_dim": int(hf.get("head_dim") or 128),
      "mlp_dim": int(hf["intermediate_size"]),
      "mlp_activation": "silu",
      "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
      "use_qk_norm": True,
      "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
      "rope_theta": _rope_theta(hf),
      "max_position_embeddings": int(hf.get("max_position_embeddings", 32768)),
  }


def config_to_hf(cfg: Any) -> dict[str, Any]:
  """Our config (`Config`, `ModelConfig` or a dict of our keys) → HF Qwen3 config dict, usable as
  `transformers.Qwen3Config(**d)` or as config.json (θ is written in both the 5.x and 4.x places)."""
  get = cfg.__getitem__ if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k)
  if get("decoder_block") != "llama" or not get("use_qk_norm") or get("mlp_activation") != "silu":
    raise ValueError("Qwen3 needs decoder_block=llama, use_qk_norm=true, mlp_activation=silu")
  theta = float(get("rope_theta"))
  return {
      "architectures": ["Qwen3ForCausalLM"],
      "model_type": "qwen3",
      "vocab_size": int(get("vocab_size")),
      "hidden_size": int(get("emb_dim")),
      "intermediate_size": int(get("mlp_dim")),
      "num_hidden_layers": int(get("num_decoder_layers")),
      "num_attention_heads": int(get("num_query_heads")),
      "num_key_value_heads": int(get("num_kv_heads")),
      "head_dim": int(get("head_dim")),
      "hidden_act": "silu",
      "rms_norm_eps": float(get("norm_epsilon")),
      "max_position_embeddings": int(get("max_position_embeddings")),
      "tie_word_embeddings": bool(get("tie_word_embeddings")),
      "rope_parameters": {"rope_type": "default", "rope_theta": theta},
      "rope_theta": theta,
      "attention_bias": False,
      "use_sliding_window": False,
  }
