"""The queue's sweeps: lease expiry, aging, promised starts, queue timeouts (a mixin of gateway.redis_queue.RedisQueue).

Any gateway may run them, and several at once: each reads the due ids from its index first, then runs a
script (common/lua/*.lua) that receives those jobs' keys and re-verifies what was read.
"""

from __future__ import annotations

import time

import redis

from common.tiers import Tier
from gateway.queue_records import JobRecord, Settled
from gateway.timeutil import time_ms

SWEEP_LIMIT = 500  # most jobs one requeue_expired / age / promote / expire call settles


class QueueSweeps:
    """Needs the queue's ``client``, ``keys``, ``_scripts``, ``_retention_ms``, ``dead_letter_max`` and
    ``_reply_deadline_ms``."""

    def server_ms(self) -> int:
        """Redis's clock, in ms: the one clock the sweeps and statistics use. Kept with the monotonic time it was
        read by (RedisQueue.admit's deadline)."""
        now_ms = time_ms(self.client.time())
        self.clock_sample = (now_ms, time.monotonic())
        return now_ms

    def requeue_expired(self, now_ms: int, max_attempts: int, *, limit: int = SWEEP_LIMIT) -> list[Settled]:
        """Settle expired leases: back to the queue (original score) or, after max_attempts, dead."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        return self.requeue(self._due(self.keys.inflight, now_ms, limit), now_ms, max_attempts)

    def requeue(self, ids: list[str], now_ms: int, max_attempts: int) -> list[Settled]:
        """Settle those of ``ids`` whose lease is due by ``now_ms`` (requeue.lua re-verifies each), as
        requeue_expired does: a released job's (release()) is due at once."""
        if not ids:
            return []
        keys = [*self.keys.queues(), self.keys.inflight, self.keys.dead, self.keys.aging, self.keys.deadlines,
                *(self.keys.job(i) for i in ids)]  # fmt: skip
        flat = self._scripts["requeue"](keys=keys, args=[str(now_ms), str(max_attempts), self._retention_ms,
                                                          str(self.dead_letter_max), self._reply_deadline_ms(), *ids])
        if flat == b"late":  # as the timeout it came close to: the next pass settles these leases, and tells
            raise redis.TimeoutError("the requeue reached Redis as its caller gave up on it; nothing was changed")
        return [Settled(flat[i].decode(), flat[i + 1].decode(), flat[i + 2].decode(), int(flat[i + 3]))
                for i in range(0, len(flat), 4)]

    def age(self, now_ms: int, interval_ms: int, *, limit: int = SWEEP_LIMIT) -> list[tuple[str, Tier, Tier]]:
        """Move jobs that waited ``interval_ms`` in P2/P3 up one tier; returns (id, from, to)."""
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be positive, got {interval_ms}")
        cutoff = now_ms - interval_ms
        ids = self._due(self.keys.aging, cutoff, limit)
        if not ids:
            return []
        keys = [*self.keys.queues(), self.keys.aging, *(self.keys.job(i) for i in ids)]
        flat = self._scripts["age"](keys=keys, args=[str(now_ms), str(cutoff), *ids])
        triples = zip(flat[0::3], flat[1::3], flat[2::3])
        return [(job_id.decode(), Tier(old.decode()), Tier(new.decode())) for job_id, old, new in triples]

    def promote(self, now_ms: int, *, limit: int = SWEEP_LIMIT) -> list[tuple[str, Tier]]:
        """Move queued P2/P3 jobs whose promised start fell due by ``now_ms`` up one tier (gateway/promises.py);
        returns (id, tier it left)."""
        ids = self._due(self.keys.promises, now_ms, limit)
        if not ids:
            return []
        keys = [*self.keys.queues(), self.keys.aging, self.keys.promises, *(self.keys.job(i) for i in ids)]
        flat = self._scripts["promote"](keys=keys, args=[str(now_ms), self._reply_deadline_ms(), *ids])
        if flat == b"late":  # as the timeout it came close to: the next pass promotes these jobs, and counts them
            raise redis.TimeoutError("the promotion reached Redis as its caller gave up on it; nothing was changed")
        return [(job_id.decode(), Tier(old.decode())) for job_id, old in zip(flat[0::2], flat[1::2])]

    def expire(self, now_ms: int, *, limit: int = SWEEP_LIMIT) -> list[str]:
        """End queued jobs past the queue timeout of the tier granted at admission; their ids."""
        return [rec.id for rec in self.expire_records(now_ms, limit=limit)]

    def expire_records(self, now_ms: int, *, limit: int = SWEEP_LIMIT) -> list[JobRecord]:
        """As expire(), returning each job as it was before (its payload holds its trace context), with the reason
        and finished_at_ms it ended with."""
        ids = self._due(self.keys.deadlines, now_ms, limit)
        if not ids:
            return []
        keys = [*self.keys.queues(), self.keys.aging, self.keys.deadlines, *(self.keys.job(i) for i in ids)]
        out = self._scripts["expire"](keys=keys, args=[str(now_ms), self._retention_ms, self._reply_deadline_ms(),
                                                       *ids])
        if out == b"late":  # as the timeout it came close to: the next pass expires these jobs, and counts them
            raise redis.TimeoutError("the expiry reached Redis as its caller gave up on it; nothing was changed")
        return [JobRecord.from_redis(before) for _, before in out]

    def _due(self, index: str, max_score: int, limit: int) -> list[str]:
        return [i.decode() for i in self.client.zrangebyscore(index, "-inf", max_score, start=0, num=limit)]
