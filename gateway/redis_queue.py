"""Per-tier job queues in Redis: admission, dispatch leases, completion, aging, expiry, cancel.

Several gateways share one Redis, so every change touching more than one key is one Lua
script (common/lua/*.lua; key layout in common/redis_keys.py). Sweeps over per-job keys
known only after a read (requeue_expired, age, expire) read the due ids first, then run a
script that receives those jobs' keys in KEYS and re-verifies what was read.

Invariants: a queued job is in exactly one ``q:P`` (its tier) and never in ``inflight``;
a dispatched job is in ``inflight`` and in no queue; a finished job is in neither.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import redis

from common.errors import DuplicateRequest
from common.redis_keys import KeySpace, load_scripts
from common.tiers import ALL_TIERS, Tier
from gateway.queue_ends import QueueEnds, _now
from gateway.queue_reads import QueueReads, floored_rates, out_of_memory
from gateway.queue_records import (  # noqa: F401  (re-exported: the queue's API names them)
    _QUEUE_FIELDS, Admitted, AdmitResult, DrainStat, IdempotencyMismatch, JobRecord, JobState, Overloaded,
    QuotaRefused, QuotaSpec, Settled, Stored, StoreFull, TenantFull, Withdrawn,
)
from gateway.queue_sweeps import SWEEP_LIMIT, QueueSweeps  # noqa: F401  (SWEEP_LIMIT: part of the queue's API)

# Queue timeout per tier in seconds (None: waits forever); also the admission limit on the
# estimated wait. Shared tier defaults live here until the configuration module exists.
DEFAULT_TIER_TIMEOUTS_S: dict[Tier, float | None] = {Tier.P0: 30.0, Tier.P1: 60.0, Tier.P2: 300.0, Tier.P3: None}
DEFAULT_AGING_INTERVAL_S = 60.0  # a job waiting this long in P2/P3 moves up one tier
DEFAULT_IDEMPOTENCY_TTL_S = 86_400
DEFAULT_DEAD_LETTER_MAX = 10_000
DEFAULT_DRAIN_TAU_S = 30.0  # memory of the drain-rate average (see common/redis_keys.py)
# A script that takes a reply deadline (_reply_deadline_ms) runs only this long before its caller would give up on
# the reply at the latest: a reply still on its way when the socket times out is the one case left where a job
# refused as unavailable is stored anyway (or a claim sent to no worker holds a lease), and it needs Redis to stall
# within this margin after running the script. At most half the reply timeout: a redis_url may set a shorter
# socket_timeout than the margin, and the deadline then fell before the command was sent (everything "late").
REPLY_MARGIN_S = 0.25
# A reading of Redis's clock older than this is not trusted to place the deadline (a stepped clock); no deadline then.
CLOCK_SAMPLE_MAX_AGE_S = 30.0


def _ms(seconds: float | None) -> str:
    return "-1" if seconds is None else str(int(round(seconds * 1000)))


class RedisQueue(QueueEnds, QueueSweeps, QueueReads):
    """The queue API over one KeySpace. Stateless apart from configuration: any number of
    RedisQueue objects (in any number of gateways) may share a prefix. The sweeps are in
    gateway/queue_sweeps.py, the ends (completion, cancel) in gateway/queue_ends.py, the reads (idempotency lookups
    included) in gateway/queue_reads.py."""

    def __init__(
        self,
        client: redis.Redis,
        keys: KeySpace,
        *,
        tier_timeouts_s: Mapping[Tier, float | None],
        idempotency_ttl_s: int = DEFAULT_IDEMPOTENCY_TTL_S,
        drain_tau_s: float = DEFAULT_DRAIN_TAU_S,
        result_ttl_s: int | None = None,
        tenant_max_jobs: int = 0,
        dead_letter_max: int = DEFAULT_DEAD_LETTER_MAX,
    ) -> None:
        """``result_ttl_s``: how long a finished or dead job (its tokens included) is kept (None: the
        idempotency TTL); ``tenant_max_jobs``: most unfinished jobs one tenant may hold over all tiers (0: no
        cap); ``dead_letter_max``: the dead-letter set keeps the newest this many."""
        missing = [t.value for t in ALL_TIERS if t not in tier_timeouts_s]
        if missing:
            raise ValueError(f"tier_timeouts_s lacks {', '.join(missing)}")
        if any(v is not None and v <= 0 for v in tier_timeouts_s.values()):
            raise ValueError(f"queue timeouts must be positive or None, got {dict(tier_timeouts_s)}")
        if idempotency_ttl_s < 1 or drain_tau_s <= 0:
            raise ValueError("idempotency_ttl_s must be >= 1 and drain_tau_s > 0")
        if (result_ttl_s is not None and result_ttl_s < 1) or tenant_max_jobs < 0 or dead_letter_max < 1:
            raise ValueError(f"result_ttl_s and dead_letter_max must be >= 1 and tenant_max_jobs >= 0, got "
                             f"{result_ttl_s}, {dead_letter_max}, {tenant_max_jobs}")
        self.tenant_max_jobs = tenant_max_jobs
        self.dead_letter_max = dead_letter_max
        self.client = client
        self.keys = keys
        self.tier_timeouts_s = {t: tier_timeouts_s[t] for t in ALL_TIERS}
        self.idempotency_ttl_s = idempotency_ttl_s
        self.drain_tau_s = drain_tau_s
        self._scripts = load_scripts(client)
        # Apart from the idempotency TTL: a long deduplication window need not keep every output that long.
        self._retention_ms = str((result_ttl_s or idempotency_ttl_s) * 1000)
        # How long a command's reply is waited for (None: forever), and Redis's clock as server_ms() last read it.
        self._reply_timeout_s = client.connection_pool.connection_kwargs.get("socket_timeout")
        self.clock_sample: tuple[int, float] | None = None

    # --- admission -------------------------------------------------------------------------
    def admit(
        self, *, job_id: str, tenant: str, tier_requested: Tier, tier: Tier, payload: bytes, now_ms: int | None = None,
        idempotency_key: str | None, quota: QuotaSpec | None, drain_rate_per_s: Mapping[Tier, float],
        estimate_s: float | None = None, promise_s: float | None = None, fingerprint: str | None = None,
        downgrade_estimate_s: float | None = None, key_ttl_s: int | None = None,
    ) -> AdmitResult:  # fmt: skip
        """Admit a job with one script call (see common/lua/admit.lua for the rules).

        ``estimate_s``: the wait estimate to store and to shed on; None estimates from the drain rates.
        ``promise_s``: for a P2 or P3 job, when from now its promised start falls due (gateway/promises.py); None:
        no promise. ``fingerprint``: what the request asks for (gateway/admission.fingerprint), stored with the
        idempotency key: a later request under the key with another fingerprint is refused (IdempotencyMismatch),
        one with the same is the first job's duplicate; None: any request under the key is.
        ``downgrade_estimate_s``: the wait of the job as a P1, stored and shed on if the quota downgrades it (the
        wait asked for with ``estimate_s`` is a P0's, which no P1 job delays); None: estimated from the drain rates.
        ``key_ttl_s``: how long the idempotency key is kept (a client's retry key: SubmitRequest.retry_key); None:
        ``idempotency_ttl_s``."""
        if not job_id or not tenant:
            raise ValueError("job_id and tenant must be non-empty")
        rates = floored_rates(drain_rate_per_s)
        keys = [*self.keys.queues(), self.keys.job(job_id), self.keys.quota(tenant), self.keys.aging,
                self.keys.deadlines, self.keys.tenant_jobs(tenant), self.keys.promises]  # fmt: skip
        if idempotency_key is not None:
            keys.append(self.keys.idem(tenant, idempotency_key))
        args = [
            job_id, tenant, Tier(tier_requested).value, Tier(tier).value, payload, _now(now_ms),
            str((key_ttl_s or self.idempotency_ttl_s) * 1000), *(_ms(self.tier_timeouts_s[t]) for t in ALL_TIERS),
            *(repr(r) for r in rates), repr(quota.rate_per_s) if quota else "0",
            repr(quota.burst) if quota else "0", quota.on_exhausted if quota else "refuse",
            str(self.tenant_max_jobs),
        ]  # fmt: skip
        for name, value in (("estimate_s", estimate_s), ("downgrade_estimate_s", downgrade_estimate_s)):
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if promise_s is not None and (estimate_s is None or not math.isfinite(promise_s) or promise_s < 0):
            raise ValueError(f"promise_s must be finite and >= 0, with an estimate_s; got {promise_s}")
        if fingerprint is not None and (not fingerprint or " " in fingerprint):
            raise ValueError(f"a fingerprint is a non-empty string without spaces, got {fingerprint!r}")
        args += [  # ARGV[20..23], each optional: "" for none
            "" if estimate_s is None else repr(float(estimate_s)),
            "" if promise_s is None else str(int(promise_s * 1000)),
            fingerprint or "",
            "" if downgrade_estimate_s is None else repr(float(downgrade_estimate_s)),
            self._reply_deadline_ms(),
        ]
        try:
            reply = self._scripts["admit"](keys=keys, args=args)
        except redis.ResponseError as e:
            if out_of_memory(e):  # the script's first write was refused: nothing was stored
                return StoreFull(str(e))
            raise
        kind = reply[0].decode()
        if kind == "late":  # as the timeout it came close to: the caller hears "unavailable", and nothing was stored
            raise redis.TimeoutError("the admission reached Redis as its caller gave up on it; nothing was stored")
        if kind == "admitted":
            return Admitted(job_id, Tier(reply[1].decode()), float(reply[2]), False, int(reply[3]),
                            dict(zip(ALL_TIERS, (int(n) for n in reply[4:8]))), int(reply[8]) if reply[8] else None,
                            int(reply[9]) if len(reply) > 9 else None)
        if kind == "quota":
            return QuotaRefused(float(reply[1]))
        if kind == "overloaded":
            t = Tier(reply[1].decode())
            return Overloaded(float(reply[2]), t, self.tier_timeouts_s[t])  # type: ignore[arg-type]
        if kind == "duplicate":
            return self._duplicate(reply[1].decode(), Tier(tier), rates)
        if kind == "mismatch":
            return IdempotencyMismatch(reply[1].decode())
        if kind == "exists":
            raise DuplicateRequest(job_id)
        if kind == "withdrawn":
            return Withdrawn()
        if kind == "tenant_full":
            return TenantFull(int(reply[1]))
        raise RuntimeError(f"admit.lua returned {reply!r}")

    def _reply_deadline_ms(self) -> str:
        """admit.lua's ARGV[24], claim.lua's, cancel.lua's and requeue.lua's ARGV[5], complete.lua's ARGV[8],
        expire.lua's ARGV[3], promote.lua's ARGV[2]: in Redis's clock, a moment before this call's reply is given up on
        (a timeout). A Redis that stood still (SIGSTOP, a slow disk, a failover's pause) runs the commands it received
        once it goes on: past this moment the admission was already answered "unavailable, nothing was stored", the
        claimed jobs were sent to no worker, the cancel was answered "unavailable" (the retry would be told the job was
        not cancelled) and its worker not told, the requeued leases' workers were not told to stop, the completion is
        kept to store again (its retry would find it stored, and take it for stale), the expired and the promoted jobs
        were counted by no gateway, so the script must change nothing.
        Redis's clock at any moment after the sample is at least the sample plus the monotonic time since it was read;
        "" (no deadline) without a timeout or a recent sample."""
        if not self._reply_timeout_s or self.clock_sample is None:
            return ""
        sampled_ms, read_by = self.clock_sample
        now = time.monotonic()
        if now - read_by > CLOCK_SAMPLE_MAX_AGE_S:
            return ""
        margin_s = min(REPLY_MARGIN_S, self._reply_timeout_s / 2)
        return str(sampled_ms + int((now - read_by + self._reply_timeout_s - margin_s) * 1000))

    # --- dispatch --------------------------------------------------------------------------
    def peek(self, tiers: Sequence[Tier], limit: int) -> list[str]:
        """Up to ``limit`` queued job ids of ``tiers`` in dispatch order (P0 first, then by score)."""
        ordered = sorted({Tier(t) for t in tiers}, key=lambda t: t.rank)
        if limit <= 0 or not ordered:
            return []
        ids = self._scripts["peek"](keys=[self.keys.queue(t) for t in ordered], args=[str(limit)])
        return [i.decode() for i in ids]

    def claim(
        self, job_ids: Sequence[str], *, worker: str, gateway: str, lease_ms: int, now_ms: int | None = None
    ) -> list[JobRecord]:
        """Lease the still-queued jobs among ``job_ids`` to ``worker``; returns those claimed."""
        if lease_ms <= 0:
            raise ValueError(f"lease_ms must be positive, got {lease_ms}")
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return []
        keys = [*self.keys.queues(), self.keys.inflight, self.keys.aging, self.keys.deadlines, self.keys.promises,
                *(self.keys.job(i) for i in ids)]  # fmt: skip
        rows = self._scripts["claim"](keys=keys, args=[worker, gateway, _now(now_ms), str(lease_ms),
                                                       self._reply_deadline_ms(), *ids])
        return [JobRecord.from_redis(row) for row in rows]

    def extend_leases(self, worker: str, job_ids: Sequence[str], now_ms: int | None, lease_ms: int) -> int:
        """Set the lease of each of ``job_ids`` dispatched to ``worker`` to now + lease; returns how many."""
        ids = list(dict.fromkeys(job_ids))
        if not ids:
            return 0
        keys = [self.keys.inflight, *(self.keys.job(i) for i in ids)]
        return int(self._scripts["extend"](keys=keys, args=[worker, _now(now_ms), str(lease_ms), *ids]))

    def release(self, job_id: str, attempt: int, worker: str) -> bool:
        """A worker hands back ``attempt`` of ``job_id`` unfinished (release.lua): its lease falls due now and the
        attempt will not count against max_attempts. False (nothing changed) unless ``worker`` holds that lease.
        requeue([job_id], ...) then puts it back in its queue."""
        keys = [self.keys.inflight, self.keys.job(job_id)]
        return bool(self._scripts["release"](keys=keys, args=[job_id, str(attempt), worker]))
