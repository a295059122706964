"""Pre-flight memory check: will the step fit per device?

Counted per device, before anything is allocated or compiled: parameters + one gradient copy +
the optimizer state, from the actual shardings (so fsdp/tensor sharding is credited exactly), plus
an estimate of the step's activations (`activation_bytes`: what the remat policy keeps per layer
for the backward pass, one layer's working set, and the fp32 logits of one loss chunk — all for
this device's rows — plus what the family keeps beyond a generic decoder layer,
`Family.activation_bytes`, e.g. a Gated DeltaNet layer's chunked-rule arrays), and what a loop
keeps beside the step: a reference copy of the parameters, a decoding cache between steps (GRPO's
rollouts: it takes the activations' place, so the larger of the two counts). Over the
available memory the run is refused (exit 2); over `WARN_FRACTION` of it, a warning. After
compiling, `compiled_step_bytes` gives XLA's own count of the step's buffers for the same check.

On an accelerator (platform != cpu) the estimate is an estimate and XLA decides: the run is
refused before compiling only when the estimate exceeds the available memory by more than
ERROR_MARGIN (`MemoryEstimate.limit`); otherwise the step is compiled, XLA refuses at compile time
what does not fit (RESOURCE_EXHAUSTED: `compile_failure`, exit 2 with XLA's figure and what would
fit), and a step that compiled is never refused afterwards (`check_compiled`: a warning above
WARN_FRACTION). On CPU nothing refuses at compile time and the host's RAM is shared: the estimate
refuses at the available memory, and so does XLA's count after compiling.

The activation model (`activation_bytes`) and what it was fitted to — one TPU v5e (15.75 GiB
`bytes_limit`), Qwen3-0.6B at seq 2048, bf16 compute, fp32 weights and Adam (state 8.88 GiB),
splash attention, loss_chunk_length=128 unless said; XLA = `compiled_step_bytes`
(tests/test_memory_plan.py holds the table and checks every row that ran within ERROR_MARGIN):
  full b8 13.77 (fused splash backward 14.02; loss chunks of 512: 14.30), full b16 17.39,
  save_attention b6 15.58 (b4 fused 13.37), save_qkv_proj b4 15.12, save_qkv_attention b4 15.96,
  save_dot_except_mlp b4 16.33, save_dot_except_mlp_in b4 16.33; compile failures (XLA's
  figure): save_matmuls b8 23.04, save_matmuls b4 16.39, none b2 21.20.
The two `full` batches fix the per-row cost (0.45 GiB a row; the model: the carry 0.11 + the
working set 0.33, i.e. 28,672 values a token at 2 + 4 bytes — one layer's recomputed intermediates in bf16 and
their fp32 gradients) and the fixed part (~1.3 GiB: the bf16 copy of the fp32 weights, 1.11 GiB);
loss chunks of 512 raise XLA's count by 0.5 GiB, not by the 2 x 2.3 GiB of two fp32 logit copies:
the chunk's fp32 logits and the layers' backward are not live at once (the loss's gradient is
computed in the forward pass, losses/chunked.py), so the larger of the two counts, and the
chunk's cotangent is computed from its logits in place (one fp32 copy). The named saves' rows read
5-9 % above the estimate: they ran with XLA's figures up to 0.6 GiB over the limit, so near the
limit XLA's count is an upper bound, not the peak.
MoE (tests/test_memory_moe.py; Qwen3-30B-A3B widths, vocab 32,768, fp32 weights, seq 2048,
libtpu's deviceless v5e compile, equal to the chip's count): XLA's buffers without remat hold per
layer what `saved_bytes` lists (175 KB a token at 16 experts top-4: the routed copies and the
activation's fp32 operands half of it) and a second bf16 copy of the layers' weights (the scan's
saved casts); with 64 experts a layer's bf16 weight gradients (0.60 GiB) are live in the
backward. Estimate / XLA GiB: 4 layers, 16 experts top-4, batch 4: none 15.65 / 15.57 (13.11
before these terms), save_matmuls 12.10 / 12.46, full 10.91 / 10.79; 2 layers, 64 experts top-8:
batch 2 full 15.06 / 15.72, save_matmuls 15.46 / 16.49 (-6 %: `auto` picks it, XLA counts it
over the limit), batch 1 none 16.26 / 16.83; 2 layers, 16 experts top-4, batch 1, none 7.01 /
6.90. A single layer's step peaks in the embedding's gradient, not in the layers' backward: 1
layer, batch 1, none reads 4.92 / 4.02 (+22 %). The same `none` count puts Qwen3-0.6B's none b2
above at 22.69 (XLA's figure 21.20; 17.24 before). Qwen3-0.6B with bf16 weights and moments
(state 4.44), save_attention fused: b8 10.33 / 10.82, b4 7.69 / 8.35 (its 28 layers' attention
kernels copied, 0.33 GiB, counted; tests/test_memory_plan.py).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import psutil
from MaxText.backend.device_type import Device

GiB = 2**30


# a process can peak well above its step's XLA buffers (allocator high-water marks from
# initialisation; benchmarks/RESULTS.md, the memory pre-flight), so warn early
WARN_FRACTION = 0.7
# the process itself beyond the step's buffers: runtime, compiled code, host batches, allocator
# slack. On CPU the host's RAM also holds the Python process and its libraries; an accelerator's
# `bytes_limit` is already the memory the program may use (the runtime's reservation taken out),
# so only the compiled code, the next batch and the allocator's slack remain
RUNTIME_ALLOWANCE = 1 * GiB
RUNTIME_ALLOWANCE_ACCELERATOR = GiB // 4
# the estimate's error against XLA's count (the table above): on an accelerator a run is refused
# before compiling only above available x (1 + ERROR_MARGIN); below, XLA decides at compile time
ERROR_MARGIN = 0.10


@dataclass(frozen=True)
class MemoryEstimate:
  params: int          # bytes per device
  grads: int
  optimizer: int
  available: int       # bytes per device
  source: str          # where `available` came from
  activations: int = 0  # estimated activation bytes per device (`activation_bytes`)
  runtime: int = RUNTIME_ALLOWANCE
  reference: int = 0     # a second copy of the parameters kept all along (a KL reference)
  decode_cache: int = 0  # a decoding cache allocated between steps (not during one)
  decode_cache_fix: str = ""   # what lowers `decode_cache` (the keys), for the message
  platform: str = "cpu"        # the devices' platform: an accelerator's XLA refuses what won't fit

  @property
  def state(self) -> int:
    """Parameters (and a reference copy), gradients and optimizer state: what weight_dtype and
    sharding scale."""
    return self.params + self.reference + self.grads + self.optimizer

  @property
  def transient(self) -> int:
    """The step's activations, or the decoding cache between steps where that is larger."""
    return max(self.activations, self.decode_cache)

  @property
  def needed(self) -> int:
    return self.state + self.transient + self.runtime

  @property
  def limit(self) -> int:
    """Above this the pre-flight refuses: the available memory (CPU), or on an accelerator that
    plus the estimate's error margin (below it XLA's compile decides)."""
    if self.platform == "cpu":
      return self.available
    return int(self.available * (1 + ERROR_MARGIN))

  @property
  def fits(self) -> bool:
    """The estimate is within the available memory (what `remat_policy=auto` and `advice` ask)."""
    return self.needed <= self.available


