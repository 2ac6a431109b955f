"""Worker frames that end a job attempt: JobFinished, stored as done only with every token (``JobFinished.token_ids``,
counted against num_tokens), and kept and retried, never dropped, when Redis cannot take it right now. Every
completion this gateway is done with (stored, or stale) is confirmed to its worker with JobFinishedAck; until then the
worker sends it again (worker/completions.py), so one lost to a restart of this gateway costs a second, not a lease
and a rerun.

A mixin of gateway.worker_link.WorkerLink (and so of gateway.server.Gateway).
"""

from __future__ import annotations

import logging

import msgpack
import redis

from common import protocol as P
from gateway import metrics, security

log = logging.getLogger("gateway")


class WorkerCompletions:
    """Handler of JobFinished, and the store of its result; needs WorkerLink's ``_holds_lease``, ``_stale`` and
    ``_prefill_started``."""

    def on_finished(self, ident: bytes, msg: P.JobFinished) -> None:
        if not security.from_registered_worker(self, ident):
            return
        if msg.state not in ("done", "failed"):  # a malformed frame, not a handler error
            self.counters["malformed"] += 1
            self._send(self.worker_sock, ident, P.ErrorReply("protocol", f"JobFinished.state {msg.state!r} is not "
                                                             "done or failed", field="state"))
            return
        if self._unstored_copy(msg):
            return  # a copy sent again while Redis is down: the first one is kept, and confirmed once stored
        if not self._holds_lease(ident, msg.job_id, msg.attempt):
            self._stale(msg)  # including a second copy of one already stored: it needs nothing more
        else:
            self._store_finished(ident.decode(), msg)
        self._send(self.worker_sock, ident, P.JobFinishedAck(msg.job_id, msg.attempt))

    def _unstored_copy(self, msg: P.JobFinished) -> bool:
        """A completion of this job attempt is kept here until Redis stores it (``_unstored``)."""
        return any(m.job_id == msg.job_id and m.attempt == msg.attempt for _, m in self._unstored)

    def _store_finished(self, worker: str, msg: P.JobFinished) -> None:
        s = self.streams.streams.get(msg.job_id)
        streamed = s.tokens if s is not None else []
        tokens = list(msg.token_ids) if msg.token_ids is not None else list(streamed)
        state, reason = msg.state, msg.reason
        if state == "done" and len(tokens) != msg.num_tokens:
            state, reason = "failed", f"incomplete result: {len(tokens)} of {msg.num_tokens} tokens arrived"
        elif state == "done" and not _agrees(tokens, streamed, msg.finish_reason):
            state, reason = "failed", "the streamed tokens disagree with the worker's result"
        if state != msg.state:
            self.counters["incomplete_results"] += 1
            log.error("job %s attempt %d: %s", msg.job_id, msg.attempt, reason)
        fields = {"finish_reason": msg.finish_reason or "", "num_tokens": len(tokens) if state == "done" else
                  msg.num_tokens, "token_ids": msgpack.packb(tokens if state == "done" else []), "run_s": msg.run_s,
                  "preemptions": msg.preemptions, "ttft_s": -1.0 if msg.ttft_s is None else msg.ttft_s}
        if reason:
            fields["reason"] = reason
        # From the admission, whichever gateway made it (Redis told it at the dispatch): the worker's own figure
        # starts at its receipt of this attempt, so it leaves the job's wait out.
        admitted = self.waits.admitted_at(msg.job_id, self.enqueued_at.get(msg.job_id))
        if s is not None and s.first_token_at is not None and admitted is not None:
            fields["ttft_s"] = max(0.0, s.first_token_at - admitted)
        self._prefill_started(worker, msg)
        queued_s = self.waits.queued_s(msg.job_id, self.enqueued_at.get(msg.job_id))
        if queued_s is not None:
            fields["queued_s"] = queued_s
        # What the next token-log flush would write into the job's hash goes with its result, in the same round
        # trip: a finished job's record must not change under a client that read it.
        start_ms = self.waits.unrecorded_start_ms(msg.job_id)
        claim = self.config.gateway_id if metrics.first_token_pending(msg.job_id) else None
        try:
            stored, won = self.queue.complete_recording(msg.job_id, attempt=msg.attempt, state=state, fields=fields,
                                                        worker=worker, first_prefill_ms=start_ms,
                                                        first_token_claim=claim)
        except redis.RedisError:
            self._unstored.append((worker, msg))  # Redis is down: keep it, retry when it is back
            raise
        self.leases.pop(msg.job_id, None)
        if start_ms is not None:
            self.waits.recorded({msg.job_id: start_ms})
        if claim is not None:
            metrics.claimed(msg.job_id, won)
        if stored is None:
            self._stale(msg)  # its lease expired (or it was cancelled) meanwhile
            return
        for w in self.workers.workers.values():
            w.pending.discard(msg.job_id)
        self._urgent_sent.discard(msg.job_id)
        # The figures stored (complete.lua may have moved the wait to an earlier start another gateway recorded):
        # what a later read of the result says, so the listeners here and the estimates are told the same.
        self.estimator.finished(msg.job_id, state, msg.num_tokens, stored.queued_s)
        self._count_end(msg.job_id, state)
        if s is not None and state == "done":
            s.tokens = tokens
        self._finish_stream(msg.job_id, state, msg.finish_reason, reason, run_s=msg.run_s,
                            preemptions=msg.preemptions, stored=stored, ttft_s=stored.ttft_s)
        self._dirty = True

    def _count_end(self, job_id: str, state: str) -> None:
        """ts_jobs_finished_total for a result stored here; the tier from Redis only if the lease came unnoticed."""
        tier = metrics.held_tier(job_id)
        if tier is None:
            try:
                granted = self.queue.granted_tiers([job_id])[0]
            except redis.RedisError as e:  # stored already: the count must not cost the ack and the stream's end
                log.warning("job %s ended %s uncounted (Redis: %s)", job_id, state, e)
                self._redis_failed(e)
                return
            tier = granted.value if granted is not None else None
        metrics.ended(job_id, tier, state, self.clock())

    def retry_unstored(self) -> None:
        """Store the completions that arrived while Redis was unreachable (raises while it still is)."""
        while self._unstored:
            worker, msg = self._unstored.pop(0)
            self._store_finished(worker, msg)
            self._send(self.worker_sock, worker.encode(), P.JobFinishedAck(msg.job_id, msg.attempt))


def _agrees(result: list[int], streamed: list[int], finish_reason: str | None) -> bool:
    """The worker's result begins with every token it streamed; or, ended where its caller's answer did
    (CancelRequest.stop_at: finish_reason "stop"), is the start of them (the step that passed the stop streamed on)."""
    if len(result) < len(streamed) and finish_reason == "stop":
        return streamed[:len(result)] == result
    return result[:len(streamed)] == streamed
