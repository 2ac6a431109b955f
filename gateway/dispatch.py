"""Dispatch: queued jobs from Redis to workers with credit (P0/P1 also to full workers, which preempt).

A mixin of gateway.server.Gateway.
"""

from __future__ import annotations

from collections import Counter

import msgpack

from common import protocol as P
from common.tiers import ALL_TIERS, Tier
from gateway.timeutil import ms as _ms


class Dispatcher:
    """Drain-rate estimates and the dispatch pass."""

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
