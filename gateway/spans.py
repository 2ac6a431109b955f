"""The gateway's spans of a request: admission, queue wait and dispatch.

They join the trace the SDK started (W3C context in SubmitRequest.trace_context). The
admission span's context is stored with the job, so the queue and dispatch spans of
every attempt, made by whichever gateway dispatches, and the worker's spans after them,
stay in that one trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common import tracing
from common.protocol import SubmitRequest
from common.tiers import ALL_TIERS, Tier
from gateway import metrics

TRACER_NAME = "tiered_serve.gateway"


class GatewaySpans:
    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self.tracer = tracer or trace.get_tracer(TRACER_NAME)

    @contextmanager
    def admission(self, req: SubmitRequest) -> Iterator[trace.Span]:
        with self.tracer.start_as_current_span("gateway.admit", context=tracing.context_from(req.trace_context),
                                               kind=SpanKind.SERVER, record_exception=False) as span:
            yield span

    @staticmethod
    def refused(span: trace.Span, code: str, message: str) -> None:
        span.set_attributes({"admission.refused": code, "admission.quota": "refused" if code == "quota_exceeded"
                             else "none"})
        span.set_status(Status(StatusCode.ERROR, message))

    @staticmethod
    def admitted(span: trace.Span, job_id: str, tenant: str, tier_requested: Tier, tier: Tier,
                 quota_applies: bool, estimated_wait_s: float, position: int | None,
                 ahead: dict[Tier, int] | None, admitted_at_ms: int | None = None) -> dict[str, str]:
        """Record the admission; returns the context to store with the job (the parent of its later spans).

        The span is on this gateway's wall clock (it began before Redis was asked), the job's queue span on Redis's
        from ``admitted_at_ms`` (admit.lua's time): ``admission.clock_offset_ms`` (this clock minus Redis's, the
        reply's time included) lets a reader put the two on one clock. Without it, a gateway 30 s behind Redis
        had explain tell 30 s of admission between them."""
        quota = "none" if not quota_applies else ("downgraded" if tier is not tier_requested else "ok")
        span.set_attributes(tracing.request_attributes(job_id, tier.value, tenant) | {
            "admission.tier_requested": tier_requested.value, "admission.tier_granted": tier.value,
            "admission.quota": quota, "admission.estimated_wait_s": estimated_wait_s,
        })
        if admitted_at_ms is not None:
            span.set_attribute("admission.clock_offset_ms", time.time_ns() // 1_000_000 - admitted_at_ms)
        if position is not None:
            span.set_attribute("queue.position", position)
        for t in ALL_TIERS:
            if ahead is not None:
                span.set_attribute(f"queue.ahead.{t.value}", ahead.get(t, 0))
        return tracing.carrier()

    def dispatched(self, rec, parent: dict[str, str], worker: str, reason: str, now_ns: int,
                   kept: tuple[int, str] | None = None) -> dict[str, str]:
        """Queue-wait and dispatch spans of one attempt; returns the context the worker's spans join. ``kept``: a
        re-dispatch's tokens from earlier attempts it resumes with, and the token log's last entry id read then
        (None: it resumes with none).

        Both are on Redis's clock, as the wait's start (admission, requeue) and its events are: the claim's
        dispatched_at_ms ends the wait, and the dispatch begins there. Ended on the gateway's wall clock, a gateway
        behind Redis by more than the wait made a span that ended before it began (the wait lost: explain and
        Jaeger took it as none). ``queue.clock_offset_ms`` says how far the gateway's clock was from Redis's then
        (the claim's reply time included), so that a reader can tell spans of other clocks apart."""
        ctx = tracing.context_from(parent)
        attrs = tracing.request_attributes(rec.id, rec.tier.value, rec.tenant)
        start_ms = self._queue_start_ms(rec)
        queue = self._queue_span(rec, ctx, attrs, start_ms, rec.attempt)
        sent_ms = rec.dispatched_at_ms
        offset_ns = 0 if sent_ms is None else now_ns - sent_ms * 1_000_000
        if sent_ms is not None:
            queue.set_attribute("queue.clock_offset_ms", offset_ns // 1_000_000)
        end_ns = max(now_ns - offset_ns, start_ms * 1_000_000)
        queue.end(end_time=end_ns)
        metrics.dispatched(rec.tier_granted.value, (end_ns // 1_000_000 - start_ms) / 1e3)
        span = self.tracer.start_span("gateway.dispatch", context=ctx, kind=SpanKind.PRODUCER, start_time=end_ns,
                                      attributes=attrs | {"dispatch.worker": worker, "dispatch.reason": reason,
                                                          "dispatch.attempt": rec.attempt})
        lost = rec.result.get("lost_worker")
        if rec.attempt > 1 and lost:
            span.set_attribute("dispatch.lost_worker", lost.decode() if isinstance(lost, bytes) else str(lost))
        if rec.attempt > 1:  # why the previous attempt ended: its worker handed it back (draining), or it was lost
            released = rec.released_attempt == rec.attempt - 1
            span.set_attribute("dispatch.requeue_cause", "released" if released else "lease_expired")
            # The first prefill of an earlier attempt as the hash recorded it (first_prefill.lua, Redis's clock): the
            # end of the wait JobResult.queued_s reports. A worker killed before its exporter ran left no prefill span
            # of that attempt, and explain measured the wait to a later attempt's, silently longer.
            first = rec.result.get("first_prefill_ms")
            if first is not None:
                span.set_attribute("dispatch.first_prefill_ms", int(first))
        if rec.attempt > 1:
            # The tokens the earlier attempts streamed that this one goes on from (none to a worker that cannot
            # resume), and when the last of them was written (the log entry's id is Redis ms): explain tells the
            # lost attempt's run up to it as kept work.
            tokens, last_entry = kept or (0, "0-0")
            span.set_attribute("dispatch.resumed_tokens", tokens)
            last_ms = int(last_entry.split("-")[0]) if tokens and last_entry != "0-0" else 0
            if last_ms > 0:
                span.set_attribute("dispatch.last_kept_token_ms", last_ms)
        carrier = tracing.carrier_of(span)
        span.end(end_time=end_ns + max(0, time.time_ns() - now_ns))  # as long as it took here
        return carrier

    def left_queue(self, rec, outcome: str, end_ns: int) -> None:
        """The queue-wait span of a job that left its queue without a dispatch (``outcome``: cancelled, expired):
        without it, its trace held no wait at all, and explain told a job that waited out its queue timeout that
        nothing held it up. ``rec``: the job as it was before (its payload holds its trace context)."""
        ctx = self._stored_context(rec)
        attrs = tracing.request_attributes(rec.id, rec.tier.value, rec.tenant)
        # The attempt that waited: a requeued job waits for attempt + 1 (the next claim adds 1).
        queue = self._queue_span(rec, ctx, attrs, self._queue_start_ms(rec), rec.attempt + 1)
        queue.set_attribute("queue.outcome", outcome)
        queue.end(end_time=max(end_ns, self._queue_start_ms(rec) * 1_000_000))

    def dead_lettered(self, rec, attempt: int, worker: str, cause: str, end_ns: int) -> None:
        """The end of a job's last allowed attempt, which lost its lease: it was dead-lettered. An earlier lost
        attempt is told by the next dispatch's span (dispatch.requeue_cause); the last has no next dispatch, and
        without this span its trace stopped at its dispatch, saying neither why it failed nor where its time went.
        ``rec``: the job as stored after (its payload holds its trace context); ``end_ns``: when, on Redis's clock."""
        attrs = tracing.request_attributes(rec.id, rec.tier.value, rec.tenant) | {
            "dead_letter.attempt": attempt, "dead_letter.cause": cause, "dead_letter.lost_worker": worker}
        if rec.reason:
            attrs["dead_letter.reason"] = rec.reason
        span = self.tracer.start_span("gateway.dead_letter", context=self._stored_context(rec), start_time=end_ns,
                                      attributes=attrs)
        span.set_status(Status(StatusCode.ERROR, rec.reason or "dead-lettered"))
        span.end(end_time=end_ns)

    @staticmethod
    def _stored_context(rec):
        """The admission's context, stored in the job's payload: the parent of the spans made after it."""
        try:
            body = msgpack.unpackb(rec.payload) if rec.payload else {}
        except (ValueError, msgpack.UnpackException):
            body = {}
        parent = body.get("trace_context") if isinstance(body, dict) else None
        return tracing.context_from(parent if isinstance(parent, dict) else {})

    @staticmethod
    def _queue_start_ms(rec) -> int:
        """When its wait for this attempt began: admission, or the requeue after a lost or handed-back attempt."""
        requeued = rec.result.get("requeued_at_ms")  # set by requeue.lua only
        return int(requeued) if requeued else rec.enqueued_at_ms

    def _queue_span(self, rec, ctx, attrs: dict, start_ms: int, attempt: int) -> trace.Span:
        queue = self.tracer.start_span("gateway.queue", context=ctx, start_time=start_ms * 1_000_000,
                                       attributes=attrs | {"queue.tier": rec.tier.value,
                                                           "queue.tier_granted": rec.tier_granted.value,
                                                           "queue.attempt": attempt})
        tiers = [rec.tier_granted.value] + [t.value for t in sorted(ALL_TIERS, key=lambda t: -t.rank)
                                            if t.rank < rec.tier_granted.rank]
        for before, after in zip(tiers, tiers[1:]):
            at = rec.result.get(f"aged_to_{after}")
            if at is not None:
                queue.add_event("aged", {"from_tier": before, "to_tier": after}, timestamp=int(at) * 1_000_000)
        promoted = rec.result.get("promoted_at_ms")
        if promoted is not None:  # its promised start fell due (gateway/promises.py): no newer job went first since
            to_tier = f"P{rec.tier_granted.rank - 1}"  # a promise moves a job up one tier from where it was admitted
            queue.add_event("promised start", {"to_tier": to_tier}, timestamp=int(promoted) * 1_000_000)
        return queue
