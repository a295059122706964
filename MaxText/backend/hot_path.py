"""The one platform choice of the hot path: the XLA:CPU-tuned mechanisms, or XLA's plain ops.

`tuned` (the default on CPU) runs what makes bf16 fast on XLA:CPU: the weight matmul and the
dot-product attention core with custom VJPs (bf16 operands, fp32 accumulation, row-major operand
barriers: `layers/linear.py`, `layers/attention_lowp.py`), the projections of one input fused into
one matmul (`linear.fused_dense`), 16-bit concatenations and remat saves as raw bits
(`linear.concat_bits`, `layers/saved.py`), RMSNorm's hand-written VJP (`layers/norms.py`), and in
the process the depth-first XLA:CPU schedule and the host allocator setting, and the train
step's compile at LLVM level 1 (`cpu_devices`).

`plain` (the default on GPU and TPU) runs what XLA compiles well there and what MaxText,
torchtitan and Levanter run: `jnp.dot(..., preferred_element_type=...)` differentiated by
autodiff, the autodiff dot-product attention (or `attention=flash` / `cudnn`: kernels, chosen by
`select_attention`), autodiff RMSNorm, and values named with `jax.ad_checkpoint.checkpoint_name`
as they are for the remat policies. The two compute the same function; in fp32 they agree to the
summation order, in bf16 within its rounding (tests/test_hot_path.py).

`select_hot_path(name, platform)` decides (as `select_attention` does for attention); the
`hot_path` key (auto | tuned | plain) forces either path. The layers read the choice when they
are traced (`current()`): the one `use(name)` entered around the model's calls (`ModelDef`), else
the default of the platform JAX computes on (`jax.default_backend()`). A jitted function keeps the
path it was traced with.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

TUNED = "tuned"
PLAIN = "plain"
CHOICES = ("auto", TUNED, PLAIN)
TUNED_PLATFORMS = ("cpu",)   # where the tuned mechanisms pay (XLA:CPU's bf16 dot kernels)

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("maxtext_hot_path",
                                                                     default=None)


def select_hot_path(name: str, platform: str) -> str:
  """The `hot_path` key → the path that runs on `platform` (a JAX backend platform: "cpu", "gpu",
  "cuda", "rocm", "tpu"): auto → tuned on CPU, plain elsewhere; tuned / plain as they are."""
  if name not in CHOICES:
    raise ValueError(f"hot_path={name!r}: expected one of {', '.join(CHOICES)}")
  if name == "auto":
    return TUNED if platform in TUNED_PLATFORMS else PLAIN
  return name


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
  """Traces inside run the path `name` (tuned / plain); auto changes nothing (an enclosing `use`,
  else the platform's default)."""
  select_hot_path(name, "")   # refuses an unknown name
  if name == "auto":
    yield
    return
  token = _FORCED.set(name)
  try:
    yield
  finally:
    _FORCED.reset(token)


def current() -> str:
  """The path the layers being traced run: the one `use` entered, else the platform's default."""
  forced = _FORCED.get()
  if forced is not None:
    return forced
  import jax  # pylint: disable=import-outside-toplevel  (this module is imported before JAX starts)
  return select_hot_path("auto", jax.default_backend())


def tuned() -> bool:
  """Whether the layers being traced run the XLA:CPU-tuned mechanisms."""
  return current() == TUNED


def describe(requested: str, resolved: str, platform: str) -> str:
  """The run's log line: which path its layers take and why."""
  why = (f"hot_path=auto on {platform}" if requested == "auto" else f"hot_path={requested}")
  other = PLAIN if resolved == TUNED else TUNED
  what = ("XLA:CPU-tuned bf16 matmul/attention cores, RMSNorm VJP, raw-bit remat saves"
          if resolved == TUNED else "XLA's plain dot, autodiff attention and norm, named remat saves")
  return f"hot path {resolved} ({why}): {what}; hot_path={other} for the other"
