"""Named sites of the forward pass: where inspection (MaxText/inspect/) reads and edits activations.

Model code marks a value with `x = site("mlp_out", x)`. Outside inspection no probe is active and
`site` returns `x` itself (nothing enters the traced program: training and decoding are unchanged).
Inside `probing(probe)` — only while a forward is traced for inspection — the probe applies the
interventions that match the site and keeps the values asked for.

The vocabulary (TransformerLens-like; layer sites carry the decoder layer index: "mlp_out.3"):
  embed_out          the token embeddings as the first layer reads them (after any scaling)
  resid_pre.{l}      the residual stream entering layer l          [B, S, D]
  attn_scores.{l}    attention scores, masked, before the softmax    [B, H, S, T]
  attn_pattern.{l}   attention probabilities                         [B, H, S, T]
  attn_out.{l}       the token mixer's branch added to the residual   [B, S, D]
  mlp_out.{l}        the MLP's branch added to the residual           [B, S, D]
  resid_post.{l}     the residual stream leaving layer l              [B, S, D]
  final_norm_out     the final norm's output                          [B, S, D]
  logits             the head's output                                [B, S, V]
resid_pre / resid_post are marked by the pattern stack (MaxText/layers/stack.py: the residual is the
carry's first element); the attention sites by the dot-product attention op
(MaxText/layers/attention_ops.py); embed_out, attn_out and mlp_out by the model code.

Layer sites run inside `layer_frame(...)`, which the pattern stack opens around each layer call with
the layer's index — a Python int (unscanned) or a traced one inside a `lax.scan` together with the
static tuple of indices the scanned body stands for. An intervention for one layer is applied under
`lax.cond(index == l, fn, identity)`, so scanned layers are edited inside the compiled scan and an
identity function leaves every value bit for bit as it was. Captured layer values are handed back
by the frame (`Frame.captured`) so that the stack can return them through its scan or remat
boundary; only the layers asked for are kept (the stack stores them in buffers of that many rows).
"""
from __future__ import annotations

import contextlib
import contextvars
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

GLOBAL_SITES = ("embed_out", "final_norm_out", "logits")
LAYER_SITES = ("resid_pre", "attn_scores", "attn_pattern", "attn_out", "mlp_out", "resid_post")
HEAD_SITES = ("attn_scores", "attn_pattern")     # [B, H, S, T]: a `heads` selection applies


@dataclass(frozen=True)
class Context:
  """What an intervention `fn(x, context)` is told: the site's full name ("mlp_out.3"), its base
  name ("mlp_out"), and the layer index (None for embed_out / final_norm_out / logits; a traced
  int32 when one function is applied at several layers of a scan through a glob)."""
  name: str
  base: str
  layer: Any = None


def parse(name: str) -> tuple[str, str | None]:
  """"mlp_out.3" → ("mlp_out", "3"); "logits" → ("logits", None); globs stay ("resid_post", "*")."""
  base, dot, layer = name.partition(".")
  return base, (layer if dot else None)


def layer_of(name: str) -> int:
  """The layer of a layer site's name ("mlp_out.3" → 3)."""
  layer = parse(name)[1]
  if layer is None:
    raise ValueError(f"site {name!r} is not a layer's")
  return int(layer)


def expand(pattern: str, num_layers: int) -> list[str]:
  """The site names a pattern (exact or glob, e.g. "resid_post.*", "attn_*.2") stands for; a
  ValueError naming it when it matches nothing of the vocabulary."""
  names = list(GLOBAL_SITES) + [f"{b}.{l}" for b in LAYER_SITES for l in range(num_layers)]
  hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
  if not hits:
    raise ValueError(f"site {pattern!r} names no site of this {num_layers}-layer model; sites: "
                     f"{', '.join(GLOBAL_SITES)}, {', '.join(b + '.{l}' for b in LAYER_SITES)} "
                     f"(l < {num_layers}; globs allowed)")
  return hits


@dataclass
class Frame:
  """One layer call under a probe: its index (int or traced), the indices it may stand for, the
  layer bases to capture, and what was captured ({base: value})."""
  index: Any
  layers: tuple[int, ...]
  wanted: frozenset[str]
  captured: dict[str, Any] = field(default_factory=dict)


