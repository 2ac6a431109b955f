"""Python SDK: submit jobs to a gateway, stream their tokens, wait for results.

    client = GatewayClient("tcp://127.0.0.1:5555", api_key="...")
    job = client.submit(prompt="Hello", max_tokens=32, tier="P0")
    for chunk in job.stream():
        print(chunk.index, chunk.text, end="")
    result = job.result(timeout=30)

``AsyncGatewayClient`` has the same surface with ``await`` (and ``async for`` on
``job.stream()``). Refusals raise typed errors: ``Unauthorized``, ``Forbidden``,
``InvalidRequest``, ``QuotaExceeded`` (``.retry_after_s``), ``Overloaded``
(``.estimated_wait_s``); a job that ends without a result raises ``JobFailed`` or
``JobExpired`` from ``result()``. A client is not thread-safe: use one per thread.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import zmq
import zmq.asyncio
from opentelemetry import trace

from common import protocol as P
from common import tracing
from common.errors import (Forbidden, InvalidRequest, JobExpired, JobFailed, NotFound, Overloaded, QuotaExceeded,
                           ServingError, Unauthorized)
from common.sockets import curve_client, make_socket

__all__ = ["AsyncGatewayClient", "Chunk", "Forbidden", "GatewayClient", "InvalidRequest", "Job", "JobExpired",
           "JobFailed", "JobResult", "JobStatus", "NotFound", "Overloaded", "QuotaExceeded", "Unauthorized"]


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


def _raise_for(reply) -> None:
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
    raise ServingError(f"{code}: {msg}")


SDK_TRACER = "tiered_serve.sdk"


def _submit_span(tracer: trace.Tracer):
    """The request's root span (or a child of the caller's current span): its context travels with the job."""
    return tracer.start_as_current_span("sdk.submit", kind=trace.SpanKind.CLIENT)


def _on_reply(span, reply) -> None:
    if isinstance(reply, P.SubmitReply):
        span.set_attributes(tracing.request_attributes(reply.job_id, reply.tier, None)
                            | {"admission.estimated_wait_s": reply.estimated_wait_s,
                               "admission.duplicate": reply.duplicate})


def _result(done: P.JobDone) -> JobResult:
    if done.state == "expired":
        raise JobExpired(f"job {done.job_id} expired: {done.reason}")
    if done.state != "done":
        raise JobFailed(f"job {done.job_id} ended {done.state}: {done.reason}")
    return JobResult(done.text, done.token_ids, done.finish_reason, done.queued_s, done.ttft_s, done.total_s,
                     done.preemptions)


def _submit_request(api_key: str, prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, tier,
                    idempotency_key, ignore_eos) -> P.SubmitRequest:
    return P.SubmitRequest(api_key=api_key, max_tokens=max_tokens, prompt=prompt,
                           prompt_token_ids=list(prompt_token_ids) if prompt_token_ids is not None else None,
                           temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed, tier=tier,
                           idempotency_key=idempotency_key, trace_context=tracing.carrier(), ignore_eos=ignore_eos)


class _Chunks:
    """Turns stream frames into chunks, trimming anything already delivered (defensive)."""

    def __init__(self, from_index: int) -> None:
        self.next = from_index
        self.done: P.JobDone | None = None

    def feed(self, msg) -> Chunk | None:
        _raise_for(msg)
        if isinstance(msg, P.JobDone):
            self.done = msg
            return None
        if isinstance(msg, P.TokenChunk) and msg.index + len(msg.token_ids) > self.next >= msg.index:
            ids = msg.token_ids[self.next - msg.index:]
            chunk = Chunk(self.next, ids, msg.text if self.next == msg.index else "")
            self.next += len(ids)
            return chunk
        return None


class _JobBase:
    """What admission said about a job: id, tier (after any downgrade), wait estimate."""

    def __init__(self, client, reply: P.SubmitReply) -> None:
        self._client = client
        self.id = reply.job_id
        self.tier = reply.tier
        self.estimated_wait_s = reply.estimated_wait_s
        self.duplicate = reply.duplicate
        self.downgraded = reply.downgraded
        self._done: P.JobDone | None = None


class Job(_JobBase):

    def stream(self, from_index: int = 0, timeout: float | None = None) -> Iterator[Chunk]:
        """Yield the job's tokens from ``from_index`` until it ends (``timeout``: seconds between frames)."""
        sock = self._client._new_socket()
        try:
            sock.send(P.encode(P.StreamRequest(self._client.api_key, self.id, from_index)))
            chunks = _Chunks(from_index)
            while chunks.done is None:
                if not sock.poll(int(1000 * (timeout or self._client.timeout_s))):
                    raise TimeoutError(f"no news of job {self.id} for {timeout or self._client.timeout_s}s")
                chunk = chunks.feed(P.decode(sock.recv()))
                if chunk is not None:
                    yield chunk
            self._done = chunks.done
        finally:
            sock.close(linger=0)

    def result(self, timeout: float | None = None) -> JobResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._done is None:
            for _ in self.stream(timeout=timeout):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {self.id} not done within {timeout}s")
        return _result(self._done)


