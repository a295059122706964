"""The one schema: every config key's name, type, default, allowed range and one-line doc.

Each field of `Config` is declared once with `key(default, doc, ...)` (MaxText/config/spec.py):
here and in `keys_run.py` (a training run's keys: `Config` derives from its `RunKeys`) for the keys
generic code or several families read, in the family's own folder for the keys
only one family reads (`MaxText/models/<family>/keys.py`, composed in by `add_keys`; below):
  choices     the allowed values of a str key
  min/max/gt  inclusive numeric bounds / exclusive lower bound
  model       the model reads it: it is a field of `ModelConfig` (MaxText/models/model_config.py)
  data        the data pipeline reads it: a field of `DataConfig` (MaxText/data/config.py)
  arch        it changes what the parameters mean, so `load_parameters_path` takes it from the
              checkpoint (default: the same as `model`)
  carried     a training setting that comes with the model (a converted MoE's balancing weight):
              `load_parameters_path` takes it from the checkpoint unless the user sets it
  section     the first key of a section of configs/base.yml starts it under this title
  tools       the programs that read it (MaxText/config/tools.py); default: those its section's
              first key names with `section_tools`. One of them set away from its default for a
              program that does not read it is refused (exit 2): no key is silently ignored
  note        a comment block written above the key in configs/base.yml

Everything else is derived from this module: `configs/base.yml` is rendered from it (`python -m
MaxText.config.render`; tests/test_config.py fails when the file is stale), `ModelConfig` and
`DataConfig` are views of its fields, a family refuses a model key it does not implement when the
key is away from its default here, and the implementation tables of allowed values (remat
policies, activations, dispatch, dataset formats, ...) are checked against `choices` by the tests.
This package imports nothing else of MaxText but the schema's parts that live in the family
folders (the table `MaxText/models/families.py` and each family's `keys.py`, which import only
this package): every other package may read it.

A family's own keys (`add_keys`) are fields of `Config` and of the views like the common ones:
`KEYS` holds them after the model section, `MODEL_KEYS` and the other name sets are read live
from `KEYS`, and a key's `Spec.family` names the family that declared it.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

# the run's keys and the constants they use (AUTO... re-exported: the schema's names)
from MaxText.config.keys_run import AUTO as AUTO
from MaxText.config.keys_run import AUTO_LOSS_CHUNK as AUTO_LOSS_CHUNK
from MaxText.config.keys_run import AUTO_TOOL_DTYPE as AUTO_TOOL_DTYPE
from MaxText.config.keys_run import AUTO_TRAINING_DTYPE as AUTO_TRAINING_DTYPE
from MaxText.config.keys_run import DTYPES, RunKeys
from MaxText.config.spec import (KeyNames, Spec, copy_field, extend_dataclass, key,
                                 shrink_dataclass, specs_of)
from MaxText.config.tools import CONVERT, DECODERS, MODEL_TOOLS, SAMPLERS, TEXT_TRAINERS, TRAINERS


MESH_AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


def parallelism_key(level: str, axis: str) -> str:
  """The key sizing mesh axis `axis` at `level` (ici | dcn): `ici_data_parallelism`, …; the
  `stage` axis is sized by `ici_pipeline_parallelism` / `dcn_pipeline_parallelism`."""
  return f"{level}_{'pipeline' if axis == 'stage' else axis}_parallelism"

_RULES = [
    ["activation_batch", ["data", "stage", "fsdp", "expert"]],
    ["activation_length", ["context"]],
    ["activation_embed", None],
    ["activation_heads", ["tensor"]],
    ["activation_kv_heads", ["tensor"]],
    ["activation_mlp", ["tensor"]],
    ["activation_vocab", ["tensor"]],
    ["embed", ["fsdp", "context", "expert"]],
    ["embed", ["fsdp", "context"]],
    ["embed", ["fsdp"]],
    ["heads", ["tensor"]],
    ["kv_heads", ["tensor"]],
    ["head_dim", None],
    ["mlp", ["tensor"]],
    ["vocab", ["tensor"]],
    ["exp", ["expert"]],
    ["layers", ["stage"]],
    ["norm", None],
    # encoder towers (a multimodal family's vision / audio encoders): sharded as the text model
    ["activation_vision_batch", ["data", "fsdp", "expert"]],
    ["activation_vision_batch", ["data", "fsdp"]],
    ["activation_vision_batch", ["data"]],
    ["vision_embed", ["fsdp"]],
    ["vision_heads", ["tensor"]],
    ["vision_kv_heads", ["tensor"]],
    ["vision_mlp", ["tensor"]],
    ["audio_embed", ["fsdp"]],
    ["audio_heads", ["tensor"]],
    ["audio_mlp", ["tensor"]],
    ["audio_conv", None],
]


if TYPE_CHECKING:   # the families' keys, fields `add_keys` gives Config at import (views_source.py)
  from MaxText.config.views_generated import FamilyKeys

  class _ConfigBase(RunKeys, FamilyKeys):
    pass
else:
  _ConfigBase = RunKeys


@dataclass(frozen=True, kw_only=True)
class Config(_ConfigBase):
  """Every key: the run's (`RunKeys`, MaxText/config/keys_run.py), then the tools', the mesh's and
  the multi-host start-up's below; a family's own keys join after the model section (`add_keys`)."""

  # ---- decoding --------------------------------------------------------------------------------
  hf_path: str = key(
      "", "a Hugging Face folder (local or gs://): train / grpo read it straight onto the mesh, "
      "each process its own slices; decode / evaluate / inspect / lm_eval convert it in memory "
      "(instead of load_parameters_path); to_maxtext converts it; logit_check compares with it",
      section="decoding (python -m MaxText.decode; MaxText.inference)",
      section_tools=DECODERS,
      tools=(*DECODERS, *TRAINERS, "evaluate", "logit_check", "lm_eval", "serve", *CONVERT))
  prompt: str = key("", 'the prompt text ("" in a training sample: see sample_prompt_tokens)',
                    tools=(*DECODERS, *TEXT_TRAINERS))
  prompt_ids: list[int] = key([], "the prompt as token ids, e.g. 1,5,9 (no tokenizer needed)",
                              tools=(*DECODERS, *TEXT_TRAINERS))
  prompt_file: str = key("", "one prompt per line (.txt), or .jsonl lines with prompt, "
                         "prompt_ids or chat messages")
  image: list[str] = key(
      [], "image files for the prompt(s) (image=a.png image=b.png: several, in order); a model "
      "whose family takes images, prepared by its processor (MaxText/data/multimodal/)",
      repeat=True, tools=DECODERS)
  audio: list[str] = key([], "WAV clips for the prompt(s), at the feature extractor's rate "
                         "(audio=a.wav audio=b.wav: several)", repeat=True, tools=DECODERS)
  chat: bool = key(False, "render prompts (and jsonl messages) with the tokenizer's own chat "
                   "template (tokenizer_config.json / chat_template.jinja)")
  max_new_tokens: int = key(64, "tokens generated per prompt (at most)", min=1,
                            tools=(*DECODERS, *SAMPLERS))
  temperature: float = key(0.0, "0 = greedy; else sample from softmax(logits / temperature)",
                           min=0, tools=("decode", "grpo"))
  top_k: int = key(0, "sample among the k most likely tokens only; 0 = off", min=0,
                   tools=("decode", "grpo"))
  top_p: float = key(1.0, "sample from the smallest set holding probability >= p; 1 = off",
                     gt=0, max=1, tools=(*DECODERS, *SAMPLERS))
  min_p: float = key(0.0, "drop tokens less likely than min_p x the most likely; 0 = off", min=0,
                     max=1, tools=(*DECODERS, *SAMPLERS))
  stop: list[str] = key([], "stop once the completion text contains one of these strings",
                        tools=(*DECODERS, *SAMPLERS))
  eos_ids: list[int] = key([], "stop at these token ids; [] = the tokenizer's eos",
                           tools=(*DECODERS, *SAMPLERS, "lm_eval", "serve"))
  decode_output: str = key("", "write one JSON line per prompt (prompt_ids, output_ids, "
                           "output_logprobs, text) to this file", tools=("decode",))
  speculative_tokens: int = key(
      0, "greedy decoding drafts this many tokens per step with the model's MTP head "
      "(mtp_num_layers > 0) and verifies them in one forward: the same output as plain greedy "
      "decoding; 0 = off", min=0, tools=("decode",))
  decode_batch_size: int = key(8, "prompts decoded together (padded up to a power of two)",
                               min=1, tools=(*DECODERS, "lm_eval"))
  max_cache_length: int = key(0, "positions the KV cache holds (prompt + new tokens); 0 = the "
                              "longest prompt + max_new_tokens, rounded up to a power of two "
                              "(serve: per slot; 0 = max_position_embeddings, at most 2048)",
                              min=0, tools=(*DECODERS, "lm_eval", "serve"))
  cache_dtype: str = key("auto", "KV cache dtype: auto (bfloat16 on GPU/TPU, else dtype) | "
                         "float32 | bfloat16 | float16", choices=("auto", *DTYPES),
                         tools=(*DECODERS, *SAMPLERS, "lm_eval", "serve"))
  decode_unroll_layers: bool = key(True, "decoding restacks a scanned model's parameters per layer "
                                   "at load, so a step reads each layer's weights in place (the "
                                   "scan slices them out of the stack on every step); false = the "
                                   "scan's layout", tools=(*DECODERS, "lm_eval", "serve"))
  decode_attention: str = key("auto", "a decoding step's attention over a full-attention KV cache: "
                              "auto (pallas on a TPU, else xla) | xla (einsums over the whole cache "
                              "bucket, after an XLA scatter of the step's K/V) | pallas (a Pallas "
                              "TPU kernel reading only the cache blocks that hold live positions "
                              "and storing the step's K/V itself; interpreted on a CPU, so slow "
                              "there); windowed layers and multi-token steps use xla",
                              choices=("auto", "xla", "pallas"), model=True, arch=False,
                              tools=(*DECODERS, "lm_eval", "serve"))

  # ---- serving ---------------------------------------------------------------------------------
  serve_slots: int = key(8, "decode slots: requests decoded together (continuous batching)", min=1,
                         section="serving (python -m MaxText.serve)", section_tools=("serve",))
  serve_queue: int = key(64, "requests waiting for a slot at most; more get 503 + Retry-After",
                         min=1)
  serve_chunk: int = key(8, "decoding steps per engine call; requests join and leave between "
                         "calls", min=1)
  serve_min_rows: int = key(1, "the fewest slot rows a decoding call runs (the busy ones, padded; "
                            "rounded up to a power of two): a call of few busy slots runs a "
                            "row bucket of 1, 2, 4, ... rows, each bucket its own programs; on "
                            "a TPU a few rows cost what one does, so serve_slots there compiles "
                            "one program per cache window", min=1)
  serve_interrupt: bool = key(True, "a decoding call ends after the step in flight when a "
                              "request waits for a free slot (a host callback between two "
                              "steps: a newcomer waits a step, not a call); false = calls run "
                              "their serve_chunk steps, no callback (docs/decoding.md)")
  serve_prefill_chunk: int = key(128, "prompt tokens prefilled between two decoding calls while "
                                 "other slots decode (a longer prompt goes in pieces, every "
                                 "family); 0 = whole prompts", min=0)
  serve_prefix_cache: int = key(0, "prefix caching: a prompt that starts with at least this many "
                                "tokens a slot's cache still holds reuses them instead of "
                                "prefilling them (docs/decoding.md); 0 = off", min=0)
  serve_warmup: bool = key(False, "compile the decoding calls' programs (every row bucket x "
                           "cache window, greedy, without top log-probabilities) before "
                           "listening, so no request waits on one")
  serve_max_tokens: int = key(16384, "a request's n x max_tokens at most (400 beyond)", min=1)
  serve_max_body_bytes: int = key(8 << 20, "a request body's bytes at most (413 beyond)", min=1)
  serve_model_name: str = key("", "the model's name in /v1/models and requests; \"\" = hf_path's "
                              "folder name, or the run's for a run's checkpoints (runs/NAME/"
                              "checkpoints[/STEP]: NAME), else the checkpoint folder's")
  log_prompts: bool = key(False, "log each request's prompt and completion text (off: only "
                          "their token counts)")

  # ---- reinforcement learning (GRPO) -----------------------------------------------------------
  prompts: str = key(
      "", "GRPO: .jsonl prompts, one object a line with prompt (text), prompt_ids or chat messages; "
      "the whole row goes to the reward functions",
      section="reinforcement learning (python -m MaxText.rl.grpo)", section_tools=("grpo",))
  reward: str = key("", "GRPO: reward functions package.module:function, comma-separated; each is "
                    "called as f(prompt, completion, row) -> number")
  reward_weights: list[float] = key([], "GRPO: one weight per reward function; [] = all 1")
  num_generations: int = key(4, "GRPO: completions sampled per prompt (the group, >= 2)", min=1)
  prompts_per_step: int = key(4, "GRPO: prompts per rollout batch (rows = this x num_generations)",
                              min=1)
  num_iterations: int = key(1, "GRPO: optimizer passes over each rollout batch (1 = on-policy)",
                            min=1)
  microbatch_size: int = key(0, "GRPO / the policy API: rows per micro-batch; the batch's "
                             "gradients are accumulated over them in one update (0 = the whole "
                             "batch at once)", min=0)
  rollout_placement: str = key(
      "colocated", "GRPO: colocated (the engine on the training mesh, no weight copy) | separate "
      "(the engine on the second half of the devices, the weights shipped by the refit stream "
      "after each update; weight_shipping_s)", choices=("colocated", "separate"))
  rollout_offload: bool = key(False, "GRPO: the optimizer state moves to host memory while the "
                              "engine samples (its device memory free for the decoding cache), "
                              "back before the update")
  advantage_estimator: str = key("grpo", "grpo: (r - mean) / std per group | drgrpo: r - mean | "
                                 "rloo: leave-one-out", choices=("grpo", "drgrpo", "rloo"))
  epsilon_low: float = key(0.2, "PPO clip: the ratio is clipped below at 1 - epsilon_low", min=0)
  epsilon_high: float = key(0.2, "PPO clip: above at 1 + epsilon_high", min=0)
  dual_clip: float = key(0.0, "dual clip: for negative advantages the loss is at most dual_clip x "
                         "|A|; 0 = off, else > 1", min=0)
  dynamic_sampling: bool = key(False, "GRPO: DAPO's dynamic sampling: groups whose rewards are "
                               "all equal are dropped from the loss (their rows weighted 0) and "
                               "counted (groups_dropped)")
  dynamic_sampling_rounds: int = key(0, "GRPO: with dynamic_sampling, up to this many more "
                                     "rounds replace the groups of equal rewards by groups of new "
                                     "prompts (groups_resampled) before the rest are dropped; 0 = "
                                     "drop only", min=0)
  overlong_buffer: int = key(0, "GRPO: DAPO's overlong shaping: a completion longer than "
                             "max_new_tokens - this loses up to 1 reward, linearly to -1 at "
                             "max_new_tokens; 0 = off", min=0)
  importance_sampling: str = key("token", "GRPO: token (a ratio per token, PPO / GRPO) | sequence "
                                 "(GSPO: one ratio per completion, the exp of its tokens' mean "
                                 "log-ratio, clipped as a whole)", choices=("token", "sequence"))
  kl_beta: float = key(0.0, "weight of the KL penalty to the reference (the loaded parameters; "
                       "with LoRA the base without adapters)", min=0)
  kl_estimator: str = key("k3", "KL estimator: k1 (logp - ref), k2 (half its square), k3",
                          choices=("k1", "k2", "k3"))
  loss_aggregation: str = key(
      "token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-scale "
      "(Dr. GRPO: per-sequence sum / max_new_tokens)",
      choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-scale"))
  max_bad_rewards: int = key(0, "GRPO: reward calls that raise or return a non-number (logged, "
                             "counted, scored 0) before the run stops with exit 3", min=0)
  eval_prompts: str = key("", "GRPO: held-out .jsonl prompts; before the first step, every "
                          "eval_reward_period steps and after the last, the mean reward of "
                          "num_generations samples of each (eval_reward) and of a greedy one "
                          "(eval_reward_greedy)")
  eval_reward_period: int = key(0, "GRPO: evaluate eval_prompts every N steps (0 = only before the "
                                "first step and after the last)", min=0)

  # ---- preference optimization (DPO) -----------------------------------------------------------
  preferences: str = key(
      "", "DPO: .jsonl preference pairs, one object a line: prompt, chosen, rejected (text, or chat "
      "messages rendered with the tokenizer's chat template)",
      section="preference optimization (python -m MaxText.dpo)", section_tools=("dpo",))
  eval_preferences: str = key("", "DPO: held-out .jsonl pairs; their rewards/* and logps/* "
                              "(eval/...) before the first step, every eval_preferences_period "
                              "steps and after the last")
  eval_preferences_period: int = key(0, "DPO: evaluate eval_preferences every N steps (0 = only "
                                     "before the first step and after the last)", min=0)
  dpo_loss: str = key("sigmoid", "sigmoid | ipo | hinge | robust (against the reference: the "
                      "loaded parameters; with LoRA the base) | orpo | simpo (reference-free)",
                      choices=("sigmoid", "ipo", "hinge", "robust", "orpo", "simpo"))
  beta: float = key(0.1, "DPO: the reward scale beta (ipo: the regularisation tau; orpo: the "
                    "odds-ratio weight lambda)", gt=0)
  label_smoothing: float = key(0.0, "DPO: the probability a label is flipped (robust, simpo; must "
                               "be < 0.5)", min=0, max=0.5)
  simpo_gamma: float = key(0.5, "SimPO: the target reward margin gamma", min=0)
  preference_packing: bool = key(False, "DPO: both sequences of a pair (prompt + chosen, prompt "
                                 "+ rejected) packed into one row, apart by segment ids: half the "
                                 "rows when a pair fits max_target_length")
  precompute_ref_log_probs: bool = key(
      False, "DPO: the reference's log-probabilities of every pair computed once before the first "
      "step (written to the run directory's reference_logps/) instead of by a frozen copy held "
      "all along")
  reference_logps: str = key("", "DPO: a reference_logps folder written by a run with "
                             "precompute_ref_log_probs (one file per pairs file): read, nothing "
                             "computed, no reference held")

  # ---- distillation ----------------------------------------------------------------------------
  teacher_path: str = key(
      "", "distill: the teacher's checkpoint (any family or size; the student's vocabulary)",
      section="distillation (python -m MaxText.distill)", section_tools=("distill",))
  distill_loss: str = key("forward_kl", "distill: forward_kl (KL(teacher || student)) | "
                          "reverse_kl (KL(student || teacher)) | jsd (generalized JSD, "
                          "distill_beta)", choices=("forward_kl", "reverse_kl", "jsd"))
  distill_beta: float = key(0.5, "distill: the generalized JSD's beta (the mixture is beta x "
                            "teacher + (1 - beta) x student; 0 = forward KL, 1 = reverse KL)",
                            min=0, max=1)
  distill_temperature: float = key(1.0, "distill: both models' logits are divided by this "
                                   "before the divergence, which is scaled by its square", gt=0)
  distill_alpha: float = key(0.5, "distill: loss = alpha x divergence + (1 - alpha) x the hard "
                             "labels' cross-entropy", min=0, max=1)

  # ---- mesh and sharding -----------------------------------------------------------------------
  mesh_axes: list[str] = key(list(MESH_AXES), "mesh axis order, outermost first",
                             section="mesh and sharding", section_tools=MODEL_TOOLS)
  ici_data_parallelism: int = key(1, 'within a slice; at most one -1 ("the rest") per level')
  ici_fsdp_parallelism: int = key(-1, "parameters and batch sharded over this axis (ZeRO-3 style)")
  ici_context_parallelism: int = key(
      1, "sequence sharding of activations (context parallelism: attention=flash or dot_product; "
      "the sequence length a multiple of 2 x the context axis with flash)")
  ici_expert_parallelism: int = key(1, "MoE experts")
  ici_tensor_parallelism: int = key(1, "heads / mlp / vocab sharding")
  dcn_data_parallelism: int = key(-1, "across slices (multi-slice hybrid mesh)")
  dcn_fsdp_parallelism: int = key(1, "across slices")
  dcn_context_parallelism: int = key(1, "across slices")
  dcn_expert_parallelism: int = key(1, "across slices")
  dcn_tensor_parallelism: int = key(1, "across slices")
  ici_pipeline_parallelism: int = key(1, "pipeline stages (the `stage` axis): the decoder layers "
                                      "split into consecutive groups, one per stage")
  dcn_pipeline_parallelism: int = key(1, "across slices")
  num_pipeline_microbatches: int = key(
      0, "microbatches each (gradient accumulation) micro-batch is cut into for the pipeline; "
      "0 = as many as stages", min=0)
  num_pipeline_repeats: int = key(
      1, "circular pipeline: each stage holds this many non-adjacent groups of layers, a "
      "microbatch passes every stage this many times (smaller bubble; needs microbatches >= "
      "stages)", min=1)
  context_parallel_strategy: str = key(
      "all_gather", "attention=flash over the context axis: all_gather (K/V gathered, each shard "
      "its own queries) | ring (K/V blocks passed around the axis, online-softmax merge); the "
      "batch runs in a load-balanced token order (each shard an early and a late chunk)",
      choices=("all_gather", "ring"), model=True, arch=False, tools=MODEL_TOOLS)
  logical_axis_rules: list = key(
      _RULES, "logical axis -> mesh axes: one [name, mesh axes] row each",
      note="logical axis -> mesh axes. Several rows for one name are ordered fallbacks: the first "
      "whose mesh\naxes are not yet used by another dimension of the same array wins. null = "
      "replicated.")

  # ---- multi-host ------------------------------------------------------------------------------
  coordinator_address: str = key(
      "", 'host:port of process 0; "" = JAX_COORDINATOR_ADDRESS[:JAX_COORDINATOR_PORT], or JAX\'s '
      "own detection (Cloud TPU, Slurm, Open MPI)",
      section="multi-host (jax.distributed: one process per host, all devices global)",
      section_tools=TRAINERS)
  num_processes: int = key(0, "processes (hosts) in the run; 0 = JAX_NUM_PROCESSES / "
                           "JAX_PROCESS_COUNT / NNODES, else 1", min=0)
  process_id: int = key(-1, "this process's index; -1 = JAX_PROCESS_ID / NODE_RANK / "
                        "JOB_COMPLETION_INDEX", min=-1)
  distributed_init_timeout_s: int = key(300, "how long the processes wait for each other at "
                                        "start-up", min=1)
  distributed_heartbeat_timeout_s: int = key(100, "a process silent this long is declared dead "
                                             "and the others stop (non-zero exit)", min=1)

  # ---- derived values (methods, never stored) ----------------------------------------------------
  def ici_parallelism(self) -> list[int]:
    return [getattr(self, parallelism_key("ici", a)) for a in self.mesh_axes]

  def dcn_parallelism(self) -> list[int]:
    return [getattr(self, parallelism_key("dcn", a)) for a in self.mesh_axes]

  def global_batch_size(self, num_devices: int) -> int:
    """Sequences per optimizer step (all micro-batches of all devices)."""
    return self.micro_batch_size(num_devices) * self.gradient_accumulation_steps

  def micro_batch_size(self, num_devices: int) -> int:
    return int(round(self.per_device_batch_size * num_devices))

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


_FAMILY_SECTION_TOOLS = (*MODEL_TOOLS, *CONVERT)     # as the model section's keys
KEYS: dict[str, Spec] = specs_of(Config)             # in declaration (= base.yml) order
MODEL_KEYS = KeyNames(KEYS, lambda s: s.model)      # read live: a family's keys join them
DATA_KEYS = KeyNames(KEYS, lambda s: s.data)
ARCHITECTURE_KEYS = KeyNames(KEYS, lambda s: s.arch)
CARRIED_KEYS = KeyNames(KEYS, lambda s: s.carried)
_FAMILY_KEYS: dict[str, type] = {}                   # family → its `Keys` dataclass
_VIEWS: list[tuple[type, KeyNames]] = []             # the views to extend with new keys
# the first key after the model section: a family's keys are placed before it (base.yml order)
_AFTER_MODEL = next(k for k, s in list(KEYS.items())[list(KEYS).index("model_name") + 1:]
                    if s.section)


def add_keys(family: str, keys: type) -> None:
  """Composes the family's own keys (`keys`: a frozen dataclass of `key(...)` fields) into the one
  schema: `KEYS` (after the model section, in a section of their own), and fields of `Config` and
  of every view whose keys they are (`ModelConfig` for model keys). The schema does this for the
  families of the table `MaxText/models/families.py` when it is imported; a family defined
  elsewhere does it when it is registered (`registry.register`, its `Family.keys`). Adding the
  same class again does nothing; a key the schema already has is a ValueError."""
  if _FAMILY_KEYS.get(family) is keys:
    return
  if family in _FAMILY_KEYS:
    raise ValueError(f"family {family!r} already declared its keys "
                     f"({_FAMILY_KEYS[family].__module__}.{_FAMILY_KEYS[family].__qualname__})")
  new = specs_of(keys, family, section=f"model: {family} ({keys.__module__})",
                 section_tools=_FAMILY_SECTION_TOOLS)
  clash = {k: KEYS[k].family or "the common schema" for k in new if k in KEYS}
  if clash:
    raise ValueError(f"family {family!r} declares keys the schema already has: "
                     + ", ".join(f"{k} (from {owner})" for k, owner in sorted(clash.items())))
  _FAMILY_KEYS[family] = keys
  items = list(KEYS.items())
  at = list(KEYS).index(_AFTER_MODEL)
  KEYS.clear()
  KEYS.update(items[:at] + list(new.items()) + items[at:])
  extend_dataclass(Config, [(f.name, copy_field(f)) for f in dataclasses.fields(keys)])
  for cls, names in _VIEWS:
    extend_dataclass(cls, [(k, _view_field(k)) for k in new if k in names])


def remove_keys(family: str) -> None:
  """Undoes `add_keys` for a family added at run time (`registry.unregister`): its keys leave
  `KEYS`, `Config` and the views, which get back what they had before (`spec.shrink_dataclass`).
  A family without keys of its own does nothing; one of the table's is a ValueError (its keys are
  the repository's, in configs/base.yml)."""
  if family not in _FAMILY_KEYS:
    return
  if family in _TABLE_FAMILIES:
    raise ValueError(f"family {family!r} is one of MaxText/models/families.py: its keys stay")
  names = frozenset(k for k, s in KEYS.items() if s.family == family)
  for cls, _ in reversed(_VIEWS):
    shrink_dataclass(cls, names)
  shrink_dataclass(Config, names)
  for k in names:
    del KEYS[k]
  del _FAMILY_KEYS[family]


