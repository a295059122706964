"""GRPO on verifiable rewards, co-located: the decoding engine samples from the current parameters
on the training mesh, the trainer scores and updates them.

  python -m MaxText.rl.grpo configs/grpo.yml load_parameters_path=CKPT prompts=FILE.jsonl \\
      reward=package.module:function[,package.module:other] [key=value ...]

Each step (a rollout batch): the `prompts_per_step` prompts of the step (MaxText/rl/prompts.py), G
= `num_generations` completions each from the engine (temperature / top_k / top_p / min_p,
max_new_tokens, eos and stop keys; MaxText/rl/rollout.py), their rewards (MaxText/rl/rewards.py;
weighted by `reward_weights`), advantages per group (`advantage_estimator`), the old
log-probabilities recomputed by the trainer (the engine's own are compared with them and the
difference logged), the reference's (`kl_beta` > 0: the loaded parameters, kept as a copy; with
LoRA the base under the adapters, no copy), then `num_iterations` optimizer updates on the clipped
policy loss (MaxText/losses/policy.py), split into micro-batches of `microbatch_size` rows whose
gradients are accumulated in the one update (`rollout_offload`: the optimizer state is in host
memory while the engine samples, `Policy.offload`). Those pieces are the policy API's
(MaxText/rl/policy.py: its batch format and compiled programs, on this trainer's mesh and state):
an outside loop driving `Policy` does what this loop does (end_to_end/rl_driver.py).

The rest is train.py's machinery (`train/loop.py: Trainer`, of which `GRPOTrainer` is a kind):
config (base.yml + configs/grpo.yml + key=value; architecture and tokenizer from the checkpoint),
mesh and rules, the pre-flight memory check, the run directory and its lock, checkpoints every
`checkpoint_period` steps and at the end (a rerun resumes bit for bit: prompts and samples are
functions of (seed, step)), SIGTERM → save → exit 42, metrics.jsonl / TensorBoard / stdout, and the
exit statuses (2 config — including a prompt over the budget, group size 1, a reward module that
does not import —, 3 more than `max_bad_rewards` bad rewards, 4 checkpoint, 5 non-finite).
The family's auxiliary loss (MoE balancing) is not part of the GRPO loss; its changes outside the
gradient (the MoE router's selection bias) follow every update as in pre-training.
"""
from __future__ import annotations

import sys

from MaxText.config import cli

if __name__ == "__main__" and (cli.wants_help(sys.argv[1:]) or len(sys.argv) < 2):
  cli.print_help(cli.usage(__doc__, {}, "grpo"))   # before jax is imported (the trainer's, below)
  sys.exit(0)

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.checkpoint.manager import RunCheckpoints
from MaxText.config.load import ConfigError
from MaxText.config.schema import Config
from MaxText.decoding.sampling import Sampling
from MaxText.inference import InferenceModel
from MaxText.metrics.writers import MetricsWriter
from MaxText.resolve import auto_settings
from MaxText.resolve.config_checks import require_files, unpipelined
from MaxText.losses import policy as losses
from MaxText.rl import rollout as rollout_lib
from MaxText.rl.prompts import PromptSet, read_prompts
from MaxText.rl.placement import Rollouts, split_devices
from MaxText.rl.policy import Policy
from MaxText.rl.rewards import RewardScorer, load_rewards
from MaxText.rl.step import batch_shardings
from MaxText.runtime.exit_codes import exit_process
from MaxText.runtime.host_data import process_rows
from MaxText.train import memory
from MaxText.train.loop import Trainer, main as train_main
from MaxText.train.periodic import log_failure
from MaxText.train.run_log import log, log_error
from MaxText.train.step_loop import LoopParts
from MaxText.backend.device_type import Device


