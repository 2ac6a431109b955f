"""A completion whose resend every gateway socket refused is tried again soon, not a resend interval later.

worker/redelivery.py recorded each resent copy as sent whatever its sockets said: refused by every one (full send
queues: its gateways down or restarting), it waited out the whole resend interval (1 s) before its next try, and its
client with it, though the gateway came back long before. Nor may it be tried at every pass of the loop (20 ms) while
the queues stay full. Real WorkerService on the tiny model, a gateway built as `python -m gateway` builds it on a
real redis-server, coming up on the port the worker already connects to; the worker's clock is the test's, so "soon"
and "a resend interval" are exact.

And ts_unconfirmed_completions_total{event="resent"} counts the copies a socket took, not the tries every one refused:
counted when a completion fell due, before it was offered, the refused-retry counted some ten "resent" a second for one
that never left the worker. There a real ROUTER, bound where the worker connects, counts what arrives.
"""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq
from prometheus_client import REGISTRY

from common import protocol as P
from common.tiers import Tier
from tests.cluster_helpers import wait_for
from tests.gateway_helpers import built_gateway

WORKER = "wk-resend"


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def refusing(tiny_model_dir):
    """(a WorkerService on the tiny model whose one gateway is down and whose send queue to it is full, the clock it
    reads (a list the test moves), the endpoint it connects to): nobody listens there yet."""
    from worker import Engine, EngineConfig
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    endpoint = _free_endpoint()
    now = [time.monotonic()]
    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_num_seqs=2))
    svc = WorkerService(WorkerConfig(gateways=[endpoint], model="tiny", worker_id=WORKER), engine, clock=lambda: now[0])
    (sock,) = svc.sockets
    sock.setsockopt(zmq.SNDHWM, 8)  # a full queue is a full queue whatever its size; a small one fills at once
    try:
        svc.connect()  # its hello waits in the queue
        hello = P.WorkerHello(WORKER, "tiny", engine.vocab_size, engine.max_model_len, 2, engine.blocks.num_blocks)
        for _ in range(1000):
            if not svc._send(sock, hello):
                break
        else:
            raise AssertionError("the socket never refused a frame")
        yield svc, now, endpoint
    finally:
        svc.close()


def test_a_resent_completion_every_socket_refused_goes_again_soon_once_the_gateway_reads(tmp_path, refusing):
    from worker.completions import REFUSED_RETRY_S

    svc, now, endpoint = refusing
    (sock,) = svc.sockets
    dropped = svc.counters["send_dropped"]
    finished = P.JobFinished("job-x", 1, "done", "length", 2, 0.0, 0.1, 0, token_ids=[7, 8])
    svc._finish(sock, finished)  # refused: due at the next pass
    t0 = now[0]
    svc._resend_unconfirmed()  # refused again, the hello before it too
    assert svc.counters["send_dropped"] - dropped == 3
    assert len(svc.unconfirmed) == 1
    assert svc.unconfirmed.due(t0 + 0.02) == [], "tried again at every pass of the loop while the queue is full"
    assert REFUSED_RETRY_S <= 0.2 < svc.unconfirmed.resend_s

    with built_gateway(tmp_path, "resend", worker_bind=endpoint) as (gw, _, _):
        gw.queue.admit(job_id="job-x", tenant="lab-co", tier_requested=Tier.P3, tier=Tier.P3,
                       payload=msgpack.packb({"prompt_token_ids": [5, 6], "max_tokens": 2}),
                       idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
        (rec,) = gw.queue.claim(["job-x"], worker=WORKER, gateway="gw-other", lease_ms=600_000)
        assert rec.attempt == 1
        # The worker connects by itself, and the gateway reads what its queue held: room again.
        wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers), WORKER in gw.workers.workers)[1], 10,
                 "the gateway to read the worker's queued hellos")
        wait_for(lambda: sock.poll(0, zmq.POLLOUT), 10, "room in the worker's send queue")

        now[0] = t0 + 0.2  # well within the resend interval (1 s) of the refused copy
        svc._resend_unconfirmed()
        try:
            wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers),
                              gw.queue.get("job-x").state == "done")[1], 5, "the completion stored")
        except AssertionError:
            raise AssertionError("the completion every socket refused was not sent again 0.2 s later") from None
        wait_for(lambda: (svc._drain(sock), len(svc.unconfirmed) == 0)[1], 10, "the gateway's confirmation")

        stored = gw.queue.get("job-x")
        assert msgpack.unpackb(stored.result["token_ids"]) == [7, 8]
        assert gw.counters["stale_frames"] == 0  # one copy came, and was stored: no second one
        assert gw.counters["malformed"] == 0
        # The pass after the first refusal was refused too; the one 0.2 s later was taken.
        assert (svc.unconfirmed.resent, svc.unconfirmed.refused) == (1, 1)
        assert svc.unconfirmed.due(t0 + 5.0) == []


def _counted(event: str) -> float:
    return REGISTRY.get_sample_value("ts_unconfirmed_completions_total", {"event": event}) or 0.0


def test_resent_counts_copies_a_socket_took_and_refused_counts_the_rest(refusing):
    from worker.completions import REFUSED_RETRY_S

    svc, now, endpoint = refusing
    (sock,) = svc.sockets
    retries = 10
    peer = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        resent0, refused0, given_up0 = _counted("resent"), _counted("refused"), _counted("given_up")
        svc._finish(sock, P.JobFinished("job-x", 1, "done", "length", 2, 0.0, 0.1, 0, token_ids=[7, 8]))  # refused
        svc._resend_unconfirmed()  # the pass after: refused by every socket too
        for _ in range(retries):  # a second of the gateways down: one retry every REFUSED_RETRY_S
            now[0] += REFUSED_RETRY_S
            svc._resend_unconfirmed()
        assert len(svc.unconfirmed) == 1
        assert _counted("resent") - resent0 == 0, "copies no socket took counted as resent"
        assert _counted("refused") - refused0 == retries + 1
        assert (svc.unconfirmed.resent, svc.unconfirmed.refused) == (0, retries + 1)

        peer.bind(endpoint)  # a gateway reads again: the queue drains into it
        wait_for(lambda: sock.poll(0, zmq.POLLOUT), 10, "room in the worker's send queue")
        now[0] += REFUSED_RETRY_S
        svc._resend_unconfirmed()
        finished = []

        def read() -> bool:
            while peer.poll(0):
                msg = P.decode(peer.recv_multipart()[-1])
                if isinstance(msg, P.JobFinished):
                    finished.append(msg.job_id)
            return bool(finished)

        wait_for(read, 10, "the completion at the peer")
        assert not sock.poll(0, zmq.POLLIN)  # nothing answered: it stays unconfirmed, due a resend interval later
        assert svc.unconfirmed.due(now[0] + svc.unconfirmed.resend_s / 2) == []
        read()
        assert finished == ["job-x"]  # one copy left the worker, and one is counted
        assert _counted("resent") - resent0 == 1
        assert _counted("refused") - refused0 == retries + 1
        assert _counted("given_up") - given_up0 == 0
        assert (svc.unconfirmed.resent, svc.unconfirmed.refused) == (1, retries + 1)
    finally:
        peer.close(linger=0)
