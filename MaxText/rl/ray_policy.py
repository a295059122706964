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

import dataclasses
import os
import socket
import time
from typing import Any, Iterator, Mapping, NoReturn, Sequence

from MaxText.storage import paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerDied(RuntimeError):
  """A worker of the group died; the group is gone (start it again to resume)."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# seconds a worker's error waits for the other workers' answers: a dead peer is reported as such
DEATH_GRACE_S = 60.0
# seconds `kill` waits for the killed actors' processes on this host to end
KILL_WAIT_S = 60.0


def _where() -> tuple[str, int]:
  return socket.gethostname(), os.getpid()


def _kill(actors: Sequence[Any], where: Sequence[tuple[str, int]]) -> None:
  """Kills the actors and returns once their processes on this host have ended (or after
  KILL_WAIT_S): `ray.kill` returns before they do, and a group started again at once would find
  the old process 0 still holding the run directory's lock (and its memory). Processes on other
  hosts are not waited for (nothing here can see them)."""
  import psutil  # pylint: disable=import-outside-toplevel
  import ray  # pylint: disable=import-outside-toplevel
  for a in actors:
    ray.kill(a, no_restart=True)
  here, procs = socket.gethostname(), []
  for host, pid in where:
    if host == here:
      try:
        procs.append(psutil.Process(pid))
      except psutil.NoSuchProcess:
        pass
  psutil.wait_procs(procs, timeout=KILL_WAIT_S)


def _worker_env(devices: int, env: Mapping[str, str] | None) -> dict[str, str]:
  """An actor's environment: `devices` fake CPU devices (set before JAX starts) with this
  process's other XLA flags (its compile options: the actors compile as the caller does), this
  tree."""
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count=")]
  return {"XLA_FLAGS": " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"]),
          "JAX_PLATFORMS": "cpu",
          "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
          **(env or {})}


class PolicyWorker:
  """One worker: a JAX process of the group holding a `Policy` (run as a Ray actor)."""

  def __init__(self, config: Sequence[str]):
    from MaxText.rl.policy import Policy   # pylint: disable=import-outside-toplevel
    self.policy = Policy.load(list(config))

  def where(self) -> tuple[str, int]:
    """(host name, pid) of this worker's process."""
    return _where()

  def checkpoints(self) -> str:
    return paths.join(self.policy.trainer.run_dir, "checkpoints")

  def call(self, method: str, *args, **kwargs) -> Any:
    out = getattr(self.policy, method)(*args, **kwargs)
    import jax  # pylint: disable=import-outside-toplevel
    return out if jax.process_index() == 0 else None

  def weights(self, tensors: str, layout: str) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of each tensor, from process 0, one at a time (a Ray streaming generator at
    most 2 objects ahead of its caller); the other workers run the same collectives (each block
    gathered from all of them) and yield nothing."""
    import jax  # pylint: disable=import-outside-toplevel
    first = jax.process_index() == 0
    for item in self.policy.weights(tensors=tensors, layout=layout):
      if first:
        yield item
      del item
  # what @ray.method(num_returns="streaming", _generator_backpressure_num_objects=2) sets (ray is
  # imported only where a group is started)
  weights.__ray_num_returns__ = "streaming"  # type: ignore[attr-defined]
  weights.__ray_generator_backpressure_num_objects__ = 2  # type: ignore[attr-defined]

  def close(self) -> None:
    self.policy.close()


class RayPolicy:
  """A group of `PolicyWorker` actors behind the policy's methods (module docstring)."""

  def __init__(self, actors: list, pids: list[int], checkpoints: str,
               hosts: list[str] | None = None):
    self.actors, self.pids, self.checkpoints = actors, pids, checkpoints
    self.hosts = hosts if hosts is not None else [socket.gethostname()] * len(pids)

  @classmethod
  def start(cls, num_workers: int, devices_per_worker: int, config: Sequence[str],
            env: Mapping[str, str] | None = None) -> "RayPolicy":
    """Starts the workers (ray must be initialised) and loads the policy on them."""
    import ray  # pylint: disable=import-outside-toplevel
    coordinator = f"127.0.0.1:{_free_port()}"
    worker_env = _worker_env(devices_per_worker, env)
    remote = ray.remote(num_cpus=0, max_restarts=0)(PolicyWorker)
    actors = [remote.options(name=f"policy-worker-{i}", runtime_env={"env_vars": worker_env})
              .remote([*config, f"coordinator_address={coordinator}",
                       f"num_processes={num_workers}", f"process_id={i}"])
              for i in range(num_workers)]
    group = cls(actors, [], "")
    where = group._all([a.where.remote() for a in actors], "start")
    group.hosts, group.pids = [h for h, _ in where], [p for _, p in where]
    group.checkpoints = ray.get(actors[0].checkpoints.remote())
    return group

  def _all(self, refs: list, what: str) -> list:
    """Every worker's result, in order; a dead worker → WorkerDied (the group torn down). A
    worker's own error is raised once the others have answered, or after DEATH_GRACE_S: when a
    peer dies, a survivor's collective fails first (its connection reset), and the death is the
    cause to report."""
    import ray.exceptions  # pylint: disable=import-outside-toplevel
    pending, done = list(refs), {}
    failed: BaseException | None = None
    while pending:
      ready, pending = ray.wait(pending, num_returns=1,
                                timeout=None if failed is None else DEATH_GRACE_S)
      if not ready:          # the others still run (or wait on the failed one): its error stands
        break
      i = refs.index(ready[0])
      try:
        done[i] = ray.get(ready[0])
      except ray.exceptions.RayActorError as e:
        self._died(i, what, e)
      except ray.exceptions.RayTaskError as e:
        failed = failed or e
    if failed is not None:
      raise failed
    return [done[i] for i in range(len(refs))]

  def _died(self, i: int, what: str, e: BaseException) -> NoReturn:
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
    """(Hugging Face name, tensor) of every weight, streamed from the group one at a time."""
    import ray.exceptions  # pylint: disable=import-outside-toplevel
    for ref in self._stream("weights", tensors, layout):
      try:
        item: Any = ray.get(ref)
      except ray.exceptions.RayActorError as e:
        self._died(0, "weights", e)
      del ref
      yield item

  def _stream(self, what: str, tensors: str = "numpy", layout: str = "checkpoint") -> Iterator:
    """The object refs of worker 0's (name, tensor) items as they come, while the other workers'
    streams are watched (a dead worker → WorkerDied, never a hang)."""
    import ray.exceptions  # pylint: disable=import-outside-toplevel
    streams = [a.weights.remote(tensors, layout) for a in self.actors]
    live = list(streams)
    while live:
      ready, _ = ray.wait(live, num_returns=1)
      # (the stream itself: ray.wait's stub types what it returns as ObjectRefs only)
      i = next(k for k, g in enumerate(streams) if g is ready[0])
      stream = streams[i]
      try:
        ref = next(stream)
      except StopIteration:
        live = [g for g in live if g is not stream]
        continue
      except ray.exceptions.RayActorError as e:
        self._died(i, what, e)
      if i == 0:
        yield ref
      else:   # the other workers yield nothing; an item here is an error they raised
        ray.get(ref)

  def ship_weights(self, engine: "RayEngine") -> float:
    """Ships the weights to `engine` (on actors of its own) by the refit stream: each tensor goes
    from worker 0 to the engine through Ray's object store (never through this driver), the
    engine writing it into its parameters on its devices as it comes (`refit.Receiver`).
    Returns the seconds it took (`weight_shipping_s`)."""
    t0 = time.perf_counter()
    actor = engine.actor
    if actor is None:
      raise WorkerDied("ship_weights: the rollout engine was killed")
    engine.call("begin")
    pending: list = []
    for ref in self._stream("ship_weights"):
      pending.append(actor.put.remote(ref))   # the engine reads the object itself
      del ref
      if len(pending) > 2:      # at most 2 tensors in flight
        engine.wait(pending.pop(0), "ship_weights")
    for ref in pending:
      engine.wait(ref, "ship_weights")
    engine.call("finish")
    return time.perf_counter() - t0

  def close(self) -> None:
    """Closes the policies (the last save committed) and ends the workers."""
    if self.actors:
      self._all([a.close.remote() for a in self.actors], "close")
    self.kill()

  def kill(self) -> None:
    """Ends the workers at once (no save); returns when their processes here have ended."""
    _kill(self.actors, list(zip(self.hosts, self.pids)))
    self.actors = []


