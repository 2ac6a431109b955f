"""A worker told to cancel a job reports the slot it freed at once, as it does a finished job's.

A real WorkerService (bench model, real ZeroMQ) facing a gateway socket the test drives (tests/test_worker_drain),
with heartbeats far apart, so a report that comes is one the step loop sent, not the heartbeat's.
"""

from __future__ import annotations

import time

import pytest

from common import protocol as P
from tests.test_worker_drain import FakeGateway, is_, serving_worker

HEARTBEAT_S = 6.0


@pytest.fixture
def slow_beating_worker(bench_model_dir):
    gateway = FakeGateway()
    with serving_worker(bench_model_dir, [gateway], worker_id="wk-cancel", heartbeat_interval_s=HEARTBEAT_S) as (
            service, _):
        yield service, gateway


def test_a_cancelled_jobs_slot_is_offered_in_the_next_report_not_a_heartbeat_later(slow_beating_worker):
    """The cancel freed the slot but asked for no report: the gateways counted it busy (and the job held) until the
    next heartbeat, half a second by default, while queued work waited for a slot that was free."""
    service, gateway = slow_beating_worker
    gateway.dispatch("a", 600)
    gateway.dispatch("b", 600)
    gateway.receive(lambda m: isinstance(m, P.WorkerLoad) and m.free_slots == 0 and sorted(m.job_ids) == ["a", "b"]
                    and m.running["P2"] == 2)
    for job, free in (("a", 1), ("b", 2)):  # one beside a running job, then the last: the engine goes idle
        gateway.sock.send_multipart([gateway.ident, P.encode(P.CancelJob(job, 1))])
        sent = time.monotonic()
        report = gateway.receive(lambda m: isinstance(m, P.WorkerLoad) and job not in m.job_ids, timeout_s=10)
        assert time.monotonic() - sent < HEARTBEAT_S / 3, f"the cancel of {job} was reported by a heartbeat"
        assert report.free_slots == free
    assert not service.jobs
    assert service.engine.kv_usage().num_used == 0
    assert not [m for _, m in gateway.seen if isinstance(m, P.JobFinished)]
