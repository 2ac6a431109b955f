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

P1_RUNNING = [Tier.P1.rank, 0, 0, 0, 1000, 0]  # nobody may preempt it: 1,000 tokens at 50 tokens/s, 20 s


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


def worker(d: Plan, wid: str, free: int, limits: dict[str, int], work: dict | None = None,
           draining: bool = False) -> None:
    d.workers.hello(P.WorkerHello(wid, "m", 512, 4096, max(1, free), 1000, limits), wid.encode(), NOW)
    d.workers.load(P.WorkerLoad(wid, free, 1000, {}, {}, list(work or {}), 0.0, {}, 1000.0, 50.0, work or {},
                                draining=draining), NOW)


def admit(d: Plan, tier: Tier, prompt: int, max_tokens: int, at: float = NOW) -> str:
    job_id = uuid.uuid4().hex
    payload = msgpack.packb({"prompt_token_ids": [5] * prompt, "max_tokens": max_tokens})
    r = d.queue.admit(job_id=job_id, tenant="t", tier_requested=tier, tier=tier, payload=payload,
                      now_ms=int(at * 1000), idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
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


def test_a_queued_job_ahead_that_fits_none_of_the_jobs_workers_takes_none_of_their_slots(server):
    """wk-a keeps a large P0 reserve (a P0 may hold 2,048 tokens there, a P1 64) and runs a P1 for 20 s; wk-b is
    idle (512 tokens a job, any tier). A queued P0 of 1,000 tokens fits only wk-a and waits there. A P1 of 300
    tokens fits only wk-b and goes there at once; its estimate replayed the P0 ahead of it on wk-b's slot, and told
    it the P0's 20 s."""
    d = Plan(server)
    worker(d, "wk-a", 0, {"P0": 2048, "P1": 64, "P2": 64, "P3": 64}, {"a1": P1_RUNNING})
    worker(d, "wk-b", 1, {t.value: 512 for t in ALL_TIERS})
    admit(d, Tier.P0, 100, 900)
    assert d.estimator.for_new("t", Tier.P1, NOW, tokens=300) < 1
    job = admit(d, Tier.P1, 100, 200)
    assert d._plan_by_credit()[0] == {"wk-b": [job]}  # what dispatch does
    assert d.estimator.for_queued(job, Tier.P1, NOW) < 1
    # Where the job ahead fits the job's worker too, it does take its slot first.
    admit(d, Tier.P0, 100, 300)
    assert d.estimator.for_queued(job, Tier.P1, NOW) > 3


def test_the_preemption_pass_beside_free_slots_reads_no_queue_the_credit_pass_read_to_its_end(server):
    """On uneven workers with a full worker holding a victim, every dispatch pass that found credit peeked the P0/P1
    queues again after the credit pass had read every queued job: a second Redis round trip (about doubling the
    pass's time with a local Redis) for jobs already in hand. An urgent job only the full worker fits still
    preempts there, found in what the credit pass read."""
    d = Plan(server)
    worker(d, "wk-small", 3, {t.value: 64 for t in ALL_TIERS})
    d.workers.hello(P.WorkerHello("wk-big", "m", 512, 4096, 1, 1000, {t.value: 2048 for t in ALL_TIERS}), b"wk-big",
                    NOW)
    d.workers.load(P.WorkerLoad("wk-big", 0, 1000, {"P3": 1}, {}, ["b3"], 0.0, {"P0": 1, "P1": 1}, 1000.0, 50.0,
                                {"b3": [Tier.P3.rank, 0, 0, 10, 400, 0b11]}), NOW)
    client = server.client()

    def peeks() -> tuple[dict, int]:
        client.config_resetstat()
        plan = d._plan(NOW)[0]
        return plan, int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    assert peeks() == ({}, 1)
    small = admit(d, Tier.P3, 10, 10)
    urgent = admit(d, Tier.P0, 100, 100)
    assert peeks() == ({"wk-small": [small], "wk-big": [urgent]}, 1)
    d.queue.client.zrem(d.queue.keys.queue(Tier.P3), small)
    d.queue.client.zrem(d.queue.keys.queue(Tier.P0), urgent)
    # The credit pass fills its slots from the head of the queues: an urgent job past them is looked for.
    ahead = [admit(d, Tier.P0, 10, 10) for _ in range(3)]
    urgent = admit(d, Tier.P1, 100, 100)
    plan, n = peeks()
    assert plan == {"wk-small": sorted(ahead), "wk-big": [urgent]} and n > 1


def test_a_job_only_a_drained_worker_fits_waits_for_its_return_a_while_and_a_killed_ones_not_at_all(server):
    """A drained worker exits without a goodbye and is dropped after worker_timeout_s; a redeploy restarts it a
    moment later. A job only it fits was then taken for one no worker left could run and sent to the small worker to
    fail. The drained worker's size is remembered (DRAINED_MEMORY_S): the job waits, and a new one is refused as
    retryable (returning_max_tokens), until the worker is back or the memory runs out. A worker that was not draining
    when it went silent (killed, crashed) is not waited for, as before."""
    d = Plan(server)
    d.workers.timeout_s = 5.0
    worker(d, "wk-small", 3, {t.value: 64 for t in ALL_TIERS})
    worker(d, "wk-big", 0, {t.value: 2048 for t in ALL_TIERS}, draining=True)
    d.workers.workers["wk-small"].last_seen = NOW + 1e6  # it keeps reporting
    big = admit(d, Tier.P3, 100, 100)
    assert d.workers.expire(NOW + 6) == ["wk-big"]
    assert d._plan_by_credit()[0] == {} and d.workers.returning_max_tokens("P3") == 2048
    small = admit(d, Tier.P3, 10, 20)  # the job ahead takes none of the small worker's slots, nor its estimate's
    assert d._plan_by_credit()[0] == {"wk-small": [small]}
    assert d.estimator.for_queued(small, Tier.P3, NOW) < 1
    d.queue.client.zrem(d.queue.keys.queue(Tier.P3), small)
    worker(d, "wk-big", 1, {t.value: 2048 for t in ALL_TIERS})  # redeployed: same id and size
    assert d._plan_by_credit()[0] == {"wk-big": [big]} and d.workers.returning_max_tokens("P3") is None
    d.workers.workers["wk-big"].load = P.WorkerLoad("wk-big", 0, 1000, {}, {}, [], 0.0, draining=True)
    assert d.workers.expire(NOW + 6) == ["wk-big"]
    assert d.workers.expire(NOW + 7 + d.workers.drained_memory_s) == []  # not back: forgotten
    assert d._plan_by_credit()[0] == {"wk-small": [big]} and d.workers.returning_max_tokens("P3") is None
    worker(d, "wk-big", 0, {t.value: 2048 for t in ALL_TIERS})  # serving, then killed: no drain before it
    assert d.workers.expire(NOW + 6) == ["wk-big"] and not d.workers.drained
    assert d._plan_by_credit()[0] == {"wk-small": [big]}


def test_p0s_waiting_for_a_draining_worker_keep_no_p0_behind_them_from_a_victim_on_another(server):
    """The big worker drains and hands back its P0s (a redeploy); only it fits them, so they wait. The small worker
    is full, with a P3 a P0 may preempt. The preemption pass took as many queued P0/P1s as there were victims, the
    waiting big ones first: none of them could go, and a small P0 behind them waited for the P3 to end by itself (a
    priority inversion lasting the redeploy, and DRAINED_MEMORY_S after it). It preempts the P3 at once now."""
    d = Plan(server)
    worker(d, "wk-small", 0, {t.value: 64 for t in ALL_TIERS})
    d.workers.load(P.WorkerLoad("wk-small", 0, 1000, {"P3": 1}, {}, ["s3"], 0.0, {"P0": 1, "P1": 1}, 1000.0, 50.0,
                                {"s3": [Tier.P3.rank, 0, 0, 10, 40, 0b11]}), NOW)
    worker(d, "wk-big", 0, {t.value: 2048 for t in ALL_TIERS}, draining=True)
    for i in range(3):
        admit(d, Tier.P0, 100, 100, at=NOW - 10 + i)
    small = admit(d, Tier.P0, 10, 20)
    assert d._plan(NOW)[0] == {"wk-small": [small]}
