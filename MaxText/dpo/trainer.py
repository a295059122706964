"""Preference optimization (DPO, IPO, hinge, robust DPO; ORPO, SimPO) as a trainer of the one step
loop: a step is one optimizer update on a batch of preference pairs (the DPO objective,
MaxText/methods/dpo.py, on the update builder, MaxText/train/update.py), its
data the pairs of the step (MaxText/dpo/data.py), its row the preference metrics.

The reference of the DPO losses is the loaded checkpoint (`load_parameters_path`; without one the
initial parameters): with LoRA the base under the adapters (no second copy), else a frozen copy of
the parameters (loaded again when a run resumes). Its summed log-probabilities are computed when a
batch is made, before the step that uses them — or, with `precompute_ref_log_probs` /
`reference_logps`, once for every pair before the first step (or read from a file) and no copy is
held (MaxText/dpo/reference.py). ORPO and SimPO need no reference and hold none.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.checkpoint.manager import RunCheckpoints, load_params
from MaxText.config.load import ConfigError
from MaxText.config.schema import Config
from MaxText.data import sft
from MaxText.data.tokenizers import make_tokenizer
from MaxText.dpo import reference
from MaxText.dpo import step as dpo_step
from MaxText.dpo.data import Encoder, PreferenceSet, read_preferences
from MaxText.losses import preference
from MaxText.methods.registry import objective
from MaxText.metrics.writers import MetricsWriter
from MaxText.resolve import auto_settings
from MaxText.resolve.config_checks import require_files, unpipelined
from MaxText.storage import paths
from MaxText.train import memory, update
from MaxText.train.loop import Trainer
from MaxText.train.periodic import log_failure
from MaxText.train.run_log import log
from MaxText.train.state import init_state
from MaxText.train.step_loop import LoopParts
from MaxText.backend.device_type import Device


def dpo_problems(cfg: Config) -> list[tuple[str, str]]:
  """Cross-key refusals of a DPO run: (key, why)."""
  out = []
  if not cfg.preferences:
    out.append(("preferences", "DPO needs a .jsonl file of preference pairs "
                "(preferences=FILE.jsonl)"))
  if cfg.label_smoothing and cfg.dpo_loss not in ("robust", "simpo"):
    out.append(("label_smoothing", f"label_smoothing={cfg.label_smoothing} is read by "
                f"dpo_loss=robust and simpo only (dpo_loss={cfg.dpo_loss})"))
  if cfg.label_smoothing >= 0.5:
    out.append(("label_smoothing", f"label_smoothing={cfg.label_smoothing} must be < 0.5"))
  if cfg.simpo_gamma != 0.5 and cfg.dpo_loss != "simpo":
    out.append(("simpo_gamma", f"simpo_gamma is read by dpo_loss=simpo only (dpo_loss="
                f"{cfg.dpo_loss})"))
  if cfg.z_loss_weight:
    out.append(("z_loss_weight", "the preference losses have no z-loss term; set z_loss_weight=0"))
  if cfg.router_bias_update_rate:
    out.append(("router_bias_update_rate", f"router_bias_update_rate={cfg.router_bias_update_rate:g}"
                ": DPO's step makes no MoE router-bias update (pre-training/SFT, distillation and "
                "GRPO do); set router_bias_update_rate=0"))
  out.extend(unpipelined(cfg, "DPO"))
  if (cfg.precompute_ref_log_probs or cfg.reference_logps) \
      and not preference.uses_reference(cfg.dpo_loss):
    key = "reference_logps" if cfg.reference_logps else "precompute_ref_log_probs"
    out.append((key, f"dpo_loss={cfg.dpo_loss} has no reference"))
  if cfg.precompute_ref_log_probs and cfg.reference_logps:
    out.append(("reference_logps", "reference_logps reads the values precompute_ref_log_probs "
                "would compute: set one of the two"))
  if cfg.eval_preferences_period and not cfg.eval_preferences:
    out.append(("eval_preferences_period", "eval_preferences_period needs "
                "eval_preferences=FILE.jsonl (held-out pairs)"))
  return out


class DPOTrainer(Trainer):
  """A Trainer whose batches are preference pairs (module docstring). `per_device_batch_size`
  counts pairs: a step holds per_device_batch_size x devices x gradient_accumulation_steps pairs
  (twice as many rows), a micro-batch per_device_batch_size x devices."""

  tool = "dpo"

  def __init__(self, cfg: Config | auto_settings.Training,
               devices: Sequence[Device] | None = None, tokenizer=None):
    training = auto_settings.for_training(cfg)
    cfg = training.cfg
    for key, problem in dpo_problems(cfg):
      raise ConfigError(f"{key}: {problem}")
    require_files(cfg, "preferences", "eval_preferences")   # exit 2, as train.py's dataset_path
    super().__init__(training, devices, tokenizer)
    self.pairs = cfg.global_batch_size(len(self.devices))
    self.packed = cfg.preference_packing   # both sequences of a pair in one row
    # rows: the activations' estimate and the row count
    self.global_batch = self.pairs if self.packed else 2 * self.pairs
    S = cfg.max_target_length
    self.shardings_dpo = dpo_step.batch_shardings(self.mesh, self.rules, self.pairs, S,
                                                  self.packed)
    self.batch_sharding = jax.sharding.NamedSharding(
        self.mesh, dpo_step.logical_to_spec(dpo_step.ROW_AXES, (self.global_batch, S), self.rules,
                                            self.mesh))
    self.use_reference = preference.uses_reference(cfg.dpo_loss)
    # the reference's sums read from a table per pairs file (dpo/reference.py), no copy held
    self.precomputed = self.use_reference and bool(cfg.precompute_ref_log_probs
                                                   or cfg.reference_logps)
    self.tables: dict[str, dict[str, np.ndarray]] = {}
    self.loss_kwargs = dict(loss=cfg.dpo_loss, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
                            simpo_gamma=cfg.simpo_gamma)
    # the held-out batches' sums: one program (run eagerly, each of its operations compiled one)
    self.eval_sums = jax.jit(functools.partial(preference.pair_sums, **self.loss_kwargs))
    self.train_set: PreferenceSet | None = None
    self.eval_set: PreferenceSet | None = None

  def memory_estimate(self) -> memory.MemoryEstimate:
    """train.py's estimate for the pairs' rows, plus the reference's copy of the parameters (a DPO
    loss without LoRA)."""
    copy = self.use_reference and not self.adapters_only and not self.precomputed
    return dataclasses.replace(
        super().memory_estimate(),
        reference=memory.per_device_bytes(self.abstract["params"]) if copy else 0)

  def open_data(self, saved_shards: int | None) -> Any:
    """Reads the pairs (a DataError here is exit 3); the pairs of a step are a function of (seed,
    step), so there is no iterator to save."""
    del saved_shards
    cfg = self.cfg
    tok = self.tokenizer or make_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    encoder = Encoder(tok, cfg.add_bos,
                      lambda: sft.ChatFormat.for_tokenizer(cfg.tokenizer_path,
                                                           cfg.chat_template_path))
    pad = tok.pad_id if getattr(tok, "pad_id", None) is not None else 0
    read = lambda path, key: read_preferences(path, key, encoder, cfg.max_target_length, pad,
                                              self.packed)
    self.train_set = read(cfg.preferences, "preferences")
    self.eval_set = read(cfg.eval_preferences, "eval_preferences") if cfg.eval_preferences \
        else None
    log(f"preferences: {len(self.train_set)} pairs from {self.train_set.path}"
        + (f"; {len(self.eval_set)} held-out pairs" if self.eval_set else "")
        + f"; {self.pairs} pairs per step, dpo_loss={cfg.dpo_loss} beta={cfg.beta}")
    return None

  def device_arrays(self, host: dict) -> dict:
    """Host arrays every process holds whole → global arrays with the pairs' shardings."""
    return jax.tree.map(lambda v, sh: jax.make_array_from_callback(v.shape, sh,
                                                                   lambda idx: v[idx]),
                        host, {s: self.shardings_dpo[s] for s in host})

  def reference_params(self, state: dict, fresh: bool) -> Any:
    """The reference's parameters of a DPO loss without LoRA: the loaded (or initial) ones — a
    copy of the state's at a fresh start, loaded again after a resume."""
    if not (self.use_reference and not self.adapters_only) or self.precomputed:
      return None
    if fresh:   # one program for the whole tree (eagerly, one per array shape and sharding)
      return jax.jit(lambda t: jax.tree.map(jnp.copy, t),
                     out_shardings=jax.tree.map(lambda x: x.sharding, state["params"])
                     )(state["params"])
    return self.loaded_reference()

  def loaded_reference(self) -> Any:
    """The reference's parameters loaded again (the checkpoint, or the initial ones)."""
    if self.cfg.load_parameters_path:
      return load_params(self.cfg.load_parameters_path, self.abstract["params"],
                         verify=self.cfg.checkpoint_verify)
    return init_state(self.mcfg, self.cfg.seed, self.tx, self.shardings)["params"]

  # ---- the step plugged into the loop (train/step_loop.py) ----------------------------------------
  def prepare(self, ckpts: RunCheckpoints | None, data_iter: Any) -> tuple[dict, int]:
    del data_iter
    cfg = self.cfg
    state, start = self.checkpointed.initial_state(ckpts, None)
    self.reference = self.reference_params(state, fresh=start == 0)
    self.update_fn = update.jit_update(
        update.make_update(objective("dpo", loss_kwargs=self.loss_kwargs,
                                     chunk=cfg.loss_chunk_length),
                           self.model_def, self.tx, mesh=self.mesh, rules=self.rules,
                           lr_schedule=self.lr_schedule,
                           grad_accum=cfg.gradient_accumulation_steps,
                           adapters_only=self.adapters_only),
        self.shardings, self.shardings_dpo, self.mesh)
    make = lambda base: dpo_step.make_sums_fn(self.model_def, self.mesh, self.rules,
                                              cfg.loss_chunk_length, self.shardings_dpo, base)
    self.policy_sums = make(False)
    self.ref_sums = make(self.adapters_only)
    if self.precomputed:
      self.tables = self.reference_tables(state, fresh=start == 0)
    self.clock.mark("init")
    return state, start

  def pair_sets(self) -> dict[str, PreferenceSet]:
    sets = {"preferences": self.train_set, "eval_preferences": self.eval_set}
    return {k: v for k, v in sets.items() if v is not None}

  def reference_tables(self, state: dict, fresh: bool) -> dict[str, dict[str, np.ndarray]]:
    """The reference's sums of every pair (dpo/reference.py): read from `reference_logps`, or
    from this run's folder when a run before it wrote them, else computed now — with the state's
    parameters at a fresh start (the reference itself; with LoRA its base), else the reference
    loaded once — and written there."""
    cfg = self.cfg
    if cfg.reference_logps:
      tables = {k: reference.read(cfg.reference_logps, k, s, "reference_logps")
                for k, s in self.pair_sets().items()}
      log(f"reference log-probabilities read from {cfg.reference_logps}")
      return tables
    folder = paths.join(self.run_dir, reference.FOLDER)
    sets = self.pair_sets()
    if not fresh and all(paths.exists(reference.file_of(folder, k)) for k in sets):
      return {k: reference.read(folder, k, s, "precompute_ref_log_probs") for k, s in sets.items()}
    params = state["params"] if fresh or self.adapters_only else self.loaded_reference()
    sums = lambda host: jax.tree.map(whole, self.ref_sums(params, self.device_arrays(host)))
    tables = {k: reference.compute(s, self.pairs, sums) for k, s in sets.items()}
    if jax.process_index() == 0:
      for k, s in sets.items():
        reference.write(folder, k, s, tables[k])
    log(f"reference log-probabilities of {sum(len(s) for s in sets.values())} pairs computed "
        f"once, written to {folder}")
    return tables

  def table_batch(self, key: str, idx: list[int]) -> dict:
    """The reference's sums of the pairs `idx` of pairs file `key` as device arrays."""
    host = {side: v[idx] for side, v in self.tables[key].items()}
    return jax.tree.map(lambda v, sh: jax.make_array_from_callback(v.shape, sh,
                                                                   lambda i: v[i]),
                        host, self.shardings_dpo["ref"])

  def loop_parts(self, state: dict, start: int, writer: MetricsWriter, data_iter: Any
                 ) -> LoopParts:
    del data_iter
    periodic = HeldOutPairs(self, writer) if self.eval_set is not None else None
    if periodic is not None and start == 0:
      periodic.evaluate(0, state["params"])   # before any step: a failure here stops the run
    return LoopParts(step=self.update_fn, next_batch=self.pairs_batch, rows=PairRows(),
                     progress=PairProgress(), periodic=periodic)

  def reference_sums(self, state_params, batch: dict) -> dict:
    if not self.use_reference:
      return {s: jnp.zeros((self.pairs,), jnp.float32) for s in dpo_step.SIDES}
    return self.ref_sums(self.reference if self.reference is not None else state_params, batch)

  def pairs_batch(self, step: int, state: dict) -> dict:
    """The batch of `step`: its pairs as device arrays and the reference's sums on them."""
    pairs = self.train_set
    assert pairs is not None, "open_data reads the pairs before the first step"
    idx = pairs.for_step(step, self.pairs, self.cfg.seed)
    batch = self.device_arrays(pairs.take(idx))
    batch["ref"] = (self.table_batch("preferences", idx) if self.precomputed
                    else self.reference_sums(state["params"], batch))
    return batch

  def evaluate(self, params) -> dict[str, float]:
    """The held-out pairs' preference metrics (eval/rewards/..., eval/logps/..., eval/loss) under
    `params`, in batches of the step's pairs (the last one padded, the padding weighted 0). ORPO's
    eval/loss is its odds-ratio term alone (no cross-entropy)."""
    ev, P = self.eval_set, self.pairs
    assert ev is not None, "evaluate runs with eval_preferences (HeldOutPairs)"
    totals: dict[str, float] = {}
    for first in range(0, len(ev), P):
      idx = list(range(first, min(first + P, len(ev))))
      weight = np.zeros(P, np.float32)
      weight[:len(idx)] = 1
      padded = idx + [idx[-1]] * (P - len(idx))
      host = ev.take(padded)
      batch = self.device_arrays(host)
      pol = jax.tree.map(whole, self.policy_sums(params, batch))
      ref = jax.tree.map(whole, self.table_batch("eval_preferences", padded) if self.precomputed
                         else self.reference_sums(params, batch))
      n = {s: host[s]["mask"].sum(-1) for s in dpo_step.SIDES}
      loss, sums = self.eval_sums(pol["chosen"], pol["rejected"], n["chosen"], n["rejected"],
                                  ref["chosen"], ref["rejected"], weight)
      for k, v in {"loss": loss, **sums}.items():
        totals[k] = totals.get(k, 0.0) + float(v)
    out = {f"eval/{k}": v / len(ev) for k, v in totals.items()}
    out["eval/pairs"] = float(len(ev))
    return out


