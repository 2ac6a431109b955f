"""Which of a request's scheduling spans are not in the input, as far as the spans found tell.

Spans go missing when a rotated spans file was removed (up.py's --spans-keep: the oldest first, so a job's
admission and queue wait go before its worker's spans) or when a process died before exporting them. Without
saying so, explain told a story that began at the first span left: a job that queued for a minute "waited 0.25 s
in the worker's queue" and nothing else. Each entry names a span the others show existed (their parent, an
attempt before theirs), and what its absence leaves out.
"""

from __future__ import annotations

from bisect import bisect_right

from common.traces.schema import (GATEWAY_ADMIT, GATEWAY_DEAD_LETTER, GATEWAY_DISPATCH, GATEWAY_QUEUE, WORKER_DECODE,
                                  WORKER_PREFILL, WORKER_QUEUE, WORKER_REQUEST, WORKER_SUSPENDED, attr_int, attr_str)
from common.traces.spans import Span

# Each span name and the one its parent is (gateway/spans.py, worker/tracing.py); gateway.admit's parent is the
# client's, which need not be exported anywhere.
_PARENT = {GATEWAY_QUEUE: GATEWAY_ADMIT, GATEWAY_DISPATCH: GATEWAY_ADMIT, GATEWAY_DEAD_LETTER: GATEWAY_ADMIT,
           WORKER_REQUEST: GATEWAY_DISPATCH, WORKER_QUEUE: WORKER_REQUEST, WORKER_PREFILL: WORKER_REQUEST,
           WORKER_DECODE: WORKER_REQUEST, WORKER_SUSPENDED: WORKER_REQUEST}


def missing_spans(own: list[Span], t0: int) -> list[str]:
    """What is missing, in the order of the request's life (``t0``: its first span found, for the times)."""
    keys = {s.key for s in own}
    names = {s.name for s in own}
    out: list[str] = []
    if GATEWAY_ADMIT not in names and names & set(_PARENT):
        out.append("gateway.admit: its admission, and whatever it waited before its first span found")
    dispatches = sorted((s for s in own if s.name == GATEWAY_DISPATCH), key=lambda s: s.start_ns)
    attempts = {attr_int(d.get("dispatch.attempt")) for d in dispatches} - {None}
    last = max(attempts | {attr_int(s.get("dead_letter.attempt")) or 0 for s in own if s.name == GATEWAY_DEAD_LETTER}
               | {0})
    for a, b in _gaps(attempts, last):
        out.append(f"gateway.dispatch of attempt {a}: that attempt's queue wait, hand-off and worker" if a == b else
                   f"gateway.dispatch of attempts {a}-{b}: their queue waits, hand-offs and workers")
    queues = [s for s in own if s.name == GATEWAY_QUEUE]
    numbered = {attr_int(q.get("queue.attempt")) for q in queues} - {None}
    if numbered:  # spans made before queue.attempt was recorded are only counted
        out += [f"gateway.queue of attempt {n}: its wait in the queue" for n in sorted(attempts - numbered)]
    elif len(queues) < len(dispatches):
        out.append(f"gateway.queue of {len(dispatches) - len(queues)} of its {len(dispatches)} attempts: their waits "
                   "in the queue")
    orphans: dict[tuple[str, str], Span] = {}
    for s in own:
        parent = _PARENT.get(s.name)
        if parent is None or parent == GATEWAY_ADMIT or s.parent_span_id is None:
            continue  # a missing admission is told above
        if (s.trace_id, s.parent_span_id) not in keys:
            first = orphans.get((s.trace_id, s.parent_span_id))
            if first is None or s.start_ns < first.start_ns:
                orphans[(s.trace_id, s.parent_span_id)] = s
    starts = [d.start_ns for d in dispatches]  # in order: the last begun by an instant found by bisection
    for s in sorted(orphans.values(), key=lambda s: s.start_ns):
        at = f"+{(s.start_ns - t0) / 1e9:.2f} s"
        if s.name == WORKER_REQUEST:
            out.append(f"gateway.dispatch before the worker.request at {at}: its hand-off and the queue wait before")
        else:
            begun = bisect_right(starts, s.start_ns)
            worker = attr_str(dispatches[begun - 1].get("dispatch.worker")) if begun else None
            out.append(f"worker.request of the attempt on worker {worker or '?'} (its {s.name} at {at}): that "
                       "attempt's stay on the worker (a worker killed before it ended exports none)")
    return out


def _gaps(known: set[int], last: int) -> list[tuple[int, int]]:
    """The runs of attempts 1..last not in ``known``, first and last of each: as many as the spans found, however
    large an attempt number a span says (one line per attempt counted to 10**12 and never ended)."""
    out, expected = [], 1
    for n in sorted(a for a in known if 1 <= a <= last):
        if n > expected:
            out.append((expected, n - 1))
        expected = n + 1
    if expected <= last:
        out.append((expected, last))
    return out
