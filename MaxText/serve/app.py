"""The HTTP application (FastAPI): GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` as server-sent events), GET /health, GET /metrics.

A request is checked (MaxText/serve/protocol.py), turned into one `Job` per prompt and choice and
queued on the engine thread (MaxText/serve/scheduler.py); its deltas come back on this event loop.
A client that goes away cancels its jobs (a stream when its task is cancelled; a whole answer when
the connection reports the disconnect), which frees their slots. A full queue answers 503 with
Retry-After. The log gets one line per request — its id, route, token counts, status — and the
prompt and completion text only with `log_prompts`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from MaxText.data.multimodal.errors import MediaError
from MaxText.inference import InferenceError, InferenceModel
from MaxText.serve import errors
from MaxText.serve.metrics import Metrics
from MaxText.serve.protocol import ChatRequest, CompletionRequest, check_prompt
from MaxText.serve.responses import DONE, Choice, Formatter, new_id, sse, usage
from MaxText.serve.scheduler import Delta, Job, QueueFull, Scheduler

log = logging.getLogger("MaxText.serve")
DISCONNECT_POLL_S = 0.25     # how often a whole-answer request checks that its client is there
RETRY_AFTER_S = 1


@dataclass
class Served:
  """What the routes need: the model, its engine thread, its name, a slot's positions."""
  model: InferenceModel
  scheduler: Scheduler
  metrics: Metrics
  name: str
  room: int                   # positions of one slot (prompt + max_tokens)
  max_tokens_total: int       # serve_max_tokens: n x max_tokens of one request at most
  log_prompts: bool = False


class Pending:
  """The jobs of one request and their deltas, handed from the engine thread to this loop."""

  def __init__(self):
    self.loop = asyncio.get_running_loop()
    self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
    self.jobs: list[Job] = []

  def sink(self, index: int) -> Callable[[Delta], None]:
    def put(d: Delta) -> None:   # (on the engine thread)
      self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, d))
    return put


