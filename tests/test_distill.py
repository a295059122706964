"""Distillation (MaxText/losses/distill.py, MaxText/distill/): the loss against a torch reference
written here (and TRL's GKDTrainer.generalized_jsd_loss for the divergence itself), value and
gradient, whole and chunk by chunk; the chunked loss never holds both models' [B, S, V] logits;
and `python -m MaxText.distill` end to end: a teacher trained here distilled into a student of
another architecture, and a teacher of another vocabulary refused with exit 2 naming
teacher_path."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import MESH_1, argv, read_metrics, train  # noqa: E402
from MaxText.losses.distill import DistillSpec, distill_sums  # noqa: E402
from MaxText.models.model_def import Head  # noqa: E402

B, S, D, DT, V = 3, 7, 8, 12, 33


def make_head(name: str) -> Head:
  return Head(fn=lambda p, h: jnp.einsum("bsd,dv->bsv", h, p[name]["w"]).astype(jnp.float32),
              paths=((name,),))


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)
  params = {"head": {"w": f(D, V)}, "body": {"x": f(4)}}          # the head reads "head" only
  teacher = {"lm": {"w": f(DT, V) * 2.0}, "layers": {"y": f(5)}}
  hidden, t_hidden = f(B, S, D), f(B, S, DT)
  targets = rng.integers(0, V, size=(B, S)).astype(np.int32)
  mask = np.ones((B, S), bool)
  mask[0, 5:] = False
  mask[2, :2] = False
  return params, teacher, hidden, t_hidden, targets, mask


def torch_reference(logits_s, logits_t, targets, mask, spec: DistillSpec):
  """The mean over the masked positions of alpha x divergence x T² + (1 - alpha) x cross-entropy,
  written from the definitions."""
  T, beta = spec.temperature, spec.beta
  log_q = torch.log_softmax(logits_s / T, -1)
  log_p = torch.log_softmax(logits_t / T, -1)
  kl = lambda la, lb: (la.exp() * (la - lb)).sum(-1)
  if spec.divergence == "forward_kl" or (spec.divergence == "jsd" and beta == 0):
    div = kl(log_p, log_q)
  elif spec.divergence == "reverse_kl" or (spec.divergence == "jsd" and beta == 1):
    div = kl(log_q, log_p)
  else:
    m = (beta * log_p.exp() + (1 - beta) * log_q.exp()).log()
    div = beta * kl(log_p, m) + (1 - beta) * kl(log_q, m)
  ce = torch.nn.functional.cross_entropy(logits_s.reshape(-1, logits_s.shape[-1]),
                                         targets.reshape(-1), reduction="none").reshape(mask.shape)
  m = mask.double()
  return ((spec.alpha * div * T * T + (1 - spec.alpha) * ce) * m).sum() / m.sum(), \
      (div * T * T * m).sum() / m.sum()


SPECS = [DistillSpec("forward_kl", temperature=2.0, alpha=0.7),
         DistillSpec("reverse_kl", temperature=1.0, alpha=0.4),
         DistillSpec("jsd", beta=0.3, temperature=1.5, alpha=1.0),
         DistillSpec("jsd", beta=0.0, temperature=1.0, alpha=0.5),
         DistillSpec("jsd", beta=1.0, temperature=3.0, alpha=0.0)]


@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.divergence}-{s.beta}")
def test_loss_and_gradient_equal_the_torch_reference(spec, chunk):
  """Value and gradient (the student head's weights and hidden state) within 1e-5 of the torch
  reference; the teacher gets no gradient; chunk 3 over S = 7 pads the last chunk."""
  params, teacher, hidden, t_hidden, targets, mask = inputs()

  def mean_loss(p, h, tp):
    loss, (kd, _), n = distill_sums(make_head("head"), p, h, make_head("lm"), tp, t_hidden,
                                    targets, mask, spec, chunk)
    return loss / n, kd / n

  (loss, kd), (g_p, g_h, g_t) = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1, 2),
                                                           has_aux=True))(params, hidden, teacher)
  w = torch.tensor(params["head"]["w"], dtype=torch.float64, requires_grad=True)
  h = torch.tensor(hidden, dtype=torch.float64, requires_grad=True)
  t_logits = torch.tensor(t_hidden, dtype=torch.float64) @ torch.tensor(teacher["lm"]["w"],
                                                                        dtype=torch.float64)
  want, want_kd = torch_reference(h @ w, t_logits, torch.tensor(targets, dtype=torch.long),
                                  torch.tensor(mask), spec)
  want.backward()
  assert abs(float(loss) - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
  assert abs(float(kd) - want_kd.item()) <= 1e-5 * max(1.0, abs(want_kd.item()))
  for got, ref in ((g_p["head"]["w"], w.grad), (g_h, h.grad)):
    np.testing.assert_allclose(np.asarray(got), ref.numpy(), atol=1e-5, rtol=1e-5)
  assert not np.asarray(g_p["body"]["x"]).any()
  assert not any(np.asarray(x).any() for x in jax.tree.leaves(g_t))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_the_divergence_is_trls_generalized_jsd(beta):
  """The torch reference's divergence (alpha = 1, T = 2, T² undone) is TRL's GKD loss."""
  trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
  _, _, _, _, targets, mask = inputs()
  rng = np.random.default_rng(3)
  s, t = (torch.tensor(rng.normal(size=(B, S, V)) * 3) for _ in range(2))
  labels = torch.tensor(np.where(mask, targets, -100))
  want = trl_gkd.GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=2.0)
  spec = DistillSpec("jsd", beta=beta, temperature=2.0, alpha=1.0)
  _, ours = torch_reference(s, t, torch.tensor(targets, dtype=torch.long), torch.tensor(mask),
                            spec)
  assert abs(ours.item() / 4.0 - want.item()) <= 1e-10


def test_the_chunked_loss_does_not_hold_both_models_logits():
  """The gradient program of the chunked loss holds far less than the two models' fp32 logits of
  the whole sequence, which the whole-sequence loss holds."""
  S_big, Vb = 256, 512
  rng = np.random.default_rng(0)
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)
  params, teacher = {"head": {"w": f(D, Vb)}}, {"lm": {"w": f(DT, Vb)}}
  hidden, t_hidden = f(2, S_big, D), f(2, S_big, DT)
  targets = rng.integers(0, Vb, size=(2, S_big)).astype(np.int32)
  mask = np.ones((2, S_big), bool)
  spec = DistillSpec("jsd", beta=0.5)

  def temp_bytes(chunk):
    g = jax.grad(lambda p, h: distill_sums(make_head("head"), p, h, make_head("lm"), teacher,
                                           t_hidden, targets, mask, spec, chunk)[0],
                 argnums=(0, 1))
    return jax.jit(g).lower(params, hidden).compile().memory_analysis().temp_size_in_bytes

  both = 2 * 2 * S_big * Vb * 4
  whole, chunked = temp_bytes(0), temp_bytes(S_big // 8)
  assert whole > both
  assert chunked < both / 2, (whole, chunked, both)


def test_the_chunked_loss_per_batch_shard_under_a_mesh_equals_one_device():
  """fsdp 8 (the loop per batch shard: shard_map, the teacher's head weights gathered once): the
  value and gradients of the one-device loss."""
  from conftest import BASE_YML   # pylint: disable=import-outside-toplevel
  from MaxText.config.load import load_config   # pylint: disable=import-outside-toplevel
  from MaxText.sharding.mesh import create_mesh   # pylint: disable=import-outside-toplevel
  from MaxText.sharding.rules import parse_rules, use_rules   # pylint: disable=import-outside-toplevel
  params, teacher, hidden, t_hidden, targets, mask = inputs(seed=4)
  tile = lambda x: np.concatenate([x] * 3)[:8]   # 8 rows over 8 batch shards
  hidden, t_hidden, targets, mask = map(tile, (hidden, t_hidden, targets, mask))
  spec = DistillSpec("jsd", beta=0.4, temperature=1.5, alpha=0.6)

  def mean_loss(p, h):
    loss, _, n = distill_sums(make_head("head"), p, h, make_head("lm"), teacher, t_hidden,
                              targets, mask, spec, 3)
    return loss / n

  want, want_g = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1)))(params, hidden)
  cfg = load_config([BASE_YML, "ici_fsdp_parallelism=8"])
  mesh = create_mesh(cfg, jax.devices())
  rules = parse_rules(cfg.logical_axis_rules, cfg.mesh_axes)

  def sharded(p, h):
    with use_rules(mesh, rules):
      return jax.value_and_grad(mean_loss, argnums=(0, 1))(p, h)

  got, got_g = jax.jit(sharded)(params, hidden)
  assert abs(float(got) - float(want)) <= 1e-6
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
  text = jax.jit(sharded).lower(params, hidden).as_text()
  assert "manual_computation" in text or "shard_map" in text   # the per-batch-shard loop ran


# ---- python -m MaxText.distill ------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher_ckpt(tmp_path_factory):
  """A tiny llama teacher trained here (its checkpoint's path): TINY's 10 steps on one device,
  the programs of tests/test_train.py's one-device run (the data split and the checkpoint are no
  part of them), which one compilation cache (CI) compiles once for both files; one device, where
  8 would cost a program per replicated array's slice when the checkpoint is saved. The students'
  divergence falls step by step from it (the student test)."""
  out = tmp_path_factory.mktemp("teacher")
  code, metrics, _ = train(out, "teacher", "checkpoint_period=10", *MESH_1,
                           devices=jax.devices()[:1])
  assert code == 0, metrics
  return os.path.join(str(out), "teacher", "checkpoints")


def distill(out, name, *overrides, trainer_out=None):
  from MaxText.distill.trainer import DistillTrainer
  from MaxText.train.loop import run
  code, trainer = run(argv(out, name, *overrides), trainer_class=DistillTrainer)
  if trainer_out is not None:
    trainer_out.append(trainer)
  run_dir = os.path.join(str(out), name)
  rows = read_metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
  return code, rows


STUDENTS = {"qwen3": ["model_name=qwen3-tiny"],
            # two layers, one sliding and one full: the pattern's two kinds (the file's "ssssf"
            # repeats them), without its five-layer period
            "gemma4": ["model_name=gemma4-tiny", "num_decoder_layers=2", "attention_pattern=sf",
                       "num_kv_shared_layers=0", "per_layer_input_vocab_size=264"]}
STUDENT_ARGS = ("vocab_size=264", "max_target_length=64", "steps=6", "log_period=1",
                "distill_loss=jsd", "distill_beta=0.3", "distill_temperature=2.0",
                "loss_chunk_length=16", "gradient_accumulation_steps=2", "per_device_batch_size=2",
                "learning_rate=3e-3", "warmup_steps=0", "lr_schedule=constant")


def distill_student(out, student, teacher_ckpt, *overrides, trainer_out=None):
  return distill(out, "student", f"teacher_path={teacher_ckpt}", *STUDENTS[student],
                 *STUDENT_ARGS, *overrides, trainer_out=trainer_out)


@pytest.fixture(scope="module")
def qwen3_student(teacher_ckpt, tmp_path_factory):
  """The Qwen3 student's 6 steps, saved at step 3 and at the end: (its output folder, exit code,
  metrics, trainer), the student test's run and the one the resume test resumes."""
  out = tmp_path_factory.mktemp("qwen3_student")
  trainers = []
  code, rows = distill_student(out, "qwen3", teacher_ckpt, "checkpoint_period=3",
                               "max_checkpoints_to_keep=3", trainer_out=trainers)
  return out, code, rows, trainers[0] if trainers else None


def test_resume_is_bitwise(qwen3_student, teacher_ckpt, tmp_path):
  """A run resumed from its step-3 checkpoint (the teacher loaded again) ends bit for bit where
  the uninterrupted one did (the Qwen3 student's run: the chunked loss per batch shard on 8
  devices, with gradient accumulation)."""
  import shutil   # pylint: disable=import-outside-toplevel
  out, code, rows, whole = qwen3_student
  assert code == 0
  shutil.copytree(out / "student", tmp_path / "student")
  shutil.rmtree(tmp_path / "student" / "checkpoints" / "6")
  resumed = []
  code, again = distill_student(tmp_path, "qwen3", teacher_ckpt, "checkpoint_period=3",
                                "max_checkpoints_to_keep=3", trainer_out=resumed)
  assert code == 0
  with open(tmp_path / "student" / "metrics.superseded.jsonl", encoding="utf-8") as f:
    redone = [json.loads(line)["step"] for line in f]   # the copied rows the resumed run redid
  assert sorted(set(redone)) == [4, 5, 6], redone
  last = lambda rs: [r for r in rs if r.get("step") == 6 and "distill_divergence" in r][-1]
  assert last(again)["loss"] == last(rows)["loss"]
  for a, b in zip(jax.tree.leaves(whole.final_state["params"]),
                  jax.tree.leaves(resumed[0].final_state["params"])):
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("student", STUDENTS)
def test_a_student_of_another_architecture_distills_on_the_mesh(teacher_ckpt, tmp_path, student,
                                                                 request):
  """A student of another shape (Qwen3: q/k norm, another width and depth) or family (Gemma 4:
  sliding and full layers, tied soft-capped head, per-layer inputs) from the llama teacher, the
  chunked loss per batch shard on 8 devices, with gradient accumulation: finite, the divergence
  falls."""
  if student == "qwen3":      # the run the resume test resumes
    _, code, rows, _ = request.getfixturevalue("qwen3_student")
  else:
    code, rows = distill_student(tmp_path, student, teacher_ckpt,
                                 "enable_checkpointing=false")   # no claim on its checkpoint
  assert code == 0
  steps = [r for r in rows if "distill_divergence" in r]
  assert len(steps) == 6
  assert all(np.isfinite(r["loss"]) and r["finite"] == 1.0 for r in steps)
  for r in steps:
    assert abs(r["loss"] - (0.5 * r["distill_divergence"] + 0.5 * r["distill_ce"])) < 1e-4
  assert steps[-1]["distill_divergence"] < steps[0]["distill_divergence"]


def test_a_teacher_of_another_vocabulary_exits_2_naming_teacher_path(teacher_ckpt, tmp_path,
                                                                        capsys):
  code, _ = distill(tmp_path, "bad", f"teacher_path={teacher_ckpt}", "vocab_size=300")
  assert code == 2
  err = capsys.readouterr().err
  assert f"teacher_path={teacher_ckpt}" in err and "vocab_size=264" in err, err
  code, _ = distill(tmp_path, "none", f"teacher_path={tmp_path}/nothing")
  assert code == 2
  assert "teacher_path" in capsys.readouterr().err
