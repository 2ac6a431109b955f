"""What the blocking and the asyncio clients share: result types, error mapping, endpoints, retries, and the
state machine of one stream (which index comes next, when a silent gateway counts as dead)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace

from common import protocol as P
from common import tracing
from common.errors import (Forbidden, InvalidRequest, JobCancelled, JobExpired, JobFailed, NotFound, Overloaded,
                           QuotaExceeded, ServingError, Unauthorized, Unavailable)

SDK_TRACER = "tiered_serve.sdk"


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
    """``req`` to send again without ``max_tokens_defaulted`` if a gateway older than the field refused it (its
    idempotency fingerprint then holds max_tokens, as before); else ``e``, raised."""
    if not (req.max_tokens_defaulted and refused_as_unknown(e)):
        raise e
    return dataclasses.replace(req, max_tokens_defaulted=False)


def refused_as_unknown(e: ServingError) -> bool:
    """Did the gateway refuse the request's frame as a protocol error (raise_for's plain ServingError), as one older
    than a field the request sent does? Then the call can be made again without that field."""
    return type(e) is ServingError and str(e).startswith("protocol: ")


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


def endpoint_list(endpoint: str | Sequence[str]) -> list[str]:
    """One endpoint, or several gateways of one cluster to fail over between (in order of preference)."""
    endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    if not endpoints or not all(isinstance(e, str) and e for e in endpoints):
        raise InvalidRequest("endpoint must be a non-empty string or a non-empty list of them", field="endpoint")
    return endpoints


def plain_int(value):
    """``value`` as a plain int if it is an integer of any kind (numpy's, as a caller's array hands them out:
    msgpack cannot even send one); else ``value`` itself, for the type check to refuse (a bool, a float)."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def plain_float(value):
    """``value`` as a plain float if it is a real number of a type other than int and bool (numpy's float32, say);
    else ``value`` itself, for the type check to take (an int) or refuse."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    try:
        return float(value)
    except (OverflowError, ValueError):
        return value


def client_settings(api_key, timeout_s, retries) -> tuple[str, float, int]:
    """A client's key, timeout and retries, checked: a timeout of 0 (or NaN) made every call fail as a silent
    gateway, and a missing key failed each call with an untyped protocol error."""
    timeout_s, retries = plain_float(plain_int(timeout_s)), plain_int(retries)
    if not isinstance(api_key, str) or not api_key:
        raise InvalidRequest("api_key must be a non-empty string", field="api_key")
    if type(timeout_s) not in (int, float) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise InvalidRequest(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}", field="timeout_s")
    if type(retries) is not int or retries < 0:
        raise InvalidRequest(f"retries must be an integer >= 0, got {retries!r}", field="retries")
    return api_key, float(timeout_s), retries


def wait_limit(timeout) -> float | None:
    """A caller's ``timeout`` (seconds, or None for no limit), checked: NaN compares false with every clock reading,
    so a deadline of NaN never came and the call waited as long as the job took."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or math.isnan(timeout)):
        raise InvalidRequest(f"timeout must be a number of seconds or None, got {timeout!r}", field="timeout")
    return timeout


def new_request_id() -> str:
    return secrets.token_hex(8)


def auto_idempotency_key() -> str:
    """A key per submit() call, so the SDK's own retries of that call can never admit the job twice."""
    return "sdk-" + secrets.token_hex(16)


# Failures that another attempt (on the next gateway) may cure; every other error is final.
RETRYABLE = (TimeoutError, Unavailable)


def failed_at(endpoint: str, why: Exception) -> str:
    """``why`` a call to ``endpoint`` failed, naming the gateway once."""
    return str(why) if endpoint in str(why) else f"gateway {endpoint}: {why}"