def per_device_bytes(abstract: Any) -> int:
  """The bytes of `abstract`'s arrays one device holds (by their shardings)."""
  total = 0
  for leaf in jax.tree.leaves(abstract):
    shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shard) * leaf.dtype.itemsize
  return total


def available_bytes_per_device(devices: Sequence[Device]) -> tuple[int, str]:
  stats = None
  try:
    stats = devices[0].memory_stats()
  except Exception:  # noqa: BLE001 — some backends do not implement memory_stats
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{devices[0].device_kind} memory limit"
  # CPU: all local devices share the host's RAM
  local = max(1, sum(1 for d in devices if d.process_index == jax.process_index()))
  return psutil.virtual_memory().available // local, f"host RAM available / {local} local devices"


def activation_bytes(mcfg, *, rows: float, seq: int, loss_chunk: int = 0, schedule=None,
                     param_bytes: int = 0, layer_param_bytes: int | None = None) -> int:
  """Estimated activation bytes of one micro-batch step on a device holding `rows` sequences of
  `seq` tokens (generic dense/MoE decoder dimensions; a model with per-layer variants is counted
  with its base layer; c = the compute dtype's bytes, tokens = rows x seq):
    kept all along — the compute-dtype copy of the weights when the weights are wider
    (`param_bytes`, this device's parameter bytes, x c / their width); with `none` the decoder
    layers' (`layer_param_bytes`) twice: the layer scan also saves each layer's cast weights;
    weights already in the compute dtype are not cast, and XLA copies the layers' attention
    kernels into its matmuls' layout instead (`attention_share` of the layers' bytes);
    kept per layer for the backward pass — the layer input (the scan carry, tokens x D x c) under
    any remat policy; with `save_matmuls` also the weight-matmul outputs (q, k, v, o, MLP in/out);
    with a named policy the values it names, in the compute dtype (`save_attention`: the attention
    op's residuals, out [tokens, H x E] + its fp32 logsumexp [H, tokens]; `save_qkv_proj`: q, k, v;
    the output projection and the MLP's down projection D each); with `none` every
    intermediate as XLA keeps it (`saved_bytes`: the MoE's routed copies among them), the
    attention scores included;
    the larger of (they are not live at once: the loss's gradient is computed before the layers'
    backward) one layer's working set in the backward pass — its recomputed intermediates in the
    compute dtype and their fp32 gradients, tokens x (q k v, attention out, o, gate, up, down, the
    norms', the activation's) x (c + 4) (with `none` nothing is recomputed: the gradients alone,
    x c), the S x S scores of non-flash attention, and the layer's weight gradients in the compute
    dtype (`layer_param_bytes` / L x c / the weights' width: 0.60 GiB for 64 experts of
    Qwen3-30B-A3B's widths) — and the loss's: one chunk's fp32 logits [rows, chunk, V] (its
    cotangent computed from them in place), or with the whole sequence at once (`loss_chunk` 0)
    the logits kept for the backward and their gradient, two copies.
  The derivation's figures: the module docstring.
  Pipelined (`schedule`, layers/pipeline.py; `rows` then counts the stage axis's split of the
  batch, as the embedding and the loss see it): a stage keeps its L / S layers' residuals for
  every iteration of the schedule — (M x R + S - 1) / (M x R) times the layers' share of a run
  without stages (the bubble's iterations included) — and its working set is one microbatch's."""
  c = jnp.dtype(mcfg.compute_dtype).itemsize
  w = jnp.dtype(mcfg.weight_dtype).itemsize
  tokens = rows * seq
  D, H, K, E, L = (mcfg.emb_dim, mcfg.num_query_heads, mcfg.num_kv_heads, mcfg.head_dim,
                   mcfg.num_decoder_layers)
  F, k, experts = mcfg.mlp_dim, 0, mcfg.num_experts or 0
  if experts:   # routed copies: k expert MLPs per token (+ a shared expert)
    k = mcfg.num_experts_per_tok
    F = k * (mcfg.moe_mlp_dim or mcfg.mlp_dim) + mcfg.shared_expert_mlp_dim
  layer_param_bytes = param_bytes if layer_param_bytes is None else layer_param_bytes
  qkv = (H + 2 * K) * E
  matmul_outs = qkv + H * E + 2 * F + 2 * D          # q k v, attention out, o; gate, up; down
  values = matmul_outs + qkv + 4 * D + 2 * F         # a layer's intermediates, per token
  scores = rows * H * seq * seq if mcfg.attention in ("dot_product",) else 0
  per_layer = tokens * D * c                           # the carry
  lse = H * 4 / c                                      # the attention's fp32 logsumexp, per token
  attention = H * E + lse
  named = {"save_attention": attention, "save_qkv_proj": qkv,
           "save_qkv_attention": qkv + attention, "save_dot_except_mlp": qkv + attention + D,
           "save_dot_except_mlp_in": qkv + attention + 2 * D}
  # one layer's weight gradients in the compute dtype, before they join the fp32 ones
  weight_grads = layer_param_bytes / (L / schedule.stages if schedule else L) * c / w
  recomputed = c + 4          # a recomputed intermediate and its fp32 gradient, per value
  if mcfg.remat_policy == "save_matmuls":
    per_layer += tokens * (matmul_outs + lse) * c
  elif mcfg.remat_policy in named:   # the named values (layers/stack.py), each in the compute dtype
    per_layer += tokens * named[mcfg.remat_policy] * c
  elif mcfg.remat_policy == "none":   # every intermediate (`saved_bytes`), the carry among them;
    per_layer = tokens * saved_bytes(mcfg, c, F, k) + scores * (4 + c)
    recomputed = c            # the backward adds only their gradients
  working = tokens * values * recomputed + 3 * scores * 4 + weight_grads
  if loss_chunk > 0 and loss_chunk < seq:
    logits = rows * loss_chunk * mcfg.vocab_size * 4
  else:
    logits = 2 * rows * seq * mcfg.vocab_size * 4      # the logits and their gradient
  if schedule is not None:
    tasks = schedule.microbatches * schedule.repeats
    per_layer *= (tasks + schedule.stages - 1) / tasks
    working *= schedule.stages / schedule.microbatches     # one microbatch of the stage's rows
  cast = param_bytes * c // w if c < w else 0
  if mcfg.remat_policy == "none" and c < w:   # the layers' cast weights saved by the scan, too
    cast += layer_param_bytes * c // w
  if c == w:   # no cast to lay them out: XLA copies the stacked attention kernels for its matmuls
    cast += layer_param_bytes * attention_share(mcfg)
  return int(cast + L * per_layer + max(working, logits))


