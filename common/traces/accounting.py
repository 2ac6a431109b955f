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

from bisect import bisect_left, bisect_right
from heapq import heappop, heappush

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
    covered = _Covered([(s.start_ns, s.end_ns) for s in timed if s.name in _ACCOUNTED or s.name in running])
    inside = _FirstOpen([(s.start_ns, s.end_ns, {GATEWAY_ADMIT: "admission", GATEWAY_DISPATCH: "dispatch"}[s.name])
                         for s in timed if s.name in (GATEWAY_ADMIT, GATEWAY_DISPATCH)])
    gaps = _Neighbours(timed)
    marks = kept_marks(timed)
    mark_starts = [start for start, _ in marks]
    cuts = sorted({t0, t_end} | {t for s in timed for t in (s.start_ns, s.end_ns) if t0 < t < t_end}
                  | {t for _, t in marks if t0 < t < t_end})
    # Each lookup below is a bisection or a sweep, not a pass over every span: with a pass per interval, a job of
    # 2,000 attempts (8,000 spans) took 25 s. ``mid`` is a float, as it always was: the same intervals, the same sums.
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        if covered.at(mid):
            continue
        kind = inside.at(mid) or gaps.kind(mid)
        if kind == "lost" and _kept(marks, mark_starts, mid):
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


def _kept(marks: list[tuple[int, int]], starts: list[int], at: float) -> bool:
    """Whether a lost attempt's instant ``at`` was before the last token the next dispatch resumed with (``starts``:
    the marks' starts)."""
    i = bisect_left(starts, at)
    return i < len(marks) and at < marks[i][1]


class _Covered:
    """Whether an instant lies in one of the intervals [start, end): those begun by then less those ended."""

    def __init__(self, intervals: list[tuple[int, int]]) -> None:
        self.starts = sorted(s for s, _ in intervals)
        self.ends = sorted(e for _, e in intervals)

    def at(self, t: float) -> bool:
        return bisect_right(self.starts, t) > bisect_right(self.ends, t)


class _FirstOpen:
    """The label of the first interval (in the order given) holding an instant, for instants that never go back."""

    def __init__(self, intervals: list[tuple[int, int, str]]) -> None:
        self.pending = sorted(range(len(intervals)), key=lambda i: intervals[i][0])
        self.intervals = intervals
        self.next = 0
        self.open: list[tuple[int, int, str]] = []  # (order, end, label): the first in order on top

    def at(self, t: float) -> str | None:
        while self.next < len(self.pending) and self.intervals[self.pending[self.next]][0] <= t:
            i = self.pending[self.next]
            heappush(self.open, (i, self.intervals[i][1], self.intervals[i][2]))
            self.next += 1
        while self.open and self.open[0][1] <= t:  # ended: it holds no later instant either
            heappop(self.open)
        return self.open[0][2] if self.open else None


class _Neighbours:
    """Which kind of gap an instant outside every span is, by the spans on either side of it: the last to end before
    it and the first to begin after it (the first given, of those ending or beginning at the same instant)."""

    def __init__(self, timed: list[Span]) -> None:
        by_end: dict[int, Span] = {}
        by_start: dict[int, Span] = {}
        dispatch_by_start: dict[int, Span] = {}
        for s in timed:
            by_end.setdefault(s.end_ns, s)
            by_start.setdefault(s.start_ns, s)
            if s.name == GATEWAY_DISPATCH:
                dispatch_by_start.setdefault(s.start_ns, s)
        self.ends, self.before = _sorted_items(by_end)
        self.starts, self.after = _sorted_items(by_start)
        self.dispatch_starts, self.dispatches = _sorted_items(dispatch_by_start)

    def kind(self, at: float) -> str:
        i = bisect_right(self.ends, at)
        prev = self.before[i - 1].name if i > 0 else None
        j = bisect_left(self.starts, at)
        nxt = self.after[j].name if j < len(self.after) else None
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
            d = bisect_left(self.dispatch_starts, at)
            redispatch = self.dispatches[d] if d < len(self.dispatches) else None
            released = redispatch is not None and attr_str(redispatch.get("dispatch.requeue_cause")) == "released"
            return "hand_back" if released else "lost"
        return "other"


def _sorted_items(by_time: dict[int, Span]) -> tuple[list[int], list[Span]]:
    times = sorted(by_time)
    return times, [by_time[t] for t in times]