class RetryBudget:
    """Whether a failed attempt may be retried, and after what pause.

    A silent gateway (TimeoutError): up to ``retries`` times in a row, at once, on the next gateway. An
    unavailable cluster (its Redis unreachable): retried after the pause the gateway asks for (else 0.1 s
    doubling to 2 s, with jitter) until the pauses add up to ``budget_s``, so a Redis blip is waited out.
    """

    def __init__(self, retries: int, budget_s: float) -> None:
        self.retries, self.budget_s = retries, budget_s
        self.reset()

    def reset(self) -> None:
        """The gateway answered: count from zero again."""
        self.silent = self.unavailable = 0
        self.waited_s = 0.0

    def pause_s(self, error: Exception) -> float:
        """The pause before the next attempt; re-raises ``error`` when the budget is spent."""
        if isinstance(error, TimeoutError):
            self.silent += 1
            if self.silent > self.retries:
                raise error
            return 0.0
        self.unavailable += 1
        pause = getattr(error, "retry_after_s", None) or min(2.0, 0.1 * 2 ** (self.unavailable - 1)) * \
            random.uniform(0.5, 1.0)
        if self.waited_s + pause > self.budget_s:
            raise error
        self.waited_s += pause
        return pause


INT64 = (-(2**63), 2**63)  # what a frame carries (msgpack): a larger int could not even be sent


def submit_request(*args, **kwargs) -> P.SubmitRequest:
    """sized_submit_request's frame alone (for those who need no size)."""
    return sized_submit_request(*args, **kwargs)[0]


def sized_submit_request(api_key: str, prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, tier,
                         idempotency_key, ignore_eos,
                         max_tokens_defaulted: bool = False) -> tuple[P.SubmitRequest, int]:
    """The frame and its frame_bytes (measured once: a million-id prompt takes ~70 ms of CPU to encode, and the
    question to the gateway about its size encoded it again), once each argument has the type the gateway's decoder
    takes (P.mistyped): a wrong one is InvalidRequest naming it. Ranges are the gateway's to judge, but for what
    64-bit frame fields can carry."""
    if prompt_token_ids is not None and not isinstance(prompt_token_ids, (str, bytes)):
        ids = list(prompt_token_ids)
        # numpy's integers as well; a bool stays a bool, which the decoder refuses.
        prompt_token_ids = [plain_int(t) for t in ids]
    max_tokens, top_k, seed = plain_int(max_tokens), plain_int(top_k), plain_int(seed)
    temperature, top_p = plain_float(temperature), plain_float(top_p)
    fields = dict(api_key=api_key, max_tokens=max_tokens, prompt=prompt, prompt_token_ids=prompt_token_ids,
                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, tier=tier,
                  idempotency_key=idempotency_key, ignore_eos=ignore_eos, max_tokens_defaulted=max_tokens_defaulted)
    wrong = P.mistyped(P.SubmitRequest, fields)
    if wrong is not None:
        raise InvalidRequest(f"{wrong} has the wrong type: {type(fields[wrong]).__name__}", field=wrong)
    for name, value, least in (("max_tokens", max_tokens, INT64[0]), ("top_k", top_k, INT64[0]), ("seed", seed, 0)):
        if value is not None and not least <= value < INT64[1]:
            raise InvalidRequest(f"{name} must be in [{least}, 2**63), got {value!r}", field=name)
    if prompt_token_ids and not INT64[0] <= min(prompt_token_ids) <= max(prompt_token_ids) < INT64[1]:
        raise InvalidRequest("prompt_token_ids must fit in 64 bits", field="prompt_token_ids")
    if prompt_token_ids is not None and len(prompt_token_ids) > P.MAX_LIST_LEN:
        raise InvalidRequest(f"prompt_token_ids has {len(prompt_token_ids)} ids; a request carries at most "
                             f"{P.MAX_LIST_LEN}", field="prompt_token_ids")
    req = P.SubmitRequest(**fields | dict(temperature=float(temperature), top_p=float(top_p)),
                          trace_context=tracing.carrier())
    return req, check_frame_size(req, ("prompt", "prompt_token_ids", "idempotency_key"))


def job_request(cls, api_key: str, job_id, **fields):
    """A request (``cls``) about the job ``job_id``, checked as submit_request checks a submission: a job id that is
    not a string, or one too long for a frame (the gateway's ZeroMQ drops the connection that carries it, and every
    stream on it), is this call's InvalidRequest, not a TimeoutError after every retry."""
    if not isinstance(job_id, str):
        raise InvalidRequest(f"job_id must be a string, got {type(job_id).__name__}", field="job_id")
    msg = cls(api_key, job_id, **fields)
    check_frame_size(msg, ("job_id",))
    return msg


