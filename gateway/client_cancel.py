"""Client cancels: a plain cancel, a stop (CancelRequest.stop_at: the job ends done with its first n tokens), and a
withdrawal (CancelRequest.idempotency_key: whatever a client submitted under a key it gave up on).

A mixin of gateway.server.Gateway, beside gateway.client_api: it uses the gateway's queue, tenants, sockets, workers,
waits and streams.
"""

from __future__ import annotations

import dataclasses
import time

from common import protocol as P
from common.client_messages import MAX_IDEMPOTENCY_KEY_LEN
from common.errors import InvalidRequest, Unauthorized
from gateway import metrics

CANCELLED = "cancelled by the client"  # the reason a cancelled job's record and final message tell


class ClientCancels:
    """Handler of CancelRequest, and ``cancel_job`` for the dispatcher."""

    def _retry_key_ttl_s(self) -> int:
        """How long a client's retry key (SubmitRequest.retry_key), or a withdrawal's mark, is kept: as long as a
        finished job's record, at most idempotency_ttl_s."""
        return min(self.config.idempotency_ttl_s, self.config.result_ttl_s or self.config.idempotency_ttl_s)

    def on_cancel(self, ident: bytes, req: P.CancelRequest) -> None:
        if req.stop_at is not None and (type(req.stop_at) is not int or req.stop_at < 1):
            self._reply_error(ident, InvalidRequest(f"stop_at must be an integer >= 1, got {req.stop_at!r}",
                                                    field="stop_at"), req.job_id)
            return
        if req.idempotency_key is not None and (req := self._withdraw(ident, req)) is None:
            return
        rec = self._own_job(ident, req.api_key, req.job_id)
        if rec is None:
            return
        if req.stop_at is not None and self._stop_at(rec, req.stop_at):
            self._send(self.clients, ident, P.CancelReply(req.job_id, True))
            return
        self._send(self.clients, ident, P.CancelReply(req.job_id, self.cancel_job(req.job_id) is not None))

    def cancel_job(self, job_id: str):
        """Cancel a queued or dispatched job (its worker told, its listeners given its end); the job as it was, or
        None if it had ended already."""
        # What this gateway's next token-log flush would write into the job's record goes with the cancel: the
        # record a job ended with is final (first_token.lua), and its final message tells that record's figures.
        start_ms = self.waits.unrecorded_start_ms(job_id)
        claim = self.config.gateway_id if metrics.first_token_pending(job_id) else None
        before, won = self.queue.cancel_recording(job_id, reason=CANCELLED, first_prefill_ms=start_ms,
                                                  first_token_claim=claim)
        if start_ms is not None:
            self.waits.recorded({job_id: start_ms})
        if claim is not None:
            metrics.claimed(job_id, won)
        if before is not None and before.state == "queued":
            # Ended when cancel.lua cancelled it, on Redis's clock as its wait's start is (ended on this gateway's
            # wall clock, a gateway behind Redis's told a job that waited seconds that it waited none): the time
            # comes back with the cancel, no second round trip. Its own clock only if a bad record says none.
            at_ms = before.finished_at_ms
            self.spans.left_queue(before, "cancelled", at_ms * 1_000_000 if at_ms is not None else time.time_ns())
        if before is not None and before.state == "dispatched":
            w = self.workers.workers.get(before.worker)
            if w is not None:
                self._send(self.worker_sock, w.identity, P.CancelJob(job_id, before.attempt))
        self.leases.pop(job_id, None)
        if before is not None:
            metrics.ended(job_id, before.tier_granted.value, "cancelled", self.clock())
            self._finish_stream(job_id, "cancelled", None, CANCELLED, ended=before)
        return before

    def _withdraw(self, ident: bytes, req: P.CancelRequest) -> P.CancelRequest | None:
        """A cancel by idempotency key: the cancel of the job admitted under it, to go on with; or None, replied to
        here: the key withdrawn (no job under it, and none will be admitted under it), or the request refused."""
        key, tenant = req.idempotency_key, self.tenants.lookup(req.api_key)
        if not isinstance(key, str) or not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_LEN or req.job_id != "":
            self._reply_error(ident, InvalidRequest(
                f"a cancel by idempotency_key gives a key of 1..{MAX_IDEMPOTENCY_KEY_LEN} characters and job_id \"\"",
                field="idempotency_key"), req.job_id)
            return None
        if tenant is None:
            self._reply_error(ident, Unauthorized("unknown API key"))
            return None
        if (job_id := self.queue.withdraw(tenant.name, key, self._retry_key_ttl_s())) is None:
            metrics.withdrawn("before_admission")
            self._send(self.clients, ident, P.CancelReply("", True))
            return None
        metrics.withdrawn("admitted")
        return dataclasses.replace(req, job_id=job_id, idempotency_key=None)

    def _stop_at(self, rec, n: int) -> bool:
        """End ``rec`` done with its first ``n`` tokens (its answer ended there): the stop is kept with the job in
        Redis (stop_at.lua), so that a re-dispatch (its worker died, drained, handed it back) ends there too, and the
        worker running it is told (CancelJob.stop_at); its completion stores it, as any other. A queued job keeps
        the stop for its next attempt. False where it cannot (running on a worker older than CancelJob.stop_at, or
        one not registered here, which might run it to its end; or ended already): the caller cancels it instead."""
        if rec.state == "dispatched" and not self._stops_at(rec.worker):
            return False
        kept = self.queue.stop_at(rec.id, n)
        if kept is None:
            return False  # ended meanwhile: the cancel that follows finds it so, and says so
        if kept.state == "dispatched":
            # Its holder as Redis tells it with the stop (a claim since ``rec`` was read holds the stop or is told).
            if not self._stops_at(kept.worker):
                return False
            # The smaller of the stops kept: a later, larger one does not raise the one its worker was told.
            w = self.workers.workers[kept.worker]
            self._send(self.worker_sock, w.identity, P.CancelJob(kept.id, kept.attempt, stop_at=kept.stop_at))
        return True

    def _stops_at(self, worker_id: str | None) -> bool:
        w = self.workers.workers.get(worker_id) if worker_id else None
        return w is not None and bool(w.hello.stops_at)

