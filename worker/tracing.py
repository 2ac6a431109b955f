"""OpenTelemetry spans for the engine: one per request, one per suspended period, one per
preemption decision (taken or declined), linked to the requests it touched.

The scheduler stays free of OpenTelemetry: it emits ``PreemptionDecision`` records and the
engine hands each step's records here. The same events feed the Prometheus counters the
scheduler keeps none of (worker/metrics.py). Spans go to whatever tracer provider the process
installed (none: the API's no-op tracer, at almost no cost).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span

from common import tracing
from worker import metrics
from worker.preemption import PreemptionDecision
from worker.request import Request
from worker.scheduler import SchedulerOutput

TRACER_NAME = "tiered_serve.worker"


def request_attributes(req: Request) -> dict[str, str | int]:
    """Attributes every span of a request carries, so a trace backend can search by them."""
    return dict(tracing.request_attributes(req.request_id, req.tier.value, req.tenant))


def decision_attributes(d: PreemptionDecision) -> dict[str, str | int | float | bool]:
    a: dict[str, str | int | float | bool] = {
        "preemption.decision_id": d.decision_id,
        "preemption.trigger": d.trigger.value,
        "preemption.mode": d.mode.value if d.mode else "declined",
        "preemption.declined": d.declined,
        "preemption.beneficiary.request_id": d.beneficiary_id,
        "preemption.beneficiary.tier": d.beneficiary_tier.value,
        "preemption.victim_progress": d.victim_progress,
        "preemption.blocks_freed": d.blocks_freed,
        "preemption.bytes_moved": d.bytes_moved,
        "preemption.estimated_cost_s": d.estimated_cost_s,
        "scheduler.step": d.step,
        "kv.utilisation": d.kv_utilisation,
    }
    if d.declined_reason is not None:
        a["preemption.declined_reason"] = d.declined_reason.value
    if d.beneficiary_tenant is not None:
        a["preemption.beneficiary.tenant"] = d.beneficiary_tenant
    if d.victim_id is not None:
        a["preemption.victim.request_id"] = d.victim_id
        a["preemption.victim.tier"] = d.victim_tier.value
    if d.victim_tenant is not None:
        a["preemption.victim.tenant"] = d.victim_tenant
    for k, v in d.cost_inputs.items():
        a[f"preemption.cost.{k}"] = v
    for tier, n in d.running_per_tier.items():
        a[f"scheduler.running.{tier}"] = n
    for tier, n in d.waiting_per_tier.items():
        a[f"scheduler.waiting.{tier}"] = n
    return a


class EngineTracer:
    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self.tracer = tracer or trace.get_tracer(TRACER_NAME)
        self._requests: dict[str, Span] = {}
        self._suspended: dict[str, Span] = {}
        self._suspend_decisions: dict[str, list[PreemptionDecision]] = {}  # per open suspended span, in order
        self._queued: dict[str, Span] = {}  # added, not yet scheduled
        self._decoding: dict[str, Span] = {}  # from the first token to the end
        self._step_start_ns = 0
        # The last step: start and end (ns), requests and tokens. A job read now may have waited for it.
        self._last_step: tuple[int, int, int, int] | None = None

    def request_added(self, req: Request, parent: Context | None = None) -> None:
        """``parent``: the context the request arrived with (its trace), or None for a new trace."""
        attrs = request_attributes(req)
        attrs.update({"request.prompt_tokens": req.num_prompt_tokens, "request.max_tokens": req.params.max_tokens})
        if self._last_step is not None:  # what explain names as the hand-over's cause (common/traces/schema.py)
            start, end, requests, tokens = self._last_step
            attrs.update({"worker.step_before.start_unix_ns": start, "worker.step_before.end_unix_ns": end,
                          "worker.step_before.requests": requests, "worker.step_before.tokens": tokens})
        span = self.tracer.start_span("worker.request", context=parent, attributes=attrs)
        self._requests[req.request_id] = span
        self._queued[req.request_id] = self.tracer.start_span(
            "worker.queue", context=trace.set_span_in_context(span), attributes=request_attributes(req))

    def step_finished(self, out: SchedulerOutput) -> None:
        """After the forward pass: a span per prefill chunk, and decode spans from the first token."""
        metrics.step_finished(out)
        end = time.time_ns()
        self._last_step = (self._step_start_ns, end, len(out.chunks), out.num_batched_tokens)
        for chunk in out.chunks:
            req = chunk.request
            parent = self._requests.get(req.request_id)
            if parent is None:
                continue
            ctx = trace.set_span_in_context(parent)
            if chunk.start < req.num_prompt_tokens:
                span = self.tracer.start_span("worker.prefill", context=ctx, start_time=self._step_start_ns,
                                              attributes=request_attributes(req) | {
                                                  "prefill.start": chunk.start, "prefill.tokens": chunk.num_tokens,
                                                  "scheduler.batch_tokens": out.num_batched_tokens})
                span.end(end_time=end)
            if chunk.sample and req.request_id not in self._decoding and not req.is_finished:
                self._decoding[req.request_id] = self.tracer.start_span(
                    "worker.decode", context=ctx, start_time=end, attributes=request_attributes(req))

    def request_finished(self, req: Request) -> None:
        metrics.request_finished(req)
        for table in (self._queued, self._decoding):
            span = table.pop(req.request_id, None)
            if span is not None:
                span.set_attribute("request.output_tokens", len(req.output_token_ids))
                span.end()
        self._end_suspended(req.request_id)
        span = self._requests.pop(req.request_id, None)
        if span is None:
            return
        span.set_attributes({
            "request.finish_reason": req.finish_reason.value if req.finish_reason else "",
            "request.output_tokens": len(req.output_token_ids),
            "request.preemptions": req.num_preemptions,
            "request.suspended_s": req.suspended_total_s,
        })
        span.end()

    def step_scheduled(self, out: SchedulerOutput, live: Mapping[str, Request]) -> None:
        self._step_start_ns = time.time_ns()
        for chunk in out.chunks:
            queued = self._queued.pop(chunk.request.request_id, None)
            if queued is not None:
                queued.end(end_time=self._step_start_ns)
        decision_spans = {d.decision_id: self._decision_span(d) for d in out.decisions}
        # A request can give way twice in one step (its slot to one request, then its blocks to another):
        # its suspended span names every decision, not just the last.
        by_victim: dict[str, list[PreemptionDecision]] = {}
        for d in out.decisions:
            if d.victim_id and not d.declined:
                by_victim.setdefault(d.victim_id, []).append(d)
        for req in out.preempted:
            if req.request_id not in live:
                continue  # suspended by hand, then aborted before this step: its request span is closed
            ds = by_victim.pop(req.request_id, [])
            self._start_suspended(req, ds, [decision_spans[d.decision_id] for d in ds])
        for rid, ds in by_victim.items():  # already suspended (keep), now giving up its blocks too
            if rid in self._suspended and rid in live:
                self._more_decisions(live[rid], ds, [decision_spans[d.decision_id] for d in ds])
        for chunk in out.chunks:
            if chunk.request.request_id in self._suspended:
                self._end_suspended(chunk.request.request_id)
                metrics.resumed(chunk.request)

    def _decision_span(self, d: PreemptionDecision) -> Span:
        links = []
        for rid, role in ((d.victim_id, "victim"), (d.beneficiary_id, "beneficiary")):
            span = self._requests.get(rid) if rid else None
            if span is not None and not (role == "beneficiary" and rid == d.victim_id):  # a manual suspend
                links.append(Link(span.get_span_context(), {"link.role": role}))
        parent = self._requests.get(d.beneficiary_id)
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        name = "scheduler.preemption_declined" if d.declined else "scheduler.preemption"
        span = self.tracer.start_span(name, context=ctx, links=links, attributes=decision_attributes(d))
        span.end()
        victim = self._requests.get(d.victim_id) if d.victim_id else None
        if victim is not None and hasattr(victim, "add_link"):
            # The victim's own span points back at the decision, so its trace shows who preempted it.
            victim.add_link(span.get_span_context(), {"link.role": "preempted_by"})
        return span

    def _start_suspended(self, req: Request, ds: list[PreemptionDecision], decisions: list[Span]) -> None:
        parent = self._requests.get(req.request_id)
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        attrs = request_attributes(req) | _suspend_attributes(req, ds)
        links = [Link(span.get_span_context()) for span in decisions]
        self._suspended[req.request_id] = self.tracer.start_span("worker.suspended", context=ctx, links=links,
                                                                 attributes=attrs)
        self._suspend_decisions[req.request_id] = list(ds)

    def _more_decisions(self, req: Request, ds: list[PreemptionDecision], decisions: list[Span]) -> None:
        span = self._suspended[req.request_id]
        every = self._suspend_decisions.setdefault(req.request_id, [])
        every.extend(ds)
        attrs = _suspend_attributes(req, every)
        attrs.setdefault("suspend.by_tenant", "")  # not the tenant of an earlier decision's beneficiary
        span.set_attributes(attrs)
        if hasattr(span, "add_link"):
            for d in decisions:
                span.add_link(d.get_span_context())

    def _end_suspended(self, request_id: str) -> None:
        self._suspend_decisions.pop(request_id, None)
        span = self._suspended.pop(request_id, None)
        if span is not None:
            span.end()


def _suspend_attributes(req: Request, ds: list[PreemptionDecision]) -> dict[str, str | list[str]]:
    """A suspended span's cause. A request can give way more than once while suspended (its slot to one request,
    then its blocks to another, in that step or a later one): the single-valued attributes (what explain reads)
    name the last decision, the one that set the mode it waits in; the lists name every one, in order."""
    attrs: dict[str, str | list[str]] = {"suspend.mode": req.preempt_mode or ""}
    if ds:
        d = ds[-1]
        attrs.update({"suspend.decision_id": d.decision_id, "suspend.by_request_id": d.beneficiary_id,
                      "suspend.by_tier": d.beneficiary_tier.value, "suspend.trigger": d.trigger.value,
                      "suspend.decision_ids": [x.decision_id for x in ds],
                      "suspend.by_request_ids": [x.beneficiary_id for x in ds]})
        if d.beneficiary_tenant:
            attrs["suspend.by_tenant"] = d.beneficiary_tenant
    return attrs
