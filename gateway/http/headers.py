"""Request headers the door acts on (Authorization, X-Priority, Idempotency-Key), each read once.

A header sent twice with different values is refused, 400, before anything is submitted: reading either one
(Starlette's ``get`` takes the first) served a request that half its headers did not ask for, e.g. another
tenant's key, tier or job. The same value repeated is one value, as a proxy that copies a header sends it.
"""

from __future__ import annotations

from starlette.requests import Request

from gateway.http.errors import HttpError


def one_header(request: Request, name: str, param: str | None = None) -> str | None:
    """The header's value (None: not sent); a 400 naming it when it came more than once with different values."""
    values = request.headers.getlist(name)
    if len(set(values)) > 1:
        raise HttpError(400, "invalid_request_error", f"the {name} header was sent {len(values)} times with "
                        "different values; send it once", param=param, code="conflicting_headers")
    return values[0] if values else None


def bearer(request: Request) -> str | None:
    scheme, _, token = (one_header(request, "Authorization") or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
