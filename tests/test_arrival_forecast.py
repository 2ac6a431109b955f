"""The arrivals to come (gateway/arrival_forecast.py, gateway/estimate_types.Arrivals): a rate now that settles to a
long-run rate, so that a burst is seen within seconds at its start and not carried forward for minutes after it."""

from __future__ import annotations

import math
import random

import pytest

from common.tiers import Tier
from gateway.arrival_forecast import SETTLE_S, ArrivalForecast
from gateway.estimate import MAX_RHO, RUNNING, Arrivals, Held, Queued, Rates, Work, WorkerView, replay, wait_s
from gateway.estimate_futures import told_wait_s

P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3
RATES = Rates(prefill_tps=1000.0, decode_tps=100.0)  # 1 s per 100 output tokens
JOB = Work(P1, 0, 100)  # 1 s in a slot


def test_a_steady_rate_counts_and_spaces_arrivals_as_before():
    for a in (Arrivals(JOB, 2.0), Arrivals(JOB, 2.0, None, 10.0), Arrivals(JOB, 2.0, 2.0, 10.0),
              Arrivals(JOB, 2.0, 5.0, 0.0)):  # no settling time: the rate now for good
        assert a.long_run() == 2.0 and a.comes()
        assert a.count(3.0) == pytest.approx(6.0) and a.count(-1.0) == 0.0
        assert [a.time_of(k) for k in (1, 2, 7)] == pytest.approx([0.5, 1.0, 3.5])
    assert not Arrivals(JOB, 0.0).comes() and Arrivals(JOB, 0.0).time_of(1) == math.inf


def test_a_surge_dies_away_and_a_lull_fills_in():
    surge, lull = Arrivals(JOB, 10.0, 1.0, 5.0), Arrivals(JOB, 0.0, 1.0, 5.0)
    assert surge.long_run() == 1.0 and lull.comes()
    # A surge adds (now - long run) x settle arrivals in all; a lull as many fewer.
    assert surge.count(1000.0) == pytest.approx(1000.0 + 9 * 5.0)
    assert lull.count(1000.0) == pytest.approx(1000.0 - 5.0)
    assert surge.count(1.0) > 1.0 * 9 and lull.count(1.0) < 0.2
    rng = random.Random(3)
    for a in (surge, lull, Arrivals(JOB, 3.0, 0.2, 40.0), Arrivals(JOB, 0.01, 7.0, 0.5)):
        last = 0.0
        for _ in range(200):  # time_of inverts count, from a warm start or from none
            t = rng.choice([rng.uniform(0, 5), rng.uniform(0, 500), rng.expovariate(0.01)])
            k = a.count(t)
            assert a.time_of(k) == pytest.approx(t, rel=1e-6, abs=1e-6)
            assert a.time_of(k, after=min(last, t)) == pytest.approx(t, rel=1e-6, abs=1e-6)
            last = t
        assert a.time_of(a.count(10.0)) < a.time_of(a.count(10.0) + 1)  # increasing


def test_a_surge_that_dies_away_to_nothing_brings_a_bounded_number():
    a = Arrivals(JOB, 4.0, 0.0, 5.0)
    assert a.comes() and a.long_run() == 0.0
    assert a.count(1e6) == pytest.approx(20.0)
    assert math.isfinite(a.time_of(19.5)) and a.time_of(20.0) == math.inf and a.time_of(25.0) == math.inf
    # The wait behind it is finite however far ahead of the job it is: the slot's 1 s and 20 jobs of 1 s, at most.
    workers = [WorkerView(1, RATES, [Held(Work(P2, 0, 100), RUNNING, 0)])]
    for wait in (wait_s(P3, workers, [], arrivals=[a]), told_wait_s(P3, workers, [], arrivals=[a])):
        assert 1.0 < wait <= 21.0 + 1e-6


