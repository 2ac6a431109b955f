"""Typed errors that callers of the engine, the gateway and the SDK can catch."""

from __future__ import annotations


class ServingError(Exception):
    """Base of every error this project raises on purpose."""


class InvalidRequest(ServingError, ValueError):
    """The request can never be served as given; nothing was stored or allocated."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        # The offending request field, so clients can point at it without parsing text.
        self.field = field


class DuplicateRequest(InvalidRequest):
    """A request with this id is already known to the engine."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use", field="request_id")
        self.request_id = request_id


class TierLimitExceeded(InvalidRequest):
    """The request fits the model but never its tier's share of the KV cache (the P0 reserve, the
    low-tier share): it could never finish, so it is refused up front."""

    def __init__(self, message: str, *, tier: str, limit_tokens: int) -> None:
        super().__init__(message, field="max_tokens")
        self.tier = tier
        # Largest prompt + max_tokens a request of this tier may ask for.
        self.limit_tokens = limit_tokens


class Unauthorized(ServingError):
    """Unknown or missing API key."""


class HandshakeFailed(ServingError, TimeoutError):
    """The gateway's end refused this client's connection handshake: the client's CURVE settings do not match
    the gateway's (``server_public_key`` missing, wrong, or given for a socket that is not encrypted), or the
    address is not a gateway's client port. A TimeoutError too, as before it had a name: no gateway took the
    request, and like a silent gateway it is tried again on the next one while retries last."""


class Forbidden(ServingError):
    """The tenant is not entitled to what it asked for (e.g. a higher tier)."""


class QuotaExceeded(ServingError):
    """The tenant's P0 quota is spent; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(ServingError):
    """The estimated wait exceeds the tier's queue timeout; nothing was stored."""

    def __init__(self, message: str, estimated_wait_s: float) -> None:
        super().__init__(message)
        self.estimated_wait_s = estimated_wait_s


class Unavailable(ServingError):
    """The service cannot take the request right now (its Redis is unreachable); nothing was stored.
    Retryable: the same request (same idempotency key) may be sent again (the SDK does, with backoff).
    Wire code ``unavailable``."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class IncompleteResult(ServingError):
    """A job was about to be stored as done without all of its tokens; it was not."""


class NotFound(ServingError):
    """No such job (for this tenant)."""


class JobFailed(ServingError):
    """The job ended without a result: failed on a worker, dead-lettered or cancelled."""


class JobCancelled(JobFailed):
    """The job was cancelled (by its tenant, or by the HTTP door when its client went away): a JobFailed, whose
    handlers it still reaches, told apart because nothing failed."""


class JobExpired(ServingError):
    """The job waited longer than its tier's queue timeout."""
