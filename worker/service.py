"""The worker process: jobs in from gateways over ZeroMQ, the engine in between, tokens out.

One loop: read every waiting frame (dispatches, cancels: worker/intake.py), run one engine step, send each
job's new tokens to the gateway that dispatched it. Load reports (which extend leases) go out
from a separate thread (worker/heartbeat.py, worker/reporting.py), so a long step never loses a lease. A frame that
cannot be decoded is counted and dropped. JobFinished carries every output token, and is kept,
its job still reported as held, until a gateway confirms it: sent again to every gateway every
second meanwhile (worker/completions.py, worker/redelivery.py), also when it could not be sent at all (a full queue).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import zmq

from common import protocol as P
from common.sockets import make_socket
from worker import metrics
from worker.completions import Unconfirmed
from worker.heartbeat import Heartbeat
from worker.calibration import RateTracker, calibrate
from worker.drain import Drain, Draining
from worker.intake import EarlyStops, Intake, RunningJob
from worker.linger import Linger, offers_room
from worker.redelivery import Redelivery
from worker.reporting import HELLO_EVERY_S, Reporting
from worker.routes import GatewayRoutes
from worker.service_config import WorkerConfig

__all__ = ["HELLO_EVERY_S", "RunningJob", "WorkerService"]  # RunningJob, HELLO_EVERY_S: kept importable from here

log = logging.getLogger("worker")

class WorkerService(Intake, Reporting, Redelivery, Draining):
    def __init__(self, config: WorkerConfig, engine, clock: Callable[[], float] = time.monotonic,
                 tokenizer_digest: str | None = None, weights_digest: str | None = None) -> None:
        self.config = config
        self.engine = engine
        self.clock = clock
        self.tokenizer_digest = tokenizer_digest  # said in each hello: common/tokenizer_digest.py
        self.weights_digest = weights_digest  # and common/model_digest.py
        self.ctx = zmq.Context.instance()
        ident = config.worker_id.encode()
        self.sockets = [make_socket(self.ctx, zmq.DEALER, identity=ident) for _ in config.gateways]
        # Which gateways are connected (worker/routes.py), and which refuse this worker's handshake.
        self.routes = GatewayRoutes(self.sockets, list(config.gateways), curve=bool(config.gateway_public_key))
        self.jobs: dict[str, RunningJob] = {}
        self.early_stops = EarlyStops()  # stops of attempts whose dispatch has not come yet (worker/intake.py)
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
        log.info("completions sent again for want of a confirmation: %d (and %d copies refused); left to their "
                 "lease: %d", self.unconfirmed.resent, self.unconfirmed.refused, self.unconfirmed.given_up)
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

    def _poller(self) -> zmq.Poller:
        """What the loop waits on: every gateway socket, and its connection events (worker/routes.py)."""
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        self.routes.register(poller)
        return poller

    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        poller = self._poller()
        self._refresh_snapshot(self.clock())
        with self._lock:
            self._beat()  # the first report now, not a heartbeat after the hello: no gateway sends work before it
        if not self._heartbeat.is_alive():
            self._heartbeat.start()
        while not should_stop():
            if self._draining_done():
                return
            busy = self.engine.has_unfinished()
            self._take_waiting(poller, self.linger.poll_ms(self.clock()) if busy else 20)
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

    def _take_waiting(self, poller: zmq.Poller, timeout_ms: int) -> None:
        """Every waiting frame and connection event (waiting up to ``timeout_ms`` for one), then the repairs they
        call for (worker/redelivery.py). The events first: a drop is reported before any frame of the connection
        after it, and such a frame read first was taken for the last heard before the drop (worker/routes.py)."""
        with self._lock:
            ready = [sock for sock, _ in poller.poll(timeout=timeout_ms)]
            for mon in (s for s in ready if s in self.routes.monitors):
                for gone in self.routes.read(mon, self.clock()):
                    self._reroute(gone)
            for sock in (s for s in ready if s not in self.routes.monitors):
                self.routes.heard[sock] = self.clock()
                self._drain(sock)
            self._reconnect_silent()
            self._resend_unconfirmed()

    def _finish(self, sock: zmq.Socket, msg: P.JobFinished) -> None:
        # Kept either way: one the gateway's full queue refused is due again at once, and goes to every gateway
        # (before, it was retried on that gateway's socket alone, which never drains if the gateway is gone).
        self.unconfirmed.sent(msg, self.clock(), delivered=self._send(sock, msg))

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
                if job.stop_at is not None and len(job.tokens) >= job.stop_at:
                    self._end_at_stop(job)  # its answer ended there, whether or not the engine's run did
                elif out.finished:
                    failed = out.error is not None  # its step failed (e.g. out of memory); the engine goes on
                    self._complete(job, "failed" if failed else "done",
                                   out.finish_reason.value if out.finish_reason and not failed else None,
                                   list(job.tokens), out.num_preemptions, out.error, now)

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
