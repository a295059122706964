"""Continuous batching: the engine's own thread, a queue of waiting requests and a fixed number of
decode slots (MaxText/decoding/slots.py).

Between two decoding calls the thread takes waiting requests into free slots and prefills their
prompts (together, one call per prompt-length bucket, when nothing decodes), then runs up to
`chunk` steps of every slot that decodes; a call ends early when a slot finishes or a request
waits for a free slot (Slots.interrupt, a host callback between two steps; `interrupt=False`:
none, calls run their steps), so a newcomer waits one step, not a call. With `overlap` (on) the
next decoding call is dispatched before the last one's tokens are read back (`Slots.follow`:
from its state on the device, over the same rows), so the device does not wait while this thread
hands tokens out; it follows while no request joins and no prompt is in pieces (those change the
state on the host: the call in flight is read back first, `_drain`). A request that leaves by a
stop string or a cancel rides along in the call already dispatched (its tokens dropped; a
finished one is done on the device and makes none). Where a call ends never changes a token.
While other
slots decode, at most `prefill_chunk` prompt tokens go in between two decoding calls, one prompt
per program: a long prompt is prefilled in pieces over several calls (chunked prefill, every
family; a prompt with images or audio goes whole), so it never stalls the running requests for
long, and the pieces' programs are few (`_prefill_pieces`); with `step_between_pieces` a
decoding call makes one step between two pieces (`_waits`: where a piece costs about a step). A
request leaves its slot when it finishes — an eos id, a stop string (MaxText/serve/text.py),
`max_tokens` — or is cancelled (its client went away), so a short request never waits for the
longest of a batch. Each request (`Job`: one choice of one prompt) reports to its `sink`
(called on this thread; the HTTP side hands it to its event loop) a `Delta` per decoding call:
the new text released, the new tokens with their log-probabilities, and at the end the finish
reason. A request with `echo` and `logprobs` first gets its prompt's log-probabilities
(`Engine.score_top`, on this thread too). With prefix caching (`prefix_min` > 0,
MaxText/serve/prefix.py) a prompt that starts with tokens a slot's row still holds takes that
row (copied into its slot, or that slot itself when free) and prefills only the rest. A full queue refuses a request (`QueueFull`); `stop`
lets the queued and running requests finish, then ends the thread.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from MaxText.decoding.engine import batch_media
from MaxText.decoding.slots import Call, Slots, row_values
from MaxText.serve.prefix import PrefixIndex

log = logging.getLogger("MaxText.serve")
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}


class QueueFull(RuntimeError):
  """The queue holds `serve_queue` requests: come back later (503, Retry-After)."""


@dataclass
class Delta:
  """What one decoding call added to a request."""
  text: str = ""
  ids: list[int] = field(default_factory=list)
  logprobs: list[float] = field(default_factory=list)
  top: list[list[tuple[int, float]]] = field(default_factory=list)   # per token: (id, logprob)
  finish_reason: str | None = None        # "stop" | "length" | "cancelled" | "error" at the end
  prompt_logprobs: Any = None             # echo: (logprobs [P-1], top ids [P-1, k], top lps)
  error: str = ""


@dataclass
class Pending:
  """A decoding call dispatched (`Slots.launch` / `follow`), the requests of its slots then (None:
  none, or a prompt still prefilling) and when it was dispatched."""
  call: Call
  jobs: list[Job | None]
  t0: float


@dataclass
class Job:
  """One completion: a prompt's ids, its sampling values, where its deltas go."""
  prompt_ids: list[int]
  max_tokens: int
  sink: Callable[[Delta], None]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int = 0
  row: int = 0                   # the prompt index of the sampling key (choice i of n: i)
  stop: list[str] = field(default_factory=list)
  top: int = 0                   # most likely tokens reported per position (0: none)
  logprobs: bool = False         # report the chosen tokens' log-probabilities
  echo_logprobs: bool = False    # report the prompt's log-probabilities first
  cancelled: bool = False        # set by the HTTP side (a client that went away)
  media: dict[str, Any] | None = None   # the prompt's images and clips (processor tensors)
  submitted: float = field(default_factory=time.perf_counter)
  prefilled: int = 0             # prompt tokens in its slot's cache so far

  def sampling(self) -> dict[str, Any]:
    return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "min_p": self.min_p, "seed": self.seed % (1 << 32)}


