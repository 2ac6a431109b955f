"""Admission into a full Redis (maxmemory, noeviction) at the queue layer, on its own real redis-server: a typed
refusal (StoreFull), nothing half-written (no job hash without its queue entry, no P0 charge, no idempotency key),
a retry of a job admitted before still answered, and admission working again once memory is freed.
"""

from __future__ import annotations

import uuid

import pytest

from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway.redis_queue import Admitted, QuotaSpec, RedisQueue, StoreFull
from gateway.sdk import Overloaded
from tests.test_security_redis import _dump, _empty, _fill, _Gateway

QUOTA = QuotaSpec(0.000001, 3)


@pytest.fixture
def full_queue():
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as s:
        q = RedisQueue(s.client(), KeySpace(prefix=f"full-{uuid.uuid4().hex[:6]}"),
                       tier_timeouts_s={t: None for t in ALL_TIERS}, tenant_max_jobs=10)
        yield q
        q.client.close()


def _p0(q: RedisQueue, key: str | None, fp: str = "fp"):
    return q.admit(job_id=uuid.uuid4().hex, tenant="t", tier_requested=Tier.P0, tier=Tier.P0, payload=b"x" * 64,
                   idempotency_key=key, quota=QUOTA, drain_rate_per_s={}, fingerprint=fp if key else None)


@pytest.mark.parametrize("flush_scripts", [False, True])
def test_a_p0_admission_into_a_full_redis_charges_nothing_and_writes_nothing(full_queue, flush_scripts):
    q = full_queue
    first = _p0(q, "k1")  # makes the bucket (2 tokens left) and loads the script
    assert isinstance(first, Admitted)
    filled = _fill(q.client)
    try:
        if flush_scripts:  # Redis restarted or failed over meanwhile: the script must be loaded into a full Redis
            q.client.script_flush()
        before = _dump(q)
        for key in ("k2", None):
            refused = _p0(q, key)
            assert isinstance(refused, StoreFull), refused
        assert _dump(q) == before  # no job, no queue entry, no charge, no key
        again = _p0(q, "k1")  # a retry of the job admitted before: still its job
        assert isinstance(again, Admitted) and again.duplicate and again.job_id == first.job_id
    finally:
        _empty(q.client, filled)
    later = _p0(q, "k2")
    assert isinstance(later, Admitted) and not later.duplicate
    assert float(q.client.hget(q.keys.quota("t"), "tokens")) == pytest.approx(1.0, abs=1e-3)
    queued = set(m.decode() for m in q.client.zrange(q.keys.queue(Tier.P0), 0, -1))
    assert queued == {first.job_id, later.job_id}
    jobs = {k.decode().rsplit(":", 1)[1] for k in q.client.scan_iter(match=q.keys.job("*"))}
    assert jobs == queued


def test_a_retry_through_a_gateway_gets_its_job_while_redis_is_full(tmp_path):
    """The gateway view: a client whose reply was lost sends its submission again (same idempotency key) while
    Redis is full. The duplicate's read (a MULTI) was refused by the full Redis and the retry answered "Redis is
    full" (overloaded), as if its job had never been admitted; a new request is still refused, storing nothing."""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as s:
        gw = _Gateway(tmp_path, s)
        r = s.client()
        try:
            with gw.client("batch-co") as c:
                job = c.submit(prompt_token_ids=[1, 2], max_tokens=2, idempotency_key="lost-reply")
                filled = _fill(r)
                try:
                    again = c.submit(prompt_token_ids=[1, 2], max_tokens=2, idempotency_key="lost-reply")
                    assert again.id == job.id and again.duplicate
                    with pytest.raises(Overloaded, match="full"):
                        c.submit(prompt_token_ids=[1, 2], max_tokens=2, idempotency_key="new")
                finally:
                    _empty(r, filled)
                assert c.submit(prompt_token_ids=[1, 2], max_tokens=2, idempotency_key="new").id != job.id
        finally:
            gw.stop()
            r.close()
