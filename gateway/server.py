"""The gateway process: client and worker sockets, admission, dispatch, streaming, maintenance.

run_gateway() -> Gateway.serve() -> one poll loop; each incoming frame is decoded once and
handed to the handler for its kind (a table; unknown kinds and malformed frames get an
ErrorReply and are counted, never crash the loop). Queue state lives in Redis; this
process holds only what it can lose: worker load reports and the token streams of the
jobs it admitted. The handlers live in mixins, one module each: client_api (submit,
status, info, cancel), streaming, worker_link (frames from workers), dispatch, maintenance;
so do the loop's own parts: frames (draining, decoding, replies), redis_backoff (Redis
unreachable or full) and outage (worker frames kept during a back-off).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import redis
import zmq

from common import protocol as P
from common import tokenizer_digest
from common.sockets import make_socket
from common.tiers import ALL_TIERS, Tier, parse_tier
from gateway.client_api import ClientApi
from gateway.client_cancel import ClientCancels
from gateway import estimate_dump, promises, security
from gateway.config import GatewayConfig
from gateway.detokenize import IncrementalText
from gateway.drained import SharedDrained
from gateway.dispatch import Dispatcher
from gateway.hello_policy import HelloPolicy
from gateway.model_pin import ModelPin
# Peer, CLIENT_DRAIN_BUDGET_S, _request_id_of and REDIS_FULL_RETRY_S were defined here; still importable from here.
from gateway.frames import CLIENT_DRAIN_BUDGET_S, Frames, Peer, _request_id_of  # noqa: F401
from gateway.keepalive import Keepalives
from gateway.maintenance import Maintenance
from gateway.outage import KeptFrames, OutageFrames
from gateway.redis_backoff import REDIS_FULL_RETRY_S, RedisBackoff  # noqa: F401
from gateway.redis_queue import RedisQueue
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


class Gateway(ClientApi, ClientCancels, WorkerLink, OutageFrames, Streaming, Dispatcher, Maintenance, Frames,
              RedisBackoff):
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
        self.hello_policy = HelloPolicy(None if tokenizer is None else tokenizer_digest.digest(tokenizer))
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
        # As long as a worker's key binding (security.py): it outlives whatever a worker may hold.
        self.model_pin = ModelPin(queue.client, queue.keys, 2 * max(config.lease_s, config.worker_timeout_s),
                                  self._redis_down, self._redis_failed)
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
        self._answer_clients_first = False  # client frames that waited out a failed Redis try are answered first
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
            redis_down = self._redis_down()
            # With no room left to keep worker frames, they wait in their socket (see _drain): not polled, not spun on.
            events = dict((clients_only if redis_down and self.kept.full() else poller).poll(timeout=10))
            if self.worker_sock in events:
                self._drain(self.worker_sock, self._worker_handlers)
            if self.clients in events:
                self._drain(self.clients, self._client_handlers)
            else:
                self._clients_answered()
            now = self.clock()
            if now - self._last_keepalive >= self.config.maintenance_interval_s:
                self._last_keepalive = now
                # Also while Redis is down: a client must not fail over from a gateway waiting out a blip.
                self.send_keepalives(now, redis_up=not self._redis_down())
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

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def tier_timeouts(config: GatewayConfig) -> dict[Tier, float | None]:
    return {parse_tier(k): v for k, v in config.tier_timeouts_s.items()} | {
        t: None for t in ALL_TIERS if t.value not in config.tier_timeouts_s}
