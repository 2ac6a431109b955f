"""Where a job may go, and what it waits for, on workers whose limits differ (their hellos' tier_max_tokens): the
dispatcher's places and the wait estimate's must agree. A real redis-server and queue; the workers are their hellos
and load reports (tests/test_dispatch_guards.Plan)."""

from __future__ import annotations

import uuid

import msgpack
import pytest

from common import protocol as P
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway.redis_queue import Admitted
from tests.test_dispatch_guards import NOW, Plan

@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


def worker(d: Plan, wid: str, free: int, limits: dict[str, int], work: dict | None = None,
           draining: bool = False) -> None:
    d.workers.hello(P.WorkerHello(wid, "m", 512, 4096, max(1, free), 1000, limits), wid.encode(), NOW)
    d.workers.load(P.WorkerLoad(wid, free, 1000, {}, {}, list(work or {}), 0.0, {}, 1000.0, 50.0, work or {},
                                draining=draining), NOW)


def admit(d: Plan, tier: Tier, prompt: int, max_tokens: int) -> str:
    job_id = uuid.uuid4().hex
    payload = msgpack.packb({"prompt_token_ids": [5] * prompt, "max_tokens": max_tokens})
    r = d.queue.admit(job_id=job_id, tenant="t", tier_requested=tier, tier=tier, payload=payload,
                      now_ms=int(NOW * 1000), idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
    assert isinstance(r, Admitted)
    return job_id


def test_a_job_only_a_draining_worker_fits_waits_for_it_rather_than_failing_on_a_smaller_one(server):
    """The big worker drains (a redeploy's SIGTERM): it hands back the jobs it has not started, and they are queued
    again. No worker not draining fits them, so dispatch took them for jobs no worker left could run and sent them
    to the small worker, which failed them (TierLimitExceeded) while the big one was still there and about to come
    back. They wait while a worker they fit is registered; once it has gone (timed out), they are sent on as
    before."""
    d = Plan(server)
    worker(d, "wk-small", 3, {t.value: 64 for t in ALL_TIERS})
    worker(d, "wk-big", 0, {t.value: 2048 for t in ALL_TIERS}, draining=True)
    big = admit(d, Tier.P3, 100, 100)
    small = admit(d, Tier.P3, 10, 20)
    assert d._plan_by_credit()[0] == {"wk-small": [small]}
    urgent = admit(d, Tier.P0, 100, 100)
    assert urgent not in d._plan_preemptions(NOW, skip={small})[0].get("wk-small", [])
    del d.workers.workers["wk-big"]  # timed out: nothing can run it now
    assert d._plan_by_credit()[0] == {"wk-small": [urgent, *sorted([big, small])]}