class EngineWorker:
  """The decoding engine on a Ray actor of its own (a JAX process outside the policy's group, on
  devices of its own): the policy's model (LoRA merged) on a mesh of its devices, its parameters
  sent by `RayPolicy.ship_weights` one tensor at a time (`refit.Receiver`)."""

  def __init__(self, config: Sequence[str], batch_size: int, max_cache_length: int):
    # pylint: disable=import-outside-toplevel
    from MaxText import refit
    from MaxText.decoding.engine import Engine
    from MaxText.models.registry import hf_model_type_for
    from MaxText.rl.policy import PolicyTrainer
    from MaxText.train.loop import build
    t = build(list(config), None, PolicyTrainer)   # config, mesh and rules as the policy's
    mcfg = dataclasses.replace(t.mcfg, lora_rank=0)
    self.cfg = t.cfg
    self.engine = Engine(mcfg, t.mesh, t.rules, cache_dtype=t.cfg.cache_dtype,
                         batch_size=batch_size, max_cache_length=max_cache_length)
    self.receiver = refit.Receiver(mcfg, self.engine.param_shardings,
                                   hf_model_type_for(mcfg, t.cfg.hf_model_type))
    self.params: Any = None

  def where(self) -> tuple[str, int]:
    """(host name, pid) of this engine's process."""
    return _where()

  def begin(self) -> None:
    self.receiver.begin(self.params)   # the last copy is overwritten in place
    self.params = None

  def put(self, item: tuple[str, Any]) -> None:
    self.receiver.put(*item)

  def finish(self) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    self.params = jax.block_until_ready(self.receiver.finish())

  def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list:
    """Engine.generate on the shipped parameters (Completion objects)."""
    return self.engine.generate(self.params, prompts, **kwargs)


