"""Who gets in, and how much they may send: an ASGI middleware in front of every route.

With a key, every request needs `Authorization: Bearer <key>` (401 otherwise; compared with
`hmac.compare_digest`, in constant time); a body larger than `max_body_bytes` is refused (413)
before the application reads it (its Content-Length, or the bytes as they arrive). Each answer is
counted in the metrics by route and status. Nothing here logs a header or a body.
"""
from __future__ import annotations

import hmac
import json
from typing import Any

from MaxText.serve.errors import body

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Guard:
  def __init__(self, app, api_key: str, max_body_bytes: int, metrics=None):
    self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
    self.expected = f"Bearer {api_key}".encode() if api_key else None

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    route = scope["path"] if scope["path"] in ROUTES else "other"
    status: dict[str, Any] = {}

    async def counted_send(message):
      if message["type"] == "http.response.start":
        status["code"] = message["status"]
        if self.metrics is not None:
          self.metrics.requests.labels(route, str(message["status"])).inc()
      await send(message)

    headers = dict(scope.get("headers") or [])
    if self.expected is not None:
      given = headers.get(b"authorization", b"")
      if not hmac.compare_digest(given, self.expected):
        return await self._refuse(counted_send, 401, "a valid API key is needed: Authorization: "
                                  "Bearer <key>", {"www-authenticate": "Bearer"})
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
      return await self._refuse(counted_send, 413, f"the body has {int(length)} bytes; at most "
                                f"{self.max_body_bytes} (serve_max_body_bytes)")
    chunks, size = [], 0
    more = scope["method"] in ("POST", "PUT", "PATCH")
    while more:
      message = await receive()
      if message["type"] == "http.disconnect":
        return None
      chunk = message.get("body", b"")
      size += len(chunk)
      if size > self.max_body_bytes:
        return await self._refuse(counted_send, 413, f"the body has more than "
                                  f"{self.max_body_bytes} bytes (serve_max_body_bytes)")
      chunks.append(chunk)
      more = message.get("more_body", False)
    replayed = {"sent": False}

    async def replay():
      if not replayed["sent"]:
        replayed["sent"] = True
        return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
      return await receive()
    return await self.app(scope, replay, counted_send)

  @staticmethod
  async def _refuse(send, status: int, message: str, extra: dict[str, str] | None = None):
    payload = json.dumps(body(status, message)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