def whole(x: jax.Array) -> np.ndarray:
  """A sharded global array whole on every process."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class HeldOutPairs:
  """The loop's evaluation for DPO (`step_loop.Periodic`): the held-out pairs' metrics every
  `eval_preferences_period` steps and after the last (after that step's save; a failure is logged)."""

  def __init__(self, trainer: DPOTrainer, writer: MetricsWriter):
    self.trainer, self.writer, self.cfg = trainer, writer, trainer.cfg

  def due(self, step: int) -> bool:
    every = self.cfg.eval_preferences_period
    return step == self.cfg.steps or bool(every and step % every == 0)

  def evaluate(self, step: int, params) -> None:
    m = self.trainer.evaluate(params)
    self.writer.write(step, m)
    log(f"eval after step {step} | rewards/accuracies {m['eval/rewards/accuracies']:.3f} | "
        f"margins {m['eval/rewards/margins']:.4f} | loss {m['eval/loss']:.4f} | "
        f"{int(m['eval/pairs'])} held-out pairs")

  def after_step(self, step: int, params) -> float:
    t0 = time.perf_counter()
    try:
      self.evaluate(step, params)
    except Exception as e:  # pylint: disable=broad-except
      log_failure("evaluation", step, e)
    return time.perf_counter() - t0


class PairRows:
  """A DPO step's row (`step_loop.Rows`), read one step late: the step's metrics as floats and
  `step_time_s` (from the previous row, less evaluation)."""

  def __init__(self):
    self._last_done = time.perf_counter()

  def exclude(self, seconds: float) -> None:
    self._last_done += seconds

  def row(self, metrics: Any) -> dict:
    row = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    row["step_time_s"], self._last_done = now - self._last_done, now
    return row


class PairProgress:
  """DPO's progress line (`step_loop.Progress`)."""

  def line(self, step: int, row: dict, steps: int) -> str:
    parts = [f"step {step}/{steps}", f"loss {row['loss']:.4f}",
             f"acc {row['rewards/accuracies']:.3f}", f"margin {row['rewards/margins']:.4f}",
             f"chosen {row['rewards/chosen']:.4f}", f"rejected {row['rewards/rejected']:.4f}",
             f"logps {row['logps/chosen']:.2f}/{row['logps/rejected']:.2f}"]
    if "nll_loss" in row:
      parts.append(f"nll {row['nll_loss']:.4f}")
    parts += [f"grad norm {row['grad_norm']:.3f}", f"{row['step_time_s']:.2f} s"]
    return " | ".join(parts)

  def warning(self, step: int, row: dict) -> str | None:
    del step, row
    return None
