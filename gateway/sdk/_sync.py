"""The blocking client: GatewayClient (its Job: _sync_job.py)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Generator, Sequence

import zmq
from opentelemetry import trace

from common import protocol as P
from common.errors import ServingError
from common.sockets import curve_client, make_socket
from gateway.sdk._common import SDK_TRACER, on_submit_reply, submit_span
from gateway.sdk._drops import DROPPED, DropWatch, failure
from gateway.sdk._frames import FrameSizes, frame_bytes
from gateway.sdk._requests import (auto_idempotency_key, cancel_requests, client_settings, endpoint_list, job_request,
                                   new_request_id, server_key, sized_submit_request, with_request_id,
                                   withdraw_request)
from gateway.sdk._results import (Chunk, JobStatus, info_requests, raise_for, refused_as_unknown, to_status,
                                  without_defaulted)
from gateway.sdk._retry import RETRYABLE, RetryBudget, failed_at, outcome_unknown, withdraw_retries
from gateway.sdk._sync_job import Job
from gateway.sdk._sync_sockets import ThreadSockets, reply_to
from gateway.sdk._sync_stream import stream

log = logging.getLogger("gateway.sdk")


class GatewayClient:
    """A blocking client of one cluster. ``endpoint``: one gateway, or a list of the cluster's gateways to fail
    over between. A call that gets no answer within ``timeout_s`` is retried up to ``retries`` times in a row,
    each on the next gateway; one answered ``Unavailable`` is retried with backoff for up to ``timeout_s``. A
    submission keeps its idempotency key across its retries, so it is admitted at most once. Threads may share
    a client: each has its own connections (a ZeroMQ socket must not be used from two threads, and one thread's
    call must not read another's answer)."""

    def __init__(self, endpoint: str | Sequence[str], api_key: str, timeout_s: float = 30.0,
                 tracer_provider: trace.TracerProvider | None = None, *, retries: int = 2,
                 server_public_key: str | bytes | None = None) -> None:
        """``tracer_provider``: where the submit spans go (default: the global one, a no-op unless set).
        ``server_public_key``: the gateways' CURVE public key (z85, or their ``gateway.key`` file) when their
        client socket is encrypted (``client_curve``)."""
        self.server_public_key = server_key(server_public_key)  # z85 bytes, read once
        self.endpoints = endpoint_list(endpoint)
        self.api_key, self.timeout_s, self.retries = client_settings(api_key, timeout_s, retries)
        self._current = 0
        self._frames = FrameSizes()  # per gateway, the frame sizes it said it takes
        self._tracer = trace.get_tracer(SDK_TRACER, tracer_provider=tracer_provider)
        self._ctx = zmq.Context.instance()
        self._local = threading.local()  # each thread's sockets for calls, one per gateway; each stream has its own
        # Every thread's sockets and their drop watches, for close().
        self._open: weakref.WeakSet[zmq.Socket | DropWatch] = weakref.WeakSet()
        self._open_lock = threading.Lock()
        self._moving = threading.Lock()  # one thread at a time moves the client to the next gateway
        self._pid = os.getpid()
        # close() calls so far: a call or stream between two attempts when one came (a pause after Unavailable)
        # ends, rather than open a socket again that nobody would close.
        self._closes = 0
        self._withdrawals: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # submissions given up on

    def _after_fork(self) -> None:
        """In a child process (os.fork, a preforking server), leave the parent's sockets and ZeroMQ context behind
        and start afresh: libzmq's threads do not survive a fork, so a call on them blocked for ever, timeout_s or
        not. (pyzmq does not touch a parent's socket that the child closes or lets go of.)"""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._ctx = zmq.Context.instance()  # pyzmq's instance is per process
        self._local = threading.local()
        self._frames = FrameSizes()  # no socket of this process watched the gateways until now
        self._open = weakref.WeakSet()
        self._open_lock = threading.Lock()  # held by a parent's thread at the fork, it would never be let go
        self._moving = threading.Lock()

    @property
    def _socks(self) -> dict[str, zmq.Socket]:
        """This thread's call sockets, by gateway (a thread that ends takes its own with it)."""
        self._after_fork()
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = ThreadSockets()
        return socks

    @property
    def endpoint(self) -> str:
        """The gateway calls go to now."""
        return self.endpoints[self._current]

    def _call_socket(self, endpoint: str, closes: int) -> zmq.Socket:
        """This thread's socket to ``endpoint``, for a call that began after ``closes`` close() calls."""
        socks = self._socks
        if endpoint not in socks:
            socks[endpoint] = self._new_socket(endpoint, closes, socks.watches)
        return socks[endpoint]

    def _new_socket(self, endpoint: str, closes: int, watches: dict[str, DropWatch] | None = None) -> zmq.Socket:
        """A socket to ``endpoint`` for a call or stream that began after ``closes`` close() calls; watched for
        drops (into ``watches``) if given."""
        self._after_fork()
        sock = make_socket(self._ctx, zmq.DEALER)
        watch = None if watches is None else DropWatch(sock, curve=self.server_public_key is not None)
        # A gateway that refused our handshake (say, CURVE without its key) leaves no pipe to queue on: a send
        # would block for ever. Bounded, it fails like a silent gateway.
        sock.setsockopt(zmq.SNDTIMEO, max(1, math.ceil(1000 * self.timeout_s)))
        if self.server_public_key is not None:  # CURVE: the API key and prompts cross the network encrypted
            curve_client(sock, self.server_public_key)
        sock.connect(endpoint)
        with self._open_lock:
            if closes == self._closes:
                self._open.add(sock)
                if watch is not None:
                    self._open.add(watch)
                    watches[endpoint] = watch
                return sock
        if watch is not None:
            watch.close()
        sock.close(linger=0)
        raise ServingError("the client was closed while this call waited to try again")

    def _fail_over(self, why: Exception, from_endpoint: str) -> None:
        # Threads may all see the same gateway fail: only the first of them moves on (the next, moving again,
        # took the client back to the failed gateway).
        with self._moving:
            if self.endpoint != from_endpoint:
                return
            self._current = (self._current + 1) % len(self.endpoints)
        log.warning("%s; trying %s", failed_at(from_endpoint, why),
                    "it again" if self.endpoint == from_endpoint else self.endpoint)

    def _fits(self, msg, size: int, closes: int) -> str:
        """Ask the current gateway whether it takes a frame as large as ``msg``'s (``size``), unless it has said so
        since its connection last dropped: its limit may be below the protocol's (a restarted gateway's below what
        it said before), and it drops the connection that brings a larger frame (the call fails after every retry
        as if the gateway were dead, and an async client's streams sharing that connection must each resubscribe).
        Asked before every attempt, on the gateway it goes to: a call failed over asks the next gateway too. For a
        call that began after ``closes`` close() calls: one came meanwhile (it forgot what gateways said), the call
        ends rather than ask again.
        Returns the gateway that takes the frame: the one to send it to, wherever other threads move the client."""
        while True:
            if closes != self._closes:
                raise ServingError("the client was closed while this call waited to try again")
            endpoint = self.endpoint
            watch = self._socks.watches.get(endpoint)
            if watch is not None and watch.dropped():  # this thread's connection: others watch their own
                self._frames.forget(endpoint)
            if (ask := self._frames.question(endpoint, msg, size)) is None:
                return endpoint
            # A call of its own, under the asking call's count of close() calls: one that comes meanwhile ends it,
            # and opens no socket after close(). It may fail over: the answer is the gateway's that gave it.
            answered_by, reply = self._answer(ask, closes=closes)
            answer = None
            try:
                raise_for(reply)
            except ServingError as e:
                answer = e
            self._frames.answered(answered_by, msg, size, ask, answer)

    def _call(self, msg, size: int | None = None, retries: int | None = None):
        _, reply = self._answer(msg, size, retries=retries)
        raise_for(reply)
        return reply

    def _answer(self, msg, size: int | None = None, closes: int | None = None, retries: int | None = None):
        """(the gateway that answered, its answer): a reply, or an error reply no further attempt may cure.
        ``closes``: the close() calls counted when the call began (a question _fits asks is part of its call)."""
        if FrameSizes.concerns(msg) and size is None:
            size = frame_bytes(msg)
        request_ids: set[str] = set()  # a late answer to an earlier attempt of this call is as good
        budget = RetryBudget(self.retries if retries is None else retries, self.timeout_s)
        closes = self._closes if closes is None else closes
        while True:
            endpoint = self._fits(msg, size, closes) if size is not None else self.endpoint
            sock = self._call_socket(endpoint, closes)
            # The gateway answers the connection a request came on: once it drops (the gateway died, or dropped a
            # frame over its limit after restarting unseen), no answer can come, and the call retries at once
            # rather than wait out its timeout. A drop before the send is not this request's.
            watch = self._socks.watches.get(endpoint)  # None: another thread closed the client just now
            if watch is not None and watch.dropped():
                self._frames.forget(endpoint)
            (reply, answered_by), silence = (None, None), "took no request"
            # A refused handshake no reconnection cures: nothing sent would reach the gateway.
            if (blocked := watch.blocked(endpoint) if watch is not None else None) is None:
                request_ids.add(rid := new_request_id())
                try:
                    sock.send(P.encode(with_request_id(msg, rid)))
                except zmq.Again:  # no pipe to the gateway: as silent as one that never answers
                    pass
                else:
                    (reply, answered_by), silence = reply_to(self._socks, request_ids, self.timeout_s, watch), \
                        "did not answer"
            try:
                if blocked is not None:
                    raise blocked
                if reply is DROPPED:
                    self._frames.forget(endpoint)
                    raise failure(watch, endpoint, "dropped the connection that took this request")
                if reply is None:
                    raise failure(watch, endpoint, f"{silence} within {self.timeout_s}s")
                raise_for(reply)
            except RETRYABLE as e:
                time.sleep(budget.pause_s(e))
                self._fail_over(e, endpoint)
                continue
            except ServingError:
                pass
            return answered_by, reply

    def _stream(self, job: Job, from_index: int, *, chunk_timeout: float | None = None,
                deadline: float | None = None) -> Generator[Chunk, None, P.JobDone]:
        return stream(self, job, from_index, chunk_timeout=chunk_timeout, deadline=deadline)

    def submit(self, prompt: str | None = None, *, prompt_token_ids=None, max_tokens: int = 16,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
               tier: str | None = None, idempotency_key: str | None = None, ignore_eos: bool = False,
               max_tokens_defaulted: bool = False, stop_token_ids: Sequence[int] | None = None,
               min_tokens: int = 0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               repetition_penalty: float = 1.0) -> Job:
        """Admit a job. Without ``idempotency_key`` one is made for this call, so its retries admit it once.
        ``max_tokens_defaulted``: ``max_tokens`` is not your caller's but a default you sized for it (as the HTTP
        door does): a retry under the same key that sizes another is still the same request. ``stop_token_ids``:
        ids that end the job as EOS does (finish_reason ``stop``, the id last in its output; at most 128);
        ``min_tokens``: no stop id nor EOS is drawn before this many output tokens (vLLM's). ``presence_penalty``
        and ``frequency_penalty`` (OpenAI's, in [-2, 2]) and ``repetition_penalty`` (vLLM's, in (0, 2])."""
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
                    reply = self._call(req, size)
                except ServingError as e:
                    reply = self._call(without_defaulted(req, e))
            except BaseException as e:
                # Unanswered or interrupted, the job may have been admitted all the same, and would run with nobody
                # told its id: withdraw the call's own key, in the background (the gateway may be slow to answer).
                if idempotency_key is None and outcome_unknown(e):
                    thread = threading.Thread(target=self._withdraw, args=(key,), name="tiered-serve-withdraw",
                                              daemon=True)
                    self._withdrawals.add(thread)
                    thread.start()
                raise
            on_submit_reply(span, reply)
        # A duplicate of the call's own key is its own earlier attempt, not an earlier submission.
        return Job(self, reply.job_id, reply.tier, reply.estimated_wait_s,
                   reply.duplicate and idempotency_key is not None, reply.downgraded)

    def _withdraw(self, key: str) -> None:
        try:
            self._call(withdraw_request(self.api_key, key), retries=withdraw_retries(self.retries))
        except (ServingError, TimeoutError) as e:
            log.warning("a submission given up on could not be withdrawn (%s): its job, if it was admitted, runs "
                        "with nobody told its id", e)

    def job(self, job_id: str) -> Job:
        """Re-attach to a job submitted earlier (by any client of this tenant, e.g. before a restart), to
        stream, wait for, inspect or cancel it. ``NotFound`` if there is no such job."""
        st = self.status(job_id)
        return Job(self, st.job_id, st.tier, st.estimated_wait_s or 0.0)

    def status(self, job_id: str) -> JobStatus:
        return to_status(self._call(job_request(P.StatusRequest, self.api_key, job_id)))

    def cancel(self, job_id: str, *, stop_at: int | None = None) -> bool:
        """Cancel the job; False if it had already ended. With ``stop_at``: the caller's answer ended with the job's
        first ``stop_at`` tokens (a stop string it found in their text): the job ends done there (finish_reason
        "stop", those tokens its result) rather than cancelled, once it has made them. Where that cannot be done
        (its worker or the gateway is older, or it is not running now) it is cancelled."""
        return self._first_taken(cancel_requests(self.api_key, job_id, stop_at)).cancelled

    def info(self, limits: bool = False, tokenizer: bool = False) -> P.InfoReply:
        """Gateway id, connected workers and queue depths per tier; with ``limits``, also this key's token limits
        per tier (``tier_token_limits``, ``max_tokens_limit``; None from a gateway too old to say them); with
        ``tokenizer``, the digest of the cluster's tokenizer (``tokenizer_digest``, common/tokenizer_digest.py;
        None while the gateway does not know it, or from one too old to say it)."""
        return self._first_taken(info_requests(self.api_key, limits, tokenizer))

    def _first_taken(self, requests: list):
        """The reply to the first of ``requests`` the gateway understands (an older one refuses a frame with a
        field it does not know: the next asks without it)."""
        *first, last = requests
        for request in first:
            try:
                return self._call(request)
            except ServingError as e:
                if not refused_as_unknown(e):
                    raise
        return self._call(last)

    def close(self) -> None:
        """Close every thread's sockets: call it once the threads using this client are done with it (a stream
        or call still waiting in another thread ends with ServingError, as it would on the async client)."""
        with self._open_lock:
            socks, self._open = list(self._open), weakref.WeakSet()
            self._closes += 1
            self._frames = FrameSizes()  # unwatched from now on: a gateway may restart unseen
        # The drop watches first: their sockets still open, each monitor stops and its reader closes at once
        # (common/monitors; a reader closed under a live monitor froze every ZeroMQ socket of the process).
        for watch in [s for s in socks if isinstance(s, DropWatch)]:
            watch.close()
        for sock in [s for s in socks if not isinstance(s, DropWatch)]:
            sock.close(linger=0)
        self._local = threading.local()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        deadline = time.monotonic() + self.timeout_s  # the withdrawals of submissions given up on go out first
        for thread in list(self._withdrawals):
            thread.join(max(0.0, deadline - time.monotonic()))
        self.close()