class RayEngine:
  """An `EngineWorker` actor (rollout_placement=separate across processes): start it beside a
  RayPolicy, `group.ship_weights(engine)` after each update, `engine.generate(...)`.

      engine = RayEngine.start(devices=4, config=[...], batch_size=64, max_cache_length=S)
      seconds = group.ship_weights(engine)
      completions = engine.generate(prompt_ids, max_new_tokens=6, sampling=..., eos_ids=[...])
  """

  def __init__(self, actor: Any, pid: int, host: str | None = None):
    self.actor, self.pid, self.host = actor, pid, host or socket.gethostname()

  @classmethod
  def start(cls, devices: int, config: Sequence[str], batch_size: int, max_cache_length: int,
            env: Mapping[str, str] | None = None) -> "RayEngine":
    import ray  # pylint: disable=import-outside-toplevel
    remote = ray.remote(num_cpus=0, max_restarts=0)(EngineWorker)
    actor = remote.options(name=f"rollout-engine-{_free_port()}",
                           runtime_env={"env_vars": _worker_env(devices, env)}) \
        .remote(list(config), batch_size, max_cache_length)
    engine = cls(actor, 0)
    engine.host, engine.pid = engine.wait(actor.where.remote(), "start")
    return engine

  def wait(self, ref: Any, what: str) -> Any:
    import ray.exceptions  # pylint: disable=import-outside-toplevel
    try:
      return ray.get(ref)
    except ray.exceptions.RayActorError as e:
      self.kill()
      raise WorkerDied(f"the rollout engine (pid {self.pid}) died during {what} "
                       f"({type(e).__name__})") from None

  def call(self, method: str, *args, **kwargs) -> Any:
    return self.wait(getattr(self.actor, method).remote(*args, **kwargs), method)

  def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list:
    return self.call("generate", [list(map(int, p)) for p in prompts], **kwargs)

  def kill(self) -> None:
    """Ends the engine at once; returns when its process here has ended."""
    if self.actor is not None:
      _kill([self.actor], [(self.host, self.pid)] if self.pid else [])
      self.actor = None
