"""Promised starts (gateway/promises.py): what admit.lua stores, what promote.lua moves and when, against a real
redis-server; and how the wait model replays queued jobs' promises (gateway/estimate.py)."""

from __future__ import annotations

import math
import uuid

import msgpack
import pytest

from common import protocol as P
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway import promises
from gateway.estimate import RUNNING, Arrivals, Held, Queued, Rates, Work, WorkerView, rank_at, wait_s
from gateway.redis_queue import DEFAULT_TIER_TIMEOUTS_S, RedisQueue

T0 = 1_700_000_000_000
P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3
RATES = Rates(prefill_tps=1000.0, decode_tps=100.0)  # 1 s per 100 output tokens


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def keys():
    return KeySpace(prefix=f"test-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def queue(server, keys):
    client = server.client()
    yield RedisQueue(client, keys, tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S)
    client.close()


def admit(q: RedisQueue, job_id: str, tier: Tier, *, now_ms: int = T0, estimate_s: float = 1.0,
          promise_s: float | None = None):
    return q.admit(job_id=job_id, tenant="acme", tier_requested=tier, tier=tier, payload=b"\x90", now_ms=now_ms,
                   idempotency_key=None, quota=None, drain_rate_per_s={t: 10.0 for t in ALL_TIERS},
                   estimate_s=estimate_s, promise_s=promise_s)


def test_the_promise_is_made_from_the_estimate_for_the_promised_tiers_only():
    both = promises.tiers(["P2", "P3"])
    assert promises.promise_s(P3, 10.0, 1.0, 0.5, both) == pytest.approx(9.5)
    assert promises.promise_s(P3, 10.0, 1.5, 0.0, both) == pytest.approx(15.0)
    assert promises.promise_s(P3, 0.2, 1.0, 0.5, both) == 0.0  # due at once: no P2 admitted after it goes first
    for tier in (P0, P1, P2):
        assert promises.promise_s(tier, 10.0, 1.0, 0.5, promises.tiers(["P3"])) is None
    assert promises.promise_s(P2, 10.0, 1.0, 0.5, both) == pytest.approx(9.5)
    assert promises.promise_s(P3, 10.0, 1.0, 0.5, promises.tiers(["P2"])) is None
    for tier in (P0, P1):  # what overtakes them is P0, which preempts: a place in a queue would not stop it
        assert promises.promise_s(tier, 10.0, 1.0, 0.5, both | {P0, P1}) is None
    for bad in (["P1"], ["P0", "P3"], ["p3"], ["P4"]):
        with pytest.raises(ValueError, match="cannot be promised"):
            promises.tiers(bad)
    assert promises.tiers([]) == frozenset()
    assert promises.promise_s(P3, 10.0, 0.0, 0.5, both) is None  # off
    assert promises.promise_s(P3, None, 1.0, 0.5, both) is None  # no estimate (no worker known)
    assert promises.promise_s(P3, math.inf, 1.0, 0.5, both) is None
    for bad in ((-1.0, 0.5), (1.0, -0.1), (math.nan, 0.5), (1.0, math.inf)):
        with pytest.raises(ValueError):
            promises.check(*bad)
    promises.check(0.0, 0.0)


def test_admit_stores_the_promise_and_promote_moves_the_job_to_p2_when_it_falls_due(queue, keys):
    client = queue.client
    p3 = admit(queue, "p3", P3, now_ms=T0, promise_s=5.0)
    assert p3.promise_at_ms == T0 + 5000
    assert client.zscore(keys.promises, "p3") == T0 + 5000
    assert queue.get("p3").result["promise_at_ms"] == str(T0 + 5000).encode()
    admit(queue, "newer-p2", P2, now_ms=T0 + 1000)
    admit(queue, "older-p2", P2, now_ms=T0 - 1000)
    admit(queue, "newer-p1", P1, now_ms=T0 + 2000, promise_s=1.0)  # a P1 is given none, whatever it asks
    admit(queue, "older-p3", P3, now_ms=T0 - 2000)
    assert client.zcard(keys.promises) == 1 and "promise_at_ms" not in queue.get("newer-p1").result
    assert queue.promote(T0 + 4999) == []
    assert queue.peek(list(ALL_TIERS), 10) == ["newer-p1", "older-p2", "newer-p2", "older-p3", "p3"]
    assert queue.promote(T0 + 5000) == [("p3", P3)]
    # In P2 with its enqueue score, as if it had aged: behind the older P2, ahead of the newer one; P1 stays ahead.
    assert queue.peek(list(ALL_TIERS), 10) == ["newer-p1", "older-p2", "p3", "newer-p2", "older-p3"]
    job = queue.get("p3")
    assert (job.tier, job.tier_granted, job.tier_since_ms) == (P2, P3, T0 + 5000)  # it preempts as a P3 still
    assert job.result["promoted_at_ms"] == str(T0 + 5000).encode()
    assert client.zscore(keys.queue(P2), "p3") == T0
    assert client.zcard(keys.promises) == 0
    assert client.zscore(keys.aging, "p3") == T0 + 5000  # it ages on from P2, from now
    assert queue.promote(T0 + 10**6) == []
    assert ("p3", P2, P1) in queue.age(T0 + 65_000, 60_000)


def test_a_promised_p2_moves_to_p1_by_its_enqueue_score_and_stops_ageing(queue, keys):
    client = queue.client
    admit(queue, "p2", P2, now_ms=T0, promise_s=3.0)
    admit(queue, "older-p1", P1, now_ms=T0 - 1000)
    admit(queue, "newer-p1", P1, now_ms=T0 + 1000)
    admit(queue, "p0", P0, now_ms=T0 + 2000)
    assert queue.peek(list(ALL_TIERS), 10) == ["p0", "older-p1", "newer-p1", "p2"]
    assert queue.promote(T0 + 3000) == [("p2", P2)]
    # In P1 with its enqueue score: behind the older P1, ahead of the newer one; P0 stays ahead.
    assert queue.peek(list(ALL_TIERS), 10) == ["p0", "older-p1", "p2", "newer-p1"]
    job = queue.get("p2")
    assert (job.tier, job.tier_granted, job.tier_since_ms) == (P1, P2, T0 + 3000)  # it is preempted as a P2 still
    assert client.zscore(keys.queue(P1), "p2") == T0 and client.zscore(keys.queue(P2), "p2") is None
    assert client.zscore(keys.aging, "p2") is None  # P1 never ages into P0
    assert queue.age(T0 + 10**6, 60_000) == [] and queue.promote(T0 + 10**6) == []
    assert queue.get("p2").tier == P1 and client.zcard(keys.promises) == 0


def test_a_p2_aged_to_p1_before_its_promise_is_left_where_it_is(queue, keys):
    admit(queue, "p2", P2, now_ms=T0, promise_s=100.0)
    assert queue.age(T0 + 60_000, 60_000) == [("p2", P2, P1)]
    assert queue.promote(T0 + 100_000) == []
    job = queue.get("p2")
    assert job.tier == P1 and "promoted_at_ms" not in job.result and queue.client.zcard(keys.promises) == 0
    assert queue.client.zscore(keys.queue(P1), "p2") == T0


def test_a_claimed_job_leaves_the_index_and_a_finished_or_aged_one_is_never_moved(queue, keys):
    client = queue.client
    for name in ("claimed", "cancelled", "aged", "kept"):
        admit(queue, name, P3, now_ms=T0 if name != "kept" else T0 + 50_000, promise_s=100.0)
    assert client.zcard(keys.promises) == 4
    assert [r.id for r in queue.claim(["claimed"], worker="w", gateway="g", lease_ms=1000, now_ms=T0)] == ["claimed"]
    assert client.zscore(keys.promises, "claimed") is None  # its wait is over: nothing left to promise
    queue.cancel("cancelled", now_ms=T0)
    assert queue.age(T0 + 60_000, 60_000) == [("aged", P3, P2)]  # before its promise: aged, by its enqueue time
    # A lease that expires puts the claimed job back in its queue, but not its promise (it has started once).
    assert [s.state for s in queue.requeue_expired(T0 + 2000, max_attempts=3)] == ["queued"]
    assert queue.promote(T0 + 150_000) == [("kept", P3)]  # the stale entries are dropped, not acted on
    assert client.zcard(keys.promises) == 0
    assert (queue.get("cancelled").state.value, queue.get("cancelled").tier) == ("cancelled", P3)
    assert queue.get("claimed").tier == P3 and queue.get("aged").tier == P2


def test_a_bad_promise_is_refused_and_stores_nothing(queue, keys):
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            admit(queue, "bad", P3, promise_s=bad)
    with pytest.raises(ValueError):  # a promise is made on an estimate
        queue.admit(job_id="bad", tenant="acme", tier_requested=P3, tier=P3, payload=b"\x90", idempotency_key=None,
                    quota=None, drain_rate_per_s={t: 10.0 for t in ALL_TIERS}, promise_s=1.0)
    assert list(queue.client.scan_iter(match=keys.scan_pattern())) == []


def test_an_idempotent_resubmission_still_finds_the_first_job(queue):
    first = queue.admit(job_id="a", tenant="acme", tier_requested=P3, tier=P3, payload=b"\x90", idempotency_key="k",
                        quota=None, drain_rate_per_s={t: 10.0 for t in ALL_TIERS}, estimate_s=1.0, promise_s=1.0)
    again = queue.admit(job_id="b", tenant="acme", tier_requested=P3, tier=P3, payload=b"\x90", idempotency_key="k",
                        quota=None, drain_rate_per_s={t: 10.0 for t in ALL_TIERS}, estimate_s=1.0, promise_s=1.0)
    assert (first.job_id, again.job_id, again.duplicate) == ("a", "a", True)
    assert queue.client.zcard(queue.keys.promises) == 1


# -- the model ------------------------------------------------------------------------------------------------------

def test_rank_at_moves_a_promised_p3_to_p2_as_early_aging():
    assert rank_at(P3, 0.0, 4.9, math.inf, promoted_s=5.0) == 3
    assert rank_at(P3, 0.0, 5.0, math.inf, promoted_s=5.0) == 2
    assert rank_at(P3, 0.0, 10**6, math.inf, promoted_s=5.0) == 2
    assert rank_at(P3, 0.0, 64.9, 60.0, promoted_s=5.0) == 2  # it ages on from P2, one interval after
    assert rank_at(P3, 0.0, 65.0, 60.0, promoted_s=5.0) == 1
    assert rank_at(P3, 0.0, 60.0, 60.0, promoted_s=70.0) == 2  # aged before it fell due: aging as ever
    assert rank_at(P3, 0.0, 120.0, 60.0, promoted_s=70.0) == 1
    for tier in (P0, P1):  # never promised: a promise time changes nothing
        assert rank_at(tier, 0.0, 5.0, 60.0, promoted_s=0.0) == tier.rank


def test_rank_at_moves_a_promised_p2_to_p1_for_good():
    assert rank_at(P2, 0.0, 4.9, 60.0, promoted_s=5.0) == 2
    assert rank_at(P2, 0.0, 5.0, 60.0, promoted_s=5.0) == 1
    assert rank_at(P2, 0.0, 10**6, 60.0, promoted_s=5.0) == 1  # P1 never ages into P0
    assert rank_at(P2, 0.0, 5.0, math.inf, promoted_s=5.0) == 1
    assert rank_at(P2, 0.0, 60.0, 60.0, promoted_s=70.0) == 1  # aged before it fell due: aging as ever


def test_a_promised_job_stops_being_overtaken_once_its_promise_falls_due():
    # One slot, busy for 1 s; P2s arrive twice a second, 0.5 s each: without a promise they overtake a P3 for
    # good (capped at MAX_RHO of the slot), with one due at 2 s it takes the first slot free after it.
    w = WorkerView(1, RATES, [Held(Work(P3, 0, 100), RUNNING, 0)])
    p2s = Arrivals(Work(P2, 0, 50), 2.0)
    free = wait_s(P3, [w], [], arrivals=[p2s])
    kept = wait_s(P3, [w], [], arrivals=[p2s], promoted_s=2.0)
    assert kept == pytest.approx(2.0)  # the slot frees every 0.5 s: at 2 s exactly
    assert free == pytest.approx(3.0)  # the P2s (capped at 0.8 of the slot) go first while one is waiting
    assert wait_s(P3, [w], [], arrivals=[p2s], promoted_s=0.0) == pytest.approx(1.0)  # due: first at the slot


def test_queued_jobs_promises_are_replayed_ahead_of_newer_work():
    w = WorkerView(1, RATES, [Held(Work(P2, 0, 100), RUNNING, 0)])  # frees at 1 s
    older_p3 = Queued(Work(P3, 0, 300), enqueued_s=-1.0, promoted_s=0.5)  # due before the slot frees
    # A P2 admitted now would go first without the promise (1 s); with it, the P3 goes first (at 1 s, for 3 s).
    assert wait_s(P2, [w], [Queued(Work(P3, 0, 300), -1.0)]) == pytest.approx(1.0)
    assert wait_s(P2, [w], [older_p3]) == pytest.approx(4.0)
    # Not yet due when the slot frees: the P2 goes first.
    assert wait_s(P2, [w], [Queued(Work(P3, 0, 300), -1.0, promoted_s=2.0)]) == pytest.approx(1.0)
    # A P1 still goes first (P1 queue); so does a P0.
    assert wait_s(P1, [w], [older_p3]) == pytest.approx(1.0)
    assert wait_s(P0, [w], [older_p3]) == pytest.approx(1.0)
    # A newer P3 waits for it, as for any older P3; a P3 older than it, not yet due, does not pass a P2.
    assert wait_s(P3, [w], [older_p3]) == pytest.approx(4.0)
    assert wait_s(P2, [w], [Queued(Work(P3, 0, 300), -5.0, promoted_s=3.0)]) == pytest.approx(1.0)
    # In P2 by their enqueue time: behind an older P2; and never in a slot a P1 takes by preemption.
    two = [Queued(Work(P3, 0, 100), -1.0, promoted_s=0.0), Queued(Work(P2, 0, 200), -2.0)]
    assert wait_s(P2, [w], two) == pytest.approx(4.0)  # the P2 (older) at 1 s, the P3 at 3 s, then this one
    younger_first = [Queued(Work(P3, 0, 100), -1.0, promoted_s=0.0), Queued(Work(P3, 0, 200), -3.0, promoted_s=9.0)]
    assert wait_s(P2, [w], younger_first) == pytest.approx(2.0)  # the older one is not due: it waits
    victim = WorkerView(1, RATES, [Held(Work(P3, 0, 100), RUNNING, 0b11)])
    assert wait_s(P1, [victim], [older_p3]) == 0.0


def test_a_job_given_twice_is_two_jobs():
    w = WorkerView(1, RATES, [Held(Work(P2, 0, 100), RUNNING, 0)])
    q = Queued(Work(P3, 0, 100), -1.0, promoted_s=0.0)
    assert wait_s(P2, [w], [q, q]) == pytest.approx(3.0)


def test_the_estimator_reads_other_gateways_promises(queue):
    """A job another gateway admitted: its promise comes from its hash, read once with its tokens."""
    from gateway.wait_estimator import WaitEstimator
    from gateway.workers import WorkerRegistry

    now_ms = queue.server_ms()

    registry = WorkerRegistry(5.0)
    registry.hello(P.WorkerHello("w", "m", 512, 2048, 1, 100), b"w", now_ms / 1000)

    def report(age_s: float, came_s_ago: float) -> None:  # the worker's load report: its job runs 1 s more
        registry.load(P.WorkerLoad("w", 0, 100, {"P3": 1}, {}, ["x"], 0.0, {}, 1000.0, 100.0,
                                   {"x": [3, RUNNING, 0, 0, 100, 0]}, age_s), now_ms / 1000 - came_s_ago)

    report(0.0, 0.0)
    payload = msgpack.packb({"prompt_token_ids": [1], "max_tokens": 300})
    queue.admit(job_id="theirs", tenant="acme", tier_requested=P3, tier=P3, payload=payload, idempotency_key=None,
                quota=None, drain_rate_per_s={t: 10.0 for t in ALL_TIERS}, estimate_s=1.0, promise_s=0.0,
                now_ms=now_ms - 1000)
    est = WaitEstimator(queue, registry, lambda: now_ms / 1000)
    # The slot frees at 1 s; the older P3, promised and due, goes first (3 s), then a new P2.
    assert est.for_new("acme", P2, now_ms / 1000) == pytest.approx(4.0, abs=0.1)
    # Half a second later, with no new report, the running job has gone on: half a second less.
    report(0.2, 0.3)
    assert est.for_new("acme", P2, now_ms / 1000) == pytest.approx(3.5, abs=0.1)


def test_a_flood_of_due_promises_moves_at_most_a_pass_s_limit_each_pass_and_every_job_exactly_once(queue, keys):
    n = 1234  # more than two passes' worth (SWEEP_LIMIT 500)
    for k in range(n):
        admit(queue, f"j{k:04d}", P3, now_ms=T0 + k, promise_s=0.0)  # due at once
    client = queue.client
    assert client.zcard(keys.promises) == n
    moved: list[str] = []
    passes = 0
    while batch := queue.promote(T0 + 10**5):
        passes += 1
        assert len(batch) <= 500 and all(left is P3 for _, left in batch)
        moved += [job_id for job_id, _ in batch]
    assert passes == 3 and len(moved) == len(set(moved)) == n
    assert client.zcard(keys.promises) == 0 and client.zcard(keys.queue(P3)) == 0
    assert client.zcard(keys.queue(P2)) == n and client.zcard(keys.aging) == n
    # In P2 by their enqueue scores: still oldest first.
    assert queue.peek([P2], n) == [f"j{k:04d}" for k in range(n)]


def test_two_gateways_promoting_the_same_due_jobs_at_once_move_each_once(server, keys):
    import threading

    clients = [server.client() for _ in range(3)]
    first, *gateways = [RedisQueue(c, keys, tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S) for c in clients]
    n = 600
    for k in range(n):
        admit(first, f"j{k:04d}", P3, now_ms=T0 + k, promise_s=0.0)
    moved: list[list[str]] = [[], []]
    go = threading.Barrier(2)

    def sweep(i: int) -> None:
        go.wait()
        while batch := gateways[i].promote(T0 + 10**5, limit=50):  # small passes: many chances to collide
            moved[i] += [job_id for job_id, _ in batch]

    threads = [threading.Thread(target=sweep, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    both = moved[0] + moved[1]
    assert len(both) == len(set(both)) == n  # none moved twice, none missed
    assert first.client.zcard(keys.queue(P2)) == n and first.client.zcard(keys.queue(P3)) == 0
    assert first.client.zcard(keys.aging) == n and first.client.zcard(keys.promises) == 0
    for k in range(0, n, 97):
        job = first.get(f"j{k:04d}")
        assert job.tier == P2 and "promoted_at_ms" in job.result
    for c in clients:
        c.close()


def test_a_promised_p2_stops_being_overtaken_by_p1s_and_p1s_wait_for_queued_ones():
    # One slot, busy with a P2 for 1 s (a P1 may not preempt it); P1s arrive twice a second, 0.5 s each.
    w = WorkerView(1, RATES, [Held(Work(P2, 0, 100), RUNNING, 0b01)])
    p1s = Arrivals(Work(P1, 0, 50), 2.0)
    assert wait_s(P2, [w], [], arrivals=[p1s]) == pytest.approx(3.0)  # overtaken (capped at 0.8 of the slot)
    assert wait_s(P2, [w], [], arrivals=[p1s], promoted_s=2.0) == pytest.approx(2.0)  # the first slot after 2 s
    assert wait_s(P2, [w], [], arrivals=[p1s], promoted_s=0.0) == pytest.approx(1.0)
    # A P1 admitted now waits for an older P2 whose promise falls due before the slot frees, not for one due after.
    older_p2 = Queued(Work(P2, 0, 300), enqueued_s=-1.0, promoted_s=0.5)
    assert wait_s(P1, [w], [older_p2]) == pytest.approx(4.0)
    assert wait_s(P1, [w], [Queued(Work(P2, 0, 300), -1.0, promoted_s=2.0)]) == pytest.approx(1.0)
    assert wait_s(P1, [w], [Queued(Work(P2, 0, 300), -1.0)]) == pytest.approx(1.0)
    assert wait_s(P0, [w], [older_p2]) == pytest.approx(0.0)  # a P0 preempts the running P2
    # A promoted P2 and a promoted P3 are in different queues: the P2 (in P1) goes first though younger (where
    # the P3 runs late, a P2 promised after it may pass it; BENCHMARKS.md, issue 12, fourteenth session).
    both = [Queued(Work(P3, 0, 100), -5.0, promoted_s=0.0), Queued(Work(P2, 0, 200), -1.0, promoted_s=0.0)]
    assert wait_s(P2, [w], both) == pytest.approx(4.0)  # this P2 is unpromised: both go first (1 s, 3 s)
    assert wait_s(P1, [w], both) == pytest.approx(3.0)  # the P2 (in P1, older than it) at 1 s, then this P1

