"""Which spans belong to one request: its traces, its own spans, and the preemption decisions that touched it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from common.traces.schema import DECISION_SPANS, REQUEST_ID, attr_str
from common.traces.spans import Span, dedupe


@dataclass
class RequestSpans:
    request_id: str
    trace_ids: list[str]
    own: list[Span]  # the request's spans (decision spans excluded)
    decisions: list[Span]  # decision spans that touched it, from any trace


def select_request_spans(spans: Iterable[Span], request_id: str, *, fallback_all: bool = False) -> RequestSpans:
    """The request's traces, its own spans, and the decision spans linked to them.

    ``fallback_all``: when no span carries ``request.id`` == ``request_id``, take every trace given
    (a backend already searched by the id: Jaeger's answer).
    """
    spans = dedupe(spans)
    rid = str(request_id)
    trace_ids = {s.trace_id for s in spans if attr_str(s.get(REQUEST_ID)) == rid}
    if not trace_ids and fallback_all:
        trace_ids = {s.trace_id for s in spans}
    own = [s for s in spans if s.trace_id in trace_ids and s.name not in DECISION_SPANS
           and (s.get(REQUEST_ID) is None or attr_str(s.get(REQUEST_ID)) == rid)]
    own_keys = {s.key for s in own}
    linked_from_own = {(lk.trace_id, lk.span_id) for s in own for lk in s.links}
    decisions = []
    for s in spans:
        if s.name not in DECISION_SPANS:
            continue
        touches = (s.trace_id in trace_ids and (s.parent_span_id is None or (s.trace_id, s.parent_span_id) in own_keys)
                   or any((lk.trace_id, lk.span_id) in own_keys for lk in s.links)
                   or s.key in linked_from_own
                   or rid in (attr_str(s.get("preemption.victim.request_id")),
                              attr_str(s.get("preemption.beneficiary.request_id"))))
        if touches:
            decisions.append(s)
    return RequestSpans(rid, sorted(trace_ids), own, decisions)
