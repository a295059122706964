"""An OpenAI-compatible HTTP server for a trained model, with continuous batching.

  python -m MaxText.serve configs/base.yml load_parameters_path=CKPT port=8000
  python -m MaxText.serve configs/base.yml hf_path=HF_DIR serve_slots=16 max_cache_length=2048

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream: true`: server-
sent events), GET /health, GET /metrics (Prometheus). The model loads as for `MaxText.decode`
(load_parameters_path or hf_path, the mesh and tokenizer keys); the server's keys are in
configs/base.yml, section "serving", and its own arguments below: it binds 127.0.0.1 unless
`host=` says otherwise; with `api_key=` (or the variable `api_key_env` names, MAXTEXT_API_KEY)
every request needs `Authorization: Bearer <key>`; `serve_slots` requests decode together, each
slot holding `max_cache_length` positions (0: the model's max_position_embeddings, at most 2048). Prints one
line when it listens: "serving MODEL on http://HOST:PORT", after the start-up line (where the
seconds to listening went), and one when the first request is answered (its seconds and the
programs compiled for it: the server compiles at its first requests). SIGTERM / Ctrl-C: no new connections,
the requests in flight finish, then exit 0. Exit 2 on a bad config, 4 on a damaged checkpoint.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from typing import Sequence

from MaxText.config import cli
from MaxText.config.cli import Arg
from MaxText.config.load import ConfigError
from MaxText.data.errors import DataError
from MaxText.runtime.exit_codes import EXIT_OK, reported

GIL_SWITCH_S = 0.0005     # the process's GIL switch interval while serving (see main)
# A slot's positions when max_cache_length is 0: the model's limit, at most this (a model's limit,
# e.g. Qwen3's 40,960, times serve_slots would reserve a cache few requests need)
DEFAULT_ROOM = 2048

ARGS = {
    "host": Arg(str, "127.0.0.1",
                "the address to bind (0.0.0.0: every interface; then set a key)"),
    "port": Arg(int, 8000, "the TCP port (0: a free one, printed when the server listens)"),
    "api_key": Arg(str, "", "every request needs Authorization: Bearer <this> (401 otherwise); "
                   "\"\": the api_key_env variable's value, if set"),
    "api_key_env": Arg(str, "MAXTEXT_API_KEY", "the environment variable holding the key when "
                       "api_key is \"\" (keeps it off the command line)"),
}


def server_class():
  """uvicorn's Server, but a SIGTERM / SIGINT that stopped it cleanly is not raised again on the
  way out (uvicorn re-raises it, so the process would die of the signal): exit 0."""
  import uvicorn  # pylint: disable=import-outside-toplevel

  class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
      previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
      try:
        yield
      finally:
        for s, handler in previous.items():
          signal.signal(s, handler)
  return Server


def model_name(cfg) -> str:
  """serve_model_name, else hf_path's folder name, else the run's name for a run's checkpoints
  (`runs/NAME/checkpoints` or a step of it: NAME), else the checkpoint folder's name."""
  if cfg.serve_model_name:
    return cfg.serve_model_name
  path = cfg.hf_path or cfg.load_parameters_path
  if not path:
    return "maxtext"
  parts = os.path.normpath(os.path.expanduser(path)).split(os.sep)
  if not cfg.hf_path:
    if len(parts) >= 3 and parts[-2] == "checkpoints" and parts[-1].isdigit():
      parts = parts[:-1]
    if len(parts) >= 2 and parts[-1] == "checkpoints" and parts[-2]:
      parts = parts[:-1]
  return parts[-1] or "maxtext"


def main(argv: Sequence[str]) -> int:
  if cli.wants_help(argv):
    cli.print_help(cli.usage(__doc__, ARGS, "serve"))
    return EXIT_OK
  from MaxText.inference import InferenceError   # pylint: disable=import-outside-toplevel
  return reported(lambda: run(argv), (ConfigError, DataError, InferenceError))


