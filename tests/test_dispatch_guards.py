"""Where a P0/P1 goes when every worker is full (gateway/dispatch.py): to a worker with a victim it may preempt, and
first to one whose victim no preemption guard protects now. Sent where the only victim is a P3 that resumed a
moment ago, it waits in that worker for the P3's residency, while the other worker's P3 would give way at once;
the wait estimate counts the slot that frees first, so the dispatcher must take it. A real redis-server and queue;
the workers are their load reports."""

from __future__ import annotations

import uuid

import msgpack
import pytest

from common import protocol as P
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway.dispatch import Dispatcher
from gateway.redis_queue import Admitted, RedisQueue
from gateway.wait_estimator import WaitEstimator
from gateway.workers import WorkerRegistry, reported_guard

NOW = 1_700_000_000.0
P3_RUNNING = [Tier.P3.rank, 0, 0, 10, 400, 0b11]  # running, preemptible by P0 and P1


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


class Plan(Dispatcher):
    """The dispatcher's planning with what it reads: a real queue, the worker registry, the estimator."""

    def __init__(self, server) -> None:
        self.queue = RedisQueue(server.client(), KeySpace(prefix=f"dg-{uuid.uuid4().hex[:8]}"),
                                tier_timeouts_s={t: None for t in ALL_TIERS})
        self.workers = WorkerRegistry(timeout_s=1e9)
        self.estimator = WaitEstimator(self.queue, self.workers, clock=lambda: NOW)
        self._urgent_sent: set[str] = set()

    def worker(self, wid: str, work: dict[str, list]) -> None:
        """A full worker (one slot) reporting ``work``; its victims as the worker counts them (running, by mask)."""
        self.workers.hello(P.WorkerHello(wid, "m", 512, 4096, 1, 1000), wid.encode(), NOW)
        victims = {t.value: sum(e[1] == 0 and (e[5] >> t.rank) & 1 for e in work.values()) for t in ALL_TIERS}
        self.workers.load(P.WorkerLoad(wid, 0, 1000, {"P3": len(work)}, {}, list(work), 0.0, victims, 1000.0, 50.0,
                                       work), NOW)

    def admit(self, tier: Tier) -> str:
        job_id = uuid.uuid4().hex
        payload = msgpack.packb({"prompt_token_ids": [5, 6], "max_tokens": 4})
        r = self.queue.admit(job_id=job_id, tenant="t", tier_requested=tier, tier=tier, payload=payload,
                             now_ms=int(NOW * 1000), idempotency_key=None, quota=None, drain_rate_per_s={},
                             estimate_s=0.0)
        assert isinstance(r, Admitted)
        return job_id


def test_a_p0_goes_to_the_worker_whose_victim_gives_way_now(server):
    d = Plan(server)
    d.worker("wk-a", {"a3": P3_RUNNING + [8]})  # resumed a moment ago: 8 tokens of residency left
    d.worker("wk-b", {"b3": P3_RUNNING + [0]})
    job = d.admit(Tier.P0)
    assert d._plan_preemptions(NOW)[0] == {"wk-b": [job]}
    # Both free now, or reported by older workers (no guard field): as before, the first with most room.
    d.worker("wk-a", {"a3": P3_RUNNING})
    assert d._plan_preemptions(NOW)[0] == {"wk-a": [job]}


def test_a_guarded_victim_is_still_one_when_it_is_the_only_one(server):
    d = Plan(server)
    d.worker("wk-a", {"a3": P3_RUNNING + [8]})
    d.worker("wk-b", {"b1": [Tier.P1.rank, 0, 0, 10, 400, 0]})  # a P1: nobody may preempt it
    job = d.admit(Tier.P1)
    assert d._plan_preemptions(NOW)[0] == {"wk-a": [job]}  # it waits for the guard there, not in Redis for a report
    assert d.workers.workers["wk-a"].guarded_victims(Tier.P1) == 1
    assert d.workers.workers["wk-b"].guarded_victims(Tier.P1) == 0
    for bad in (-1, "x", None, 2.5):  # a worker's bad field: no guard believed
        d.worker("wk-c", {"c3": P3_RUNNING + [bad]})
        assert d.workers.workers["wk-c"].guarded_victims(Tier.P0) == 0


def test_a_guard_is_believed_up_to_its_jobs_end_only():
    # [tier, status, prefill, generated, max_tokens, preemptible-by mask, guard]: a guard outlasting its job is a
    # buggy worker's, and unbounded it would put every estimate behind it past any timeout (all work shed).
    assert reported_guard([3, 0, 100, 10, 400, 3, 10**30]) == 500
    assert reported_guard([3, 0, 100, 10, 400, 3, 12]) == 12
    assert reported_guard([3, 0, 100, 10, 400, 3, True]) == 0  # a bool is no count
    assert reported_guard([3, 0, 100, 10, 400, 3]) == 0  # an older worker's six fields


