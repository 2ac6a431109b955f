"""The gateway's wait estimator on a real redis-server, with a queue deeper than it reads or replays one job at a
time: the oldest jobs of each queue are read and replayed, the rest counted and spread over the slots, and the
estimate is still the wait the whole queue makes (gateway/estimate.py's exact replay, given every job, agrees)."""

from __future__ import annotations

import math
import uuid

import msgpack
import pytest

import gateway.estimate as estimate
from common import protocol as P
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway.estimate import Queued, Rates, Work, WorkerView, wait_s
from gateway.redis_queue import Admitted, RedisQueue
from gateway.wait_estimator import MAX_QUEUE_READ, WaitEstimator
from gateway.workers import WorkerRegistry

T0 = 1_700_000_000_000
NOW = T0 / 1000 + 3600.0  # an hour after the first admission: every job is older than any estimate
RATES = Rates(prefill_tps=1000.0, decode_tps=50.0)


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


def cluster(server, slots: int, rates: Rates = RATES) -> tuple[RedisQueue, WaitEstimator]:
    queue = RedisQueue(server.client(), KeySpace(prefix=f"est-{uuid.uuid4().hex[:8]}"),
                       tier_timeouts_s={t: None for t in ALL_TIERS})
    workers = WorkerRegistry(timeout_s=1e9)
    workers.hello(P.WorkerHello("wk-0", "m", 512, 4096, slots, 1000), b"wk-0", NOW)
    workers.load(P.WorkerLoad("wk-0", slots, 1000, {}, {}, [], 0.0, {}, rates.prefill_tps, rates.decode_tps), NOW)
    return queue, WaitEstimator(queue, workers, clock=lambda: NOW)


