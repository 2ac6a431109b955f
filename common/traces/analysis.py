"""Explain why one request was slow, from its spans (parsed by ``common.traces.otlp_json``).

Pure analysis: no I/O, no network, no plotting (``scripts/explain.py`` reads files, calls
Jaeger and draws the PNG).

The request's spans are those of every trace that holds a span with ``request.id`` == the
id, plus the preemption decision spans of other traces that link to them (a decision lives
in the beneficiary's trace and links to the victim's ``worker.request``) or that they link
to (the victim's ``preempted_by`` link, a ``worker.suspended`` span's link). From them: total
time split into queued / running / suspended (and the rest, "other"), the blame chain (each
wait with its cause, in time order) and the phases for a Gantt chart.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

from common.traces import accounting
from common.traces.clocks import clock_offsets, on_redis_clock
from common.traces.lookups import Within
from common.traces.missing import missing_spans
from common.traces.model import Cause, Explanation, NoSchedulingSpans, Phase, Suspension
from common.traces.preemption_causes import PreemptionCauses
from common.traces.schema import (GATEWAY_ADMIT, GATEWAY_DEAD_LETTER, GATEWAY_DISPATCH, GATEWAY_QUEUE, PHASES,
                                  PREEMPTION, PREEMPTION_DECLINED, REQUEST_ID, REQUEST_TIER, SCHEDULING_SPANS,
                                  SDK_SUBMIT, TENANT_ID, WORKER_DECODE, WORKER_PREFILL, WORKER_QUEUE, WORKER_REQUEST,
                                  WORKER_SUSPENDED, attr_int, attr_str)
from common.traces.select import RequestSpans, select_request_spans
from common.traces.spans import Span
from common.traces.wait_causes import WaitCauses


def explain_request(spans: Iterable[Span], request_id: str, *, fallback_all: bool = False,
                    min_wait_s: float = 0.005) -> Explanation:
    """Explain one request. Raises NoSchedulingSpans when there is nothing to explain."""
    sel = select_request_spans(on_redis_clock(spans), request_id, fallback_all=fallback_all)
    if not any(s.name in SCHEDULING_SPANS for s in sel.own):
        # Decisions alone (its own spans gone) were told as a request of 0 s, made of another request's instant.
        raise NoSchedulingSpans(sel.request_id, sel.trace_ids, _named_by(sel))
    return _Analyser(sel, min_wait_s).run()


def _named_by(sel: RequestSpans) -> list[dict]:
    out = []
    for s in sorted(sel.decisions, key=_in_time):
        role = ("victim" if attr_str(s.get("preemption.victim.request_id")) == sel.request_id else
                "beneficiary" if attr_str(s.get("preemption.beneficiary.request_id")) == sel.request_id else "linked")
        out.append({"decision_id": attr_str(s.get("preemption.decision_id")), "role": role, "trace_id": s.trace_id,
                    "span_id": s.span_id})
    return out


# Spans of the same start and end in the order of a request's life, then by name and id: a sort by times alone kept
# the input's order for them (lines of several processes, rotated files, an exporter's retry), and so did the
# answer (which dispatch's worker came first, which decision a suspension took, the gaps' names).
_LIFE = {name: i for i, name in enumerate((SDK_SUBMIT, GATEWAY_ADMIT, GATEWAY_QUEUE, GATEWAY_DISPATCH,
                                           GATEWAY_DEAD_LETTER, WORKER_REQUEST, WORKER_QUEUE, WORKER_PREFILL,
                                           WORKER_DECODE, WORKER_SUSPENDED, PREEMPTION, PREEMPTION_DECLINED))}


def _in_time(s: Span) -> tuple:
    return s.start_ns, s.end_ns, _LIFE.get(s.name, len(_LIFE)), s.name, s.trace_id, s.span_id


class _Analyser(WaitCauses, PreemptionCauses):
    """The causes come from the mixins: the gateway's side (wait_causes) and preemption's (preemption_causes)."""

    def __init__(self, sel: RequestSpans, min_wait_s: float) -> None:
        self.sel = sel
        self.rid = sel.request_id
        self.min_wait_s = min_wait_s
        self.own = sorted(sel.own, key=_in_time)
        # The request's extent: its own spans (request.id, or one of the schema's span names), not a
        # caller's wrapping span that happens to share the trace.
        mine = [s for s in self.own if s.start_ns > 0 and (attr_str(s.get(REQUEST_ID)) == self.rid
                                                            or s.name in SCHEDULING_SPANS or s.name == SDK_SUBMIT)]
        timed = mine or [s for s in self.own if s.start_ns > 0] or [s for s in sel.decisions if s.start_ns > 0]
        self.t0 = min((s.start_ns for s in timed), default=0)
        self.t_end = max((s.end_ns for s in timed), default=self.t0)
        self.by_name: dict[str, list[Span]] = {}
        for s in self.own:
            self.by_name.setdefault(s.name, []).append(s)
        self.own_keys = {s.key for s in self.own}
        # The roles of the links from its own spans to each span they link (a victim's preempted_by): read once,
        # not once per decision, which took minutes for a request preempted a few thousand times.
        self.own_link_roles: dict[tuple[str, str], set[str]] = {}
        for s in self.own:
            for lk in s.links:
                roles = self.own_link_roles.setdefault((lk.trace_id, lk.span_id), set())
                roles.add(str(lk.attributes.get("link.role")))

    def rel(self, ns: int) -> float:
        return round((ns - self.t0) / 1e9, 9) if ns else 0.0

    def spans(self, name: str) -> list[Span]:
        return self.by_name.get(name, [])

    def total(self, name: str) -> float:
        return sum(s.duration_s for s in self.spans(name))

    def run(self) -> Explanation:
        decision_spans = sorted(self.sel.decisions, key=_in_time)
        decisions = [self.decision(s) for s in decision_spans]

        causes: list[tuple[float, int, Cause]] = []

        def add(order: int, cause: Cause) -> None:
            causes.append((cause.at_s, order, cause))

        admit = self.spans(GATEWAY_ADMIT)[0] if self.spans(GATEWAY_ADMIT) else None
        tier_requested = attr_str(admit.get("admission.tier_requested")) if admit else None
        tier_granted = attr_str(admit.get("admission.tier_granted")) if admit else None

        # Quota.
        if admit is not None:
            quota = attr_str(admit.get("admission.quota"))
            asked = tier_requested or "P0"
            if quota == "downgraded":
                add(0, Cause(self.rel(admit.start_ns), "quota", f"{asked} quota spent: served as {tier_granted or '?'}",
                             detail={"tier_requested": tier_requested, "tier_granted": tier_granted}))
            elif quota == "refused":
                add(0, Cause(self.rel(admit.start_ns), "quota", f"{asked} quota spent: refused at admission",
                             detail={"tier_requested": tier_requested}))

        # In this order: causes at the same moment and of the same order are told in the order added.
        dispatches = self.spans(GATEWAY_DISPATCH)
        queues = self.spans(GATEWAY_QUEUE)
        workers = self._dispatch_causes(dispatches, queues, add)
        self._dead_letter_causes(dispatches, add)
        self._queue_causes(queues, admit, add)
        self._worker_queue_causes(dispatches, add)
        self._declined_causes(decisions, add)
        suspensions = self._suspension_causes(decisions, add)

        # Totals.
        total = max(0.0, (self.t_end - self.t0) / 1e9)
        worker_queue = self.total(WORKER_QUEUE)
        queued = self.total(GATEWAY_QUEUE) + worker_queue
        suspended = self.total(WORKER_SUSPENDED)
        if self.spans(WORKER_REQUEST):
            # Only the waits inside a worker.request found: a worker killed -9 exported its lost attempt's queue
            # wait but never its worker.request, and that wait taken off the next attempt's running was told twice.
            within = Within(self.spans(WORKER_REQUEST))
            inside = [s for s in self.spans(WORKER_QUEUE) + self.spans(WORKER_SUSPENDED) if within.holds(s)]
            running = self.total(WORKER_REQUEST) - sum(s.duration_s for s in inside)
        else:
            running = self.total(WORKER_PREFILL) + self.total(WORKER_DECODE) - suspended
        running = max(0.0, running)
        transit = accounting.transit(self.own, self.t0, self.t_end)
        kept = transit.pop("kept")  # a lost attempt's run up to the last token the next one resumed with
        running += kept
        in_transit = sum(v for k, v in transit.items() if k != "other")
        other = max(0.0, total - queued - running - suspended - in_transit)
        self._to_worker_causes(dispatches, add)

        to_first_prefill, prefill_attempt = self._to_first_prefill(queues, dispatches)
        tier = next((attr_str(s.get(REQUEST_TIER)) for s in self.own if s.get(REQUEST_TIER) is not None), None)
        tenant = next((attr_str(s.get(TENANT_ID)) for s in self.own if s.get(TENANT_ID) is not None), None)
        attempts = max([len(dispatches), len(self.spans(WORKER_REQUEST))]
                       + [attr_int(d.get("dispatch.attempt")) or 0 for d in dispatches])

        return Explanation(
            request_id=self.rid, trace_ids=self.sel.trace_ids, tier=tier, tenant=tenant,
            tier_requested=tier_requested, tier_granted=tier_granted, start_unix_ns=self.t0,
            total_s=round(total, 9), queued_s=round(queued, 9), running_s=round(running, 9),
            suspended_s=round(suspended, 9), transit_s=round(in_transit, 9), transit=transit, other_s=round(other, 9),
            attempts=max(attempts, 1 if self.own else 0),
            workers=workers, blame=[c for _, _, c in sorted(causes, key=lambda x: (x[0], x[1]))],
            phases=self._phases(dispatches, suspensions), suspensions=suspensions, decisions=decisions,
            missing=missing_spans(self.own, self.t0), clock_offsets=clock_offsets(self.own), kept_s=round(kept, 9),
            to_first_prefill_s=to_first_prefill, to_first_prefill_attempt=prefill_attempt)

    def _to_first_prefill(self, queues: list[Span], dispatches: list[Span]) -> tuple[float | None, int | None]:
        """Admission to the first prefill found, and the attempt that prefill is of: what JobResult.queued_s reports
        (first_prefill_ms - admission). Not queued_s here, which holds every queue wait of every attempt: after a
        re-dispatch the two differ by design. A re-dispatch's span holds the earlier attempts' first prefill as the
        job's hash recorded it (Redis's clock, as the admission's): that one, where given, as a worker killed before
        its exporter ran left no prefill span of its attempt. (None, None) without the first attempt's queue span
        (its start is the admission) or any prefill."""
        first = [q for q in queues if (attr_int(q.get("queue.attempt")) or 1) == 1]
        if not first:
            return None, None
        admitted = min(q.start_ns for q in first)
        recorded = [ms * 1_000_000 for d in dispatches if (ms := attr_int(d.get("dispatch.first_prefill_ms")))]
        if recorded:
            return round(max(0, min(recorded) - admitted) / 1e9, 9), None
        prefills = [p.start_ns for p in self.spans(WORKER_PREFILL) if p.start_ns > 0]
        if not prefills:
            return None, None
        at = min(prefills)
        before = [d for d in dispatches if d.start_ns <= at]
        attempt = (attr_int(before[-1].get("dispatch.attempt")) or len(before)) if before else 1
        return round(max(0, at - admitted) / 1e9, 9), attempt

    def _phases(self, dispatches: list[Span], suspensions: list[Suspension]) -> list[Phase]:
        out: list[Phase] = []
        starts = sorted(d.start_ns for d in dispatches)  # attempts counted by bisection (a pass each: squared)
        chunk = 0
        for s in self.own:
            phase = PHASES.get(s.name)
            if phase is None or phase == "suspended":
                continue
            attempt = max(1, bisect_right(starts, s.start_ns)) if phase != "queue" else \
                max(1, bisect_left(starts, s.start_ns) + 1)
            if phase == "queue":
                label = attr_str(s.get("queue.tier")) or ""
            elif phase == "dispatch":
                label = attr_str(s.get("dispatch.worker")) or ""
            elif phase == "prefill":
                chunk += 1
                label = f"chunk {chunk}"
            else:
                label = ""
            out.append(Phase(phase, self.rel(s.start_ns), self.rel(s.end_ns), label, attempt))
        rel_starts = sorted(self.rel(t) for t in starts)  # rel of an unset start (0) is 0.0: not in starts' order
        for sus in suspensions:
            label = " then ".join(f"by {t.by_request_id}" + (f" ({t.by_tier})" if t.by_tier else "")
                                  for t in sus.takings[:3] if t.by_request_id) or sus.mode or "suspended"
            if len(sus.takings) > 3:
                label += f" (+{len(sus.takings) - 3})"
            attempt = max(1, bisect_right(rel_starts, sus.start_s))
            out.append(Phase("suspended", sus.start_s, sus.end_s, label, attempt))
        return out
