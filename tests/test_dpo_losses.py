"""The preference losses (MaxText/losses/preference.py, through the DPO step's loss: MaxText/dpo/step.py
`batch_loss`) against TRL 1.16 running its own code on the same tiny transformers model (a random
Qwen3, converted to our parameters) and the same batch of pairs: DPOTrainer's `_compute_loss` for
sigmoid / ipo / hinge / robust (its fused LM head on the policy and on a reference model of other
weights), ORPOTrainer's and CPOTrainer's (loss_type="simpo") `get_batch_loss_metrics` for orpo and
simpo. Each is called on a bare namespace holding the attributes it reads, so no trainer (no
dataset, no accelerate state) is built. Loss, the logged metrics and every parameter's gradient
must agree within 1e-5 in fp32."""
import copy
import functools
from collections import defaultdict
from types import SimpleNamespace

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from conftest import BASE_YML  # noqa: E402
from hf_parity import build_hf_model, hf_state  # noqa: E402
from MaxText.config.load import load_config, replace  # noqa: E402
from MaxText.dpo.data import row_arrays  # noqa: E402
from MaxText.dpo.step import batch_loss, side_logps  # noqa: E402
from MaxText.models.llama import qwen3_hf_map as hf_map  # noqa: E402
from MaxText.models.model_config import ModelConfig  # noqa: E402
from MaxText.models.registry import make_model_def  # noqa: E402


TOL = 1e-5
S = 14          # our rows' length (targets)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


@functools.lru_cache(maxsize=None)
def tiny_models():
  """(policy, reference: the same architecture with other weights, mcfg, model_def)."""
  cfg = load_config([BASE_YML, "model_name=qwen3-tiny", "rope_theta=1000", "scan_layers=true",
                     "dtype=float32"])
  policy = build_hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                          hf_map.config_to_hf(cfg))
  ref = copy.deepcopy(policy)
  torch.manual_seed(1)
  with torch.no_grad():
    for p in ref.parameters():
      p.add_(0.05 * torch.randn_like(p))
  cfg = replace(cfg, **hf_map.config_from_hf(policy.config.to_dict()))
  mcfg = ModelConfig.from_config(cfg)
  return policy, ref, mcfg, make_model_def(mcfg)


def pairs(vocab: int):
  """Three pairs: (prompt ids, chosen ids, rejected ids) of different lengths."""
  rng = np.random.default_rng(0)
  shape = [(4, 5, 3), (6, 2, 7), (3, 9, 6)]
  return [tuple(list(rng.integers(1, vocab, n)) for n in lens) for lens in shape]


def our_batch(data):
  """Host arrays (eagerly, each jnp conversion compiles a program)."""
  sides = {"chosen": [], "rejected": []}
  for prompt, chosen, rejected in data:
    for side, resp in (("chosen", chosen), ("rejected", rejected)):
      sides[side].append(row_arrays(prompt + resp, [0] * len(prompt) + [1] * len(resp), S, 0))
  return {s: {k: np.stack([r[k] for r in rows]) for k in rows[0]} for s, rows in sides.items()}


@functools.lru_cache(maxsize=None)
def our_inputs():
  """(params, batch with the reference model's summed log-probabilities): every case's, built
  once (the TRL side deep-copies the models, so they never change)."""
  policy, ref, mcfg, model_def = tiny_models()
  batch = our_batch(pairs(mcfg.vocab_size))

  @jax.jit   # one program (eagerly, each op of the forward compiles alone)
  def ref_sums(ref_params, batch):
    lc, lr = side_logps(model_def, ref_params, batch, 0)
    return {"chosen": (lc * batch["chosen"]["mask"]).sum(-1),
            "rejected": (lr * batch["rejected"]["mask"]).sum(-1)}
  batch["ref"] = ref_sums(hf_map.hf_to_params(hf_state(ref), mcfg), batch)
  return hf_map.hf_to_params(hf_state(policy), mcfg), batch


@functools.lru_cache(maxsize=None)
def loss_and_grads(loss: str):
  """jitted (params, batch, nll_tokens, numbers) -> ((loss, metric sums), grads) of the DPO step's
  `batch_loss`; the numbers (beta, label_smoothing, simpo_gamma) are arguments, so the cases of one
  loss share its program (traced once); the loss's name chooses the program."""
  _, _, mcfg, model_def = tiny_models()
  pairs_ = float(len(pairs(mcfg.vocab_size)))

  def f(p, batch, nll_tokens, numbers):
    return batch_loss(model_def, p, batch, chunk=5, pairs=pairs_, nll_tokens=nll_tokens,
                      loss_kwargs={"loss": loss, **numbers})
  return jax.jit(jax.value_and_grad(f, has_aux=True))


def our_loss_and_grads(params, batch, loss_kwargs):
  n = float(len(batch["chosen"]["inputs"]))
  numbers = {k: np.float32(v) for k, v in loss_kwargs.items() if k != "loss"}
  (loss, sums), grads = loss_and_grads(loss_kwargs["loss"])(
      params, batch, np.float32(batch["chosen"]["real"].sum()), numbers)
  return float(loss), {k: float(v) / n for k, v in sums.items()}, grads


def accelerator():
  same = lambda x: x
  return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=same, gather=same,
                         unwrap_model=same)


