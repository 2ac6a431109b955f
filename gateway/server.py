"""The gateway process: client and worker sockets, admission, dispatch, streaming, maintenance.

run_gateway() -> Gateway.serve() -> one poll loop; each incoming frame is decoded once and
handed to the handler for its kind (a table; unknown kinds and malformed frames get an
ErrorReply and are counted, never crash the loop). Queue state lives in Redis; this
process holds only what it can lose: worker load reports and the token streams of the
jobs it admitted.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable

import msgpack
import zmq

from common import protocol as P
from common import tracing
from common.errors import Forbidden, InvalidRequest, Unauthorized
from common.sockets import make_socket
from common.tiers import ALL_TIERS, Tier, parse_tier
from gateway import admission, security
from gateway.config import GatewayConfig
from gateway.detokenize import IncrementalText
from gateway.spans import GatewaySpans
from gateway.redis_queue import Admitted, Overloaded, QuotaRefused, QuotaSpec, RedisQueue
from gateway.streams import StreamTable
from gateway.tenants import TenantDirectory
from gateway.workers import WorkerRegistry

log = logging.getLogger("gateway")

FINAL_STATES = ("done", "failed", "expired", "cancelled", "dead")


def _ms(t: float) -> int:
    return int(t * 1000)


class Gateway:
    def __init__(self, config: GatewayConfig, queue: RedisQueue, tenants: TenantDirectory,
                 tokenizer=None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.queue = queue
        self.tenants = tenants
        self.tokenizer = tokenizer
        self.clock = clock
        self.workers = WorkerRegistry(config.worker_timeout_s)
        self.hello_policy = security.HelloPolicy()
        self.spans = GatewaySpans()
        self.streams = StreamTable(self._detokenize if tokenizer is not None else None,
                                   (lambda: IncrementalText(tokenizer)) if tokenizer is not None else None)
        self.enqueued_at: dict[str, float] = {}  # job id -> admission time, for the jobs this gateway admitted
        self.counters: Counter = Counter()  # malformed frames, refusals by code, dispatches, ...
        self._dirty = True  # something may be dispatchable
        self._urgent_sent: set[str] = set()  # P0/P1 jobs dispatched by this gateway, not yet finished
        self._last_maintenance = 0.0
        self._measured_rates: dict[Tier, float] = {}  # measured jobs/s per tier, refreshed by maintenance()
        self.ctx = zmq.Context.instance()
        self.clients = make_socket(self.ctx, zmq.ROUTER)
        self.worker_sock = make_socket(self.ctx, zmq.ROUTER)
        self._client_handlers = {
            P.SubmitRequest: self.on_submit, P.StreamRequest: self.on_stream,
            P.StatusRequest: self.on_status, P.CancelRequest: self.on_cancel, P.InfoRequest: self.on_info,
        }
        self._worker_handlers = {
            P.WorkerHello: self.on_hello, P.WorkerLoad: self.on_load,
            P.JobTokens: self.on_tokens, P.JobFinished: self.on_finished,
        }

    # -- plumbing -------------------------------------------------------------------------------------------------

    def bind(self) -> None:
        self.clients.bind(self.config.client_bind)
        self.worker_sock.bind(self.config.worker_bind)

    def close(self) -> None:
        self.clients.close(linger=0)
        self.worker_sock.close(linger=0)

    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        poller = zmq.Poller()
        poller.register(self.clients, zmq.POLLIN)
        poller.register(self.worker_sock, zmq.POLLIN)
        while not should_stop():
            events = dict(poller.poll(timeout=10))
            if self.worker_sock in events:
                self._drain(self.worker_sock, self._worker_handlers)
            if self.clients in events:
                self._drain(self.clients, self._client_handlers)
            now = self.clock()
            if now - self._last_maintenance >= self.config.maintenance_interval_s:
                self._last_maintenance = now
                self.maintenance(now)
            if self._dirty:
                self._dirty = False
                self.dispatch(now)

    def _drain(self, sock: zmq.Socket, handlers: dict) -> None:
        for _ in range(1000):  # bounded, so one busy socket cannot starve the other
            try:
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
                self._send(sock, ident, P.ErrorReply(e.code, str(e)))
                continue
            try:
                handler(ident, msg)
            except Exception:  # a handler bug must not take the gateway down with it
                self.counters["handler_errors"] += 1
                log.exception("handler for %s failed", type(msg).__name__)
                self._send(sock, ident, P.ErrorReply("internal", "internal error"))

    def _send(self, sock: zmq.Socket, ident: bytes, msg) -> None:
        try:
            sock.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            self.counters["unroutable"] += 1  # peer gone or its queue full; it can re-subscribe

    def _error_for(self, e: Exception, job_id: str | None = None) -> P.ErrorReply:
        code = {Unauthorized: "unauthorized", Forbidden: "forbidden", InvalidRequest: "invalid_request"}.get(
            type(e), "invalid_request")
        self.counters[f"refused_{code}"] += 1
        return P.ErrorReply(code, str(e), field=getattr(e, "field", None), in_reply_to=job_id)

    def _reply_error(self, ident: bytes, e: Exception, job_id: str | None = None) -> None:
        self._send(self.clients, ident, self._error_for(e, job_id))

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- clients --------------------------------------------------------------------------------------------------

    def on_submit(self, ident: bytes, req: P.SubmitRequest) -> None:
        with self.spans.admission(req) as span:
            reply = self._admit(req, span)
            if isinstance(reply, P.ErrorReply):
                GatewaySpans.refused(span, reply.code, reply.message)
        self._send(self.clients, ident, reply)

    def _admit(self, req: P.SubmitRequest, span) -> P.SubmitReply | P.ErrorReply:
        max_len = self.workers.max_model_len() or self.config.max_model_len
        tokenize = security.bounded_tokenize(self.tokenizer, max_len) if self.tokenizer is not None else None
        try:
            adm = admission.check(req, self.tenants, tokenize=tokenize, vocab_size=self.workers.vocab_size(),
                                  max_model_len=max_len,
                                  max_tokens_limit=self.config.max_tokens_limit)
        except (Unauthorized, Forbidden, InvalidRequest) as e:
            return self._error_for(e)
        now = self.clock()
        job_id = uuid.uuid4().hex
        t = adm.tenant
        span.set_attributes(tracing.request_attributes(job_id, adm.tier_requested.value, t.name))
        quota = (QuotaSpec(t.p0_rate_per_s, t.p0_burst, t.on_quota_exhausted)
                 if adm.tier_requested is Tier.P0 and t.p0_rate_per_s else None)
        # The job's later spans (queue, dispatch, worker) are children of this admission span.
        parent = tracing.carrier()
        payload = msgpack.packb({
            "prompt_token_ids": adm.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k,
            "seed": req.seed if req.seed is not None else random.getrandbits(63),
            "reply_to": self.config.gateway_id, "trace_context": parent, "ignore_eos": req.ignore_eos,
        })
        result = self.queue.admit(job_id=job_id, tenant=t.name, tier_requested=adm.tier_requested,
                                  tier=adm.tier_requested, payload=payload, now_ms=_ms(now),
                                  idempotency_key=req.idempotency_key, quota=quota,
                                  drain_rate_per_s=self.drain_rates(now))
        if isinstance(result, QuotaRefused):
            self.counters["refused_quota"] += 1
            return P.ErrorReply("quota_exceeded", f"P0 quota of tenant {t.name!r} is spent",
                                retry_after_s=result.retry_after_s)
        if isinstance(result, Overloaded):
            self.counters["refused_overloaded"] += 1
            return P.ErrorReply("overloaded", f"estimated wait {result.estimated_wait_s:.1f}s exceeds the "
                                f"{adm.tier_requested.value} queue timeout", estimated_wait_s=result.estimated_wait_s)
        assert isinstance(result, Admitted)
        GatewaySpans.admitted(span, result.job_id, t.name, adm.tier_requested, result.tier, quota is not None,
                              result.estimated_wait_s, result.position, result.ahead_by_tier)
        if not result.duplicate:
            self.enqueued_at[result.job_id] = now
            self.streams.get_or_create(result.job_id).tenant = t.name
            self._dirty = True
        return P.SubmitReply(result.job_id, result.tier.value, result.estimated_wait_s, result.duplicate,
                             result.tier is not adm.tier_requested)

    def _own_job(self, ident: bytes, api_key: str, job_id: str):
        """The job record if the caller's tenant owns it; else replies with an error and returns None."""
        tenant = self.tenants.lookup(api_key)
        if tenant is None:
            self._reply_error(ident, Unauthorized("unknown API key"), job_id)
            return None
        rec = self.queue.get(job_id) if isinstance(job_id, str) and job_id else None
        if rec is None or rec.tenant != tenant.name:
            self.counters["refused_not_found"] += 1
            self._send(self.clients, ident, P.ErrorReply("not_found", f"no job {job_id!r}", in_reply_to=job_id))
            return None
        return rec

    def on_stream(self, ident: bytes, req: P.StreamRequest) -> None:
        live = self.streams.streams.get(req.job_id)
        tenant = self.tenants.lookup(req.api_key)
        if live is not None and tenant is not None and live.tenant == tenant.name:
            # A job this gateway admitted and is still streaming: no Redis read needed.
            live.subscribers[ident] = max(0, req.from_index)
            self._flush(req.job_id)
            return
        rec = self._own_job(ident, req.api_key, req.job_id)
        if rec is None:
            return
        s = self.streams.streams.get(req.job_id)
        if s is None:
            if rec.state in FINAL_STATES:
                self._send_final(ident, rec, max(0, req.from_index))
                return
            if rec.gateway and rec.gateway != self.config.gateway_id and rec.state == "dispatched":
                self._send(self.clients, ident, P.ErrorReply(
                    "not_found", f"job {req.job_id} streams from gateway {rec.gateway}", in_reply_to=req.job_id))
                return
            s = self.streams.get_or_create(req.job_id)
        s.subscribers[ident] = max(0, req.from_index)
        self._flush(req.job_id)
        if rec.state in FINAL_STATES:
            self._send_final(ident, rec, None)

    def on_status(self, ident: bytes, req: P.StatusRequest) -> None:
        rec = self._own_job(ident, req.api_key, req.job_id)
        if rec is None:
            return
        estimate = rec.estimate_s
        if rec.state == "queued":  # kept current: the work ahead now, at the rates measured now
            rates = self.drain_rates(self.clock())
            estimate = sum(n / rates[t] for t, n in self.queue.jobs_ahead(rec).items())
        else:
            estimate = 0.0
        self._send(self.clients, ident, P.StatusReply(rec.id, str(rec.state.value), rec.tier.value, rec.attempt,
                                                      estimate, rec.reason))

    def on_info(self, ident: bytes, req: P.InfoRequest) -> None:
        if self.tenants.lookup(req.api_key) is None:
            self._reply_error(ident, Unauthorized("unknown API key"))
            return
        depths = {t.value: n for t, n in self.queue.depths().items()}
        self._send(self.clients, ident, P.InfoReply(self.config.gateway_id, sorted(self.workers.workers), depths))

    def on_cancel(self, ident: bytes, req: P.CancelRequest) -> None:
        rec = self._own_job(ident, req.api_key, req.job_id)
        if rec is None:
            return
        before = self.queue.cancel(req.job_id)
        if before is not None and before.state == "dispatched":
            w = self.workers.workers.get(before.worker)
            if w is not None:
                self._send(self.worker_sock, w.identity, P.CancelJob(req.job_id))
        self._send(self.clients, ident, P.CancelReply(req.job_id, before is not None))
        if before is not None:
            self._finish_stream(req.job_id, "cancelled", None, "cancelled by the client")

    # -- workers --------------------------------------------------------------------------------------------------

    def on_hello(self, ident: bytes, msg: P.WorkerHello) -> None:
        if ident != msg.worker_id.encode():
            self.counters["malformed"] += 1
            return
        if (why := self.hello_policy.refusal(msg)) is not None:
            self.counters["hello_refused"] += 1
            log.warning("refused hello from %s: %s", msg.worker_id, why)
            self._send(self.worker_sock, ident, P.ErrorReply("forbidden", f"hello refused: {why}"))
            return
        self.workers.hello(msg, ident, self.clock())
        self._send(self.worker_sock, ident, P.GatewayWelcome(self.config.gateway_id))
        self._dirty = True

    def on_load(self, ident: bytes, msg: P.WorkerLoad) -> None:
        now = self.clock()
        if ident != msg.worker_id.encode() or not self.workers.load(msg, now):
            return
        w = self.workers.workers[msg.worker_id]
        # A job this gateway sent that ended before any report listed it, and whose JobFinished went to
        # another gateway (its reply_to) or that was cancelled or requeued, would hold credit here forever.
        for job_id in list(w.pending):
            rec = self.queue.get(job_id)
            if rec is None or rec.state != "dispatched" or rec.worker != msg.worker_id:
                w.pending.discard(job_id)
        self._urgent_sent &= set().union(*(x.pending for x in self.workers.workers.values()))
        if msg.job_ids:
            self.queue.extend_leases(msg.worker_id, msg.job_ids, _ms(now), _ms(self.config.lease_s))
        self._dirty = True

    def on_tokens(self, ident: bytes, msg: P.JobTokens) -> None:
        if not security.from_registered_worker(self, ident):
            return
        if msg.job_id not in self.streams.streams:
            return  # not ours (or long finished): nothing to forward
        if self.streams.add_tokens(msg.job_id, msg.index, msg.token_ids, self.clock()):
            self._flush(msg.job_id)

    def on_finished(self, ident: bytes, msg: P.JobFinished) -> None:
        if not security.from_registered_worker(self, ident):
            return
        if msg.state not in ("done", "failed"):  # a malformed frame, not a handler error
            self.counters["malformed"] += 1
            self._send(self.worker_sock, ident, P.ErrorReply("protocol", f"JobFinished.state {msg.state!r} is not "
                                                             "done or failed", field="state"))
            return
        now = self.clock()
        s = self.streams.streams.get(msg.job_id)
        tokens = s.tokens if s is not None else []
        fields = {"finish_reason": msg.finish_reason or "", "num_tokens": msg.num_tokens,
                  "token_ids": msgpack.packb(tokens), "run_s": msg.run_s, "preemptions": msg.preemptions,
                  "ttft_s": -1.0 if msg.ttft_s is None else msg.ttft_s}
        if msg.reason:
            fields["reason"] = msg.reason
        if s is not None and s.first_token_at is not None and msg.job_id in self.enqueued_at:
            fields["ttft_s"] = s.first_token_at - self.enqueued_at[msg.job_id]
        if not self.queue.complete(msg.job_id, attempt=msg.attempt, state=msg.state, now_ms=_ms(now),
                                   fields=fields):
            return  # a stale attempt (its lease expired and the job moved on)
        for w in self.workers.workers.values():
            w.pending.discard(msg.job_id)
        self._urgent_sent.discard(msg.job_id)
        self._finish_stream(msg.job_id, msg.state, msg.finish_reason, msg.reason,
                            run_s=msg.run_s, preemptions=msg.preemptions)
        self._dirty = True

    # -- streaming ------------------------------------------------------------------------------------------------

    def _flush(self, job_id: str) -> None:
        for sub, start, ids in self.streams.pending_chunks(job_id):
            text = self.streams.chunk_text(job_id, start)
            self._send(self.clients, sub, P.TokenChunk(job_id, start, ids, text))

    def _finish_stream(self, job_id: str, state: str, finish_reason: str | None, reason: str | None,
                       run_s: float = 0.0, preemptions: int = 0) -> None:
        s = self.streams.streams.pop(job_id, None)
        enq = self.enqueued_at.pop(job_id, None)
        if s is None:
            return
        now = self.clock()
        total = now - enq if enq is not None else 0.0
        ttft = s.first_token_at - enq if (s.first_token_at is not None and enq is not None) else None
        done = P.JobDone(job_id, state, finish_reason, list(s.tokens), self.streams.text(s.tokens, []),
                         queued_s=max(0.0, total - run_s), ttft_s=ttft, total_s=total, preemptions=preemptions,
                         reason=reason)
        for sub, nxt in s.subscribers.items():
            if nxt < len(s.tokens):
                self._send(self.clients, sub, P.TokenChunk(job_id, nxt, s.tokens[nxt:],
                                                           s.decoded.text(nxt) if s.decoded else ""))
            self._send(self.clients, sub, done)

    def _send_final(self, ident: bytes, rec, from_index: int | None) -> None:
        res = rec.result
        tokens = msgpack.unpackb(res["token_ids"]) if res.get("token_ids") else []
        if from_index is not None and from_index < len(tokens):
            self._send(self.clients, ident, P.TokenChunk(rec.id, from_index, tokens[from_index:],
                                                         self.streams.text(tokens[from_index:], tokens[:from_index])))
        total = max(0, (rec.finished_at_ms or rec.enqueued_at_ms) - rec.enqueued_at_ms) / 1000
        run_s = float(res.get("run_s", 0))
        ttft = float(res.get("ttft_s", -1))
        finish = res.get("finish_reason", b"").decode() or None
        self._send(self.clients, ident, P.JobDone(
            rec.id, str(rec.state.value if hasattr(rec.state, "value") else rec.state), finish, tokens,
            self.streams.text(tokens, []), queued_s=max(0.0, total - run_s), ttft_s=ttft if ttft >= 0 else None,
            total_s=total, preemptions=int(res.get("preemptions", 0)), reason=rec.reason or None))

    # -- dispatch and maintenance -----------------------------------------------------------------------------------

    def drain_rates(self, now: float) -> dict[Tier, float]:
        """Jobs per second each tier drains at (measured in Redis, floored until measurements exist)."""
        floor = self.config.default_drain_rate_per_s
        return {t: max(floor, self._measured_rates.get(t, 0.0)) for t in ALL_TIERS}

    def dispatch(self, now: float) -> None:
        if not self.workers.workers:
            return
        credit = self.workers.total_credit()
        if credit > 0:
            ids = self.queue.peek(list(ALL_TIERS), credit)
        else:
            # Everyone is full: P0/P1 may still go, one at a time per worker, to where preemption is cheapest.
            # "One at a time" counts only urgent jobs still unconfirmed: credit-dispatched P2/P3 jobs
            # awaiting the next load report must not hold a P0 back for a heartbeat interval.
            idle = [w for w in self.workers.workers.values() if not w.pending & self._urgent_sent]
            ids = self.queue.peek([Tier.P0, Tier.P1], len(idle)) if idle else []
        if not ids:
            return
        by_worker: dict[str, list[str]] = {}
        reason: dict[str, str] = {}  # why each job goes where it goes, for its dispatch span
        planned: Counter = Counter()
        for job_id in ids:
            w = max(self.workers.workers.values(), key=lambda w: w.credit - planned[w.hello.worker_id])
            reason[job_id] = "credit"
            if w.credit - planned[w.hello.worker_id] <= 0:
                w = self.workers.cheapest_to_preempt()
                reason[job_id] = "cheapest_preemption"
            by_worker.setdefault(w.hello.worker_id, []).append(job_id)
            planned[w.hello.worker_id] += 1
        for wid, job_ids in by_worker.items():
            w = self.workers.workers[wid]
            for rec in self.queue.claim(job_ids, worker=wid, gateway=self.config.gateway_id, now_ms=_ms(now),
                                        lease_ms=_ms(self.config.lease_s)):
                body = msgpack.unpackb(rec.payload)
                ctx = self.spans.dispatched(rec, body.get("trace_context") or {}, wid, reason[rec.id],
                                            int(now * 1e9))
                self._send(self.worker_sock, w.identity, P.DispatchJob(
                    rec.id, rec.attempt, rec.tier.value, rec.tenant, body["prompt_token_ids"], body["max_tokens"],
                    body["temperature"], body["top_p"], body["top_k"], body["seed"], body["reply_to"],
                    ctx, bool(body.get("ignore_eos", False))))
                w.pending.add(rec.id)
                if rec.tier in (Tier.P0, Tier.P1):
                    self._urgent_sent.add(rec.id)
                self.counters["dispatched"] += 1

    def maintenance(self, now: float) -> None:
        for wid in self.workers.expire(now):
            log.warning("worker %s timed out; its leases will expire", wid)
        now_ms = _ms(now)
        for job_id, state in self.queue.requeue_expired(now_ms, self.config.max_attempts):
            self._dirty = True
            if state == "dead":
                self._finish_stream(job_id, "dead", None, "lease expired too many times")
        if self.queue.age(now_ms, _ms(self.config.aging_interval_s)):
            self._dirty = True
        for job_id in self.queue.expire(now_ms):
            self._finish_stream(job_id, "expired", None, "queue timeout exceeded")
        self._measured_rates = {t: st.rate_per_s for t, st in self.queue.drain_stats(now_ms).items()}
        self._dirty = True  # jobs admitted by other gateways, or capacity reported meanwhile


def tier_timeouts(config: GatewayConfig) -> dict[Tier, float | None]:
    return {parse_tier(k): v for k, v in config.tier_timeouts_s.items()} | {
        t: None for t in ALL_TIERS if t.value not in config.tier_timeouts_s}
