"""The gateway process: client and worker sockets, admission, dispatch, streaming, maintenance.

run_gateway() -> Gateway.serve() -> one poll loop; each incoming frame is decoded once and
handed to the handler for its kind (a table; unknown kinds and malformed frames get an
ErrorReply and are counted, never crash the loop). Queue state lives in Redis; this
process holds only what it can lose: worker load reports and the token streams of the
jobs it admitted. The handlers live in mixins, one module each: client_api (submit,
status, info, cancel), streaming, worker_link (frames from workers), dispatch, maintenance.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import redis
import zmq

from common import protocol as P
from common.errors import Forbidden, InvalidRequest, Unauthorized
from common.sockets import make_socket
from common.tiers import ALL_TIERS, Tier, parse_tier
from gateway.client_api import REDIS_FULL_LOG_EVERY_S, ClientApi
from gateway import estimate_dump, metrics, promises, security
from gateway.config import GatewayConfig
from gateway.detokenize import IncrementalText
from gateway.drained import SharedDrained
from gateway.dispatch import Dispatcher
from gateway.keepalive import Keepalives
from gateway.maintenance import Maintenance
from gateway.outage import KeptFrames, OutageFrames
from gateway.redis_queue import RedisQueue, out_of_memory
from gateway.spans import GatewaySpans
from gateway.streaming import Streaming
from gateway.streams import StreamTable
from gateway.token_log import TokenLog
from gateway.tenants import TenantDirectory
from gateway.wait_estimator import WaitEstimator
from gateway.waits import Waits
from gateway.worker_link import WorkerLink, new_stale_memory
from gateway.workers import WorkerRegistry

log = logging.getLogger("gateway")

# Where a client reply goes: the client's routing id and the request id to echo on every frame of the reply.
# Client handlers receive one instead of a bare routing id; stream subscribers are keyed by it, so one
# connection can hold several streams (even of the same job) at once.
Peer = tuple[bytes, "str | None"]
# A full Redis refused a write of the background work (dispatch, results, maintenance): it tries again after this.
REDIS_FULL_RETRY_S = 0.5
# Client frames handled in a row while a dispatch is pending. An admission costs milliseconds (its wait estimate),
# and a burst of them drained at once kept freed slots idle for as long, a lag no estimate counted.
CLIENT_DRAIN_BUDGET_S = 0.01


class Gateway(ClientApi, WorkerLink, OutageFrames, Streaming, Dispatcher, Maintenance):
    """The poll loop and the sockets; the handlers live in the mixins, one module per concern."""

    def __init__(self, config: GatewayConfig, queue: RedisQueue, tenants: TenantDirectory,
                 tokenizer=None, clock: Callable[[], float] = time.monotonic) -> None:
        # ``clock`` times intervals (keepalives, maintenance, worker timeouts, waits), so it must not step: a wall
        # clock set back an hour stopped them all for an hour. What must agree across processes (scores, leases,
        # quotas, deadlines, span times) uses Redis's TIME instead.
        promises.check(config.promise_factor, config.promise_lead_s)
        self.promise_tiers = promises.tiers(config.promise_tiers)
        if config.wait_futures < 0:
            raise ValueError(f"wait_futures must be >= 0, got {config.wait_futures}")
        self.config = config
        self.queue = queue
        self.tenants = tenants
        self.tokenizer = tokenizer
        self.clock = clock
        self.workers = WorkerRegistry(config.worker_timeout_s)
        self.hello_policy = security.HelloPolicy()
        self.spans = GatewaySpans()
        self.estimator = WaitEstimator(queue, self.workers, clock, config.aging_interval_s,
                                       learn_bias=config.wait_bias_correction, futures=config.wait_futures,
                                       step_cost=config.wait_step_cost,
                                       dump=estimate_dump.DumpWriter(config.estimate_dump)
                                       if config.estimate_dump else None)
        self.waits = Waits()  # measured waits: admission until first prefill
        self.streams = StreamTable(self._detokenize if tokenizer is not None else None,
                                   (lambda: IncrementalText(tokenizer)) if tokenizer is not None else None)
        self.keepalives = Keepalives(config.keepalive_interval_s)
        self._last_keepalive = 0.0
        self.enqueued_at: dict[str, float] = {}  # job id -> admission time, for the jobs this gateway admitted
        self.counters: Counter = Counter()  # malformed frames, refusals by code, dispatches, ...
        self._dirty = True  # something may be dispatchable
        self._urgent_sent: set[str] = set()  # P0/P1 jobs dispatched by this gateway, not yet finished
        self._last_maintenance = 0.0
        self._listening_since = self.clock()  # when this gateway last began to hear workers (maintenance.py)
        self._hello_asked: OrderedDict[bytes, float] = OrderedDict()  # worker peers asked to say hello, and when
        self.worker_keys: security.WorkerKeys | None = None  # with CURVE on the worker socket (security.py)
        self.frame_key: str | None = None  # CURVE key (z85) of the worker frame being handled, with worker_keys
        self._measured_rates: dict[Tier, float] = {}  # measured jobs/s per tier, refreshed by maintenance()
        self.token_log = TokenLog(queue.client, queue.keys)
        # The cluster's memory of drained workers (worker_link._track_drain): as long as this gateway's own, and
        # the worker's timeout, since it counts from the worker's last draining report.
        self.drained_memory = SharedDrained(queue.client, queue.keys,
                                            self.workers.drained_memory_s + self.workers.timeout_s, self._redis_failed)
        self.leases: dict[str, tuple[str, int]] = {}  # job id -> (worker, attempt) of the leases this gateway holds
        self._stale_seen = new_stale_memory()
        self._strays_checked: dict[str, float] = {}  # worker id -> load_at of its report stop_strays checked
        self._strays_told: OrderedDict = OrderedDict()  # (worker, job, attempt) -> when stop_strays told it
        self._unstored: list = []  # (worker, JobFinished) that arrived while Redis was unreachable
        self._last_tokens_io = 0.0
        self._redis_backoff_s = 0.0  # > 0 while Redis is unreachable: wait this long between tries
        self._redis_retry_at = 0.0
        self.kept = KeptFrames()  # worker frames that need Redis, kept during its back-off (outage.py)
        self._background_retry_at = 0.0  # a full Redis refused the background work's writes: wait until then
        self._redis_full_logged_at = float("-inf")  # when a full Redis was last logged (client_api)
        self.ctx = zmq.Context.instance()
        self.clients = make_socket(self.ctx, zmq.ROUTER)
        self.worker_sock = make_socket(self.ctx, zmq.ROUTER)
        self._client_handlers = {
            P.SubmitRequest: self.on_submit, P.StreamRequest: self.on_stream,
            P.StatusRequest: self.on_status, P.CancelRequest: self.on_cancel, P.InfoRequest: self.on_info,
        }
        self._worker_handlers = {
            P.WorkerHello: self.on_hello, P.WorkerLoad: self.on_load,
            P.JobTokens: self.on_tokens, P.JobFinished: self.on_finished, P.JobReleased: self.on_released,
        }

    # -- plumbing -------------------------------------------------------------------------------------------------

    def bind(self) -> None:
        self.clients.bind(self.config.client_bind)
        self.worker_sock.bind(self.config.worker_bind)

    def close(self) -> None:
        self.clients.close(linger=0)
        self.worker_sock.close(linger=0)
        if self.estimator.dump is not None:
            self.estimator.dump.close()

    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        poller, clients_only = zmq.Poller(), zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.worker_sock, zmq.POLLIN)
        clients_only.register(self.clients, zmq.POLLIN)
        while not should_stop():
            # The frames kept during a back-off go first, and the background work only after them: after a Redis
            # freeze, the reports kept extend the leases before a maintenance pass may take them for expired.
            if self.kept and not self._redis_down():
                self.replay_kept()
            redis_down = self.clock() < self._redis_retry_at
            # With no room left to keep worker frames, they wait in their socket (see _drain): not polled, not spun on.
            events = dict((clients_only if redis_down and self.kept.full() else poller).poll(timeout=10))
            if self.worker_sock in events:
                self._drain(self.worker_sock, self._worker_handlers)
            if self.clients in events:
                self._drain(self.clients, self._client_handlers)
            now = self.clock()
            if now - self._last_keepalive >= self.config.maintenance_interval_s:
                self._last_keepalive = now
                # Also while Redis is down: a client must not fail over from a gateway waiting out a blip.
                self.send_keepalives(now, redis_up=now >= self._redis_retry_at)
            if redis_down or now < max(self._redis_retry_at, self._background_retry_at):
                continue
            try:
                self._background(now)
            except redis.RedisError as e:
                self._redis_failed(e)
            else:
                self._redis_ok()

    def _background(self, now: float) -> None:
        """Everything besides answering frames; all of it needs Redis."""
        self.retry_unstored()
        if now - self._last_tokens_io >= self.config.stream_flush_interval_s:
            self._last_tokens_io = now
            self.flush_token_log()
            self.follow_token_log(now)
        if now - self._last_maintenance >= self.config.maintenance_interval_s:
            previous, self._last_maintenance = self._last_maintenance, now
            self.maintenance(now, previous)
        if self._dirty:
            self._dirty = False
            self.dispatch(now)

    def _redis_failed(self, e: Exception) -> None:
        """Redis is unreachable: back off (0.1 s doubling to 2 s) and keep serving what needs no Redis."""
        if out_of_memory(e):
            self._redis_full(e)
            return
        self.counters["redis_errors"] += 1
        if not self._redis_backoff_s:
            log.warning("Redis unreachable (%s); admission answers 'unavailable' until it is back", e)
        self._redis_backoff_s = min(2.0, max(0.1, self._redis_backoff_s * 2))
        self._redis_retry_at = self.clock() + self._redis_backoff_s
        self._dirty = True

    def _redis_down(self) -> bool:
        """Redis did not answer lately and the back-off is not over: a site that tries Redis and goes on without it
        (keepalives, the shared memories of drained workers and worker keys) skips it, rather than wait out the
        socket timeout again, one try after another, while no client hears even 'unavailable'."""
        return self.clock() < self._redis_retry_at

    def _redis_full(self, e: Exception) -> None:
        """Redis is reachable but at its maxmemory (noeviction) and refused a write. Reads, streams and cancels
        still work, so clients are not refused as if it were down; the work that writes waits a moment and tries
        again (a completion is kept until it is stored). Redis refuses only a script's first write that may use
        memory, so scripts that open with one that cannot (a claim's ZREM, a heartbeat's) still run in full."""
        self.counters["redis_full"] += 1
        now = self.clock()
        if now - self._redis_full_logged_at >= REDIS_FULL_LOG_EVERY_S:
            self._redis_full_logged_at = now
            log.warning("Redis is full (%s): dispatches and results wait for room; raise maxmemory or free memory", e)
        self._background_retry_at = now + REDIS_FULL_RETRY_S
        self._dirty = True  # a dispatch it refused is tried again with the rest

    def _redis_ok(self) -> None:
        if self._redis_backoff_s:
            log.warning("Redis reachable again")
            self._redis_backoff_s = 0.0

    def _drain(self, sock: zmq.Socket, handlers: dict) -> None:
        started = time.monotonic()
        for _ in range(1000):  # bounded, so one busy socket cannot starve the other
            if sock is self.worker_sock and self.holding_back() and self.kept.full():
                # Redis is known down: most worker frames need it (a report extends leases, a completion is
                # stored), and each would stand the loop still for Redis's socket timeout, one after another
                # (reports come every 0.5 s per worker): no client heard even 'unavailable', no stream a keepalive.
                # They are kept aside for the end of the back-off (outage.py); with no room left to keep them, they
                # wait in the socket, behind the kept ones (a completion is also sent again until confirmed).
                return
            if sock is self.clients and self._dirty and time.monotonic() - started >= CLIENT_DRAIN_BUDGET_S:
                return  # a slot may be free: dispatch first (the rest wait in the socket, and the loop comes back)
            try:
                if sock is self.worker_sock and self.worker_keys is not None:
                    frames, self.frame_key = security.recv_with_key(sock)
                else:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.counters["malformed"] += 1
                continue
            ident, frame = frames
            try:
                msg = P.decode(frame, authorize=self.tenants.lookup if sock is self.clients else None)
                handler = handlers.get(type(msg))
                if handler is None:
                    raise P.ProtocolError(f"{type(msg).__name__} is not accepted on this socket")
            except P.ProtocolError as e:
                self.counters["malformed"] += 1
                to = ident
                if sock is self.clients:
                    metrics.refused(e.code)  # e.g. an unknown API key, refused before the frame is decoded
                    rid = _request_id_of(frame)
                    to = (ident, rid) if rid is not None else ident
                self._send(sock, to, P.ErrorReply(e.code, str(e)))
                continue
            to = ident
            if sock is self.clients:
                rid = msg.request_id
                if rid is not None and not 0 < len(rid) <= P.MAX_REQUEST_ID_LEN:
                    self.counters["malformed"] += 1
                    self._send(sock, ident, P.ErrorReply(
                        "protocol", f"request_id must be 1 to {P.MAX_REQUEST_ID_LEN} characters", field="request_id"))
                    continue
                to = (ident, rid)
            if sock is self.clients and self.clock() < self._redis_retry_at:
                self._refuse(to, msg, self._unavailable())
                continue
            if sock is self.worker_sock and self.holding_back() and not self.needs_no_redis(ident, msg):
                self.keep_aside(ident, msg, len(frame))
                continue
            self._handle(sock, to, msg, handler)

    def _handle(self, sock: zmq.Socket, to: bytes | Peer, msg, handler: Callable) -> None:
        """``handler(to, msg)``: a Redis error starts the back-off (and refuses a client), a bug is logged."""
        try:
            handler(to, msg)
        except redis.RedisError as e:
            self._redis_failed(e)
            if sock is self.clients:
                self._refuse(to, msg, P.ErrorReply("overloaded", "the queue store (Redis) is full; retry later")
                             if out_of_memory(e) else self._unavailable())
        except Exception:  # a handler bug must not take the gateway down with it
            self.counters["handler_errors"] += 1
            log.exception("handler for %s failed", type(msg).__name__)
            self._send(sock, to, P.ErrorReply("internal", "internal error"))

    def _send(self, sock: zmq.Socket, to: bytes | Peer, msg) -> None:
        ident = to
        if isinstance(to, tuple):  # a client: echo its request id, and note that its stream is alive
            ident, rid = to
            if rid is not None:
                msg = dataclasses.replace(msg, request_id=rid)
            self.keepalives.sent(to, self.clock(), final=isinstance(msg, (P.JobDone, P.ErrorReply)))
        try:
            sock.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.counters["unroutable"] += 1  # peer gone or its queue full; it can re-subscribe
            if isinstance(to, tuple):
                self.keepalives.sent(to, 0.0, final=True)
                if e.errno == zmq.EHOSTUNREACH:
                    # Its connection is gone (the blocking client closes a stream's socket when its caller stops
                    # reading), and a connection never comes back: a re-subscription comes on a new one. Kept, the
                    # subscription had every token batch of its job sent into the void until the job ended.
                    self.streams.forget_peer(to)

    def _refuse(self, to: Peer, msg, reply: P.ErrorReply) -> None:
        """A client request refused for the queue store's sake; a submission's refusal is counted as on_submit's."""
        if isinstance(msg, P.SubmitRequest):
            metrics.refused(reply.code)
        self._send(self.clients, to, reply)

    def _unavailable(self) -> P.ErrorReply:
        self.counters["refused_unavailable"] += 1
        return P.ErrorReply("unavailable", "the queue (Redis) is unreachable; nothing was stored, retry",
                            retry_after_s=max(0.1, self._redis_retry_at - self.clock()))

    def _error_for(self, e: Exception, job_id: str | None = None) -> P.ErrorReply:
        code = {Unauthorized: "unauthorized", Forbidden: "forbidden", InvalidRequest: "invalid_request"}.get(
            type(e), "invalid_request")
        self.counters[f"refused_{code}"] += 1
        return P.ErrorReply(code, str(e), field=getattr(e, "field", None), in_reply_to=job_id)

    def _reply_error(self, ident: bytes, e: Exception, job_id: str | None = None) -> None:
        self._send(self.clients, ident, self._error_for(e, job_id))

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def tier_timeouts(config: GatewayConfig) -> dict[Tier, float | None]:
    return {parse_tier(k): v for k, v in config.tier_timeouts_s.items()} | {
        t: None for t in ALL_TIERS if t.value not in config.tier_timeouts_s}


def _request_id_of(frame: bytes) -> str | None:
    """The request id of a client frame refused before it was decoded, so the error reaches its caller.
    Only small frames are read again, and under the decoder's caps: a flood of large ones, or of nested lists,
    costs no more than before."""
    if len(frame) > 64 * 1024:
        return None
    try:
        body = P.loads(frame, max_containers=16).get("b")  # a request holds a few (its body, ids, trace context)
        rid = body.get("request_id") if isinstance(body, dict) else None
    except Exception:  # noqa: BLE001 - unreadable: the error goes out without an id
        return None
    return rid if isinstance(rid, str) and 0 < len(rid) <= P.MAX_REQUEST_ID_LEN else None
