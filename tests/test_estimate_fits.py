"""The wait model on workers of different sizes: a worker's slot goes to the first job in line that fits that worker
(Queued.fits), as dispatch reads past a job whose workers are full. Pure functions (gateway/estimate.py); the real
cluster's case is tests/test_wait_estimate_sharing.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from common.tiers import Tier
from gateway.estimate import RUNNING, Held, Queued, Rates, Work, WorkerView, replay, wait_s

RATES = Rates(1000.0, 50.0)
SMALL, BIG = 0, 1


def workers(small_busy_s: float = 0.0) -> list[WorkerView]:
    """A small worker of two slots (busy ``small_busy_s``: 50 tokens a second), a big one of one slot busy 20 s."""
    busy = [Held(Work(Tier.P3, 0, small_busy_s * 50), RUNNING, 0b11)] * 2 if small_busy_s else []
    return [WorkerView(2, RATES, busy), WorkerView(1, RATES, [Held(Work(Tier.P3, 0, 1000), RUNNING, 0b11)])]


def ahead(n: int, fits: frozenset[int] | None, tier: Tier = Tier.P3, **kw) -> list[Queued]:
    return [Queued(Work(tier, 100, 1000), -10.0 + k, fits=fits, **kw) for k in range(n)]


def test_jobs_ahead_that_fit_only_the_big_worker_leave_the_small_workers_slots_to_the_job():
    """Four 20 s jobs only the big worker fits, queued before a job both fit: it starts on the small worker at once.
    It was told it would wait for one of them to end there."""
    assert wait_s(Tier.P3, workers(), ahead(4, frozenset({BIG}))) < 0.1
    assert wait_s(Tier.P3, workers(), ahead(4, None)) > 15  # jobs that fit both: they take the small slots


def test_jobs_ahead_that_fit_only_the_small_worker_leave_the_big_workers_slot_to_the_job():
    ws = [replace(workers()[SMALL], slots=1), replace(workers()[BIG], held=[])]
    assert wait_s(Tier.P3, ws, ahead(3, frozenset({SMALL}))) < 0.1
    assert wait_s(Tier.P3, ws, ahead(3, None)) > 15


def test_a_job_ahead_still_takes_the_slots_of_the_workers_it_fits():
    """Small worker busy 5 s, big 20 s: the big-only jobs wait for the big one and the job takes a small slot at 5 s;
    with two small-only jobs ahead too, they take both small slots at 5 s, the big slot goes to the first big-only
    job at 20 s, and the job waits for a small slot to free again (20.1 s later): the big-only jobs never take it."""
    ws = workers(small_busy_s=5.0)
    assert wait_s(Tier.P3, ws, ahead(4, frozenset({BIG}))) == pytest.approx(5.0)
    dispatches: list = []
    wait, _ = replay(Tier.P3, ws, ahead(4, frozenset({BIG})) + ahead(2, frozenset({SMALL})), dispatches=dispatches)
    assert [(t, i) for t, i, _ in dispatches] == [(pytest.approx(5.0), SMALL)] * 2 + [(pytest.approx(20.0), BIG)]
    assert wait == pytest.approx(5.0 + RATES.seconds(100, 1000))


def test_promoted_jobs_ahead_take_only_the_slots_of_the_workers_they_fit():
    """P3 jobs whose promise fell due are in the P2 line ahead of a new P2: only the big worker's slot is theirs."""
    due = ahead(4, frozenset({BIG}), promoted_s=-1.0)
    assert wait_s(Tier.P2, workers(), due) < 0.1
    assert wait_s(Tier.P2, workers(), [replace(q, fits=None) for q in due]) > 15


def test_fits_naming_every_worker_is_the_line_of_alike_workers():
    queued = ahead(5, None) + ahead(3, None, Tier.P2)
    every = [replace(q, fits=frozenset({SMALL, BIG})) for q in queued]
    assert replay(Tier.P3, workers(), every) == replay(Tier.P3, workers(), queued)


def test_a_long_line_of_jobs_that_fit_the_other_worker_costs_no_more_than_the_replay_bound():
    """Reading past jobs that do not fit a slot's worker must not be a scan per dispatch: 20,000 big-only jobs ahead
    of a job that the small worker, busy, frees a slot for after 5 s."""
    queued = ahead(20_000, frozenset({BIG}))
    wait, n = replay(Tier.P3, workers(small_busy_s=5.0), queued)
    assert wait == pytest.approx(5.0) and n is not None and n <= 3
    assert math.isfinite(wait_s(Tier.P3, workers(), queued + ahead(600, None)))
