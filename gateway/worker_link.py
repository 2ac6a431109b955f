"""Worker frames: hello, load reports (which extend leases), token frames, job completions and hand-backs.

Fencing: a JobTokens / JobFinished frame counts only if it comes from the worker holding the
job's current lease, for the current attempt (known from this gateway's own claims, else read
from Redis once). Anything else is dropped and counted as ``stale_frames``. A completion is
stored as done only with every token (``JobFinished.token_ids``, counted against num_tokens);
one that Redis cannot take right now is kept and retried, never dropped (gateway/worker_completions.py).

A mixin of gateway.server.Gateway.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

from common import protocol as P
from gateway import metrics, security
from gateway.model_pin import UNKNOWN as UNKNOWN_PIN
from gateway.model_pin import UNREADABLE as UNREADABLE_PIN
from gateway.waits import first_prefill_ms
from gateway.worker_completions import WorkerCompletions

log = logging.getLogger("gateway")
STALE_MEMORY = 4096  # (job, attempt, worker) triples remembered as stale, so a flood costs no Redis reads
# How long a triple stays stale without another read: Redis that lost a claim (AOF everysec and a crash, a failover)
# shows the job queued under a worker still running it, and its claim again, for the same attempt on the same worker,
# makes that worker's frames the lease holder's. Remembered for good, they stayed stale: the job's stream stalled and
# its completion was confirmed as stale and lost, so it waited out its lease and ran again.
STALE_RECHECK_S = 1.0


class WorkerLink(WorkerCompletions):
    """Handlers of WorkerHello, WorkerLoad, JobTokens, JobFinished and JobReleased."""

    def on_hello(self, ident: bytes, msg: P.WorkerHello) -> None:
        if ident != msg.worker_id.encode():
            self.counters["malformed"] += 1
            return
        self._follow_model_pin(self.model_pin.read())
        if (why := self.hello_policy.refusal(msg)) is not None:
            self._refuse_hello(ident, msg, why)
            return
        if not security.room_for_worker(self, ident, msg.worker_id):  # before its key is bound: a refusal binds nothing
            return
        if self.worker_keys is not None and (
                bound := self.worker_keys.claim(msg.worker_id, self.frame_key, self.workers.workers)) is not None:
            self.counters["hello_wrong_key"] += 1
            log.warning("refused hello from %s: it said hello with key %s here, this one is %s", msg.worker_id,
                        bound, self.frame_key)
            self._send(self.worker_sock, ident, P.ErrorReply("forbidden", "hello refused: this worker id belongs "
                                                                           "to another key"))
            return
        self.hello_policy.pin(msg)  # only now: a hello refused for its key had pinned another model for good
        confirmed = self._follow_model_pin(self.model_pin.keep(msg))
        if confirmed and (why := self.hello_policy.refusal(msg)) is not None:
            self._refuse_hello(ident, msg, why)  # another gateway pinned another model since the read above
            return
        self._hello_asked.pop(ident, None)
        if not confirmed and msg.worker_id not in self.workers.workers:
            log.warning("took worker %s while Redis did not answer: it gets no job until Redis says its model is the "
                        "cluster's", msg.worker_id)
        if (forgotten := self.workers.hello(msg, ident, self.clock(), confirmed)) is not None:
            security.forgot_worker(self, forgotten, msg.worker_id)
        self._track_drain(msg.worker_id)
        self._send(self.worker_sock, ident, P.GatewayWelcome(self.config.gateway_id))
        self._dirty = True

    def _refuse_hello(self, ident: bytes, msg: P.WorkerHello, why: str) -> None:
        self.counters["hello_refused"] += 1
        log.warning("refused hello from %s: %s", msg.worker_id, why)
        self._send(self.worker_sock, ident, P.ErrorReply("forbidden", f"hello refused: {why}"))
        self._hello_asked[ident] = math.inf  # asking it for another would only repeat the refusal

    def _follow_model_pin(self, pinned) -> bool:
        """Hold hellos to the cluster's model (gateway/model_pin.py); False where Redis did not answer."""
        if pinned is UNKNOWN_PIN:
            return False
        if pinned is not UNREADABLE_PIN:
            self.hello_policy.follow(pinned)
        return True

    def on_load(self, ident: bytes, msg: P.WorkerLoad) -> None:
        now = self.clock()
        if not security.from_registered_worker(self, ident):
            return
        if ident != msg.worker_id.encode() or not self.workers.load(msg, now):
            return
        self.waits.worker_clocks.heard(msg.worker_id, msg.sent_at_s, now)
        if self.worker_keys is not None:
            self.worker_keys.refresh(msg.worker_id, self.frame_key)
        self._track_drain(msg.worker_id)
        self._dirty = True
        if self._redis_down():
            # A read above timed out (and started the back-off): the leases wait for a later report, rather than the
            # loop for a second timeout in a row (4 s in which no client heard even 'unavailable').
            return
        w = self.workers.workers[msg.worker_id]
        due = w.unconfirmed or self.model_pin.due(msg.worker_id)
        if due and self._follow_model_pin(self.model_pin.keep(w.hello)):
            if (why := self.hello_policy.refusal(w.hello)) is not None:
                # Taken while Redis did not answer, by this gateway's memory alone, and the cluster serves another
                # model: kept, its jobs' answers would come from another model than their neighbours', marked done.
                # Dropped, its leases run out (not extended below) and their jobs go to the cluster's model; its
                # frames are a stranger's, and its next hello is refused.
                del self.workers.workers[msg.worker_id]
                self.counters["workers_of_another_model"] += 1
                log.error("dropped worker %s, taken while Redis did not answer: %s", msg.worker_id, why)
                return
            if w.unconfirmed:
                log.info("worker %s serves the cluster's model, as Redis says: it gets jobs now", msg.worker_id)
                w.unconfirmed = False
        # A job this gateway sent that ended before any report listed it, and whose JobFinished went to
        # another gateway or that was cancelled or requeued, would hold credit here forever.
        for job_id in list(w.pending):
            rec = self.queue.get(job_id)
            if rec is None or rec.state != "dispatched" or rec.worker != msg.worker_id:
                w.pending.discard(job_id)
        self._urgent_sent &= set().union(*(x.pending for x in self.workers.workers.values()))
        if msg.job_ids:
            self.queue.extend_leases(msg.worker_id, msg.job_ids, None, int(self.config.lease_s * 1000))

    def _track_drain(self, worker_id: str) -> None:
        """Tell the cluster's memory of drained workers (gateway/drained.py) whether ``worker_id`` drains, and
        read that memory again when due: on the workers' cadence, since only with workers heard does it matter
        (their hellos and reports are what admission and dispatch go by)."""
        memory = self.drained_memory
        now = self.clock()
        if not self._redis_down():  # else Redis is known to be down: the copy read last decides meanwhile
            w = self.workers.workers[worker_id]
            if w.draining:
                memory.note(worker_id, w.hello.tier_max_tokens, now)
            else:
                memory.back(worker_id)
            if not self._redis_down():  # a write that timed out started the back-off: no second timeout in a row
                memory.refresh(now)
        self.workers.shared_drained = memory.alive(now)

    def _holds_lease(self, ident: bytes, job_id: str, attempt: int) -> bool:
        """True if ``ident`` is the worker holding ``job_id``'s current lease for ``attempt``."""
        worker = ident.decode(errors="replace")
        lease = self.leases.get(job_id)
        if lease is not None and lease == (worker, attempt):
            return True
        seen = self._stale_seen.get((job_id, attempt, worker))
        if seen is not None and self.clock() - seen < STALE_RECHECK_S:
            return False
        if lease is None or attempt > lease[1]:  # unknown here (e.g. this gateway restarted) or moved on
            rec = self.queue.get(job_id)
            # Taken over only from its holder, whose frames now come here. Taken on another worker's stale frame,
            # this gateway waited for the holder's tokens (they go to the gateway that dispatched it) and stopped
            # following the job's token log: its clients' streams stalled until the job ended.
            if rec is not None and rec.state == "dispatched" and (rec.worker, rec.attempt) == (worker, attempt):
                self.leases[job_id] = (worker, attempt)
                s = self.streams.streams.get(job_id)
                if s is None:
                    s = self._open_stream(job_id, rec.tenant)
                now_ms, now = self.queue.server_ms(), self.clock()
                since_s = (now_ms - rec.enqueued_at_ms) / 1e3
                metrics.holding(job_id, rec.tier_granted.value, now - since_s, bool(s.tokens))
                if rec.dispatched_at_ms is not None:  # sent before this gateway's restart: its wait is measured here
                    sent = now - (now_ms - rec.dispatched_at_ms) / 1e3
                    self.waits.dispatched(job_id, sent, True, rec.attempt, sent_ms=rec.dispatched_at_ms,
                                          enqueued_ms=rec.enqueued_at_ms, first_ms=first_prefill_ms(rec), told=True)
                return True
        self._stale_seen[(job_id, attempt, worker)] = self.clock()
        self._stale_seen.move_to_end((job_id, attempt, worker))
        while len(self._stale_seen) > STALE_MEMORY:
            self._stale_seen.popitem(last=False)
        return False

    def _stale(self, msg) -> None:
        self.counters["stale_frames"] += 1
        log.debug("dropped a stale %s for job %s attempt %d", type(msg).__name__, msg.job_id, msg.attempt)

    def on_tokens(self, ident: bytes, msg: P.JobTokens) -> None:
        if not security.from_registered_worker(self, ident):
            return
        if not self._holds_lease(ident, msg.job_id, msg.attempt):
            self._stale(msg)
            return
        self._prefill_started(ident.decode(), msg)
        now = self.clock()
        if self.streams.add_tokens(msg.job_id, msg.index, msg.token_ids, now):
            if msg.token_ids:
                metrics.first_token(msg.job_id, now)
            self._flush(msg.job_id)
        else:
            self.counters["token_gaps"] += 1
            # Tokens before these never came (sent to this gateway's previous process, or dropped on the way): the
            # worker sends every token so far when asked to say hello. Without it the stream held every client of
            # the job until its JobFinished, which carries them all; a restarted gateway whose first frame from the
            # worker was its periodic hello never asked.
            self._ask_hello(ident, f"job {msg.job_id} lacks tokens before index {msg.index}: send them again")

    def _ask_hello(self, ident: bytes, why: str) -> None:
        """Ask a registered worker to say hello (and so send its jobs' tokens again), at most once a
        HELLO_ASK_EVERY_S: frames already on their way with the same gap need no second replay."""
        now = self.clock()
        if now - self._hello_asked.get(ident, float("-inf")) < security.HELLO_ASK_EVERY_S:
            return
        self._hello_asked[ident] = now
        self._hello_asked.move_to_end(ident)
        while len(self._hello_asked) > security.HELLO_ASK_MEMORY:
            self._hello_asked.popitem(last=False)
        self._send(self.worker_sock, ident, P.ErrorReply(P.HELLO_FIRST, why))

    def _prefill_started(self, worker: str, msg: P.JobTokens | P.JobFinished) -> None:
        """The end of the job's wait, if this is the first start a worker reports; the hand-off of the attempt this
        gateway sent teaches the estimate."""
        # From the frame's send, not its reading: a frame that sat in this gateway's socket is no wait.
        sent = self.waits.worker_clocks.sent(worker, msg.sent_at_s, self.clock())
        handoff = self.waits.prefill_started(msg.job_id, msg.prefill_start_s, msg.prefill_start_age_s, sent,
                                             msg.attempt)
        if handoff is not None:
            self.estimator.handed_off(worker, handoff.seconds, handoff.busy)
            metrics.handed_off(worker, handoff.seconds, handoff.busy, self.workers.workers)

    def on_released(self, ident: bytes, msg: P.JobReleased) -> None:
        """A worker shutting down hands a job back: back in its queue now, not a lease later (release.lua)."""
        if not security.from_registered_worker(self, ident):
            return
        if not self._holds_lease(ident, msg.job_id, msg.attempt):
            self._stale(msg)  # including the copies sent to the other gateways, once one has requeued it
        else:
            worker = ident.decode()
            if self.queue.release(msg.job_id, msg.attempt, worker):
                self.counters["released"] += 1
                log.info("worker %s handed back job %s attempt %d (%s)", worker, msg.job_id, msg.attempt,
                         msg.reason)
                self.settle_leases(self.queue.requeue([msg.job_id], self.queue.server_ms(),
                                                      self.config.max_attempts), "released")
        # Settled here (requeued, or its lease had moved on): the worker stops sending it again. Not reached when
        # Redis fails, so the worker's next copy tries again (worker/completions.py).
        self._send(self.worker_sock, ident, P.JobFinishedAck(msg.job_id, msg.attempt))


def new_stale_memory() -> OrderedDict:
    return OrderedDict()