def family_keys(family: str) -> type | None:
  """The `Keys` dataclass whose keys `family` added to the schema (None: none)."""
  return _FAMILY_KEYS.get(family)


def in_base_yml(name: str) -> bool:
  """Whether configs/base.yml holds the key: the common ones and those of the repository's
  families (a family registered at run time brings its keys' defaults with it)."""
  return KEYS[name].family in ("", *_TABLE_FAMILIES)


def choices(name: str) -> tuple:
  return KEYS[name].choices or ()


def default(name: str) -> Any:
  return copy.deepcopy(KEYS[name].default)


class View:
  """Base of the typed views of a subset of the keys (`ModelConfig`, `DataConfig`). A view is built
  at import (`view`); the type checker reads its fields from MaxText/config/views_generated.py."""
  __dataclass_fields__: ClassVar[dict[str, dataclasses.Field]]   # every view is a dataclass

  @classmethod
  def from_config(cls, cfg: Config) -> Self:
    return cls(**{f.name: view_value(getattr(cfg, f.name)) for f in dataclasses.fields(cls)})


def view_value(value: Any) -> Any:
  """Lists become tuples in a view, so that a view is hashable (a static model attribute)."""
  return tuple(view_value(v) for v in value) if isinstance(value, list) else value


def _view_field(k: str) -> dataclasses.Field:
  return field(default=view_value(KEYS[k].default))


