"""The asyncio client: AsyncGatewayClient and its AsyncJob.

One DEALER socket per gateway carries every call and stream of the client at once. Each request gets a
request id; one reader task per socket hands each incoming frame to the inbox (a queue) registered under
the frame's request id. A frame nobody waits for (the answer to a call that gave up) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio
from opentelemetry import trace

from common import protocol as P
from common.errors import ServingError
from common.sockets import curve_client, make_socket
from gateway.sdk._common import (RETRYABLE, SDK_TRACER, Chunk, JobBase, JobResult, JobStatus, RetryBudget, StreamState,
                                 auto_idempotency_key, client_settings, endpoint_list, FrameSizes, failed_at,
                                 frame_bytes, job_request, new_request_id, on_submit_reply, raise_for,
                                 refused_as_unknown, sized_submit_request, submit_span, to_result, to_status,
                                 wait_limit,
                                 with_request_id, without_defaulted)

log = logging.getLogger("gateway.sdk")
CLOSED = object()  # put in every inbox of a connection the client closes: its waiters end rather than time out


async def _next(inbox: asyncio.Queue, timeout_s: float):
    """The next frame in ``inbox``, or None after ``timeout_s``."""
    try:
        return inbox.get_nowait()  # wait_for(…, 0) would time out even with a frame waiting
    except asyncio.QueueEmpty:
        pass
    try:
        return await asyncio.wait_for(inbox.get(), timeout_s)
    except TimeoutError:
        return None


class _Connection:
    """One socket to one gateway, and the task that routes what it receives."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, server_public_key: str | bytes | None = None) -> None:
        self.endpoint = endpoint
        self.sock = make_socket(ctx, zmq.DEALER)
        if server_public_key is not None:  # CURVE: the API key and prompts cross the network encrypted
            curve_client(self.sock, server_public_key)
        self.sock.connect(endpoint)
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.dropped = 0  # frames for no waiting request (late answers) or unreadable
        self.loop = asyncio.get_running_loop()  # its reader runs there, and ends with it
        self._reader = self.loop.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                msg = P.decode(frame)
            except P.ProtocolError as e:
                self.dropped += 1
                log.warning("gateway %s sent an unreadable frame: %s", self.endpoint, e)
                continue
            if msg.request_id is None and isinstance(msg, P.ErrorReply):
                # The gateway could not read one of our frames far enough to find its request id. An unknown
                # API key (refused before the rest is decoded) concerns every call here, which all share the
                # key: each gets the answer rather than waiting out its timeout. Any other such error belongs
                # to one call that cannot be told apart: handed to all, it failed every stream beside it.
                if msg.code == "unauthorized":
                    for waiting in list(self.inboxes.values()):
                        waiting.put_nowait(msg)
                else:
                    self.dropped += 1
                    log.warning("gateway %s refused a frame it could not attribute: %s", self.endpoint, msg.message)
                continue
            inbox = self.inboxes.get(msg.request_id)
            if inbox is None:
                self.dropped += 1
                continue
            inbox.put_nowait(msg)

    async def send(self, msg) -> None:
        try:
            await self.sock.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            # No pipe to queue on (a gateway that refused our handshake) or a full one: never block the caller;
            # the wait for the answer times out and the call retries or fails over like on a silent gateway.
            self.dropped += 1

    def send_nowait(self, msg) -> None:
        """As send, from code that may not await: a stream's ``finally`` while its task is being cancelled."""
        try:
            self.sock.send(P.encode(msg), zmq.NOBLOCK).add_done_callback(_retrieved)
        except Exception:  # noqa: BLE001 - its socket or loop already closed: nobody is left to tell
            self.dropped += 1

    def close(self) -> None:
        if not self.loop.is_closed():
            self._reader.cancel()
            # Its waiters heard nothing more: each took the gateway for dead after timeout_s, failed the client over
            # and opened a connection again, behind the back of the caller that had closed it.
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self.loop:
                self._wake()
            else:
                self.loop.call_soon_threadsafe(self._wake)
        self.sock.close(linger=0)

    def _wake(self) -> None:
        for inbox in list(self.inboxes.values()):
            inbox.put_nowait(CLOSED)


def _check_open(frame) -> None:
    if frame is CLOSED:
        raise ServingError("the client was closed while this call waited for its answer")


def _retrieved(sent: asyncio.Future) -> None:
    if not sent.cancelled():
        sent.exception()  # a full or missing pipe: the unsubscription is lost, which costs only its keepalives


