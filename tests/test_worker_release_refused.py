"""A draining worker's hand-back (JobReleased) that every gateway socket refused is due again at once.

worker/drain.py recorded each hand-back as sent whatever its sockets said: one refused by every socket (a full send
queue: its gateways down or not reading) waited out the resend interval before its next try, and its job waited
with it. It is now recorded as sent only if a socket took it, as a refused completion already is
(worker/service.py ``_finish``). Real WorkerService on the tiny model, its own ZeroMQ sockets: one connected to a
port nobody listens on (a gateway that is down) queues frames until its high-water mark, then refuses.
"""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from common import protocol as P


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _fill(sock: zmq.Socket) -> int:
    """Queue frames on ``sock`` until it refuses one; how many it took."""
    for n in range(1_000_000):
        try:
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            return n
    raise AssertionError("the socket never refused a frame")


@pytest.fixture
def service(tiny_model_dir, request):
    """A WorkerService whose first gateway is a live ROUTER (when the test asks for one) and the rest are down,
    each down one's send queue full; its clock stands still while ``frozen[0]`` is set."""
    from worker import Engine, EngineConfig
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    live = request.param
    router = zmq.Context.instance().socket(zmq.ROUTER) if live else None
    endpoints = [_dead_endpoint(), _dead_endpoint()]
    if router is not None:
        endpoints[0] = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    frozen: list[float | None] = [None]
    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_num_seqs=2))
    svc = WorkerService(WorkerConfig(gateways=endpoints, model="tiny", worker_id="wk-refused"), engine,
                        clock=lambda: time.monotonic() if frozen[0] is None else frozen[0])
    try:
        svc.connect()
        for sock in svc.sockets[1 if live else 0:]:
            assert _fill(sock) > 0
        yield svc, frozen, live
    finally:
        svc.close()
        if router is not None:
            router.close(linger=0)


@pytest.mark.parametrize("service", [False], indirect=True)
def test_a_hand_back_every_socket_refused_is_due_again_at_once(service):
    svc, frozen, _ = service
    frozen[0] = svc.clock()
    dropped = svc.counters["send_dropped"]
    svc._release({"job-a": 3}, "draining: not started")
    assert svc.counters["send_dropped"] - dropped == 2  # both gateways refused it
    due = svc.unconfirmed_releases.due(frozen[0])
    assert [(m.job_id, m.attempt, m.reason) for m, _ in due] == [("job-a", 3, "draining: not started")]
    # The next pass of the loop tries it again (and, both still refusing, again REFUSED_RETRY_S after).
    svc._resend_unconfirmed()
    assert svc.counters["send_dropped"] - dropped >= 4
    assert (svc.unconfirmed_releases.resent, svc.unconfirmed_releases.refused) == (0, 1)  # refused: no copy went
    assert len(svc.unconfirmed_releases) == 1  # kept until a gateway confirms it


@pytest.mark.parametrize("service", [True], indirect=True)
def test_a_hand_back_one_socket_took_waits_for_the_resend_interval(service):
    svc, frozen, _ = service
    frozen[0] = svc.clock()
    dropped = svc.counters["send_dropped"]
    svc._release({"job-a": 3}, "draining: not started")
    assert svc.counters["send_dropped"] - dropped == 1  # the down gateway refused it, the live one took it
    assert svc.unconfirmed_releases.due(frozen[0]) == []
    assert len(svc.unconfirmed_releases) == 1
    resend = svc.unconfirmed_releases.resend_s
    assert [m.job_id for m, _ in svc.unconfirmed_releases.due(frozen[0] + resend)] == ["job-a"]