def view(name: str, keys: KeyNames, module: str, bases: tuple[type, ...] = ()) -> type:
  """A frozen dataclass `name` with exactly the schema fields `keys` (their types and defaults;
  list keys as tuples); the keys a family adds later (`add_keys`) become its fields too."""
  fields = []
  for k in keys:
    spec = KEYS[k]
    kind = tuple if spec.type is list else spec.type
    fields.append((k, kind, _view_field(k)))
  cls = dataclasses.make_dataclass(name, fields, bases=(*bases, View), frozen=True)
  cls.__module__ = module
  _VIEWS.append((cls, keys))
  return cls


def _import_family_keys() -> tuple[str, ...]:
  """Composes the keys of the repository's families: for each family of the table
  `MaxText/models/families.py` (an import-free dict), its sibling module `keys` (e.g.
  MaxText/models/gemma4/keys.py), when it has one, declares a dataclass `Keys`. These modules
  import only this package's `spec` and `tools` (tests/test_layering.py checks it), so reading
  them from here keeps the config package below every other."""
  table = importlib.import_module("MaxText.models.families").FAMILY_MODULES
  for family, module in table.items():
    name = module.rsplit(".", 1)[0] + ".keys"
    if importlib.util.find_spec(name) is not None:
      add_keys(family, importlib.import_module(name).Keys)
  return tuple(table)


_TABLE_FAMILIES = _import_family_keys()
