"""The state machine of one stream, whatever carries it (a blocking socket or an asyncio inbox)."""

from __future__ import annotations

import time

from common import protocol as P
from common.errors import InvalidRequest
from gateway.sdk._requests import INT64, job_request, new_request_id, plain_int, wait_limit
from gateway.sdk._results import Chunk, raise_for
from gateway.sdk._retry import RetryBudget


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