def attention_share(mcfg) -> float:
  """The attention projections' share of a decoder layer's weights (q, k, v, o against the MLP's
  or the experts' gate, up, down and the router)."""
  D, H, K, E = mcfg.emb_dim, mcfg.num_query_heads, mcfg.num_kv_heads, mcfg.head_dim
  attention = 2 * (H + K) * E * D
  if mcfg.num_experts:
    mlp = (mcfg.num_experts * 3 * D * (mcfg.moe_mlp_dim or mcfg.mlp_dim) + mcfg.num_experts * D
           + 3 * D * mcfg.shared_expert_mlp_dim)
  else:
    mlp = 3 * D * mcfg.mlp_dim
  return attention / (attention + mlp)


def saved_bytes(mcfg, c: int, F: int, k: int) -> int:
  """Bytes per token one decoder layer keeps for the backward pass when nothing is recomputed
  (`remat_policy=none`), as XLA's buffer assignment for a v5e lists them (Qwen3-30B-A3B widths,
  the module docstring): the query in fp32 and four compute-dtype copies (projected, normed,
  rotated, the attention's output), the keys and values likewise ([tokens, K x E]: one fp32, three
  compute-dtype); the two norms' fp32 inputs and four [tokens, D] compute-dtype values (the layer
  input, the normed inputs, the output projection); the MLP's gate, up and their product in the
  compute dtype and the activation's three fp32 operands (F wide: k routed copies + the shared
  expert); with experts also the routed copies in expert order and back in token order ([k, D]
  each) and the router's logits and fp32 probabilities."""
  D, H, K, E = mcfg.emb_dim, mcfg.num_query_heads, mcfg.num_kv_heads, mcfg.head_dim
  return int((4 + 4 * c) * H * E + (4 + 3 * c) * K * E + (8 + 4 * c) * D + (12 + 3 * c) * F
             + 2 * k * D * c + (mcfg.num_experts or 0) * (4 + c))


