"""The wait a job is told (gateway/estimate_futures.py): for a job near a slot, the evenly spaced replay hedged with
the likeliest of drawn futures of the arrivals that overtake it; everywhere else, the evenly spaced replay of
gateway/estimate.py unchanged."""

from __future__ import annotations

import math
import random

from common.tiers import Tier
from gateway.estimate import RUNNING, Arrivals, Held, Queued, Rates, Work, WorkerView, replay, wait_s
from gateway.estimate_futures import FUTURE_DISPATCHES, FUTURES, hedged, likeliest, told_wait_s

P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3
RATES = Rates(prefill_tps=1000.0, decode_tps=100.0)  # 1 s per 100 output tokens


def within_2x(estimate: float, waits) -> int:
    return sum(w / 2 <= estimate <= 2 * w for w in waits)


def near_a_slot() -> tuple[list[WorkerView], list[Arrivals]]:
    """A P2's slot frees in 2 s (one slot, running P3 work it may not preempt); P1s of 1.5 s each arrive at
    0.4/s: evenly spaced, the first comes at 2.5 s, after the slot went to the P2; drawn, one comes before 2 s
    more often than not (1 - exp(-0.8) = 55 %), and the P2 then waits 3.5 s or more."""
    return [WorkerView(1, RATES, [Held(Work(P3, 0, 200), RUNNING, 0b11)])], [Arrivals(Work(P1, 0, 150), 0.4)]


def test_the_likeliest_estimate_has_the_most_waits_within_2x():
    assert likeliest([1.0, 1.1, 1.2, 5.0, 6.0]) == 1.2  # the three near 1 s, at their median
    assert likeliest([2.0, 8.0, 9.0, 10.0, 30.0]) == 15.0  # 8..30 all within 2x of it
    assert likeliest([0.0, 0.0, 0.0, 4.0]) == 0.0  # most futures start it at once
    rng = random.Random(5)
    for _ in range(300):  # against every sample (and the median) as the estimate, floods of zeros and ties included
        ws = [rng.choice([0.0, rng.uniform(0, 1), rng.expovariate(0.1), 3.0]) for _ in range(rng.randint(1, 20))]
        best = likeliest(ws)
        assert all(within_2x(best, ws) >= within_2x(c, ws) for c in ws + [sorted(ws)[len(ws) // 2]]), ws


def test_a_job_near_a_slot_is_told_a_hedge_between_the_evenly_spaced_future_and_the_likeliest_drawn_one():
    workers, arrivals = near_a_slot()
    even = wait_s(P2, workers, [], arrivals=arrivals)
    assert even == 2.0  # the evenly spaced future: no P1 before the slot frees
    drawn = [wait_s(P2, workers, [], arrivals=arrivals, rng=random.Random(s)) for s in range(FUTURES)]
    best = likeliest(drawn)
    assert best >= 2 * even  # the drawn futures disagree: in most of them a P1 comes first
    told = told_wait_s(P2, workers, [], arrivals=arrivals)
    assert told == told_wait_s(P2, workers, [], arrivals=arrivals)  # fixed seeds: one state, one estimate
    assert math.isclose(told, math.sqrt(even * best)) and even < told < best
    # Within 2x of both answers to the coin toss, and of as many drawn futures as the evenly spaced estimate.
    assert within_2x(told, [even, best]) == 2 and within_2x(told, drawn) >= within_2x(even, drawn), (told, drawn)


def test_the_hedge_is_the_geometric_mean_and_leaves_a_start_at_once_to_the_drawn_futures():
    assert hedged(2.0, 8.0) == 4.0 and hedged(8.0, 2.0) == 4.0 and hedged(3.0, 3.0) == 3.0
    assert hedged(0.0, 5.0) == 5.0  # the evenly spaced future starts it at once, most drawn ones do not
    assert hedged(5.0, 0.0) == 0.0  # most drawn futures start it at once
    assert hedged(math.inf, 5.0) == 5.0 and hedged(5.0, math.inf) == math.inf  # never a product of inf and 0
    rng = random.Random(7)
    for _ in range(200):  # within 2x of both where they are less than 4x apart, and never outside them
        a, b = rng.uniform(0.01, 100), rng.uniform(0.01, 100)
        h = hedged(a, b)
        assert min(a, b) <= h * (1 + 1e-12) and h <= max(a, b) * (1 + 1e-12)
        if max(a, b) < 4 * min(a, b):
            assert within_2x(h, [a, b]) == 2


def test_the_evenly_spaced_estimate_stays_where_futures_cannot_differ_or_would_cost_too_much():
    workers, arrivals = near_a_slot()
    # No higher tier to overtake it (a P0; a P1 whose only arrivals are P1s), futures off, no arrival rate.
    assert told_wait_s(P0, workers, [], arrivals=arrivals) == wait_s(P0, workers, [], arrivals=arrivals)
    assert told_wait_s(P1, workers, [], arrivals=arrivals) == wait_s(P1, workers, [], arrivals=arrivals)
    assert told_wait_s(P2, workers, [], arrivals=arrivals, futures=0) == 2.0
    assert told_wait_s(P2, [], [], arrivals=arrivals) == math.inf  # no workers: no capacity, as wait_s says
    assert told_wait_s(P2, workers, [], arrivals=[Arrivals(Work(P1, 0, 150), 0.0)]) == 2.0
    # A job more than FUTURE_DISPATCHES dispatches back: the deep replay, once, as before.
    queued = [Queued(Work(P2, 0, 50), -10.0 + i * 1e-3) for i in range(FUTURE_DISPATCHES + 10)]
    deep = told_wait_s(P2, workers, queued, arrivals=arrivals)
    assert deep == wait_s(P2, workers, queued, arrivals=arrivals) and deep > FUTURE_DISPATCHES * 0.5


def test_the_replay_says_how_many_dispatches_it_replayed_and_when_it_spread_the_rest():
    workers, arrivals = near_a_slot()
    queued = [Queued(Work(P2, 0, 50), -10.0 + i * 1e-3) for i in range(20)]
    assert replay(P2, workers, queued, arrivals=arrivals, max_exact=5)[1] is None  # too far back: spread
    wait, dispatches = replay(P2, workers, queued, arrivals=arrivals, max_exact=50)
    assert wait == wait_s(P2, workers, queued, arrivals=arrivals) and 21 <= dispatches <= 50  # 20 ahead, then its own
