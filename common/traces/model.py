"""What explain concludes about one request: the explanation and its parts (pure data, with its text)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.traces.clocks import clock_text


# Queued time told apart from JobResult.queued_s past this: they differ by the hand-offs (a few ms) always.
WAITS_DIFFER_S = 0.05


class NoSchedulingSpans(LookupError):
    """No trace of the request, or its traces hold none of the scheduling spans. ``named_by``: the preemption
    decisions that name it all the same (its own spans rotated away, or never exported), each a dict of decision_id,
    role, trace_id and span_id."""

    def __init__(self, request_id: str, trace_ids: Iterable[str] = (), named_by: Iterable[dict] = ()) -> None:
        self.request_id = request_id
        self.trace_ids = sorted(trace_ids)
        self.named_by = list(named_by)
        where = f" (traces {', '.join(self.trace_ids)})" if self.trace_ids else " (no trace carries it)"
        text = f"no scheduling spans for request {request_id}{where}"
        if self.named_by:
            shown = [f"{d['decision_id'] or 'span ' + d['span_id']} (as {d['role']}, trace {d['trace_id']})"
                     for d in self.named_by[:3]]
            more = f" and {len(self.named_by) - 3} more" if len(self.named_by) > 3 else ""
            text += (f"; it is named only by preemption decisions: {', '.join(shown)}{more}. Its "
                     "own spans are not in the input (rotated away, or never exported)")
        super().__init__(text)


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
class Taking:
    """One decision that took from a suspended request (its slot, its blocks), as its ``worker.suspended`` span
    names it; the decision span's own attributes where found."""

    decision_id: str | None
    by_request_id: str | None
    by_tier: str | None
    by_tenant: str | None
    mode: str | None
    trigger: str | None
    at_s: float | None  # the decision span's start, where found
    decision: Decision | None


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
    # Every decision that took from it, in order (the fields above are the last one's, which set its mode): its slot
    # to one request, then its blocks to another, in that step or a later one. One for a span of one decision.
    takings: list[Taking] = field(default_factory=list)


@dataclass(frozen=True)
class Cause:
    """One entry of the blame chain: a wait (or an event) and what caused it."""

    at_s: float  # seconds since the request's first span started
    # quota | queue | aging | promise | dispatch | redispatch | to_worker | worker_queue | declined | suspended
    # | preempted (a decision without a recorded suspended period) | preempting (it was the beneficiary)
    # | dead_letter (its last allowed attempt lost its lease)
    kind: str
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
    transit_s: float  # between the spans above, named in ``transit`` (common/traces/accounting.py)
    other_s: float  # what no span accounts for (transit names every gap it can: this should be ~0)
    attempts: int
    workers: list[str]
    blame: list[Cause]
    phases: list[Phase]
    suspensions: list[Suspension]
    decisions: list[Decision]
    transit: dict[str, float] = field(default_factory=dict)  # kind -> seconds: to_gateway, admission, ...
    # Spans the others show existed but the input lacks (common/traces/missing.py): the times leave out theirs.
    missing: list[str] = field(default_factory=list)
    # Admissions and dispatches whose gateway's wall clock was off Redis's, workers whose clock was behind it
    # (common/traces/clocks.py): at, attempt, service, offset_s (and worker, for a worker).
    clock_offsets: list[dict[str, Any]] = field(default_factory=list)
    # Admission to its first prefill (what JobResult.queued_s reports), None where its spans do not tell; not
    # queued_s, which also holds the worker's queue and every later attempt's waits.
    to_first_prefill_s: float | None = None
    # The attempt whose prefill to_first_prefill_s was measured to, where no span recorded the first one (a
    # re-dispatch's dispatch.first_prefill_ms): past 1, an earlier attempt's prefill may be missing (its worker killed
    # before exporting it), and to_first_prefill_s longer than JobResult.queued_s. None: the first prefill.
    to_first_prefill_attempt: int | None = None
    # Of running_s, a lost attempt's run up to the last token the next attempt resumed with (the re-dispatch's
    # dispatch.last_kept_token_ms): its worker, killed, exported no span of it, but its tokens were kept.
    kept_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        who = ", ".join(x for x in (self.tier, f"tenant {self.tenant}" if self.tenant else None) if x)
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in self.transit.items()
                          if v >= 0.005 and k != "other")
        return (f"request {self.request_id}" + (f" ({who})" if who else "")
                + f": total {self.total_s:.2f} s = queued {self.queued_s:.2f} s + running {self.running_s:.2f} s"
                + f" + suspended {self.suspended_s:.2f} s + in transit {self.transit_s:.2f} s"
                + (f" ({parts})" if parts else "")
                + f" + other {self.other_s:.2f} s")

    def render_text(self) -> str:
        lines = [self.summary(), f"trace {', '.join(self.trace_ids)}"]
        if self.missing:
            lines.append("incomplete: not in the input (a rotated spans file removed, beyond up.py's --spans-keep, or "
                         "a process that died before exporting them), so the times above may leave out what they held:")
            lines += [f"  - {m}" for m in self.missing]
        if self.to_first_prefill_s is not None and abs(self.to_first_prefill_s - self.queued_s) >= WAITS_DIFFER_S:
            lines.append(f"queued {self.queued_s:.2f} s in all (every gateway and worker queue, of {self.attempts} "
                         f"attempt{'s' if self.attempts != 1 else ''}); {self.to_first_prefill_s:.2f} s from "
                         "admission to its first prefill (JobResult.queued_s)")
        if self.to_first_prefill_s is not None and (self.to_first_prefill_attempt or 1) > 1:
            lines.append(f"first prefill found is attempt {self.to_first_prefill_attempt}'s: "
                         f"{self.to_first_prefill_s:.2f} s from admission; an earlier attempt's, if it ran, is not in "
                         "the input (its worker killed before exporting it), so JobResult.queued_s may be shorter")
        lines += clock_text(self.clock_offsets)
        if self.blame:
            lines.append("why:")
            for c in self.blame:
                lines.append(f"  {'+' + format(c.at_s, '.2f'):>8} s  {c.text}")
                takings = c.detail.get("takings") if c.kind == "suspended" else None
                if isinstance(takings, list) and len(takings) > 1:  # each decision of the period found, in order
                    found = [t["decision"] for t in takings if isinstance(t.get("decision"), dict)]
                else:
                    found = [c.detail.get("decision")] if c.kind == "suspended" else []
                lines += [" " * 14 + _decision_detail_text(d) for d in found if isinstance(d, dict)]
        else:
            lines.append("why: nothing held it up (no queueing, suspension or declined preemption recorded)"
                         + (" in the spans found" if self.missing else ""))
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
