"""The front door's Prometheus metrics, served on its own port at /metrics (as vLLM does): requests by
route and status, and their duration to the last byte (a stream's whole life)."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from common.metrics import LATENCY_BUCKETS

REQUESTS = Counter("ts_http_requests_total", "HTTP requests answered, by route and status", ["route", "status"])
DURATION = Histogram("ts_http_request_duration_seconds", "From the request to its last response byte, by route",
                     ["route"], buckets=LATENCY_BUCKETS)
DISCONNECTS = Counter("ts_http_client_disconnects_total", "Requests whose client went away before the end "
                      "(their jobs were cancelled, except those of requests with an Idempotency-Key: their clients "
                      "come back for them)")
# A stream's status line (200) is sent with its first token: an error after it reaches the client as an event, and
# ts_http_requests_total counts the request as the 200 it began as. Counted here too, so the failures show.
STREAM_ERRORS = Counter("ts_http_stream_errors_total", "Streamed requests that ended in an error event after their "
                        "200 status line, by route and error code", ["route", "code"])


class MetricsMiddleware:
    """Pure ASGI, so it sees a streamed response's end, not only its first byte."""

    def __init__(self, app, routes: set[str]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        start = time.perf_counter()
        status = {"code": 500}

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            REQUESTS.labels(route, str(status["code"])).inc()
            DURATION.labels(route).observe(time.perf_counter() - start)


async def metrics_endpoint(request: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
