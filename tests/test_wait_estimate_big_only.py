"""Wait estimates for a job only the big worker fits, queued behind jobs every worker fits: dispatch hands each freed
slot to the first job in line that fits its worker (gateway/dispatch.py), so the small worker runs its share of the
jobs ahead and the big worker reaches the job sooner than if it ran them all. A real redis-server and queue; the
workers are their hellos and load reports; the dispatcher's own credit pass places the jobs."""

from __future__ import annotations

import uuid

import msgpack
import pytest

from common import protocol as P
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway.dispatch import Dispatcher
from gateway.estimate import Queued, Rates, Work, WorkerView, replay
from gateway.redis_queue import Admitted, RedisQueue
from gateway.wait_estimator import WaitEstimator
from gateway.workers import WorkerRegistry

NOW = 1_700_000_000.0
RATES = Rates(1000.0, 50.0)
SHARED_S = RATES.seconds(10, 50)  # a job both fit: 10 + 50 tokens (the small worker holds 64), 1.01 s


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


class Cluster(Dispatcher):
    """wk-small: two free slots of 64 tokens a job; wk-big: one free slot of 2,048."""

    def __init__(self, server) -> None:
        self.queue = RedisQueue(server.client(), KeySpace(prefix=f"bo-{uuid.uuid4().hex[:8]}"),
                                tier_timeouts_s={t: None for t in ALL_TIERS})
        self.workers = WorkerRegistry(timeout_s=1e9)
        self.estimator = WaitEstimator(self.queue, self.workers, clock=lambda: NOW, futures=0)
        self._urgent_sent: set[str] = set()
        for wid, slots, limit in (("wk-small", 2, 64), ("wk-big", 1, 2048)):
            self.workers.hello(P.WorkerHello(wid, "m", 512, 2048, slots, 1000, {t.value: limit for t in ALL_TIERS}),
                               wid.encode(), NOW)
            self.workers.load(P.WorkerLoad(wid, slots, 1000, {}, {}, [], 0.0, {}, RATES.prefill_tps,
                                           RATES.decode_tps), NOW)

    def admit(self, prompt: int, max_tokens: int, at_ms: int) -> str:
        job_id = uuid.uuid4().hex
        payload = msgpack.packb({"prompt_token_ids": [5] * prompt, "max_tokens": max_tokens})
        r = self.queue.admit(job_id=job_id, tenant="t", tier_requested=Tier.P3, tier=Tier.P3, payload=payload,
                             now_ms=at_ms, idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
        assert isinstance(r, Admitted)
        return job_id


def test_a_job_only_the_big_worker_fits_is_told_the_small_worker_runs_its_share_of_the_jobs_ahead(server):
    """Nine 1.01 s jobs both workers fit, then one only the big worker fits: the three slots run three of them each
    1.01 s, so the big slot is the job's after three rounds (3.03 s). The model replayed all nine on the big worker
    alone and told 9.09 s, three times the wait (a P0 or P1 told so is refused as overloaded far sooner)."""
    c = Cluster(server)
    shared = [c.admit(10, 50, int(NOW * 1000) - 10_000 + k) for k in range(9)]
    big_only = c.admit(100, 1000, int(NOW * 1000) - 1_000)
    placed, _, _ = c._plan_by_credit()  # what dispatch does with the three free slots: one job each, in line order
    assert placed == {"wk-small": shared[:2], "wk-big": shared[2:3]}
    told = c.estimator.for_queued(big_only, Tier.P3, NOW)
    assert told == pytest.approx(3 * SHARED_S, abs=0.05), f"told {told:.2f} s"
    # A new job of its size goes after it on the big worker: 30.2 s told before, 23.1 s now.
    big_s = RATES.seconds(100, 1000)
    assert c.estimator.for_new("t", Tier.P3, NOW, tokens=1100) == pytest.approx(3 * SHARED_S + big_s, abs=0.05)


def test_the_jobs_ahead_only_the_big_worker_fits_still_hold_its_slot(server):
    """Two 21.1 s jobs only the big worker fits, then six 1.01 s jobs both fit, ahead of a job only the big worker
    fits: the small worker runs the six meanwhile, and the job waits for both big ones."""
    c = Cluster(server)
    for k in range(2):
        c.admit(100, 1000, int(NOW * 1000) - 20_000 + k)
    for k in range(6):
        c.admit(10, 50, int(NOW * 1000) - 10_000 + k)
    told = c.estimator.for_new("t", Tier.P3, NOW, tokens=1100)
    assert told == pytest.approx(2 * RATES.seconds(100, 1000), abs=0.05), f"told {told:.2f} s"


def test_past_the_replayed_dispatches_work_only_the_big_worker_fits_is_drained_by_its_slots_alone():
    """A job only the big worker (one slot) fits, behind 900 jobs of its size: the replay takes 500 of them one by one
    and spreads the rest over the slots. Over all three (the small worker's two as well, which never run them) it
    told a third of the wait still ahead; over the big worker's slot, the wait."""
    small, big = WorkerView(2, RATES), WorkerView(1, RATES)
    each = RATES.seconds(100, 50)
    ahead = [Queued(Work(Tier.P3, 100, 50), -100.0 + k * 0.01, fits=frozenset({1})) for k in range(900)]
    wait, n = replay(Tier.P3, [small, big], ahead, fits=frozenset({1}))
    assert n is None  # past the replayed dispatches
    assert wait == pytest.approx(900 * each, rel=0.01)
    exact, _ = replay(Tier.P3, [small, big], ahead, fits=frozenset({1}), max_exact=2000)
    assert exact == pytest.approx(900 * each, rel=1e-6)