# What a request id adds to a frame, at most: the key, the string and their headers.
_REQUEST_ID_BYTES = len("request_id") + P.MAX_REQUEST_ID_LEN + 8


def frame_bytes(msg) -> int:
    """The most bytes ``msg`` takes in a frame, whatever request id it is sent with."""
    return len(P.encode(msg)) + _REQUEST_ID_BYTES


def _largest(msg, fields: tuple[str, ...]) -> str:
    return max(fields, key=lambda f: len(getattr(msg, f) or ""))


def check_frame_size(msg, fields: tuple[str, ...]) -> int:
    """``msg``'s frame_bytes; InvalidRequest naming the largest of ``fields`` if ``msg`` would not fit in one
    frame. A gateway cannot read such a frame far enough to find its request id (over the size limit ZeroMQ even
    drops the connection), so its refusal could reach no caller: better refused here, where it is this call's alone.
    """
    size = frame_bytes(msg)
    if size > P.MAX_MESSAGE_BYTES:
        raise InvalidRequest(f"the request is {size} bytes; a frame carries at most {P.MAX_MESSAGE_BYTES} "
                             f"(its {_largest(msg, fields)} is the largest part)", field=_largest(msg, fields))
    return size


# A gateway may take smaller frames than the protocol's (its client_max_message_bytes), and drops the connection
# that brings a larger one, with every stream on it. A frame over UNASKED_BYTES is announced first
# (InfoRequest.frame_bytes), once per size a gateway has not yet taken. The first question to a gateway is about
# ASK_OVER_BYTES at least, so one that takes that many is asked about nothing smaller; one that does not is asked
# about each larger size it has not taken (a limit below 16 KiB dropped the connection for frames under it, unasked).
# Frames of UNASKED_BYTES or less go unasked: a gateway that takes no more than that serves almost no prompt, and
# asking about every first frame would cost every client a round trip.
ASK_OVER_BYTES = 16 * 2**10
UNASKED_BYTES = 2**10
_PARTS = {P.SubmitRequest: ("prompt", "prompt_token_ids", "idempotency_key"), P.StatusRequest: ("job_id",),
          P.CancelRequest: ("job_id",)}


class FrameSizes:
    """What each gateway said of the frame sizes it takes: the largest it took, the smallest it refused."""

    def __init__(self) -> None:
        self.taken: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    @staticmethod
    def concerns(msg) -> bool:
        """Is ``msg`` of a kind asked about (those that carry a caller's arbitrary prompt or job id)?"""
        return type(msg) in _PARTS

    def question(self, endpoint: str, msg, size: int) -> P.InfoRequest | None:
        """The question to ask the gateway at ``endpoint`` before sending it ``msg`` (of frame_bytes ``size``), or
        None if ``msg`` needs none."""
        if type(msg) not in _PARTS or size <= max(UNASKED_BYTES, self.taken.get(endpoint, 0)):
            return None
        ask = max(size, ASK_OVER_BYTES)
        return P.InfoRequest(msg.api_key, frame_bytes=ask if ask < self.refused.get(endpoint, ask + 1) else size)

    def answered(self, endpoint: str, msg, size: int, ask: P.InfoRequest, e: ServingError | None) -> None:
        """Note the gateway's answer ``e`` (None: it takes ``ask``'s size), and raise what the caller gets: too big
        there (InvalidRequest naming the request's largest part), or ``e`` itself; nothing where the gateway is
        older than the question (the frame is then sent as before) or refused only a question larger than
        ``msg`` (the next is about ``size`` itself)."""
        if e is None or refused_as_unknown(e):
            self.taken[endpoint] = max(ask.frame_bytes, self.taken.get(endpoint, 0))
            return
        if not (isinstance(e, InvalidRequest) and e.field == "frame_bytes"):
            raise e
        self.refused[endpoint] = min(ask.frame_bytes, self.refused.get(endpoint, ask.frame_bytes))
        if ask.frame_bytes > size:
            return
        part = _largest(msg, _PARTS[type(msg)])
        raise InvalidRequest(f"the request is {size} bytes, too large for gateway {endpoint} (its {part} is the "
                             f"largest part): {e}", field=part) from None