def build_app(served: Served) -> FastAPI:
  app = FastAPI(title="MaxText", docs_url=None, redoc_url=None, openapi_url=None)
  model, scheduler = served.model, served.scheduler
  tok = model.tokenizer
  fmt = Formatter(served.name, lambda t: tok.decode([t]) if tok is not None else str(t))

  @app.exception_handler(errors.ApiError)
  async def _api_error(_request, e: errors.ApiError):
    return errors.response(e)

  @app.exception_handler(RequestValidationError)
  async def _invalid(_request, e: RequestValidationError):
    return errors.validation_response(e)

  @app.exception_handler(StarletteHTTPException)
  async def _http(request: Request, e: StarletteHTTPException):
    if e.status_code == 404:
      return JSONResponse(errors.body(404, f"no route {request.url.path}", "path"), 404)
    if e.status_code == 405:
      return JSONResponse(errors.body(405, f"{request.method} is not allowed on "
                                      f"{request.url.path}", "method"), 405)
    return JSONResponse(errors.body(e.status_code, str(e.detail), "body"), e.status_code)

  @app.get("/health")
  async def health():
    if scheduler.failed:
      return JSONResponse({"status": "failed", "error": scheduler.failed}, 503)
    return {"status": "ok", "slots": served.scheduler.slots.slots,
            "slots_busy": scheduler.busy(), "queue": len(scheduler.waiting)}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(served.metrics.text(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                        "owned_by": "maxtext", "max_model_len": served.room}]}

  def check_model(name: str) -> None:
    if name != served.name:
      raise errors.ApiError(404, f"model {name!r} is not served here; GET /v1/models lists "
                            f"{served.name!r}", "model")

  def encode(prompt: str | list[int], index: int) -> list[int]:
    if isinstance(prompt, list):
      return prompt
    if tok is None:
      raise errors.ApiError(400, f"prompt {index} is text but the model has no tokenizer "
                            f"({model.tokenizer_source}); send token ids", "prompt")
    return model.encode(prompt, chat=False)

  def budget(n: int, prompts: int, max_tokens: int) -> None:
    total = n * prompts * max_tokens
    if total > served.max_tokens_total:
      raise errors.ApiError(400, f"n={n} x {prompts} prompt(s) x max_tokens={max_tokens} = "
                            f"{total} tokens; at most {served.max_tokens_total} "
                            f"(serve_max_tokens)", "max_tokens")

  def jobs_for(pending: Pending, prompts: list[list[int]], req, max_tokens: int, top: int,
               logprobs: bool, echo_logprobs: bool, media: Any = None) -> list[Job]:
    seed = req.seed if req.seed is not None else secrets.randbits(32)
    top_k = max(req.top_k, 0)
    jobs = []
    for p, ids in enumerate(prompts):
      for j in range(req.n):
        i = p * req.n + j
        jobs.append(Job(ids, max_tokens, pending.sink(i), temperature=req.temperature,
                        top_k=top_k, top_p=req.top_p, min_p=req.min_p, seed=seed, row=i,
                        stop=req.stops(), top=top, logprobs=logprobs,
                        echo_logprobs=echo_logprobs, media=media))
    pending.jobs = jobs
    return jobs

  def submit(jobs: list[Job]) -> None:
    if len(jobs) > scheduler.queue_size:
      raise errors.ApiError(400, f"{len(jobs)} completions (n x prompts) never fit the queue of "
                            f"{scheduler.queue_size} (serve_queue)", "n")
    try:
      scheduler.submit(jobs)
    except QueueFull as e:
      raise errors.ApiError(503, f"busy: {e}; retry later", None,
                            {"Retry-After": str(RETRY_AFTER_S)}) from None

  async def gather(request: Request, pending: Pending) -> list[Choice]:
    """Every choice, whole; the jobs cancelled if the client goes away."""
    choices = [Choice(i) for i in range(len(pending.jobs))]
    left = len(choices)
    try:
      while left:
        try:
          i, d = await asyncio.wait_for(pending.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            scheduler.cancel(pending.jobs)
            raise errors.ApiError(499, "the client went away") from None
          continue
        choices[i].add(d)
        left -= d.finish_reason is not None
    except asyncio.CancelledError:
      scheduler.cancel(pending.jobs)
      raise
    failed = next((c.error for c in choices if c.finish_reason == "error"), None)
    if failed:
      raise errors.ApiError(500, failed)
    return choices

  async def deltas(pending: Pending) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas as they come; the unfinished jobs cancelled when the stream is dropped."""
    left = len(pending.jobs)
    try:
      while left:
        i, d = await pending.queue.get()
        left -= d.finish_reason is not None
        yield i, d
    finally:
      if left:
        scheduler.cancel(pending.jobs)

  def logged(rid: str, route: str, prompt_tokens: int, choices: list[Choice] | None,
             t0: float, texts: Any = None) -> None:
    completion = sum(len(c.ids) for c in choices) if choices is not None else -1
    served.metrics.latency.labels(route).observe(time.perf_counter() - t0)
    log.info("%s %s prompt_tokens=%d completion_tokens=%s %.3fs", rid, route, prompt_tokens,
             completion if completion >= 0 else "streamed", time.perf_counter() - t0)
    if served.log_prompts and texts is not None:
      log.info("%s prompt=%r completions=%r", rid, texts,
               [c.text for c in choices] if choices is not None else None)

  @app.post("/v1/completions")
  async def completions(req: CompletionRequest, request: Request) -> Response:
    t0 = time.perf_counter()
    check_model(req.model)
    req.check_penalties()
    raw = req.prompts()
    prompts = [encode(p, i) for i, p in enumerate(raw)]
    max_tokens = req.max_tokens if req.max_tokens is not None else \
        served.room - max(map(len, prompts))
    if max_tokens == 0 and not req.echo:
      raise errors.ApiError(400, "max_tokens=0 generates nothing; it needs echo=true (scoring "
                            "the prompt)", "max_tokens")
    for i, ids in enumerate(prompts):
      check_prompt(ids, i, model.engine.mcfg.vocab_size, served.room, max(max_tokens, 1),
                   "prompt")
    budget(req.n, len(prompts), max_tokens)
    k = req.logprobs
    pending = Pending()
    jobs = jobs_for(pending, prompts, req, max_tokens, top=k or 0, logprobs=k is not None,
                    echo_logprobs=req.echo and k is not None)
    texts = [p if isinstance(p, str) else (model.text(p) or "") for p in raw]
    rid = new_id("cmpl")
    submit(jobs)
    n_prompt = sum(map(len, prompts))
    owner = lambda i: i // req.n
    if not req.stream:
      choices = await gather(request, pending)
      logged(rid, "/v1/completions", n_prompt, choices, t0, texts)
      return JSONResponse(fmt.completion(
          rid, [fmt.completion_choice(c, prompts[owner(c.index)], texts[owner(c.index)], req.echo,
                                      k) for c in choices],
          usage(n_prompt, sum(len(c.ids) for c in choices))))

    async def stream() -> AsyncIterator[str]:
      made = 0
      echoed: set[int] = set()
      async for i, d in deltas(pending):
        made += len(d.ids)
        lp = None
        text = d.text
        if req.echo and i not in echoed and (d.prompt_logprobs is not None or k is None):
          echoed.add(i)
          text = texts[owner(i)] + text
          if k is not None:
            c = Choice(i, prompt_logprobs=d.prompt_logprobs)
            lp = fmt.completion_logprobs(*fmt.echo_part(c, prompts[owner(i)], k), k)
            if not d.ids and d.finish_reason is None:
              yield sse(fmt.completion_chunk(rid, i, text, None, lp))
              continue
        if k is not None and d.ids:
          part = fmt.completion_logprobs(d.ids, list(d.logprobs), list(d.top or [[]] * len(d.ids)),
                                         k)
          lp = part if lp is None else {key: lp[key] + part[key] for key in lp}
        if text or d.ids or d.finish_reason is not None:
          if d.finish_reason == "error":
            yield sse(errors.body(500, d.error))
            return
          yield sse(fmt.completion_chunk(rid, i, text, d.finish_reason, lp))
      if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({**fmt.completion(rid, [], usage(n_prompt, made))})
      logged(rid, "/v1/completions", n_prompt, None, t0)
      yield DONE
    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

  @app.post("/v1/chat/completions")
  async def chat(req: ChatRequest, request: Request) -> Response:
    t0 = time.perf_counter()
    check_model(req.model)
    req.check_penalties()
    variables = req.template_variables()
    tools = variables.pop("tools", None)
    found = None
    if req.has_media():     # decoded from their data URLs, then the model's processor
      processor = model.processor
      audio = processor.audio if processor is not None else None
      messages = req.template_messages(audio.sampling_rate if audio is not None else None)
      try:
        prepared = model.prepare([{"messages": messages, "tools": tools,
                                   "chat_template_kwargs": variables}])
        model.check_room(prepared, req.new_tokens() or 1, served.room, "max_cache_length")
      except (InferenceError, MediaError) as e:
        raise errors.ApiError(400, f"messages: {e}", "messages") from None
      ids, found = prepared.ids[0], (prepared.media or [None])[0]
    else:
      messages = req.template_messages()
      try:
        ids = model.render_chat(messages, tools, variables)
      except InferenceError as e:
        raise errors.ApiError(400, f"messages: {e}", "messages") from None
    max_tokens = req.new_tokens() or served.room - len(ids)
    check_prompt(ids, 0, model.engine.mcfg.vocab_size, served.room, max(max_tokens, 1),
                 "messages")
    budget(req.n, 1, max_tokens)
    k = req.top_logprobs or 0
    pending = Pending()
    jobs = jobs_for(pending, [ids], req, max_tokens, top=k, logprobs=req.logprobs,
                    echo_logprobs=False, media=found)
    rid = new_id("chatcmpl")
    submit(jobs)
    if not req.stream:
      choices = await gather(request, pending)
      logged(rid, "/v1/chat/completions", len(ids), choices, t0, messages)
      return JSONResponse(fmt.chat(rid, [fmt.chat_choice(c, req.logprobs, k) for c in choices],
                                   usage(len(ids), sum(len(c.ids) for c in choices))))

    async def stream() -> AsyncIterator[str]:
      made = 0
      for i in range(req.n):
        yield sse(fmt.chat_chunk(rid, i, {"role": "assistant", "content": ""}))
      async for i, d in deltas(pending):
        made += len(d.ids)
        if d.finish_reason == "error":
          yield sse(errors.body(500, d.error))
          return
        lp = fmt.chat_logprobs(d.ids, d.logprobs, d.top, k) if req.logprobs and d.ids else None
        if d.text or lp is not None:
          yield sse(fmt.chat_chunk(rid, i, {"content": d.text}, None, lp))
        if d.finish_reason is not None:
          yield sse(fmt.chat_chunk(rid, i, {}, d.finish_reason))
      if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({**fmt.chat(rid, [], usage(len(ids), made)),
                   "object": "chat.completion.chunk"})
      logged(rid, "/v1/chat/completions", len(ids), None, t0)
      yield DONE
    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

  return app


@contextlib.contextmanager
def running(scheduler: Scheduler):
  """The engine thread for the application's lifetime (stopped after the in-flight requests)."""
  scheduler.start()
  try:
    yield
  finally:
    scheduler.stop()
