"""The worker process: jobs in from gateways over ZeroMQ, the engine in between, tokens out.

One loop: read every waiting frame (dispatches, cancels), run one engine step, send each
job's new tokens to the gateway that dispatched it. Load reports (which extend leases) go out
from a separate thread (worker/heartbeat.py), so a long step never loses a lease. A frame that
cannot be decoded is counted and dropped. JobFinished carries every output token, and is kept,
its job still reported as held, until a gateway confirms it: sent again to every gateway every
second meanwhile (worker/completions.py), also when it could not be sent at all (a full queue).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import zmq

from common import protocol as P
from common.errors import InvalidRequest
from common.sockets import make_socket
from worker import load_report, metrics
from worker.completions import Unconfirmed
from worker.heartbeat import Heartbeat
from worker.calibration import RateTracker, calibrate
from worker.drain import Drain, Draining
from worker.linger import Linger, offers_room
from worker.request import SamplingParams
from worker.routes import SILENT_RECONNECT_S, GatewayRoutes
from worker.service_config import WorkerConfig

log = logging.getLogger("worker")

HELLO_EVERY_S = 5.0  # re-announce, so a restarted gateway learns about this worker


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    reply: zmq.Socket  # the gateway that streams this job
    started: float
    tokens: list[int] = field(default_factory=list)  # every output token so far (the next index is its length)
    first_token: float | None = None


class WorkerService(Draining):
    def __init__(self, config: WorkerConfig, engine, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.engine = engine
        self.clock = clock
        self.ctx = zmq.Context.instance()
        ident = config.worker_id.encode()
        self.sockets = [make_socket(self.ctx, zmq.DEALER, identity=ident) for _ in config.gateways]
        self.routes = GatewayRoutes(self.sockets)  # which gateways are connected (worker/routes.py)
        self.jobs: dict[str, RunningJob] = {}
        self.counters: Counter = Counter()
        # Every socket use, from the step loop and the heartbeat thread; reentrant: a dispatch read under it may be
        # handed back at once (worker/drain.py), which sends under it too.
        self._lock = threading.RLock()
        # Completions no gateway has confirmed yet (sent, or not even that: a full queue).
        self.unconfirmed = Unconfirmed(observe=metrics.unconfirmed_completions)
        # Hand-backs no gateway has confirmed yet (worker/drain.py): sent again, never reported as held.
        self.unconfirmed_releases = Unconfirmed()
        self._snapshot: P.WorkerLoad | None = None  # what the heartbeat thread sends
        self._sent: P.WorkerLoad | None = None  # the last report that went out: what the gateways know
        self._snapshot_at = float("-inf")
        self._beat_pending = False
        self._heartbeat = Heartbeat(self._lock, self._beat, self._hello, config.heartbeat_interval_s, HELLO_EVERY_S)
        self.rates = RateTracker(engine, clock)
        # The wait for the answer to a report offering room (worker/linger.py).
        self.linger = Linger(config.dispatch_linger_s, observe=metrics.dispatch_linger)
        self.drain = Drain(config.drain_timeout_s)  # the shutdown: worker/drain.py

    def connect(self) -> None:
        for sock, endpoint in zip(self.sockets, self.config.gateways):
            sock.connect(endpoint)
        prefill, decode = calibrate(self.engine, self.rates)  # the first heartbeat carries measured rates
        # Logged in this form for operators and for scripts/bench_estimate.py --load, which sizes its
        # replay from the capacity the gateways are told.
        log.info("calibrated: prefill %.1f tokens/s, decode %.1f tokens/s per sequence, %d slots",
                 prefill, decode, self.engine.config.max_num_seqs)
        self._hello()

    def close(self) -> None:
        log.info("dispatch linger: %d reports offered room, waited on %d, answered in time %d",
                 self.linger.offers, self.linger.waits, self.linger.answers)
        log.info("completions sent again for want of a confirmation: %d; left to their lease: %d",
                 self.unconfirmed.resent, self.unconfirmed.given_up)
        self._heartbeat.stop()
        with self._lock:
            self.routes.close()
            for s in self.sockets:
                s.close(linger=0)

    def _send(self, sock: zmq.Socket, msg) -> bool:
        if hasattr(msg, "sent_at_s"):  # stamped as sent: a gateway reading it late learns so (gateway/waits.py)
            msg = replace(msg, sent_at_s=self.clock())
        try:
            sock.send(P.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.counters["send_dropped"] += 1  # gateway gone or slow; leases will sort it out
            return False

    def _hello(self, sockets: list[zmq.Socket] | None = None) -> None:
        e = self.engine
        hello = P.WorkerHello(self.config.worker_id, self.config.model, e.vocab_size, e.max_model_len,
                              e.config.max_num_seqs, e.blocks.num_blocks, e.tier_limits(),
                              e.config.max_num_batched_tokens, resumes=True, draining=self.drain.active)
        for s in self.sockets if sockets is None else sockets:
            self._send(s, hello)
        # And the latest report at once: a gateway gives a worker it knows from a hello alone no credit (a hello
        # names its slots, not which are free), so one that restarted would otherwise wait for the next heartbeat.
        self._beat(sockets)

    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        self.routes.register(poller)
        self._refresh_snapshot(self.clock())
        with self._lock:
            self._beat()  # the first report now, not a heartbeat after the hello: no gateway sends work before it
        if not self._heartbeat.is_alive():
            self._heartbeat.start()
        while not should_stop():
            if self._draining_done():
                return
            busy = self.engine.has_unfinished()
            with self._lock:
                for sock, _ in poller.poll(timeout=self.linger.poll_ms(self.clock()) if busy else 20):
                    if sock in self.routes.monitors:
                        for gone in self.routes.read(sock):
                            self._reroute(gone)
                    else:
                        self.routes.heard[sock] = self.clock()
                        self._drain(sock)
                self._reconnect_silent()
                self._resend_unconfirmed()
            if busy and self.linger.poll_ms(self.clock()):
                continue  # a frame came, not the dispatch the last report offered room for: wait on
            # Before the step too: the heartbeat thread sends only what was last published, and a job
            # just dispatched must be in it before a step that may outlast the job's lease (its prefill).
            self._publish()
            if self.engine.has_unfinished():
                started = self.clock()
                self._step()
                offered, before = self._publish()
                if offered and offers_room(self._snapshot, before):
                    now = self.clock()
                    self.linger.offered(now, now - started)
            else:
                self._publish()

    def _publish(self) -> tuple[bool, P.WorkerLoad | None]:
        """Refresh the snapshot the heartbeat thread sends; send it now if jobs came or went. Returns whether it
        went now, and the report sent before it (a refresh in between may never have gone out)."""
        now = self.clock()
        if self._beat_pending or now - self._snapshot_at >= self.config.heartbeat_interval_s / 2:
            self._refresh_snapshot(now)
        if not self._beat_pending:
            return False, self._sent
        self._beat_pending = False
        with self._lock:
            before = self._sent
            self._beat()
        return True, before

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
                self._cancel(msg.job_id, msg.attempt)
            elif isinstance(msg, P.JobFinishedAck):
                self.unconfirmed.confirmed(msg.job_id, msg.attempt)
                self.unconfirmed_releases.confirmed(msg.job_id, msg.attempt)
            elif isinstance(msg, P.GatewayWelcome):
                pass  # nothing to learn: a job's tokens go back on the socket its dispatch came in on
            elif isinstance(msg, P.ErrorReply) and msg.code == P.HELLO_FIRST:
                # The gateway restarted, or forgot this worker: what was sent to it meanwhile is lost.
                self._hello([sock])
                self._replay_tokens(sock, [job for job in self.jobs.values() if job.reply is sock])
            elif isinstance(msg, P.ErrorReply):
                self.counters["gateway_errors"] += 1
                log.warning("gateway says: %s %s", msg.code, msg.message)
            else:
                self.counters["unexpected"] += 1

    def _dispatch(self, sock: zmq.Socket, msg: P.DispatchJob) -> None:
        if msg.attempt < 1:
            # Attempts count from 1 (claim.lua): a buggy gateway's frame. Taken for a stale copy, it got no answer
            # and the job waited out its lease in silence; answered as an invalid job is, and nothing here touched.
            self.counters["invalid_dispatches"] += 1
            self._finish(sock, P.JobFinished(msg.job_id, msg.attempt, "failed", None, 0, None, 0.0, 0,
                                             f"invalid dispatch: attempt must be >= 1, got {msg.attempt}", []))
            return
        newest = max([a for j, a in self.unconfirmed.attempts() if j == msg.job_id]
                     + ([self.jobs[msg.job_id].attempt] if msg.job_id in self.jobs else []), default=0)
        if msg.attempt <= newest:
            # A copy of a frame, or an older attempt's delayed past a newer one (on another gateway's connection):
            # run, it would start the current attempt over, or replace it with one whose frames are all stale.
            self.counters["duplicate_dispatches" if msg.attempt == newest else "stale_dispatches"] += 1
            log.warning("dropped a dispatch of job %s attempt %d: attempt %d is here", msg.job_id, msg.attempt,
                        newest)
            return
        if msg.job_id in self.jobs:  # re-dispatched here after its lease expired: start over
            self.engine.abort(msg.job_id)
            del self.jobs[msg.job_id]  # else a refused re-dispatch leaves it reported (its lease renewed) forever
            self.rates.forget(msg.job_id)  # and its timing, which holds the aborted request, kept for good
        params = SamplingParams(max_tokens=msg.max_tokens, temperature=msg.temperature, top_k=msg.top_k,
                                top_p=msg.top_p, seed=msg.seed, ignore_eos=msg.ignore_eos)
        self.linger.dispatched(self.clock())  # a job refused below answered the offer all the same
        if self.drain.active:  # sent before the gateway read the report offering nothing
            self._release({msg.job_id: msg.attempt}, "draining: not started")
            return
        try:
            self.engine.add_request(msg.job_id, msg.prompt_token_ids, params, tier=msg.tier, tenant=msg.tenant,
                                    trace_context=msg.trace_context, output_token_ids=msg.resume_token_ids)
        except InvalidRequest as e:
            # A gateway validates what it sends against this worker's hello: a refusal here is a buggy or
            # mismatched gateway, which went unseen (no log line, no count) while its jobs failed.
            self.counters["invalid_dispatches"] += 1
            log.warning("refused a dispatch of job %s attempt %d: %s", msg.job_id, msg.attempt, e)
            self._finish(sock, P.JobFinished(msg.job_id, msg.attempt, "failed", None, 0, None, 0.0, 0, str(e), []))
            return
        # Resumed: its output so far (as the engine kept it) is the start of what it streams and returns.
        resumed = list(self.engine.get_request(msg.job_id).output_token_ids)
        if resumed:
            log.info("job %s attempt %d resumes after %d tokens", msg.job_id, msg.attempt, len(resumed))
        # Its tokens go back on the socket the dispatch came in on (reply_to names that gateway). Looked up by the id
        # gateways welcomed this worker with, a welcome naming another gateway's id (a buggy one, or two started with
        # one id) took its tokens.
        self.jobs[msg.job_id] = RunningJob(msg.job_id, msg.attempt, sock, self.clock(), resumed)
        self.rates.added(msg.job_id)
        self._beat_soon()  # confirm it now: the gateway counts it against this worker's credit until then

    def _cancel(self, job_id: str, attempt: int | None) -> None:
        job = self.jobs.get(job_id)
        if job is not None and attempt is not None and job.attempt > attempt:
            self.counters["stale_cancels"] += 1  # meant for an earlier attempt; this one is current
            return
        if self.engine.abort(job_id):
            self.jobs.pop(job_id, None)
            self.rates.forget(job_id)
            self._beat_soon()  # its slot is free: a gateway counts it busy, and the job held, until a report

    def _finish(self, sock: zmq.Socket, msg: P.JobFinished) -> None:
        # Kept either way: one the gateway's full queue refused is due again at once, and goes to every gateway
        # (before, it was retried on that gateway's socket alone, which never drains if the gateway is gone).
        self.unconfirmed.sent(msg, self.clock(), delivered=self._send(sock, msg))

    def _reroute(self, gone: zmq.Socket) -> None:
        """The connection to a gateway was lost: its jobs' tokens go to a connected one, every token so far first
        (worker/routes.py)."""
        other = self.routes.other_than(gone)
        moved = [job for job in self.jobs.values() if job.reply is gone] if other is not None else []
        for job in moved:
            job.reply = other
        self._replay_tokens(other, moved)
        if moved:
            self.counters["rerouted"] += len(moved)
            log.warning("lost the connection to a gateway: %d jobs now stream through another", len(moved))

    def _reconnect_silent(self) -> None:
        """A gateway that answers no hello may hold this worker's identity on a dead pipe (worker/routes.py)."""
        for sock in self.routes.silent(dict(zip(self.sockets, self.config.gateways)), self.clock()):
            log.warning("gateway %s answered nothing for %.0f s: connecting to it anew",
                        self.config.gateways[self.sockets.index(sock)], SILENT_RECONNECT_S)
            self._hello([sock])
            self._replay_tokens(sock, [job for job in self.jobs.values() if job.reply is sock])

    def _replay_tokens(self, sock: zmq.Socket, jobs: list[RunningJob]) -> None:
        """Every token so far of ``jobs``, through ``sock``: a gateway that dropped their token frames (it restarted)
        or that takes over their streams has a gap that would hold every client of the job until its completion
        filled it. The gateway takes the tokens it has already seen as seen (a frame counts from the first index it
        lacks)."""
        for job in jobs:
            if job.tokens:
                self._send(sock, P.JobTokens(job.job_id, job.attempt, 0, list(job.tokens)))

    def _resend_unconfirmed(self) -> None:
        now = self.clock()
        due = self.unconfirmed.due(now)
        releases = self.unconfirmed_releases.due(now)
        if not due and not releases:
            return
        # To every gateway: the one that dispatched it may be restarting, or gone for good, and any gateway can
        # store a completion (the lease in Redis says whose it is); the others take their copy as stale. A hello
        # first: a gateway restarted since drops the frames of a worker it has not heard one from.
        self._hello()
        now = self.clock()
        for msg, first_sent in due:
            late = msg if msg.prefill_start_age_s is None else replace(
                msg, prefill_start_age_s=msg.prefill_start_age_s + max(0.0, now - first_sent))
            for sock in self.sockets:
                self._send(sock, late)
            self.unconfirmed.sent(msg, now)
        for msg, _ in releases:
            for sock in self.sockets:
                self._send(sock, msg)
            self.unconfirmed_releases.sent(msg, now)

    def _step(self) -> None:
        self.rates.before_step()
        before = self._running_ids()
        outs = self.engine.step()
        self.rates.after_step(outs)
        if self._running_ids() != before:
            # A job started, resumed or gave way: gateways send P0/P1 jobs on the victims a report lists
            # and estimate waits from what runs, so report it now, not up to a heartbeat interval later.
            self._beat_soon()
        now = self.clock()
        with self._lock:
            for out in outs:
                job = self.jobs.get(out.request_id)
                if job is None:
                    continue
                first = job.first_token is None  # only the first tokens' frame says when the prefill started
                if first:
                    job.first_token = now
                started = self.rates.prefill_start_s(job.job_id) if first else None
                age = self.rates.prefill_start_age_s(job.job_id, now) if first else None
                self._send(job.reply, P.JobTokens(job.job_id, job.attempt, len(job.tokens), out.new_token_ids, started,
                                                  age))
                job.tokens.extend(out.new_token_ids)
                if out.finished:
                    del self.jobs[job.job_id]
                    failed = out.error is not None  # its step failed (e.g. out of memory); the engine goes on
                    self._finish(job.reply, P.JobFinished(
                        job.job_id, job.attempt, "failed" if failed else "done",
                        out.finish_reason.value if out.finish_reason and not failed else None,
                        len(job.tokens), None if job.first_token is None else job.first_token - job.started,
                        now - job.started, out.num_preemptions, out.error, list(job.tokens),
                        prefill_start_s=self.rates.prefill_start_s(job.job_id),
                        prefill_start_age_s=self.rates.prefill_start_age_s(job.job_id, now)))
                    self.rates.forget(job.job_id)
                    self._beat_soon()  # report the free slot now, not at the next beat: the wait estimate counts on it

    def _running_ids(self) -> set[str]:
        return {r.request_id for r in self.engine.scheduler.running}

    def log_state(self) -> None:
        """Log every request the engine holds (on SIGUSR1): what an operator needs when a job seems stuck."""
        s = self.engine.scheduler
        for r in s.running + s.waiting:
            log.info("%s %s %s mode=%s computed=%d out=%d/%d preempted=%d", r.request_id, r.tier.value,
                     r.status.value, r.preempt_mode, r.num_computed_tokens, len(r.output_token_ids),
                     r.params.max_tokens, r.num_preemptions)
        log.info("jobs=%d kv=%s stats=%s counters=%s", len(self.jobs), self.engine.kv_usage(), s.stats,
                 dict(self.counters))

    def _beat_soon(self) -> None:
        """Send a fresh load report after this loop iteration rather than at the next heartbeat."""
        self._beat_pending = True

    def _beat(self, sockets: list[zmq.Socket] | None = None) -> None:
        if self._snapshot is not None:
            report = replace(self._snapshot, age_s=max(0.0, self.clock() - self._snapshot_at))
            # A list, not any(generator): every gateway gets it.
            if any([self._send(s, report) for s in (self.sockets if sockets is None else sockets)]):
                self._sent = self._snapshot

    def _refresh_snapshot(self, now: float) -> None:
        """The load report the heartbeat thread sends until the next refresh (built here: engine state
        is only read on the step loop's thread)."""
        self._snapshot_at = now
        held = list(dict.fromkeys([*self.jobs, *self.unconfirmed.job_ids()]))
        self._snapshot = load_report.build(self.config.worker_id, self.engine, self.rates, held,
                                           offer=not self.drain.active)
