"""The queue's reads: idempotency-key lookups, job records, depths, jobs ahead, drain rates (a mixin of
gateway.redis_queue.RedisQueue). Read only: no script runs here, nothing is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import redis

from common.tiers import ALL_TIERS, Tier
from gateway.queue_records import (WITHDRAWN_MARK, Admitted, DrainStat, IdempotencyMismatch, JobRecord, JobState,
                                   Withdrawn)

# Drain rate assumed for a tier the gateway has no measurement for (or measured ~0):
# one job per 10 s. Keeps the estimate finite; a gateway should pass a capacity-based prior.
MIN_DRAIN_RATE_PER_S = 0.1


class QueueReads:
    """Needs the queue's ``client``, ``keys`` and ``drain_tau_s``."""

    def idempotent(self, tenant: str, idempotency_key: str, fingerprints: Sequence[str], tier: Tier,
                   drain_rate_per_s: Mapping[Tier, float]) -> Admitted | IdempotencyMismatch | Withdrawn | None:
        """What admit.lua answers a request of ``tier`` under a key that names a job already, read only, for a
        request refused before it reached admit.lua: that job (a duplicate) where the key was stored with one of
        ``fingerprints`` (or none), else IdempotencyMismatch; Withdrawn where its client withdrew it; None where the
        key names no job."""
        stored = self.client.get(self.keys.idem(tenant, idempotency_key))
        if stored is None:
            return None
        job_id, _, asked = stored.decode(errors="replace").partition(" ")
        if job_id == WITHDRAWN_MARK:
            return Withdrawn()
        if asked and asked not in fingerprints:
            return IdempotencyMismatch(job_id)
        return self._duplicate(job_id, tier, floored_rates(drain_rate_per_s))

    def _duplicate(self, job_id: str, fallback_tier: Tier, rates: list[float]) -> Admitted:
        """Describe the job an idempotency key points to, from one MULTI snapshot (read only)."""
        try:
            raw, *rest = self._duplicate_reads(job_id, transaction=True)
        except redis.ResponseError as e:
            if not out_of_memory(e):
                raise
            # A full Redis (maxmemory, noeviction) refuses every command queued in a MULTI, reads too: a retry of a
            # job admitted before was refused as "Redis is full" instead of getting its job back. Read without one:
            # a job claimed or aged between the reads is described as no longer queued (no position), as below.
            raw, *rest = self._duplicate_reads(job_id, transaction=False)
        depths, ranks = rest[:4], rest[4:]
        if not raw:  # the result expired before its idempotency key (result_ttl_s < idempotency_ttl_s)
            return Admitted(job_id, fallback_tier, 0.0, True, None)
        job = JobRecord.from_redis(raw)
        if job.state is not JobState.QUEUED or ranks[job.tier.rank] is None:
            return Admitted(job_id, job.tier, 0.0, True, None)
        r = job.tier.rank
        ahead = [*depths[:r], ranks[r]]
        return Admitted(job_id, job.tier, sum(n / rates[i] for i, n in enumerate(ahead)), True, sum(ahead))

    def _duplicate_reads(self, job_id: str, *, transaction: bool) -> list:
        pipe = self.client.pipeline(transaction=transaction)
        pipe.hgetall(self.keys.job(job_id))
        for q in self.keys.queues():
            pipe.zcard(q)
        for q in self.keys.queues():
            pipe.zrank(q, job_id)
        return pipe.execute()

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.client.hgetall(self.keys.job(job_id))
        return JobRecord.from_redis(raw) if raw else None

    def granted_tiers(self, job_ids: Sequence[str]) -> list[Tier | None]:
        """The tier each job was admitted at (None if gone), one round trip."""
        if not job_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for i in job_ids:
            pipe.hget(self.keys.job(i), "tier_granted")
        return [Tier(t.decode()) if t else None for t in pipe.execute()]

    def lease_views(self, job_ids: Sequence[str]) -> list[tuple[str | None, str | None, int]]:
        """(state, worker, attempt) of each job, one round trip; state None for an unknown job."""
        pipe = self.client.pipeline(transaction=False)
        for i in job_ids:
            pipe.hmget(self.keys.job(i), "state", "worker", "attempt")
        return [(st.decode() if st else None, w.decode() if w else None, int(a or 0)) for st, w, a in pipe.execute()]

    def jobs_ahead(self, job: JobRecord) -> dict[Tier, int]:
        """Queued jobs that will be served before ``job``: all of higher tiers, the earlier ones of its own."""
        pipe = self.client.pipeline(transaction=False)
        higher = [t for t in ALL_TIERS if t.rank < job.tier.rank]
        for t in higher:
            pipe.zcard(self.keys.queue(t))
        pipe.zscore(self.keys.queue(job.tier), job.id)
        *counts, score = pipe.execute()
        ahead = dict(zip(higher, (int(n) for n in counts)))
        ahead[job.tier] = int(self.client.zcount(self.keys.queue(job.tier), "-inf", f"({score}")) if score else 0
        return ahead

    def depths(self) -> dict[Tier, int]:
        pipe = self.client.pipeline(transaction=False)
        for q in self.keys.queues():
            pipe.zcard(q)
        return dict(zip(ALL_TIERS, (int(n) for n in pipe.execute())))

    def drain_stats(self, now_ms: int) -> dict[Tier, DrainStat]:
        """Completed counts and completion rates per tier, decayed to ``now_ms``: what admit() wants."""
        raw = {k.decode(): v for k, v in self.client.hgetall(self.keys.drain).items()}
        tau_ms = self.drain_tau_s * 1000
        stats = {}
        for t in ALL_TIERS:
            rate, ts = float(raw.get(f"rate:{t.value}", 0)), float(raw.get(f"ts:{t.value}", now_ms))
            decayed = rate * math.exp(-max(0.0, now_ms - ts) / tau_ms)
            stats[t] = DrainStat(int(raw.get(f"completed:{t.value}", 0)), decayed)
        return stats


def out_of_memory(e: redis.RedisError) -> bool:
    """Redis at maxmemory under noeviction refused a write. Redis 7 answers OOM (redis-py's OutOfMemoryError);
    6.2 wraps a script's refused call in an ERR that quotes it."""
    return isinstance(e, redis.exceptions.OutOfMemoryError) or "command not allowed when used memory" in str(e)


def floored_rates(drain_rate_per_s: Mapping[Tier, float]) -> list[float]:
    """Each tier's drain rate (jobs/s), in tier order, at least MIN_DRAIN_RATE_PER_S: what wait estimates from a
    queue's depth divide by."""
    rates = [max(float(drain_rate_per_s.get(t, 0.0)), MIN_DRAIN_RATE_PER_S) for t in ALL_TIERS]
    if not all(math.isfinite(r) for r in rates):
        raise ValueError(f"drain rates must be finite, got {dict(drain_rate_per_s)}")
    return rates
