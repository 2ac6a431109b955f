"""A worker told to cancel a job reports the slot it freed at once, as it does a finished job's.

A real WorkerService (bench model, real ZeroMQ) facing a gateway socket the test drives (tests/test_worker_drain),
with heartbeats far apart, so a report that comes is one the step loop sent, not the heartbeat's.
"""

from __future__ import annotations

import threading
import time

import pytest

from common import protocol as P
from tests.test_worker_drain import FakeGateway, is_

HEARTBEAT_S = 6.0


@pytest.fixture
def slow_beating_worker(bench_model_dir):
    from worker import Engine, EngineConfig
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    gateway = FakeGateway()
    engine = Engine.from_pretrained(str(bench_model_dir), EngineConfig(max_num_seqs=2, p0_reserve_slots=0))
    service = WorkerService(WorkerConfig(worker_id="wk-cancel", gateways=[f"tcp://127.0.0.1:{gateway.port}"],
                                         model="bench", heartbeat_interval_s=HEARTBEAT_S), engine)
    service.connect()
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    gateway.receive(is_(P.WorkerHello))
    try:
        yield service, gateway
    finally:
        stop.set()
        thread.join(30)
        service.close()
        gateway.close()


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
