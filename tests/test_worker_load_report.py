"""The victims a worker's load report offers urgent tiers while an urgent job it was just sent waits for the step
that starts it (worker/load_report.py). Real engine (tiny model) and WorkerService; the report is the one the
heartbeat thread would send."""

from __future__ import annotations

import pytest

from worker import Engine, EngineConfig
from worker.request import SamplingParams


def report(service):
    service._refresh_snapshot(0.0)
    return service._snapshot


@pytest.mark.parametrize("reserve", [0, 1])
def test_an_urgent_job_starting_in_a_free_slot_claims_no_victim(tiny_model_dir, reserve):
    """A P0 sent to a free slot was counted as taking a victim too: the report before its first step offered no
    victim though the P3 beside it ran on, preemptable, and a second P0 waited in Redis for a step (a long prompt's
    chunk: seconds) until the next report."""
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, p0_reserve_slots=reserve))
    service = WorkerService(WorkerConfig(worker_id="wk-v", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        engine.add_request("p3", [5, 6, 7], SamplingParams(max_tokens=50), tier="P3")
        engine.step()
        engine.add_request("p0", [5, 6, 7], SamplingParams(max_tokens=50), tier="P0")
        before = report(service)
        assert before.free_slots == 0
        engine.step()
        assert sorted(r.request_id for r in engine.scheduler.running) == ["p0", "p3"]  # nothing was preempted
        after = report(service)
        assert after.victims["P0"] == after.victims["P1"] == 1
        assert before.victims == after.victims  # as the report before the step said
    finally:
        service.close()


def test_an_urgent_job_with_no_free_slot_still_claims_its_victim(tiny_model_dir):
    """The other side of the rule (the over-dispatch it guards against): with every slot running, a P0 not yet
    started takes one of the P3s, so only the other is offered."""
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, p0_reserve_slots=0))
    service = WorkerService(WorkerConfig(worker_id="wk-w", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        for i in range(2):
            engine.add_request(f"p3-{i}", [5, 6, 7], SamplingParams(max_tokens=50), tier="P3")
        engine.step()
        engine.add_request("p0", [5, 6, 7], SamplingParams(max_tokens=50), tier="P0")
        assert report(service).victims["P0"] == 1
    finally:
        service.close()
