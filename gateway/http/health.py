"""GET /health: 200 when a gateway answers, a worker is registered and the cluster's tokenizer is the door's, else
503 saying why.

It asks with the door's health_api_key, else with the caller's bearer token (an info call needs a tenant's key).
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common.errors import ServingError, Unauthorized
from gateway.http.errors import HttpError
from gateway.http.headers import bearer
from gateway.sdk import GatewayClient

HEALTH_TIMEOUT_S = 2.0


async def answer(request: Request, health_api_key: str, endpoints: list[str], prompts) -> Response:
    """``prompts``: the door's (gateway/http/prompts.Prompts), whose tokenizer must be the cluster's."""
    try:
        key = health_api_key or bearer(request)
    except HttpError as e:
        return e.response()
    if not key:
        return JSONResponse({"status": "unknown", "reason": "no health_api_key configured and no bearer token"},
                            status_code=503)
    info, errors_seen, refused = None, [], []
    # Healthy when any gateway answers. All are asked at once: one at a time, each gateway down added its
    # timeout before the next was asked.
    asks = {asyncio.ensure_future(asyncio.to_thread(_info, e, key)): e for e in endpoints}
    pending = set(asks)
    while pending and info is None:
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for ask in finished:
            try:
                info = info or ask.result()
            except Unauthorized:  # the gateway is up; it does not know the key asked with
                refused.append(asks[ask])
            except (TimeoutError, ServingError) as e:
                errors_seen.append(f"{asks[ask]}: {type(e).__name__}: {e}")
    for ask in pending:  # still asking a gateway down; its thread ends within its timeout, unread
        ask.add_done_callback(lambda f: f.cancelled() or f.exception())
    if info is None and refused:
        # Not "unavailable": a gateway answered. What is unknown is its workers, for want of a key it knows.
        whose = ("the configured health_api_key" if health_api_key else
                 "the bearer token (no health_api_key is configured, so /health asks with the caller's key)")
        reason = f"the gateway ({', '.join(refused)}) does not know {whose}"
        return JSONResponse({"status": "unknown", "reason": "; ".join([reason, *errors_seen])}, status_code=503)
    if info is None:
        return JSONResponse({"status": "unavailable", "reason": "; ".join(errors_seen)}, status_code=503)
    if (wrong := prompts.mismatch(info.tokenizer_digest)) is not None:
        return JSONResponse({"status": "tokenizer_mismatch", "reason": wrong.message}, status_code=503)
    body = {"status": "ok" if info.workers else "no_workers", "gateway": info.gateway_id,
            "workers": len(info.workers), "queue_depths": info.queue_depths}
    return JSONResponse(body, status_code=200 if info.workers else 503)


def _info(endpoint: str, key: str):
    # A short-lived client of one gateway (the door's own fail over between them): is this one up? Asked once:
    # the SDK's retries of a silent gateway made a gateway down cost /health three timeouts.
    with GatewayClient(endpoint, key, timeout_s=HEALTH_TIMEOUT_S, retries=0) as client:
        return client.info(tokenizer=True)
