"""The `Idempotency-Key` request header: a client that retries a request (its connection dropped, its answer
lost) names the job it started rather than starting another. The key is the SDK's ``idempotency_key``, scoped
to the tenant, kept ``idempotency_ttl_s`` (24 h); a retry may be streamed where the first was whole, or the
other way round (the job is the same, only its delivery differs). Reused for another request (another prompt,
tier, max_tokens or sampling) it is refused, 422, as the IETF draft on this header says, and nothing changes
(gateway/http/errors.from_serving_error).

A request with a key is one its client means to come back for: the door does not cancel its job when the
client goes away (without a key it does, which frees the worker's KV blocks at once).
"""

from __future__ import annotations

from starlette.requests import Request

from common.client_messages import MAX_IDEMPOTENCY_KEY_LEN
from gateway.http.errors import HttpError
from gateway.http.headers import one_header

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"  # response header: "true" where the key named a job an earlier request started


def key_of(request: Request) -> str | None:
    """The request's key (None: it has none); a 400 for one the gateway could not store or a client meant
    otherwise (empty, too long, surrounding spaces, control characters)."""
    value = one_header(request, HEADER)
    if value is None:
        return None
    if not 0 < len(value) <= MAX_IDEMPOTENCY_KEY_LEN or value.strip() != value or not value.isprintable():
        raise HttpError(400, "invalid_request_error", f"{HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} printable "
                        f"characters without surrounding spaces", code="invalid_idempotency_key")
    return value