def fill(queue: RedisQueue, tiers: list[Tier], prompt: int, max_tokens: int) -> list[Queued]:
    """Admit one job per entry of ``tiers``, a millisecond apart; the same jobs as the model sees them."""
    payload = msgpack.packb({"prompt_token_ids": [5] * prompt, "max_tokens": max_tokens})
    out = []
    for n, tier in enumerate(tiers):
        r = queue.admit(job_id=uuid.uuid4().hex, tenant="t", tier_requested=tier, tier=tier, payload=payload,
                        now_ms=T0 + n, idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
        assert isinstance(r, Admitted)
        out.append(Queued(Work(tier, prompt, max_tokens), (T0 + n) / 1000 - NOW))
    return out


def test_a_queue_deeper_than_the_read_is_counted_in_full(server):
    queue, est = cluster(server, slots=2)
    fill(queue, [Tier.P3] * (MAX_QUEUE_READ + 1500), prompt=100, max_tokens=50)  # 1.1 s each
    per_queue, counts, _ = est._queued(Tier.P3, None)
    assert [len(found) for found in per_queue] == [0, 0, 0, MAX_QUEUE_READ]  # read: the oldest of each queue
    assert counts == [0, 0, 0, MAX_QUEUE_READ + 1500]  # the rest: counted
    # All of them, 1.1 s each, ahead on 2 slots.
    assert est.for_new("t", Tier.P3, NOW) == pytest.approx(1.1 * (MAX_QUEUE_READ + 1500) / 2, rel=1e-3)


def test_past_the_replay_the_estimate_agrees_with_replaying_every_job(server, monkeypatch):
    """Mixed tiers on 3 slots, each queue deeper than the read: the estimate (oldest replayed one by one, the
    rest spread) against the exact replay of every job, for a new job of each tier."""
    queue, est = cluster(server, slots=3)
    tiers = [ALL_TIERS[(n * 7) % 4] for n in range(4 * MAX_QUEUE_READ + 400)]
    jobs = fill(queue, tiers, prompt=300, max_tokens=20)
    views = [WorkerView(3, RATES)]
    for tier in ALL_TIERS:
        got = est.for_new("t", tier, NOW)
        monkeypatch.setattr(estimate, "MAX_EXACT_DISPATCHES", 10**7)
        exact = wait_s(tier, views, jobs, enqueued_s=0.0)
        monkeypatch.undo()
        assert exact > 100 and got == pytest.approx(exact, rel=0.02), tier
    assert math.isfinite(est.for_new("t", Tier.P0, NOW))


def test_jobs_aged_into_a_higher_queue_count_as_that_queues_jobs(server, monkeypatch):
    """An hour-old P3 backlog has aged into P1 in Redis: the queue read past its bound holds P3 jobs, and its
    unread ones still count in full (by the jobs the queue holds, not by the tier named P1)."""
    queue, est = cluster(server, slots=2)
    est.aging_interval_s = 60.0
    jobs = fill(queue, [Tier.P3] * (MAX_QUEUE_READ + 700), prompt=100, max_tokens=50)
    for at in (NOW, NOW + 61):  # a tier per aging interval: P3 to P2, then P2 to P1
        while queue.age(int(at * 1000), 60_000):
            pass
    assert queue.depths()[Tier.P1] == len(jobs)
    monkeypatch.setattr(estimate, "MAX_EXACT_DISPATCHES", 10**7)
    exact = wait_s(Tier.P3, [WorkerView(2, RATES)], jobs, aging_interval_s=60.0)
    monkeypatch.undo()
    assert exact == pytest.approx(1.1 * len(jobs) / 2, rel=1e-3)
    assert est.for_new("t", Tier.P3, NOW) == pytest.approx(exact, rel=0.01)


def test_a_reports_age_advances_its_running_work_and_a_bad_age_is_bounded():
    from types import SimpleNamespace

    from gateway.wait_estimator import MAX_REPORT_AGE_S, advanced, report_age_s

    rates = Rates(prefill_tps=1000.0, decode_tps=100.0)
    assert advanced(Work(Tier.P3, 100, 100), rates, 0.05) == Work(Tier.P3, 50, 100)
    assert advanced(Work(Tier.P3, 100, 100), rates, 0.2) == Work(Tier.P3, 0.0, 90)  # 0.1 s of prefill, then decode
    assert advanced(Work(Tier.P3, 100, 100), rates, 100.0) == Work(Tier.P3, 0.0, 0.0)  # done: nothing left
    assert report_age_s(SimpleNamespace(age_s=0.25), 10.0, 10.5) == pytest.approx(0.75)
    for bad in (math.nan, math.inf, -3.0, "x"):  # from a broken worker: not believed
        assert report_age_s(SimpleNamespace(age_s=bad), 10.0, 10.5) == pytest.approx(0.5)
    assert report_age_s(SimpleNamespace(age_s=1e9), 10.0, 10.5) == MAX_REPORT_AGE_S
    assert report_age_s(SimpleNamespace(age_s=0.0), 10.0, 9.0) == 0.0  # a clock step back: no negative age


def test_a_draining_worker_is_no_capacity_for_queued_work_and_gets_none(server):
    """A worker told to stop (worker/drain.py) takes no new job, and hands back what it has not started: its slots
    are not capacity the queue drains into. Counted, a drain halved the P3 queue's estimate on two workers."""
    queue, est = cluster(server, slots=2)
    fill(queue, [Tier.P3] * 40, prompt=100, max_tokens=50)  # 1.1 s each
    workers = est.workers
    workers.hello(P.WorkerHello("wk-1", "m", 512, 4096, 2, 1000), b"wk-1", NOW)
    workers.load(P.WorkerLoad("wk-1", 2, 1000, {}, {}, [], 0.0, {}, RATES.prefill_tps, RATES.decode_tps), NOW)
    both = est.for_new("t", Tier.P3, NOW)
    assert both == pytest.approx(1.1 * 40 / 4, rel=1e-3)
    workers.load(P.WorkerLoad("wk-1", 0, 1000, {}, {}, [], 1e6, {}, RATES.prefill_tps, RATES.decode_tps,
                              draining=True), NOW)
    assert est.for_new("t", Tier.P3, NOW) == pytest.approx(2 * both, rel=1e-3)
    assert workers.workers["wk-1"].credit == 0 and workers.total_credit() == 2
    # A gateway that restarted hears its hello before any report: the hello says so too, and it gets no job.
    fresh = WorkerRegistry(timeout_s=1e9)
    fresh.hello(P.WorkerHello("wk-1", "m", 512, 4096, 2, 1000, draining=True), b"wk-1", NOW)
    assert fresh.workers["wk-1"].credit == 0 and fresh.with_credit() is None
    assert fresh.workers["wk-1"].victims_left(set()) == {}


def test_a_worker_silent_for_a_lease_is_no_capacity_until_it_reports_again(server):
    """A worker silent for lease_s (or whose lease ran out) gets no job from any gateway until it reports again
    (WorkerState.lost_lease): its slots are not capacity the queue drains into. Counted, they halved the estimate of
    a P3 queue on two workers for the rest of worker_timeout_s, while dispatch sent everything to the other one."""
    queue, est = cluster(server, slots=2)
    fill(queue, [Tier.P3] * 40, prompt=100, max_tokens=50)  # 1.1 s each
    workers = est.workers
    workers.hello(P.WorkerHello("wk-1", "m", 512, 4096, 2, 1000), b"wk-1", NOW)
    report = P.WorkerLoad("wk-1", 2, 1000, {}, {}, [], 0.0, {}, RATES.prefill_tps, RATES.decode_tps)
    workers.load(report, NOW)
    both = est.for_new("t", Tier.P3, NOW)
    assert both == pytest.approx(1.1 * 40 / 4, rel=1e-3)
    workers.workers["wk-1"].lost_lease = True  # as gateway/maintenance.py marks it
    assert workers.workers["wk-1"].credit == 0
    assert est.for_new("t", Tier.P3, NOW) == pytest.approx(2 * both, rel=1e-3)
    workers.load(report, NOW + 1)  # it speaks again: capacity again
    assert est.for_new("t", Tier.P3, NOW + 1) == pytest.approx(both, rel=1e-3)


def test_a_workers_periodic_hello_does_not_age_its_latest_load_report(server):
    """Workers re-announce every 5 s (worker/service.HELLO_EVERY_S). The hello kept the report but not when it
    came, so for the next half second every estimate saw the report 5 s old, advanced the running work 5 s and
    read full workers as about to free: P1s told 0.05 s waited 1-2.6 s (bench_estimate, tenth session)."""
    queue, est = cluster(server, slots=1)
    workers = est.workers
    running = {"job-a": [Tier.P2.rank, 0, 0, 0, 100, 0b01]}  # generated 0 of 100 tokens at 50/s: 2 s left
    workers.load(P.WorkerLoad("wk-0", 0, 1000, {"P2": 1}, {}, ["job-a"], 0.0, {}, RATES.prefill_tps,
                              RATES.decode_tps, running), NOW)
    before = est.for_new("t", Tier.P1, NOW + 0.1)
    assert before == pytest.approx(1.9, abs=0.05)  # the P2's 2 s less the 0.1 s since its report
    workers.hello(P.WorkerHello("wk-0", "m", 512, 4096, 1, 1000), b"wk-0", NOW + 0.1)  # its periodic re-announce
    assert workers.workers["wk-0"].load_at == NOW
    assert est.for_new("t", Tier.P1, NOW + 0.1) == pytest.approx(before)


def test_a_victims_guard_is_read_from_its_report_counted_down_by_its_age_and_a_bad_one_ignored(server):
    queue, est = cluster(server, slots=1)

    def report(entry: list, age_s: float = 0.0) -> float:
        est.workers.load(P.WorkerLoad("wk-0", 0, 1000, {"P3": 1}, {}, ["job-a"], 0.0, {}, RATES.prefill_tps,
                                      RATES.decode_tps, {"job-a": entry}, age_s), NOW)
        return est.for_new("t", Tier.P0, NOW)

    p3 = [Tier.P3.rank, 0, 0, 10, 400, 0b11]  # running, 390 tokens left at 50/s; a P0 may preempt it
    assert report(p3) == 0.0  # an older worker's six fields: no guard
    assert report(p3 + [0]) == 0.0
    assert report(p3 + [10]) == pytest.approx(0.2)  # 10 guarded tokens at 50/s
    assert report(p3 + [10], age_s=0.1) == pytest.approx(0.1)  # 5 of them generated since it was built
    assert report(p3 + [10], age_s=1.0) == 0.0  # all of them
    for bad in (-5, 2.5, "x", None):
        assert report(p3 + [bad]) == 0.0, bad


def test_each_workers_step_tokens_come_from_its_hello(server):
    """What a worker's hello says of its step budget (max_num_batched_tokens) reaches the wait model; an older
    worker's hello, without it, still registers, and the model then takes a prompt to be prefilled in one step."""
    queue, est = cluster(server, slots=2)
    est.workers.hello(P.WorkerHello("wk-1", "m", 512, 4096, 2, 1000, None, 256), b"wk-1", NOW)
    est.workers.hello(P.WorkerHello("wk-2", "m", 512, 4096, 2, 1000, None, 0), b"wk-2", NOW)  # nonsense: unsaid
    frame = msgpack.unpackb(P.encode(P.WorkerHello("wk-3", "m", 512, 4096, 2, 1000)))
    for field in ("max_num_batched_tokens", "tier_max_tokens"):  # as a worker from before sent it
        frame["b"].pop(field, None)  # (fields at their defaults are not sent anyway: common/protocol.encode)
    est.workers.hello(P.decode(msgpack.packb(frame)), b"wk-3", NOW)
    views = dict(zip(est.workers.workers, est._worker_views(NOW)))
    assert {wid: v.step_tokens for wid, v in views.items()} == {"wk-0": math.inf, "wk-1": 256, "wk-2": math.inf,
                                                                 "wk-3": math.inf}


def test_a_workers_step_cost_reaches_the_model_which_replays_the_steps_since_its_report(server):
    """A worker that says what its steps cost: its running work is handed to the model as reported, with the
    report's age, and the model replays the steps since (gateway/estimate_steps.py); one that does not say keeps
    the token rates, its work advanced here."""
    from gateway.estimate_steps import StepCost, run_out

    queue, est = cluster(server, slots=1)
    running = {"job-a": [Tier.P2.rank, 0, 0, 0, 100, 0b01]}  # a P2 about to decode 100 tokens, alone

    def report(age_s: float, **step) -> float:
        est.workers.load(P.WorkerLoad("wk-0", 0, 1000, {"P2": 1}, {}, ["job-a"], 0.0, {}, RATES.prefill_tps,
                                      RATES.decode_tps, running, age_s, **step), NOW)
        return est.for_new("t", Tier.P1, NOW)

    assert report(0.5) == pytest.approx(1.5, abs=0.01)  # 100 tokens at 50/s, 0.5 s of them gone
    cost = StepCost(0.01, 0.002)  # a step of one sequence: 0.012 s
    views = est._worker_views(NOW)
    assert views[0].step is None and views[0].age_s == 0.0
    told = report(0.5, step_base_s=cost.base_s, step_token_s=cost.token_s)
    [view] = est._worker_views(NOW)
    assert view.step == cost and view.age_s == pytest.approx(0.5) and view.held[0].work.decode == 100
    assert told == pytest.approx(run_out([(0, 100, 0)], cost, math.inf, age_s=0.5).ends[0], abs=0.01)
    assert told == pytest.approx(1.2 - 0.5, abs=0.02)
    assert report(0.5, step_base_s=math.nan, step_token_s=0.002) == pytest.approx(1.5, abs=0.01)  # not believed
    # Its tokens in the KV cache (the entry's eighth field) reach the model: each step attends to them.
    running["job-a"] = [Tier.P2.rank, 0, 0, 0, 100, 0b01, 0, 900]
    told = report(0.5, step_base_s=cost.base_s, step_token_s=cost.token_s, step_pair_s=1e-5)
    [view] = est._worker_views(NOW)
    assert view.held[0].context == 900 and view.step == StepCost(0.01, 0.002, 1e-5)
    assert told == pytest.approx(run_out([(0, 100, 0, 900)], view.step, math.inf, age_s=0.5).ends[0], abs=0.01)
    assert told > 1.2 + 100 * 900 * 1e-5 - 0.5  # each of the 100 steps attends 900 pairs and more


def test_the_step_replay_can_be_turned_off(server):
    """wait_step_cost = false: a worker's step cost is not used; its work is advanced and timed at its token rates."""
    queue, est = cluster(server, slots=1)
    est.step_cost = False
    running = {"job-a": [Tier.P2.rank, 0, 0, 0, 100, 0b01]}
    est.workers.load(P.WorkerLoad("wk-0", 0, 1000, {"P2": 1}, {}, ["job-a"], 0.0, {}, RATES.prefill_tps,
                                  RATES.decode_tps, running, 0.5, step_base_s=0.01, step_token_s=0.002), NOW)
    assert est._worker_views(NOW)[0].step is None
    assert est.for_new("t", Tier.P1, NOW) == pytest.approx(1.5, abs=0.01)
