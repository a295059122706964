"""Distillation as a trainer of the one step loop: train.py's data (documents or chat), evaluation,
samples, checkpoints and resume, with the step's objective the distillation loss
(MaxText/methods/distill.py) against a frozen teacher loaded from `teacher_path`.

The teacher may be of another family or size than the student (its architecture comes from its
checkpoint's stored config, as `load_parameters_path`'s does); it must share the student's
vocabulary (same vocab_size: the same tokenizer), else exit 2 naming teacher_path. Its parameters
live on the same mesh as the student's, sharded by their own logical axes; no optimizer state, no
gradient. A resumed run loads the teacher again.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from MaxText.checkpoint.manager import RunCheckpoints, load_params, read_meta
from MaxText.config.load import ConfigError, replace
from MaxText.config.schema import ARCHITECTURE_KEYS, Config
from MaxText.losses.distill import DistillSpec
from MaxText.methods.registry import objective
from MaxText.metrics.writers import MetricsWriter
from MaxText.models.model_config import ModelConfig
from MaxText.models.registry import make_model_def
from MaxText.resolve import auto_settings
from MaxText.resolve.config_checks import unpipelined
from MaxText.sharding.rules import tree_shardings
from MaxText.train import memory, update
from MaxText.train.loop import Trainer
from MaxText.train.run_log import log
from MaxText.train.step_loop import LoopParts
from MaxText.backend.device_type import Device


def teacher_config(cfg: Config) -> Config:
  """The teacher's config: the student's run settings with the architecture of the checkpoint at
  `teacher_path`. ConfigError (exit 2) naming teacher_path: no checkpoint there, a LoRA
  checkpoint, or a vocabulary other than the student's."""
  if not cfg.teacher_path:
    raise ConfigError("teacher_path: distillation needs the teacher's checkpoint "
                      "(teacher_path=CKPT)")
  try:
    saved = read_meta(cfg.teacher_path)["config"]
  except FileNotFoundError as e:
    raise ConfigError(f"teacher_path: {e}") from None
  if saved.get("lora_rank"):
    raise ConfigError(f"teacher_path={cfg.teacher_path}: a LoRA run's checkpoint (adapters "
                      "only); export it merged first (MaxText.checkpoint_conversion)")
  if saved.get("vocab_size") != cfg.vocab_size:
    raise ConfigError(f"teacher_path={cfg.teacher_path}: the teacher's vocabulary "
                      f"(vocab_size={saved.get('vocab_size')}) differs from the student's "
                      f"(vocab_size={cfg.vocab_size}); distillation compares the two models' "
                      "next-token distributions, so both need the same tokenizer")
  arch = {k: saved[k] for k in ARCHITECTURE_KEYS & set(saved)}
  return replace(cfg, **arch, lora_rank=0, load_parameters_path=cfg.teacher_path)


def distill_problems(cfg: Config) -> list[tuple[str, str]]:
  """Cross-key refusals of a distillation run: (key, why)."""
  out = []
  for key in ("max_num_images_per_example", "max_num_audio_per_example"):
    if getattr(cfg, key):
      out.append((key, "distillation takes text rows only (the teacher has no media slots)"))
  if cfg.distill_beta != 0.5 and cfg.distill_loss != "jsd":
    out.append(("distill_beta", f"distill_beta is read by distill_loss=jsd only (distill_loss="
                f"{cfg.distill_loss})"))
  out.extend(unpipelined(cfg, "distillation"))
  return out


class DistillTrainer(Trainer):
  """A Trainer whose step distills a teacher into the trained model (module docstring)."""

  tool = "distill"

  def __init__(self, cfg: Config | auto_settings.Training,
               devices: Sequence[Device] | None = None, tokenizer=None):
    training = auto_settings.for_training(cfg)
    for key, problem in distill_problems(training.cfg):
      raise ConfigError(f"{key}: {problem}")
    super().__init__(training, devices, tokenizer)
    cfg = self.cfg
    self.teacher_cfg = teacher_config(cfg)
    self.teacher_mcfg = ModelConfig.from_config(self.teacher_cfg)
    self.teacher_def = make_model_def(self.teacher_mcfg)
    self.teacher_shardings = tree_shardings(self.teacher_def.logical_axes,
                                            self.teacher_def.abstract_params, self.mesh,
                                            self.rules)
    self.teacher_abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        self.teacher_def.abstract_params, self.teacher_shardings)
    self.spec = DistillSpec(cfg.distill_loss, cfg.distill_beta, cfg.distill_temperature,
                            cfg.distill_alpha)
    self.teacher: Any = None

  def memory_estimate(self) -> memory.MemoryEstimate:
    """train.py's estimate plus the teacher's parameters (counted as a reference copy)."""
    base = super().memory_estimate()
    return dataclasses.replace(base,
                               reference=memory.per_device_bytes(self.teacher_abstract))

  def compile_step(self):
    """The distillation objective (MaxText/methods/distill.py) on the update builder, the
    teacher's parameters its side input."""
    cfg = self.cfg
    step_fn = update.make_update(
        objective("distill", teacher_def=self.teacher_def, spec=self.spec,
                  chunk=cfg.loss_chunk_length),
        self.model_def, self.tx, mesh=self.mesh, rules=self.rules, lr_schedule=self.lr_schedule,
        grad_accum=cfg.gradient_accumulation_steps, aux_terms=self.aux_terms,
        adapters_only=self.adapters_only)
    jitted = update.jit_update(step_fn, self.shardings, self.batch_shardings, self.mesh,
                               side_shardings=self.teacher_shardings)
    abstract_batch = {k: jax.ShapeDtypeStruct((self.global_batch, *shape), dtype,
                                              sharding=self.batch_shardings[k])
                      for k, (shape, dtype) in self.row_specs.items()}
    return update.compile_update(jitted, self.abstract, abstract_batch, self.teacher_abstract,
                                 platform=self.devices[0].platform, hot_path=cfg.hot_path)

  def prepare(self, ckpts: RunCheckpoints | None, data_iter: Any) -> tuple[dict, int]:
    """The teacher's parameters loaded onto the mesh (exit 4: a damaged or misfitting
    checkpoint), then train.py's state and compiled step."""
    tc = self.teacher_cfg
    self.teacher = load_params(tc.teacher_path, self.teacher_abstract,
                               verify=self.cfg.checkpoint_verify)
    log(f"teacher: {tc.decoder_block} ({tc.num_decoder_layers} layers, emb_dim {tc.emb_dim}) "
        f"from {tc.teacher_path}; distill_loss={self.spec.divergence}"
        + (f" beta={self.spec.beta}" if self.spec.divergence == "jsd" else "")
        + f" temperature={self.spec.temperature} alpha={self.spec.alpha}")
    return super().prepare(ckpts, data_iter)

  def loop_parts(self, state: dict, start: int, writer: MetricsWriter, data_iter: Any
                 ) -> LoopParts:
    """train.py's parts (rows, progress, evaluation of the student, samples) with the step given
    the teacher's parameters."""
    parts = super().loop_parts(state, start, writer, data_iter)
    compiled, teacher = self.compiled, self.teacher
    return dataclasses.replace(parts, step=lambda s, batch: compiled(s, batch, teacher))