def run(argv: Sequence[str]) -> int:
  # pylint: disable=import-outside-toplevel  (--help and a bad key answer before jax loads)
  from MaxText.runtime.startup import StartupClock
  clock = StartupClock()
  parsed = cli.parse(argv, ARGS, __doc__ or "", tool="serve", config_file=True)
  assert parsed is not None     # --help answered in main
  args, first, config_argv = parsed
  host, port = args["host"], args["port"]
  if not 0 <= port <= 65535:
    raise ConfigError(f"port={port}: a TCP port is 0..65535")
  api_key = args["api_key"] or (os.environ.get(args["api_key_env"], "")
                                if args["api_key_env"] else "")
  import uvicorn

  Server = server_class()
  from MaxText.decoding.slots import Slots
  from MaxText.inference import load
  from MaxText.serve.app import Served, build_app, running
  from MaxText.serve.guard import Guard
  from MaxText.serve.metrics import Metrics
  from MaxText.serve.scheduler import Scheduler
  from MaxText.serve.text import TextStream

  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
  served_log = logging.getLogger("MaxText.serve")
  served_log.addHandler(handler)
  served_log.setLevel(logging.INFO)
  served_log.propagate = False
  from MaxText.runtime import compile_cache
  print(compile_cache.use(first.jax_cache_dir), file=sys.stderr)  # a restart finds its programs
  clock.mark("config")
  model = load(config_argv)
  clock.mark("model")
  import jax
  if jax.process_count() > 1:
    raise ConfigError(f"the server runs in one process ({jax.process_count()} here): its engine "
                      f"thread would step alone; serve from one host (its devices: any mesh)")
  cfg = model.cfg
  room = cfg.max_cache_length or min(model.engine.mcfg.max_position_embeddings, DEFAULT_ROOM)
  metrics = Metrics()
  metrics.slots.set(cfg.serve_slots)
  slots = Slots(model.engine, cfg.serve_slots, room, chunk=cfg.serve_chunk,
                min_rows=cfg.serve_min_rows)
  decode = model.decoder()
  compiling = compile_cache.CompileMeter()

  def first_answer(job) -> None:
    compiling.__exit__(None, None, None)
    print(f"first answer {time.perf_counter() - job.submitted:.1f} s after its request arrived "
          f"({compiling.text()})", file=sys.stderr, flush=True)

  # the engine thread takes the GIL for a host callback between two decoding steps and for each
  # call's deltas; while the HTTP event loop holds it, it waits up to the switch interval (5 ms
  # by default: a step's length on a small model), a wait that grows with the clients streaming
  sys.setswitchinterval(GIL_SWITCH_S)
  scheduler = Scheduler(model, slots, cfg.serve_queue, metrics,
                        (lambda stop: TextStream(decode, stop)) if decode else None,
                        prefill_chunk=cfg.serve_prefill_chunk,
                        prefix_min=cfg.serve_prefix_cache, on_first_answer=first_answer,
                        interrupt=cfg.serve_interrupt)
  if cfg.serve_warmup:
    t0 = time.perf_counter()
    n = slots.warm(model.params)
    print(f"serve_warmup: {n} decoding programs compiled in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
  name = model_name(cfg)
  served = Served(model, scheduler, metrics, name, room, cfg.serve_max_tokens, cfg.log_prompts)
  app = build_app(served)

  @asynccontextmanager
  async def lifespan(_app):
    with running(scheduler):
      yield
  app.router.lifespan_context = lifespan
  guarded = Guard(app, api_key, cfg.serve_max_body_bytes, metrics)
  config = uvicorn.Config(guarded, host=host, port=port, log_level="info",
                          access_log=False, lifespan="on")
  server = Server(config)
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    raise ConfigError(f"host={host} port={port}: cannot listen there: {e}") from None
  sock.listen(128)
  clock.mark("app")
  print(clock.line("listening"), file=sys.stderr)
  compiling.__enter__()
  print(f"serving {name} on http://{host}:{sock.getsockname()[1]} ({cfg.serve_slots} slots of "
        f"{room} positions{'; API key required' if api_key else ''})", file=sys.stderr, flush=True)
  server.run(sockets=[sock])   # SIGTERM / SIGINT: stops taking connections, drains, returns
  return EXIT_OK


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
