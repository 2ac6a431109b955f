"""The asyncio client: AsyncGatewayClient (its AsyncJob: gateway.sdk._async_job).

One connection per gateway (_async_connection) carries every call and stream of the client at once; each request
gets a request id, under which its answers reach it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence

import zmq.asyncio
from opentelemetry import trace

from common import protocol as P
from common.errors import ServingError
from gateway.sdk._async_connection import _check_open, _Connection
from gateway.sdk._async_job import AsyncJob
from gateway.sdk._common import SDK_TRACER, on_submit_reply, submit_span
from gateway.sdk._drops import DROPPED, failure
from gateway.sdk._frames import FrameSizes, frame_bytes
from gateway.sdk._requests import (auto_idempotency_key, cancel_requests, client_settings, endpoint_list, job_request,
                                   new_request_id, server_key, sized_submit_request, with_request_id,
                                   withdraw_request)
from gateway.sdk._results import (Chunk, JobStatus, info_requests, raise_for, refused_as_unknown,
                                  to_result, to_status, without_defaulted)
from gateway.sdk._retry import RETRYABLE, RetryBudget, failed_at, outcome_unknown, withdraw_retries
from gateway.sdk._stream_state import StreamState

log = logging.getLogger("gateway.sdk")


class AsyncGatewayClient:
    """GatewayClient for asyncio: the same surface with ``await``; any number of concurrent calls and streams
    from any number of coroutines share one connection per gateway. It serves one running event loop at a time;
    once that loop has ended, the next one to use it gets new connections."""

    def __init__(self, endpoint: str | Sequence[str], api_key: str, timeout_s: float = 30.0,
                 tracer_provider: trace.TracerProvider | None = None, *, retries: int = 2,
                 server_public_key: str | bytes | None = None) -> None:
        self.server_public_key = server_key(server_public_key)  # as GatewayClient's
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
        self._withdrawals: set[asyncio.Task] = set()  # submissions given up on, being withdrawn (_withdraw_later)

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
            self._frames = FrameSizes()  # no connection of this process watched the gateways until now
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
            conn = self._conns[self.endpoint] = _Connection(self._ctx, self.endpoint, self.server_public_key,
                                                            on_drop=self._forget_frames)
        return conn

    def _forget_frames(self, endpoint: str) -> None:
        self._frames.forget(endpoint)  # the client's current FrameSizes: close() and a fork replace it

    def _fail_over(self, why: Exception, from_endpoint: str) -> None:
        # Concurrent callers may all see the same gateway fail: only the first of them moves on.
        if self.endpoint == from_endpoint:
            self._current = (self._current + 1) % len(self.endpoints)
            log.warning("%s; trying %s", failed_at(from_endpoint, why),
                        "it again" if self.endpoint == from_endpoint else self.endpoint)

    async def _fits(self, msg, size: int, closes: int) -> None:
        """As GatewayClient._fits: ask the current gateway, before every attempt, unless it said it takes the size
        since its connection last dropped. A frame over its limit drops the connection, and with it every stream of
        this client's there: they resubscribe from their next undelivered index, and the call fails after every
        retry."""
        while True:
            conn = self._conn(closes)
            conn.seen_drops()  # a drop not yet read forgets what the gateway said, now
            if (ask := self._frames.question(conn.endpoint, msg, size)) is None:
                return
            # The answer is the gateway's that gave it: the question may fail over, and other calls may move the
            # client on while it waits.
            endpoint, reply = await self._answer(ask, closes=closes)
            answer = None
            try:
                raise_for(reply)
            except ServingError as e:
                answer = e
            self._frames.answered(endpoint, msg, size, ask, answer)

    async def _call(self, msg, size: int | None = None, retries: int | None = None):
        _, reply = await self._answer(msg, size, retries=retries)
        raise_for(reply)
        return reply

    async def _answer(self, msg, size: int | None = None, closes: int | None = None, retries: int | None = None):
        """(the gateway that answered, its answer): a reply, or an error reply no further attempt may cure.
        ``closes``: the close() calls counted when the call began (a question _fits asks is part of its call)."""
        if FrameSizes.concerns(msg) and size is None:
            size = frame_bytes(msg)
        inbox: asyncio.Queue = asyncio.Queue()  # every attempt's answer lands here: a late one is as good
        sent: dict[str, _Connection] = {}  # request id -> the connection it went on
        budget = RetryBudget(self.retries if retries is None else retries, self.timeout_s)
        closes = self._closes if closes is None else closes
        try:
            while True:
                if size is not None:
                    await self._fits(msg, size, closes)
                conn, rid = self._conn(closes), new_request_id()
                conn.inboxes[rid] = inbox
                sent[rid] = conn
                drops = conn.seen_drops()  # a drop before the send is not this request's
                # A refused handshake no reconnection cures: nothing sent would reach the gateway.
                if (blocked := conn.watch.blocked(conn.endpoint)) is None:
                    await conn.send(with_request_id(msg, rid))
                    reply = await conn.next_frame(inbox, self.timeout_s, drops)
                    _check_open(reply)
                try:
                    if blocked is not None:
                        raise blocked
                    if reply is DROPPED:
                        raise failure(conn.watch, conn.endpoint, "dropped the connection that took this request")
                    if reply is None:
                        raise failure(conn.watch, conn.endpoint, f"did not answer within {self.timeout_s}s")
                    raise_for(reply)
                except RETRYABLE as e:
                    await asyncio.sleep(budget.pause_s(e))
                    self._fail_over(e, conn.endpoint)
                    continue
                except ServingError:
                    pass
                # No request id: the unknown-key refusal every call on the connection gets.
                return sent.get(reply.request_id, conn).endpoint, reply
        finally:
            for rid, conn in sent.items():
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
                blocked = None
                if conn is None:
                    conn, req = self._conn(closes), st.request()
                    conn.inboxes[req.request_id] = inbox
                    drops = conn.seen_drops()  # a drop before the subscription went is not its own
                    # A refused handshake no reconnection cures: the subscription would never reach the gateway.
                    if (blocked := conn.watch.blocked(conn.endpoint)) is None:
                        await conn.send(req)
                msg = DROPPED if blocked is not None else await conn.next_frame(inbox, st.wait_s(), drops)
                _check_open(msg)
                if msg is None:
                    if st.on_silence():
                        self._leave(conn, st)
                        self._fail_over(TimeoutError(f"silent for {self.timeout_s}s while streaming job {job.id}"),
                                        conn.endpoint)
                        conn = None
                    continue
                try:
                    if msg is DROPPED:
                        # As the blocking client's: the subscription went with the connection; resubscribe now from
                        # the next index not delivered (frames still coming under the old request id are dropped).
                        raise failure(conn.watch, conn.endpoint,
                                      f"dropped the connection of the stream of job {job.id}")
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
                     ignore_eos: bool = False, max_tokens_defaulted: bool = False,
                     stop_token_ids: Sequence[int] | None = None, min_tokens: int = 0,
                     presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                     repetition_penalty: float = 1.0) -> AsyncJob:
        """As GatewayClient.submit."""
        key = idempotency_key if idempotency_key is not None else auto_idempotency_key()
        with submit_span(self._tracer) as span:
            req, size = sized_submit_request(self.api_key, prompt, prompt_token_ids, max_tokens, temperature, top_p,
                                             top_k, seed, tier, key, ignore_eos, max_tokens_defaulted,
                                             stop_token_ids=stop_token_ids, min_tokens=min_tokens,
                                             presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                             repetition_penalty=repetition_penalty,
                                             retry_key=idempotency_key is None)
            try:
                try:
                    reply = await self._call(req, size)
                except ServingError as e:
                    reply = await self._call(without_defaulted(req, e))
            except BaseException as e:
                # Cancelled (wait_for, a TaskGroup) or unanswered, the job may have been admitted all the same, and
                # would run with nobody told its id: withdraw the call's own key. A caller's key is theirs to reuse.
                if idempotency_key is None and outcome_unknown(e):
                    self._withdraw_later(key)
                raise
            on_submit_reply(span, reply)
        return AsyncJob(self, reply.job_id, reply.tier, reply.estimated_wait_s,
                        reply.duplicate and idempotency_key is not None, reply.downgraded)

    def _withdraw_later(self, key: str) -> None:
        task = asyncio.get_running_loop().create_task(self._withdraw(key))
        self._withdrawals.add(task)  # a task only the loop refers to may be collected before it ends
        task.add_done_callback(self._withdrawals.discard)

    async def _withdraw(self, key: str) -> None:
        try:
            await self._call(withdraw_request(self.api_key, key), retries=withdraw_retries(self.retries))
        except (ServingError, TimeoutError) as e:
            log.warning("a submission given up on could not be withdrawn (%s): its job, if it was admitted, runs "
                        "with nobody told its id", e)

    async def job(self, job_id: str) -> AsyncJob:
        """As GatewayClient.job."""
        st = await self.status(job_id)
        return AsyncJob(self, st.job_id, st.tier, st.estimated_wait_s or 0.0)

    async def status(self, job_id: str) -> JobStatus:
        return to_status(await self._call(job_request(P.StatusRequest, self.api_key, job_id)))

    async def cancel(self, job_id: str, *, stop_at: int | None = None) -> bool:
        """As GatewayClient.cancel."""
        return (await self._first_taken(cancel_requests(self.api_key, job_id, stop_at))).cancelled

    async def info(self, limits: bool = False, tokenizer: bool = False) -> P.InfoReply:
        """As GatewayClient.info."""
        return await self._first_taken(info_requests(self.api_key, limits, tokenizer))

    async def _first_taken(self, requests: list):
        """The reply to the first of ``requests`` the gateway understands (an older one refuses a frame with a
        field it does not know: the next asks without it)."""
        *first, last = requests
        for request in first:
            try:
                return await self._call(request)
            except ServingError as e:
                if not refused_as_unknown(e):
                    raise
        return await self._call(last)

    def close(self) -> None:
        self._closes += 1
        self._close_connections()

    def _close_connections(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._frames = FrameSizes()  # unwatched from now on: a gateway may restart unseen

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc) -> None:
        if self._withdrawals:  # the withdrawals of submissions given up on go out before the connections close
            await asyncio.wait(self._withdrawals, timeout=self.timeout_s)
        self.close()
