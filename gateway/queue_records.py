"""What the Redis queue API takes and returns: job states and records, admission outcomes, quota specs.

Kept apart from gateway/redis_queue.py (the operations) so readers of records need not load the scripts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Union

from common.tiers import Tier


class JobState(str, enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    DEAD = "dead"


# Fields the queue's state machine owns: complete() may not overwrite them. ``reason`` is
# a JobRecord field too, but complete() may set it (why a job failed).
_QUEUE_FIELDS = frozenset(
    "id tenant tier tier_requested tier_granted state payload enqueued_at_ms tier_since_ms attempt "
    "estimate_s deadline_ms worker gateway dispatched_at_ms finished_at_ms releases released_attempt stop_at".split()
)
_CORE_FIELDS = _QUEUE_FIELDS | {"reason"}  # everything else in the hash is a result field


@dataclass(frozen=True)
class QuotaSpec:
    """A tenant's P0 token bucket."""

    rate_per_s: float  # tokens refilled per second
    burst: float  # bucket capacity; a full bucket admits this many P0 jobs at once
    on_exhausted: Literal["refuse", "downgrade"] = "refuse"  # downgrade = admit at P1 instead

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0 or not self.burst >= 1:
            raise ValueError(f"quota needs rate_per_s > 0 and burst >= 1, got {self}")
        if self.on_exhausted not in ("refuse", "downgrade"):
            raise ValueError(f"on_exhausted must be 'refuse' or 'downgrade', got {self.on_exhausted!r}")


@dataclass(frozen=True)
class Admitted:
    job_id: str  # for a duplicate: the job first admitted under the idempotency key
    tier: Tier  # tier the job is queued at (P1 after a quota downgrade; current tier for a duplicate)
    estimated_wait_s: float  # jobs ahead / drain rate; 0.0 for a duplicate no longer queued
    duplicate: bool  # True: the idempotency key was seen before; nothing was stored or charged
    position: int | None  # queued jobs ahead of it; None for a duplicate no longer queued
    # The same per tier (fresh admissions only); diagnostic, for the admission span, so not compared.
    ahead_by_tier: dict[Tier, int] | None = field(default=None, compare=False)
    # Redis ms at which its promised start falls due (a P2 or P3 job given one; gateway/promises.py), else None.
    promise_at_ms: int | None = field(default=None, compare=False)
    # Redis ms of the admission (its enqueued_at_ms; fresh admissions only): the admission span's clock offset.
    admitted_at_ms: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class QuotaRefused:
    retry_after_s: float  # when the tenant's P0 bucket holds a token again


@dataclass(frozen=True)
class Overloaded:
    estimated_wait_s: float  # the estimate that exceeded the timeout
    tier: Tier  # the tier the estimate was made for
    timeout_s: float  # that tier's queue timeout


@dataclass(frozen=True)
class TenantFull:
    cap: int  # the tenant already holds this many unfinished jobs (queued or dispatched, all tiers)


@dataclass(frozen=True)
class StoreFull:
    """Redis is at its maxmemory (policy noeviction) and refused the admission's first write."""

    detail: str  # Redis's own words


@dataclass(frozen=True)
class IdempotencyMismatch:
    """The idempotency key was first used for another request (another prompt or other sampling)."""

    job_id: str  # the job admitted under it


@dataclass(frozen=True)
class Withdrawn:
    """The idempotency key was withdrawn (CancelRequest by key: its client gave up on the submission) before any
    job was admitted under it: nothing is stored under it for as long as the mark lasts."""


# What an idempotency key holds once withdrawn, in place of a job id (a uuid4 hex, never this); admit.lua's too.
WITHDRAWN_MARK = "-"

AdmitResult = Union[Admitted, QuotaRefused, Overloaded, TenantFull, StoreFull, IdempotencyMismatch, Withdrawn]


@dataclass(frozen=True)
class JobRecord:
    id: str
    tenant: str
    tier: Tier  # current tier (after aging)
    tier_requested: Tier  # what the client asked for
    tier_granted: Tier  # what it was admitted at (after a quota downgrade)
    state: JobState
    payload: bytes | None  # None once the job is finished (dropped to bound memory), except dead
    enqueued_at_ms: int
    tier_since_ms: int
    attempt: int  # claims so far
    estimate_s: float  # wait estimate at admission
    deadline_ms: int | None  # queue deadline; None if the granted tier has no timeout
    worker: str | None  # holder while dispatched (kept on a dead job)
    gateway: str | None
    dispatched_at_ms: int | None
    reason: str | None  # why it expired, died, was cancelled (or failed, if complete() said)
    finished_at_ms: int | None
    result: dict[str, bytes] = field(default_factory=dict)  # the fields given to complete()
    released_attempt: int | None = None  # the last attempt its worker handed back (release.lua), if any
    stop_at: int | None = None  # its answer ends with this many tokens, on every attempt (stop_at.lua)

    @classmethod
    def from_redis(cls, raw: Mapping[bytes, bytes] | Sequence[bytes]) -> JobRecord:
        """From HGETALL: a dict (redis-py) or a flat [field, value, ...] list (from Lua)."""
        h = dict(raw) if isinstance(raw, Mapping) else dict(zip(raw[0::2], raw[1::2]))
        d = {k.decode(): v for k, v in h.items()}

        def text(name: str) -> str | None:
            return d[name].decode() if name in d else None

        def integer(name: str) -> int | None:
            return int(d[name]) if name in d else None

        return cls(
            id=d["id"].decode(), tenant=d["tenant"].decode(), tier=Tier(d["tier"].decode()),
            tier_requested=Tier(d["tier_requested"].decode()), tier_granted=Tier(d["tier_granted"].decode()),
            state=JobState(d["state"].decode()), payload=d.get("payload"),
            enqueued_at_ms=int(d["enqueued_at_ms"]), tier_since_ms=int(d["tier_since_ms"]),
            attempt=int(d["attempt"]), estimate_s=float(d["estimate_s"]), deadline_ms=integer("deadline_ms"),
            worker=text("worker"), gateway=text("gateway"), dispatched_at_ms=integer("dispatched_at_ms"),
            reason=text("reason"), finished_at_ms=integer("finished_at_ms"),
            result={k: v for k, v in d.items() if k not in _CORE_FIELDS},
            released_attempt=integer("released_attempt"), stop_at=integer("stop_at"),
        )  # fmt: skip


@dataclass(frozen=True)
class DrainStat:
    completed: int  # jobs of this tier completed (done + failed) since the stats began
    rate_per_s: float  # decayed completion rate at the time asked


class Stored(NamedTuple):
    """A result complete.lua stored: the figures a later read of it reports (streaming._send_final)."""

    queued_s: float | None  # None: no wait was measured
    total_s: float  # admission until finished_at_ms, on Redis's clock
    ttft_s: float | None = None  # None: no first token was measured


class Settled(NamedTuple):
    """A job whose lease expired: back in its queue or dead-lettered, and who held it."""

    job_id: str
    state: str  # queued | dead
    worker: str  # the holder of the lost lease ("" if unknown)
    attempt: int  # the lost attempt
