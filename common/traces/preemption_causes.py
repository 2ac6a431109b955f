"""The blame chain's preemption side: the decisions about the request (as victim or beneficiary), the preemptions
declined for it and its suspended periods (a mixin of common.traces.analysis._Analyser)."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import asdict

from common.traces.model import Cause, Decision, Suspension, Taking
from common.traces.schema import PREEMPTION_DECLINED, WORKER_SUSPENDED, attr_float, attr_int, attr_str, per_tier
from common.traces.spans import Span

# A suspended span's decisions told one by one up to this many; past it they are counted (a hostile or buggy producer
# may write a list of any length).
MAX_TAKINGS = 64


class PreemptionCauses:
    """Needs the analyser's ``rid``, ``own_keys``, ``own_link_roles``, ``rel`` and ``spans``; each method adds its
    causes through ``add``."""

    def decision(self, s: Span) -> Decision:
        victim = attr_str(s.get("preemption.victim.request_id"))
        beneficiary = attr_str(s.get("preemption.beneficiary.request_id"))
        roles = {str(lk.attributes.get("link.role")) for lk in s.links if (lk.trace_id, lk.span_id) in self.own_keys}
        linked_from_own = self.own_link_roles.get(s.key, set())
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
        unnamed = VictimDecisions(decisions)
        for s in self.spans(WORKER_SUSPENDED):
            d = self._decision_for(s, unnamed, by_key, by_id, used)
            if d is not None:
                used.add((d.trace_id, d.span_id))
            by = attr_str(s.get("suspend.by_request_id")) or (d.beneficiary_request_id if d else None)
            last = Taking(
                decision_id=attr_str(s.get("suspend.decision_id")) or (d.decision_id if d else None),
                by_request_id=by,
                by_tier=attr_str(s.get("suspend.by_tier")) or (d.beneficiary_tier if d else None),
                by_tenant=attr_str(s.get("suspend.by_tenant")) or (d.beneficiary_tenant if d else None),
                mode=attr_str(s.get("suspend.mode")) or (d.mode if d else None),
                trigger=attr_str(s.get("suspend.trigger")) or (d.trigger if d else None),
                at_s=d.at_s if d else None, decision=d)
            takings, untold = _takings(s, last, by_id)
            used.update((t.decision.trace_id, t.decision.span_id) for t in takings if t.decision is not None)
            used.update((by_id[i].trace_id, by_id[i].span_id) for i in _ids(s) if i in by_id)
            sus = Suspension(
                start_s=self.rel(s.start_ns), end_s=self.rel(s.end_ns), duration_s=s.duration_s,
                mode=last.mode, by_request_id=last.by_request_id, by_tier=last.by_tier, by_tenant=last.by_tenant,
                decision_id=last.decision_id, trigger=last.trigger, decision=d, takings=takings)
            suspensions.append(sus)
            detail = {"mode": sus.mode, "by_request_id": sus.by_request_id, "by_tier": sus.by_tier,
                      "by_tenant": sus.by_tenant, "decision_id": sus.decision_id, "trigger": sus.trigger,
                      "decision": asdict(d) if d else None, "takings": [asdict(t) for t in takings]}
            if untold:
                detail["takings_untold"] = untold
            add(7, Cause(sus.start_s, "suspended", _suspension_text(sus, self.rid, untold), sus.duration_s, detail))

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

    def _decision_for(self, s: Span, unnamed: VictimDecisions, by_key: dict, by_id: dict,
                      used: set) -> Decision | None:
        did = attr_str(s.get("suspend.decision_id"))
        if did and did in by_id:
            return by_id[did]
        for lk in s.links:
            if (lk.trace_id, lk.span_id) in by_key:
                return by_key[(lk.trace_id, lk.span_id)]
        # Nearest taken decision against this request at (or just before) the suspension.
        return unnamed.latest(self.rel(s.start_ns) + 0.001, used)


class VictimDecisions:
    """The taken decisions against the request, for the suspended spans that name none (no suspend.decision_id, no
    link to one: an old or hostile producer): the latest at or before a time that no suspended period has used yet,
    the first in ``decisions`` of those at that time (what max() over a scan of them all picked).

    Invariant: ``_left[j] <= j`` and every position in (``_left[j]``, j] holds a used decision, so a walk to the left
    skips each used one once (path compression); ``used`` only grows. An answer costs a bisection and that walk,
    O(log n) amortised: the scan of every decision for each suspended span took minutes for a request suspended
    20,000 times that way."""

    def __init__(self, decisions: list[Decision]) -> None:
        order = sorted((i for i, d in enumerate(decisions) if d.role == "victim" and not d.declined),
                       key=lambda i: (decisions[i].at_s, -i))  # at one time, the first in the list comes last
        self._ds = [decisions[i] for i in order]
        self._times = [d.at_s for d in self._ds]
        self._left = list(range(len(self._ds)))

    def latest(self, until_s: float, used: set[tuple[str, str]]) -> Decision | None:
        """The last decision at or before ``until_s`` whose (trace id, span id) is not in ``used``; None if none."""
        j = bisect_right(self._times, until_s) - 1
        walked = []
        while j >= 0:
            if self._left[j] != j:
                walked.append(j)
                j = self._left[j]
                continue
            d = self._ds[j]
            if (d.trace_id, d.span_id) not in used:
                break
            walked.append(j)
            j -= 1
        for k in walked:
            self._left[k] = j
        return self._ds[j] if j >= 0 else None



def _ids(s: Span) -> list[str | None]:
    """A list attribute of a suspended span (suspend.decision_ids), however it came: a lone value is a list of one."""
    return _str_list(s.get("suspend.decision_ids"))


def _str_list(v) -> list[str | None]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [attr_str(x) if not isinstance(x, (list, dict)) else None for x in v]
    return [attr_str(v) if not isinstance(v, dict) else None]


def _takings(s: Span, last: Taking, by_id: dict[str, Decision]) -> tuple[list[Taking], int]:
    """Every decision that took from the request in this suspended period, in order, and how many past MAX_TAKINGS
    were left untold. A span without the lists (one written before them) names one: ``last``, the single-valued
    attributes'. The lists name the rest by id and beneficiary alone; their tier, tenant, mode and trigger come
    from the decision spans found (or, for the last, from the single-valued attributes)."""
    ids, bys = _ids(s), _str_list(s.get("suspend.by_request_ids"))
    if not ids and not bys:
        return ([last] if last.decision_id or last.by_request_id or last.decision else []), 0
    n = max(len(ids), len(bys))
    if last.decision_id and last.decision_id not in ids:
        # The ids leave out the decision the single-valued attributes name: it came last (the longer list's last).
        n += len(ids) >= n
        ids, bys = ids + [None] * (n - 1 - len(ids)) + [last.decision_id], bys + [None] * (n - len(bys))
    out: list[Taking] = []
    for i in [*range(min(n, MAX_TAKINGS) - 1), n - 1]:  # the last is always told: it set the mode it waited in
        did = ids[i] if i < len(ids) else None
        d = by_id.get(did) if did else None
        if i == n - 1 and (did is None or did == last.decision_id):
            out.append(Taking(did or last.decision_id, (bys[i] if i < len(bys) else None) or last.by_request_id,
                              last.by_tier if d is None else d.beneficiary_tier or last.by_tier,
                              last.by_tenant if d is None else d.beneficiary_tenant or last.by_tenant,
                              last.mode if d is None else d.mode or last.mode,
                              last.trigger if d is None else d.trigger or last.trigger,
                              d.at_s if d else last.at_s, d or last.decision))
            continue
        by = (bys[i] if i < len(bys) else None) or (d.beneficiary_request_id if d else None)
        out.append(Taking(did, by, d.beneficiary_tier if d else None, d.beneficiary_tenant if d else None,
                          d.mode if d else None, d.trigger if d else None, d.at_s if d else None, d))
    return out, n - len(out)


def _who(request_id: str | None, tier: str | None, tenant: str | None) -> str:
    if not request_id:
        return "an unrecorded request"
    inner = ", ".join(x for x in (tier, f"tenant {tenant}" if tenant else None) if x)
    return f"request {request_id}" + (f" ({inner})" if inner else "")


def _suspension_text(s: Suspension, rid: str, untold: int = 0) -> str:
    head = f"suspended {s.duration_s:.2f} s ({s.mode or 'mode not recorded'})"
    if len(s.takings) > 1:
        told = [_taking_text(t, rid, s.start_s) for t in s.takings]
        if untold:
            told.insert(-1, f"{untold} more decision{'s' if untold != 1 else ''} not told")
        return f"{head} by {len(s.takings) + untold} decisions in turn: " + "; then ".join(told)
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


def _taking_text(t: Taking, rid: str, start_s: float) -> str:
    if t.trigger == "manual" or t.by_request_id == rid:
        who = "an operator (manual suspend)"
    else:
        who = _who(t.by_request_id, t.by_tier, t.by_tenant)
    how = ", ".join(x for x in (t.mode or "mode not recorded", f"trigger {t.trigger}" if t.trigger else None) if x)
    # A decision of a later step than the one that suspended it (its blocks taken while it waited).
    when = f" at +{t.at_s:.2f} s" if t.at_s is not None and t.at_s - start_s >= 0.005 else ""
    return f"{who}, decision {t.decision_id or '?'} ({how}){when}"
