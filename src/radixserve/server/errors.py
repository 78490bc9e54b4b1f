"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

A request that ended as `abort` maps to the status its cause deserves: the client's own doing
is a 4xx, the server's (a failed step, a timeout, a shutdown, a dead engine) a 5xx whose
message carries the request id.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from radixserve.engine import GenerateResult
from radixserve.errors import InvalidArgumentError

_API_NAMES = {"max_new_tokens": "max_tokens"}

# cause -> (status, code)
_ABORT_STATUS = {
    "client": (499, "client_closed_request"),
    "timeout": (504, "request_timeout"),
    "shutdown": (503, "shutting_down"),
    "error": (500, "engine_error"),
    "memory": (503, "out_of_memory"),
    "too_long": (400, "context_length_exceeded"),
    "invalid": (400, "invalid_grammar"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param=None, code=None) -> dict:
    if status == 401:
        kind = "authentication_error"
    elif status >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


def check_result(result: GenerateResult) -> GenerateResult:
    """`result` itself when it finished normally; else the APIError its abort cause maps to."""
    if result.finish_reason != "abort":
        return result
    status, code = _ABORT_STATUS.get(result.abort_cause or "error", (500, "engine_error"))
    message = result.error or "the request was aborted"
    if status >= 500:
        message = f"{message} (request id {result.rid})"
    param = "max_tokens" if result.abort_cause == "too_long" else None
    raise APIError(status, message, param, code)


def invalid_argument(exc: InvalidArgumentError) -> APIError:
    """A 400 naming the request field an engine error blames, under the API's name for it."""
    field = getattr(exc, "field", None)
    return APIError(400, str(exc), _API_NAMES.get(field, field))
