"""The wait estimate's model (gateway/estimate.py): slots, preemptibility, queue order, overtaking, learning."""

from __future__ import annotations

import math

import pytest

from common.tiers import Tier
from gateway.estimate import (MAX_RHO, RUNNING, SUSPENDED, WAITING, ArrivalRates, BiasCorrection, Held, OutputLengths, Rates, Work,
                              WorkerView, wait_s)

P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3
RATES = Rates(prefill_tps=1000.0, decode_tps=100.0)  # 1 s per 100 output tokens, 0.1 s per 100 prompt tokens
BY_P0, BY_P0_P1 = 0b01, 0b11  # the default matrix: P2 preempted by P0, P3 by P0 and P1


def running(tier: Tier, decode: float, mask: int = 0, prefill: float = 0.0) -> Held:
    return Held(Work(tier, prefill, decode), RUNNING, mask)


def test_no_work_means_no_wait_and_no_workers_means_no_capacity():
    assert wait_s(P2, [WorkerView(2, RATES)], []) == 0.0
    assert wait_s(P2, [], []) == math.inf


def test_a_p2_waits_for_running_p3_it_may_not_preempt_and_a_p0_does_not():
    w = WorkerView(2, RATES, [running(P3, 300, BY_P0_P1), running(P3, 100, BY_P0_P1)])
    assert wait_s(P2, [w], []) == pytest.approx(1.0)  # the shorter one frees its slot first
    assert wait_s(P1, [w], []) == 0.0  # P1 may preempt P3
    assert wait_s(P0, [w], []) == 0.0
    w = WorkerView(2, RATES, [running(P2, 100, BY_P0), running(P0, 200)])
    assert wait_s(P1, [w], []) == pytest.approx(1.0)  # P1 may not preempt P2
    assert wait_s(P0, [w], []) == 0.0  # P0 may


def test_queued_work_ahead_takes_the_first_free_slots_in_order():
    w = WorkerView(2, RATES, [running(P3, 100), running(P3, 200)])  # free at 1 s and 2 s
    ahead = [Work(P2, 100, 100), Work(P2, 0, 300)]  # 1.1 s then 3 s
    # The first takes the slot free at 1 s (until 2.1 s), the second the one free at 2 s (until 5 s).
    assert wait_s(P2, [w], ahead) == pytest.approx(2.1)
    assert wait_s(P2, [w], ahead, handoff_s=0.05) == pytest.approx(2.15)


def test_held_work_that_starts_first_counts_lower_tiers_do_not():
    w = WorkerView(1, RATES, [running(P3, 100), Held(Work(P2, 0, 100), SUSPENDED, BY_P0),
                              Held(Work(P3, 0, 500), WAITING, BY_P0_P1)])
    # A P2 waits for a free slot: the running P3, then everything held there (the suspended P2, the waiting P3).
    assert wait_s(P2, [w], []) == pytest.approx(7.0)
    w = WorkerView(1, RATES, [running(P2, 100), Held(Work(P1, 0, 100), SUSPENDED, 0),
                              Held(Work(P3, 0, 500), WAITING, BY_P0_P1)])
    # A P1 goes to the full worker and waits there only for what outranks it: the running P2, the suspended P1.
    assert wait_s(P1, [w], []) == pytest.approx(2.0)


def test_slots_of_several_workers_and_their_own_rates():
    slow = WorkerView(1, Rates(1000.0, 10.0), [running(P3, 100)])  # free at 10 s
    fast = WorkerView(1, RATES, [running(P3, 100)])  # free at 1 s
    assert wait_s(P2, [slow, fast], [Work(P2, 0, 100)]) == pytest.approx(2.0)


