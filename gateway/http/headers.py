"""Request headers the door acts on (Authorization, X-Priority, Idempotency-Key, Content-Encoding), each read once.

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


# Content codings that compress (RFC 9110 and its registry): a body so sent is not JSON until decoded, which the
# door does not do. Others (identity, or a value no client compresses with) leave the body as it is read.
COMPRESSIONS = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd", "compress", "x-compress"})


def refuse_compressed(request: Request) -> None:
    """A 415 for a body sent compressed, before it is read: it was refused as JSON that is not valid, and its client
    looked for a mistake in JSON that had none."""
    sent = request.headers.getlist("Content-Encoding")
    if any(coding.strip().lower() in COMPRESSIONS for value in sent for coding in value.split(",")):
        raise HttpError(415, "invalid_request_error", f"Content-Encoding {', '.join(sent)!r} is not supported: send "
                        "the body uncompressed", code="unsupported_content_encoding")
