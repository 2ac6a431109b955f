"""What the blocking and the asyncio clients share beside the modules they import directly: the submit span, and
what is known of a job.

The result types, argument checks, frame sizes, retries and a stream's state machine have modules of their own
(_results, _requests, _frames, _retry, _stream_state). Their names stay importable from here, as before the split,
for code (and branches) written against this module."""

from __future__ import annotations

from opentelemetry import trace

from common import protocol as P
from common import tracing
from gateway.sdk._frames import ASK_OVER_BYTES, UNASKED_BYTES, FrameSizes, check_frame_size, frame_bytes  # noqa: F401
from gateway.sdk._requests import (INT64, auto_idempotency_key, client_settings, endpoint_list,  # noqa: F401
                                   job_request, new_request_id, plain_float, plain_int, sized_submit_request,
                                   submit_request, wait_limit, with_request_id)
from gateway.sdk._results import (Chunk, JobResult, JobStatus, raise_for, refused_as_unknown,  # noqa: F401
                                  to_result, to_status, without_defaulted)
from gateway.sdk._retry import RETRYABLE, RetryBudget, failed_at  # noqa: F401
from gateway.sdk._stream_state import StreamState  # noqa: F401

SDK_TRACER = "tiered_serve.sdk"


def submit_span(tracer: trace.Tracer):
    """The request's root span (or a child of the caller's current span): its context travels with the job."""
    return tracer.start_as_current_span("sdk.submit", kind=trace.SpanKind.CLIENT)


def on_submit_reply(span, reply) -> None:
    if isinstance(reply, P.SubmitReply):
        span.set_attributes(tracing.request_attributes(reply.job_id, reply.tier, None)
                            | {"admission.estimated_wait_s": reply.estimated_wait_s,
                               "admission.duplicate": reply.duplicate})


class JobBase:
    """What is known of a job: id, tier (after any downgrade), wait estimate; and its final frame once seen."""

    def __init__(self, client, job_id: str, tier: str, estimated_wait_s: float, duplicate: bool = False,
                 downgraded: bool = False) -> None:
        self._client = client
        self.id = job_id
        self.tier = tier
        self.estimated_wait_s = estimated_wait_s
        self.duplicate = duplicate  # an earlier submission with the caller's own idempotency key
        self.downgraded = downgraded
        self._done: P.JobDone | None = None