def grpo_problems(cfg: Config) -> list[tuple[str, str]]:
  """Cross-key refusals of a GRPO run: (key, why)."""
  out = []
  if cfg.num_generations < 2:
    out.append(("num_generations", f"num_generations={cfg.num_generations}: GRPO's advantages are "
                "relative to the other completions of the same prompt, so a group needs at least "
                "2"))
  if cfg.gradient_accumulation_steps != 1:
    out.append(("gradient_accumulation_steps", "GRPO splits its rollout batch by rows: set "
                "microbatch_size (rows per micro-batch) instead"))
  rows = cfg.prompts_per_step * cfg.num_generations
  if cfg.microbatch_size and rows % cfg.microbatch_size:
    out.append(("microbatch_size", f"microbatch_size={cfg.microbatch_size} does not divide the "
                f"rollout batch's {rows} rows (prompts_per_step x num_generations)"))
  if cfg.dual_clip and cfg.dual_clip <= 1:
    out.append(("dual_clip", f"dual_clip={cfg.dual_clip} must be > 1 (or 0 = off)"))
  if cfg.max_new_tokens >= cfg.max_target_length:
    out.append(("max_new_tokens", f"max_new_tokens={cfg.max_new_tokens} leaves no room for a "
                f"prompt in max_target_length={cfg.max_target_length}"))
  if cfg.overlong_buffer > cfg.max_new_tokens:
    out.append(("overlong_buffer", f"overlong_buffer={cfg.overlong_buffer} exceeds max_new_tokens="
                f"{cfg.max_new_tokens}"))
  if cfg.rollout_placement == "separate" and cfg.router_bias_update_rate > 0 \
      and not cfg.lora_rank:
    out.append(("router_bias_update_rate", "rollout_placement=separate ships the weights by the "
                "refit stream, under Hugging Face names, and a Hugging Face model has no router "
                "selection bias to ship: set router_bias_update_rate=0 or use colocated"))
  if cfg.dynamic_sampling_rounds and not cfg.dynamic_sampling:
    out.append(("dynamic_sampling_rounds", "dynamic_sampling_rounds resamples the groups "
                "dynamic_sampling finds; set dynamic_sampling=true"))
  if cfg.temperature == 0:
    out.append(("temperature", "temperature=0 decodes greedily: every completion of a prompt is "
                "the same and no advantage is ever non-zero; sample (e.g. temperature=1)"))
  out.extend(unpipelined(cfg, "GRPO"))
  return out