def test_a_deep_wait_counts_the_rest_of_a_surge_and_then_the_long_run_rate():
    """Behind 40 queued P3s on 2 slots, a surge of P1s dying away adds its (now - long run) x settle jobs to the
    wait, replayed one by one or, past the replayed dispatches, spread over the slots (the fluid tail)."""
    slots = [WorkerView(2, RATES, [Held(Work(P2, 0, 100), RUNNING, 0)] * 2)]
    ahead = [Queued(Work(P3, 0, 100), -1.0 - n / 100) for n in range(40)]
    surge, steady = Arrivals(JOB, 1.5, 0.5, 20.0), Arrivals(JOB, 0.5)
    waits = {(name, max_exact): replay(P3, slots, ahead, arrivals=[a], max_exact=max_exact)[0]
             for name, a in (("surge", surge), ("steady", steady)) for max_exact in (3, 100_000)}
    # The surge's (1.5 - 0.5) x 20 = 20 jobs of 1 s, drained by 2 slots at 0.5 s a second of long-run arrivals.
    for max_exact in (3, 100_000):
        assert waits["surge", max_exact] - waits["steady", max_exact] == pytest.approx(20 / (2 - 0.5), rel=0.25)
    assert waits["surge", 3] == pytest.approx(waits["surge", 100_000], rel=0.1)
    assert waits["steady", 3] == pytest.approx(waits["steady", 100_000], rel=0.1)


def test_a_burst_is_seen_within_seconds_and_settles_to_its_long_run_rate():
    f = ArrivalForecast(0.0)
    workers = [WorkerView(2, RATES, []), WorkerView(2, RATES, [])]
    for n in range(60):  # ten quiet minutes: a P1 every 10 s (0.1 s of work a second, of 4 slots)
        f.add(P1, 0, 100, 10.0 * n)
    quiet = f.arrivals([P0, P1], 600.0, workers)[1]
    assert quiet.long_run() == pytest.approx(0.1, rel=0.2) and quiet.settle_s == SETTLE_S
    for n in range(90):  # then a burst: 90 P1s in 3 s
        f.add(P1, 0, 100, 600.0 + n / 30)
    p0, p1 = f.arrivals([P0, P1], 603.0, workers)
    assert p0.per_s == 0.0 and not p0.comes()  # no P0 ever came
    assert p1.per_s > 3.0  # seen at once
    # The ten minutes with the burst in them: about 90 + 60 x 0.63 jobs decayed over 600 s, of which 63 % was seen.
    assert p1.long_run() == pytest.approx((90 + 60 * 0.632) / 600 / 0.632, rel=0.05)
    # Carried forward: the long-run rate and the rest of the surge, not the burst's rate for minutes.
    assert p1.count(600.0) - p1.long_run() * 600.0 == pytest.approx((p1.per_s - p1.long_run()) * SETTLE_S)
    assert p1.count(600.0) < p1.per_s * 600.0 / 4


def test_a_young_gateways_burst_is_not_taken_for_its_long_run_rate():
    """A fresh gateway's first seconds are all the history it has: a burst then reads as a long-run rate many
    times what the cluster serves. The long run of all tiers together is capped at MAX_RHO of the slots."""
    f = ArrivalForecast(0.0)
    workers = [WorkerView(4, RATES, [])]
    for n in range(100):  # 100 P1s and 100 P2s of 1 s in the first 2 s, for 4 slots
        f.add(P1, 0, 100, n / 50)
        f.add(P2, 0, 100, n / 50)
    p1, p2 = f.arrivals([P1, P2], 2.0, workers)
    assert p1.per_s > 5.0 and p2.per_s > 5.0
    assert p1.long_run() + p2.long_run() == pytest.approx(MAX_RHO * 4)  # 1 s jobs: 0.8 of the 4 slots busy
    assert p1.long_run() == pytest.approx(p2.long_run())
    # Unless the cluster is unknown: then nothing to cap against.
    uncapped = ArrivalForecast(0.0)
    for n in range(100):
        uncapped.add(P1, 0, 100, n / 50)
    assert uncapped.arrivals([P1], 2.0, [])[0].long_run() > 5.0


def test_bad_time_scales_are_refused():
    for bad in ((0.0, 10.0, 600.0), (15.0, -1.0, 600.0), (15.0, 10.0, 0.0)):
        with pytest.raises(ValueError, match="arrival forecast"):
            ArrivalForecast(0.0, *bad)
