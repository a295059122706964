"""Errors as the OpenAI API answers them: `{"error": {"message", "type", "param", "code"}}` with
the HTTP status (400 bad request, 401 no or wrong key, 404 unknown model or path, 413 body too
large, 422 a field of the wrong type or range, 503 queue full, with Retry-After). pydantic's
validation errors name the field by its path (`messages.0.content`); a body that is not JSON is a
400. The message never quotes a prompt or the key."""
from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 422: "invalid_request_error", 500: "server_error",
         503: "overloaded_error"}


class ApiError(Exception):
  """A request answered with `status` and a message naming `param`."""

  def __init__(self, status: int, message: str, param: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.headers = status, message, param, headers


def body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
  return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                    "param": param, "code": status}}


def response(e: ApiError) -> JSONResponse:
  return JSONResponse(body(e.status, e.message, e.param), e.status, headers=e.headers)


def validation_response(e: RequestValidationError) -> JSONResponse:
  """422 naming the first bad field (400 for a body that is not JSON)."""
  errors = list(e.errors())
  first = errors[0] if errors else {}
  loc = [str(x) for x in first.get("loc", ()) if x != "body"]
  if first.get("type") == "json_invalid":
    return JSONResponse(body(400, f"the body is not JSON: {first.get('msg', '')}", "body"), 400)
  where = ".".join(loc) or "body"
  more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
  return JSONResponse(body(422, f"{where}: {first.get('msg', 'invalid')}{more}", where), 422)
