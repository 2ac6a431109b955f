"""Periodic maintenance: worker timeouts, expired leases, aging, queue timeouts, drain rates.

A mixin of gateway.server.Gateway; any number of gateways may run it at once (the scripts make it
safe). Every time it compares is Redis's own clock (one clock for all gateways).
"""

from __future__ import annotations

import logging

import redis

from common import protocol as P
from gateway import metrics

log = logging.getLogger("gateway")
ADMISSION_MEMORY_S = 3600.0  # admission times kept for TTFT; a job finished by another gateway is forgotten after
# A worker told to stop a job it runs without a lease is told again after this, if it still reports the job (the
# CancelJob may have been dropped on a full socket); the memory of such orders is bounded.
STRAY_RESEND_S = 2.0
STRAY_MEMORY = 4096


class Maintenance:
    """The maintenance pass, run every ``maintenance_interval_s``."""

    def maintenance(self, now: float, previous: float = float("-inf")) -> None:
        """``previous``: when the last pass ran."""
        for wid in self.workers.expire(now):
            log.warning("worker %s timed out; its leases will expire", wid)
        # Silent for a lease, it may be dead, and its leases are running out: every gateway stops sending it work
        # (WorkerState.lost_lease), not only the one that requeues its jobs, until it reports again.
        for w in self.workers.workers.values():
            w.lost_lease = w.lost_lease or now - w.last_seen > self.config.lease_s
        # A lease says its worker was heard from lately. While this gateway heard nothing (before it started,
        # while its loop or Redis stood still), a lease that ran out says nothing of the worker: a sole gateway
        # restarted after lease_s would re-run every job in flight, though their workers went on. So it judges
        # leases only once it has listened a whole lease (other gateways judge meanwhile, if there are any).
        if now - previous > self.config.lease_s / 2:
            self._listening_since = now
        now_ms = self.queue.server_ms()
        if now - self._listening_since >= self.config.lease_s:
            self.settle_leases(self.queue.requeue_expired(now_ms, self.config.max_attempts), "lease_expired")
        if self.queue.age(now_ms, int(self.config.aging_interval_s * 1000)):
            self._dirty = True
        for _, left in self.queue.promote(now_ms):
            metrics.promoted(left.value)
            self._dirty = True
        for rec in self.queue.expire_records(now_ms):
            self.spans.left_queue(rec, "expired", now_ms * 1_000_000)
            metrics.ended(rec.id, rec.tier_granted.value, "expired", now)
            self._finish_stream(rec.id, "expired", None, "queue timeout exceeded", ended=rec)
        self.stop_strays(now)
        self._measured_rates = {t: st.rate_per_s for t, st in self.queue.drain_stats(now_ms).items()}
        for job_id in [j for j, t in self.enqueued_at.items() if now - t > ADMISSION_MEMORY_S]:
            del self.enqueued_at[job_id]
        self._dirty = True  # jobs admitted by other gateways, or capacity reported meanwhile

    def stop_strays(self, now: float) -> None:
        """Tell a worker to stop each job its latest report lists that Redis no longer holds for it (cancelled,
        requeued, expired, dead, or leased to another worker). The CancelJob that the cancel or the requeue sent
        may never have been read as meant: a worker reads its gateways' sockets in turn, so one gateway's cancel
        could come before another's dispatch of the same attempt, was ignored (no such job yet), and the job then
        ran to its end on a slot nobody counted. Each report is checked once; the figures of a job the worker
        finished itself (its completion waiting for a confirmation) are left alone."""
        seen, sent = self._strays_checked, self._strays_told
        held = [(wid, job_id) for wid, w in self.workers.workers.items()
                if w.load is not None and seen.get(wid) != w.load_at for job_id in w.load.job_ids]
        for wid, w in self.workers.workers.items():
            if w.load is not None:
                seen[wid] = w.load_at
        for wid in [wid for wid in seen if wid not in self.workers.workers]:
            del seen[wid]
        if not held:
            return
        for (wid, job_id), (state, holder, attempt) in zip(held, self.queue.lease_views([j for _, j in held])):
            if state is None or (holder == wid and state in ("dispatched", "done", "failed")):
                continue
            key = (wid, job_id, attempt)
            if now - sent.get(key, float("-inf")) < STRAY_RESEND_S:
                continue
            sent[key] = now
            sent.move_to_end(key)
            while len(sent) > STRAY_MEMORY:
                sent.popitem(last=False)
            self.counters["strays_stopped"] += 1
            log.info("worker %s still runs job %s (%s in Redis): told to stop attempt %d", wid, job_id, state, attempt)
            self._send(self.worker_sock, self.workers.workers[wid].identity, P.CancelJob(job_id, attempt))

    def settle_leases(self, settled: list, cause: str) -> None:
        """After leases were settled (requeued or dead): forget them here, and stop the attempts that lost them.
        ``cause``: lease_expired or released (ts_requeues_total)."""
        for one in settled:
            self._dirty = True
            metrics.requeued(cause, one.state)
            if one.state != "dead":  # a dead one is counted finished below, by the tier held here
                metrics.let_go(one.job_id)
            self.leases.pop(one.job_id, None)
            # The lost attempt may still be running (a worker cut off, not dead): stop it, so it cannot
            # stitch its output into the next attempt's.
            w = self.workers.workers.get(one.worker)
            if w is not None:
                w.lost_lease = w.lost_lease or cause == "lease_expired"  # a release is a live worker's word
                self._send(self.worker_sock, w.identity, P.CancelJob(one.job_id, one.attempt))
        for one in settled:  # after every lease is settled here: a Redis error cannot leave one half done
            if one.state == "dead":
                self._dead_lettered(one, cause)

    def _dead_lettered(self, one, cause: str) -> None:
        """The lost last attempt's count and span (GatewaySpans.dead_lettered): its trace context is in the stored
        job; and the final message of its stream here, with its record's figures (what a later read tells)."""
        rec, unread = None, False  # counted all the same if this gateway held it (the tier it held)
        try:
            if self._redis_down():  # a read before timed out: this one would too, each after the other
                raise redis.ConnectionError("in back-off")
            rec = self.queue.get(one.job_id)
        except redis.RedisError as e:
            unread = True
            log.warning("job %s dead-lettered; its span is lost (Redis: %s)", one.job_id, e)
            if not self._redis_down():
                self._redis_failed(e)
        metrics.ended(one.job_id, rec.tier_granted.value if rec is not None else None, "dead", self.clock())
        if rec is not None and rec.finished_at_ms is not None:  # None: already trimmed from the dead letters
            self.spans.dead_lettered(rec, one.attempt, one.worker, cause, rec.finished_at_ms * 1_000_000)
            self._finish_stream(one.job_id, "dead", None, "lease expired too many times", ended=rec)
        elif unread:  # its stream here ends from its record once Redis answers (follow_token_log's idle check)
            self.enqueued_at.pop(one.job_id, None)
            self.waits.forget(one.job_id)
        else:  # no record left to tell: this gateway's own measures
            self._finish_stream(one.job_id, "dead", None, "lease expired too many times")
