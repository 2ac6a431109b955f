"""The wait estimate's model (gateway/estimate.py): slots, preemptibility, queue order, overtaking, aging;
and what it learns (gateway/wait_learning.py)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from common.tiers import ALL_TIERS, Tier
from gateway.estimate import (MAX_RHO, RUNNING, SUSPENDED, WAITING, Arrivals, Held, Queued, Rates, Work, WorkerView,
                              rank_at, wait_s)
from gateway.waits import Waits
from gateway.wait_learning import ArrivalRates, BiasCorrection, HandOffs, OutputLengths

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
    ahead = [Queued(Work(P2, 100, 100), -2.0), Queued(Work(P2, 0, 300), -1.0)]  # 1.1 s then 3 s
    # The first takes the slot free at 1 s (until 2.1 s), the second the one free at 2 s (until 5 s).
    assert wait_s(P2, [w], ahead) == pytest.approx(2.1)
    w.handoff_s = 0.05  # a job sent there starts 0.05 s after its slot freed
    assert wait_s(P2, [w], ahead) == pytest.approx(2.2)  # theirs and its own


def test_held_work_that_starts_first_counts_lower_tiers_do_not():
    w = WorkerView(1, RATES, [running(P3, 100), Held(Work(P2, 0, 100), SUSPENDED, BY_P0),
                              Held(Work(P3, 0, 500), WAITING, BY_P0_P1)])
    # A P2 waits for a free slot: the running P3, then everything held there (the suspended P2, the waiting P3).
    assert wait_s(P2, [w], []) == pytest.approx(7.0)
    w = WorkerView(1, RATES, [running(P2, 100), Held(Work(P1, 0, 100), SUSPENDED, 0),
                              Held(Work(P3, 0, 500), WAITING, BY_P0_P1)])
    # A P1 goes to the full worker and waits there only for what outranks it: the running P2, the suspended P1.
    assert wait_s(P1, [w], []) == pytest.approx(2.0)


def test_a_p1_waits_behind_a_suspended_job_it_may_not_preempt_which_resumes_in_the_first_free_slot():
    # A P0 preempted a P2 here. The suspended P2 holds its slot's credit, so when the P0 ends the worker resumes
    # it, and a P1 (which may not preempt a P2) gets no slot until the P2 ends too.
    w = WorkerView(1, RATES, [running(P0, 100), Held(Work(P2, 0, 200), SUSPENDED, BY_P0),
                              Held(Work(P3, 0, 500), SUSPENDED, BY_P0_P1)])
    assert wait_s(P1, [w], []) == pytest.approx(3.0)  # the P0, then the P2; the P3 it would preempt at once
    assert wait_s(P0, [w], []) == pytest.approx(1.0)  # a P0 preempts the P2 as soon as it resumes
    assert wait_s(P2, [w], []) == pytest.approx(8.0)  # and a P2 waits for all of it


def test_slots_of_several_workers_and_their_own_rates():
    slow = WorkerView(1, Rates(1000.0, 10.0), [running(P3, 100)])  # free at 10 s
    fast = WorkerView(1, RATES, [running(P3, 100)])  # free at 1 s
    assert wait_s(P2, [slow, fast], [Queued(Work(P2, 0, 100), -1.0)]) == pytest.approx(2.0)


def test_higher_tier_arrivals_take_slots_before_it_and_lower_or_newer_ones_never():
    p0s = Arrivals(Work(P0, 0, 100), per_s=0.5)  # 1 s jobs, the k-th k gaps from now: at 2 s, 4 s, 6 s...
    free_at_1 = WorkerView(1, RATES, [running(P3, 100)])
    assert wait_s(P2, [free_at_1], [], arrivals=[p0s]) == pytest.approx(1.0)  # the first P0 is not there yet
    free_at_2 = WorkerView(1, RATES, [running(P3, 200)])
    assert wait_s(P2, [free_at_2], [], arrivals=[p0s]) == pytest.approx(3.0)  # the P0 of 2 s goes first
    for newer in (Arrivals(Work(P2, 0, 100), per_s=2.0), Arrivals(Work(P3, 0, 100), per_s=2.0)):
        assert wait_s(P2, [free_at_2], [], arrivals=[newer]) == pytest.approx(2.0)
    assert wait_s(P2, [WorkerView(2, RATES)], [], arrivals=[p0s]) == 0.0  # a free slot now


def test_a_drawn_future_takes_poisson_arrivals():
    free_at_2 = WorkerView(1, RATES, [running(P3, 200)])  # free at 2 s
    p0s = Arrivals(Work(P0, 0, 100), per_s=0.5)
    waits = [wait_s(P2, [free_at_2], [], arrivals=[p0s], rng=random.Random(seed)) for seed in range(2000)]
    # No P0 before 2 s with probability exp(-0.5 * 2): then the slot is the P2's at 2 s; else later.
    assert sum(w == pytest.approx(2.0) for w in waits) / len(waits) == pytest.approx(math.exp(-1.0), abs=0.03)
    assert min(waits) == pytest.approx(2.0) and max(waits) > 4.0
    # Evenly spaced (no rng), the first P0 comes at 2 s and takes the slot: one point of that spread.
    assert wait_s(P2, [free_at_2], [], arrivals=[p0s]) == pytest.approx(3.0)
    assert wait_s(P2, [free_at_2], [], arrivals=[p0s], rng=random.Random(7)) == wait_s(
        P2, [free_at_2], [], arrivals=[p0s], rng=random.Random(7))  # seeded: the same future


def test_arrivals_that_overtake_for_good_are_capped_so_the_wait_stays_finite():
    w = WorkerView(1, RATES, [running(P3, 200)])  # free at 2 s
    flood = Arrivals(Work(P0, 0, 100), per_s=10.0)  # ten times the slot, capped to MAX_RHO of it
    # At 0.8 a second the k-th comes at 1.25 k s: four take the slot before a gap opens at 6 s.
    assert MAX_RHO == 0.8 and wait_s(P2, [w], [], arrivals=[flood]) == pytest.approx(6.0)


def test_aging_puts_a_job_ahead_of_newer_jobs_of_the_tier_it_joins():
    assert [rank_at(P3, -1.0, t, 10.0) for t in (0.0, 9.0, 9.5, 19.0, 40.0)] == [3, 2, 2, 1, 1]
    assert rank_at(P1, -100.0, 0.0, 10.0) == 1 and rank_at(P3, -100.0, 0.0, math.inf) == 3
    w = WorkerView(1, RATES, [running(P3, 200)])  # free at 2 s
    p2s = Arrivals(Work(P2, 0, 100), per_s=4.0)  # four times the slot: a P3 never gets it before it ages
    assert wait_s(P3, [w], [], arrivals=[p2s], aging_interval_s=10.0) == pytest.approx(10.0)
    # Admitted 9 s ago: it is a P2 from 1 s on, ahead of every P2 that came since, and takes the slot at 2 s.
    assert wait_s(P3, [w], [], enqueued_s=-9.0, arrivals=[p2s], aging_interval_s=10.0) == pytest.approx(2.0)
    # Without aging they overtake it for good: capped as above, they leave it the slot at 6 s.
    assert wait_s(P3, [w], [], arrivals=[p2s]) == pytest.approx(6.0)


def test_jobs_aged_into_p1_take_free_slots_first_but_never_preempt_for_a_p1():
    # Both slots run P3 work a P1 may preempt; five P3s admitted long ago are P1s in line now, older than it.
    w = WorkerView(2, RATES, [running(P3, 1000, BY_P0_P1), running(P3, 1000, BY_P0_P1)])  # free at 10 s
    aged = [Queued(Work(P3, 0, 100), enqueued_s=-200.0 + k) for k in range(5)]
    assert rank_at(P3, -200.0, 0.0, 60.0) == 1
    # They wait for a slot to free, as P3s; the P1 preempts at once (the dispatcher passes over them).
    assert wait_s(P1, [w], aged, aging_interval_s=60.0) == 0.0
    # An older P1 (admitted as one) does go first, in the slot it preempts; one per victim.
    older = [Queued(Work(P1, 0, 300), enqueued_s=-1.0)] * 2
    assert wait_s(P1, [w], aged + older, aging_interval_s=60.0) == pytest.approx(3.0)
    # A P2 has no victim: the aged jobs go ahead of it in the slots as they free (one each second from 10 s).
    assert wait_s(P2, [w], aged, aging_interval_s=60.0) == pytest.approx(12.0)


def test_an_older_p1_preempts_a_job_aged_ahead_of_both_before_the_p1_does():
    # One slot, running P1 work until 1 s. First in line: a P3 aged into P1 long ago, then a P1 older than the job.
    w = WorkerView(1, RATES, [running(P1, 100)])
    aged = Queued(Work(P3, 0, 500), enqueued_s=-200.0)
    older = Queued(Work(P1, 0, 300), enqueued_s=-1.0)
    # The aged job takes the slot as it frees, and the first in line that may preempt it is the older P1, not the
    # job (the dispatcher sends preempting jobs in queue order): it runs 1-4 s, then the P3 resumes there (it holds
    # the slot's credit) and the job preempts it.
    assert wait_s(P1, [w], [aged, older], aging_interval_s=60.0) == pytest.approx(4.0)
    # Without the older P1 the job preempts the aged P3 as soon as it starts.
    assert wait_s(P1, [w], [aged], aging_interval_s=60.0) == pytest.approx(1.0)
    # A P0 older than the job preempts it too; a P2 (no preemption) waits for the P3 to end.
    assert wait_s(P1, [w], [aged, Queued(Work(P0, 0, 200), enqueued_s=-0.5)],
                  aging_interval_s=60.0) == pytest.approx(3.0)
    assert wait_s(P2, [w], [aged], aging_interval_s=60.0) == pytest.approx(6.0)


def test_an_older_lower_tier_job_that_ages_first_goes_ahead():
    w = WorkerView(1, RATES, [running(P3, 500)])  # free at 5 s
    old_p3 = Queued(Work(P3, 0, 300), enqueued_s=-7.0)  # joins P2 at 3 s, ahead of a P2 admitted now
    assert wait_s(P2, [w], [old_p3], aging_interval_s=10.0) == pytest.approx(8.0)
    assert wait_s(P2, [w], [old_p3], aging_interval_s=100.0) == pytest.approx(5.0)  # still a P3 at 5 s
    assert wait_s(P2, [w], [Queued(Work(P3, 0, 300), enqueued_s=-1.0)], aging_interval_s=10.0) == pytest.approx(5.0)


def test_work_waiting_in_a_worker_with_a_free_slot_starts_there_first():
    # Sent to the free slot and not yet stepped: by the time a P0 gets there, the P1 runs, and P0 may not preempt it.
    w = WorkerView(1, RATES, [Held(Work(P1, 0, 200), WAITING, 0)])
    assert wait_s(P0, [w], []) == pytest.approx(2.0)
    w = WorkerView(1, RATES, [Held(Work(P3, 0, 200), WAITING, BY_P0_P1)])
    assert wait_s(P0, [w], []) == 0.0 and wait_s(P2, [w], []) == pytest.approx(2.0)


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
    a = rates.arrivals(P0, now=0.5)
    assert 0 < a.per_s < 0.12 and a.work == Work(P0, 100, 50)  # one job, spread over about 10 s, not 0.5 s
    for k in range(600):  # a 10-token job every 0.1 s for a minute
        rates.add(P1, 10, 0, now=1 + k / 10)
    a = rates.arrivals(P1, now=61)
    assert a.per_s == pytest.approx(10, rel=0.1) and a.work.prefill == pytest.approx(10)
    assert rates.arrivals(P1, now=361).per_s < 0.1  # five minutes of silence
    assert rates.arrivals(P2, now=61).per_s == 0.0


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


def test_an_estimate_replays_a_bounded_number_of_dispatches_and_spreads_the_rest(monkeypatch):
    import gateway.estimate as estimate

    monkeypatch.setattr(estimate, "MAX_EXACT_DISPATCHES", 100)
    w = WorkerView(1, RATES, [running(P3, 100)])
    backlog = [Queued(Work(P2, 0, 100), -1.0 - k) for k in range(1000)]  # 1000 s of work ahead
    assert wait_s(P2, [w], backlog) == pytest.approx(1001.0)  # 100 replayed, 900 after them: all of it


def test_every_job_pays_its_workers_hand_off_the_waiting_one_too():
    # Slots free at 1 s and 2 s on a worker whose jobs start 0.25 s after they are sent.
    w = WorkerView(2, RATES, [running(P3, 100, BY_P0_P1), running(P3, 200, BY_P0_P1)], handoff_s=0.25)
    assert wait_s(P2, [w], []) == pytest.approx(1.25)
    ahead = [Queued(Work(P2, 100, 100), -2.0)]  # takes the slot free at 1 s: starts 1.25, holds it 1.1 s
    assert wait_s(P2, [w], ahead) == pytest.approx(2.25)  # then the slot free at 2 s
    # A free slot next to running work: the job waits for the step in progress.
    assert wait_s(P2, [WorkerView(2, RATES, [running(P3, 100, BY_P0_P1)], handoff_s=0.25)], []) == pytest.approx(0.25)
    # A P0 preempts at once, but starts only when the worker has read it: the hand-off too.
    assert wait_s(P0, [w], []) == pytest.approx(0.25)


def test_a_job_sent_to_an_idle_worker_pays_its_idle_hand_off_not_a_step():
    idle = WorkerView(2, RATES, [], handoff_s=0.8, idle_handoff_s=0.01)
    assert wait_s(P2, [idle], []) == pytest.approx(0.01)
    assert wait_s(P0, [idle], []) == pytest.approx(0.01)
    # Work queued ahead takes the idle worker's first slot at once; the job gets the second one, and by then
    # the worker is running that work, so the job is read after a step.
    ahead = [Queued(Work(P2, 100, 100), -1.0)]
    assert wait_s(P2, [idle], ahead) == pytest.approx(0.8)
    # On one slot: the job ahead runs 0.01 + 1.1 s and leaves the worker idle again.
    one = WorkerView(1, RATES, [], handoff_s=0.8, idle_handoff_s=0.01)
    assert wait_s(P2, [one], ahead) == pytest.approx(0.01 + 1.1 + 0.01)
    # Busy until 1 s on one slot, the other free: the job there waits for a step; after the running job ends
    # the second job ahead finds the worker still running the first, and so on.
    w = WorkerView(2, RATES, [running(P3, 100, BY_P0_P1)], handoff_s=0.5, idle_handoff_s=0.0)
    assert wait_s(P3, [w], []) == pytest.approx(0.5)
    # P0: the running P3 is its victim, but the worker is stepping it, so a step's hand-off.
    assert wait_s(P0, [w], []) == pytest.approx(0.5)


def test_hand_offs_are_learned_per_worker_capped_and_bounded():
    h = HandOffs()
    assert h.of("w1") == 0.0  # nothing started anywhere yet
    h.learn("w1", 0.4)
    h.learn("w2", 0.2)
    assert h.of("w1") == pytest.approx(0.4) and h.of("new") == pytest.approx(0.3)  # a new one: the others' mean
    h.learn("w1", 1e9)  # one stalled job moves it by at most its capped share
    assert h.of("w1") == pytest.approx(0.95 * 0.4 + 0.05 * HandOffs.MAX_SAMPLE_S)
    h.learn("w1", -5.0)  # a clock step backwards counts as no delay, never a negative one
    assert h.of("w1") >= 0
    for i in range(HandOffs.MAX_WORKERS + 10):
        h.learn(f"churn-{i}", 0.1, busy=True)
        h.learn(f"churn-{i}", 0.0, busy=False)
    assert len(h._mean) == 2 * HandOffs.MAX_WORKERS and ("w1", True) not in h._mean


def test_a_workers_hand_off_while_busy_and_while_idle_are_learned_apart():
    h = HandOffs()
    for _ in range(50):
        h.learn("w1", 0.6, busy=True)  # sent mid-step
        h.learn("w1", 0.002, busy=False)  # sent to an idle worker
    assert h.of("w1", busy=True) == pytest.approx(0.6) and h.of("w1", busy=False) == pytest.approx(0.002)
    h.learn("w2", 0.2, busy=False)
    assert h.of("w2", busy=True) == pytest.approx(0.6)  # none measured busy there yet: the others'


def test_a_measured_wait_counts_the_time_the_dispatch_sat_unread_at_the_worker():
    waits = Waits()
    waits.dispatched("j", 100.0)
    # The worker read it 2 s after it was sent (a step was running) and started it 0.01 s after that; its first
    # token frame left 0.5 s after the prefill started and came here at 102.52.
    assert waits.prefill_started("j", 0.01, age_s=0.5, now=102.52) == (pytest.approx(2.02), True)
    assert waits.queued_s("j", enqueued_at=99.0) == pytest.approx(3.02)
    assert waits.prefill_started("j", 0.01, age_s=0.1, now=150.0) is None  # the first start ends the wait
    assert waits.queued_s("j", enqueued_at=99.0) == pytest.approx(3.02)
    # An older worker reports only the time since it read the job: the dispatch time plus that, as before.
    # Sent to an idle worker, the hand-off says so (the estimate learns the two cases apart).
    waits.dispatched("k", 10.0, busy=False)
    assert waits.prefill_started("k", 0.3) == (pytest.approx(0.3), False)
    # A frame that says its prefill started before the job was even sent (clock skew, a stale frame): never
    # earlier than the dispatch plus the worker's own delay.
    waits.dispatched("m", 10.0)
    assert waits.prefill_started("m", 0.2, age_s=50.0, now=11.0).seconds == pytest.approx(0.2)
    # Nonsense ages (the protocol takes any float) never move a start before its floor or make it NaN.
    for i, age in enumerate((math.nan, math.inf, -math.inf, -1.0)):
        waits.dispatched(f"n{i}", 10.0)
        seconds = waits.prefill_started(f"n{i}", 0.2, age_s=age, now=11.0).seconds
        assert math.isfinite(seconds) and 0.2 - 1e-9 <= seconds <= 1.0 + 1e-9



def test_a_hand_off_is_told_once_per_attempt_and_only_by_the_gateway_that_sent_it():
    """The hand-off (ts_dispatch_handoff_seconds, the estimate's HandOffs) is a dispatch's: this gateway re-sending
    a job tells the new attempt's too (it told only the first: the first start of any attempt ended it), and an
    attempt another gateway sent, whose frames come here (its gateway went away, worker/routes.py), tells none
    (it was measured from this gateway's earlier dispatch: its lost attempt's time, seconds, as a hand-off)."""
    waits = Waits()
    waits.dispatched("j", 100.0, attempt=1)
    assert waits.prefill_started("j", 0.2, attempt=1) == (pytest.approx(0.2), True)
    assert waits.prefill_started("j", 0.2, attempt=1) is None  # its JobFinished says it again
    waits.dispatched("j", 130.0, busy=False, attempt=2)
    assert waits.prefill_started("j", 0.1, age_s=0.05, now=130.3, attempt=2) == (pytest.approx(0.25), False)
    assert waits.queued_s("j", enqueued_at=99.0) == pytest.approx(1.2)  # the first start still ends the wait
    waits.dispatched("k", 10.0, attempt=1)  # never started: its worker died
    assert waits.prefill_started("k", 0.1, age_s=0.5, now=25.0, attempt=2) is None
    assert waits.queued_s("k", enqueued_at=9.0) == pytest.approx(15.5)

def test_past_the_replay_the_spread_work_agrees_with_the_exact_replay(monkeypatch):
    """Random deep queues (every tier, aging or none, arrivals of the higher tiers, several workers of unequal
    speed and hand-off): the estimate replayed one by one for its first dispatches and spread over the slots for
    the rest against the one replayed to the end."""
    import gateway.estimate as estimate

    rng = random.Random(11)
    ratios = []
    for _ in range(30):
        workers = [WorkerView(rng.choice([1, 2, 4]), Rates(rng.uniform(300, 2000), rng.uniform(20, 80)),
                              handoff_s=rng.uniform(0, 0.2)) for _ in range(rng.choice([1, 2, 3]))]
        mix = [rng.random() for _ in ALL_TIERS]
        queued = [Queued(Work(rng.choices(ALL_TIERS, mix)[0], rng.randint(10, 2000), rng.randint(1, 300)),
                         -rng.uniform(0, 300)) for _ in range(rng.choice([600, 1200]))]
        aging = rng.choice([60.0, 300.0, math.inf])
        arrivals = [Arrivals(Work(t, rng.randint(10, 1000), rng.randint(1, 200)), rng.choice([0.0, 0.05, 0.3, 1.0]))
                    for t in ALL_TIERS[:3]]
        tier = rng.choice(ALL_TIERS)
        spread = wait_s(tier, workers, queued, arrivals=arrivals, aging_interval_s=aging)
        monkeypatch.setattr(estimate, "MAX_EXACT_DISPATCHES", 10**7)
        exact = wait_s(tier, workers, queued, arrivals=arrivals, aging_interval_s=aging)
        monkeypatch.undo()
        if exact > 0:
            ratios.append(spread / exact)
    assert len(ratios) >= 25 and all(0.75 <= r <= 1.25 for r in ratios), sorted(ratios)
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.03)


def test_a_p1_preempts_the_suspended_work_that_resumes_in_a_freed_slot_before_jobs_aged_up_ahead_of_it():
    # Found on the cluster (F1): P1s told 2.7-3 s started in 0.6 s. Their worker's slots freed in 0.6 s; the
    # suspended P3 work there resumed in them (it holds their credit) and the P1 preempted it, while the P2s aged
    # into the P1 queue ahead of it, which preempt as P2s (not at all), waited for a slot that frees.
    w = WorkerView(1, RATES, [running(P0, 60), Held(Work(P3, 0, 500), SUSPENDED, BY_P0_P1)])
    aged = [Queued(Work(P2, 0, 300), -70.0)]  # admitted 70 s ago: in P1 since 10 s ago, ahead of a new P1
    assert wait_s(P1, [w], aged, aging_interval_s=60.0) == pytest.approx(0.6)
    # Without suspended work there the freed slot is the aged job's, and the P1 waits for it to end.
    w = WorkerView(1, RATES, [running(P0, 60)])
    assert wait_s(P1, [w], aged, aging_interval_s=60.0) == pytest.approx(3.6)
    # A P2 does not preempt the resuming P3: it waits for the aged job, then for the P3 (it holds the credit).
    w = WorkerView(1, RATES, [running(P0, 60), Held(Work(P3, 0, 500), SUSPENDED, BY_P0_P1)])
    assert wait_s(P2, [w], aged, aging_interval_s=60.0) == pytest.approx(0.6 + 5.0 + 3.0)


def test_a_victim_preempted_again_resumes_in_the_next_slot_its_worker_frees_not_after_its_preemptor():
    """Found on the conversation replay (fifty-first session): a P1 told 2.5 s started in 1.15 s, and two more P1s
    missed 2x so. The suspended P3 resumed in the first slot its worker freed and an older P1 preempted it there;
    suspended again, it resumed in the next slot that worker freed, where the P1 preempted it in turn. The model
    had it resume only after its first preemptor's end, so the second slot went to a job aged into P1 ahead of the
    P1 (which waits for a free slot, as the P2 it was admitted as, and got none while the P3 held the credit)."""
    held = [running(P1, 60), running(P1, 100), Held(Work(P3, 0, 500), SUSPENDED, BY_P0_P1, 8)]
    w = WorkerView(2, RATES, held)
    older = Queued(Work(P1, 0, 300), enqueued_s=-1.0)
    aged = Queued(Work(P2, 0, 300), enqueued_s=-70.0)  # in P1 since 10 s ago, ahead of both P1s
    # 0.6 s: the P3 resumes, the older P1 preempts it after its residency (0.08 s); 1.0 s: it resumes again there,
    # and the job preempts it after its residency.
    assert wait_s(P1, [w], [older, aged], aging_interval_s=60.0) == pytest.approx(1.08)
    # A P0 is first in line for the first (the older P1 then waits for the second).
    assert wait_s(P0, [w], [older, aged], aging_interval_s=60.0) == pytest.approx(0.68)
    # A P2 preempts nobody: the aged job goes first, into the first slot that frees for good (the older P1's end,
    # 3.68 s: the P3 holds the other until it ends).
    assert wait_s(P2, [w], [older, aged], aging_interval_s=60.0) > 3.68


def test_a_p1_sent_to_a_victim_guarded_to_its_end_takes_its_slot_before_jobs_aged_ahead_of_it():
    """A worker reports work its guards protect to its end as a victim all the same, so the dispatcher sends a P1
    there at once (a code-trace P1 sent as it was admitted, told 2.0 s, started in 0.5 s): waiting in the worker, it
    takes the slot as that work ends, before a job aged into P1 ahead of it, which waits in Redis for a free slot."""
    w = WorkerView(1, RATES, [Held(Work(P3, 0, 3), RUNNING, BY_P0_P1, 3)])  # 3 tokens left, all of them guarded
    aged = [Queued(Work(P2, 0, 300), -70.0)]
    assert wait_s(P1, [w], aged, aging_interval_s=60.0) == pytest.approx(0.03)
    # The slot is an ordinary one once the job ends there: the aged job has it then, and a P2 waits for both.
    assert wait_s(P2, [w], aged, aging_interval_s=60.0) == pytest.approx(3.03)


def test_a_victim_its_guards_protect_frees_its_slot_to_preemption_only_when_they_lift():
    """The worker leaves a resumed victim alone for its residency (min_residency_steps tokens, after any prompt it
    must re-read) and one near its end to the end (worker/preemption.PreemptionPolicy.guard): a P0 told it takes
    such a slot at once waited that long (bench_estimate, runs r6 and r4 of the twelfth session: told 0.07-0.28 s,
    waited 0.67-1.02 s, with nothing started before it)."""
    def p3(decode: float, guard: float, prefill: float = 0.0, status: int = RUNNING) -> Held:
        return Held(Work(P3, prefill, decode), status, BY_P0_P1, guard)
    one = lambda *held: [WorkerView(1, RATES, list(held))]  # noqa: E731
    assert wait_s(P0, one(p3(300, 0))) == 0.0  # unguarded: preempted at once
    assert wait_s(P0, one(p3(300, 8))) == pytest.approx(0.08)  # 8 tokens of residency left at 100/s
    assert wait_s(P0, one(p3(300, 8, prefill=500))) == pytest.approx(0.58)  # re-reading its prompt first
    assert wait_s(P0, one(p3(3, 3))) == pytest.approx(0.03)  # protected to its end: the slot frees then
    assert wait_s(P2, one(p3(300, 8))) == pytest.approx(3.0)  # a P2 may not preempt it at all, guard or none
    # A suspended P3 resumes in the first slot that frees (it holds its credit), re-reads its prompt and only
    # after its residency may the P0 preempt it; the guard of the running P1 (which a P0 may not preempt) is moot.
    held = [Held(Work(P1, 0, 100), RUNNING, 0, 8), p3(200, 8, prefill=500, status=SUSPENDED)]
    assert wait_s(P0, [WorkerView(1, RATES, held)]) == pytest.approx(1.0 + 0.5 + 0.08)
    # Of two victims, the one whose guard lifts first.
    assert wait_s(P0, [WorkerView(2, RATES, [p3(300, 20), p3(300, 5)])]) == pytest.approx(0.05)


def test_a_job_sent_while_its_worker_prefills_a_long_prompt_starts_after_that_step():
    """The worker's next step prefills the prompt of work it holds (just sent, or waiting there for a free slot):
    a job sent meanwhile starts its prefill in the step after it, a P0 that preempts at once too."""
    long_prompt = Held(Work(P2, 1300, 100), WAITING, BY_P0)  # 1.3 s of prefill at 1000 tokens/s
    w = WorkerView(2, RATES, [running(P3, 300, BY_P0_P1), long_prompt], handoff_s=0.05, idle_handoff_s=0.01)
    assert wait_s(P0, [w], []) == pytest.approx(1.3)  # its victim is there at once; the step is not
    assert wait_s(P1, [w], []) == pytest.approx(1.3)  # a P1 too: it preempts the P3 after the P2's prefill
    # The same worker without the prompt to prefill: the learned hand-off, a tenth of that.
    plain = WorkerView(2, RATES, [running(P3, 300, BY_P0_P1), Held(Work(P2, 0, 100), WAITING, BY_P0)],
                       handoff_s=0.05, idle_handoff_s=0.01)
    assert wait_s(P0, [plain], []) == pytest.approx(0.05)
    # A prefill already under way counts what is left of it; one waiting for a slot too (by the time the job
    # arrives a slot may have freed for it).
    under_way = WorkerView(2, RATES, [running(P3, 300, BY_P0_P1), running(P2, 100, BY_P0, prefill=400)],
                           handoff_s=0.05)
    assert wait_s(P0, [under_way], []) == pytest.approx(0.4)
    no_slot = WorkerView(1, RATES, [running(P3, 300, BY_P0_P1), long_prompt], handoff_s=0.05)
    assert wait_s(P0, [no_slot], []) == pytest.approx(1.3)
    assert wait_s(P0, [WorkerView(1, RATES, [running(P3, 300, BY_P0_P1), Held(Work(P2, 1300, 100), SUSPENDED, BY_P0)],
                                  handoff_s=0.05)], []) == pytest.approx(0.05)  # suspended: its prompt is cached
    # A job whose slot frees after the step is over pays the hand-off only (an idle worker's, here).
    later = WorkerView(1, RATES, [running(P2, 300, BY_P0, prefill=200)], handoff_s=0.05, idle_handoff_s=0.01)
    assert wait_s(P1, [later], []) == pytest.approx(0.2 + 3.0 + 0.01)


def test_a_step_prefills_no_more_than_the_workers_step_tokens():
    """A worker prefills a long prompt in chunks of its step's token budget (max_num_batched_tokens, sent in its
    hello): a job sent meanwhile starts after the chunk in progress, not after the whole prompt."""
    huge = Held(Work(P2, 8000, 100), WAITING, BY_P0)  # 8 s of prefill at 1000 tokens/s, in chunks of 1,024
    chunked = WorkerView(2, RATES, [running(P3, 300, BY_P0_P1), huge], handoff_s=0.05, step_tokens=1024)
    assert wait_s(P0, [chunked], []) == pytest.approx(1.024)
    under_way = WorkerView(2, RATES, [running(P3, 300, BY_P0_P1), running(P2, 100, BY_P0, prefill=600)],
                           handoff_s=0.05, step_tokens=1024)
    assert wait_s(P0, [under_way], []) == pytest.approx(0.6)  # its last chunk: what is left of the prompt
    # A worker that does not say (an older one) is taken to prefill the whole prompt in one step.
    unsaid = WorkerView(2, RATES, [running(P3, 300, BY_P0_P1), huge], handoff_s=0.05)
    assert wait_s(P0, [unsaid], []) == pytest.approx(8.0)
