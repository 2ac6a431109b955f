"""Clocks a request's spans were read from that disagreed: said, not hidden in the times.

A gateway's queue and dispatch spans are on Redis's clock (gateway/spans.py); its admission span, and the worker's
spans, are on their own hosts' clocks. Each queue span that ended at a dispatch says how far the dispatching
gateway's wall clock was from Redis's then (``queue.clock_offset_ms``, the claim's reply time included), and the
admission span how far the admitting gateway's was as admit.lua ran (``admission.clock_offset_ms``): explain reads
the admission on Redis's clock by it (``on_redis_clock``), so that the queue wait follows it without a gap the skew
made. Past ``TOLERANCE_S`` the gaps explain names between spans of different processes may be off by as much.

A worker says nothing of its clock, but one behind Redis's shows: its ``worker.request`` begins before the dispatch
that sent it (its parent) began, which cannot be. Without a word, explain told such a job's worker-queue wait before
its gateway queue wait, a first prefill before its admission and seconds of "other".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from common.traces.schema import GATEWAY_ADMIT, GATEWAY_DISPATCH, GATEWAY_QUEUE, WORKER_REQUEST, attr_int, attr_str
from common.traces.spans import Span, SpanEvent

# Above a claim's reply time on a loaded host (a few tens of ms), below what would mislead about a wait.
TOLERANCE_S = 0.25
CLOCK_OFFSET = "queue.clock_offset_ms"
ADMISSION_OFFSET = "admission.clock_offset_ms"


def on_redis_clock(spans: Iterable[Span]) -> list[Span]:
    """``spans``, each admission span that says its clock's offset moved onto Redis's clock (the others as they
    are). The offset holds admit.lua's reply time, so the admission still ends at or after the queue span's start."""
    out = []
    for s in spans:
        ms = attr_int(s.get(ADMISSION_OFFSET)) if s.name == GATEWAY_ADMIT else None
        if ms and s.start_ns > 0:
            d = ms * 1_000_000
            s = replace(s, start_ns=s.start_ns - d, end_ns=s.end_ns - d,
                        events=[SpanEvent(e.name, e.time_ns - d, e.attributes) for e in s.events])
        out.append(s)
    return out


def clock_offsets(own: list[Span]) -> list[dict]:
    """The admissions and dispatches whose gateway's clock was off Redis's by more than TOLERANCE_S: at
    (``admission`` or ``dispatch``), attempt (a dispatch's), service, offset_s (the gateway's clock minus Redis's:
    negative, behind)."""
    out = []
    for s in sorted((s for s in own if s.name in (GATEWAY_ADMIT, GATEWAY_QUEUE)), key=lambda s: s.start_ns):
        admission = s.name == GATEWAY_ADMIT
        ms = attr_int(s.get(ADMISSION_OFFSET if admission else CLOCK_OFFSET))
        if ms is not None and abs(ms) / 1e3 > TOLERANCE_S:
            out.append({"at": "admission" if admission else "dispatch",
                        "attempt": None if admission else attr_int(s.get("queue.attempt")), "service": s.service,
                        "offset_s": ms / 1e3})
    return out + _workers_behind(own)


def _workers_behind(own: list[Span]) -> list[dict]:
    """Workers whose request span began more than TOLERANCE_S before its dispatch began: at ``worker``, the attempt,
    service, worker, offset_s (a bound: its clock was at least that far behind Redis's)."""
    dispatches = {s.key: s for s in own if s.name == GATEWAY_DISPATCH}
    out = []
    for w in sorted((s for s in own if s.name == WORKER_REQUEST and s.start_ns > 0), key=lambda s: s.start_ns):
        d = dispatches.get((w.trace_id, w.parent_span_id))
        if d is not None and (d.start_ns - w.start_ns) / 1e9 > TOLERANCE_S:
            out.append({"at": "worker", "attempt": attr_int(d.get("dispatch.attempt")), "service": w.service,
                        "worker": attr_str(d.get("dispatch.worker")), "offset_s": (w.start_ns - d.start_ns) / 1e9})
    return out


def clock_text(offsets: list[dict]) -> list[str]:
    lines = []
    for o in offsets:
        how = "behind" if o["offset_s"] < 0 else "ahead of"
        if o.get("at") == "worker":
            at = f" at attempt {o['attempt']}" if o.get("attempt") else ""
            who = o.get("worker") or "?"
            lines.append(f"clocks disagree: worker {who}'s clock was at least {abs(o['offset_s']):.2f} s behind "
                         f"Redis's{at} (its worker.request began before its dispatch); its spans are on its own clock, "
                         "so the times between them and the gateway's are off by as much")
            continue
        if o.get("at") == "admission":
            lines.append(f"clocks disagree: the gateway was {abs(o['offset_s']):.2f} s {how} Redis's clock at the "
                         "admission; its admission is told on Redis's clock (admission.clock_offset_ms)")
            continue
        at = f" at the dispatch of attempt {o['attempt']}" if o.get("attempt") else " at a dispatch"
        lines.append(f"clocks disagree: the gateway was {abs(o['offset_s']):.2f} s {how} Redis's clock{at}; queue and "
                     "dispatch times are Redis's, the worker's its own, so the gaps between them may be off by as "
                     "much")
    return lines