class _ClientBase:
    def __init__(self, endpoint: str, api_key: str, timeout_s: float, tracer_provider, ctx,
                 server_public_key: str | bytes | None = None) -> None:
        self.endpoint = endpoint
        self.api_key = api_key
        self.server_public_key = server_public_key
        self.timeout_s = timeout_s
        self._tracer = trace.get_tracer(SDK_TRACER, tracer_provider=tracer_provider)
        self._ctx = ctx
        self._sock = self._new_socket()

    def _new_socket(self):
        sock = make_socket(self._ctx, zmq.DEALER)
        if self.server_public_key is not None:  # CURVE: the API key and prompts cross the network encrypted
            curve_client(sock, self.server_public_key)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        self._sock.close(linger=0)


class GatewayClient(_ClientBase):
    def __init__(self, endpoint: str, api_key: str, timeout_s: float = 30.0,
                 tracer_provider: trace.TracerProvider | None = None,
                 server_public_key: str | bytes | None = None) -> None:
        """``tracer_provider``: where the submit spans go (default: the global one, a no-op unless set).
        ``server_public_key``: the gateway's CURVE public key (z85, or its ``gateway.key`` file) when its
        client socket is encrypted (``client_curve``)."""
        super().__init__(endpoint, api_key, timeout_s, tracer_provider, zmq.Context.instance(), server_public_key)

    def _call(self, msg):
        self._sock.send(P.encode(msg))
        if not self._sock.poll(int(1000 * self.timeout_s)):
            # The reply may still come; a fresh socket keeps it from answering the next call.
            self._sock.close(linger=0)
            self._sock = self._new_socket()
            raise TimeoutError(f"gateway {self.endpoint} did not answer within {self.timeout_s}s")
        reply = P.decode(self._sock.recv())
        _raise_for(reply)
        return reply

    def submit(self, prompt: str | None = None, *, prompt_token_ids=None, max_tokens: int = 16,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
               tier: str | None = None, idempotency_key: str | None = None, ignore_eos: bool = False) -> Job:
        with _submit_span(self._tracer) as span:
            reply = self._call(_submit_request(self.api_key, prompt, prompt_token_ids, max_tokens, temperature,
                                               top_p, top_k, seed, tier, idempotency_key, ignore_eos))
            _on_reply(span, reply)
        return Job(self, reply)

    def status(self, job_id: str) -> JobStatus:
        r = self._call(P.StatusRequest(self.api_key, job_id))
        return JobStatus(r.job_id, r.state, r.tier, r.attempt, r.estimated_wait_s, r.reason)

    def cancel(self, job_id: str) -> bool:
        return self._call(P.CancelRequest(self.api_key, job_id)).cancelled

    def info(self) -> P.InfoReply:
        """Gateway id, connected workers and queue depths per tier."""
        return self._call(P.InfoRequest(self.api_key))

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncJob(_JobBase):

    async def stream(self, from_index: int = 0, timeout: float | None = None) -> AsyncIterator[Chunk]:
        sock = self._client._new_socket()
        try:
            await sock.send(P.encode(P.StreamRequest(self._client.api_key, self.id, from_index)))
            chunks = _Chunks(from_index)
            while chunks.done is None:
                if not await sock.poll(int(1000 * (timeout or self._client.timeout_s))):
                    raise TimeoutError(f"no news of job {self.id}")
                chunk = chunks.feed(P.decode(await sock.recv()))
                if chunk is not None:
                    yield chunk
            self._done = chunks.done
        finally:
            sock.close(linger=0)

    async def result(self, timeout: float | None = None) -> JobResult:
        if self._done is None:
            async for _ in self.stream(timeout=timeout):
                pass
        return _result(self._done)


class AsyncGatewayClient(_ClientBase):
    def __init__(self, endpoint: str, api_key: str, timeout_s: float = 30.0,
                 tracer_provider: trace.TracerProvider | None = None,
                 server_public_key: str | bytes | None = None) -> None:
        super().__init__(endpoint, api_key, timeout_s, tracer_provider, zmq.asyncio.Context.instance(),
                         server_public_key)

    async def _call(self, msg):
        await self._sock.send(P.encode(msg))
        if not await self._sock.poll(int(1000 * self.timeout_s)):
            self._sock.close(linger=0)
            self._sock = self._new_socket()
            raise TimeoutError(f"gateway {self.endpoint} did not answer within {self.timeout_s}s")
        reply = P.decode(await self._sock.recv())
        _raise_for(reply)
        return reply

    async def submit(self, prompt: str | None = None, *, prompt_token_ids=None, max_tokens: int = 16,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                     tier: str | None = None, idempotency_key: str | None = None,
                     ignore_eos: bool = False) -> AsyncJob:
        with _submit_span(self._tracer) as span:
            reply = await self._call(_submit_request(self.api_key, prompt, prompt_token_ids, max_tokens,
                                                     temperature, top_p, top_k, seed, tier, idempotency_key, ignore_eos))
            _on_reply(span, reply)
        return AsyncJob(self, reply)

    async def status(self, job_id: str) -> JobStatus:
        r = await self._call(P.StatusRequest(self.api_key, job_id))
        return JobStatus(r.job_id, r.state, r.tier, r.attempt, r.estimated_wait_s, r.reason)

    async def cancel(self, job_id: str) -> bool:
        return (await self._call(P.CancelRequest(self.api_key, job_id))).cancelled
