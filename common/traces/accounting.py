"""Where a request's time went between its scheduling spans: so that explain leaves no interval unnamed.

Queued, running and suspended time come from spans (``gateway.queue``; ``worker.request`` with its
queue, prefill, decode and suspended children). Every instant of the request's life outside them is
named here by the spans on either side of it:

- ``to_gateway``: before the gateway's first span (the client's submit in flight);
- ``admission``: inside ``gateway.admit``, or between it and the queue (the job being stored);
- ``dispatch``: inside ``gateway.dispatch``;
- ``to_worker``: from a dispatch to the worker's ``worker.request`` (the frame in flight, and the
  step the worker was running when it arrived: the worker reads new jobs between steps);
- ``lost``: from a dispatch (or the last span its worker sent) to a re-queue of the same job, or to its
  dead-lettering (the worker died or its lease expired);
- ``kept``: the part of such a lost attempt before its last token the next attempt resumed with was written (the
  re-dispatch's ``dispatch.last_kept_token_ms``): work its worker did and the job kept. Not time in transit: the
  worker ran (explain counts it as running), though its killed worker exported no span of it;
- ``hand_back``: from the last span of a worker that handed the job back (it was shutting down:
  worker/drain.py) to its re-queue (the hand-back in flight);
- ``delivery``: after the worker's last span (the result on its way back to the client);
- ``other``: anything else (it should be nothing).
"""

from __future__ import annotations

from common.traces.schema import (GATEWAY_ADMIT, GATEWAY_DEAD_LETTER, GATEWAY_DISPATCH, GATEWAY_QUEUE, SDK_SUBMIT,
                                  WORKER_DECODE, WORKER_PREFILL, WORKER_QUEUE, WORKER_REQUEST,
                                  WORKER_SUSPENDED, attr_int, attr_str)
from common.traces.spans import Span

TRANSIT_KINDS = ("to_gateway", "admission", "dispatch", "to_worker", "lost", "hand_back", "delivery", "other")
# Spans whose time is already counted as queued, running or suspended (a worker's queue wait and suspended periods
# also when their worker.request is missing: a worker killed -9 exports its ended spans, never its open request).
_ACCOUNTED = (GATEWAY_QUEUE, WORKER_REQUEST, WORKER_QUEUE, WORKER_SUSPENDED)


def transit(own: list[Span], t0: int, t_end: int) -> dict[str, float]:
    """Seconds per kind above, for the time in [t0, t_end] that no queue or worker span covers (``kept`` too, which
    is not in TRANSIT_KINDS: the caller counts it as running)."""
    out = {k: 0.0 for k in (*TRANSIT_KINDS, "kept")}
    timed = [s for s in own if s.start_ns > 0 and s.end_ns >= s.start_ns and s.name != SDK_SUBMIT]
    # With no worker.request found, explain counts the prefill and decode spans as running: not in transit too.
    running = () if any(s.name == WORKER_REQUEST for s in timed) else (WORKER_PREFILL, WORKER_DECODE)
    covered = [(s.start_ns, s.end_ns) for s in timed if s.name in _ACCOUNTED or s.name in running]
    inside = [(s.start_ns, s.end_ns, {GATEWAY_ADMIT: "admission", GATEWAY_DISPATCH: "dispatch"}[s.name])
              for s in timed if s.name in (GATEWAY_ADMIT, GATEWAY_DISPATCH)]
    marks = kept_marks(timed)
    cuts = sorted({t0, t_end} | {t for s in timed for t in (s.start_ns, s.end_ns) if t0 < t < t_end}
                  | {t for _, t in marks if t0 < t < t_end})
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        if any(s <= mid < e for s, e in covered):
            continue
        kind = next((k for s, e, k in inside if s <= mid < e), None) or _gap_kind(timed, mid)
        if kind == "lost" and _kept(marks, mid):
            kind = "kept"
        out[kind] += (b - a) / 1e9
    return {k: round(v, 9) for k, v in out.items()}


def kept_marks(spans: list[Span]) -> list[tuple[int, int]]:
    """(start, last kept token; 0: none) of each dispatch, in ns: an attempt lost before a re-dispatch ran until
    the last token that re-dispatch resumed with was written (gateway.spans: dispatch.last_kept_token_ms, Redis's
    clock)."""
    return sorted((s.start_ns, (attr_int(s.get("dispatch.last_kept_token_ms")) or 0) * 1_000_000
                   if (attr_int(s.get("dispatch.resumed_tokens")) or 0) > 0 else 0)
                  for s in spans if s.name == GATEWAY_DISPATCH)


def _kept(marks: list[tuple[int, int]], at: float) -> bool:
    """Whether a lost attempt's instant ``at`` was before the last token the next dispatch resumed with."""
    nxt = next((kept for start, kept in marks if start >= at), 0)
    return at < nxt


def _gap_kind(timed: list[Span], at: float) -> str:
    before = [s for s in timed if s.end_ns <= at]
    after = [s for s in timed if s.start_ns >= at]
    prev = max(before, key=lambda s: s.end_ns).name if before else None
    nxt = min(after, key=lambda s: s.start_ns).name if after else None
    if prev is None:
        return "to_gateway"
    if nxt is None:
        return "delivery"
    if prev == GATEWAY_ADMIT:
        return "admission"
    if nxt == GATEWAY_DEAD_LETTER and (prev == GATEWAY_DISPATCH or prev.startswith("worker.")):
        return "lost"  # its last allowed attempt: the lease ran out and nothing came after
    if prev == GATEWAY_DISPATCH:
        return "to_worker" if nxt.startswith("worker.") else "lost" if nxt == GATEWAY_QUEUE else "other"
    if prev.startswith("worker.") and nxt == GATEWAY_QUEUE:
        # The attempt ended there and the job was queued again: handed back, as the next dispatch says
        # (dispatch.requeue_cause), or lost with its worker.
        redispatch = min((s for s in after if s.name == GATEWAY_DISPATCH), key=lambda s: s.start_ns, default=None)
        released = redispatch is not None and attr_str(redispatch.get("dispatch.requeue_cause")) == "released"
        return "hand_back" if released else "lost"
    return "other"