def runtime_share(devices: Sequence[Device]) -> int:
  """The process's allowance per device: on CPU the local devices share the host (and its one
  process), so each carries its part of the allowance; an accelerator's memory carries it whole."""
  if devices[0].platform != "cpu":
    return RUNTIME_ALLOWANCE_ACCELERATOR
  local = max(1, sum(1 for d in devices if d.process_index == jax.process_index()))
  return RUNTIME_ALLOWANCE // local


def estimate(abstract_state: dict, devices: Sequence[Device], activations: int = 0,
             trained: Any = None) -> MemoryEstimate:
  """`trained`: the parameters that get gradients (LoRA: the adapters), when not all."""
  params = per_device_bytes(abstract_state["params"])
  available, source = available_bytes_per_device(devices)
  grads = params if trained is None else per_device_bytes(trained)
  return MemoryEstimate(params=params, grads=grads,
                        optimizer=per_device_bytes(abstract_state["opt_state"]),
                        available=available, source=source, activations=activations,
                        runtime=runtime_share(devices), platform=devices[0].platform)


def _breakdown(est: MemoryEstimate) -> str:
  reference = (f" + a reference copy of the parameters {est.reference / GiB:.2f} GiB"
               if est.reference else "")
  transient = f"activations ~{est.activations / GiB:.2f} GiB"
  if est.decode_cache:
    transient = (f"max(the step's {transient}, the decoding cache between steps "
                 f"{_size(est.decode_cache)})")
  return (f"parameters {est.params / GiB:.2f} GiB{reference} + gradients {est.grads / GiB:.2f} "
          f"GiB + optimizer state {est.optimizer / GiB:.2f} GiB + {transient} + runtime "
          f"~{est.runtime / GiB:.2f} GiB = {est.needed / GiB:.2f} GiB needed per device, "
          f"{est.available / GiB:.2f} GiB available ({est.source})")