def trl_dpo(policy, ref, data, loss, beta, label_smoothing):
  """TRL's DPOTrainer._compute_loss: the loss (backward done) and its logged metrics."""
  # TRL's trainers imported where they run: a worker that only collects this file skips them
  from trl.trainer.dpo_trainer import DPOTrainer
  from trl.trainer.utils import add_fused_lm_head
  policy, ref = copy.deepcopy(policy), copy.deepcopy(ref)
  add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
  add_fused_lm_head(ref)
  policy.train()
  seqs = [p + c for p, c, _ in data] + [p + r for p, _, r in data]
  comp = [[0] * len(p) + [1] * len(c) for p, c, _ in data] + \
         [[0] * len(p) + [1] * len(r) for p, _, r in data]
  L = max(map(len, seqs))
  pad = lambda rows: torch.tensor([row + [0] * (L - len(row)) for row in rows])
  inputs = {"input_ids": pad(seqs), "attention_mask": pad([[1] * len(s) for s in seqs]),
            "completion_mask": pad(comp)}
  me = SimpleNamespace(
      model=policy, ref_model=ref, accelerator=accelerator(), ld_alpha=None,
      precompute_ref_logps=False, aux_loss_enabled=False, f_divergence_type="reverse_kl",
      loss_types=[loss], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing,
      use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
      _total_train_tokens=0, _tp_size=1, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
  out = DPOTrainer._compute_loss(me, policy, inputs, False)
  out.backward()
  metrics = {k: me._metrics["train"][k][0] for k in METRICS}
  return out.item(), metrics, policy


def trl_pairs_batch(data):
  """ORPO's / CPO's tokenized batch: chosen_* and rejected_* ids, masks, labels (-100 on the prompt
  and the padding)."""
  out = {}
  for side, k in (("chosen", 1), ("rejected", 2)):
    seqs = [d[0] + d[k] for d in data]
    labels = [[-100] * len(d[0]) + list(d[k]) for d in data]
    L = max(map(len, seqs))
    out[f"{side}_input_ids"] = torch.tensor([s + [0] * (L - len(s)) for s in seqs])
    out[f"{side}_attention_mask"] = torch.tensor([[1] * len(s) + [0] * (L - len(s))
                                                  for s in seqs])
    out[f"{side}_labels"] = torch.tensor([lab + [-100] * (L - len(lab)) for lab in labels])
  return out


def trl_reference_free(policy, data, loss, beta, label_smoothing, simpo_gamma):
  from trl.experimental.cpo import CPOTrainer
  from trl.experimental.orpo import ORPOTrainer
  policy = copy.deepcopy(policy)
  cls = ORPOTrainer if loss == "orpo" else CPOTrainer
  me = SimpleNamespace(accelerator=accelerator(), is_encoder_decoder=False, padding_value=0,
                       pad_token_id=0, aux_loss_enabled=False, beta=beta,
                       label_smoothing=label_smoothing, simpo_gamma=simpo_gamma, loss_type=loss,
                       cpo_alpha=0.0, alpha=0.0, concatenated_inputs=cls.concatenated_inputs,
                       get_batch_logps=cls.get_batch_logps)
  me.concatenated_forward = lambda model, batch: cls.concatenated_forward(me, model, batch)
  me.odds_ratio_loss = lambda *a: ORPOTrainer.odds_ratio_loss(me, *a)
  me.cpo_loss = lambda *a: CPOTrainer.cpo_loss(me, *a)
  out, metrics = cls.get_batch_loss_metrics(me, policy, trl_pairs_batch(data))
  out.backward()
  logged = (*METRICS, "nll_loss") if loss == "orpo" else METRICS   # simpo: no cross-entropy
  return out.item(), {k: metrics[k] for k in logged}, policy


CASES = [("sigmoid", 0.1, 0.0), ("sigmoid", 2.0, 0.0), ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0),
         ("hinge", 0.5, 0.0), ("robust", 0.5, 0.2), ("orpo", 0.1, 0.0), ("orpo", 1.0, 0.0),
         ("simpo", 2.0, 0.0), ("simpo", 2.0, 0.15)]


@pytest.mark.parametrize("loss,beta,label_smoothing", CASES)
def test_loss_metrics_and_gradients_equal_trl(loss, beta, label_smoothing):
  policy, ref, mcfg, model_def = tiny_models()
  data = pairs(mcfg.vocab_size)
  gamma = 0.7
  if loss in ("orpo", "simpo"):
    want, want_m, tp = trl_reference_free(policy, data, loss, beta, label_smoothing, gamma)
  else:
    want, want_m, tp = trl_dpo(policy, ref, data, loss, beta, label_smoothing)
  want_grads = hf_map.hf_to_params({k: p.grad.numpy().copy() for k, p in tp.named_parameters()},
                                   mcfg)
  params, batch = our_inputs()
  got, got_m, grads = our_loss_and_grads(
      params, batch, dict(loss=loss, beta=beta, label_smoothing=label_smoothing,
                          simpo_gamma=gamma))
  print(f"{loss}: ours {got:.7f} TRL {want:.7f}")
  assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)
  for k, v in want_m.items():
    assert abs(got_m[k] - v) <= TOL * max(1.0, abs(v)), (k, got_m[k], v)
  assert set(METRICS) <= set(got_m)
  worst = 0.0
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    w = np.asarray(functools.reduce(lambda t, k: t[k.key], path, want_grads), np.float64)
    scale = np.abs(w).max()
    assert scale > 0, path
    err = np.abs(np.asarray(g, np.float64) - w).max() / scale
    worst = max(worst, err)
    assert err <= TOL, (jax.tree_util.keystr(path), err)
  print(f"max grad error (relative to each tensor's max |grad|) = {worst:.1e}")
