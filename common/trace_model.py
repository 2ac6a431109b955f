"""Explain why one request was slow, from its spans (parsed by ``common.otlp_json``).

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

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.otlp_json import REQUEST_ID, Span, dedupe


REQUEST_TIER = "request.tier"
TENANT_ID = "tenant.id"
TIERS = ("P0", "P1", "P2", "P3")

SDK_SUBMIT = "sdk.submit"
GATEWAY_ADMIT = "gateway.admit"
GATEWAY_QUEUE = "gateway.queue"
GATEWAY_DISPATCH = "gateway.dispatch"
WORKER_REQUEST = "worker.request"
WORKER_QUEUE = "worker.queue"
WORKER_PREFILL = "worker.prefill"
WORKER_DECODE = "worker.decode"
WORKER_SUSPENDED = "worker.suspended"
PREEMPTION = "scheduler.preemption"
PREEMPTION_DECLINED = "scheduler.preemption_declined"

DECISION_SPANS = frozenset({PREEMPTION, PREEMPTION_DECLINED})
# Spans that say something about scheduling; a trace with none of them cannot be explained.
SCHEDULING_SPANS = frozenset({GATEWAY_ADMIT, GATEWAY_QUEUE, GATEWAY_DISPATCH, WORKER_REQUEST, WORKER_QUEUE,
                              WORKER_PREFILL, WORKER_DECODE, WORKER_SUSPENDED}) | DECISION_SPANS
# Gantt rows, top to bottom (suspended periods are drawn over them, hatched).
PHASES = {GATEWAY_QUEUE: "queue", GATEWAY_DISPATCH: "dispatch", WORKER_QUEUE: "worker_queue",
          WORKER_PREFILL: "prefill", WORKER_DECODE: "decode", WORKER_SUSPENDED: "suspended"}



class NoSchedulingSpans(LookupError):
    """No trace of the request, or its traces hold none of the scheduling spans."""

    def __init__(self, request_id: str, trace_ids: Iterable[str] = ()) -> None:
        self.request_id = request_id
        self.trace_ids = sorted(trace_ids)
        where = f" (traces {', '.join(self.trace_ids)})" if self.trace_ids else " (no trace carries it)"
        super().__init__(f"no scheduling spans for request {request_id}{where}")



# --------------------------------------------------------------------------------------------
# Analysis model


@dataclass(frozen=True)
class Decision:
    """One preemption decision (taken or declined) that touched the request."""

    decision_id: str | None
    role: str  # "victim" (it suspended this request) | "beneficiary" (made room for it, or declined to)
    declined: bool
    at_s: float  # seconds since the request's first span started
    trigger: str | None
    mode: str | None
    declined_reason: str | None
    victim_request_id: str | None
    victim_tier: str | None
    victim_tenant: str | None
    beneficiary_request_id: str | None
    beneficiary_tier: str | None
    beneficiary_tenant: str | None
    blocks_freed: int | None
    bytes_moved: int | None
    estimated_cost_s: float | None
    kv_utilisation: float | None
    running: dict[str, int]
    waiting: dict[str, int]
    trace_id: str
    span_id: str


@dataclass(frozen=True)
class Suspension:
    """One period the request spent suspended (a ``worker.suspended`` span)."""

    start_s: float
    end_s: float
    duration_s: float
    mode: str | None
    by_request_id: str | None
    by_tier: str | None
    by_tenant: str | None
    decision_id: str | None
    trigger: str | None
    decision: Decision | None  # the decision span itself, when it was found (cost, KV use, counts)


@dataclass(frozen=True)
class Cause:
    """One entry of the blame chain: a wait (or an event) and what caused it."""

    at_s: float  # seconds since the request's first span started
    kind: str  # quota | queue | aging | dispatch | redispatch | worker_queue | declined | suspended
    #            | preempted (a decision without a recorded suspended period) | preempting (it was the beneficiary)
    text: str
    duration_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Phase:
    """One bar of the timeline (a span of the request), in seconds since its first span started."""

    phase: str  # queue | dispatch | worker_queue | prefill | decode | suspended
    start_s: float
    end_s: float
    label: str
    attempt: int


@dataclass
class Explanation:
    request_id: str
    trace_ids: list[str]
    tier: str | None  # the request's tier as its spans say (request.tier)
    tenant: str | None
    tier_requested: str | None
    tier_granted: str | None
    start_unix_ns: int
    total_s: float  # first span start to last span end of the request
    queued_s: float  # gateway.queue + worker.queue
    running_s: float  # worker.request - worker.queue - suspended
    suspended_s: float  # sum of worker.suspended
    other_s: float  # the rest: admission, dispatch, transfers, streaming
    attempts: int
    workers: list[str]
    blame: list[Cause]
    phases: list[Phase]
    suspensions: list[Suspension]
    decisions: list[Decision]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        who = ", ".join(x for x in (self.tier, f"tenant {self.tenant}" if self.tenant else None) if x)
        return (f"request {self.request_id}" + (f" ({who})" if who else "")
                + f": total {self.total_s:.2f} s = queued {self.queued_s:.2f} s + running {self.running_s:.2f} s"
                + f" + suspended {self.suspended_s:.2f} s + other {self.other_s:.2f} s")

    def render_text(self) -> str:
        lines = [self.summary(), f"trace {', '.join(self.trace_ids)}"]
        if self.blame:
            lines.append("why:")
            for c in self.blame:
                lines.append(f"  {'+' + format(c.at_s, '.2f'):>8} s  {c.text}")
                d = c.detail.get("decision") if c.kind == "suspended" else None
                if isinstance(d, dict):
                    lines.append(" " * 14 + _decision_detail_text(d))
        else:
            lines.append("why: nothing held it up (no queueing, suspension or declined preemption recorded)")
        return "\n".join(lines)


def _decision_detail_text(d: dict[str, Any]) -> str:
    parts = []
    if d.get("blocks_freed") is not None:
        parts.append(f"{d['blocks_freed']} KV blocks freed")
    if d.get("bytes_moved") is not None:
        parts.append(f"{_bytes(d['bytes_moved'])} moved")
    if d.get("estimated_cost_s") is not None:
        parts.append(f"estimated cost {d['estimated_cost_s']:.3f} s")
    if d.get("kv_utilisation") is not None:
        parts.append(f"KV {100 * d['kv_utilisation']:.0f}% used")
    for what in ("running", "waiting"):
        counts = d.get(what) or {}
        if counts:
            busy = " ".join(f"{t}:{n}" for t, n in counts.items() if n)
            parts.append(f"{what} {busy or 'none'}")
    return f"decision {d.get('decision_id') or '?'}: " + (", ".join(parts) if parts else "no details recorded")


def _bytes(n: Any) -> str:
    try:
        v = float(n)
    except (TypeError, ValueError):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return str(n)


# --------------------------------------------------------------------------------------------
# Analysis


def _str(v: Any) -> str | None:
    return None if v is None or v == "" else str(v)


def _int(v: Any) -> int | None:
    try:
        return None if v is None or v == "" else int(v)
    except (TypeError, ValueError):
        try:
            return int(float(v))
        except (TypeError, ValueError, OverflowError):
            return None


def _float(v: Any) -> float | None:
    try:
        return None if v is None or v == "" else float(v)
    except (TypeError, ValueError):
        return None


def _per_tier(span: Span, prefix: str) -> dict[str, int]:
    out = {}
    for t in TIERS:
        n = _int(span.get(f"{prefix}.{t}"))
        if n is not None:
            out[t] = n
    return out


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
    trace_ids = {s.trace_id for s in spans if _str(s.get(REQUEST_ID)) == rid}
    if not trace_ids and fallback_all:
        trace_ids = {s.trace_id for s in spans}
    own = [s for s in spans if s.trace_id in trace_ids and s.name not in DECISION_SPANS
           and (s.get(REQUEST_ID) is None or _str(s.get(REQUEST_ID)) == rid)]
    own_keys = {s.key for s in own}
    linked_from_own = {(lk.trace_id, lk.span_id) for s in own for lk in s.links}
    decisions = []
    for s in spans:
        if s.name not in DECISION_SPANS:
            continue
        touches = (s.trace_id in trace_ids and (s.parent_span_id is None or (s.trace_id, s.parent_span_id) in own_keys)
                   or any((lk.trace_id, lk.span_id) in own_keys for lk in s.links)
                   or s.key in linked_from_own
                   or rid in (_str(s.get("preemption.victim.request_id")),
                              _str(s.get("preemption.beneficiary.request_id"))))
        if touches:
            decisions.append(s)
    return RequestSpans(rid, sorted(trace_ids), own, decisions)


def explain_request(spans: Iterable[Span], request_id: str, *, fallback_all: bool = False,
                    min_wait_s: float = 0.005) -> Explanation:
    """Explain one request. Raises NoSchedulingSpans when there is nothing to explain."""
    sel = select_request_spans(spans, request_id, fallback_all=fallback_all)
    if not any(s.name in SCHEDULING_SPANS for s in sel.own) and not sel.decisions:
        raise NoSchedulingSpans(sel.request_id, sel.trace_ids)
    return _Analyser(sel, min_wait_s).run()


class _Analyser:
    def __init__(self, sel: RequestSpans, min_wait_s: float) -> None:
        self.sel = sel
        self.rid = sel.request_id
        self.min_wait_s = min_wait_s
        self.own = sorted(sel.own, key=lambda s: (s.start_ns, s.end_ns))
        # The request's extent: its own spans (request.id, or one of the schema's span names), not a
        # caller's wrapping span that happens to share the trace.
        mine = [s for s in self.own if s.start_ns > 0 and (_str(s.get(REQUEST_ID)) == self.rid
                                                            or s.name in SCHEDULING_SPANS or s.name == SDK_SUBMIT)]
        timed = mine or [s for s in self.own if s.start_ns > 0] or [s for s in sel.decisions if s.start_ns > 0]
        self.t0 = min((s.start_ns for s in timed), default=0)
        self.t_end = max((s.end_ns for s in timed), default=self.t0)
        self.by_name: dict[str, list[Span]] = {}
        for s in self.own:
            self.by_name.setdefault(s.name, []).append(s)
        self.own_keys = {s.key for s in self.own}

    def rel(self, ns: int) -> float:
        return round((ns - self.t0) / 1e9, 9) if ns else 0.0

    def spans(self, name: str) -> list[Span]:
        return self.by_name.get(name, [])

    def total(self, name: str) -> float:
        return sum(s.duration_s for s in self.spans(name))

    # ---- decisions ------------------------------------------------------------------------

    def decision(self, s: Span) -> Decision:
        victim = _str(s.get("preemption.victim.request_id"))
        beneficiary = _str(s.get("preemption.beneficiary.request_id"))
        roles = {str(lk.attributes.get("link.role")) for lk in s.links if (lk.trace_id, lk.span_id) in self.own_keys}
        linked_from_own = {str(lk.attributes.get("link.role")) for o in self.own for lk in o.links
                           if (lk.trace_id, lk.span_id) == s.key}
        declined = s.name == PREEMPTION_DECLINED or s.get("preemption.declined") is True
        if declined:
            role = "beneficiary"
        elif victim == self.rid or "victim" in roles or "preempted_by" in linked_from_own:
            role = "victim"
        else:
            role = "beneficiary"
        mode = _str(s.get("preemption.mode"))
        return Decision(
            decision_id=_str(s.get("preemption.decision_id")), role=role, declined=declined, at_s=self.rel(s.start_ns),
            trigger=_str(s.get("preemption.trigger")), mode=None if declined and mode == "declined" else mode,
            declined_reason=_str(s.get("preemption.declined_reason")),
            victim_request_id=victim, victim_tier=_str(s.get("preemption.victim.tier")),
            victim_tenant=_str(s.get("preemption.victim.tenant")),
            beneficiary_request_id=beneficiary, beneficiary_tier=_str(s.get("preemption.beneficiary.tier")),
            beneficiary_tenant=_str(s.get("preemption.beneficiary.tenant")),
            blocks_freed=_int(s.get("preemption.blocks_freed")), bytes_moved=_int(s.get("preemption.bytes_moved")),
            estimated_cost_s=_float(s.get("preemption.estimated_cost_s")),
            kv_utilisation=_float(s.get("kv.utilisation")),
            running=_per_tier(s, "scheduler.running"), waiting=_per_tier(s, "scheduler.waiting"),
            trace_id=s.trace_id, span_id=s.span_id,
        )

    # ---- main -----------------------------------------------------------------------------

    def run(self) -> Explanation:
        decision_spans = sorted(self.sel.decisions, key=lambda s: s.start_ns)
        decisions = [self.decision(s) for s in decision_spans]
        by_key = {(d.trace_id, d.span_id): d for d in decisions}
        by_id = {d.decision_id: d for d in decisions if d.decision_id}

        causes: list[tuple[float, int, Cause]] = []

        def add(order: int, cause: Cause) -> None:
            causes.append((cause.at_s, order, cause))

        admit = self.spans(GATEWAY_ADMIT)[0] if self.spans(GATEWAY_ADMIT) else None
        tier_requested = _str(admit.get("admission.tier_requested")) if admit else None
        tier_granted = _str(admit.get("admission.tier_granted")) if admit else None

        # Quota.
        if admit is not None:
            quota = _str(admit.get("admission.quota"))
            asked = tier_requested or "P0"
            if quota == "downgraded":
                add(0, Cause(self.rel(admit.start_ns), "quota", f"{asked} quota spent: served as {tier_granted or '?'}",
                             detail={"tier_requested": tier_requested, "tier_granted": tier_granted}))
            elif quota == "refused":
                add(0, Cause(self.rel(admit.start_ns), "quota", f"{asked} quota spent: refused at admission",
                             detail={"tier_requested": tier_requested}))

        # Dispatches and re-dispatches.
        dispatches = self.spans(GATEWAY_DISPATCH)
        queues = self.spans(GATEWAY_QUEUE)
        workers: list[str] = []
        for i, d in enumerate(dispatches):
            worker = _str(d.get("dispatch.worker")) or "?"
            workers.append(worker)
            attempt = _int(d.get("dispatch.attempt")) or i + 1
            if i > 0 or attempt > 1:
                prev = workers[i - 1] if i > 0 else None
                requeue = [q for q in queues if (i == 0 or q.start_ns >= dispatches[i - 1].start_ns)
                           and q.start_ns <= d.start_ns]
                at = requeue[-1].start_ns if requeue and i > 0 else d.start_ns
                # Time between handing it to the previous worker and the lease expiring: lost work.
                lost = (at - dispatches[i - 1].end_ns) / 1e9 if i > 0 and requeue else None
                text = (f"lease expired on worker {prev}; attempt {attempt} on worker {worker}" if prev
                        else f"attempt {attempt} on worker {worker} (an earlier attempt's lease expired)")
                if lost is not None and lost > 0:
                    text += f" ({lost:.2f} s lost on {prev})"
                add(1, Cause(self.rel(at), "redispatch", text, lost,
                             detail={"attempt": attempt, "previous_worker": prev, "worker": worker}))
            if _str(d.get("dispatch.reason")) == "cheapest_preemption":
                add(5, Cause(self.rel(d.start_ns), "dispatch",
                             f"dispatched to worker {worker} with no free credit anywhere: it had the cheapest "
                             f"preemption", detail={"worker": worker, "attempt": attempt}))

        # Gateway queue waits and aging.
        for i, q in enumerate(queues):
            src = q if any(k.startswith("queue.ahead.") or k == "queue.position" for k in q.attributes) else \
                (admit if i == 0 and admit is not None else None)
            ahead = _per_tier(src, "queue.ahead") if src else {}
            position = _int(src.get("queue.position")) if src else None
            jobs = position if position is not None else (sum(ahead.values()) if ahead else None)
            verb = "queued" if i == 0 else "re-queued"
            dur = q.duration_s
            if jobs is None:
                text = f"{verb} {dur:.2f} s (jobs ahead not recorded)"
            elif jobs == 0 and not any(ahead.values()):
                text = f"{verb} {dur:.2f} s with no job ahead at admission (waiting for worker capacity)"
            else:
                breakdown = ", ".join(f"{t}: {n}" for t, n in ahead.items() if n)
                text = f"{verb} {dur:.2f} s behind {jobs} job{'s' if jobs != 1 else ''}" + \
                    (f" ({breakdown})" if breakdown else "")
            estimate = _float(admit.get("admission.estimated_wait_s")) if admit is not None and i == 0 else None
            if estimate:
                text += f"; estimated {estimate:.2f} s at admission"
            if dur >= self.min_wait_s or jobs:
                add(2, Cause(self.rel(q.start_ns), "queue", text, dur,
                             {"jobs_ahead": jobs, "ahead": ahead, "estimated_wait_s": estimate,
                              "tier": _str(q.get("queue.tier")), "tier_granted": _str(q.get("queue.tier_granted"))}))
            for ev in q.events:
                if ev.name == "aged":
                    frm, to = _str(ev.attributes.get("from_tier")), _str(ev.attributes.get("to_tier"))
                    at = self.rel(ev.time_ns)
                    add(3, Cause(at, "aging", f"aged {frm or '?'} -> {to or '?'} at +{at:.1f} s",
                                 detail={"from_tier": frm, "to_tier": to,
                                         "after_queued_s": round((ev.time_ns - q.start_ns) / 1e9, 9)}))

        # Worker queue waits (attempt i's worker from the dispatch that preceded it).
        for wq in self.spans(WORKER_QUEUE):
            if wq.duration_s < self.min_wait_s:
                continue
            worker = self._worker_at(dispatches, wq.start_ns)
            where = f"worker {worker}'s queue" if worker else "the worker's queue"
            add(4, Cause(self.rel(wq.start_ns), "worker_queue", f"waited {wq.duration_s:.2f} s in {where}",
                         wq.duration_s, {"worker": worker}))

        # Declined preemptions for this request (one entry per reason).
        declined: dict[str, list[Decision]] = {}
        for d in decisions:
            if d.declined and d.beneficiary_request_id in (None, self.rid):
                declined.setdefault(d.declined_reason or "reason not recorded", []).append(d)
        for reason, ds in declined.items():
            text = f"waited: no preemption possible ({reason})"
            if len(ds) > 1:
                text += f", {len(ds)} times"
            add(6, Cause(ds[0].at_s, "declined", text,
                         detail={"reason": reason, "count": len(ds), "decision_ids": [d.decision_id for d in ds],
                                 "trigger": ds[0].trigger}))

        # Suspended periods.
        suspensions: list[Suspension] = []
        used: set[tuple[str, str]] = set()
        for s in self.spans(WORKER_SUSPENDED):
            d = self._decision_for(s, decisions, by_key, by_id, used)
            if d is not None:
                used.add((d.trace_id, d.span_id))
            by = _str(s.get("suspend.by_request_id")) or (d.beneficiary_request_id if d else None)
            sus = Suspension(
                start_s=self.rel(s.start_ns), end_s=self.rel(s.end_ns), duration_s=s.duration_s,
                mode=_str(s.get("suspend.mode")) or (d.mode if d else None),
                by_request_id=by,
                by_tier=_str(s.get("suspend.by_tier")) or (d.beneficiary_tier if d else None),
                by_tenant=_str(s.get("suspend.by_tenant")) or (d.beneficiary_tenant if d else None),
                decision_id=_str(s.get("suspend.decision_id")) or (d.decision_id if d else None),
                trigger=_str(s.get("suspend.trigger")) or (d.trigger if d else None),
                decision=d)
            suspensions.append(sus)
            add(7, Cause(sus.start_s, "suspended", _suspension_text(sus, self.rid), sus.duration_s,
                         {"mode": sus.mode, "by_request_id": sus.by_request_id, "by_tier": sus.by_tier,
                          "by_tenant": sus.by_tenant, "decision_id": sus.decision_id, "trigger": sus.trigger,
                          "decision": asdict(d) if d else None}))

        # Decisions that preempted it but whose suspended period was not recorded,
        # and the ones that made room for it.
        for d in decisions:
            if d.declined or (d.trace_id, d.span_id) in used:
                continue
            if d.role == "victim":
                by = _who(d.beneficiary_request_id, d.beneficiary_tier, d.beneficiary_tenant)
                add(7, Cause(d.at_s, "preempted", f"preempted ({d.mode or '?'}) by {by}, decision "
                             f"{d.decision_id or '?'} (suspended period not recorded)", detail={"decision": asdict(d)}))
            elif d.victim_request_id and d.victim_request_id != self.rid:
                victim = _who(d.victim_request_id, d.victim_tier, d.victim_tenant)
                add(8, Cause(d.at_s, "preempting", f"preempted {victim} to get its slot, decision "
                             f"{d.decision_id or '?'} ({d.mode or '?'})", detail={"decision": asdict(d)}))

        # Totals.
        total = max(0.0, (self.t_end - self.t0) / 1e9)
        worker_queue = self.total(WORKER_QUEUE)
        queued = self.total(GATEWAY_QUEUE) + worker_queue
        suspended = self.total(WORKER_SUSPENDED)
        if self.spans(WORKER_REQUEST):
            running = self.total(WORKER_REQUEST) - worker_queue - suspended
        else:
            running = self.total(WORKER_PREFILL) + self.total(WORKER_DECODE) - suspended
        running = max(0.0, running)
        other = max(0.0, total - queued - running - suspended)

        tier = next((_str(s.get(REQUEST_TIER)) for s in self.own if s.get(REQUEST_TIER) is not None), None)
        tenant = next((_str(s.get(TENANT_ID)) for s in self.own if s.get(TENANT_ID) is not None), None)
        attempts = max([len(dispatches), len(self.spans(WORKER_REQUEST))]
                       + [_int(d.get("dispatch.attempt")) or 0 for d in dispatches])

        return Explanation(
            request_id=self.rid, trace_ids=self.sel.trace_ids, tier=tier, tenant=tenant,
            tier_requested=tier_requested, tier_granted=tier_granted, start_unix_ns=self.t0,
            total_s=round(total, 9), queued_s=round(queued, 9), running_s=round(running, 9),
            suspended_s=round(suspended, 9), other_s=round(other, 9), attempts=max(attempts, 1 if self.own else 0),
            workers=workers, blame=[c for _, _, c in sorted(causes, key=lambda x: (x[0], x[1]))],
            phases=self._phases(dispatches, suspensions), suspensions=suspensions, decisions=decisions)

    def _worker_at(self, dispatches: list[Span], ns: int) -> str | None:
        before = [d for d in dispatches if d.start_ns <= ns]
        return _str(before[-1].get("dispatch.worker")) if before else None

    def _decision_for(self, s: Span, decisions: list[Decision], by_key: dict, by_id: dict,
                      used: set) -> Decision | None:
        did = _str(s.get("suspend.decision_id"))
        if did and did in by_id:
            return by_id[did]
        for lk in s.links:
            if (lk.trace_id, lk.span_id) in by_key:
                return by_key[(lk.trace_id, lk.span_id)]
        # Nearest taken decision against this request at (or just before) the suspension.
        start = self.rel(s.start_ns)
        cands = [d for d in decisions if d.role == "victim" and not d.declined and (d.trace_id, d.span_id) not in used
                 and d.at_s <= start + 0.001]
        return max(cands, key=lambda d: d.at_s) if cands else None

    def _phases(self, dispatches: list[Span], suspensions: list[Suspension]) -> list[Phase]:
        out: list[Phase] = []
        starts = [d.start_ns for d in dispatches]
        chunk = 0
        for s in self.own:
            phase = PHASES.get(s.name)
            if phase is None or phase == "suspended":
                continue
            attempt = max(1, sum(1 for t in starts if t <= s.start_ns)) if phase != "queue" else \
                max(1, sum(1 for t in starts if t < s.start_ns) + 1)
            if phase == "queue":
                label = _str(s.get("queue.tier")) or ""
            elif phase == "dispatch":
                label = _str(s.get("dispatch.worker")) or ""
            elif phase == "prefill":
                chunk += 1
                label = f"chunk {chunk}"
            else:
                label = ""
            out.append(Phase(phase, self.rel(s.start_ns), self.rel(s.end_ns), label, attempt))
        for sus in suspensions:
            label = f"by {sus.by_request_id}" + (f" ({sus.by_tier})" if sus.by_tier else "") \
                if sus.by_request_id else (sus.mode or "suspended")
            attempt = max(1, sum(1 for t in starts if self.rel(t) <= sus.start_s))
            out.append(Phase("suspended", sus.start_s, sus.end_s, label, attempt))
        return out


def _who(request_id: str | None, tier: str | None, tenant: str | None) -> str:
    if not request_id:
        return "an unrecorded request"
    inner = ", ".join(x for x in (tier, f"tenant {tenant}" if tenant else None) if x)
    return f"request {request_id}" + (f" ({inner})" if inner else "")


def _suspension_text(s: Suspension, rid: str) -> str:
    head = f"suspended {s.duration_s:.2f} s ({s.mode or 'mode not recorded'})"
    if s.trigger == "manual" or (s.by_request_id == rid):
        by = " by an operator (manual suspend)"
    elif s.by_request_id:
        by = " by " + _who(s.by_request_id, s.by_tier, s.by_tenant)
    else:
        by = ", cause not recorded"
    tail = f", decision {s.decision_id}" if s.decision_id else ""
    if s.trigger and s.trigger != "manual":
        tail += f", trigger {s.trigger}"
    return head + by + tail
