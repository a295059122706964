"""The trainer as a policy backend for an outside RL loop: train on a batch the loop built, the
log-probabilities of sequences it sampled (the policy's and the reference's), the weights under
Hugging Face names for its inference engine, save / restore, and freeing device memory while its
rollouts run.

    from MaxText.rl.policy import Policy
    policy = Policy.load(["configs/grpo.yml", "load_parameters_path=CKPT", "lora_rank=16"])
    lp = policy.logprobs(batch)                   # [B, S], aligned with batch["input_ids"]
    ref = policy.reference_logprobs(batch)
    metrics = policy.train(batch, loss="grpo")    # or loss=fn(logprobs, batch) -> (loss, aux)
    for name, tensor in policy.weights(tensors="torch"): ...   # MaxText/refit.py: stream
    policy.save(); policy.offload(); policy.onload(); policy.close()

The batch format (keys, shapes, dtypes, alignment; a bad batch raises BatchError naming the key
and the expected shape): MaxText/rl/batch.py. The compiled programs: MaxText/rl/step.py.

What it shares with train.py (`train/loop.py: build`): the config (base.yml + e.g.
configs/grpo.yml + key=value; the keys GRPO reads, architecture and tokenizer from the
checkpoint), the mesh and sharding rules, the memory pre-flight, the state it starts from (the
run's latest checkpoint, else `load_parameters_path`, else a fresh init; LoRA as in training), the
checkpoint format in `<base_output_directory>/<run_name>/checkpoints` (its run lock held while the
policy is open), the metric names, and the exit statuses of its errors (`exit_status`: 2 config,
3 data — a bad batch —, 4 checkpoint, 5 non-finite).

`train`: one optimizer update on the whole batch; with `microbatch_size` the batch is split into
micro-batches whose gradients are accumulated inside the one compiled update (GRPO's loss is
normalised by the whole batch's totals, so this equals one pass up to float rounding). The
family's changes outside the gradient follow each update as in pre-training (a MoE router's
selection bias, `router_bias_update_rate`; not with LoRA, where the base is frozen). A non-finite
loss or gradient is never applied: `train` raises NonFiniteUpdate (exit 5).

The reference is the loaded parameters: with LoRA the base under the adapters (no copy); without
LoRA a copy of the parameters, kept only when `kl_beta` > 0.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import refit
from MaxText.checkpoint.errors import CheckpointError
from MaxText.checkpoint.manager import RunCheckpoints, load_params
from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError
from MaxText.inference import InferenceModel
from MaxText.rl import batch as batch_lib
from MaxText.losses.policy import group_advantages
from MaxText.rl.step import batch_shardings, grpo_loss, jit_update, make_logprob_fn, make_update
from MaxText.runtime.exit_codes import (EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA, EXIT_NONFINITE,
                                        EXIT_PREEMPTED)
from MaxText.runtime.preemption import PreemptionWatch
from MaxText.runtime.run_dir import RunLock
from MaxText.storage import paths
from MaxText.train.loop import Trainer, build
from MaxText.train.state import init_state
from MaxText.backend.device_type import Device

__all__ = ["EXIT_PREEMPTED", "BatchError", "NonFiniteUpdate", "Policy", "exit_status",
           "group_advantages"]
BatchError = batch_lib.BatchError
LossFn = Callable[[jax.Array, dict], tuple[jax.Array, dict]]


class NonFiniteUpdate(RuntimeError):
  """A `train` call whose loss or gradient was not finite: the update was not applied."""


def exit_status(e: BaseException) -> int:
  """train.py's exit status for an error a policy raised (README "Exit status")."""
  if isinstance(e, BatchError):
    return EXIT_DATA
  if isinstance(e, ConfigError):
    return EXIT_CONFIG
  if isinstance(e, DataError):
    return EXIT_DATA
  if isinstance(e, CheckpointError):
    return EXIT_CHECKPOINT
  if isinstance(e, NonFiniteUpdate):
    return EXIT_NONFINITE
  return 1   # anything else is a bug


class PolicyTrainer(Trainer):
  """The trainer's machinery a policy stands on (config, mesh, state, checkpoints), reading the
  keys GRPO reads."""
  tool = "grpo"


