"""ts_unconfirmed_completions_total{event="resent"} counts copies a gateway socket took, not tries every one refused.

The count was taken when a completion fell due, before it was offered: while every gateway socket refused (full send
queues, the gateways down), the refused-retry (REFUSED_RETRY_S, 0.1 s) counted about ten "resent" a second for one
completion that never left the worker. Real WorkerService on the tiny model, its real DEALER socket filled while
nobody listens, then a real ROUTER bound where it connects, which counts the completions that arrive; the worker's
clock is the test's, so every pass is one retry.
"""

from __future__ import annotations

import socket
import time

import zmq
from prometheus_client import REGISTRY

from common import protocol as P
from tests.cluster_helpers import wait_for

WORKER = "wk-resend-counts"
RETRIES = 10


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _counted(event: str) -> float:
    return REGISTRY.get_sample_value("ts_unconfirmed_completions_total", {"event": event}) or 0.0


def test_resent_counts_copies_taken_and_refused_counts_the_rest(tiny_model_dir):
    from worker import Engine, EngineConfig
    from worker.completions import REFUSED_RETRY_S
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    endpoint = _free_endpoint()  # nobody listens yet
    now = [time.monotonic()]
    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_num_seqs=2))
    svc = WorkerService(WorkerConfig(gateways=[endpoint], model="tiny", worker_id=WORKER), engine, clock=lambda: now[0])
    (sock,) = svc.sockets
    sock.setsockopt(zmq.SNDHWM, 8)
    peer = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        svc.connect()
        hello = P.WorkerHello(WORKER, "tiny", engine.vocab_size, engine.max_model_len, 2, engine.blocks.num_blocks)
        for _ in range(1000):
            if not svc._send(sock, hello):
                break
        else:
            raise AssertionError("the socket never refused a frame")
        resent0, refused0, given_up0 = _counted("resent"), _counted("refused"), _counted("given_up")
        svc._finish(sock, P.JobFinished("job-x", 1, "done", "length", 2, 0.0, 0.1, 0, token_ids=[7, 8]))  # refused
        svc._resend_unconfirmed()  # the pass after: refused by every socket too
        for _ in range(RETRIES):  # a second of the gateways down: one retry every REFUSED_RETRY_S
            now[0] += REFUSED_RETRY_S
            svc._resend_unconfirmed()
        assert len(svc.unconfirmed) == 1
        assert _counted("resent") - resent0 == 0, "copies no socket took counted as resent"
        assert _counted("refused") - refused0 == RETRIES + 1
        assert (svc.unconfirmed.resent, svc.unconfirmed.refused) == (0, RETRIES + 1)

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
        assert _counted("refused") - refused0 == RETRIES + 1
        assert _counted("given_up") - given_up0 == 0
        assert (svc.unconfirmed.resent, svc.unconfirmed.refused) == (1, RETRIES + 1)
    finally:
        svc.close()
        peer.close(linger=0)
