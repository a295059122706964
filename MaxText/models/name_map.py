"""A family's Hugging Face name map as data, read in both conversion directions.

A family's hf_map module declares `Rule` rows — our parameter path ↔ HF tensor name, plus the
layout transform — a `layer_location(mcfg, i)` telling where HF layer i lives in our params (a
path prefix and, for scanned stacks, the index on the stacked axis) and the model's constructor
(`build`, whose abstract parameters say which rows apply). `NameMap` turns that into:
  hf_to_params   HF tensors (a possibly lazy mapping, read one tensor at a time) → our params
  params_to_hf   our params → a lazy mapping of HF tensors (made one at a time when read)
  hf_names       every HF tensor name the model maps to

Layouts. HF `nn.Linear.weight` is `[out, in]` with head axes folded into `out` (or `in`) as
`h * E + e`; our kernels are `[*in, *out]` (`DenseGeneral`). With `in_rank = n` (the number of our
input dims): `kernel = W.T.reshape(*in_shape, *out_shape)` and
`W = kernel.reshape(prod(in), prod(out)).T`. `in_rank=None` copies the array as it is (norm
scales, embedding tables). `lead` leading axes are shared as they are (fused experts: HF
`[E, out, in]` ↔ ours `[E, *in, *out]`).

Experts and fusions. `expert=True`: the HF name has "{e}" and holds one expert; our parameter's
expert axis (the first after a stacked layers axis; in a global rule, the first) takes it at
index e. `part=(j, n)`: our
parameter's last axis is n equal parts and the rule maps part j (e.g. our fused gate|up kernel
from HF's separate gate_proj and up_proj).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Iterator, Mapping

import numpy as np
from flax import traverse_util

from MaxText.config.schema import ARCHITECTURE_KEYS, MODEL_KEYS
from MaxText.models.family import is_default
from MaxText.models.model_config import ModelConfig
from MaxText.models.model_def import Build, model_def_of


@dataclass(frozen=True)
class Rule:
  ours: str                # "/"-joined path (per-layer rules: relative to one layer; a number: a
                           # list index)
  hf: str                  # HF tensor name; "{i}" is the layer index, "{e}" the expert
  in_rank: int | None = None  # None: same array; n: nn.Linear [out, in] ↔ kernel [*in (n dims), *out]
  lead: int = 0            # leading axes shared as they are (before in/out)
  expert: bool = False     # one HF tensor per expert ("{e}")
  part: tuple[int, int] | None = None  # (j, n): part j of n of our last axis


def to_ours(w: np.ndarray, shape: tuple[int, ...], rule: Rule, name: str) -> np.ndarray:
  lead, body = tuple(shape[: rule.lead]), tuple(shape[rule.lead:])
  if rule.in_rank is None:
    want = tuple(shape)
  else:
    want = (*lead, math.prod(body[rule.in_rank:]), math.prod(body[: rule.in_rank]))
  if tuple(w.shape) != want:
    raise ValueError(f"{name}: HF shape {tuple(w.shape)}, expected {want} for {rule.ours} "
                     f"{tuple(shape)}")
  return w if rule.in_rank is None else np.swapaxes(w, -1, -2).reshape(shape)


def to_hf(k: Any, rule: Rule) -> Any:
  """Our array → HF's layout; a NumPy array stays one (contiguous), a jax.Array stays on its
  devices."""
  if rule.in_rank is None:
    return k
  lead, body = k.shape[: rule.lead], k.shape[rule.lead:]
  out = k.reshape(*lead, math.prod(body[: rule.in_rank]), -1).swapaxes(-1, -2)
  return np.ascontiguousarray(out) if isinstance(out, np.ndarray) else out


def flatten(tree: Mapping) -> dict[tuple, Any]:
  return traverse_util.flatten_dict(dict(tree))


def unflatten(flat: Mapping[tuple, Any]) -> dict:
  return traverse_util.unflatten_dict(dict(flat))


def check_representable(mcfg: Any, represents: AbstractSet[str], model_type: str) -> None:
  """ValueError naming the first architecture key that `mcfg` sets away from its default and the
  Hugging Face architecture `model_type` has no field for (`represents`: the keys it has)."""
  for key in MODEL_KEYS:
    if key in ARCHITECTURE_KEYS and key not in represents and key not in _LAYOUT_ONLY \
        and key not in _STORAGE_ONLY and not is_default(mcfg, key):
      raise ValueError(f"{key}={getattr(mcfg, key)!r}: {model_type} has no such setting")


_LAYOUT_ONLY = {"decoder_block", "scan_layers", "init_std"}   # no effect on what the model computes
# how a quantized checkpoint stores its weights (integer levels + scales); the architecture is the
# float model's, and to_huggingface writes its weights dequantized
_STORAGE_ONLY = {"weight_bits", "weight_group_size", "weight_quant_exclude", "weight_quant_vocab"}


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialised array whose data starts on a 64-byte boundary, so that
  `jax.device_put(a, may_alias=True)` on CPU wraps it without a copy (converters hold one copy)."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  start = (-raw.ctypes.data) % 64
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def split_path(name: str) -> tuple:
  """"a/b/0/c" → ("a", "b", 0, "c"): a number is an index into a list of modules (nnx.List)."""
  return tuple(int(p) if p.isdigit() else p for p in name.split("/"))


def _name(path: tuple) -> str:
  return "/".join(map(str, path))


@dataclass(frozen=True)
class Entry:
  path: tuple                                 # our parameter
  rule: Rule
  sources: tuple[tuple[str, tuple], ...]      # (HF name, index into our parameter; () = all)
  spec: Any                                   # ShapeDtypeStruct of our parameter


def block_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
  return np.broadcast_to(np.empty((), np.int8), shape)[index].shape


def _index(rule: Rule, layer_index: int | None, e: int | None, shape: tuple[int, ...]) -> tuple:
  index: tuple = () if layer_index is None else (layer_index,)
  if e is not None:
    index += (e,)
  if rule.part is not None:
    j, n = rule.part
    width = shape[-1] // n
    index += (Ellipsis, slice(j * width, (j + 1) * width))
  return index


# Rows every transformers causal LM of the Llama lineage shares: the embedding, the final norm, the
# LM head; and the projections of a layer's `self_attn`.
CAUSAL_LM_RULES: tuple[Rule, ...] = (
    Rule("embedding", "model.embed_tokens.weight"),
    Rule("final_norm/scale", "model.norm.weight"),
    Rule("lm_head/kernel", "lm_head.weight", in_rank=1),
)


def self_attention_rules(layer: str) -> tuple[Rule, ...]:
  """q, k, v, o of `{layer}self_attn` ↔ our `attn/{query,key,value,out}/kernel`."""
  return (Rule("attn/query/kernel", layer + "self_attn.q_proj.weight", in_rank=1),
          Rule("attn/key/kernel", layer + "self_attn.k_proj.weight", in_rank=1),
          Rule("attn/value/kernel", layer + "self_attn.v_proj.weight", in_rank=1),
          Rule("attn/out/kernel", layer + "self_attn.o_proj.weight", in_rank=2))


@dataclass(frozen=True)
class LayerGroup:
  """Another stack of layers beside the decoder's (an encoder tower's): its per-layer rules, where
  its layer i lives (`location(mcfg, i)`: path prefix, stacked index) and how many it has."""
  rules: tuple[Rule, ...]
  location: Callable[[ModelConfig, int], tuple[tuple, int | None]]
  count: Callable[[ModelConfig], int]


@dataclass(frozen=True)
class NameMap:
  """`check(mcfg)` runs before every conversion (an architecture's `config_to_hf`: ValueError
  when it cannot hold the model); HF names ending with `ignored_suffixes` (non-parameter buffers
  older checkpoints carry) are skipped on import."""
  global_rules: tuple[Rule, ...]
  layer_rules: tuple[Rule, ...]
  layer_location: Callable[[ModelConfig, int], tuple[tuple, int | None]]
  build: Build
  check: Callable[[ModelConfig], Any] = lambda mcfg: None
  ignored_suffixes: tuple[str, ...] = ()
  embedding_name: str = "model.embed_tokens.weight"
  tied_head_name: str = "lm_head.weight"
  # our parameters with no HF counterpart and a neutral value of zero (e.g. an MoE selection bias):
  # imported as zeros; exporting one that is not all zero is refused (HF would compute otherwise)
  ours_only: tuple[str, ...] = ()
  # stacks of layers besides the decoder's ("{i}" in their rules is their own layer index)
  more_layers: tuple[LayerGroup, ...] = ()

  def layer_groups(self, mcfg: ModelConfig) -> list[tuple[tuple[Rule, ...], Callable, int]]:
    return [(self.layer_rules, self.layer_location, mcfg.num_decoder_layers),
            *((g.rules, g.location, g.count(mcfg)) for g in self.more_layers)]

  def specs(self, mcfg: ModelConfig) -> dict[tuple, Any]:
    """Our parameters (path → ShapeDtypeStruct) of the model of `mcfg`."""
    return flatten(model_def_of(self.build, mcfg).abstract_params)

  def plan(self, mcfg: ModelConfig, specs: dict[tuple, Any] | None = None) -> Iterator[Entry]:
    """Every parameter of the model of `mcfg` (`specs`, when already known), with its rule and HF
    sources. A rule whose parameter the model does not have (an untied head, K/V of a kv-shared
    layer, a dense layer's router) is skipped; a parameter no rule covers is an error."""
    specs = dict(self.specs(mcfg) if specs is None else specs)
    for name in self.ours_only:
      specs.pop(split_path(name), None)
    sources: dict[tuple, list] = {}
    rules: dict[tuple, Rule] = {}
    stacked: dict[tuple, list] = {}
    for rule in self.global_rules:
      path = split_path(rule.ours)
      if path in specs:
        rules[path] = rule
        for e in (range(mcfg.num_experts) if rule.expert else [None]):
          sources.setdefault(path, []).append(
              (rule.hf.format(e=e) if rule.expert else rule.hf,
               _index(rule, None, e, specs[path].shape)))
    for layer_rules, layer_location, count in self.layer_groups(mcfg):
      self._plan_layers(mcfg, specs, layer_rules, layer_location, count, rules, sources, stacked)
    missing = sorted(_name(p) for p in set(specs) - set(sources))
    if missing:
      raise ValueError(f"no HF name for our parameters: {missing}")
    for path, layers in stacked.items():
      idx = sorted({ix for ix in layers if ix is not None})
      if idx and idx != list(range(specs[path].shape[0])):
        raise ValueError(f"{_name(path)}: layers map to stacked indices {idx}")
    for path, src in sources.items():
      yield Entry(path, rules[path], tuple(src), specs[path])

  @staticmethod
  def _plan_layers(mcfg, specs, layer_rules, layer_location, count, rules, sources, stacked):
    for i in range(count):
      prefix, layer_index = layer_location(mcfg, i)
      for rule in layer_rules:
        path = (*prefix, *split_path(rule.ours))
        if path not in specs:
          continue
        rules[path] = rule
        stacked.setdefault(path, []).append(layer_index)
        for e in (range(mcfg.num_experts) if rule.expert else [None]):
          sources.setdefault(path, []).append(
              (rule.hf.format(i=i, e=e), _index(rule, layer_index, e, specs[path].shape)))

  def hf_names(self, mcfg: ModelConfig, *, tied_lm_head: bool = False) -> list[str]:
    """Every HF tensor name the model of `mcfg` maps to."""
    self.check(mcfg)
    names = [name for e in self.plan(mcfg) for name, _ in e.sources]
    return names + ([self.tied_head_name] if tied_lm_head and mcfg.tie_word_embeddings else [])

  def hf_to_params(self, hf_state: Mapping[str, np.ndarray], mcfg: ModelConfig, *,
                   ignore: Callable[[str], bool] = lambda name: False) -> dict:
    """HF tensors → our pure-dict params in `mcfg.weight_dtype`. Strict: a missing tensor, a wrong
    shape or an HF tensor left over (unless `ignore(name)`) raises ValueError naming it. Each
    parameter is filled in place (64-byte aligned, see `aligned_empty`), so only one HF tensor is
    held beyond the output."""
    self.check(mcfg)
    hf = {k for k in hf_state if not (ignore(k) or k.endswith(self.ignored_suffixes))}
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
      if name not in hf:
        raise ValueError(f"HF state lacks {name}")
      used.add(name)
      return np.asarray(hf_state[name])

    specs = self.specs(mcfg)
    flat = {}
    for e in self.plan(mcfg, specs):
      value = aligned_empty(e.spec.shape, e.spec.dtype)
      for name, index in e.sources:
        value[index] = to_ours(take(name), block_shape(e.spec.shape, index), e.rule, name)
      flat[e.path] = value
    if mcfg.tie_word_embeddings and self.tied_head_name in hf:
      if not np.array_equal(np.asarray(hf_state[self.tied_head_name]),
                            np.asarray(hf_state[self.embedding_name])):
        raise ValueError(f"tie_word_embeddings=true but {self.tied_head_name} differs from the "
                         f"embedding")
      used.add(self.tied_head_name)
    extra = sorted(hf - used)
    if extra:
      raise ValueError(f"HF tensors with no place in our model: {extra}")
    for name in self.ours_only:
      path = split_path(name)
      if path in specs:
        flat[path] = np.zeros(specs[path].shape, specs[path].dtype)
    return unflatten(flat)

  def params_to_hf(self, params: Mapping, mcfg: ModelConfig, *, tied_lm_head: bool = False,
                   on_device: bool = False) -> Mapping[str, np.ndarray]:
    """Our params → HF tensors (dtype kept) as a lazy mapping: each tensor is made when read, so an
    exporter holds one at a time (a parameter is indexed where it lives before anything is copied:
    a scanned jax.Array gives one layer's block). With tied embeddings the head is left out (as
    `save_pretrained` does) unless `tied_lm_head`. Tensors are NumPy arrays, or with `on_device`
    the leaves' own arrays (a jax.Array stays on its devices; MaxText/refit.py)."""
    self.check(mcfg)
    flat = flatten(params)
    for name in self.ours_only:
      value = flat.get(split_path(name))
      if value is not None and np.any(np.asarray(value)):
        raise ValueError(f"{name} is not zero: Hugging Face has no such parameter, so the exported "
                         f"model would compute differently")
    where: dict[str, tuple[Any, Rule, tuple]] = {}
    for e in self.plan(mcfg):
      if e.path not in flat:
        raise ValueError(f"params lack {_name(e.path)}")
      value = flat[e.path]
      if tuple(value.shape) != tuple(e.spec.shape):
        raise ValueError(f"{_name(e.path)}: shape {tuple(value.shape)}, expected {e.spec.shape}")
      where.update((name, (value, e.rule, index)) for name, index in e.sources)
    if tied_lm_head and mcfg.tie_word_embeddings:
      where[self.tied_head_name] = where[self.embedding_name]
    return LazyHF(where, on_device)


def _never(name: str) -> bool:
  return False


def _same(name: str) -> str:
  return name


@dataclass(frozen=True)
class FolderMap:
  """How the tensors of a Hugging Face folder make our parameters when they are read a box at a
  time (MaxText/resolve/hf_sharded.py) rather than whole by `hf_to_params`; a family's
  `folder_map(names, mcfg)` gives it, saying what its `hf_to_params` does to the same folder:
    name_map   the rows, as `hf_to_params` uses them for a folder with these tensor `names`
    rename     a name of the map → the folder's (a multimodal folder read as its text model)
    ignore     folder tensors with no place that `hf_to_params` skips (a tower the config lacks,
               K/V of kv-shared layers, a part of the folder outside the view it reads)
    relayout   (folder name, its shape) → (a function of the whole tensor, the shape it gives)
               for the few small tensors whose layout is not a box of the file's (a channel
               order regrouped): those are read whole, then laid out, then boxed."""
  name_map: NameMap
  rename: Callable[[str], str] = _same
  ignore: Callable[[str], bool] = _never
  relayout: Callable[[str, tuple[int, ...]], tuple[Callable[[np.ndarray], np.ndarray],
                                                    tuple[int, ...]] | None] = (
      lambda name, shape: None)


class LazyHF(Mapping):
  def __init__(self, where: dict[str, tuple[Any, Rule, tuple]], on_device: bool = False):
    self._where, self._on_device = where, on_device

  def __getitem__(self, name: str) -> np.ndarray:
    value, rule, index = self._where[name]
    part = value[index]                     # indexed where it lives: only this block is copied
    if not self._on_device:
      part = np.asarray(part)
    out = to_hf(part, rule)
    return out.copy() if out is part and isinstance(out, np.ndarray) else out

  def __iter__(self):
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)
