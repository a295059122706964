"""The policy API (MaxText/rl/policy.py) on a group of Ray actors: N workers, each one JAX process
with K devices, joined by `jax.distributed` (the coordinator on worker 0, on 127.0.0.1 when Ray
runs on one machine), together holding the shards of one global mesh. The driver calls the
policy's methods on the group: every worker gets the whole batch (each feeds its devices' rows),
every worker runs the same program, and the result is process 0's.

    import ray
    from MaxText.rl.ray_policy import RayPolicy
    ray.init()                                       # or an existing cluster
    group = RayPolicy.start(num_workers=2, devices_per_worker=4,
                            config=["configs/grpo.yml", "load_parameters_path=CKPT"])
    lp = group.logprobs(batch); metrics = group.train(batch); group.save(3)
    for name, tensor in group.weights(): ...
    group.close()

On one machine the workers' devices are fake CPU devices (`devices_per_worker` of them each,
XLA_FLAGS set in the actor's environment before JAX starts). A worker that dies (a crash, a kill
-9 of its process) makes the call raise `WorkerDied` naming the worker, its process and the last
committed checkpoint — never a hang on the survivors (their pending collective is abandoned and the
group is torn down) and never a silent continue; starting the group again resumes from that
checkpoint (Policy.load's start: the run's latest checkpoint).
"""
from __future__ import annotations

import os
import socket
from typing import Any, Iterator, Mapping, Sequence

from MaxText.storage import paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerDied(RuntimeError):
  """A worker of the group died; the group is gone (start it again to resume)."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class PolicyWorker:
  """One worker: a JAX process of the group holding a `Policy` (run as a Ray actor)."""

  def __init__(self, config: Sequence[str]):
    from MaxText.rl.policy import Policy   # pylint: disable=import-outside-toplevel
    self.policy = Policy.load(list(config))

  def pid(self) -> int:
    return os.getpid()

  def checkpoints(self) -> str:
    return paths.join(self.policy.trainer.run_dir, "checkpoints")

  def call(self, method: str, *args, **kwargs) -> Any:
    out = getattr(self.policy, method)(*args, **kwargs)
    import jax  # pylint: disable=import-outside-toplevel
    return out if jax.process_index() == 0 else None

  def weights(self, tensors: str, layout: str) -> list:
    import jax  # pylint: disable=import-outside-toplevel
    out = list(self.policy.weights(tensors=tensors, layout=layout))   # collectives on every worker
    return out if jax.process_index() == 0 else []

  def close(self) -> None:
    self.policy.close()


class RayPolicy:
  """A group of `PolicyWorker` actors behind the policy's methods (module docstring)."""

  def __init__(self, actors: list, pids: list[int], checkpoints: str):
    self.actors, self.pids, self.checkpoints = actors, pids, checkpoints

  @classmethod
  def start(cls, num_workers: int, devices_per_worker: int, config: Sequence[str],
            env: Mapping[str, str] | None = None) -> "RayPolicy":
    """Starts the workers (ray must be initialised) and loads the policy on them."""
    import ray  # pylint: disable=import-outside-toplevel
    coordinator = f"127.0.0.1:{_free_port()}"
    worker_env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_worker}",
                  "JAX_PLATFORMS": "cpu",
                  "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                if p),
                  **(env or {})}
    remote = ray.remote(num_cpus=0, max_restarts=0)(PolicyWorker)
    actors = [remote.options(name=f"policy-worker-{i}", runtime_env={"env_vars": worker_env})
              .remote([*config, f"coordinator_address={coordinator}",
                       f"num_processes={num_workers}", f"process_id={i}"])
              for i in range(num_workers)]
    group = cls(actors, [], "")
    group.pids = group._all([a.pid.remote() for a in actors], "start")
    group.checkpoints = ray.get(actors[0].checkpoints.remote())
    return group

  def _all(self, refs: list, what: str) -> list:
    """Every worker's result, in order; a dead worker → WorkerDied (the group torn down)."""
    import ray  # pylint: disable=import-outside-toplevel
    pending, done = list(refs), {}
    while pending:
      ready, pending = ray.wait(pending, num_returns=1)
      i = refs.index(ready[0])
      try:
        done[i] = ray.get(ready[0])
      except ray.exceptions.RayActorError as e:
        self._died(i, what, e)
    return [done[i] for i in range(len(refs))]

  def _died(self, i: int, what: str, e: BaseException) -> None:
    pid = f" (pid {self.pids[i]})" if i < len(self.pids) else ""
    last = self.last_checkpoint()
    where = (f"the last committed checkpoint is step {last} in {self.checkpoints}" if last is not None
             else f"no committed checkpoint{' in ' + self.checkpoints if self.checkpoints else ''}")
    self.kill()
    raise WorkerDied(f"policy worker {i}{pid} died during {what} ({type(e).__name__}); the group "
                     f"is stopped; {where} (RayPolicy.start resumes from it)") from None

  def last_checkpoint(self) -> int | None:
    if not self.checkpoints or not os.path.isdir(self.checkpoints):
      return None
    steps = [int(n) for n in os.listdir(self.checkpoints) if n.isdigit()]
    return max(steps) if steps else None

  def _call(self, method: str, *args, **kwargs) -> Any:
    return self._all([a.call.remote(method, *args, **kwargs) for a in self.actors], method)[0]

  # ---- the policy's methods ------------------------------------------------------------------------
  def logprobs(self, batch: Mapping[str, Any]):
    return self._call("logprobs", dict(batch))

  def reference_logprobs(self, batch: Mapping[str, Any]):
    return self._call("reference_logprobs", dict(batch))

  def train(self, batch: Mapping[str, Any], loss: Any = "grpo") -> dict[str, float]:
    return self._call("train", dict(batch), loss)

  def save(self, step: int | None = None) -> int:
    return self._call("save", step)

  def restore(self) -> int:
    return self._call("restore")

  def offload(self, params: bool = False) -> None:
    self._call("offload", params)

  def onload(self) -> None:
    self._call("onload")

  def weights(self, tensors: str = "numpy", layout: str = "checkpoint"
              ) -> Iterator[tuple[str, Any]]:
    yield from self._all([a.weights.remote(tensors, layout) for a in self.actors], "weights")[0]

  def close(self) -> None:
    """Closes the policies (the last save committed) and ends the workers."""
    if self.actors:
      self._all([a.close.remote() for a in self.actors], "close")
    self.kill()

  def kill(self) -> None:
    import ray  # pylint: disable=import-outside-toplevel
    for a in self.actors:
      ray.kill(a, no_restart=True)
    self.actors = []
