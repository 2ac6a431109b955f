"""Batch slots only P0 may use (issue 10 item 5): a P0 never waits for a slot behind work it may not preempt.

With the default matrix P0 may not preempt P1, so when P0 and P1 work together fill the batch a new P0
waits for one of them to finish: its time to first token then depends on how long they run. A reserve
of slots caps what P1..P3 may hold, so while fewer P0s than the reserve run, a new one starts at once.
"""

from __future__ import annotations

import pytest

from common.tiers import Tier
from tests.scheduler_helpers import req, step
from worker import Engine, EngineConfig, SamplingParams
from worker.block_manager import BlockManager
from worker.config import ConfigError, SchedulerConfig
from worker.policy import FifoPolicy, PriorityPolicy
from worker.preemption import DeclineReason, PreemptionConfig
from worker.request import RequestStatus
from worker.scheduler import Scheduler
from worker.simulator import Arrival, random_case, run_case, simulate


def sched(reserve: int, max_num_seqs: int = 4, policy=None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=4096,
                                     p0_reserve_slots=reserve),
                     BlockManager(256, 16), policy or PriorityPolicy(), PreemptionConfig(bytes_per_block=1))


@pytest.mark.parametrize("reserve", [0, 1])
def test_a_p0_behind_a_batch_of_p1s_starts_at_once_only_with_a_reserved_slot(reserve):
    s = sched(reserve)
    p1s = [req(f"p1-{i}", Tier.P1, max_tokens=40) for i in range(6)]
    for r in p1s:
        s.add(r)
    step(s), step(s)
    assert sum(r.status is RequestStatus.RUNNING for r in p1s) == 4 - reserve
    p0 = req("p0", Tier.P0, max_tokens=4)
    s.add(p0)
    out = step(s)
    if reserve:
        assert p0.status is RequestStatus.RUNNING and p0.num_computed_tokens == 8
        assert not out.decisions and not out.preempted  # the slot was free: nothing gave way
    else:  # the case the reserve is for: nothing P0 may preempt, so it waits for a P1 to finish
        assert p0.status is RequestStatus.WAITING
        assert [d.declined_reason for d in out.decisions] == [DeclineReason.NO_LOWER_TIER]


def test_the_lower_tiers_never_hold_a_reserved_slot_yet_all_finish():
    s = sched(2, max_num_seqs=5)
    reqs = [req(f"{t.value}-{i}", t, max_tokens=6 + i) for i in range(4) for t in (Tier.P1, Tier.P2, Tier.P3)]
    reqs += [req(f"P0-{i}", Tier.P0, max_tokens=3) for i in range(6)]
    for r in reqs:
        s.add(r)
    most_p0 = 0
    while s.has_unfinished():
        step(s)
        assert sum(r.tier is not Tier.P0 for r in s.running) <= 3
        most_p0 = max(most_p0, sum(r.tier is Tier.P0 for r in s.running))
    assert most_p0 == 5  # P0 may use every slot, reserved or not
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)


def test_a_p1_preempting_a_p3_for_a_slot_still_leaves_the_reserve_free():
    s = sched(1, max_num_seqs=3)
    p3s = [req(f"p3-{i}", Tier.P3, max_tokens=50) for i in range(2)]
    for r in p3s:
        s.add(r)
    step(s)
    p1s = [req(f"p1-{i}", Tier.P1, max_tokens=20) for i in range(2)]
    for r in p1s:
        s.add(r)
    out = step(s)
    assert [r.request_id for r in out.preempted] and len(s.running) == 2  # one slot still free for P0
    assert {r.tier for r in s.running} <= {Tier.P1, Tier.P3}


def test_fifo_keeps_the_reserve_too():
    s = sched(1, max_num_seqs=2, policy=FifoPolicy())
    a, b, p0 = req("a", Tier.P3, max_tokens=10), req("b", Tier.P3, max_tokens=10), req("p0", Tier.P0, max_tokens=2)
    s.add(a), s.add(b), s.add(p0)
    step(s)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert p0.status is RequestStatus.WAITING  # strict admission order: it is behind b


@pytest.mark.parametrize("reserve, seqs", [(-1, 4), (4, 4), (9, 4)])
def test_a_reserve_that_leaves_the_other_tiers_no_slot_is_a_config_error(reserve, seqs):
    with pytest.raises(ConfigError, match="p0_reserve_slots"):
        SchedulerConfig(max_num_seqs=seqs, p0_reserve_slots=reserve).validate()
    with pytest.raises(ConfigError, match="p0_reserve_slots"):
        EngineConfig(max_num_seqs=seqs, p0_reserve_slots=reserve).validate()


def test_the_simulator_checks_the_reserve_and_its_random_cases_use_it():
    import random

    arrivals = [Arrival(f"p1-{i}", 0.0, 8, 16, Tier.P1) for i in range(6)]
    arrivals += [Arrival(f"p0-{i}", 0.001 * i, 8, 4, Tier.P0) for i in range(3)]
    res = simulate(arrivals, num_blocks=64, block_size=16, preemption=PreemptionConfig(bytes_per_block=1),
                   sched=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096,
                                         p0_reserve_slots=2))
    assert res.violations == [] and len(res.finished) == len(arrivals)
    rng = random.Random(7)
    cases = [random_case(rng) for _ in range(300)]
    assert any(c.sched.p0_reserve_slots for c in cases)
    for c in cases:
        assert run_case(c).violations == []