def check_fits(est: MemoryEstimate, advice: str = "") -> str | None:
  """None when the step fits; otherwise the message to stop with (ending with `advice`, what
  would fit, when given)."""
  if est.needed <= est.limit:
    return None
  margin = "" if est.limit == est.available else \
      f" (over it by more than the estimate's {ERROR_MARGIN:.0%} margin)"
  return (f"the model does not fit: {_breakdown(est)}{margin}. " + (advice or (
      "Shard the state over more devices (ici_fsdp_parallelism / ici_tensor_parallelism, or more "
      "hosts), use weight_dtype=bfloat16, lower per_device_batch_size or max_target_length, use "
      "remat_policy=full, set loss_chunk_length, or pick a smaller model.")))


@dataclass(frozen=True)
class Alternative:
  """The same run with `setting` (e.g. "weight_dtype=bfloat16"): its pre-flight estimate and its
  whole state's bytes (all devices), counted for the dtypes that run would hold."""
  setting: str
  est: MemoryEstimate
  total: int


def total_state_bytes(abstract_state: dict, trained: Any = None, reference: bool = False) -> int:
  """The whole state's bytes over all devices: parameters (twice with a `reference` copy),
  gradients (of `trained`, the parameters with gradients, when not all) and optimizer state."""
  grads = abstract_state["params"] if trained is None else trained
  return _bytes(abstract_state["params"]) * (2 if reference else 1) + _bytes(grads) \
      + _bytes(abstract_state["opt_state"])


def advice(est: MemoryEstimate, abstract_state: dict, smaller: list[tuple[str, int]],
           trained: Any = None, lighter: Alternative | None = None, fastest: str = "") -> str:
  """What would fit: `lighter`'s setting (bfloat16 weights, when they are not already; its
  estimate built for the dtypes that run holds: the moments follow moment_dtype) when its state
  fits, the number of devices of this size the whole state needs when split over all of them
  (fsdp; also with `lighter`) next to this device's activations and runtime, lighter activations
  when they alone leave no room, and the configs of the same family that fit here as they are
  (`smaller`: [(model_name, bytes needed per device)]). `trained`: the parameters with gradients
  (LoRA: the adapters), when not all. `fastest`: the fastest configuration of this run that fits
  (`memory_plan.fastest_fit`, key=value text), named first."""
  total = total_state_bytes(abstract_state, trained, bool(est.reference))
  room = est.available - est.transient - est.runtime   # for the state, per device
  ways = [f"the fastest that fits: {fastest}"] if fastest else []
  if lighter is not None and lighter.est.needed <= lighter.est.available:
    ways.append(f"{lighter.setting} (about {lighter.est.needed / GiB:.2f} GiB per device)")
  if room > 0:
    devices = lambda nbytes: math.ceil(nbytes / room)
    ways.append(f"the state ({total / GiB:.2f} GiB in all) split over at least {devices(total)} "
                f"devices with {est.available / GiB:.2f} GiB each ({room / GiB:.2f} GiB of it "
                f"left after activations and runtime)" +
                (f" ({devices(lighter.total)} with {lighter.setting})" if lighter else "") +
                " (ici_fsdp_parallelism, or more hosts)")
  elif est.decode_cache > est.activations:
    ways.append(f"a smaller decoding cache: it alone ({_size(est.decode_cache)} per device) leaves "
                f"no room for the state; {est.decode_cache_fix or 'decode fewer rows at once'}")
  else:
    bare = lambda nbytes: math.ceil(nbytes / max(est.available - est.runtime, 1))
    ways.append(f"fewer activations: they alone (~{est.activations / GiB:.2f} GiB) leave no room "
                f"for the state; lower per_device_batch_size or max_target_length, use "
                f"remat_policy=full or set loss_chunk_length; even without activations the state "
                f"({total / GiB:.2f} GiB in all) needs at least {bare(total)} devices of this "
                f"size" + (f" ({bare(lighter.total)} with {lighter.setting})" if lighter else "") +
                " (ici_fsdp_parallelism, or more hosts)")
  if smaller:
    ways.append("a smaller model of this family: " + ", ".join(
        f"model_name={name} ({_size(needed)} per device)" for name, needed in smaller))
  else:
    ways.append("no other model of this family in configs/models/ fits here either")
  return "What would fit: " + "; or ".join(ways) + "."