def test_higher_tier_arrivals_stretch_the_wait():
    w = WorkerView(2, RATES, [running(P3, 100), running(P3, 100)])
    assert wait_s(P2, [w], [], overtaking_slot_s_per_s=1.0) == pytest.approx(1.0 / (1 - 0.5))
    assert wait_s(P2, [w], [], overtaking_slot_s_per_s=100.0) == pytest.approx(1.0 / (1 - MAX_RHO))
    assert wait_s(P2, [WorkerView(2, RATES)], [], overtaking_slot_s_per_s=1.0) == 0.0  # a free slot now


def test_output_lengths_are_learned_per_tenant_and_tier_and_bounded_by_max_tokens():
    lengths = OutputLengths()
    assert lengths.expected("a", P2, 100) == 100  # nothing learned: all of max_tokens
    for _ in range(200):
        lengths.learn("a", P2, 100, 25)
    assert lengths.expected("a", P2, 200) == pytest.approx(50)
    assert lengths.expected("b", P2, 200) == pytest.approx(50)  # an unknown tenant: the tier's share
    assert lengths.expected("a", P3, 200) == 200
    assert lengths.expected("a", P2, 200, generated=40) == pytest.approx(10)
    assert lengths.expected("a", P2, 200, generated=60) == 1  # past the expectation: at least one more
    assert lengths.expected("a", P2, 200, generated=200) == 0
    lengths.learn("a", P2, 10, 10_000)  # a report beyond max_tokens counts as max_tokens, no more
    assert lengths.expected("a", P2, 100) <= 100


def test_arrival_rates_decay_and_do_not_read_a_young_gateway_as_a_flood():
    rates = ArrivalRates(tau_s=30.0, start=0.0)
    rates.add(P0, 100, 50, now=0.5)
    prefill, decode = rates.tokens_per_s(P0, now=0.5)
    assert 0 < prefill < 12 and decode == pytest.approx(prefill / 2)  # spread over about 10 s, not 0.5 s
    for k in range(600):  # 10 tokens every 0.1 s for a minute: 100 tokens/s
        rates.add(P1, 10, 0, now=1 + k / 10)
    assert rates.tokens_per_s(P1, now=61)[0] == pytest.approx(100, rel=0.1)
    assert rates.tokens_per_s(P1, now=361)[0] < 1  # five minutes of silence
    assert rates.tokens_per_s(P2, now=61) == (0.0, 0.0)


def test_bias_correction_learns_a_steady_ratio_within_bounds_from_informative_jobs():
    bias = BiasCorrection()
    assert bias.factor(P2) == 1.0
    for _ in range(20):
        bias.learn(P2, 0.01, 0.3)  # both under half a second: no information about the ratio
    assert bias.factor(P2) == 1.0
    for _ in range(300):
        bias.learn(P2, 2.0, 3.0)
    assert bias.factor(P2) == pytest.approx(1.5, rel=0.01)
    assert bias.factor(P3) == 1.0  # per tier
    for _ in range(300):
        bias.learn(P3, 1.0, 100.0)
    assert bias.factor(P3) == pytest.approx(2.0)  # bounded: the model carries the estimate


def test_aging_ends_overtaking_by_the_tier_the_job_joins():
    w = WorkerView(1, RATES, [running(P3, 100)])  # 1 s of work ahead
    # Overtakers hold half the slot in P3 and a quarter once it aged into P2 (after 1 s): 0.5 s of progress in
    # the first second, the other 0.5 s at 0.75 per second.
    assert wait_s(P3, [w], [], overtaking_slot_s_per_s=[0.5, 0.25, 0.0], aging_interval_s=1.0) == pytest.approx(
        1 + 0.5 / 0.75)
    assert wait_s(P3, [w], [], overtaking_slot_s_per_s=[0.5, 0.25, 0.0]) == pytest.approx(2.0)  # no aging
    # Swamped in P3: no progress until it ages (after 1 s), then all of its work.
    assert wait_s(P3, [w], [], overtaking_slot_s_per_s=[100.0, 0.0], aging_interval_s=1.0) == pytest.approx(2.0)
