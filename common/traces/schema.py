"""The span schema explain reads: span names and attribute names, and typed readers of attribute values."""

from __future__ import annotations

import math
from typing import Any

from common.traces.spans import Span

REQUEST_ID = "request.id"
REQUEST_TIER = "request.tier"
TENANT_ID = "tenant.id"
TIERS = ("P0", "P1", "P2", "P3")

SDK_SUBMIT = "sdk.submit"
GATEWAY_ADMIT = "gateway.admit"
GATEWAY_QUEUE = "gateway.queue"
GATEWAY_DISPATCH = "gateway.dispatch"
GATEWAY_DEAD_LETTER = "gateway.dead_letter"  # instant: its last allowed attempt lost its lease (gateway/spans.py)
WORKER_REQUEST = "worker.request"
WORKER_QUEUE = "worker.queue"
WORKER_PREFILL = "worker.prefill"
WORKER_DECODE = "worker.decode"
WORKER_SUSPENDED = "worker.suspended"
PREEMPTION = "scheduler.preemption"
PREEMPTION_DECLINED = "scheduler.preemption_declined"

# On worker.request: the engine step that ran last before the job was read (the worker reads new jobs between
# steps, so a job that arrived during that step waited for it).
STEP_BEFORE_START = "worker.step_before.start_unix_ns"
STEP_BEFORE_END = "worker.step_before.end_unix_ns"
STEP_BEFORE_REQUESTS = "worker.step_before.requests"
STEP_BEFORE_TOKENS = "worker.step_before.tokens"

DECISION_SPANS = frozenset({PREEMPTION, PREEMPTION_DECLINED})
# Spans that say something about scheduling; a trace with none of them cannot be explained.
SCHEDULING_SPANS = frozenset({GATEWAY_ADMIT, GATEWAY_QUEUE, GATEWAY_DISPATCH, GATEWAY_DEAD_LETTER, WORKER_REQUEST,
                              WORKER_QUEUE, WORKER_PREFILL, WORKER_DECODE, WORKER_SUSPENDED}) | DECISION_SPANS
# Gantt rows, top to bottom (suspended periods are drawn over them, hatched).
PHASES = {GATEWAY_QUEUE: "queue", GATEWAY_DISPATCH: "dispatch", WORKER_QUEUE: "worker_queue",
          WORKER_PREFILL: "prefill", WORKER_DECODE: "decode", WORKER_SUSPENDED: "suspended"}


def attr_str(v: Any) -> str | None:
    return None if v is None or v == "" else str(v)


def attr_int(v: Any) -> int | None:
    try:
        return None if v is None or v == "" else int(v)
    except OverflowError:  # a double of +-inf (any producer may write one): no integer
        return None
    except (TypeError, ValueError):
        try:
            return int(float(v))
        except (TypeError, ValueError, OverflowError):
            return None


def attr_float(v: Any) -> float | None:
    """None also for NaN and +-inf (any producer may write them): no cost, wait or share, and --json must stay JSON
    (json.dumps writes them as NaN and Infinity, which strict readers refuse)."""
    try:
        f = None if v is None or v == "" else float(v)
    except (TypeError, ValueError):
        return None
    return f if f is None or math.isfinite(f) else None


def per_tier(span: Span, prefix: str) -> dict[str, int]:
    out = {}
    for t in TIERS:
        n = attr_int(span.get(f"{prefix}.{t}"))
        if n is not None:
            out[t] = n
    return out
