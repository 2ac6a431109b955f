"""What a gateway's answer becomes for the caller: the result types, and the typed error each refusal raises."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common import protocol as P
from common.errors import (Forbidden, InvalidRequest, JobCancelled, JobExpired, JobFailed, NotFound, Overloaded,
                           QuotaExceeded, ServingError, Unauthorized, Unavailable)


@dataclass(frozen=True)
class Chunk:
    index: int  # position of token_ids[0] in the output; each index is delivered once
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class JobResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    queued_s: float
    ttft_s: float | None
    total_s: float
    preemptions: int


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    state: str
    tier: str
    attempt: int
    estimated_wait_s: float | None
    reason: str | None


def raise_for(reply) -> None:
    if not isinstance(reply, P.ErrorReply):
        return
    code, msg = reply.code, reply.message
    if code == "unauthorized":
        raise Unauthorized(msg)
    if code == "forbidden":
        raise Forbidden(msg)
    if code == "quota_exceeded":
        raise QuotaExceeded(msg, reply.retry_after_s or 0.0)
    if code == "overloaded":
        raise Overloaded(msg, reply.estimated_wait_s or 0.0)
    if code == "not_found":
        raise NotFound(msg)
    if code == "invalid_request":
        raise InvalidRequest(msg, field=reply.field)
    if code == "unavailable":
        raise Unavailable(msg, reply.retry_after_s)
    raise ServingError(f"{code}: {msg}")


def without_defaulted(req: P.SubmitRequest, e: ServingError) -> P.SubmitRequest:
    """``req`` to send again without ``max_tokens_defaulted`` and ``retry_key`` if a gateway older than the fields
    refused it (its idempotency fingerprint then holds max_tokens, and it keeps the key its own time, as before);
    else ``e``, raised."""
    if not ((req.max_tokens_defaulted or req.retry_key) and refused_as_unknown(e)):
        raise e
    return dataclasses.replace(req, max_tokens_defaulted=False, retry_key=False)


def refused_as_unknown(e: ServingError) -> bool:
    """Did the gateway refuse the request's frame as a protocol error (raise_for's plain ServingError), as one older
    than a field the request sent does? Then the call can be made again without that field."""
    return type(e) is ServingError and str(e).startswith("protocol: ")


def info_requests(api_key: str, limits: bool, tokenizer: bool) -> list[P.InfoRequest]:
    """The info call's frames, most asked first: a gateway older than a field refuses the frame (refused_as_unknown),
    and the next one asks without it."""
    out = [P.InfoRequest(api_key, limits=limits, tokenizer=tokenizer)]
    if tokenizer:
        out.append(P.InfoRequest(api_key, limits=limits))
    if limits:
        out.append(P.InfoRequest(api_key))
    return out


def to_result(done: P.JobDone) -> JobResult:
    if done.state == "expired":
        raise JobExpired(f"job {done.job_id} expired: {done.reason}")
    if done.state == "cancelled":
        raise JobCancelled(f"job {done.job_id} ended {done.state}: {done.reason}")
    if done.state != "done":
        raise JobFailed(f"job {done.job_id} ended {done.state}: {done.reason}")
    return JobResult(done.text, done.token_ids, done.finish_reason, done.queued_s, done.ttft_s, done.total_s,
                     done.preemptions)


def to_status(r: P.StatusReply) -> JobStatus:
    return JobStatus(r.job_id, r.state, r.tier, r.attempt, r.estimated_wait_s, r.reason)