def with_request_id(msg, request_id: str):
    return dataclasses.replace(msg, request_id=request_id)


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


class StreamState:
    """One stream's progress, whatever carries it: the next index, the deadlines, the failover count.

    Three clocks: ``chunk_timeout`` (the caller's limit on the wait between token chunks; keepalives do not
    count), ``deadline`` (the caller's limit on the whole wait) and the client's ``timeout_s`` (the limit on
    silence from the gateway: keepalives do count, so only a dead or unreachable gateway reaches it, and
    then the stream resumes from its next index on the next gateway, as RetryBudget allows).
    """

    def __init__(self, job_id: str, api_key: str, from_index: int, *, liveness_s: float, retries: int,
                 chunk_timeout: float | None = None, deadline: float | None = None) -> None:
        from_index = plain_int(from_index)
        if type(from_index) is not int or from_index < 0:  # -1 would drop every chunk: a stream of nothing
            raise InvalidRequest(f"from_index must be an integer >= 0, got {from_index!r}", field="from_index")
        # Refused before anything is sent; sized as the largest of its requests (a resubscription from far on).
        job_request(P.StreamRequest, api_key, job_id, from_index=INT64[1] - 1, unsubscribe=True)
        self.job_id, self.api_key = job_id, api_key
        self.next = from_index
        self.done: P.JobDone | None = None
        self.liveness_s = liveness_s
        self.chunk_timeout, self.deadline = wait_limit(chunk_timeout), deadline
        self.request_id: str | None = None
        self.budget = RetryBudget(retries, liveness_s)
        now = time.monotonic()
        self.last_frame = self.last_chunk = now

    def request(self) -> P.StreamRequest:
        """The request that (re)subscribes from the next undelivered index, under a fresh request id."""
        self.request_id = new_request_id()
        self.last_frame = time.monotonic()
        return P.StreamRequest(self.api_key, self.job_id, self.next, request_id=self.request_id)

    def unsubscribe(self) -> P.StreamRequest:
        """The request that tells the gateway this stream no longer reads the subscription it opened last."""
        return P.StreamRequest(self.api_key, self.job_id, request_id=self.request_id, unsubscribe=True)

    def wait_s(self) -> float:
        """How long to wait for the next frame before on_silence() must decide."""
        now = time.monotonic()
        limits = [self.last_frame + self.liveness_s]
        if self.chunk_timeout is not None:
            limits.append(self.last_chunk + self.chunk_timeout)
        if self.deadline is not None:
            limits.append(self.deadline)
        return max(0.0, min(limits) - now)

    def on_frame(self, msg) -> Chunk | None:
        """A frame for this stream: a chunk to deliver, or None (keepalive, end, or nothing new). Raises the
        typed error of an ErrorReply; Unavailable is the caller's cue to retry."""
        if msg.request_id not in (self.request_id, None):
            return None  # an earlier subscription's frame
        self.last_frame = time.monotonic()
        raise_for(msg)
        self.budget.reset()
        if isinstance(msg, P.JobDone):
            self.done = msg
            return None
        if isinstance(msg, P.TokenChunk) and msg.index + len(msg.token_ids) > self.next >= msg.index:
            ids = msg.token_ids[self.next - msg.index:]  # trims anything already delivered (defensive)
            chunk = Chunk(self.next, ids, msg.text if self.next == msg.index else "")
            self.next += len(ids)
            self.last_chunk = self.last_frame
            return chunk
        return None

    def on_silence(self) -> bool:
        """wait_s() passed with no frame. Raises TimeoutError if the caller's limit is reached or retries are
        spent; True: the gateway is silent, resubscribe on the next one; False: keep waiting."""
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError(f"job {self.job_id} not done by the deadline")
        if self.chunk_timeout is not None and now >= self.last_chunk + self.chunk_timeout:
            raise TimeoutError(f"no tokens of job {self.job_id} for {self.chunk_timeout}s")
        if now < self.last_frame + self.liveness_s:
            return False
        self.on_failure(TimeoutError(f"no frame about job {self.job_id} for {self.liveness_s}s"))
        return True

    def on_failure(self, error: Exception) -> float:
        """A failed subscription: the pause before the next (re-raises ``error`` when retries are spent)."""
        return self.budget.pause_s(error)
