"""The blame chain's preemption side: the decisions about the request (as victim or beneficiary), the preemptions
declined for it and its suspended periods (a mixin of common.traces.analysis._Analyser)."""

from __future__ import annotations

from dataclasses import asdict

from common.traces.model import Cause, Decision, Suspension
from common.traces.schema import PREEMPTION_DECLINED, WORKER_SUSPENDED, attr_float, attr_int, attr_str, per_tier
from common.traces.spans import Span


class PreemptionCauses:
    """Needs the analyser's ``rid``, ``own``, ``own_keys``, ``rel`` and ``spans``; each method adds its causes through
    ``add``."""

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

    def _declined_causes(self, decisions: list[Decision], add) -> None:
        """Declined preemptions for this request (one entry per reason)."""
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

    def _suspension_causes(self, decisions: list[Decision], add) -> list[Suspension]:
        """Its suspended periods, each with the decision behind it; then the decisions that preempted it whose
        suspended period was not recorded, and the ones that made room for it."""
        by_key = {(d.trace_id, d.span_id): d for d in decisions}
        by_id = {d.decision_id: d for d in decisions if d.decision_id}
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
        return suspensions

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
