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

from collections.abc import Iterable
from dataclasses import asdict

from common.traces import accounting
from common.traces.clocks import clock_offsets, on_redis_clock
from common.traces.missing import missing_spans
from common.traces.model import Cause, Decision, Explanation, NoSchedulingSpans, Phase, Suspension
from common.traces.schema import (GATEWAY_ADMIT, GATEWAY_DEAD_LETTER, GATEWAY_DISPATCH, GATEWAY_QUEUE, PHASES,
                                  PREEMPTION_DECLINED, REQUEST_ID, REQUEST_TIER, SCHEDULING_SPANS, SDK_SUBMIT,
                                  STEP_BEFORE_END, STEP_BEFORE_REQUESTS, STEP_BEFORE_START, STEP_BEFORE_TOKENS,
                                  TENANT_ID, WORKER_DECODE, WORKER_PREFILL, WORKER_QUEUE, WORKER_REQUEST,
                                  WORKER_SUSPENDED, attr_float, attr_int, attr_str, per_tier)
from common.traces.select import RequestSpans, select_request_spans
from common.traces.spans import Span


def explain_request(spans: Iterable[Span], request_id: str, *, fallback_all: bool = False,
                    min_wait_s: float = 0.005) -> Explanation:
    """Explain one request. Raises NoSchedulingSpans when there is nothing to explain."""
    sel = select_request_spans(on_redis_clock(spans), request_id, fallback_all=fallback_all)
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
        mine = [s for s in self.own if s.start_ns > 0 and (attr_str(s.get(REQUEST_ID)) == self.rid
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
        victim = attr_str(s.get("preemption.victim.request_id"))
        beneficiary = attr_str(s.get("preemption.beneficiary.request_id"))
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
        mode = attr_str(s.get("preemption.mode"))
        return Decision(
            decision_id=attr_str(s.get("preemption.decision_id")), role=role, declined=declined,
            at_s=self.rel(s.start_ns),
            trigger=attr_str(s.get("preemption.trigger")), mode=None if declined and mode == "declined" else mode,
            declined_reason=attr_str(s.get("preemption.declined_reason")),
            victim_request_id=victim, victim_tier=attr_str(s.get("preemption.victim.tier")),
            victim_tenant=attr_str(s.get("preemption.victim.tenant")),
            beneficiary_request_id=beneficiary, beneficiary_tier=attr_str(s.get("preemption.beneficiary.tier")),
            beneficiary_tenant=attr_str(s.get("preemption.beneficiary.tenant")),
            blocks_freed=attr_int(s.get("preemption.blocks_freed")),
            bytes_moved=attr_int(s.get("preemption.bytes_moved")),
            estimated_cost_s=attr_float(s.get("preemption.estimated_cost_s")),
            kv_utilisation=attr_float(s.get("kv.utilisation")),
            running=per_tier(s, "scheduler.running"), waiting=per_tier(s, "scheduler.waiting"),
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

        # Dispatches and re-dispatches.
        dispatches = self.spans(GATEWAY_DISPATCH)
        queues = self.spans(GATEWAY_QUEUE)
        workers: list[str] = []
        for i, d in enumerate(dispatches):
            worker = attr_str(d.get("dispatch.worker")) or "?"
            workers.append(worker)
            attempt = attr_int(d.get("dispatch.attempt")) or i + 1
            if i > 0 or attempt > 1:
                prev = workers[i - 1] if i > 0 else None
                requeue = [q for q in queues if (i == 0 or q.start_ns >= dispatches[i - 1].start_ns)
                           and q.start_ns <= d.start_ns]
                at = requeue[-1].start_ns if requeue and i > 0 else d.start_ns
                # A draining worker hands its job back (gateway.dispatch says so since it can): its time on that
                # worker is in its worker.request span, and the next attempt goes on from its tokens.
                released = attr_str(d.get("dispatch.requeue_cause")) == "released"
                prev = prev or attr_str(d.get("dispatch.lost_worker"))
                # Time between handing it to the previous worker and the lease expiring: lost work, but for its run
                # up to the last token this attempt resumed with (written to the token log then), which was kept.
                lost = (at - dispatches[i - 1].end_ns) / 1e9 if i > 0 and requeue and not released else None
                resumed = attr_int(d.get("dispatch.resumed_tokens"))
                last_ms = attr_int(d.get("dispatch.last_kept_token_ms"))
                kept_s = None
                if lost is not None and resumed and last_ms:
                    kept_s = min(lost, max(0.0, (last_ms * 1_000_000 - dispatches[i - 1].end_ns) / 1e9))
                    lost -= kept_s
                if released:
                    text = (f"worker {prev or '?'} handed it back (shutting down); attempt {attempt} on worker "
                            f"{worker}")
                elif prev:
                    text = f"lease expired on worker {prev}; attempt {attempt} on worker {worker}"
                else:
                    text = f"attempt {attempt} on worker {worker} (an earlier attempt's lease expired)"
                said = [f"{resumed} token{'s' if resumed != 1 else ''} kept"
                        + (f": {kept_s:.2f} s of its run on {prev}" if kept_s else "")] if resumed else []
                if lost is not None and lost > 0:
                    said.append(f"{lost:.2f} s lost on {prev}")
                if said:
                    text += f" ({'; '.join(said)})"
                detail = {"attempt": attempt, "previous_worker": prev, "worker": worker,
                          "cause": "released" if released else "lease_expired"}
                if resumed is not None:
                    detail |= {"kept_tokens": resumed, "kept_s": None if kept_s is None else round(kept_s, 9)}
                add(1, Cause(self.rel(at), "redispatch", text, lost, detail=detail))
            if attr_str(d.get("dispatch.reason")) == "cheapest_preemption":
                add(5, Cause(self.rel(d.start_ns), "dispatch",
                             f"dispatched to worker {worker} with no free credit anywhere: it had the cheapest "
                             f"preemption", detail={"worker": worker, "attempt": attempt}))

        self._dead_letter_causes(dispatches, add)

        # Gateway queue waits and aging.
        for i, q in enumerate(queues):
            src = q if any(k.startswith("queue.ahead.") or k == "queue.position" for k in q.attributes) else \
                (admit if i == 0 and admit is not None else None)
            ahead = per_tier(src, "queue.ahead") if src else {}
            position = attr_int(src.get("queue.position")) if src else None
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
            estimate = attr_float(admit.get("admission.estimated_wait_s")) if admit is not None and i == 0 else None
            if estimate:
                text += f"; estimated {estimate:.2f} s at admission"
            outcome = attr_str(q.get("queue.outcome"))  # it left the queue undispatched (gateway.spans.left_queue)
            if outcome == "expired":
                text += "; then expired: its queue timeout ran out"
            elif outcome:
                text += f"; then {outcome} while queued"
            if dur >= self.min_wait_s or jobs or outcome:
                add(2, Cause(self.rel(q.start_ns), "queue", text, dur,
                             {"jobs_ahead": jobs, "ahead": ahead, "estimated_wait_s": estimate, "outcome": outcome,
                              "tier": attr_str(q.get("queue.tier")),
                              "tier_granted": attr_str(q.get("queue.tier_granted"))}))
            for ev in q.events:
                if ev.name == "aged":
                    frm, to = attr_str(ev.attributes.get("from_tier")), attr_str(ev.attributes.get("to_tier"))
                    at = self.rel(ev.time_ns)
                    add(3, Cause(at, "aging", f"aged {frm or '?'} -> {to or '?'} at +{at:.1f} s",
                                 detail={"from_tier": frm, "to_tier": to,
                                         "after_queued_s": round((ev.time_ns - q.start_ns) / 1e9, 9)}))
                elif ev.name == "promised start":  # gateway/promises.py: no newer job went first from then on
                    at = self.rel(ev.time_ns)
                    add(3, Cause(at, "promise", f"its promised start fell due at +{at:.1f} s: moved to P2, ahead of "
                                 "every P2 admitted after it", detail={
                                     "to_tier": attr_str(ev.attributes.get("to_tier")),
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
            by = attr_str(s.get("suspend.by_request_id")) or (d.beneficiary_request_id if d else None)
            sus = Suspension(
                start_s=self.rel(s.start_ns), end_s=self.rel(s.end_ns), duration_s=s.duration_s,
                mode=attr_str(s.get("suspend.mode")) or (d.mode if d else None),
                by_request_id=by,
                by_tier=attr_str(s.get("suspend.by_tier")) or (d.beneficiary_tier if d else None),
                by_tenant=attr_str(s.get("suspend.by_tenant")) or (d.beneficiary_tenant if d else None),
                decision_id=attr_str(s.get("suspend.decision_id")) or (d.decision_id if d else None),
                trigger=attr_str(s.get("suspend.trigger")) or (d.trigger if d else None),
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
            # Only the waits inside a worker.request found: a worker killed -9 exported its lost attempt's queue
            # wait but never its worker.request, and that wait taken off the next attempt's running was told twice.
            inside = [s for s in self.spans(WORKER_QUEUE) + self.spans(WORKER_SUSPENDED) if self._in_request(s)]
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

    def _dead_letter_causes(self, dispatches: list[Span], add) -> None:
        """Its last allowed attempt lost its lease: the job was dead-lettered (no next dispatch tells of it)."""
        for s in self.spans(GATEWAY_DEAD_LETTER):
            before = [d for d in dispatches if d.end_ns <= s.start_ns]
            worker = attr_str(s.get("dead_letter.lost_worker")) or \
                (attr_str(before[-1].get("dispatch.worker")) if before else None)
            attempt = attr_int(s.get("dead_letter.attempt"))
            cause = attr_str(s.get("dead_letter.cause")) or "lease_expired"
            lost = (s.start_ns - before[-1].end_ns) / 1e9 if before else None
            how = "handed back by" if cause == "released" else "lease expired on"
            text = f"{how} worker {worker or '?'}" + (f" (attempt {attempt})" if attempt else "") + \
                ": dead-lettered, no attempt left"
            if attr_str(s.get("dead_letter.reason")):
                text += f" ({s.get('dead_letter.reason')})"
            if lost is not None and lost > 0:
                text += f"; {lost:.2f} s lost on {worker or '?'}"
            add(1, Cause(self.rel(s.start_ns), "dead_letter", text, lost,
                         {"attempt": attempt, "worker": worker, "cause": cause,
                          "reason": attr_str(s.get("dead_letter.reason"))}))

    def _to_worker_causes(self, dispatches: list[Span], add) -> None:
        """A hand-over to a worker that took a while: the step the worker was running when the job came."""
        for w in self.spans(WORKER_REQUEST):
            before = [d for d in dispatches if d.end_ns <= w.start_ns]
            if not before:
                continue
            gap = (w.start_ns - before[-1].end_ns) / 1e9
            if gap < self.min_wait_s:
                continue
            worker = attr_str(before[-1].get("dispatch.worker")) or "?"
            text = f"reached worker {worker} {gap:.3f} s after dispatch"
            step_end = attr_int(w.get(STEP_BEFORE_END))
            detail = {"worker": worker, "step_requests": attr_int(w.get(STEP_BEFORE_REQUESTS)),
                      "step_tokens": attr_int(w.get(STEP_BEFORE_TOKENS))}
            if step_end is not None and step_end > before[-1].end_ns:
                step_start = attr_int(w.get(STEP_BEFORE_START)) or step_end
                detail["step_s"] = (step_end - step_start) / 1e9
                text += (f": it was running a step ({detail['step_requests']} requests, {detail['step_tokens']} "
                         f"tokens, {detail['step_s']:.3f} s) and reads new jobs between steps")
            add(4, Cause(self.rel(before[-1].end_ns), "to_worker", text, gap, detail))

    def _in_request(self, s: Span) -> bool:
        """Whether ``s`` lies in one of the request's worker.request spans found (its parent, or its interval)."""
        return any(s.parent_span_id == w.span_id or w.start_ns <= s.start_ns <= s.end_ns <= w.end_ns
                   for w in self.spans(WORKER_REQUEST) if w.trace_id == s.trace_id)

    def _worker_at(self, dispatches: list[Span], ns: int) -> str | None:
        before = [d for d in dispatches if d.start_ns <= ns]
        return attr_str(before[-1].get("dispatch.worker")) if before else None

    def _decision_for(self, s: Span, decisions: list[Decision], by_key: dict, by_id: dict,
                      used: set) -> Decision | None:
        did = attr_str(s.get("suspend.decision_id"))
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
                label = attr_str(s.get("queue.tier")) or ""
            elif phase == "dispatch":
                label = attr_str(s.get("dispatch.worker")) or ""
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
