"""OpenAI-shaped error responses, and the one mapping from the SDK's typed errors to HTTP.

Body: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI and vLLM return it, so
clients written for them (the official ``openai`` package raises ``AuthenticationError``,
``RateLimitError``, ... from the status) work unchanged.
"""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from common.errors import (Forbidden, InvalidRequest, JobCancelled, JobExpired, JobFailed, NotFound, Overloaded,
                           QuotaExceeded, ServingError, Unauthorized, Unavailable)


class HttpError(Exception):
    """An error answer: status, OpenAI error type, message, the offending body field, extra headers."""

    def __init__(self, status: int, type_: str, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None) -> HttpError:
    return HttpError(400, "invalid_request_error", message, param=param, code="invalid_request")


def seconds_header(s: float) -> str:
    """Whole seconds, rounded up (Retry-After takes an integer; a client must not come back too early)."""
    return str(max(0, math.ceil(s))) if math.isfinite(s) else "3600"


def from_serving_error(e: ServingError, prompt_param: str = "prompt",
                       max_tokens_param: str = "max_tokens") -> HttpError:
    """The HTTP answer for a refusal or an unsuccessful end reported by the gateway (``prompt_param``: what
    the client called the prompt: ``prompt`` or ``messages``; ``max_tokens_param``: and the limit:
    ``max_tokens`` or ``max_completion_tokens``)."""
    if isinstance(e, Unauthorized):
        return HttpError(401, "authentication_error", str(e), code="invalid_api_key")
    if isinstance(e, Forbidden):
        return HttpError(403, "permission_error", str(e), param="priority", code="tier_not_entitled")
    if isinstance(e, InvalidRequest) and e.field == "idempotency_key":  # the key names another request's job
        return HttpError(422, "invalid_request_error", str(e), code="idempotency_key_reused")
    if isinstance(e, InvalidRequest):
        param = _param(e.field)
        return invalid(str(e), {"prompt": prompt_param, "max_tokens": max_tokens_param}.get(param, param))
    if isinstance(e, QuotaExceeded):
        return HttpError(429, "rate_limit_error", str(e), code="p0_quota_exceeded",
                         headers={"Retry-After": seconds_header(e.retry_after_s)})
    if isinstance(e, Overloaded):
        wait = seconds_header(e.estimated_wait_s)
        return HttpError(503, "overloaded_error", str(e), code="overloaded",
                         headers={"Retry-After": wait, "X-Estimated-Wait-Seconds": f"{e.estimated_wait_s:.3f}"})
    if isinstance(e, Unavailable):  # the gateways' Redis is unreachable, past the SDK's own retries: nothing stored
        return HttpError(503, "overloaded_error", str(e), code="unavailable",
                         headers={"Retry-After": seconds_header(max(1.0, e.retry_after_s or 0.0))})
    if isinstance(e, JobExpired):
        return HttpError(504, "timeout_error", str(e), code="queue_timeout")
    if isinstance(e, NotFound):
        return HttpError(404, "not_found_error", str(e), code="not_found")
    if isinstance(e, JobCancelled):  # its tenant's doing, not the server's: a conflict with the job's state
        return HttpError(409, "invalid_request_error", str(e), code="job_cancelled")
    if isinstance(e, JobFailed):
        return HttpError(500, "server_error", str(e), code="job_failed")
    return HttpError(502, "server_error", str(e), code="upstream_error")


# The gateway names its own request fields; the client sent OpenAI ones.
_PARAMS = {"prompt_token_ids": "prompt", "tier": "priority"}


def _param(field: str | None) -> str | None:
    return _PARAMS.get(field, field) if field else None