def _gather(x: jax.Array) -> np.ndarray:
  """A sharded global array whole on every process."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class Policy:
  """A policy on the training mesh (module docstring). `Policy.load(argv)` opens one; GRPO
  (MaxText/rl/grpo.py) builds one on its own trainer and drives its programs from the step loop
  (`arrays`, `token_logprobs`, `update`: the functional core under the methods)."""

  def __init__(self, trainer: Trainer):
    self.trainer = trainer
    self.cfg, self.mesh, self.rules = trainer.cfg, trainer.mesh, trainer.rules
    self.model_config = trainer.mcfg
    self.state: dict | None = None
    self.reference: Any = None      # the reference's parameters (a copy), when one is kept
    self.offloaded: tuple[str, ...] = ()
    self._ckpts: RunCheckpoints | None = None
    self._lock: RunLock | None = None
    self._io: InferenceModel | None = None
    self._programs: dict[tuple, Callable] = {}
    cfg = self.cfg
    self.loss_kwargs = dict(epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                            dual_clip=cfg.dual_clip or None, beta=cfg.kl_beta,
                            kl_estimator=cfg.kl_estimator, aggregation=cfg.loss_aggregation,
                            max_response_len=cfg.max_new_tokens,
                            importance_sampling=cfg.importance_sampling)
    self.keeps_reference_copy = cfg.kl_beta > 0 and not trainer.adapters_only

  # ---- opening and closing -------------------------------------------------------------------------
  @classmethod
  def load(cls, argv: Sequence[str], devices: Sequence[Device] | None = None) -> "Policy":
    """The policy of `argv` (a config file, then key=value), its state restored from the run's
    latest checkpoint, else loaded from `load_parameters_path`, else initialised. Raises
    ConfigError (exit 2), CheckpointError (exit 4)."""
    policy = cls(build(argv, devices, PolicyTrainer))
    policy.open()
    return policy

  def open(self) -> None:
    """Takes the run directory's lock and the state to start from (docstring of `load`)."""
    t, cfg = self.trainer, self.cfg
    if cfg.enable_checkpointing:
      self._lock = t._lock_run_dir()  # pylint: disable=protected-access
      self._ckpts = RunCheckpoints(paths.join(t.run_dir, "checkpoints"),
                                   max_to_keep=cfg.max_checkpoints_to_keep,
                                   async_save=cfg.async_checkpointing,
                                   save_timeout_s=cfg.checkpoint_save_timeout_s)
    state, start = t.checkpointed.initial_state(self._ckpts, None)
    self.start(state, fresh=start == 0)

  def start(self, state: dict, fresh: bool) -> None:
    """Holds `state`; the reference copy (`kl_beta` > 0, no LoRA) of the loaded parameters."""
    self.state = state
    self.reference = self.reference_params(state, fresh) if self.keeps_reference_copy else None

  def reference_params(self, state: dict, fresh: bool) -> Any:
    """The loaded (or initial) parameters: a copy of the state's at a fresh start, loaded again
    after a resume."""
    t = self.trainer
    if fresh:   # one program copies the tree (not one eager copy program per leaf's shape)
      return jax.jit(lambda p: jax.tree.map(jnp.copy, p))(state["params"])
    if self.cfg.load_parameters_path:
      return load_params(self.cfg.load_parameters_path, t.abstract["params"],
                         verify=self.cfg.checkpoint_verify)
    return init_state(t.mcfg, self.cfg.seed, t.tx, t.shardings)["params"]

  def close(self) -> None:
    """Waits for the last save to commit and releases the run directory."""
    if self._ckpts is not None:
      self._ckpts.close()
      self._ckpts = None
    if self._lock is not None:
      self._lock.release()
      self._lock = None

  def __enter__(self) -> "Policy":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- the functional core (also GRPO's) -----------------------------------------------------------
  def arrays(self, batch: Mapping[str, Any], need: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """A batch (rl/batch.py), checked, as global arrays on the mesh (every process holds the
    whole batch on the host)."""
    host = batch_lib.model_arrays(batch_lib.check(batch, need))
    B, S = host["inputs"].shape
    if S > self.cfg.max_target_length:
      raise BatchError(f"batch['input_ids']: shape {(B, S)}, expected at most "
                       f"max_target_length={self.cfg.max_target_length} positions")
    micro = self.cfg.microbatch_size
    if micro and B % micro:
      raise BatchError(f"batch['input_ids']: {B} rows do not split into micro-batches of "
                       f"microbatch_size={micro}")
    shardings = batch_shardings(self.mesh, self.rules, B, S)
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
            for k, v in host.items()}

  def _program(self, key: tuple, make: Callable[[], Callable]) -> Callable:
    if key not in self._programs:
      self._programs[key] = make()
    return self._programs[key]

  def token_logprobs(self, params: Any, arrays: dict, reference: bool = False) -> jax.Array:
    """Token-aligned log-probabilities [B, S] (0 outside the generation mask) of `params`, or with
    `reference` of the reference (the copy, or with LoRA the base under `params`' adapters)."""
    base = reference and self.trainer.adapters_only
    B, S = arrays["inputs"].shape
    fn = self._program(("logprobs", base, B, S), lambda: make_logprob_fn(
        self.trainer.model_def, self.mesh, self.rules, self.cfg.loss_chunk_length,
        batch_shardings(self.mesh, self.rules, B, S), reference_base=base))
    if reference and not base:
      if self.reference is None:
        raise ConfigError("reference_logprobs: without LoRA the reference is a copy of the loaded "
                          "parameters, kept only with kl_beta > 0 (set kl_beta, or lora_rank)")
      params = self.reference
    return fn(params, arrays)

  def update(self, state: dict, arrays: dict, loss: str | LossFn = "grpo") -> tuple[dict, dict]:
    """One optimizer update of `state` on `arrays` (dispatched: no host wait; `state` is donated)
    → (the new state, its metrics as device values)."""
    t, cfg = self.trainer, self.cfg
    B, S = arrays["inputs"].shape
    micro = cfg.microbatch_size or B
    use_reference = self.keeps_reference_copy or t.adapters_only
    if loss == "grpo":
      loss_fn = grpo_loss(self.loss_kwargs, use_reference)
    elif callable(loss):
      loss_fn = loss
    else:
      raise ConfigError(f"train: loss={loss!r}: \"grpo\" or a function (logprobs, batch) -> "
                        "(loss, aux)")
    fn = self._program(("update", loss if callable(loss) else "grpo", B, S), lambda: jit_update(
        make_update(t.model_def, t.tx, mesh=self.mesh, rules=self.rules,
                    lr_schedule=t.lr_schedule, chunk=cfg.loss_chunk_length,
                    adapters_only=t.adapters_only, loss_fn=loss_fn, micro_batches=B // micro,
                    aux_terms=t.aux_terms),
        t.shardings, batch_shardings(self.mesh, self.rules, B, S), self.mesh))
    return fn(state, arrays)

  # ---- the API of an outside loop ----------------------------------------------------------------
  @property
  def params(self) -> Any:
    """The current parameters (sharded on the training mesh): what a co-located engine samples
    from."""
    return self._require_on_device("params")["params"]

  @property
  def step(self) -> int:
    return int(self._held()["step"])

  def logprobs(self, batch: Mapping[str, Any]) -> np.ndarray:
    """[B, S] log p(input_ids[:, t] | input_ids[:, :t]) under the policy, 0 outside the
    generation mask (and at position 0)."""
    return _gather(self.token_logprobs(self.params, self.arrays(batch)))

  def reference_logprobs(self, batch: Mapping[str, Any]) -> np.ndarray:
    """As `logprobs`, under the reference (module docstring)."""
    return _gather(self.token_logprobs(self.params, self.arrays(batch), reference=True))

  def train(self, batch: Mapping[str, Any], loss: str | LossFn = "grpo") -> dict[str, float]:
    """One optimizer update on `batch` → its metrics (loss, grad_norm, lr, finite, and the
    loss's own: for GRPO pg_loss, kl, clip_frac_low / _high, ratio_mean / _min / _max, entropy;
    with MoE the expert-load metrics). `loss`: "grpo" (the clipped policy loss with the config's
    settings) or a JAX function fn(logprobs [b, S], batch) -> (loss, aux) of one micro-batch
    (rl/step.py). Without `reference_logprobs` in the batch the GRPO loss's reference term uses
    the policy's own (`reference_logprobs(batch)`). Raises NonFiniteUpdate (not applied)."""
    held = self._require_on_device("params", "opt_state")
    arrays = self.arrays(batch, ("generation_mask", "advantages", "old_logprobs"))
    uses_reference = self.keeps_reference_copy or self.trainer.adapters_only
    if loss == "grpo" and uses_reference and "reference_logprobs" not in batch:
      arrays["reference_logprobs"] = self.token_logprobs(self.params, arrays, reference=True)
    state, metrics = self.update(held, arrays, loss)
    self.state = {**state, "step": state["step"] + 1}
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not out["finite"]:
      raise NonFiniteUpdate(f"non-finite loss or gradient at update {self.step} (loss "
                            f"{out['loss']}, grad_norm {out['grad_norm']}): not applied")
    return out

  def weights(self, tensors: str = "numpy", layout: str = "checkpoint"
              ) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor) of every weight, one at a time (MaxText/refit.py: stream;
    LoRA merged)."""
    return refit.stream(self.params, self.cfg, layout=layout, tensors=tensors)

  def save(self, step: int | None = None, wait: bool = True) -> int:
    """Writes a checkpoint of the state at `step` (default: the updates so far) in train.py's
    format; `wait`: until it is committed. Returns the step."""
    if self._ckpts is None:
      raise ConfigError("save: enable_checkpointing=false (no checkpoints directory)")
    held = self._require_on_device("params", "opt_state")
    step = self.step if step is None else int(step)
    self.trainer.checkpointed.save_checkpoint(self._ckpts, step, held, None,
                                              self.cfg.as_dict())
    if wait:
      self._ckpts.wait()
    return step

  def restore(self) -> int:
    """The state of the run's latest committed checkpoint (raises CheckpointError without one)
    → its step."""
    if self._ckpts is None or self._ckpts.latest_step() is None:
      raise CheckpointError(f"restore: no checkpoint in {self.trainer.run_dir}/checkpoints")
    self._ckpts.wait()
    state, start = self.trainer.checkpointed.initial_state(self._ckpts, None)
    self.state, self.offloaded = state, ()
    return start

  @staticmethod
  def preemption() -> PreemptionWatch:
    """train.py's preemption watch, for a loop's `with`: SIGTERM / SIGINT are noted (not fatal);
    `watch.should_stop(step)` after each step (every process agrees) says to save and end with
    EXIT_PREEMPTED (42), as train.py does."""
    return PreemptionWatch()

  def latest_checkpoint(self) -> int | None:
    return None if self._ckpts is None else self._ckpts.latest_step()

  def offload(self, params: bool = False) -> None:
    """Frees the device memory of the optimizer state (and with `params` of the parameters):
    moved to host memory until `onload`."""
    parts = ("opt_state", "params") if params else ("opt_state",)
    for part in parts:
      if part in self.offloaded:
        continue
      state = self._held()
      host = jax.device_get(state[part])
      jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, state[part])
      state[part] = host
      self.offloaded += (part,)

  def onload(self) -> None:
    """Brings back what `offload` moved, on its training shardings."""
    for part in self.offloaded:
      state = self._held()
      state[part] = jax.device_put(state[part], self.trainer.shardings[part])
    self.offloaded = ()

  def _held(self) -> dict:
    if self.state is None:
      raise ConfigError("the policy holds no state (Policy.load, or start)")
    return self.state

  def _require_on_device(self, *parts: str) -> dict:
    """The state, its `parts` on device."""
    state = self._held()
    off = [p for p in parts if p in self.offloaded]
    if off:
      raise ConfigError(f"{', '.join(off)} offloaded: call onload() first")
    return state

  # ---- the tokenizer, for a loop that has none of its own ------------------------------------------
  @property
  def io(self) -> InferenceModel:
    """Prompt encoding and text decoding with the run's tokenizer (MaxText/inference.py)."""
    if self._io is None:
      self._io = InferenceModel(self.cfg, None, None, self.trainer.tokenizer,  # type: ignore[arg-type]
                                "the run's tokenizer")
    return self._io
