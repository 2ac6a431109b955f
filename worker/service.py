"""The worker process: jobs in from gateways over ZeroMQ, the engine in between, tokens out.

One loop: read every waiting frame (dispatches, cancels), run one engine step, send each
job's new tokens to the gateway that streams it, and report load (which extends leases)
every heartbeat interval. A frame that cannot be decoded is counted and dropped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from common import protocol as P
from common.errors import InvalidRequest
from common.sockets import make_socket
from common.tiers import ALL_TIERS
from worker.calibration import RateTracker, calibrate
from worker.request import RequestStatus, SamplingParams
from worker.service_config import WorkerConfig

log = logging.getLogger("worker")

HELLO_EVERY_S = 5.0  # re-announce, so a restarted gateway learns about this worker


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    reply: zmq.Socket  # the gateway that streams this job
    started: float
    sent: int = 0  # tokens sent so far (the next JobTokens.index)
    first_token: float | None = None


class WorkerService:
    def __init__(self, config: WorkerConfig, engine, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.engine = engine
        self.clock = clock
        self.ctx = zmq.Context.instance()
        ident = config.worker_id.encode()
        self.sockets = [make_socket(self.ctx, zmq.DEALER, identity=ident) for _ in config.gateways]
        self.by_gateway: dict[str, zmq.Socket] = {}
        self.jobs: dict[str, RunningJob] = {}
        self.counters: Counter = Counter()
        self.rates = RateTracker(engine, clock)
        self._last_beat = 0.0
        self._last_hello = 0.0

    def connect(self) -> None:
        for sock, endpoint in zip(self.sockets, self.config.gateways):
            sock.connect(endpoint)
        calibrate(self.engine, self.rates)  # the first heartbeat carries measured rates
        self._hello()

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)

    def _send(self, sock: zmq.Socket, msg) -> None:
        try:
            sock.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.counters["send_dropped"] += 1  # gateway gone or slow; leases will sort it out

    def _hello(self) -> None:
        e = self.engine
        hello = P.WorkerHello(self.config.worker_id, self.config.model, e.vocab_size, e.max_model_len,
                              e.config.max_num_seqs, e.blocks.num_blocks)
        for s in self.sockets:
            self._send(s, hello)
        self._last_hello = self.clock()

    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        while not should_stop():
            busy = self.engine.has_unfinished()
            for sock, _ in poller.poll(timeout=0 if busy else 20):
                self._drain(sock)
            if self.engine.has_unfinished():
                self._step()
            now = self.clock()
            if now - self._last_beat >= self.config.heartbeat_interval_s:
                self._heartbeat(now)
            if now - self._last_hello >= HELLO_EVERY_S:
                self._hello()

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(1000):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode(frame)
            except P.ProtocolError as e:
                self.counters["malformed"] += 1
                log.warning("dropped a malformed frame: %s", e)
                continue
            if isinstance(msg, P.DispatchJob):
                self._dispatch(sock, msg)
            elif isinstance(msg, P.CancelJob):
                self._cancel(msg.job_id)
            elif isinstance(msg, P.GatewayWelcome):
                self.by_gateway[msg.gateway_id] = sock
            elif isinstance(msg, P.ErrorReply):
                self.counters["gateway_errors"] += 1
                log.warning("gateway says: %s %s", msg.code, msg.message)
            else:
                self.counters["unexpected"] += 1

    def _dispatch(self, sock: zmq.Socket, msg: P.DispatchJob) -> None:
        reply = self.by_gateway.get(msg.reply_to, sock)
        if msg.job_id in self.jobs:  # re-dispatched here after its lease expired: start over
            self.engine.abort(msg.job_id)
            del self.jobs[msg.job_id]  # else a refused re-dispatch leaves it reported (its lease renewed) forever
        params = SamplingParams(max_tokens=msg.max_tokens, temperature=msg.temperature, top_k=msg.top_k,
                                top_p=msg.top_p, seed=msg.seed, ignore_eos=msg.ignore_eos)
        try:
            self.engine.add_request(msg.job_id, msg.prompt_token_ids, params, tier=msg.tier, tenant=msg.tenant,
                                    trace_context=msg.trace_context)
        except InvalidRequest as e:
            self._send(reply, P.JobFinished(msg.job_id, msg.attempt, "failed", None, 0, None, 0.0, 0, str(e)))
            return
        self.jobs[msg.job_id] = RunningJob(msg.job_id, msg.attempt, reply, self.clock())
        self.rates.added(msg.job_id)
        self._last_beat = 0.0  # confirm it now: the gateway counts it against this worker's credit until then

    def _cancel(self, job_id: str) -> None:
        if self.engine.abort(job_id):
            self.jobs.pop(job_id, None)
            self.rates.forget(job_id)

    def _step(self) -> None:
        self.rates.before_step()
        outs = self.engine.step()
        self.rates.after_step(outs)
        now = self.clock()
        for out in outs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            if job.first_token is None:
                job.first_token = now
            started = self.rates.prefill_start_s(job.job_id) if job.sent == 0 else None
            self._send(job.reply, P.JobTokens(job.job_id, job.attempt, job.sent, out.new_token_ids, started))
            job.sent += len(out.new_token_ids)
            if out.finished:
                del self.jobs[job.job_id]
                self._send(job.reply, P.JobFinished(
                    job.job_id, job.attempt, "done", out.finish_reason.value if out.finish_reason else None,
                    job.sent, None if job.first_token is None else job.first_token - job.started,
                    now - job.started, out.num_preemptions, prefill_start_s=self.rates.prefill_start_s(job.job_id)))
                self.rates.forget(job.job_id)
                self._last_beat = 0.0  # report the free slot now, not at the next beat: the wait estimate counts on it

    def log_state(self) -> None:
        """Log every request the engine holds (on SIGUSR1): what an operator needs when a job seems stuck."""
        s = self.engine.scheduler
        for r in s.running + s.waiting:
            log.info("%s %s %s mode=%s computed=%d out=%d/%d preempted=%d", r.request_id, r.tier.value,
                     r.status.value, r.preempt_mode, r.num_computed_tokens, len(r.output_token_ids),
                     r.params.max_tokens, r.num_preemptions)
        log.info("jobs=%d kv=%s stats=%s counters=%s", len(self.jobs), self.engine.kv_usage(), s.stats,
                 dict(self.counters))

    def _heartbeat(self, now: float) -> None:
        self._last_beat = now
        e = self.engine
        running = {t.value: 0 for t in ALL_TIERS}
        waiting = {t.value: 0 for t in ALL_TIERS}
        for r in e.scheduler.running:
            running[r.tier.value] += 1
        for r in e.scheduler.waiting:
            waiting[r.tier.value] += 1
        free_slots = max(0, e.config.max_num_seqs - len(e.scheduler.running) - len(e.scheduler.waiting))
        low_running = any(r.tier.rank >= 2 and r.status is RequestStatus.RUNNING for r in e.scheduler.running)
        cost = 0.0 if free_slots or low_running else 1e6  # keep-mode preemption of a P2/P3 costs nothing
        load = P.WorkerLoad(self.config.worker_id, free_slots, e.blocks.num_free, running, waiting,
                            list(self.jobs), cost, *self.rates.rates(), self.rates.work())
        for s in self.sockets:
            self._send(s, load)
