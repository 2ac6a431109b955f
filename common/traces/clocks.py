"""Clocks a request's spans were read from that disagreed: said, not hidden in the times.

A gateway's queue and dispatch spans are on Redis's clock (gateway/spans.py); its admission span, and the worker's
spans, are on their own hosts' clocks. Each queue span that ended at a dispatch says how far the dispatching
gateway's wall clock was from Redis's then (``queue.clock_offset_ms``, the claim's reply time included). Past
``TOLERANCE_S`` the gaps explain names between spans of different processes may be off by as much.
"""

from __future__ import annotations

from common.traces.schema import GATEWAY_QUEUE, attr_int
from common.traces.spans import Span

# Above a claim's reply time on a loaded host (a few tens of ms), below what would mislead about a wait.
TOLERANCE_S = 0.25
CLOCK_OFFSET = "queue.clock_offset_ms"


def clock_offsets(own: list[Span]) -> list[dict]:
    """The dispatches whose gateway's clock was off Redis's by more than TOLERANCE_S: attempt, service, offset_s
    (the gateway's clock minus Redis's: negative, behind)."""
    out = []
    for q in sorted((s for s in own if s.name == GATEWAY_QUEUE), key=lambda s: s.start_ns):
        ms = attr_int(q.get(CLOCK_OFFSET))
        if ms is not None and abs(ms) / 1e3 > TOLERANCE_S:
            out.append({"attempt": attr_int(q.get("queue.attempt")), "service": q.service, "offset_s": ms / 1e3})
    return out


def clock_text(offsets: list[dict]) -> list[str]:
    lines = []
    for o in offsets:
        how = "behind" if o["offset_s"] < 0 else "ahead of"
        at = f" at the dispatch of attempt {o['attempt']}" if o.get("attempt") else " at a dispatch"
        lines.append(f"clocks disagree: the gateway was {abs(o['offset_s']):.2f} s {how} Redis's clock{at}; queue and "
                     "dispatch times are Redis's, the admission's and the worker's their own, so the gaps between "
                     "them may be off by as much")
    return lines
