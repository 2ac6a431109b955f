"""The wait model against scripts/estimate_offline.py's reference dispatch simulation: with the arrivals that really
came, its replay must reproduce every simulated wait; with none foreseen it may only run short."""

from __future__ import annotations

import pytest

from scripts import estimate_offline as offline


def run(forecast: str):
    a = offline.parser().parse_args(["--forecast", forecast, "--arrivals", "200", "--load", "1.1",
                                     "--aging-interval", "20", "--seed", "3"])
    dur = offline.durations(a)
    jobs = offline.segment(a, 3000)
    waits, seen = offline.simulate(jobs, a.slots, a.aging_interval, dur)
    return offline.estimates(jobs, waits, seen, a, dur)


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
