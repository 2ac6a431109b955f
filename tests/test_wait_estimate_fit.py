"""Wait estimates on workers of different sizes (their hellos' tier_max_tokens): a job waits only for the workers it
fits, since dispatch sends it nowhere else (gateway/dispatch.py). A real redis-server and queue; the workers are
their hellos and load reports."""

from __future__ import annotations

import uuid
from dataclasses import replace

import msgpack
import pytest

from common import protocol as P
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway.estimate import wait_s
from gateway.redis_queue import Admitted, RedisQueue
from gateway.wait_estimator import WaitEstimator
from gateway.workers import WorkerRegistry

NOW = 1_700_000_000.0
P3_RUNNING = [Tier.P3.rank, 0, 0, 0, 1000, 0b11]  # 1,000 tokens to decode: 20 s at 50 tokens/s


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


def estimator(server, small_limit: int = 64) -> tuple[RedisQueue, WaitEstimator]:
    """wk-small: two free slots, each job up to ``small_limit`` tokens; wk-big: one slot, 2,048 tokens, busy 20 s."""
    queue = RedisQueue(server.client(), KeySpace(prefix=f"ef-{uuid.uuid4().hex[:8]}"),
                       tier_timeouts_s={t: None for t in ALL_TIERS})
    workers = WorkerRegistry(timeout_s=1e9)
    for wid, slots, limit in (("wk-small", 2, small_limit), ("wk-big", 1, 2048)):
        workers.hello(P.WorkerHello(wid, "m", 512, 2048, slots, 1000, {t.value: limit for t in ALL_TIERS}),
                      wid.encode(), NOW)
    workers.load(P.WorkerLoad("wk-small", 2, 1000, {}, {}, [], 0.0, {}, 1000.0, 50.0), NOW)
    workers.load(P.WorkerLoad("wk-big", 0, 1000, {"P3": 1}, {}, ["b3"], 0.0, {"P0": 1, "P1": 1}, 1000.0, 50.0,
                              {"b3": P3_RUNNING}), NOW)
    return queue, WaitEstimator(queue, workers, clock=lambda: NOW)


def admit(queue: RedisQueue, prompt: int, max_tokens: int) -> str:
    job_id = uuid.uuid4().hex
    payload = msgpack.packb({"prompt_token_ids": [5] * prompt, "max_tokens": max_tokens})
    r = queue.admit(job_id=job_id, tenant="t", tier_requested=Tier.P3, tier=Tier.P3, payload=payload,
                    now_ms=int(NOW * 1000), idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
    assert isinstance(r, Admitted)
    return job_id


def test_a_queued_job_only_the_busy_big_worker_fits_is_told_its_wait_there_not_the_small_workers_free_slot(server):
    """It was told no wait (the small worker's free slots counted), then waited the big worker's 20 s."""
    queue, est = estimator(server)
    queued = admit(queue, prompt=100, max_tokens=1000)  # read back from Redis: its tokens are in its payload
    assert est.for_queued(queued, Tier.P3, NOW) > 15
    small = admit(queue, prompt=10, max_tokens=20)  # fits both: the small worker's free slot
    assert est.for_queued(small, Tier.P3, NOW) < 1


def test_a_new_job_is_told_the_wait_of_the_workers_it_fits(server):
    _, est = estimator(server)
    big_only = est._views_by_worker(NOW)["wk-big"]
    assert est.for_new("t", Tier.P3, NOW, tokens=1100) == pytest.approx(wait_s(Tier.P3, [big_only]))
    assert wait_s(Tier.P3, [big_only]) > 15
    # A job both fit, one none fits (it is sent on and fails there), one whose size is not known: every worker.
    everyone = est.for_new("t", Tier.P3, NOW)
    assert everyone < 1
    assert est.for_new("t", Tier.P3, NOW, tokens=50) == everyone
    assert est.for_new("t", Tier.P3, NOW, tokens=5000) == everyone


def test_workers_alike_are_estimated_as_before(server):
    _, est = estimator(server, small_limit=2048)
    assert est.for_new("t", Tier.P3, NOW, tokens=1100) == est.for_new("t", Tier.P3, NOW) < 1


def test_each_workers_start_is_its_own_when_a_worker_before_it_takes_no_job(server):
    """starts_s paired the registry's worker ids with the views of the workers that take jobs: a draining worker
    first in the registry shifted every view onto the worker before it, and the last worker got none (a start of 0,
    the best). An urgent job then went to the worker whose victim a guard protects, to wait for it, though the other
    worker's victim would give way at once."""
    from tests.test_dispatch_guards import P3_RUNNING as RUN, Plan

    d = Plan(server)
    d.worker("wk-a", {"a3": RUN})
    d.workers.load(replace(d.workers.workers["wk-a"].load, draining=True), NOW)  # takes no job, leaves no view
    d.worker("wk-b", {"b3": RUN + [0]})
    d.worker("wk-c", {"c3": RUN + [200]})  # resumed a moment ago: 200 tokens of residency left, 4 s
    starts = d.estimator.starts_s([Tier.P0], NOW)
    assert set(starts) == {"wk-b", "wk-c"}
    assert starts["wk-b"][Tier.P0] < 1 < starts["wk-c"][Tier.P0]
    job = d.admit(Tier.P0)
    assert d._plan_preemptions(NOW)[0] == {"wk-b": [job]}