def _sent(d: Plan, wid: str, tier: Tier, known: bool = True) -> str:
    """A job of ``tier`` this gateway sent to ``wid`` since its last report (``known``: admitted here)."""
    job_id = uuid.uuid4().hex
    if known:
        d.estimator.admitted(job_id, "t", tier, 2, 4, 0.0, NOW)
    d.workers.workers[wid].pending.add(job_id)
    return job_id


def test_a_job_sent_since_the_last_report_is_a_victim_for_the_urgent_jobs_that_may_preempt_it(server):
    # One full worker running a P2 nobody but a P0 may preempt; a P3 just went to it (the worker's report of it
    # comes at the end of the step that starts it, a second away beside a long prompt's chunk). A P1 admitted now
    # goes at once, to start at the next step, not after that report and the step the worker has begun by then.
    d = Plan(server)
    d.worker("wk-a", {"a2": [Tier.P2.rank, 0, 0, 10, 400, 0b01]})
    p1 = d.admit(Tier.P1)
    assert d._plan_preemptions(NOW)[0] == {}  # the P2 is no victim of a P1's
    _sent(d, "wk-a", Tier.P3)
    assert d.workers.workers["wk-a"].victims_left(d._urgent_sent, d.estimator.tier_of) == {Tier.P0: 2, Tier.P1: 1}
    assert d._plan_preemptions(NOW)[0] == {"wk-a": [p1]}
    # An urgent job already sent there and not yet reported takes that victim: no second P1 goes.
    urgent = _sent(d, "wk-a", Tier.P1)
    d._urgent_sent.add(urgent)
    assert d.workers.workers["wk-a"].victims_left(d._urgent_sent, d.estimator.tier_of) == {Tier.P0: 1, Tier.P1: 0}
    assert d._plan_preemptions(NOW)[0] == {}


def test_a_sent_job_counts_as_a_victim_only_by_the_workers_own_matrix_and_only_when_known(server):
    d = Plan(server)
    d.worker("wk-a", {"a3": [Tier.P3.rank, 0, 0, 10, 400, 0b01]})  # this worker lets only a P0 preempt a P3
    _sent(d, "wk-a", Tier.P3)
    _sent(d, "wk-a", Tier.P2)  # a P2: a P0's victim by the default matrix (this worker reports none to say)
    _sent(d, "wk-a", Tier.P3, known=False)  # another gateway's job: its tier is not known here
    _sent(d, "wk-a", Tier.P0)  # nobody's victim
    assert d.workers.workers["wk-a"].victims_left(d._urgent_sent, d.estimator.tier_of) == {Tier.P0: 3, Tier.P1: 0}
    p1 = d.admit(Tier.P1)
    assert d._plan_preemptions(NOW)[0] == {}  # stays in Redis: nothing there gives way to it
    p0 = d.admit(Tier.P0)
    assert d._plan_preemptions(NOW)[0] == {"wk-a": [p0]}
    assert p1 not in d._plan_preemptions(NOW)[0].get("wk-a", [])


def test_an_urgent_job_goes_where_the_model_expects_it_to_start_first(server):
    # Two full workers (two slots each), both running P3s a P0 may preempt. wk-a has two victims, but is midway
    # through a 2,000-token prompt: its next step, a 1,000-token chunk deep in the prompt, runs about 1.7 s before
    # a job sent now is read. wk-b decodes (steps of 0.02 s). The P0 goes to wk-b, as the wait model told it.
    d = Plan(server)
    step = dict(step_base_s=0.02, step_token_s=0.001, step_pair_s=4e-7)
    loads = {"wk-a": {"a1": [Tier.P3.rank, 0, 1000, 0, 400, 0b11, 0, 1000], "a2": [Tier.P3.rank, 0, 0, 10, 400,
                                                                                    0b11, 0, 300]},
             "wk-b": {"b1": [Tier.P3.rank, 0, 0, 10, 400, 0b11, 0, 300], "b2": [Tier.P0.rank, 0, 0, 10, 400, 0,
                                                                                 0, 300]}}
    for wid, work in loads.items():
        d.workers.hello(P.WorkerHello(wid, "m", 512, 4096, 2, 1000, max_num_batched_tokens=1000), wid.encode(), NOW)
        victims = {t.value: sum(e[1] == 0 and (e[5] >> t.rank) & 1 for e in work.values()) for t in ALL_TIERS}
        d.workers.load(P.WorkerLoad(wid, 0, 1000, {"P3": 2}, {}, list(work), 0.0, victims, 1000.0, 50.0, work,
                                    **step), NOW)
    starts = d.estimator.starts_s([Tier.P0], NOW)
    assert starts["wk-b"][Tier.P0] < 0.1 < 1.5 < starts["wk-a"][Tier.P0]
    job = d.admit(Tier.P0)
    assert d._plan_preemptions(NOW)[0] == {"wk-b": [job]}  # not to wk-a, for all its two victims
    # Two P0s (admitted together: either is first): the second goes to wk-a, as wk-b has no victim left.
    second = d.admit(Tier.P0)
    plan = d._plan_preemptions(NOW)[0]
    assert sorted(plan) == ["wk-a", "wk-b"] and sorted(plan["wk-a"] + plan["wk-b"]) == sorted([job, second])
