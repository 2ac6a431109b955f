"""What every process's Prometheus endpoint shares: the HTTP server, latency buckets, the tier labels.

Each process serves ``/metrics`` (prometheus_client's own server, in a daemon thread) on the
``metrics_bind`` of its configuration, ``host:port``; an empty value serves nothing. Metric
objects live at module level in gateway/metrics.py and worker/metrics.py, as prometheus_client
intends: one registry per process, and the standard process_* and python_* metrics come free.
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.registry import Collector

from common.tiers import ALL_TIERS

TIER_VALUES = tuple(t.value for t in ALL_TIERS)

# From 5 ms to 10 minutes: a P0 first token is tens of milliseconds, a P3 job may queue for minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class MetricsBindError(RuntimeError):
    """/metrics cannot be served on the ``metrics_bind`` asked for (its port taken, or not this host's
    address): a start-up error a process reports in one line, naming the address."""


def parse_bind(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics_bind must be host:port, not {bind!r}")
    return host or "0.0.0.0", int(port)


def serve(bind: str, state: Collector | None = None) -> None:
    """Serve /metrics on ``bind`` (``host:port``; empty: nothing), with ``state`` read at each scrape."""
    if not bind:
        return
    host, port = parse_bind(bind)
    if state is not None:
        REGISTRY.register(state)
    try:
        start_http_server(port, addr=host)
    except OSError as e:
        raise MetricsBindError(f"cannot serve metrics on {bind}: {e.strerror or e} (metrics_bind)") from None
    logging.getLogger("metrics").info("metrics on http://%s:%d/metrics", host, port)