def test_the_simulator_reports_a_breached_reserve(monkeypatch):
    # A checker that cannot fail proves nothing: let non-P0 work take every slot and it must say so.
    monkeypatch.setattr(Scheduler, "_low_slots_free", lambda self: self.config.max_num_seqs - len(self.running))
    arrivals = [Arrival(f"p3-{i}", 0.0, 8, 8, Tier.P3) for i in range(4)]
    res = simulate(arrivals, num_blocks=64, block_size=16, preemption=PreemptionConfig(bytes_per_block=1),
                   sched=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096,
                                         p0_reserve_slots=1))
    assert any("P0 slot reserve breached" in v for v in res.violations), res.violations


def test_the_engine_takes_the_reserve_from_its_config(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=3, p0_reserve_slots=1))
    for i in range(3):
        engine.add_request(f"p3-{i}", [5, 6, 7], SamplingParams(max_tokens=4), tier="P3")
    engine.step()
    assert len(engine.scheduler.running) == 2
    engine.add_request("p0", [5, 6, 7], SamplingParams(max_tokens=2), tier="P0")
    engine.step()
    assert engine.get_request("p0").status is RequestStatus.RUNNING and len(engine.scheduler.running) == 3


def test_the_load_report_offers_the_reserved_slots_to_p0_alone(tiny_model_dir):
    # A gateway sends P1..P3 jobs on free_slots and P0 jobs on victims too: a reserved slot counted as free
    # would let it send a P3 that then waits inside the worker, outside Redis.
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=4, p0_reserve_slots=1))
    service = WorkerService(WorkerConfig(worker_id="wk-r", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        for i in range(2):
            engine.add_request(f"p3-{i}", [5, 6, 7], SamplingParams(max_tokens=8), tier="P3")
        engine.step()
        service._refresh_snapshot(0.0)
        load = service._snapshot
        assert load.free_slots == 1 and load.victims["P0"] == 2 + 1 and load.victims["P1"] == 2
        engine.add_request("p3-2", [5, 6, 7], SamplingParams(max_tokens=8), tier="P3")
        engine.step()
        service._refresh_snapshot(0.0)
        load = service._snapshot
        assert load.free_slots == 0 and load.victims["P0"] == 3 + 1 and load.victims["P2"] == 0
    finally:
        service.close()


@pytest.mark.parametrize("reserve", [0, 1, 2])
def test_next_to_start_names_what_the_next_step_starts_where_slots_are_the_limit(reserve):
    # Random mixes of running and waiting work with KV and budget to spare: the requests the next step starts
    # are those next_to_start() named before it, in its order, whatever the tiers, the reserve and the slots
    # (and where urgent work preempts besides, those and more).
    import random

    rng = random.Random(reserve)
    for case in range(200):
        # Every waiting prompt fits the step's budget and the pool.
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=4096,
                                      p0_reserve_slots=reserve),
                      BlockManager(1024, 16), PriorityPolicy(), PreemptionConfig(bytes_per_block=1))
        for i in range(rng.randint(0, 4)):
            s.add(req(f"r{case}-{i}", rng.choice(list(Tier)), prompt=rng.randint(1, 20)))
        step(s)
        for i in range(rng.randint(0, 5)):
            s.add(req(f"w{case}-{i}", rng.choice(list(Tier)), prompt=rng.randint(1, 20)))
        named = [r.request_id for r in s.next_to_start()]
        waiting = {r.request_id for r in s.waiting}
        out = s.schedule()
        started = [c.request.request_id for c in out.chunks if c.request.request_id in waiting]
        if out.preempted:  # urgent work took running slots besides: what had a free slot started too
            assert set(named) <= set(started), (case, named, started)
        else:
            assert started == named, (case, named, started)


def test_a_job_reported_before_the_step_that_starts_it_is_already_a_victim(tiny_model_dir):
    # A worker reports a job it was just sent before the step that starts it. For that step it runs: an urgent
    # job sent now preempts it at the next step, so the report counts it as a victim for P0 and P1 (not for a
    # tier that may not preempt it, and not where the P0 slot reserve keeps it from starting).
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    for reserve, p1_victims in ((0, 1), (1, 0)):
        engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, p0_reserve_slots=reserve))
        service = WorkerService(WorkerConfig(worker_id="wk-v", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
        try:
            engine.add_request("p2", [5, 6, 7], SamplingParams(max_tokens=8), tier="P2")
            engine.step()
            engine.add_request("p3", [5, 6, 7], SamplingParams(max_tokens=8), tier="P3")
            service._refresh_snapshot(0.0)
            load = service._snapshot
            assert load.waiting["P3"] == 1 and load.victims["P1"] == p1_victims
            assert load.victims["P0"] == 1 + p1_victims  # the P2, and the P3 where it starts
            engine.step()
            assert (engine.get_request("p3").status is RequestStatus.RUNNING) == bool(p1_victims)
            service._refresh_snapshot(0.0)
            assert service._snapshot.victims["P1"] == p1_victims  # as the report before the step said
            if p1_victims:
                # Suspended, it resumes at the next step, but then its residency protects it: no victim yet.
                from worker.preemption import PreemptMode

                engine.scheduler.suspend(engine.get_request("p3"), PreemptMode.KEEP)
                assert [r.request_id for r in engine.scheduler.next_to_start()] == ["p3"]
                service._refresh_snapshot(0.0)
                assert service._snapshot.victims["P1"] == 0
        finally:
            service.close()