def _size(nbytes: int) -> str:
  return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 100 else f"{nbytes / 2**20:.1f} MiB"


def _bytes(tree: Any) -> int:
  return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def warning(est: MemoryEstimate) -> str | None:
  """A warning when the estimate is close to the available memory (but fits)."""
  if est.needed <= WARN_FRACTION * est.available:
    return None
  return (f"memory is tight: {_breakdown(est)}; the estimate is approximate and the run may run "
          f"out of memory")


def check_compiled(compiled, devices: Sequence[Device]) -> tuple[str, str | None]:
  """(a line on the compiled step's memory, the message to stop with or None) from XLA's count.
  On an accelerator XLA refuses at compile time what does not fit, and its count over-counts
  (steps with counts above the limit ran, the module docstring): a step that compiled is not
  refused, the line then says it is tight."""
  step = compiled_step_bytes(compiled)
  if step is None:
    return "", None
  available, source = available_bytes_per_device(devices)
  runtime = runtime_share(devices)
  line = (f"memory per device: the compiled step's buffers {step / GiB:.2f} GiB + runtime "
          f"~{runtime / GiB:.2f} GiB of {available / GiB:.2f} GiB available ({source})")
  if step + runtime <= available:
    return line, None
  if devices[0].platform != "cpu":
    return (f"{line}; tight (XLA compiled it, so it fits: its count is an upper bound near the "
            f"limit)"), None
  return line, (f"the compiled step does not fit: {line}. Lower per_device_batch_size or "
                f"max_target_length, use remat_policy=full, set loss_chunk_length, or shard over "
                f"more devices.")


def is_out_of_memory(error: BaseException) -> bool:
  """Whether a compile error is XLA refusing a program that does not fit (RESOURCE_EXHAUSTED)."""
  return "RESOURCE_EXHAUSTED" in str(error) or "Ran out of memory" in str(error)


def xla_memory_figure(error: BaseException) -> str | None:
  """The sentence of XLA's out-of-memory message that names the sizes ("Used 17.2G of 15.7G
  hbm", "HLO temporaries ... exceeds ..."), or None when it has none."""
  text = " ".join(str(error).split())
  figure = re.search(r"[Uu]sed [\d.]+\w* of [\d.]+\w* \w+|HLO temporaries .*?exceeds [\d.]+\w*", text)
  return figure.group(0) if figure else None


def compile_failure(error: BaseException, est: MemoryEstimate, fits: str = "") -> str:
  """The one line for a step XLA refused to compile for memory: XLA's own figure (its message's
  sentence naming the sizes), the pre-flight's estimate, and `fits` (what would fit)."""
  said = xla_memory_figure(error) or " ".join(str(error).split())[:200]
  return (f"the step does not fit in memory: XLA refused to compile it ({said}); the pre-flight "
          f"estimated {est.needed / GiB:.2f} GiB of {est.available / GiB:.2f} GiB available "
          f"({est.source})." + (f" What would fit: {fits}." if fits else " Lower per_device_batch_size, use "
                               "remat_policy=full or set loss_chunk_length."))


def compiled_step_bytes(compiled) -> int | None:
  """XLA's count of the compiled step's buffers per device (arguments + temporaries + outputs that
  do not reuse a donated argument), or None when the backend gives no memory analysis."""
  try:
    ma = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 — not every backend implements it
    return None
  if ma is None:
    return None
  return int(ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
             - ma.alias_size_in_bytes)