class GRPOTrainer(Trainer):
  """A Trainer whose batches are rollouts (module docstring)."""

  tool = "grpo"

  def __init__(self, cfg: Config | auto_settings.Training,
               devices: Sequence[Device] | None = None, tokenizer=None):
    training = auto_settings.for_training(cfg)   # train.py's run() hands its resolution over
    cfg = training.cfg
    for key, problem in grpo_problems(cfg):
      raise ConfigError(f"{key}: {problem}")
    require_files(cfg, "prompts", "eval_prompts")   # before the engine is made
    devices, engine_devices = split_devices(cfg, jax.devices() if devices is None else devices)
    super().__init__(training, devices, tokenizer)
    self.group = cfg.num_generations
    self.global_batch = cfg.prompts_per_step * cfg.num_generations
    S = cfg.max_target_length
    self.batch_sharding = batch_shardings(self.mesh, self.rules, self.global_batch, S)["inputs"]
    self.rows = process_rows(self.batch_sharding, (self.global_batch, S))
    self.scorer = RewardScorer(load_rewards(cfg.reward, cfg.reward_weights), cfg.max_bad_rewards,
                               log_error)   # scoring runs on process 0 only
    self.rollouts = Rollouts(cfg, self.mcfg, self.mesh, self.rules, engine_devices,
                             batch_size=self.global_batch, max_cache_length=S)
    self.engine = self.rollouts.engine
    self.io = InferenceModel(cfg, self.engine, None, tokenizer, "the run's tokenizer")
    budget = S - cfg.max_new_tokens
    hint = f"max_target_length={S} - max_new_tokens={cfg.max_new_tokens}"
    read = lambda path, key: read_prompts(path, key, self.io.encode, self.io.text, budget, hint)
    self.prompts: PromptSet = read(cfg.prompts, "prompts")
    self.eval_set: PromptSet | None = read(cfg.eval_prompts, "eval_prompts") \
        if cfg.eval_prompts else None
    self.use_reference = cfg.kl_beta > 0 or self.adapters_only   # with LoRA the KL is free to log
    self.policy = Policy(self)   # the programs of the policy API (MaxText/rl/policy.py)

  def micro_batches(self) -> int:
    return self.global_batch // (self.cfg.microbatch_size or self.global_batch)

  def memory_estimate(self) -> memory.MemoryEstimate:
    """train.py's estimate for the rollout rows, plus the engine's cache of a rollout batch (held
    between the updates, in the activations' place) and, with `kl_beta` > 0 and no LoRA, the
    reference's copy of the parameters."""
    cfg = self.cfg
    copy = cfg.kl_beta > 0 and not self.adapters_only
    return dataclasses.replace(
        super().memory_estimate(),
        reference=memory.per_device_bytes(self.abstract["params"]) if copy else 0,
        decode_cache=self.engine.cache_bytes_per_device(self.global_batch, cfg.max_target_length),
        decode_cache_fix=f"lower prompts_per_step={cfg.prompts_per_step} or num_generations="
                         f"{cfg.num_generations} (the rows decoded at once), max_target_length="
                         f"{cfg.max_target_length} (the cache length), "
                         + ("set cache_dtype=bfloat16, " if self.engine.cache_dtype.itemsize > 2
                            else "") + "or shard the rows over more devices")

  def open_data(self, saved_shards: int | None) -> Any:
    del saved_shards
    return None   # the prompts are chosen per step (MaxText/rl/prompts.py): no iterator to save

  # ---- pieces of a step --------------------------------------------------------------------------
  def sampling(self, greedy: bool = False) -> Sampling:
    cfg = self.cfg
    return Sampling() if greedy else Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p,
                                              cfg.seed)

  def eos_ids(self) -> list[int]:
    return list(self.io.eos_ids)

  def evaluate(self, params) -> dict[str, float]:
    """The held-out prompts' mean reward: of `num_generations` samples of each, drawn as in
    training with the same keys at every evaluation (`eval_reward`: what GRPO maximises), and of
    one greedy completion each (`eval_reward_greedy`)."""
    cfg, ev = self.cfg, self.eval_set
    assert ev is not None, "evaluate runs with eval_prompts (RewardEvaluation)"
    params = self.rollouts.params_for_engine(params)
    idx = list(range(len(ev.rows)))
    out: dict[str, float] = {"eval_prompts": len(idx)}
    for name, copies, sampling in (("eval_reward", self.group, self.sampling()),
                                   ("eval_reward_greedy", 1, self.sampling(greedy=True))):
      done = rollout_lib.generate(self.engine, params, ev, idx, copies=copies, sampling=sampling,
                                  first_row=0, max_new_tokens=cfg.max_new_tokens,
                                  eos_ids=self.eos_ids(), stop=cfg.stop, decode=self.io.text)
      per_fn = rollout_lib.score(self.scorer, ev, idx, copies, done, self.eos_ids(), self.io.text)
      out[name] = float(self.scorer.total(per_fn).mean())
      for f, r in enumerate(self.scorer.rewards):
        out[f"{name}/{r.name}"] = float(per_fn[:, f].mean())
    return out

  # ---- the step plugged into the loop (train/step_loop.py) ----------------------------------------
  def prepare(self, ckpts: RunCheckpoints | None, data_iter: Any) -> tuple[dict, int]:
    """(the state to start from, its step), held by the policy with its reference."""
    del data_iter
    state, start = self.checkpointed.initial_state(ckpts, None)
    self.policy.start(state, fresh=start == 0)
    self.clock.mark("init")
    return state, start

  def loop_parts(self, state: dict, start: int, writer: MetricsWriter, data_iter: Any
                 ) -> LoopParts:
    """GRPO's step in the loop: the batch of a step is its rollout (sampled from the state the
    step starts from), the step is `num_iterations` updates on it, the row is read one step late
    as in pre-training; the held-out prompts' reward is the evaluation (also before step 1)."""
    del data_iter
    periodic = RewardEvaluation(self, writer) if self.eval_set is not None else None
    if periodic is not None and start == 0:
      periodic.evaluate(0, state["params"])   # before any step: a failure here stops the run
    return LoopParts(step=self.dispatch, next_batch=self.rollout_batch,
                     rows=RolloutRows(self.cfg.num_iterations, self.scorer),
                     progress=RolloutProgress(self.scorer), periodic=periodic)

  def rollout_batch(self, step: int, state: dict) -> tuple[dict, dict]:
    """The batch of `step`: its prompts' completions sampled from `state`'s parameters, their
    rewards and advantages, the old (and reference) log-probabilities → (device arrays, what the
    step's row reports of the rollout)."""
    cfg, N = self.cfg, self.global_batch
    engine_params = self.rollouts.params_for_engine(state["params"])   # separate: shipped
    if cfg.rollout_offload:   # the loop's state: its optimizer state leaves the devices in place
      self.policy.state = state
      self.policy.offload()
    t0 = time.perf_counter()
    idx = self.prompts.for_step(step, cfg.prompts_per_step, cfg.seed)
    extra = {}
    try:
      ro = rollout_lib.rollout(self.engine, engine_params, self.prompts, idx, self.scorer,
                               copies=self.group, sampling=self.sampling(),
                               first_row=(step - 1) * N, max_new_tokens=cfg.max_new_tokens,
                               eos_ids=self.eos_ids(), stop=cfg.stop, decode=self.io.text,
                               seq=cfg.max_target_length)
      if cfg.dynamic_sampling and cfg.dynamic_sampling_rounds:
        ro, extra["groups_resampled"] = self.resample_equal_groups(step, ro, engine_params)
    finally:
      if cfg.rollout_offload:
        self.policy.onload()
    rollout_time = time.perf_counter() - t0
    rewards, arrays = self.shaped_rewards(ro), dict(ro.arrays)
    if cfg.overlong_buffer:   # DAPO's overlong shaping, before the advantages
      extra["overlong_penalty_mean"] = float((rewards - ro.rewards).mean())
    advantages = np.asarray(losses.group_advantages(rewards, self.group, cfg.advantage_estimator))
    if cfg.dynamic_sampling:   # DAPO: groups of equal rewards out of the loss, counted
      keep = losses.informative_rows(rewards, self.group)
      arrays["sample_weight"] = keep.astype(np.float32)   # weight 0: the rows left out
      extra["groups_dropped"] = float((~keep).sum() // self.group)
    policy, params = self.policy, state["params"]
    batch = policy.arrays({**arrays, "advantages": advantages})
    batch["old_logprobs"] = policy.token_logprobs(params, batch)
    batch["reference_logprobs"] = (policy.token_logprobs(params, batch, reference=True)
                                   if self.use_reference else jnp.zeros_like(batch["old_logprobs"]))
    report = {"step": step, "rollout": ro, "advantages": advantages,
              "rollout_time_s": rollout_time, "bad_rewards": float(self.scorer.bad), **extra}
    if self.rollouts.separate:
      report["weight_shipping_s"] = self.rollouts.shipping_s
    return batch, report

  def shaped_rewards(self, ro: rollout_lib.Rollout) -> np.ndarray:
    """The rewards of a rollout with DAPO's overlong penalty (`overlong_buffer`) added."""
    cfg = self.cfg
    if not cfg.overlong_buffer:
      return ro.rewards
    return ro.rewards + losses.overlong_penalty(ro.lengths, cfg.max_new_tokens,
                                                cfg.overlong_buffer)

  def resample_equal_groups(self, step: int, ro: rollout_lib.Rollout, engine_params
                            ) -> tuple[rollout_lib.Rollout, float]:
    """DAPO's dynamic sampling with resampling: up to `dynamic_sampling_rounds` times, the groups
    whose (shaped) rewards are all equal are replaced by groups of new prompts, sampled from the
    same parameters → (the rollout, the groups generated again). Round r's prompts are the first
    of step `step`'s prompts in the order of seed + r, its rows' sampler keys past every step's
    first rows ((steps·r + step − 1)·N + j): functions of (seed, step), so a resumed run draws the
    same. The groups still equal after the last round are dropped by the caller."""
    cfg, N, G = self.cfg, self.global_batch, self.group
    resampled = 0
    for r in range(1, cfg.dynamic_sampling_rounds + 1):
      keep = losses.informative_rows(self.shaped_rewards(ro), G)
      equal = [int(g) for g in np.flatnonzero(~keep.reshape(-1, G)[:, 0])]
      if not equal:
        break
      idx = self.prompts.for_step(step, cfg.prompts_per_step, cfg.seed + r)[:len(equal)]
      new = rollout_lib.rollout(self.engine, engine_params, self.prompts, idx, self.scorer,
                                copies=G, sampling=self.sampling(),
                                first_row=(cfg.steps * r + step - 1) * N,
                                max_new_tokens=cfg.max_new_tokens, eos_ids=self.eos_ids(),
                                stop=cfg.stop, decode=self.io.text, seq=cfg.max_target_length)
      ro = rollout_lib.replace_groups(ro, equal, new, G)
      resampled += len(equal)
    return ro, float(resampled)

  def dispatch(self, state: dict, batch: tuple[dict, dict]) -> tuple[dict, tuple]:
    """`num_iterations` updates on one rollout batch (dispatched; no host wait) → (state, the
    passes' metrics, the old log-probabilities and the rollout's report, read by `RolloutRows`)."""
    arrays, report = batch
    passes = []
    for _ in range(self.cfg.num_iterations):
      state, m = self.policy.update(state, arrays)
      passes.append(m)
    state = {**state, "step": state["step"] + 1}
    return state, (passes, arrays["old_logprobs"], report)


class RewardEvaluation:
  """The loop's evaluation for GRPO (`step_loop.Periodic`): the held-out prompts' reward every
  `eval_reward_period` steps and after the last (after that step's save; a failure is logged and
  the run goes on, train/periodic.py: `log_failure`)."""

  def __init__(self, trainer: GRPOTrainer, writer: MetricsWriter):
    self.trainer, self.writer, self.cfg = trainer, writer, trainer.cfg

  def due(self, step: int) -> bool:
    cfg = self.cfg
    return step == cfg.steps or bool(cfg.eval_reward_period and step % cfg.eval_reward_period == 0)

  def evaluate(self, step: int, params) -> None:
    """Evaluates `params`: the row under `step` and its line."""
    metrics = self.trainer.evaluate(params)
    self.writer.write(step, metrics)
    log(f"eval after step {step} | eval_reward {metrics['eval_reward']:.4f} (sampled x"
        f"{self.trainer.group}) | greedy {metrics['eval_reward_greedy']:.4f} | "
        f"{metrics['eval_prompts']} held-out prompts")

  def after_step(self, step: int, params) -> float:
    """After the step's checkpoint was handed off: a failure is logged, never fatal."""
    t0 = time.perf_counter()
    try:
      self.evaluate(step, params)
    except Exception as e:  # pylint: disable=broad-except
      log_failure("evaluation", step, e)
    return time.perf_counter() - t0


class RolloutRows:
  """A GRPO step's row (`step_loop.Rows`), read back one step late: the passes' metrics (their
  mean; the extremes of the ratio; finite only if every pass was), the rollout's rewards, lengths,
  and how far the engine's log-probabilities were from the trainer's. `step_time_s`: from the
  previous row to this one (less evaluation), as in pre-training; `rollout_time_s`: the host time
  of the step's sampling; `train_time_s`: the rest of the step's time."""

  def __init__(self, num_iterations: int, scorer: RewardScorer):
    self.num_iterations, self.scorer = num_iterations, scorer
    self._last_done = time.perf_counter()

  def exclude(self, seconds: float) -> None:
    self._last_done += seconds

  def row(self, metrics: tuple) -> dict:
    passes, old_logprobs, report = metrics
    ro, advantages = report["rollout"], report["advantages"]
    passes = [{k: float(v) for k, v in jax.device_get(m).items()} for m in passes]
    diff = np.abs(_gather(old_logprobs) - ro.rollout_logprobs)[ro.arrays["generation_mask"] > 0]
    now = time.perf_counter()
    step_time, self._last_done = now - self._last_done, now
    row = {k: float(np.mean([p[k] for p in passes])) for k in passes[0]}
    row.update(ratio_max=max(p["ratio_max"] for p in passes),
               ratio_min=min(p["ratio_min"] for p in passes),
               finite=min(p["finite"] for p in passes))
    row.update(
        reward_mean=float(ro.rewards.mean()), reward_std=float(ro.rewards.std()),
        advantage_abs_mean=float(np.abs(advantages).mean()),
        response_length=float(ro.lengths.mean()), finished_frac=float(ro.finished.mean()),
        rollout_logprob_diff_mean=float(diff.mean()), rollout_logprob_diff_max=float(diff.max()),
        bad_rewards=report["bad_rewards"], rollout_time_s=report["rollout_time_s"],
        train_time_s=max(step_time - report["rollout_time_s"], 0.0), step_time_s=step_time,
        optimizer_steps=float(report["step"] * self.num_iterations))
    row.update({k: report[k] for k in ("groups_dropped", "groups_resampled",
                                       "overlong_penalty_mean") if k in report})
    for f, r in enumerate(self.scorer.rewards):
      row[f"reward/{r.name}"] = float(ro.rewards_NF[:, f].mean())
    if "weight_shipping_s" in report:
      row["weight_shipping_s"] = report["weight_shipping_s"]
    return row


class RolloutProgress:
  """GRPO's progress line (`step_loop.Progress`)."""

  def __init__(self, scorer: RewardScorer):
    self.scorer = scorer

  def line(self, step: int, row: dict, steps: int) -> str:
    return progress_line(step, steps, row, self.scorer)

  def warning(self, step: int, row: dict) -> str | None:
    del step, row
    return None


def _gather(x: jax.Array) -> np.ndarray:
  """A sharded global array whole on every process."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def progress_line(step: int, steps: int, m: dict, scorer: RewardScorer) -> str:
  parts = [f"step {step}/{steps}", f"reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}"]
  if len(scorer.rewards) > 1:
    parts.append(" ".join(f"{r.name.rsplit(':', 1)[-1]} {m[f'reward/{r.name}']:.3f}"
                          for r in scorer.rewards))
  parts.append(f"loss {m['loss']:.4f}")
  if "kl" in m:
    parts.append(f"kl {m['kl']:.4f}")
  parts += [f"clip {m['clip_frac_low']:.3f}/{m['clip_frac_high']:.3f}",
            f"len {m['response_length']:.1f}", f"entropy {m['entropy']:.3f}",
            f"rollout {m['rollout_time_s']:.2f} s train {m['train_time_s']:.2f} s"]
  if m["bad_rewards"]:
    parts.append(f"bad rewards {int(m['bad_rewards'])}")
  return " | ".join(parts)


def main(argv: Sequence[str]) -> int:
  return train_main(argv, trainer_class=GRPOTrainer)


if __name__ == "__main__":
  exit_process(main(sys.argv[1:]))