class AsyncJob(JobBase):

    async def stream(self, from_index: int = 0, timeout: float | None = None) -> AsyncIterator[Chunk]:
        """As Job.stream, with ``async for``."""
        async for chunk in self._client._stream(self, from_index, chunk_timeout=timeout):
            yield chunk

    async def result(self, timeout: float | None = None) -> JobResult:
        """As Job.result."""
        if self._done is None:
            deadline = None if wait_limit(timeout) is None else asyncio.get_running_loop().time() + timeout
            async for _ in self._client._stream(self, 0, deadline=deadline):
                pass
        return to_result(self._done)

    async def status(self) -> JobStatus:
        return await self._client.status(self.id)

    async def cancel(self) -> bool:
        return await self._client.cancel(self.id)


class AsyncGatewayClient:
    """GatewayClient for asyncio: the same surface with ``await``; any number of concurrent calls and streams
    from any number of coroutines share one connection per gateway. It serves one running event loop at a time;
    once that loop has ended, the next one to use it gets new connections."""

    def __init__(self, endpoint: str | Sequence[str], api_key: str, timeout_s: float = 30.0,
                 tracer_provider: trace.TracerProvider | None = None, *, retries: int = 2,
                 server_public_key: str | bytes | None = None) -> None:
        self.server_public_key = server_public_key  # as GatewayClient's
        self.endpoints = endpoint_list(endpoint)
        self.api_key, self.timeout_s, self.retries = client_settings(api_key, timeout_s, retries)
        self._current = 0
        self._frames = FrameSizes()  # per gateway, the frame sizes it said it takes
        self._tracer = trace.get_tracer(SDK_TRACER, tracer_provider=tracer_provider)
        self._ctx = zmq.asyncio.Context.instance()
        self._conns: dict[str, _Connection] = {}
        self._pid = os.getpid()
        # close() calls so far: a call or stream between two attempts when one came ends, rather than open a
        # connection again that nobody would close.
        self._closes = 0

    @property
    def endpoint(self) -> str:
        """The gateway new calls and streams go to now."""
        return self.endpoints[self._current]

    def _conn(self, closes: int) -> _Connection:
        """The connection to the current gateway, for a call or stream that began after ``closes`` close() calls."""
        if closes != self._closes:
            raise ServingError("the client was closed while this call waited to try again")
        if self._pid != os.getpid():
            # A child process (os.fork): the parent's connections (their loop, libzmq's threads) are not its own,
            # and a call on them blocked for ever. Left alone, not closed: pyzmq would not close them here anyway.
            self._pid, self._ctx, self._conns = os.getpid(), zmq.asyncio.Context.instance(), {}
        loop = asyncio.get_running_loop()
        made_on = next((c.loop for c in self._conns.values()), loop)
        if made_on is not loop:
            if made_on.is_running():
                raise RuntimeError("this AsyncGatewayClient's connections belong to another event loop, which is "
                                   "still running: use one client per event loop")
            # That loop has ended (asyncio.run again, say), and the connections' readers with it: start afresh.
            self._close_connections()
        conn = self._conns.get(self.endpoint)
        if conn is None:
            conn = self._conns[self.endpoint] = _Connection(self._ctx, self.endpoint, self.server_public_key)
        return conn

    def _fail_over(self, why: Exception, from_endpoint: str) -> None:
        # Concurrent callers may all see the same gateway fail: only the first of them moves on.
        if self.endpoint == from_endpoint:
            self._current = (self._current + 1) % len(self.endpoints)
            log.warning("%s; trying %s", failed_at(from_endpoint, why),
                        "it again" if self.endpoint == from_endpoint else self.endpoint)

    async def _fits(self, msg, size: int | None) -> None:
        """Ask the gateway whether it takes a frame as large as ``msg``'s (``size``; None: measure it), unless it
        has said so already: its limit may be below the protocol's, and it drops the connection that brings a
        larger frame (every stream on it stalls, and the call itself fails after every retry as if the gateway
        were dead)."""
        if not FrameSizes.concerns(msg):
            return
        size = frame_bytes(msg) if size is None else size
        while (ask := self._frames.question(self.endpoint, msg, size)) is not None:
            answer = None
            try:
                await self._call(ask)
            except ServingError as e:
                answer = e
            self._frames.answered(self.endpoint, msg, size, ask, answer)

    async def _call(self, msg, size: int | None = None):
        await self._fits(msg, size)
        inbox: asyncio.Queue = asyncio.Queue()  # every attempt's answer lands here: a late one is as good
        sent: list[tuple[_Connection, str]] = []
        budget = RetryBudget(self.retries, self.timeout_s)
        closes = self._closes
        try:
            while True:
                conn, rid = self._conn(closes), new_request_id()
                conn.inboxes[rid] = inbox
                sent.append((conn, rid))
                await conn.send(with_request_id(msg, rid))
                reply = await _next(inbox, self.timeout_s)
                _check_open(reply)
                try:
                    if reply is None:
                        raise TimeoutError(f"gateway {conn.endpoint} did not answer within {self.timeout_s}s")
                    raise_for(reply)
                    return reply
                except RETRYABLE as e:
                    await asyncio.sleep(budget.pause_s(e))
                    self._fail_over(e, conn.endpoint)
        finally:
            for conn, rid in sent:
                conn.inboxes.pop(rid, None)

    async def _stream(self, job: AsyncJob, from_index: int, *, chunk_timeout: float | None = None,
                      deadline: float | None = None) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        # StreamState keeps time.monotonic(); the loop's clock is the same clock on every platform we run on,
        # but convert anyway so a deadline means the same instant.
        st = StreamState(job.id, self.api_key, from_index, liveness_s=self.timeout_s, retries=self.retries,
                         chunk_timeout=chunk_timeout,
                         deadline=None if deadline is None else time.monotonic() + (deadline - loop.time()))
        inbox: asyncio.Queue = asyncio.Queue()
        conn: _Connection | None = None
        closes = self._closes
        try:
            while st.done is None:
                if conn is None:
                    conn, req = self._conn(closes), st.request()
                    conn.inboxes[req.request_id] = inbox
                    await conn.send(req)
                msg = await _next(inbox, st.wait_s())
                _check_open(msg)
                if msg is None:
                    if st.on_silence():
                        self._leave(conn, st)
                        self._fail_over(TimeoutError(f"silent for {self.timeout_s}s while streaming job {job.id}"),
                                        conn.endpoint)
                        conn = None
                    continue
                try:
                    chunk = st.on_frame(msg)
                except RETRYABLE as e:
                    pause = st.on_failure(e)
                    self._leave(conn, st)
                    await asyncio.sleep(pause)
                    self._fail_over(e, conn.endpoint)
                    conn = None
                    continue
                if chunk is not None:
                    yield chunk
            job._done = st.done
            to_result(st.done)  # a job that ended otherwise than done raises here, as result() does
        finally:
            if conn is not None:
                self._leave(conn, st)

    def _leave(self, conn: _Connection, st: StreamState) -> None:
        """Stop reading the stream's subscription; unless the job has ended, tell its gateway, which would
        otherwise send it keepalives and every token until then (for ever, for a P3 job that waits for ever:
        each ``result(timeout=...)`` that gave up left one)."""
        conn.inboxes.pop(st.request_id, None)
        if st.done is None:
            conn.send_nowait(st.unsubscribe())

    async def submit(self, prompt: str | None = None, *, prompt_token_ids=None, max_tokens: int = 16,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                     tier: str | None = None, idempotency_key: str | None = None,
                     ignore_eos: bool = False, max_tokens_defaulted: bool = False) -> AsyncJob:
        """As GatewayClient.submit."""
        key = idempotency_key if idempotency_key is not None else auto_idempotency_key()
        with submit_span(self._tracer) as span:
            req, size = sized_submit_request(self.api_key, prompt, prompt_token_ids, max_tokens, temperature, top_p,
                                             top_k, seed, tier, key, ignore_eos, max_tokens_defaulted)
            try:
                reply = await self._call(req, size)
            except ServingError as e:
                reply = await self._call(without_defaulted(req, e))
            on_submit_reply(span, reply)
        return AsyncJob(self, reply.job_id, reply.tier, reply.estimated_wait_s,
                        reply.duplicate and idempotency_key is not None, reply.downgraded)

    async def job(self, job_id: str) -> AsyncJob:
        """As GatewayClient.job."""
        st = await self.status(job_id)
        return AsyncJob(self, st.job_id, st.tier, st.estimated_wait_s or 0.0)

    async def status(self, job_id: str) -> JobStatus:
        return to_status(await self._call(job_request(P.StatusRequest, self.api_key, job_id)))

    async def cancel(self, job_id: str) -> bool:
        return (await self._call(job_request(P.CancelRequest, self.api_key, job_id))).cancelled

    async def info(self, limits: bool = False) -> P.InfoReply:
        """As GatewayClient.info."""
        if limits:
            try:
                return await self._call(P.InfoRequest(self.api_key, limits=True))
            except ServingError as e:
                if not refused_as_unknown(e):
                    raise
        return await self._call(P.InfoRequest(self.api_key))

    def close(self) -> None:
        self._closes += 1
        self._close_connections()

    def _close_connections(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