class Probe:
  """The interventions and captures of one traced forward.

  interventions: {site name or glob: fn(x, Context) -> x'} applied in order;
  capture: site names or globs to keep; heads: the heads kept at attention sites (None: all).
  After the forward, `results` holds {site name: value} (layer values stored by the stack) and
  `reached` the names the forward passed through."""

  def __init__(self, num_layers: int, interventions: dict[str, Callable] | None = None,
               capture: tuple[str, ...] = (), heads: tuple[int, ...] | None = None):
    self.num_layers = num_layers
    self.interventions = []          # (base, frozenset of layers or None, fn, exact name or None)
    for pattern, fn in (interventions or {}).items():
      names = expand(pattern, num_layers)
      base = parse(names[0])[0]
      if any(parse(n)[0] != base for n in names):
        raise ValueError(f"intervention {pattern!r} spans several kinds of site "
                         f"({sorted({parse(n)[0] for n in names})}): give one per kind")
      layers = None if base in GLOBAL_SITES else frozenset(layer_of(n) for n in names)
      self.interventions.append((base, layers, fn, pattern if len(names) == 1 else None))
    self.capture: dict[str, set[int] | None] = {}
    for pattern in capture:
      for n in expand(pattern, num_layers):
        base, layer = parse(n)
        if layer is None:
          self.capture[base] = None
        else:
          held = self.capture.setdefault(base, set())
          assert held is not None, f"site {base!r} is captured both whole and per layer"
          held.add(int(layer))
    self.heads = None if heads is None else tuple(heads)
    self.results: dict[str, Any] = {}
    self.reached: set[str] = set()
    self._frame: Frame | None = None

  # ---- what the stack asks -----------------------------------------------------------------------
  def captured_layers(self, base: str) -> set[int]:
    return set(self.capture.get(base) or ())

  def wanted(self, layers: tuple[int, ...]) -> frozenset[str]:
    """The layer bases to capture at some layer of `layers`."""
    return frozenset(b for b in LAYER_SITES if self.captured_layers(b) & set(layers))

  def store(self, base: str, layer: int, value) -> None:
    self.results[f"{base}.{layer}"] = value

  @contextlib.contextmanager
  def frame(self, index, layers: tuple[int, ...], wanted: frozenset[str]) -> Iterator[Frame]:
    outer, self._frame = self._frame, Frame(index, layers, wanted)
    try:
      yield self._frame
    finally:
      self._frame = outer

  # ---- a site ------------------------------------------------------------------------------------
  def visit(self, base: str, x):
    frame = self._frame
    if base in GLOBAL_SITES:
      self.reached.add(base)
      for b, _, fn, _ in self.interventions:
        if b == base:
          x = _checked(fn(x, Context(base, base)), x, base)
      if base in self.capture:
        self.results[base] = x
      return x
    if frame is None:
      raise ValueError(f"site {base!r} was reached outside a decoder layer (the pattern stack "
                       f"opens a frame around each layer)")
    self.reached.update(f"{base}.{l}" for l in frame.layers)
    for b, layers, fn, exact in self.interventions:
      if b != base or not layers & set(frame.layers):
        continue
      hits = sorted(layers & set(frame.layers))
      if isinstance(frame.index, int):
        if frame.index in layers:
          x = _checked(fn(x, Context(f"{base}.{frame.index}", base, frame.index)), x, base)
        continue
      layer = hits[0] if len(hits) == 1 else frame.index
      name = f"{base}.{layer}" if len(hits) == 1 else exact or f"{base}.*"
      hit = jnp.isin(frame.index, jnp.asarray(hits))
      x = jax.lax.cond(hit, lambda v, fn=fn, name=name, layer=layer:
                       _checked(fn(v, Context(name, base, layer)), v, base), lambda v: v, x)
    if base in frame.wanted:
      kept = x
      if base in HEAD_SITES and self.heads is not None:
        kept = x[:, np.asarray(self.heads)]
      frame.captured[base] = kept
    return x


def _checked(y, x, base: str):
  y = jnp.asarray(y)
  if y.shape != x.shape:
    raise ValueError(f"an intervention at {base} returned shape {y.shape}; the site's value has "
                     f"shape {x.shape}")
  return y.astype(x.dtype)


_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("maxtext_probe", default=None)


@contextlib.contextmanager
def probing(probe: Probe):
  """Makes `site` live while a forward is traced inside."""
  token = _PROBE.set(probe)
  try:
    yield probe
  finally:
    _PROBE.reset(token)


@contextlib.contextmanager
def unprobed():
  """Makes `site` a no-op inside (e.g. an encoder tower whose layers are no decoder layers)."""
  token = _PROBE.set(None)
  try:
    yield
  finally:
    _PROBE.reset(token)


def active() -> Probe | None:
  return _PROBE.get()


def site(base: str, x):
  """`x`, or under a probe, `x` after the interventions at this site (and captured if asked)."""
  probe = _PROBE.get()
  return x if probe is None else probe.visit(base, x)
