"""The wait model against scripts/estimate_offline.py's reference dispatch simulation: with the arrivals that really
came, its replay must reproduce every simulated wait; with none foreseen it may only run short."""

from __future__ import annotations

import argparse

import pytest

from scripts import estimate_offline as offline


def run(forecast: str, rows: int = 200, load: float = 1.1):
    a = argparse.Namespace(
        trace=offline.ROOT / "data/azure-2023/AzureLLMInferenceTrace_conv.csv", forecast=forecast, tau=30.0, slots=4,
        aging_interval=20.0, token_scale=0.25, max_len=2048, mix="10,20,30,40", seed=3, speedup=None)

    def dur(job):
        return job["prompt_tokens"] / 1300.0 + job["max_tokens"] / 37.5

    jobs = offline.plan(offline.load_trace(a.trace, 3000, rows), a)
    speedup = load / (sum(map(dur, jobs)) / (jobs[-1]["at"] - jobs[0]["at"]) / a.slots)
    for job in jobs:
        job["at"] /= speedup
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
