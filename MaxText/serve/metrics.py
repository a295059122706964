"""The server's Prometheus metrics (GET /metrics, text format), in a registry of its own: requests
by endpoint and status, requests waiting, slots busy, prompt and generated tokens, prefix-cache
hits and the prompt tokens they saved, the last decoding call's tokens per second, time to first
token and request latency."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
  def __init__(self):
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("maxtext_requests", "HTTP requests answered", ["endpoint", "status"],
                            registry=r)
    self.queue = Gauge("maxtext_queue_requests", "completions waiting for a slot", registry=r)
    self.slots_busy = Gauge("maxtext_slots_busy", "decode slots holding a request", registry=r)
    self.slots = Gauge("maxtext_slots", "decode slots", registry=r)
    self.prompt_tokens = Counter("maxtext_prompt_tokens", "prompt tokens prefilled", registry=r)
    self.prefix_hits = Counter("maxtext_prefix_hits", "completions that reused a cached prompt "
                               "prefix (serve_prefix_cache)", registry=r)
    self.prefix_tokens = Counter("maxtext_prefix_tokens", "prompt tokens not prefilled: reused "
                                 "from a cached prefix", registry=r)
    self.generated_tokens = Counter("maxtext_generated_tokens", "tokens generated", registry=r)
    self.tokens_per_second = Gauge("maxtext_decode_tokens_per_second",
                                   "tokens per second of the last decoding call", registry=r)
    self.ttft = Histogram("maxtext_time_to_first_token_seconds",
                          "from a completion's arrival to its first token", registry=r,
                          buckets=LATENCY_BUCKETS)
    self.latency = Histogram("maxtext_request_seconds", "from a request's arrival to its answer",
                             ["endpoint"], registry=r, buckets=LATENCY_BUCKETS)

  def text(self) -> bytes:
    return generate_latest(self.registry)
