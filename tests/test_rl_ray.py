"""The policy on Ray (MaxText/rl/ray_policy.py): a local Ray (started on 127.0.0.1 by the test and
shut down by it) with 2 actors x 4 fake CPU devices, joined by jax.distributed, equals this process
with 8 devices — log-probabilities within 1e-6, three `train` steps' metrics within 1e-6, the
same weights() (streamed); an engine actor of its own sent the weights by the refit stream
(rollout_placement=separate across processes) samples what a local engine samples from them; a
worker killed with SIGKILL makes the next call raise naming the worker and the
last committed checkpoint (no hang), and a group started again resumes from it bit for bit."""
import dataclasses
import os
import signal

import jax

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray")

from conftest import ROOT  # noqa: E402
from ray_peer import Peer  # noqa: E402
from test_rl_policy import LOSS, SHOW_GRAD, S, a_batch, argv  # noqa: E402
from MaxText.rl.policy import Policy  # noqa: E402
from MaxText.decoding.engine import Engine  # noqa: E402
from MaxText.decoding.sampling import Sampling  # noqa: E402
from MaxText.models.llama import qwen3_hf_map as hf_map  # noqa: E402
from MaxText.rl.ray_policy import RayEngine, RayPolicy, WorkerDied  # noqa: E402
from MaxText.sharding.mesh import create_mesh  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
           runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT,
                                                                                     "tests")])}})
  yield
  ray.shutdown()


def test_a_peers_death_is_reported_though_a_survivors_error_comes_first(local_ray):
  """When a worker dies mid-step, the others' collectives fail, often before Ray reports the
  death: the group still names the dead worker; with no death, the worker's own error stands."""
  remote = ray.remote(num_cpus=0, max_restarts=0)(Peer)
  actors = [remote.remote(), remote.remote()]
  group = RayPolicy(actors, [], "")
  with pytest.raises(WorkerDied, match=r"policy worker 1 died during train \(\w+\)"):
    group._all([actors[0].fail.remote(), actors[1].die.remote(1.0)], "train")
  actors = [remote.remote(), remote.remote()]
  group = RayPolicy(actors, [], "")
  with pytest.raises(ray.exceptions.RayTaskError, match="Connection reset by peer"):
    group._all([actors[0].fail.remote(), actors[1].ok.remote()], "train")
  group.kill()


def steps(policy, batch):
  out = []
  for _ in range(3):
    batch = {**batch, "old_logprobs": policy.logprobs(batch),
             "reference_logprobs": policy.reference_logprobs(batch)}
    out.append(policy.train(batch))
  return out


def test_two_actors_equal_one_process_and_a_killed_worker_is_named(local_ray, tmp_path):
  one = Policy.load(argv(tmp_path / "one", *LOSS, *SHOW_GRAD[1:], "learning_rate=1e-2"))
  batch = a_batch(one.model_config.vocab_size)
  want_lp, want_steps = one.logprobs(batch), steps(one, batch)
  want_weights = dict(one.weights())
  one.close()

  config = argv(tmp_path / "ray", *LOSS, *SHOW_GRAD[1:], "learning_rate=1e-2")
  group = RayPolicy.start(num_workers=2, devices_per_worker=4, config=config)
  try:
    lp = group.logprobs(batch)
    np.testing.assert_allclose(lp, want_lp, rtol=0, atol=1e-6)
    for got, want in zip(steps(group, batch), want_steps):
      assert set(got) == set(want)
      for k in want:
        assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (k, got[k], want[k])
    weights = dict(group.weights())
    assert set(weights) == set(want_weights)
    # adam_eps=1 (SHOW_GRAD): an update is ~ lr x g, so the gradients' rounding (sums in another
    # order across processes) stays rounding; with eps=1e-8 Adam's g / |g| turns it into up to
    # ~1e-4 of a step where a gradient is near 0
    for k, v in want_weights.items():
      assert weights[k].shape == v.shape and weights[k].dtype == v.dtype, k
      np.testing.assert_allclose(weights[k], v, rtol=0, atol=1e-6, err_msg=k)
    # separate rollouts across processes: an engine actor on 2 devices of its own, sent the
    # weights by the refit stream, samples what an engine here on 2 devices samples from the
    # group's weights (the same program on the same parameters: bit for bit)
    engine = RayEngine.start(devices=2, config=config, batch_size=8, max_cache_length=S)
    try:
      assert group.ship_weights(engine) > 0
      prompts = [list(row[:4]) for row in batch["input_ids"]]
      sampling = Sampling(1.0, seed=3)
      got = engine.generate(prompts, max_new_tokens=6, sampling=sampling)
    finally:
      engine.kill()
    mcfg = dataclasses.replace(one.model_config, lora_rank=0)
    local = Engine(mcfg, create_mesh(one.cfg, jax.devices()[:2]), one.rules, batch_size=8,
                   max_cache_length=S)
    params = local.place(hf_map.hf_to_params(weights, mcfg))
    want = local.generate(params, prompts, max_new_tokens=6, sampling=sampling)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert [c.output_logprobs for c in got] == [c.output_logprobs for c in want]
    assert group.save(3) == 3
    after_save = group.logprobs(batch)
    os.kill(group.pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDied) as e:
      group.train({**batch, "old_logprobs": after_save, "reference_logprobs": after_save})
    message = str(e.value)
    assert f"policy worker 1 (pid {group.pids[1]}) died" in message
    assert "the last committed checkpoint is step 3" in message, message
    # the group was torn down before the error: no worker process is left (ray.kill alone returns
    # before they end), so the start below finds the run directory's lock free
    assert [p for p in group.pids if psutil.pid_exists(p)] == []
  finally:
    group.kill()

  again = RayPolicy.start(num_workers=2, devices_per_worker=4, config=config)
  try:
    np.testing.assert_array_equal(again.logprobs(batch), after_save)   # resumed bit for bit
  finally:
    again.close()