class Scheduler:
  """The engine thread over `slots` (module docstring). `model`: a MaxText.inference model (its
  parameters, engine, tokenizer and eos ids); `metrics`: MaxText/serve/metrics.Metrics or None."""

  def __init__(self, model, slots: Slots, queue_size: int, metrics=None,
               text_stream: Callable[[list[str]], Any] | None = None, top_max: int = 20,
               prefill_chunk: int = 0, prefix_min: int = 0, step_between_pieces: bool = False,
               on_first_answer: Callable[[Job], None] | None = None,
               on_call: Callable[[str, list[int], int, float, float], None] | None = None,
               overlap: bool = True, interrupt: bool = True):
    self.model, self.slots, self.queue_size, self.metrics = model, slots, queue_size, metrics
    # called on this thread after each engine call: (kind "prefill" | "piece" | "step", the
    # slots it served, its tokens (prompt tokens, or steps), start and end perf_counter seconds)
    self.on_call = on_call
    # called once, on this thread, with the first request that finishes (the start-up line)
    self.on_first_answer = on_first_answer
    # prompt tokens prefilled per engine call while other slots decode (0: whole prompts)
    self.prefill_chunk = prefill_chunk
    self.prefilling: list[int] = []      # slots whose prompt is not all in the cache yet
    # while a prompt goes in pieces, a decoding call makes one step between two of them (`_waits`)
    self.step_between_pieces = step_between_pieces
    self.text_stream = text_stream
    self.top_max = top_max
    n = slots.slots
    # prefix caching: the tokens each slot's row holds (None: off)
    self.prefix = PrefixIndex(n, slots.positional, prefix_min) if prefix_min else None
    self.reuse: dict[int, tuple[int, int]] = {}   # a taken slot: (the row it reuses, tokens)
    self.jobs: list[Job | None] = [None] * n
    self.streams: list[Any] = [None] * n
    self.state = {"token": np.zeros(n, np.int32), "position": np.zeros(n, np.int32),
                  "count": np.zeros(n, np.int32), "max_new": np.ones(n, np.int32),
                  "done": np.ones(n, bool), "row": np.zeros(n, np.int32)}
    self.waiting: collections.deque[Job] = collections.deque()
    self.cv = threading.Condition()
    self.stopping = False
    self.failed: str = ""
    # the next decoding call dispatched before the last one's tokens are read back (`_step`)
    self.overlap = overlap
    self.pending: Pending | None = None   # the decoding call in flight
    self.collected = 0.0                  # when the last one was read back (perf_counter)
    self.thread = threading.Thread(target=self._run, name="maxtext-engine", daemon=True)
    # a decoding call ends after its step in flight when a request waits for a free slot (a host
    # callback between two steps; `interrupt` False: calls run their steps, fewer host round trips)
    slots.interrupt = self._waits if interrupt else None

  def _waits(self) -> bool:
    """A request waits and a slot is free, or (`step_between_pieces`) a prompt is being
    prefilled in pieces (read without the lock: a stale answer costs a step): the decoding call
    in flight ends after its step. With `step_between_pieces` the running requests make one
    token per piece (vLLM's and Sarathi-Serve's chunked prefill: each iteration a step and a
    piece), so a newcomer's first token waits one step per piece, not `chunk` steps: where a
    piece costs about a step (a TPU: both read the weights once); on a CPU a piece costs many
    steps and the running requests would pay for it (measured there: no gain, f0896f3)."""
    return ((self.step_between_pieces and bool(self.prefilling))
            or (bool(self.waiting) and any(j is None for j in self.jobs)))

  # ---- the HTTP side -----------------------------------------------------------------------------
  def start(self) -> None:
    self.thread.start()

  def submit(self, jobs: list[Job]) -> None:
    """Queues `jobs` (all of one request, together); QueueFull when they do not fit."""
    with self.cv:
      if self.stopping or self.failed:
        raise QueueFull("the server is stopping" if self.stopping else self.failed)
      if len(self.waiting) + len(jobs) > self.queue_size:
        raise QueueFull(f"the queue holds {len(self.waiting)} requests (serve_queue="
                        f"{self.queue_size})")
      self.waiting.extend(jobs)
      self._gauges()
      self.cv.notify()

  def cancel(self, jobs: list[Job]) -> None:
    with self.cv:
      for j in jobs:
        j.cancelled = True
      self.cv.notify()

  def stop(self, timeout: float | None = None) -> None:
    """Lets the queued and running requests finish, then ends the thread."""
    with self.cv:
      self.stopping = True
      self.cv.notify()
    self.thread.join(timeout)

  def busy(self) -> int:
    return sum(j is not None for j in self.jobs)

  # ---- the engine thread -------------------------------------------------------------------------
  def _run(self) -> None:
    try:
      while True:
        with self.cv:
          while not self.waiting and not self.busy() and not self.stopping:
            self.pending = None        # its requests all left
            self.cv.wait()
          if self.stopping and not self.waiting and not self.busy():
            return
          new = self._take()
        if new or self.prefilling:
          self._drain()                # the state a request joins, a piece goes in, is the host's
        if new:
          self._admit(new)
        if self.prefilling:
          self._prefill_pieces()
        if self.busy() > len(self.prefilling):
          self._step()
    except Exception as e:   # pylint: disable=broad-except  (every request is answered)
      log.exception("the engine thread failed")
      self._fail(f"the engine failed: {type(e).__name__}: {e}")

  def _fail(self, message: str) -> None:
    with self.cv:
      self.failed = message
      jobs = [j for j in self.jobs if j is not None] + list(self.waiting)
      self.waiting.clear()
      self.jobs = [None] * len(self.jobs)
      self.prefilling.clear()
      self.pending = None
    for j in jobs:
      j.sink(Delta(finish_reason="error", error=message))

  def _take(self) -> list[tuple[int, Job]]:
    """Waiting jobs for the free slots (cancelled ones answered and dropped)."""
    free = [s for s, j in enumerate(self.jobs) if j is None]
    out = []
    while free and self.waiting:
      job = self.waiting.popleft()
      if job.cancelled:
        job.sink(Delta(finish_reason="cancelled"))
        continue
      if self.prefix is None:
        slot = free.pop(0)
      else:
        slot, source, m = self.prefix.place(None if job.media else job.prompt_ids, free)
        free.remove(slot)
        self.prefix.took(slot, m if source == slot else 0)
        self.reuse[slot] = (source, m)
      self.jobs[slot] = job
      out.append((slot, job))
    self._gauges()
    return out

  def _gauges(self) -> None:
    if self.metrics is not None:
      self.metrics.queue.set(len(self.waiting))
      self.metrics.slots_busy.set(self.busy())

  def _release(self, slot: int) -> None:
    job, first = self.jobs[slot], self.on_first_answer
    if job is not None and first is not None:
      self.on_first_answer = None
      first(job)
    with self.cv:
      self.jobs[slot] = None
      self.streams[slot] = None
      if slot in self.prefilling:
        self.prefilling.remove(slot)
      self.state["done"][slot] = True
      self._gauges()

  def _admit(self, new: list[tuple[int, Job]]) -> None:
    model = self.model
    echo = [j for _, j in new if j.echo_logprobs]
    if echo:                          # the prompts' own log-probabilities, scored together
      scored = model.engine.score_top(model.params, [j.prompt_ids[:1] for j in echo],
                                      [j.prompt_ids[1:] for j in echo],
                                      top=max(1, *(j.top for j in echo)))
      for job, got in zip(echo, scored):
        job.sink(Delta(prompt_logprobs=got))
    for s, j in new:
      source, m = self.reuse.pop(s, (-1, 0))
      if m:
        if source != s:
          self.slots.copy(source, s)
          assert self.prefix is not None
          self.prefix.copied(source, s, m)
        j.prefilled = m
        if self.metrics is not None:
          self.metrics.prefix_hits.inc()
          self.metrics.prefix_tokens.inc(m)
    if self.metrics is not None:
      self.metrics.prompt_tokens.inc(sum(len(j.prompt_ids) - j.prefilled for _, j in new))
    for s, j in new:
      if j.max_tokens == 0:
        j.sink(Delta(finish_reason="length"))
        self._release(s)
      else:
        self.prefilling.append(s)

  def _prefill_pieces(self) -> None:
    """Prefills the waiting prompts: whole when no slot decodes (nobody waits for them; one call
    per kind of piece: first pieces by prompt-length bucket, so a short prompt is not padded to a
    long one, continuing ones together), else pieces of at most `prefill_chunk` tokens in all
    this call, one prompt per program, first come first served (a long prompt goes in pieces over
    several calls, so the decoding slots keep stepping). A prompt's first piece is what is left
    over (its length modulo `prefill_chunk`), each later one exactly `prefill_chunk` tokens: a
    piece's program is one of few (the first pieces' length buckets, then one length in cache
    windows), all met early on, never compiled while requests wait on it."""
    for s in list(self.prefilling):
      job = self.jobs[s]
      if job is not None and job.cancelled:
        job.sink(Delta(finish_reason="cancelled"))
        self._release(s)
    chunk = self.prefill_chunk if self.busy() > len(self.prefilling) else 0
    if chunk:
      budget = chunk
      for s in list(self.prefilling):
        job = self.jobs[s]
        assert job is not None
        left = len(job.prompt_ids) - job.prefilled
        take = left if job.media else left % chunk or chunk
        if take > budget and budget < chunk:
          break                       # the budget is spent: the rest after the next steps
        budget -= take
        self._prefill([(s, job, take)], job.prefilled == 0)
        if budget <= 0:
          break
      return
    pieces: dict[tuple[bool, int], list[tuple[int, Job, int]]] = {}
    for s in list(self.prefilling):
      job = self.jobs[s]
      assert job is not None
      take = len(job.prompt_ids) - job.prefilled
      first = job.prefilled == 0
      key = (first, self.slots.prompt_bucket(take) if first else 0)
      pieces.setdefault(key, []).append((s, job, take))
    for (first, _), group in sorted(pieces.items(), key=lambda kv: (not kv[0][0], kv[0][1])):
      while group:       # calls of power-of-two rows: no row of padding (each would cost a prompt)
        n = 1 << (len(group).bit_length() - 1)
        self._prefill(group[:n], first)
        group = group[n:]

  def _prefill(self, group: list[tuple[int, Job, int]], first: bool) -> None:
    t0 = time.perf_counter()
    ends = [j.prefilled + n == len(j.prompt_ids) for _, j, n in group]
    top = self.top_max if any(j.top for (_, j, _), end in zip(group, ends) if end) else 0
    media = batch_media([j.media or {} for _, j, _ in group], range(len(group))) if first else {}
    first_ids, first_lp, top_ids, top_lps = self.slots.prefill(
        self.model.params, [j.prompt_ids[j.prefilled:j.prefilled + n] for _, j, n in group],
        [s for s, _, _ in group], [j.row for _, j, _ in group],
        [j.sampling() if end else GREEDY for (_, j, _), end in zip(group, ends)], top,
        starts=None if first else [j.prefilled for _, j, _ in group], media=media)
    now = time.perf_counter()
    if self.on_call is not None:
      self.on_call("prefill" if first else "piece", [s for s, _, _ in group],
                   sum(n for _, _, n in group), t0, now)
    for b, ((s, j, n), end) in enumerate(zip(group, ends)):
      if self.prefix is not None:
        self.prefix.wrote(s, j.prompt_ids[j.prefilled:j.prefilled + n])
      j.prefilled += n
      if not end:
        continue
      self.prefilling.remove(s)
      if self.metrics is not None:
        self.metrics.ttft.observe(now - j.submitted)
      self.streams[s] = self.text_stream(j.stop) if self.text_stream else None
      st = self.state
      st["token"][s], st["position"][s], st["count"][s] = first_ids[b], len(j.prompt_ids), 1
      st["max_new"][s], st["done"][s], st["row"][s] = j.max_tokens, False, j.row
      self._emit(s, j, np.asarray([first_ids[b]]), np.asarray([first_lp[b]]), top_ids[b:b + 1],
                 top_lps[b:b + 1])

  def _step(self) -> None:
    """Dispatches the next decoding call, then hands out the tokens of the one before it (module
    docstring: `follow`ed while nothing joins, so the device never waits for the host)."""
    for s, j in enumerate(self.jobs):
      if j is not None and j.cancelled and s not in self.prefilling:
        j.sink(Delta(finish_reason="cancelled"))
        self._release(s)
    jobs = [None if s in self.prefilling else j for s, j in enumerate(self.jobs)]
    last = self.pending
    if not any(jobs):
      self.pending = None              # its rows' requests all left: nothing to hand out
      return
    if (last is not None and self.overlap and not self.prefilling
        and all(j is None or j is last.jobs[s] for s, j in enumerate(jobs))):
      self.pending = Pending(self.slots.follow(self.model.params, last.call), last.jobs,
                             time.perf_counter())
      self._collect(last)
      return
    if last is not None:
      self._drain()
      jobs = [None if s in self.prefilling else j for s, j in enumerate(self.jobs)]
      if not any(jobs):
        return
    values = row_values([j.sampling() if j is not None else GREEDY for j in jobs], len(jobs))
    top = self.top_max if any(j is not None and j.top for j in jobs) else 0
    self.pending = Pending(self.slots.launch(self.model.params, self.state,
                                             list(self.model.eos_ids), values, top),
                           jobs, time.perf_counter())
    if not self.overlap or self.prefilling:
      self._drain()                    # a piece comes next: it would wait for the call anyway

  def _drain(self) -> None:
    """Hands out the tokens of the decoding call in flight, if any (before the host state
    changes: a request joins, a prompt piece goes in)."""
    last, self.pending = self.pending, None
    if last is not None:
      self._collect(last)

  def _collect(self, call: Pending) -> None:
    """Waits for `call` and hands its tokens to their requests. A slot whose request left since
    the call was dispatched (a stop string, a cancel: found after the call after it went) is
    kept up to date (its state, the prefix index: its row was written) but hands out nothing."""
    st = self.state
    busy, new, out = self.slots.collect(call.call)
    now = time.perf_counter()
    t0 = max(call.t0, self.collected)   # its time on this thread: since the call before ended
    self.collected = now
    made_any = out["tokens"] >= 0
    if self.on_call is not None:
      self.on_call("step", [int(s) for s in busy if call.jobs[s] is not None],
                   int(made_any.any(axis=0).sum()), t0, now)
    made = 0
    for i, s in enumerate(busy):
      j = call.jobs[s]
      if j is None:
        continue
      fed = int(st["token"][s])
      for k in ("token", "position", "count"):
        st[k][s] = new[k][i]
      keep = made_any[i]
      if self.prefix is not None and keep.any():   # the fed token, then all but the last made
        self.prefix.wrote(s, [fed] + out["tokens"][i, keep][:-1].tolist())
      if self.jobs[s] is not j:
        continue
      made += int(keep.sum())
      self._emit(s, j, out["tokens"][i, keep], out["logprobs"][i, keep],
                 out["top_ids"][i, keep], out["top_logprobs"][i, keep])
    if self.metrics is not None and now > t0:
      self.metrics.tokens_per_second.set(made / (now - t0))

  def _emit(self, slot: int, job: Job, ids: np.ndarray, logprobs: np.ndarray, top_ids: np.ndarray,
            top_lps: np.ndarray) -> None:
    """Hands `job` the tokens of a call; finishes it (eos, stop string, max_tokens)."""
    eos = set(self.model.eos_ids)
    ids_l = [int(t) for t in ids]
    finish = None
    cut = next((i for i, t in enumerate(ids_l) if t in eos), None)
    if cut is not None:
      ids_l, finish = ids_l[:cut], "stop"
    stream = self.streams[slot]
    text = ""
    if stream is not None:
      if stream.stop:
        text, taken = stream.push_each(ids_l)
        ids_l = ids_l[:taken]
      else:
        text = stream.push(ids_l)
      if stream.stopped:
        finish = "stop"
    n = len(ids_l)
    if finish is None and int(self.state["count"][slot]) >= job.max_tokens:
      finish = "length"
    if finish is not None and stream is not None:
      text += stream.finish()
    if self.metrics is not None:
      self.metrics.generated_tokens.inc(n + (cut is not None))
    job.sink(Delta(text=text, ids=ids_l, logprobs=[float(x) for x in logprobs[:n]],
                   top=[[(int(a), float(b)) for a, b in zip(top_ids[i], top_lps[i])]
                        for i in range(n)] if job.top else [],
                   finish_reason=finish))
    if finish is not None:
      self._release(slot)
