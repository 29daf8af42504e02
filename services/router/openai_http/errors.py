"""Errors in OpenAI's JSON shape, with the HTTP status of the gRPC status they stand for.

`{"error": {"message", "type", "param", "code"}}`; the status follows the router's gRPC table
(INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, ALREADY_EXISTS 409,
RESOURCE_EXHAUSTED 429 with `Retry-After`, UNAVAILABLE 503, DEADLINE_EXCEEDED 504), so a client
sees the same refusal whichever protocol it speaks. A bug is 500 with a generic message.
"""

from __future__ import annotations

import json
import math

from aiohttp import web

from services.common.errors import InvalidArgumentError, SluiceError

# gRPC status name -> (HTTP status, OpenAI error type)
STATUS_TABLE: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled_error"),
    "UNIMPLEMENTED": (501, "not_implemented_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
INTERNAL = (500, "internal_error")


class RequestError(InvalidArgumentError):
    """A bad request body: 400 (or `http_status`), naming the offending field in `param`."""

    def __init__(self, message: str, *, param: str | None = None, http_status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.http_status = http_status


class ModelNotFoundError(SluiceError):
    """The body names a model that is neither the served model nor a known adapter."""

    code = "NOT_FOUND"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model[:256]}' does not exist")


def error_body(error: SluiceError) -> dict:
    """The OpenAI error object for `error` (also sent as an SSE event mid-stream)."""
    status, kind = STATUS_TABLE.get(error.code, INTERNAL)
    code: str | None = error.code.lower()
    if isinstance(error, ModelNotFoundError):
        code = "model_not_found"
    return {
        "error": {
            "message": error.message if status != 500 else "internal error",
            "type": kind,
            "param": getattr(error, "param", None)
            or ("model" if code == "model_not_found" else None),
            "code": code,
        }
    }


def http_status(error: SluiceError) -> int:
    if isinstance(error, RequestError):
        return error.http_status
    return STATUS_TABLE.get(error.code, INTERNAL)[0]


def error_response(error: SluiceError) -> web.Response:
    """The HTTP response for `error`; 429 and 503 carry `Retry-After` (whole seconds, >= 1)."""
    headers = {}
    status = http_status(error)
    if error.retry_after_s is not None or status == 429:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s or 1.0)))
    return web.Response(
        status=status,
        text=json.dumps(error_body(error)),
        content_type="application/json",
        headers=headers,
    )
