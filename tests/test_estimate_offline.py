"""The wait model against scripts/estimate_offline.py's reference dispatch simulation: with the arrivals that really
came, its replay must reproduce every simulated wait; with none foreseen it may only run short."""

from __future__ import annotations

import pytest

from scripts import estimate_offline as offline


def run(forecast: str, *extra: str, promises: bool = False):
    a = offline.parser().parse_args(["--forecast", forecast, "--arrivals", "200", "--load", "1.1",
                                     "--aging-interval", "20", "--seed", "3", *extra,
                                     *([] if promises else ["--promise-factor", "0"])])
    return offline.run(offline.segment(a, 3000), a, offline.durations(a))


def test_the_model_replays_the_simulated_dispatches_exactly_given_the_real_arrivals():
    rows = run("exact")
    waited = [r for r in rows if r[2] >= 0.5]
    assert len(waited) > 50 and {r[0] for r in waited} >= {"P2", "P3"}  # overloaded, with aging at work
    for tier, estimate, wait in rows:
        assert estimate == pytest.approx(wait, abs=1e-6), tier


def test_without_a_forecast_it_can_only_run_short_and_the_measured_rates_come_closer():
    none, rates = run("none"), run("rates")
    assert all(e <= w + 1e-6 for _, e, w in none)  # arrivals to come only ever delay a job
    short = sum(w - e for _, e, w in none)
    assert sum(abs(w - e) for _, e, w in rates) < 0.8 * short


def test_the_tail_arrives_but_is_not_judged():
    judged = run("exact", "--tail", "0")
    assert len(run("exact", "--tail", "100")) == len(judged) == 200
    # Later arrivals can only delay the judged jobs; with the same pace, some of the last ones are.
    a = offline.parser().parse_args(["--arrivals", "200", "--load", "1.1", "--aging-interval", "20", "--seed", "3",
                                     "--tail", "100", "--promise-factor", "0"])
    jobs = offline.segment(a, 3000)
    assert [j["judged"] for j in jobs] == [True] * 200 + [False] * 100
    a.tail = 0
    assert [j["at"] for j in offline.segment(a, 3000)] == [j["at"] for j in jobs[:200]]
    later = [w for _, _, w in run("exact", "--tail", "100")]
    assert all(x >= y - 1e-9 for x, y in zip(later, [w for _, _, w in judged])) and later != [w for _, _, w in judged]


def test_pick_takes_the_median_or_the_estimate_with_most_waits_within_2x():
    waits = [1.0, 1.0, 1.0, 1.1, 3.0, 3.0, 3.0, 3.5, 50.0]
    assert offline.pick(waits, "median") == 3.0
    e = offline.pick(waits, "within-2x")
    assert sum(w / 2 <= e <= 2 * w for w in waits) == 8  # 1.0 .. 3.5 (no estimate covers 50 with them)
    assert e == 2.0  # of the estimates that cover them (1.75 .. 2.0), the nearest to the median
    assert offline.pick([0.0] * 5, "within-2x") == 0.0
